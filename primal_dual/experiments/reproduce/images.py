r"""Reproduce image classification with softmax, linear, BN, SH and BN+SH attention (ViT/DeiT).

Run it as ``python scripts/reproduce_images.py`` from a clone or ``primal-dual reproduce images``
where the package is installed (the same flags; outputs relative to the current folder).

Runs variants × seeds with ``primal_dual/configs/images.py`` (one workdir per run under
``--root``), then writes

* ``--results`` (default results/images.json): one record per run (``RECORD_SCHEMA``): accuracy
  on the evaluation split after the last step, parameter count, analytic attention FLOPs per
  image, wall time;
* the same path with ``.md``: mean ± std over seeds per variant and the full-scale commands
  (DeiT-tiny on imagenet2012 and cifar10).

Resuming: a finished run is reused, an interrupted one resumes from its last checkpoint.

Commands (from the repository root)::

  # CPU demo grid: digits upscaled to 16×16, patch 4 (4×4 grid + CLS), ViT micro, 60 epochs;
  # 5 variants × 3 seeds. One softmax run took 3 minutes on this 2-core CPU while shared with
  # other jobs, so about 45 minutes for the grid.
  .venv/bin/python scripts/reproduce_images.py

  # Full scale (accelerators, TFDS data prepared under $TFDS_DATA_DIR):
  .venv/bin/python scripts/reproduce_images.py --dataset=imagenet2012 --model=tiny \
      --data_dir=$TFDS_DATA_DIR --root=workdirs/deit_tiny --results=results/images_imagenet.json

  # Smoke test: tiny model, 4 steps, softmax and sh, one seed (2 runs).
  .venv/bin/python scripts/reproduce_images.py --quick --root=/tmp/images_smoke \
      --results=/tmp/images_smoke/images.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping, Sequence

from primal_dual.experiments import grid

CONFIG_FILE = "images"  # a packaged config (primal_dual/configs/images.py)
DEFAULT_VARIANTS = ("softmax", "linear", "bn", "sh", "bn_sh")
QUICK_VARIANTS = ("softmax", "sh")
DEFAULT_SEEDS = (0, 1, 2)
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
python scripts/reproduce_images.py --dataset=imagenet2012 --model=tiny --data_dir=$TFDS_DATA_DIR \\
    --root=workdirs/deit_tiny --results=results/images_imagenet.json
```

DeiT-tiny on CIFAR-10 (32×32, patch 4 → 8×8 grid, the same recipe at batch 512):

```
python scripts/reproduce_images.py --dataset=cifar10 --model=tiny --data_dir=$TFDS_DATA_DIR \\
    --root=workdirs/cifar10_tiny --results=results/images_cifar10.json
```
"""

_NUMBER = (int, float)
RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
  "name": (str,),
  "config_file": (str,),
  "config_arg": (str,),
  "dataset": (str,),
  "model": (str,),
  "attention": (str,),
  "seed": (int,),
  "steps": (int,),
  "quick": (bool,),
  "eval_split": (str,),
  "test_accuracy": _NUMBER,
  "best_test_accuracy": _NUMBER,
  "num_params": (int,),
  "sequence_length": (int,),
  "attention_flops": _NUMBER,
  "attention_flops_relative": _NUMBER,
  "wall_time_s": _NUMBER,
  "metrics": (dict,),
}


def validate_record(record: Mapping[str, Any]) -> None:
  """Raises ValueError naming every field of ``RECORD_SCHEMA`` missing or of the wrong type."""
  grid.check_schema(record, RECORD_SCHEMA, "images")


def build_runs(args: argparse.Namespace) -> list[grid.GridRun]:
  """The grid in seed-major order, so a half-finished grid already covers every variant."""
  config_file = CONFIG_FILE
  runs = []
  for seed in args.seeds:
    for attention in args.variants:
      config_arg = f"dataset={args.dataset},attention={attention},seed={seed}"
      config_arg += f",model={args.model}" if args.model else ""
      config_arg += f",epochs={args.epochs}" if args.epochs > 0 else ""
      config_arg += f",data_dir={args.data_dir}" if args.data_dir else ""
      config_arg += ",runlocal" if args.quick else ""
      config = grid.load_config(config_file, config_arg)
      steps = int(config.num_train_steps)
      model = "runlocal" if args.quick else (args.model or _preset_name(config))
      runs.append(
        grid.GridRun(
          name=f"{args.dataset}-{model}-{attention}-steps{steps}-s{seed}",
          config_file=config_file,
          config_arg=config_arg,
          tags=dict(
            dataset=args.dataset,
            model=model,
            attention=attention,
            seed=seed,
            steps=steps,
            quick=bool(args.quick),
            eval_split=config.selection.split,
          ),
        )
      )
  return runs


