r"""Fuzzy logic: in-context regression of max-of-min functions (the HYLA paper's task).

A task is ``y = max over num_terms conjunctions (min over literals x_i or 1 − x_i)`` of ``n``
variables in [0, 1]; a sequence shows ``seq_len − 1`` examples ``[x, y]`` of one task and a query
``[x, 0]`` whose ``y`` the model predicts (squared error). Splits: ``train`` / ``validation``
(train term sets), ``test`` = **held-out combinations** (unseen term sets of seen conjunctions:
the paper's "OOD"), ``ood`` = **held-out conjunctions** (term sets with held-out conjunctions:
only those in the ``paper`` preset, C(4, 2) = 6 sets; any in the ``cpu`` preset). Metrics on
every split: ``r2`` (R² against each task's exact target variance, this library's definition)
and ``r2_per_sequence`` (the paper's: ``1 − (ŷ − y)²/var_seq`` per sequence, ``var_seq`` the
variance of that sequence's ``seq_len`` targets, query included, then averaged).

Arguments (``--config=primal_dual/configs/logic.py:key=value,...``):
  preset: 'paper' (the paper's code and headline protocol) or 'cpu' (smaller model and task).
  attention: any name of ``primal_dual.layers.ATTENTION_REGISTRY``.
  seed: model initialisation, data order and dropout, and under ``held_out=per_seed`` (the
    ``paper`` preset's rule) the held-out (test) term sets. steps: -1 = the preset's.
  end_lr, held_out: the end-rate and held-out-split rules, as in ``primal_dual/configs/sraven.py``
    ('relative' / 'absolute', 'per_seed' / 'fixed'; '' = the preset's: ``paper`` relative and
    per_seed as the paper's code, ``cpu`` absolute and fixed).
  runlocal: a tiny model and a few steps, for smoke tests.
  bf16: bfloat16 compute, float32 parameters, as in ``primal_dual/configs/sraven.py``.

Presets
-------
``paper`` — the paper's headline protocol (``logic_4var_2term`` with ``seq_len`` 32 and
``frac_test`` 0.7 from its sweep): n = 4, 2 terms, the last 25% of the 16 conjunctions (4) held
out, 70% of the 66 in-distribution term sets held out for ``test`` (drawn per seed,
``held_out=per_seed``, as the paper's code); the held-out conjunctions'
6 term sets form ``ood``. 16,000 sequences per evaluation split. Model: emb 128, 8 heads of
q/k/v width 16 in total (head size 2), 2 pre-LN layers, MLP 256 (lecun_normal), attention
dropout 0.1, unidirectional T5 buckets with ``num_buckets = max_distance = seq_len = 32``, output
1: 151,265 parameters (the paper's code prints 151,009 for its default ``seq_len`` 16, whose
bias tables are 2 × 8 × 16 smaller). Batch 128, AdamW lr 1e-3, warm-up 100, cosine to 0.1 × lr
(``end_lr=relative``) reached at step 49,900 and held, weight decay 0.1 on non-vector parameters, 50,000 steps::

  python train.py --config=primal_dual/configs/logic.py:preset=paper,attention=hyla \
      --workdir=workdirs/logic_paper_hyla

``cpu`` — n = 4, 2 terms, seq_len 16, test fraction 0.5, ``ood`` = term sets with any held-out
conjunction; the paper's model structure at d 64, 8 heads, q/k/v width 16, 2 layers, MLP 128;
batch 64, 6000 steps (300 warm-up, cosine to 1e-4: ``end_lr=absolute``), same optimizer, one
held-out split for every seed (``held_out=fixed``)::

  python train.py --config=primal_dual/configs/logic.py:preset=cpu,attention=hyla --workdir=workdirs/logic_hyla

The results in ``results/logic.md`` were measured with the earlier model of this preset (q/k/v
width = model width, bidirectional buckets, no attention dropout, xavier MLP).
"""

from primal_dual.configs import _base
from primal_dual.configs import sraven as sraven_config
from primal_dual.training import config_lib

PAPER_DATA = dict(
  sraven_config.STREAM_DATA,
  num_variables=4,
  num_terms=2,
  seq_len=32,
  test_fraction=0.7,
  ood_term_sets="all_held_out",
  materialize_train=False,
  **sraven_config.eval_split_sizes(16_000),
)
PAPER_SIZE = dict(num_layers=2, model_dim=128, num_heads=8, qkv_features=16, mlp_dim=256)
PAPER = dict(
  data=PAPER_DATA,
  model=sraven_config.paper_model(PAPER_SIZE, PAPER_DATA["seq_len"]),
  eval_batch_size=1000,
  **sraven_config.paper_schedule(steps=50_000, warmup_steps=100, eval_every=2500),
)
PAPER = _base.merge(PAPER, sraven_config.PAPER_RULES)
CPU_DATA = dict(
  seq_len=16,
  test_fraction=0.5,
  ood_term_sets="any_held_out",
  materialize_train=True,
  **sraven_config.eval_split_sizes(2048),
)
CPU = _base.merge(
  _base.merge(PAPER, sraven_config.CPU_RULES),
  dict(
    data=CPU_DATA,
    model=dict(model_dim=64, mlp_dim=128, **sraven_config.position_buckets(CPU_DATA["seq_len"])),
    eval_batch_size=512,
    **sraven_config.cpu_schedule(steps=6000, warmup_steps=300),
  ),
)

PRESETS = {"paper": PAPER, "cpu": CPU}


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, **config_lib.RUN_ARGUMENTS, **sraven_config.PRESET_ARGUMENTS)
  return sraven_config.preset_config("logic", PRESETS, arg, selection_metric="r2", title="logic")
