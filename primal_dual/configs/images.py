r"""DeiT/ViT image classification with any attention variant (docs/maths.md §4).

Data sets (``dataset=``):

* ``digits`` — CPU demo, offline: scikit-learn's 8×8 digits upscaled ×2 to 16×16, patch 4 → a 4×4
  patch grid plus CLS (17 tokens), 1437 train / 360 test images, random shifts of up to one original
  pixel. ViT ``micro`` (4 layers, d 64, 4 heads, MLP 128), batch 64, 60 epochs (1320 steps),
  AdamW lr 1e-3, weight decay 0.05, 3 warm-up epochs then cosine to 1e-5. Measured once
  (softmax, seed 0, on this 2-core CPU while other jobs shared it): test accuracy 86.9% after the
  last step (train accuracy on augmented batches 95%), 175 s end to end; see results/images.md
  for every variant over 3 seeds.
* ``cifar10`` — 32×32, patch 4 → 8×8 grid, DeiT-tiny by default, the DeiT recipe below at batch
  512 (lr 5e-4), 4-pixel padded crops and flips.
* ``imagenet2012`` — 224×224, patch 16 → 14×14 grid, DeiT-tiny by default. The DeiT recipe
  (Touvron et al. 2021): AdamW lr 5e-4·batch/512 (1e-3 at batch 1024), weight decay 0.05,
  cosine to 1e-5 after 5 warm-up epochs, 300 epochs, batch 1024; random resized crops and flips
  in training, resize to 256 and central 224 crop for evaluation. Not reproduced here (the trainer
  has no per-batch hook): label smoothing, Mixup/CutMix, RandAugment, random erasing, repeated
  augmentation and stochastic depth, so expect accuracy below DeiT's published one.

cifar10 and imagenet2012 are read through TFDS (``data_dir=``, array_record format); when they are
not prepared the run stops with one message saying how to prepare them.

Training length and periods are counted in epochs of the real training set and converted to steps
(``primal_dual.data.images.train_size``); the train source holds one augmented pass per
epoch (``augment_repeats``; see the docstring of ``primal_dual/tasks/images.py``).
Evaluation on the whole evaluation split ('test'; imagenet2012: 'validation'); reported:
``test/accuracy`` (``validation/accuracy`` for imagenet2012) after the last step.

Attention-SH ratios. On an image a ratio r pools r×r patches (the CLS token is never pooled). Per
head count: 3 heads (1, 2, 4), 4 heads (1, 1, 2, 2), 6 heads (1, 1, 2, 2, 4, 4) — at least one
full-resolution head, the others see a coarser grid — each capped at half the grid side so every
head keeps a grid of at least 2×2 (on the 4×4 digits grid: at most 2).

Arguments: ``dataset``, ``model`` (micro | tiny | small; '' = the data set's default),
``attention`` (any name of ``primal_dual.layers.ATTENTION_REGISTRY``), ``seed``, ``epochs``
(-1 = the recipe's), ``data_dir``, ``runlocal`` (a 1-layer d 16 model, 4 steps: a smoke test),
``bf16`` (bfloat16 compute, float32 parameters: ``--config.model.dtype=bfloat16``).

Commands::

  # CPU demo (about 3 minutes on 2 cores)
  python train.py --config=primal_dual/configs/images.py:dataset=digits,attention=softmax \
      --workdir=workdirs/digits_softmax
  # DeiT-tiny on ImageNet (accelerators; prepare imagenet2012 with TFDS first)
  python train.py --config=primal_dual/configs/images.py:dataset=imagenet2012,model=tiny,attention=bn_sh,\
data_dir=$TFDS_DATA_DIR --workdir=workdirs/deit_tiny_bn_sh
  # every variant × 3 seeds on digits, tabulated: python scripts/reproduce.py images
"""

from primal_dual import registry
from primal_dual.configs import _base
from primal_dual.data import images as image_data
from primal_dual.models import VIT_PRESETS
from primal_dual.training import config_lib

DEIT_BASE_LR, DEIT_BASE_BATCH = 5e-4, 512


def deit_lr(batch_size: int) -> float:
  """DeiT's linear scaling rule: 5e-4 · batch / 512."""
  return DEIT_BASE_LR * batch_size / DEIT_BASE_BATCH


