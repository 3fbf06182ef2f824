r"""Reproduce ListOps (LRA) accuracy and attention cost for softmax, linear, BN, SH and BN+SH.

Run it as ``python scripts/reproduce_listops.py`` from a clone or ``primal-dual reproduce listops``
where the package is installed (the same flags; outputs relative to the current folder).

Runs variants × seeds with ``primal_dual/configs/listops.py`` (one workdir per run under
``--root``), then writes

* ``--results`` (default results/listops.json): one record per run (``RECORD_SCHEMA``): test
  accuracy after the last step (LRA's protocol), test accuracy at the best validation accuracy,
  parameter count, analytic attention FLOPs per example, wall time;
* the same path with ``.md``: mean ± std over seeds per variant, a column "reference (published,
  full scale)" with docs/maths.md §5's softmax numbers, and the full-scale commands.

Resuming: a finished run (``final_metrics.json`` in its workdir) is reused and an interrupted one
resumes from its last checkpoint, so re-running the same command only does what is missing.

Commands (from the repository root)::

  # CPU grid: PyTorch-lineage model (2 layers, d 64, 2 heads), short preset (10k/500/500, up to
  # 500 tokens), 5 variants × 3 seeds, 5000 steps each (the lineage's schedule). Measured on this
  # 2-core CPU at batch 32: a training step costs 1.3 s of CPU time for softmax, sh and bn_sh and
  # 0.7 s for linear (primal), i.e. roughly 1–1.5 h per run and 15–20 h for the grid;
  # --steps=1000 cuts that five-fold (a truncated schedule, recorded in the table).
  .venv/bin/python scripts/reproduce_listops.py

  # Full scale (accelerator): the JAX LRA model on the LRA-sized data (96k, 500–2000 tokens).
  .venv/bin/python scripts/reproduce_listops.py --setting=jax_lra --preset=full \
      --root=workdirs/listops_lra --results=results/listops_lra.json

  # Smoke test: tiny preset and model, 4 steps, softmax and sh, one seed (2 runs).
  .venv/bin/python scripts/reproduce_listops.py --quick --root=/tmp/listops_smoke \
      --results=/tmp/listops_smoke/listops.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping, Sequence

from primal_dual.experiments import grid

CONFIG_FILE = "listops"  # a packaged config (primal_dual/configs/listops.py)
DEFAULT_VARIANTS = ("softmax", "linear", "bn", "sh", "bn_sh")
QUICK_VARIANTS = ("softmax", "sh")
DEFAULT_SEEDS = (0, 1, 2)
SETTINGS = ("pytorch", "jax_lra")
PRESETS = ("short", "full")

# docs/maths.md §5, published by others at full scale (LRA data, 5000 steps): (setting, variant) → accuracy.
REFERENCE = {("jax_lra", "softmax"): 0.3637, ("pytorch", "softmax"): 0.371}
REFERENCE_HEADER = "reference (published, full scale)"

FULL_SCALE_COMMANDS = """\
## Full-scale commands (GPU/TPU)

JAX LRA setting (4 layers, d 512, 8 heads, MLP 1024, CLS pooling, batch 32, 5000 steps) on the
LRA-sized data (`preset=full`: 96k/2k/2k expressions of 500–2000 tokens; generated and prepared
with TFDS on first use, about half a minute):

```
python train.py --config=primal_dual/configs/listops.py:setting=jax_lra,preset=full,attention=softmax \\
    --workdir=workdirs/listops_lra_softmax
python scripts/reproduce_listops.py --setting=jax_lra --preset=full \\
    --root=workdirs/listops_lra --results=results/listops_lra.json
```

PyTorch-lineage setting at full scale:

