"""The fuzzy-logic study of "Attention as a Hypernetwork": in-context regression (R² on held-out
term combinations and conjunctions) of HYLA against softmax and linear attention and the paper's
ablations (``primal-dual reproduce logic``). The fixed-setting grid and the paper's sweep protocol
come from ``hyla_paper``; the task is ``primal_dual/tasks/logic.py``; the setup is compared with
the paper's code in ``docs/reproduction.md``.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Sequence


from reproduce import grid
from reproduce import hyla_paper


# ------------------------------------------------------------------------------------------------
# The reproduction grid (``primal-dual reproduce logic``): sRAVEN's plan, flags and report pieces.

GRID_COMMANDS = r"""
Runs the grid (``primal_dual/configs/logic.py``, one workdir per run under ``--root``): the preset's
main variants × seeds 0, 1, 2 and its ablations × seed 0 (``sraven.GRID_VARIANTS``). For
every run it records R² on ``test`` (held-out combinations of seen conjunctions: the HYLA paper's
OOD), ``ood`` (held-out conjunctions) and ``validation`` at the checkpoint selected on validation R²
(both definitions: against each task's variance, and the paper's per-sequence mean), the last
evaluation's values, the learning curve, the median logged steps/s (first log period, which includes
compilation, left out) and the wall time; it writes ``--results`` (default results/logic.json), the
same path with ``.md`` (mean ± std over seeds, HYLA/softmax step-time ratio, the GPU command for
the reference scale) and with ``_curves.png``.

""" + hyla_paper.sequence_grid_commands(
  "logic",
  cpu="""CPU preset: 11 runs of 6000 steps; softmax ~7 min per run at the speed measured under load
(primal_dual/configs/logic.py), HYLA ~3× that: ~2.5-3 h in all (estimated from those speeds).""",
  paper="""The paper's setup (primal_dual/configs/logic.py `paper`: 50k steps of batch 128), for an
accelerator.""",
  resume="Re-running the same command resumes (finished runs are reused, unfinished ones continue).",
)
CURVE_METRICS = ("test/r2", "ood/r2", "validation/r2")
CURVE_FIGURE = hyla_paper.CurveFigure(
  title="Fuzzy-logic learning curves",
  ylabel="R²",
  panel_titles=("unseen combinations (test)", "held-out conjunctions (ood)"),
)
REFERENCE_COMMAND = (
  "python scripts/reproduce.py logic --scale=paper --root=workdirs/logic_paper "
  "--results=results/paper/logic.json"
)
REFERENCE_SINGLE_RUN = (
  "python train.py --config=primal_dual/configs/logic.py:preset=paper,"
  "attention=hyla,seed=0 --workdir=workdirs/logic_paper_hyla"
)


# Record fields holding the metric of the same name at the selected checkpoint (selected/<name>).
SELECTED_FIELDS = (
  "test_r2",
  "ood_r2",
  "validation_r2",
  "test_mse",
  "test_r2_per_sequence",
  "ood_r2_per_sequence",
)


def record_fn(
  run: grid.GridRun, metrics: Mapping[str, Any], workdir: str, args: argparse.Namespace
) -> dict[str, Any]:
  """A record's task fields: R² of the selected checkpoint, curve and speed of a run."""
  del run, args
  return {
    **{name: float(metrics[f"selected/{name}"]) for name in SELECTED_FIELDS},
    "selected_step": int(metrics["selected/step"]),
    "final_test_r2": float(metrics["test/r2"]),
    "final_ood_r2": float(metrics["ood/r2"]),
    **hyla_paper.progress_fields(workdir, CURVE_METRICS),
  }


# The paper's Table A1 (test R² per sequence on held-out combinations, %, mean ± s.e. over 3
# seeds), for the report's reference column.
REFERENCES = {"hyla": "81.13 ± 7.77", "softmax": "63.28 ± 2.31", "linear_plain": "59.89 ± 5.22"}
# The --protocol=paper_sweep table's columns: header → record field.
SWEEP_COLUMNS = {
  "test R² per sequence %": "test_r2_per_sequence",
  "test R² %": "test_r2",
  "OOD R² %": "ood_r2",
}


def sweep_section(records: Sequence[Mapping[str, Any]]) -> str:
  """The ``--protocol=paper_sweep`` and ``--protocol=points`` parts of the report (empty without
  their records)."""
  return "".join(
    hyla_paper.sweep_report(
      records,
      validation_field="validation_r2",
      columns=SWEEP_COLUMNS,
      references=REFERENCES,
      reference_column="test R² per sequence % (Table A1)",
      protocol=protocol,
    )
    for protocol in hyla_paper.SELECTING_PROTOCOLS
  )


def markdown_report(records: Sequence[Mapping[str, Any]], command: str) -> str:
  sweep = sweep_section(records)
  fixed = hyla_paper.fixed_records(records)
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
  presets = sorted({str(r["preset"]) for r in records})
  lines = [
    "# Fuzzy logic: in-context regression, HYLA against softmax and linear attention\n",
    hyla_paper.environment_line(command, records) + f" Preset: {', '.join(presets)} "
    "(primal_dual/configs/logic.py). Fixed-setting cells are mean ± std over seeds (n runs; the "
    "sweep sections below give mean ± standard error), at the checkpoint selected on "
    "validation R². "
    "R² = 1 − Σ squared error / Σ task variance (exact variance of each task's target; 0 = "
    "predicting each task's mean, 1 = perfect). Per-run records and learning curves: the .json "
    "of the same name; curves: the _curves.png next to it.\n",
    grid.summary_table(fixed, ("attention",), columns, scales)
    if fixed
    else "(No fixed-setting runs: see the paper's protocol below.)\n",
    "\n" + hyla_paper.speed_ratio_line(records) + "\n",
    "\n## Reference scale (accelerator)\n",
    "The HYLA paper's setup (model d 128, 8 heads of q/k/v width 16, 2 layers; n = 4 "
    "variables, 2 terms, sequences of 32, 70% of the term sets held out; 50k steps of batch "
    "128) is the `paper` preset, meant for an accelerator:\n",
    f"```\n{REFERENCE_COMMAND}\n# or a single run:\n{REFERENCE_SINGLE_RUN}\n```\n",
    sweep,
  ]
  return "\n".join(lines)


FLAGS = hyla_paper.SEQUENCE_GRID_FLAGS
REPRODUCTION = hyla_paper.sequence_reproduction(
  __name__, "The fuzzy-logic comparison: HYLA against softmax and linear attention (R²)."
)