def _preset_name(config) -> str:
  """The ``VIT_PRESETS`` name matching a config's model sizes ('custom' if none does)."""
  from primal_dual.models import VIT_PRESETS  # pylint: disable=g-import-not-at-top

  for name, sizes in VIT_PRESETS.items():
    if all(config.model[k] == v for k, v in sizes.items()):
      return name
  return "custom"


def record_fn(run: grid.GridRun, metrics: Mapping[str, Any], workdir: str) -> dict[str, Any]:
  """``run_grid``'s ``record_fn``: accuracy, size and attention cost of one run."""
  del workdir
  from primal_dual.experiments import images as images_task  # pylint: disable=g-import-not-at-top

  split = run.tags["eval_split"]
  summary = images_task.model_summary(grid.load_config(run.config_file, run.config_arg))
  record = {
    "test_accuracy": float(metrics[f"{split}/accuracy"]),
    "best_test_accuracy": float(metrics[f"best/{split}_accuracy"]),
    "num_params": int(summary["parameters"]),
    "sequence_length": int(summary["sequence_length"]),
    "attention_flops": float(summary["attention_flops"]),
    "attention_flops_relative": float(summary["attention_flops_relative"]),
  }
  validate_record(
    {
      **dict(run.tags),
      "name": run.name,
      "config_file": run.config_file,
      "config_arg": run.config_arg,
      "wall_time_s": 0.0,
      "metrics": dict(metrics),
      **record,
    }
  )
  return record


# ------------------------------------------------------------------------------------------------
# Report.


def markdown_report(records: Sequence[Mapping[str, Any]], command: str) -> str:
  """results/images.md: mean ± std over seeds per variant and the full-scale commands."""
  params = grid.first_by_variant(records, "num_params")
  flops = grid.first_by_variant(records, "attention_flops")
  relative = grid.first_by_variant(records, "attention_flops_relative")

  split = records[0]["eval_split"]
  columns = {
    f"{split} acc % (last step)": grid.field("test_accuracy"),
    f"{split} acc % (best over evaluations)": grid.field("best_test_accuracy"),
    "wall time (min)": grid.field("wall_time_s"),
  }
  extra = {
    "params": lambda key: f"{params[key[0]]:,}",
    "attention MFLOPs / image": lambda key: f"{flops[key[0]] / 1e6:.4g}",
    "attention FLOPs / softmax": lambda key: f"{relative[key[0]]:.2f}",
  }
  datasets = sorted({r["dataset"] for r in records})
  models = sorted({r["model"] for r in records})
  steps = sorted({r["steps"] for r in records})
  seeds = sorted({r["seed"] for r in records})
  lengths = sorted({r["sequence_length"] for r in records})
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


# ------------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  grid.add_variant_and_seed_arguments(parser, DEFAULT_VARIANTS, QUICK_VARIANTS, DEFAULT_SEEDS)
  parser.add_argument("--dataset", choices=DATASETS, default="digits")
  parser.add_argument(
    "--model",
    choices=("", *MODELS),
    default="",
    help="ViT preset; default the data set's (digits: micro, others: tiny)",
  )
  parser.add_argument("--epochs", type=int, default=-1, help="-1: the recipe's")
  parser.add_argument("--data_dir", default="", help="TFDS data folder (cifar10, imagenet2012)")
  parser.add_argument("--root", default="workdirs/images_grid", help="parent of the workdirs")
  parser.add_argument(
    "--jobs", type=int, default=1, help="runs trained at once, one process each (e.g. 6 on a GPU)"
  )
  parser.add_argument(
    "--report_only",
    action="store_true",
    help="rewrite the report from the existing results JSON; train nothing",
  )
  parser.add_argument(
    "--results", default="results/images.json", help="records; the .md goes next to it"
  )
  parser.add_argument(
    "--quick", action="store_true", help="smoke test: tiny model, 4 steps, 2 runs by default"
  )
  args = parser.parse_args(argv)
  grid.check_variants_and_seeds(parser, args, DEFAULT_VARIANTS, QUICK_VARIANTS, DEFAULT_SEEDS)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  runs = build_runs(args)
  print(
    f"Images grid: {len(runs)} runs ({len(args.variants)} variants × {len(args.seeds)} "
    f"seeds, {args.dataset}) under {args.root}"
  )
  records = grid.records_for_report(
    runs, args.root, args.results, report_only=args.report_only, record_fn=record_fn, jobs=args.jobs
  )
  for record in records:
    validate_record(record)
  markdown_path = os.path.splitext(args.results)[0] + ".md"
  command = grid.report_command(
    "scripts/reproduce_images.py", argv, markdown_path, report_only=args.report_only
  )
  with open(markdown_path, "w") as f:
    f.write(markdown_report(records, command))
  print(f"wrote {args.results}, {markdown_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
