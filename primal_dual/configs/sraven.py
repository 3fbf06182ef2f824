r"""Symbolic Raven (sRAVEN): compositional generalisation of HYLA, softmax and linear attention.

Arguments (``--config=primal_dual/configs/sraven.py:key=value,...``):
  preset: 'paper' (the HYLA paper's code, for an accelerator) or 'cpu' (a smaller problem and
    model of the same structure, for a 2-core CPU), see ``PRESETS``.
  attention: any name of ``primal_dual.layers.ATTENTION_REGISTRY`` (softmax, linear_plain, hyla,
    hyla_no_relu, hyla_no_norm, ...; ``docs/maths.md`` lists the paper's Table A1 rows).
    Kernels that cannot take the model's relative-position bias (random_feature) fail when the
    model is built.
  seed: model initialisation, data order and dropout; under ``held_out=per_seed`` (the ``paper``
    preset's rule) also the held-out rule combinations, under ``held_out=fixed`` (the ``cpu``
    preset's) not: runs then differ only in the model.
  steps: training steps; -1 = the preset's. The train stream holds ``steps × batch`` problems, so
    no training problem repeats.
  end_lr: the schedule's end rate, a rule of ``END_LR_RULES``: 'relative' (0.1 × lr, the paper's
    code; the ``paper`` preset's) or 'absolute' (1e-4 whatever lr; the ``cpu`` preset's, and the
    ``paper`` preset's before). '' = the preset's.
  held_out: the held-out split, a rule of ``HELD_OUT_RULES``: 'per_seed' (drawn from the run's
    seed, ``data.split_seed = -1``, the paper's code; the ``paper`` preset's) or 'fixed' (split
    seed 0 for every seed; the ``cpu`` preset's, and the ``paper`` preset's before). '' = the
    preset's. Under 'per_seed' the seeds of a sweep (``config.sweep.seed``) keep each its own
    held-out split in one program.
  runlocal: a tiny model and a few steps, for smoke tests.
  bf16: bfloat16 compute, float32 parameters (``--config.model.dtype=bfloat16``); the presets are
    float32, as the paper's code. With the presets' attention-weight dropout, training keeps the
    kernels' own attention (``jax.nn.dot_product_attention``, cuDNN's path, takes no dropout).

Presets
-------
``paper`` — the setup of the paper's code (``configs/raven.py`` and ``run.py`` of Schug et al.):
F = 4 features, V = 8 values, the 8 rules, feature slots shuffled per column, 25% of the 330 rule
multisets (82) held out for ``ood``, drawn per seed (``held_out=per_seed``). Model (402,824 parameters): input Dense 8→128, 4 pre-LN
blocks, MLP 128→256→128 (gelu, lecun_normal kernels), 16 heads of q/k/v width 64 in total (head
size 4), attention-weight dropout 0.1 in training, per layer a T5 relative-position table
(heads × 36 buckets, unidirectional, ``num_buckets = max_distance = 36``, Flax's
default_embed_init), final LN, read-out 128→8 at the last 4 positions, no causal mask. Batch 128,
AdamW lr 1e-3 (b1 0.9, b2 0.999, eps 1e-8), weight decay 0.1 on non-vector parameters, warm-up
1000 steps from 0, cosine to 0.1 × lr (``end_lr=relative``: 1e-4 at lr 1e-3) reached at step
155,250 (optax ``decay_steps = total − warm-up``) and held, 156,250 steps (20M problems). The
paper's protocol sweeps lr × weight decay (× warm-up for softmax) over seeds 0, 1, 2 and keeps the
best setting per model: ``reproduce/sraven.py --protocol=paper_sweep``; ``docs/reproduction.md``
compares this preset with the paper's code line by line. Test and OOD: 51,200 problems each, as the
paper's code; ``validation`` (4,096 problems, in distribution, its own stream) is this library's
addition for checkpoint selection. A job for an accelerator::

  python train.py --config=primal_dual/configs/sraven.py:preset=paper,attention=hyla \
      --workdir=workdirs/sraven_paper_hyla

``cpu`` — the same model structure (q/k/v width apart from the model width with head size 4,
unidirectional buckets over the 27 tokens, attention dropout 0.1, lecun_normal MLP) at a size a
2-core CPU trains: F = 3 features, V = 8 values, all 8 rules, slots shuffled per column, 25% of
the 120 rule multisets (30) held out; d 64, 8 heads, q/k/v width 32, 2 layers, MLP 128; batch 64,
AdamW lr 1e-3, 500 warm-up steps, cosine to 1e-4 at 12k steps (``end_lr=absolute``), weight
decay 0.1; one held-out set for every seed (``held_out=fixed``). Whole-panel
chance is 8⁻³ = 0.2%::

  python train.py --config=primal_dual/configs/sraven.py:preset=cpu,attention=hyla \
      --workdir=workdirs/sraven_hyla

prints ``test/whole_panel_accuracy`` (in-distribution), ``ood/whole_panel_accuracy`` (held-out
rule combinations) and the ``selected/`` values of the checkpoint chosen on validation. The
results in ``results/sraven.md`` were measured with the earlier model of this preset (q/k/v width
= model width, bidirectional buckets, no attention dropout, xavier MLP); how that preset was sized
is recorded there.
"""

