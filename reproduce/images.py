"""The image-classification study (ViT/DeiT): accuracy and attention cost of the five attention
forms on digits (offline), CIFAR-10 and ImageNet: its grid, record schema and report
(``primal-dual reproduce images``); ``model_summary`` gives a config's size and attention FLOPs.
The task: ``primal_dual/tasks/images.py``.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import ml_collections

from primal_dual.analysis import flops
from primal_dual.tasks import images as images_task
from reproduce import grid
from primal_dual.models import model_parameter_count


# ------------------------------------------------------------------------------------------------
# The reproduction grid (``primal-dual reproduce images``).

GRID_COMMANDS = r"""
Runs variants × seeds with ``primal_dual/configs/images.py`` (one workdir per run under
``--root``), then writes

* ``--results`` (default results/images.json): one record per run (``RECORD_SCHEMA``): accuracy
  on the evaluation split after the last step, parameter count, analytic attention FLOPs per
  image, wall time;
* the same path with ``.md``: mean ± std over seeds per variant and the full-scale commands
  (DeiT-tiny on imagenet2012 and cifar10).

Resuming: a finished run is reused, an interrupted one resumes from its last checkpoint.

Commands (from the repository root; ``primal-dual reproduce images`` where the package is
installed)::

  # CPU demo grid: digits upscaled to 16×16, patch 4 (4×4 grid + CLS), ViT micro, 60 epochs;
  # 5 variants × 3 seeds. One softmax run took 3 minutes on this 2-core CPU while shared with
  # other jobs, so about 45 minutes for the grid.
  .venv/bin/python scripts/reproduce.py images

  # Full scale (accelerators, TFDS data prepared under $TFDS_DATA_DIR):
  .venv/bin/python scripts/reproduce.py images --dataset=imagenet2012 --scale=tiny \
      --data_dir=$TFDS_DATA_DIR --root=workdirs/deit_tiny --results=results/images_imagenet.json

  # Smoke test: tiny model, 4 steps, softmax and sh, one seed (2 runs).
  .venv/bin/python scripts/reproduce.py images --quick --root=/tmp/images_smoke \
      --results=/tmp/images_smoke/images.json
"""
CONFIG_FILE = "images"  # a packaged config (primal_dual/configs/images.py)
DATASETS = ("digits", "cifar10", "imagenet2012")
MODELS = ("micro", "tiny", "small")

FULL_SCALE_COMMANDS = """\
## Full-scale commands (GPU/TPU)

cifar10 and imagenet2012 are read from TFDS in array_record format; prepare them once on a
machine with TensorFlow (`tfds build cifar10 --file_format=array_record --data_dir=DATA_DIR`;
imagenet2012 also needs the ILSVRC2012 tar files in `DATA_DIR/downloads/manual`). A run without
the prepared data stops with a message saying exactly this.

DeiT-tiny on ImageNet (224×224, patch 16, the DeiT recipe: AdamW lr 1e-3 at batch 1024, weight
decay 0.05, 5 warm-up epochs, cosine, 300 epochs; without DeiT's label smoothing, Mixup/CutMix,
RandAugment, random erasing and stochastic depth):

```
python train.py --config=primal_dual/configs/images.py:dataset=imagenet2012,model=tiny,attention=softmax,\\
data_dir=$TFDS_DATA_DIR --workdir=workdirs/deit_tiny_softmax
python scripts/reproduce.py images --dataset=imagenet2012 --scale=tiny --data_dir=$TFDS_DATA_DIR \\
    --root=workdirs/deit_tiny --results=results/images_imagenet.json
```

DeiT-tiny on CIFAR-10 (32×32, patch 4 → 8×8 grid, the same recipe at batch 512):

```
python scripts/reproduce.py images --dataset=cifar10 --scale=tiny --data_dir=$TFDS_DATA_DIR \\
    --root=workdirs/cifar10_tiny --results=results/images_cifar10.json
```
"""

RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
  **grid.RUN_RECORD_SCHEMA,
  "dataset": (str,),
  "model": (str,),
  **grid.VARIANT_RUN_SCHEMA,
  "eval_split": (str,),
  "test_accuracy": grid.NUMBER,
  "best_test_accuracy": grid.NUMBER,
  **grid.SIZE_AND_COST_SCHEMA,
}


def validate_record(record: Mapping[str, Any]) -> None:
  """Raises ValueError naming every field of ``RECORD_SCHEMA`` missing or of the wrong type."""
  grid.check_schema(record, RECORD_SCHEMA, "images")


def build_runs(args: argparse.Namespace) -> list[grid.GridRun]:
  """The grid in seed-major order, so a half-finished grid already covers every variant."""

  def run(attention: str, seed: int) -> grid.GridRun:
    config_arg = grid.config_argument(
      dict(dataset=args.dataset, attention=attention, seed=seed),
      dict(model=args.model, epochs=args.epochs, data_dir=args.data_dir),
      runlocal=args.quick,
    )
    config = grid.load_config(CONFIG_FILE, config_arg)
    steps = int(config.num_train_steps)
    model = "runlocal" if args.quick else (args.model or _preset_name(config))
    labels = dict(dataset=args.dataset, model=model)
    return grid.variant_run(
      CONFIG_FILE,
      config_arg,
      labels,
      attention,
      seed,
      steps,
      args.quick,
      eval_split=config.selection.split,
    )

  return grid.seed_major_runs(args, run)


def _preset_name(config) -> str:
  """The ``VIT_PRESETS`` name matching a config's model sizes ('custom' if none does)."""
  from primal_dual.models import VIT_PRESETS

  for name, sizes in VIT_PRESETS.items():
    if all(config.model[k] == v for k, v in sizes.items()):
      return name
  return "custom"