```
python scripts/reproduce_listops.py --setting=pytorch --preset=full \\
    --root=workdirs/listops_pytorch_full --results=results/listops_pytorch_full.json
```
"""

_NUMBER = (int, float)
RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
  "name": (str,),
  "config_file": (str,),
  "config_arg": (str,),
  "setting": (str,),
  "preset": (str,),
  "attention": (str,),
  "seed": (int,),
  "steps": (int,),
  "quick": (bool,),
  "test_accuracy": _NUMBER,
  "selected_test_accuracy": _NUMBER,
  "best_validation_accuracy": _NUMBER,
  "selected_step": (int,),
  "num_params": (int,),
  "sequence_length": (int,),
  "attention_flops": _NUMBER,
  "attention_flops_relative": _NUMBER,
  "wall_time_s": _NUMBER,
  "metrics": (dict,),
}


def validate_record(record: Mapping[str, Any]) -> None:
  """Raises ValueError naming every field of ``RECORD_SCHEMA`` missing or of the wrong type."""
  grid.check_schema(record, RECORD_SCHEMA, "ListOps")


def build_runs(args: argparse.Namespace) -> list[grid.GridRun]:
  """The grid in seed-major order, so a half-finished grid already covers every variant."""
  config_file = CONFIG_FILE
  runs = []
  for seed in args.seeds:
    for attention in args.variants:
      config_arg = f"setting={args.setting},preset={args.preset},attention={attention},seed={seed}"
      config_arg += f",steps={args.steps}" if args.steps > 0 else ""
      config_arg += f",data_dir={args.data_dir}" if args.data_dir else ""
      config_arg += ",runlocal" if args.quick else ""
      steps = int(grid.load_config(config_file, config_arg).num_train_steps)
      preset = "tiny" if args.quick else args.preset
      runs.append(
        grid.GridRun(
          name=f"{args.setting}-{preset}-{attention}-steps{steps}-s{seed}",
          config_file=config_file,
          config_arg=config_arg,
          tags=dict(
            setting=args.setting,
            preset=preset,
            attention=attention,
            seed=seed,
            steps=steps,
            quick=bool(args.quick),
          ),
        )
      )
  return runs


def record_fn(run: grid.GridRun, metrics: Mapping[str, Any], workdir: str) -> dict[str, Any]:
  """``run_grid``'s ``record_fn``: accuracies, size and attention cost of one run."""
  del workdir
  from primal_dual.experiments import listops as listops_task  # pylint: disable=g-import-not-at-top

  summary = listops_task.model_summary(grid.load_config(run.config_file, run.config_arg))
  record = {
    "test_accuracy": float(metrics["test/accuracy"]),
    "selected_test_accuracy": float(metrics["selected/test_accuracy"]),
    "best_validation_accuracy": float(metrics["best/validation_accuracy"]),
    "selected_step": int(metrics["selected/step"]),
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
  """results/listops.md: mean ± std over seeds per variant, reference column, full-scale runs."""
  setting = records[0]["setting"]
  params = grid.first_by_variant(records, "num_params")
  flops = grid.first_by_variant(records, "attention_flops")
  relative = grid.first_by_variant(records, "attention_flops_relative")

  def reference(key: tuple) -> str:
    value = REFERENCE.get((setting, key[0]))
    return "–" if value is None else f"{100 * value:.2f}"

  columns = {
    "test acc % (last step)": grid.field("test_accuracy"),
    "test acc % (validation-selected)": grid.field("selected_test_accuracy"),
    "wall time (min)": grid.field("wall_time_s"),
  }
  extra = {
    "params": lambda key: f"{params[key[0]]:,}",
    "attention MFLOPs / example": lambda key: f"{flops[key[0]] / 1e6:.4g}",
    "attention FLOPs / softmax": lambda key: f"{relative[key[0]]:.2f}",
    REFERENCE_HEADER: reference,
  }
  presets = sorted({r["preset"] for r in records})
  steps = sorted({r["steps"] for r in records})
  seeds = sorted({r["seed"] for r in records})
  lengths = sorted({r["sequence_length"] for r in records})
  lines = [
    "# ListOps (Long Range Arena): accuracy and attention cost per variant\n",
    f"Measured by `{command}` on {grid.describe_hardware(records)}; setting `{setting}`, preset {', '.join(presets)}, "
    f"{', '.join(map(str, steps))} steps, seeds {', '.join(map(str, seeds))}. Cells are "
    "mean ± std over seeds (n runs). *Last step*: test accuracy after the final step (LRA's "
    "protocol). *Validation-selected*: test accuracy at the evaluation with the best validation "
    "accuracy. Attention FLOPs are analytic: the products inside every layer's attention kernel "
    f"for one example at the padded length ({', '.join(map(str, lengths))} tokens), "
    "multiply-add = 2, projections left out (primal_dual/analysis/flops.py); linear runs in its "
    "O(N) primal form. Wall time covers training and the periodic evaluations."
    + grid.shared_machine_note(command)
    + " Per-run records: listops.json.\n",
    f"The column *{REFERENCE_HEADER}* holds docs/maths.md §5's published softmax number for this "
    "setting, measured by others on the full LRA data (96k examples of 500–2000 tokens, 5000 "
    "steps) with their own code. "
    + (
      "It is not comparable to the runs above, which use a smaller preset (shorter "
      "sequences, less data).\n"
      if presets != ["full"] or steps != [5000]
      else "The runs above use the same data scale and schedule with this library's code.\n"
    ),
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
  parser.add_argument("--setting", choices=SETTINGS, default="pytorch")
  parser.add_argument("--preset", choices=PRESETS, default="short")
  parser.add_argument("--steps", type=int, default=-1, help="-1: the setting's (5000)")
  parser.add_argument("--data_dir", default="", help="TFDS data folder (default TFDS's)")
  parser.add_argument("--root", default="workdirs/listops_grid", help="parent of the workdirs")
  parser.add_argument(
    "--jobs", type=int, default=1, help="runs trained at once, one process each (e.g. 6 on a GPU)"
  )
  parser.add_argument(
    "--report_only",
    action="store_true",
    help="rewrite the report from the existing results JSON; train nothing",
  )
  parser.add_argument(
    "--results", default="results/listops.json", help="records; the .md goes next to it"
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="smoke test: tiny preset and model, 4 steps, 2 runs by default",
  )
  args = parser.parse_args(argv)
  grid.check_variants_and_seeds(parser, args, DEFAULT_VARIANTS, QUICK_VARIANTS, DEFAULT_SEEDS)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  runs = build_runs(args)
  print(
    f"ListOps grid: {len(runs)} runs ({len(args.variants)} variants × {len(args.seeds)} "
    f"seeds, setting {args.setting}) under {args.root}"
  )
  records = grid.records_for_report(
    runs, args.root, args.results, report_only=args.report_only, record_fn=record_fn, jobs=args.jobs
  )
  for record in records:
    validate_record(record)
  markdown_path = os.path.splitext(args.results)[0] + ".md"
  command = grid.report_command(
    "scripts/reproduce_listops.py", argv, markdown_path, report_only=args.report_only
  )
  with open(markdown_path, "w") as f:
    f.write(markdown_report(records, command))
  print(f"wrote {args.results}, {markdown_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
