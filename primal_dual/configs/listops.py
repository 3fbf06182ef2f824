r"""Long Range Arena ListOps with any attention variant (docs/maths.md §4), in two reference settings.

Settings (``setting=``):

* ``jax_lra`` — the JAX LRA setup of docs/maths.md §4: 4 layers, d_model 512, 8 heads, MLP 1024, pre-LN,
  sinusoidal positions (LRA's ``learn_pos_emb=False``), dropout 0.1, CLS pooling, batch 32,
  5000 steps. Optimizer as in LRA's ``listops/train.py`` and ``base_listops_config.py``: Adam with
  b1 0.9, b2 0.98, eps 1e-9, decoupled weight decay 0.1, and the schedule
  ``0.05 · min(1, step/1000) / sqrt(max(step, 1000))``, which is our ``rsqrt`` schedule with peak
  ``lr = 0.05/√1000 ≈ 1.58e-3`` and 1000 warm-up steps. (LRA's Flax Adam decays every parameter;
  ours decays only matrices — see ``primal_dual/training/optim.py``.)
* ``pytorch`` — the smaller PyTorch-lineage setup (Nyströmformer's LRA code): 2 layers, d_model 64,
  2 heads, MLP 128, pre-LN, learned positions, dropout 0.1, mean pooling over valid tokens,
  batch 32, 5000 steps, AdamW lr 1e-4, no weight decay, 1000 warm-up steps. That code decays the
  learning rate linearly after warm-up; the trainer offers cosine decay, used here instead (our
  choice).

In both settings attention dropout is 0 (LRA uses 0.1), so that every variant trains under the same
regularisation: the primal linear and random-feature kernels never form the weights dropout would
act on. ``linear`` runs in its primal form (O(N), what makes linear attention worth having on
long sequences; equal to the dual form up to float error).

Presets (``preset=``): ``full`` (LRA: 96k/2k/2k expressions of 500–2000 tokens) or ``short``
(10k/500/500 expressions of 100–500 tokens, for CPU runs); ``runlocal`` uses ``tiny``.

Attention-SH ratios (``attention=sh|bn_sh``). A pooled key of ratio r averages r consecutive
tokens. ListOps needs token-level access (each digit and bracket changes the answer), so half the
heads keep ratio 1 or 2 and the other half summarise spans of 4–8 tokens, short next to sequences
of 100–2000 tokens: 8 heads (1, 1, 2, 2, 4, 4, 8, 8), attention cost 0.47 of softmax; 2 heads
(1, 2): one full-resolution head, cost 0.75. The CLS token is never pooled.

Evaluation every 250 steps on the whole validation and test splits; reported: ``test/accuracy``
(last step, LRA's protocol) and ``selected/test_accuracy`` (at the best validation accuracy).

Arguments: ``setting``, ``preset``, ``attention`` (any name of
``primal_dual.layers.ATTENTION_REGISTRY``), ``seed`` (model and data order; the data set itself
is generated with ``data_seed``, default 0), ``steps`` (-1: the setting's 5000; a shorter run caps
the warm-up at a fifth of it), ``data_dir`` (TFDS folder), ``runlocal`` (tiny preset, 1-layer d 16
model, 4 steps: a smoke test), ``bf16`` (bfloat16 compute, float32 parameters:
``--config.model.dtype=bfloat16``).

Commands::

  # JAX LRA, full scale (accelerator; LRA reports 36.37% test accuracy for softmax)
  python train.py --config=primal_dual/configs/listops.py:setting=jax_lra,preset=full,attention=softmax \
      --workdir=workdirs/listops_lra_softmax
  # PyTorch lineage on the short preset (CPU: a step costs about 1.3 s of CPU time, so 1–1.5 h
  # on 2 cores; results/listops.md holds the measured accuracies)
  python train.py --config=primal_dual/configs/listops.py:setting=pytorch,preset=short,attention=bn_sh \
      --workdir=workdirs/listops_short_bn_sh
  # every variant × 3 seeds, tabulated: python scripts/reproduce.py listops
"""

import math

from primal_dual import registry
from primal_dual.configs import _base
from primal_dual.training import config_lib

# The optimizer both settings share: AdamW after 1000 warm-up steps.
ADAMW = dict(name="adamw", warmup_steps=1000)
SETTINGS = {
  "jax_lra": dict(
    model=dict(
      num_layers=4, model_dim=512, num_heads=8, mlp_dim=1024, pooling="cls", positional="sinusoidal"
    ),
    optimizer=dict(
      ADAMW,
      lr=0.05 / math.sqrt(1000),
      schedule="rsqrt",
      weight_decay=0.1,
      b1=0.9,
      b2=0.98,
      eps=1e-9,
    ),
    sh_ratios=(1, 1, 2, 2, 4, 4, 8, 8),
  ),
  "pytorch": dict(
    model=dict(
      num_layers=2, model_dim=64, num_heads=2, mlp_dim=128, pooling="mean", positional="learned"
    ),
    optimizer=dict(ADAMW, lr=1e-4, schedule="warmup_cosine", weight_decay=0.0, end_lr=0.0),
    sh_ratios=(1, 2),
  ),
}
PRESETS = ("full", "short")
# The task's own options by variant (variants that take ratios get the setting's sh_ratios).
VARIANT_OPTIONS = {"linear": {"form": "primal"}}

BATCH_SIZE = 32
NUM_TRAIN_STEPS = 5000
EVAL_EVERY_STEPS = 250
RUNLOCAL = dict(_base.RUNLOCAL_STEPS, model=_base.RUNLOCAL_MODEL, optimizer=dict(warmup_steps=2))
RUNLOCAL_SH_RATIOS = (1, 2)


def get_config(arg=None):
  arg = config_lib.parse_arg(
    arg,
    **config_lib.RUN_ARGUMENTS,
    setting="jax_lra",
    preset="full",
    data_seed=0,
    steps=-1,
    data_dir="",
  )
  setting = config_lib.choice(SETTINGS, arg.setting, "ListOps setting")
  config_lib.choice(dict.fromkeys(PRESETS), arg.preset, "ListOps preset")
  config_lib.choice(registry.ATTENTION_REGISTRY, arg.attention, "attention variant (attention=)")

  config = _base.build(
    "listops",
    arg,
    dict(
      data=dict(
        preset="tiny" if arg.runlocal else arg.preset, seed=arg.data_seed, data_dir=arg.data_dir
      ),
      model=dict(
        pre_norm=True,
        norm="layer",
        dropout_rate=0.1,
        attention_dropout_rate=0.0,
        **setting["model"],
      ),
      optimizer=setting["optimizer"],
      batch_size=BATCH_SIZE,
      num_train_steps=NUM_TRAIN_STEPS,
      eval_every_steps=EVAL_EVERY_STEPS,
      checkpoint_every_steps=1000,
      log_every_steps=50,
      selection=dict(split="validation", metric="accuracy"),
    ),
    RUNLOCAL if arg.runlocal else {},
  )
  if arg.steps != config_lib.CONFIG_DEFAULT_COUNT:
    config.num_train_steps = config_lib.count_or_default(arg.steps, config.num_train_steps, "steps")
    # A shortened run keeps its warm-up to at most a fifth of the steps.
    config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, max(1, arg.steps // 5))
  return _base.finish(
    config,
    ratios=RUNLOCAL_SH_RATIOS if arg.runlocal else setting["sh_ratios"],
    by_variant=VARIANT_OPTIONS,
  )