def record_fn(
  run: grid.GridRun, metrics: Mapping[str, Any], workdir: str, args: argparse.Namespace
) -> dict[str, Any]:
  """A record's task fields: accuracy, size and attention cost of one run."""
  del workdir, args
  split = run.tags["eval_split"]
  return {
    "test_accuracy": float(metrics[f"{split}/accuracy"]),
    "best_test_accuracy": float(metrics[f"best/{split}_accuracy"]),
    **grid.size_and_cost_fields(model_summary, run),
  }


# ------------------------------------------------------------------------------------------------
# Report.


def markdown_report(records: Sequence[Mapping[str, Any]], command: str) -> str:
  """results/images.md: mean ± std over seeds per variant and the full-scale commands."""
  split = records[0]["eval_split"]
  columns = {
    f"{split} acc % (last step)": grid.field("test_accuracy"),
    f"{split} acc % (best over evaluations)": grid.field("best_test_accuracy"),
    "wall time (min)": grid.field("wall_time_s"),
  }
  extra = grid.size_and_cost_columns(records, "image")
  datasets, models, steps, seeds, lengths = grid.distinct_values(
    records, "dataset", "model", "steps", "seed", "sequence_length"
  )
  lines = [
    "# Image classification (ViT): accuracy and attention cost per variant\n",
    f"Measured by `{command}` on {grid.describe_hardware(records)}; data set {', '.join(datasets)}, model "
    f"{', '.join(models)}, {', '.join(map(str, steps))} steps, seeds "
    f"{', '.join(map(str, seeds))}. Cells are mean ± std over seeds (n runs). *Last step*: "
    f"accuracy on the {split} split after the final step (the number to report). *Best over "
    "evaluations* picks the evaluation by the same split, so it is optimistic. Attention FLOPs "
    "are analytic: the products inside every layer's attention kernel for one image "
    f"({', '.join(map(str, lengths))} tokens incl. CLS), multiply-add = 2, projections left out "
    "(primal_dual/analysis/flops.py); SH pools r×r patches of the grid; linear is the "
    "registry's dual form here. Wall time covers training and the periodic evaluations."
    + grid.shared_machine_note(command)
    + " Per-run records: images.json.\n",
    grid.summary_table(records, ("attention",), columns, {"wall time (min)": 1 / 60}, extra),
    FULL_SCALE_COMMANDS,
  ]
  return "\n".join(lines)


# The grid's own flags: flag → add_argument options.
FLAGS: dict[str, dict[str, Any]] = {
  "--dataset": dict(choices=DATASETS, default="digits"),
  "--scale": dict(
    dest="model",
    choices=("", *MODELS),
    default="",
    help="ViT preset; default the data set's (digits: micro, others: tiny)",
  ),
  "--epochs": dict(type=int, default=-1, help="-1: the recipe's"),
  "--data_dir": dict(default="", help="TFDS data folder (cifar10, imagenet2012)"),
}


REPRODUCTION = grid.module_reproduction(
  __name__,
  task="images",
  summary="Image classification with softmax, linear, BN, SH and BN+SH attention (ViT/DeiT).",
  quick="tiny model, 4 steps, 2 runs by default",
  variants=grid.ATTENTION_FORMS,
)


def model_summary(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Size and attention cost of an images config (no data is read).

  Returns:
    ``{'parameters': int, 'attention_flops': float (one image, forward, all layers; see
    ``primal_dual.analysis.flops``, SH pooling r×r windows of the patch grid),
    'attention_flops_relative': float (to softmax), 'sequence_length': int (CLS + patches)}``.
  """
  metadata = images_task.images_metadata(config)
  model = images_task.build_model(config, metadata)
  parameters = model_parameter_count(
    model, jnp.zeros((1, *metadata["image_shape"]), jnp.float32), train=False
  )
  side = metadata["image_shape"][0] // config.model.patch_size  # patches per side
  cost = flops.attention_flops(
    config.model, seq_len=side * side, grid_shape=(side, side), num_prefix_tokens=1
  )
  return {
    "parameters": parameters,
    "attention_flops": cost["total"],
    "attention_flops_relative": cost["relative_to_softmax"],
    "sequence_length": 1 + side * side,
  }
