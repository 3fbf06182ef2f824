r"""Fuzzy logic: in-context regression of max-of-min functions (SPEC §4).

A task is ``y = max over num_terms conjunctions (min over literals x_i or 1 − x_i)`` of
``n`` variables in [0, 1]; a sequence shows ``seq_len − 1`` examples ``[x, y]`` of one task and a
query ``[x, 0]`` whose ``y`` the model predicts (squared error). Splits: ``train``/``validation``
(train term sets), ``test`` (unseen combinations of seen conjunctions), ``ood`` (term sets with a
held-out conjunction). Metric: ``r2`` (R² against each task's exact target variance; the
``selected/`` values come from the checkpoint with the best validation R²).

Arguments (``--config=configs/logic.py:key=value,...``):
  preset: 'reference' (SPEC §4) or 'cpu' (smaller model, fewer steps; same task family).
  attention: any name of ``primal_dual.layers.ATTENTION_REGISTRY``.
  seed: model initialisation and data order. steps: -1 = the preset's.
  runlocal: a tiny model and a few steps, for smoke tests.

Presets
-------
``reference`` — SPEC §4: n = 4, 2 terms, seq_len 16, the last 25% of the 16 conjunctions (4)
held out; model d 128, 8 heads, 2 layers (MLP 256, pre-LN, per-head relative position bias, no
causal mask). The optimizer and length are not given by the SPEC; we use the sRAVEN recipe
(batch 128, AdamW lr 1e-3, 1000 warm-up steps, cosine to 1e-4, weight decay 0.1 on non-vector
parameters) for 20k steps::

  python train.py --config=configs/logic.py:preset=reference,attention=hyla \
      --workdir=workdirs/logic_reference_hyla

``cpu`` — the same task family; model d 64, 8 heads of 8, 2 layers, MLP 128, batch 64, 6000
steps (500 warm-up, cosine to 1e-4), same optimizer::

  python train.py --config=configs/logic.py:preset=cpu,attention=hyla --workdir=workdirs/logic_hyla

Measured (one softmax run of this preset, stopped by a 6-minute limit at step ≈5300, on this
2-core CPU under a load average of 6-8 from other jobs: 14-16 steps/s; R² on 1024 sequences per
split): step 500: validation 0.32, test 0.27, OOD −0.04; 1000: 0.50, 0.45, 0.27; 2500: 0.63,
0.60, 0.20; 5000: 0.72, 0.67, 0.25. It learns the seen term sets and generalises to unseen
combinations of seen conjunctions; held-out conjunctions stay hard (OOD R² 0.2-0.35). A full run
takes ≈ 7 min (softmax) at that speed; HYLA's step costs about 3× softmax's on this CPU.
"""

from configs.sraven import VARIANT_OPTIONS, apply_runlocal, exact_offset_buckets
from primal_dual.training import config_lib

TASK_FAMILY = dict(num_variables=4, num_terms=2, seq_len=16, ood_fraction=0.25, split_seed=0,
                   test_fraction=0.5, ood_term_sets="any_held_out", stream_seed=0, num_train=0,
                   materialize_train=True, chunk_size=8192)

REFERENCE = dict(
    data=dict(TASK_FAMILY, num_validation=4096, num_test=4096, num_ood=4096),
    model=dict(num_layers=2, model_dim=128, num_heads=8, mlp_dim=256, dropout_rate=0.0),
    batch_size=128, eval_batch_size=512, num_train_steps=20_000, warmup_steps=1000,
    lr=1e-3, end_lr=1e-4, weight_decay=0.1, log_every_steps=200, eval_every_steps=1000,
    checkpoint_every_steps=2000)

CPU = dict(
    data=dict(TASK_FAMILY, num_validation=2048, num_test=2048, num_ood=2048),
    model=dict(num_layers=2, model_dim=64, num_heads=8, mlp_dim=128, dropout_rate=0.0),
    batch_size=64, eval_batch_size=512, num_train_steps=6000, warmup_steps=300,
    lr=1e-3, end_lr=1e-4, weight_decay=0.1, log_every_steps=100, eval_every_steps=500,
    checkpoint_every_steps=1000)

PRESETS = {"reference": REFERENCE, "cpu": CPU}


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, preset="cpu", attention="softmax", seed=0, steps=-1,
                             runlocal=False)
  if arg.preset not in PRESETS:
    raise ValueError(f"unknown logic preset {arg.preset!r}; choose one of {sorted(PRESETS)}")
  preset = PRESETS[arg.preset]

  config = config_lib.training_defaults()
  config.task = "logic"
  config.seed = arg.seed
  config.data = dict(preset["data"])
  config.model = dict(preset["model"], **exact_offset_buckets(config.data.seq_len),
                      attention=arg.attention, attention_options={})
  config.batch_size = preset["batch_size"]
  config.eval_batch_size = preset["eval_batch_size"]
  config.num_train_steps = preset["num_train_steps"] if arg.steps < 0 else arg.steps
  config.optimizer.update(name="adamw", lr=preset["lr"], schedule="warmup_cosine",
                          warmup_steps=preset["warmup_steps"], end_lr=preset["end_lr"],
                          weight_decay=preset["weight_decay"])
  config.log_every_steps = preset["log_every_steps"]
  config.eval_every_steps = preset["eval_every_steps"]
  config.checkpoint_every_steps = preset["checkpoint_every_steps"]
  config.selection.split = "validation"
  config.selection.metric = "r2"
  config.selection.mode = "max"
  if arg.runlocal:
    apply_runlocal(config)
  if arg.attention in VARIANT_OPTIONS:
    config.model.attention_options = VARIANT_OPTIONS[arg.attention](config.model.num_heads)
  return config_lib.lock(config)
