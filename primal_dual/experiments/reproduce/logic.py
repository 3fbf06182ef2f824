r"""Reproduce the fuzzy-logic comparison: HYLA against softmax and linear attention (R²).

Run it as ``python scripts/reproduce_logic.py`` from a clone or ``primal-dual reproduce logic``
where the package is installed (the same flags; outputs relative to the current folder).

Runs the grid (``primal_dual/configs/logic.py``, one workdir per run under ``--root``): the preset's
main variants × seeds 0, 1, 2 and its ablations × seed 0 (``reproduce.sraven.GRID_VARIANTS``). For
every run it records R² on ``test`` (held-out combinations of seen conjunctions: the HYLA paper's
OOD), ``ood`` (held-out conjunctions) and ``validation`` at the checkpoint selected on validation R²
(both definitions: against each task's variance, and the paper's per-sequence mean), the last
evaluation's values, the learning curve, the median logged steps/s (first log period, which includes
compilation, left out) and the wall time; it writes ``<out>/logic.json``, ``<out>/logic.md`` (mean ±
std over seeds, HYLA/softmax step-time ratio, the GPU command for the reference scale) and
``<out>/logic_curves.png``.

Commands (from the repository root)::

  # CPU preset: 11 runs of 6000 steps; softmax ~7 min per run at the speed measured under load
  # (primal_dual/configs/logic.py), HYLA ~3× that: ~2.5-3 h in all (estimated from those speeds).
  .venv/bin/python scripts/reproduce_logic.py

  # The paper's setup (primal_dual/configs/logic.py `paper`: 50k steps of batch 128), for an
  # accelerator.
  python scripts/reproduce_logic.py --preset=paper --root=workdirs/logic_paper

  # Smoke test: 2 tiny runs (softmax and hyla, runlocal).
  .venv/bin/python scripts/reproduce_logic.py --quick --root=/tmp/logic_quick \
      --out=/tmp/logic_quick

Re-running the same command resumes (finished runs are reused, unfinished ones continue).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Sequence

from primal_dual.experiments import grid
from primal_dual.experiments.reproduce import sraven as common

CONFIG_FILE = "logic"  # a packaged config (primal_dual/configs/logic.py)
RESULTS_STEM = "logic"
CURVE_METRICS = ("test/r2", "ood/r2", "validation/r2")
REFERENCE_COMMAND = (
  "python scripts/reproduce_logic.py --preset=paper --root=workdirs/logic_paper --out=results/paper"
)
REFERENCE_SINGLE_RUN = (
  "python train.py --config=primal_dual/configs/logic.py:preset=paper,"
  "attention=hyla,seed=0 --workdir=workdirs/logic_paper_hyla"
)


def record_fn(run: grid.GridRun, metrics: Mapping[str, Any], workdir: str) -> dict[str, Any]:
  """``run_grid``'s ``record_fn``: R² of the selected checkpoint, curve and speed of a run."""
  del run
  return {
    "test_r2": float(metrics["selected/test_r2"]),
    "ood_r2": float(metrics["selected/ood_r2"]),
    "validation_r2": float(metrics["selected/validation_r2"]),
    "test_mse": float(metrics["selected/test_mse"]),
    "test_r2_per_sequence": float(metrics["selected/test_r2_per_sequence"]),
    "ood_r2_per_sequence": float(metrics["selected/ood_r2_per_sequence"]),
    "selected_step": int(metrics["selected/step"]),
    "final_test_r2": float(metrics["test/r2"]),
    "final_ood_r2": float(metrics["ood/r2"]),
    "curve": common.learning_curve(workdir, CURVE_METRICS),
    "steps_per_second": common.median_steps_per_second(workdir),
  }


def markdown_report(records: Sequence[Mapping[str, Any]], command: str) -> str:
  columns = {
    "validation R²": grid.field("validation_r2"),
    "test R² (unseen combinations)": grid.field("test_r2"),
    "OOD R² (held-out conjunctions)": grid.field("ood_r2"),
    "OOD R² last eval": grid.field("final_ood_r2"),
    "test R² per sequence (paper's R²)": grid.field("test_r2_per_sequence"),
    "OOD R² per sequence": grid.field("ood_r2_per_sequence"),
    "steps/s": grid.field("steps_per_second"),
    "wall time (min)": grid.field("wall_time_s"),
  }
  scales = {name: 1.0 for name in columns}
  scales["wall time (min)"] = 1 / 60
  ratio = common.speed_ratio(records)
  ratio_line = (
    "HYLA's training step takes "
    f"{ratio:.2f}× the time of softmax attention's on the same model (mean logged "
    "steps/s over runs, compilation excluded)."
    if ratio
    else "HYLA/softmax step-time ratio: not available (needs runs of both)."
  )
  presets = sorted({str(r["preset"]) for r in records})
  lines = [
    "# Fuzzy logic: in-context regression, HYLA against softmax and linear attention\n",
    common.environment_line(command, records) + f" Preset: {', '.join(presets)} "
    "(primal_dual/configs/logic.py). Cells are mean ± std over seeds (n runs), at the checkpoint selected on validation R². "
    "R² = 1 − Σ squared error / Σ task variance (exact variance of each task's target; 0 = "
    "predicting each task's mean, 1 = perfect). Per-run records and learning curves: the .json "
    "of the same name; curves: the _curves.png next to it.\n",
    grid.summary_table(records, ("attention",), columns, scales),
    "\n" + ratio_line + "\n",
    "\n## Reference scale (accelerator)\n",
    "The HYLA paper's setup (model d 128, 8 heads of q/k/v width 16, 2 layers; n = 4 "
    "variables, 2 terms, sequences of 32, 70% of the term sets held out; 50k steps of batch "
    "128) is the `paper` preset, meant for an accelerator:\n",
    f"```\n{REFERENCE_COMMAND}\n# or a single run:\n{REFERENCE_SINGLE_RUN}\n```\n",
  ]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  args = common.parse_args(argv, __doc__.split("\n\n")[0])
  root = args.root or os.path.join("workdirs", f"logic_{'quick' if args.quick else args.preset}")
  stem = RESULTS_STEM + ("_quick" if args.quick else "")
  runs = common.build_runs(
    CONFIG_FILE,
    "logic",
    args.preset,
    args.quick,
    args.steps,
    args.steps_per_call,
    args.seeds_together,
  )
  print(f"Fuzzy-logic grid: {len(runs)} runs under {root}")
  records = grid.records_for_report(
    runs,
    root,
    os.path.join(args.out, f"{stem}.json"),
    report_only=args.report_only,
    record_fn=record_fn,
    jobs=args.jobs,
  )
  command = grid.report_command(
    "scripts/reproduce_logic.py",
    argv,
    os.path.join(args.out, f"{stem}.md"),
    report_only=args.report_only,
  )
  paths = common.write_report(
    records,
    args.out,
    stem,
    markdown_report(records, command),
    lambda path: common.plot_curves(
      records,
      {
        "unseen combinations (test)": CURVE_METRICS[0],
        "held-out conjunctions (ood)": CURVE_METRICS[1],
      },
      path,
      "R²",
      "Fuzzy-logic learning curves",
    ),
  )
  print("\n".join(f"wrote {path}" for path in paths.values()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
