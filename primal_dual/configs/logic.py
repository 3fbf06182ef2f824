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
  seed: model initialisation, data order and dropout. steps: -1 = the preset's.
  runlocal: a tiny model and a few steps, for smoke tests.

Presets
-------
``paper`` — the paper's headline protocol (``logic_4var_2term`` with ``seq_len`` 32 and
``frac_test`` 0.7 from its sweep): n = 4, 2 terms, the last 25% of the 16 conjunctions (4) held
out, 70% of the 66 in-distribution term sets held out for ``test``; the held-out conjunctions'
6 term sets form ``ood``. 16,000 sequences per evaluation split. Model: emb 128, 8 heads of
q/k/v width 16 in total (head size 2), 2 pre-LN layers, MLP 256 (lecun_normal), attention
dropout 0.1, unidirectional T5 buckets with ``num_buckets = max_distance = seq_len = 32``, output
1: 151,265 parameters (the paper's code prints 151,009 for its default ``seq_len`` 16, whose
bias tables are 2 × 8 × 16 smaller). Batch 128, AdamW lr 1e-3, warm-up 100, cosine to 1e-4
reached at step 49,900 and held, weight decay 0.1 on non-vector parameters, 50,000 steps::

  python train.py --config=primal_dual/configs/logic.py:preset=paper,attention=hyla \
      --workdir=workdirs/logic_paper_hyla

``cpu`` — n = 4, 2 terms, seq_len 16, test fraction 0.5, ``ood`` = term sets with any held-out
conjunction; the paper's model structure at d 64, 8 heads, q/k/v width 16, 2 layers, MLP 128;
batch 64, 6000 steps (300 warm-up, cosine to 1e-4), same optimizer::

  python train.py --config=primal_dual/configs/logic.py:preset=cpu,attention=hyla --workdir=workdirs/logic_hyla

The results in ``results/logic.md`` were measured with the earlier model of this preset (q/k/v
width = model width, bidirectional buckets, no attention dropout, xavier MLP).
"""

from primal_dual.configs import _base
from primal_dual.configs.sraven import paper_model, position_buckets, preset_config
from primal_dual.training import config_lib

PAPER_DATA = dict(
  num_variables=4,
  num_terms=2,
  seq_len=32,
  ood_fraction=0.25,
  split_seed=0,
  test_fraction=0.7,
  ood_term_sets="all_held_out",
  stream_seed=0,
  num_train=0,
  materialize_train=False,
  chunk_size=8192,
  num_validation=16_000,
  num_test=16_000,
  num_ood=16_000,
)
PAPER = dict(
  data=PAPER_DATA,
  model=paper_model(
    num_layers=2,
    model_dim=128,
    num_heads=8,
    qkv_features=16,
    mlp_dim=256,
    num_tokens=PAPER_DATA["seq_len"],
  ),
  batch_size=128,
  eval_batch_size=1000,
  num_train_steps=50_000,
  optimizer=dict(warmup_steps=100, cosine_end="total_minus_warmup"),
  log_every_steps=500,
  eval_every_steps=2500,
  checkpoint_every_steps=2500,
)
CPU_DATA = dict(
  seq_len=16,
  test_fraction=0.5,
  ood_term_sets="any_held_out",
  materialize_train=True,
  num_validation=2048,
  num_test=2048,
  num_ood=2048,
)
CPU = _base.merge(
  PAPER,
  dict(
    data=CPU_DATA,
    model=dict(model_dim=64, mlp_dim=128, **position_buckets(CPU_DATA["seq_len"])),
    batch_size=64,
    eval_batch_size=512,
    num_train_steps=6000,
    optimizer=dict(warmup_steps=300, cosine_end="total"),
    log_every_steps=100,
    eval_every_steps=500,
    checkpoint_every_steps=1000,
  ),
)

PRESETS = {"paper": PAPER, "cpu": CPU}


def get_config(arg=None):
  arg = config_lib.parse_arg(
    arg, preset="cpu", attention="softmax", seed=0, steps=-1, runlocal=False
  )
  return preset_config("logic", PRESETS, arg, selection_metric="r2", title="logic")