from primal_dual.configs import _base
from primal_dual.data import generated
from primal_dual.data import sraven
from primal_dual.training import config_lib


def position_buckets(num_tokens: int) -> dict:
  """T5 unidirectional relative-position buckets spanning the sequence:
  ``num_buckets = max_distance = num_tokens``."""
  return dict(position_buckets="unidirectional", num_buckets=num_tokens, max_distance=num_tokens)


# The HYLA paper's sequence model apart from its size: attention-weight dropout 0.1 in training,
# lecun_normal MLP kernels, no residual dropout.
PAPER_MODEL_STYLE = dict(
  dropout_rate=0.0, attention_dropout_rate=0.1, mlp_kernel_init="lecun_normal"
)


def paper_model(size: dict, num_tokens: int) -> dict:
  """The HYLA paper's sequence model of ``size`` (num_layers, model_dim, num_heads, qkv_features,
  mlp_dim; q/k/v width set apart from the model width) over ``num_tokens`` tokens, with T5
  unidirectional relative-position buckets (``position_buckets``)."""
  return dict(size, **PAPER_MODEL_STYLE, **position_buckets(num_tokens))


def paper_schedule(*, steps: int, warmup_steps: int, eval_every: int) -> dict:
  """The paper presets' schedule (shared with logic.py): batch 128, cosine down to the end of
  training less warm-up, logs every 500 steps, a checkpoint at every evaluation."""
  return dict(
    batch_size=128,
    num_train_steps=steps,
    optimizer=dict(warmup_steps=warmup_steps, cosine_end="total_minus_warmup"),
    log_every_steps=500,
    eval_every_steps=eval_every,
    checkpoint_every_steps=eval_every,
  )


def cpu_schedule(*, steps: int, warmup_steps: int) -> dict:
  """The CPU presets' schedule (shared with logic.py): batch 64, cosine down to the last step,
  logs every 100 steps, evaluations every 500, checkpoints every 1000."""
  return dict(
    batch_size=64,
    num_train_steps=steps,
    optimizer=dict(warmup_steps=warmup_steps, cosine_end="total"),
    log_every_steps=100,
    eval_every_steps=500,
    checkpoint_every_steps=1000,
  )


def eval_split_sizes(size: int) -> dict:
  """``size`` examples in each of validation, test and ood."""
  return dict(num_validation=size, num_test=size, num_ood=size)


# The generated streams' data options the presets of both sequence tasks share.
STREAM_DATA = dict(ood_fraction=0.25, split_seed=0, stream_seed=0, num_train=0, chunk_size=8192)

# Where the paper's code and this library's earlier presets differ, each rule is a named option
# (config arguments ``end_lr`` and ``held_out``; '' keeps the preset's): option → the values it sets.
#
# The schedule's end rate. 'relative': 0.1 × lr, the paper's code (``run.py`` ``end_value=
# config.lr * 0.1``), so every lr of its sweep gets the same shape; 'absolute': 1e-4 whatever lr
# (this library's earlier rule; equal to 'relative' at lr 1e-3 only).
END_LR_RULES = {
  "relative": dict(optimizer=dict(end_lr=None, end_lr_factor=0.1)),
  "absolute": dict(optimizer=dict(end_lr=1e-4, end_lr_factor=None)),
}
# The held-out latents (sRAVEN rule multisets; logic test term sets). 'per_seed': each training
# seed draws its own (``data.split_seed = SPLIT_SEED_OF_RUN``), as the paper's code, whose data
# generators permute the latents with the run's seed, so its mean over seeds 0, 1, 2 is over three
# splits; 'fixed': split seed 0 for every seed (this library's earlier rule: seeds differ only in
# the model and data order).
HELD_OUT_RULES = {
  "per_seed": dict(data=dict(split_seed=generated.SPLIT_SEED_OF_RUN)),
  "fixed": dict(data=dict(split_seed=0)),
}