# Data set → recipe. Sizes in epochs; image_size only matters for imagenet2012.
CIFAR10 = dict(
  model="tiny",
  patch_size=4,
  upscale=1,
  image_size=0,
  batch_size=512,
  epochs=300,
  warmup_epochs=5,
  lr=deit_lr(512),
  weight_decay=0.05,
  end_lr=1e-5,
  eval_every_epochs=5,
  checkpoint_every_epochs=5,
)
RECIPES = {
  "digits": _base.merge(
    CIFAR10,
    dict(
      model="micro",
      upscale=2,
      batch_size=64,
      epochs=60,
      warmup_epochs=3,
      lr=1e-3,
      checkpoint_every_epochs=20,
    ),
  ),
  "cifar10": CIFAR10,
  "imagenet2012": _base.merge(
    CIFAR10,
    dict(
      patch_size=16,
      image_size=224,
      batch_size=1024,
      lr=deit_lr(1024),
      eval_every_epochs=1,
      checkpoint_every_epochs=1,
    ),
  ),
}
# A 1-layer d 16 model, 4 steps: a smoke test.
RUNLOCAL = dict(
  _base.RUNLOCAL_STEPS,
  model=_base.RUNLOCAL_MODEL,
  data=dict(augment_repeats=1),
  optimizer=dict(warmup_steps=2),
)
SH_RATIOS = {3: (1, 2, 4), 4: (1, 1, 2, 2), 6: (1, 1, 2, 2, 4, 4)}


def sh_ratios_for(num_heads: int, grid_side: int) -> tuple[int, ...]:
  """SH ratios for ``num_heads`` heads on a ``grid_side²`` patch grid (module docstring).

  Head counts outside ``SH_RATIOS`` get half their heads at ratio 1 and half at 2.
  """
  pattern = SH_RATIOS.get(num_heads) or registry.default_ratios(num_heads)
  cap = max(1, grid_side // 2)
  return tuple(min(r, cap) for r in pattern)


def get_config(arg=None):
  arg = config_lib.parse_arg(
    arg, **config_lib.RUN_ARGUMENTS, dataset="digits", model="", epochs=-1, data_dir=""
  )
  recipe = config_lib.choice(RECIPES, arg.dataset, "image data set")
  config_lib.choice(registry.ATTENTION_REGISTRY, arg.attention, "attention variant (attention=)")
  model_sizes = config_lib.choice(VIT_PRESETS, arg.model or recipe["model"], "ViT preset")
  epochs = config_lib.count_or_default(arg.epochs, recipe["epochs"], "epochs")
  batch_size = recipe["batch_size"]

  steps_per_epoch = image_data.train_size(arg.dataset) // batch_size
  config = _base.build(
    "images",
    arg,
    dict(
      data=dict(
        dataset=arg.dataset,
        data_dir=arg.data_dir,
        upscale=recipe["upscale"],
        image_size=recipe["image_size"],
        test_fraction=0.2,
        split_seed=0,
        augment_repeats=epochs,
      ),
      model=dict(
        patch_size=recipe["patch_size"],
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        **model_sizes,
      ),
      batch_size=batch_size,
      optimizer=dict(
        name="adamw",
        lr=recipe["lr"],
        schedule="warmup_cosine",
        weight_decay=recipe["weight_decay"],
        end_lr=recipe["end_lr"],
        warmup_steps=min(recipe["warmup_epochs"], epochs) * steps_per_epoch,
      ),
      num_train_steps=epochs * steps_per_epoch,
      eval_every_steps=recipe["eval_every_epochs"] * steps_per_epoch,
      checkpoint_every_steps=recipe["checkpoint_every_epochs"] * steps_per_epoch,
      log_every_steps=min(100, steps_per_epoch),
      selection=dict(
        split="validation" if arg.dataset == "imagenet2012" else "test", metric="accuracy"
      ),
    ),
  )
  if arg.runlocal:
    _base.apply(config, RUNLOCAL)
  side = image_data.input_side(
    arg.dataset, upscale=config.data.upscale, image_size=config.data.image_size
  )
  return _base.finish(
    config, ratios=sh_ratios_for(config.model.num_heads, side // config.model.patch_size)
  )