PAPER_OPTIMIZER = dict(lr=1e-3, weight_decay=0.1)
# What every preset of the paper's two tasks (sRAVEN, logic) shares.
PAPER_TASK = dict(
  optimizer=dict(name="adamw", schedule="warmup_cosine", **PAPER_OPTIMIZER),
  selection=dict(split="validation", mode="max"),
)
# The paper presets' rules and the CPU presets' (the earlier ones, which the CPU results used).
PAPER_RULES = _base.merge(END_LR_RULES["relative"], HELD_OUT_RULES["per_seed"])
CPU_RULES = _base.merge(END_LR_RULES["absolute"], HELD_OUT_RULES["fixed"])


def num_tokens(data: dict) -> int:
  """8 panels of F feature tokens, then F query tokens."""
  return sraven.NUM_PANELS * data["num_features"]


PAPER_DATA = dict(
  STREAM_DATA,
  num_features=4,
  num_values=8,
  rules=sraven.DEFAULT_RULES,
  shuffle_features=True,
  num_validation=4096,
  num_test=51_200,
  num_ood=51_200,
  materialize_train=True,
)
PAPER = dict(
  data=PAPER_DATA,
  model=paper_model(
    dict(num_layers=4, model_dim=128, num_heads=16, qkv_features=64, mlp_dim=256),
    num_tokens(PAPER_DATA),
  ),
  eval_batch_size=512,
  **paper_schedule(steps=156_250, warmup_steps=1000, eval_every=6250),
)
PAPER = _base.merge(PAPER, PAPER_RULES)
CPU_DATA = dict(num_features=3, **eval_split_sizes(1024))
CPU_SIZE = dict(num_layers=2, model_dim=64, num_heads=8, qkv_features=32, mlp_dim=128)
CPU = _base.merge(
  _base.merge(PAPER, CPU_RULES),
  dict(
    data=CPU_DATA,
    model=dict(CPU_SIZE, **position_buckets(num_tokens(CPU_DATA))),
    **cpu_schedule(steps=12_000, warmup_steps=500),
  ),
)

PRESETS = {"paper": PAPER, "cpu": CPU}
# The config arguments of both sequence tasks besides config_lib.RUN_ARGUMENTS.
PRESET_ARGUMENTS = dict(preset="cpu", steps=-1, end_lr="", held_out="")

# A tiny model, tiny splits and a few steps (shared with logic.py); 32 problems per split (= the
# 4 × 8 training problems): one compiled generator shape.
RUNLOCAL = _base.merge(
  _base.RUNLOCAL_STEPS,
  dict(
    model=dict(_base.RUNLOCAL_MODEL, num_heads=4, qkv_features=16),
    data=dict(eval_split_sizes(32), chunk_size=32),
    eval_batch_size=32,
    optimizer=dict(warmup_steps=1),
    checkpoint_every_steps=4,
    progress_bar=False,
  ),
)


def preset_config(task: str, presets: dict, arg, *, selection_metric: str, title: str):
  """The locked config of ``presets[arg.preset]`` for ``task`` (shared with logic.py);
  ``title`` names the task in messages; ``arg.end_lr`` / ``arg.held_out`` name a rule of
  ``END_LR_RULES`` / ``HELD_OUT_RULES`` to use instead of the preset's ('' keeps it)."""
  rules = [
    config_lib.choice(table, value, f"{title} {name} rule")
    for name, table, value in (
      ("end_lr", END_LR_RULES, arg.end_lr),
      ("held_out", HELD_OUT_RULES, arg.held_out),
    )
    if value
  ]
  config = _base.build(
    task,
    arg,
    PAPER_TASK,
    config_lib.choice(presets, arg.preset, f"{title} preset"),
    *rules,
    dict(selection=dict(metric=selection_metric)),
  )
  config.num_train_steps = config_lib.count_or_default(arg.steps, config.num_train_steps, "steps")
  if arg.runlocal:
    _base.apply(config, RUNLOCAL)
  return _base.finish(config)


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, **config_lib.RUN_ARGUMENTS, **PRESET_ARGUMENTS)
  return preset_config(
    "sraven", PRESETS, arg, selection_metric="whole_panel_accuracy", title="sRAVEN"
  )
