"""What the HYLA paper's two studies, sRAVEN (``reproduce/sraven.py``) and fuzzy logic
(``reproduce/logic.py``), share: the plan of runs (main variants × seeds 0, 1, 2 and ablations at
seed 0), the grid flags, the per-run facts read from a workdir (learning curve, training speed),
the report's speed and environment lines, the learning-curves figure and the ``Reproduction``
built from a study module.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from reproduce import grid


# ------------------------------------------------------------------------------------------------
# The reproduction grid (``primal-dual reproduce sraven``). The fuzzy-logic grid (logic.py) uses
# its plan, flags, per-run facts and report pieces.


def sequence_grid_commands(
  task: str, *, cpu: str, paper: str, resume: str, smoke_note: str = ""
) -> str:
  """The commands part of a sequence grid's ``--help`` (this module's and logic.py's): the CPU
  preset, the paper's setup and a smoke test, each under its comment (``cpu``, ``paper``, and
  ``smoke_note`` closing the smoke test's), then the ``resume`` paragraph."""

  def comment(text: str) -> str:
    return "\n".join(f"  # {line}" for line in text.splitlines())

  return f"""Commands (from the repository root; ``primal-dual reproduce {task}`` where the package is
installed)::

{comment(cpu)}
  .venv/bin/python scripts/reproduce.py {task}

{comment(paper)}
  python scripts/reproduce.py {task} --scale=paper --root=workdirs/{task}_paper

  # Smoke test: 2 tiny runs (softmax and hyla, runlocal){smoke_note}.
  .venv/bin/python scripts/reproduce.py {task} --quick --root=/tmp/{task}_quick \\
      --results=/tmp/{task}_quick/{task}.json

{resume}
"""


# Preset → (main variants, run at every seed; ablations, run at seed 0). The paper preset runs
# the paper's baselines (its linear attention is `linear_plain`) and the other Table A1 rows.
GRID_VARIANTS = {
  "cpu": (("softmax", "linear", "hyla"), ("hyla_no_relu", "hyla_no_norm")),
  "paper": (
    ("softmax", "linear_plain", "hyla"),
    ("hyla_linear_value", "hyla_no_norm", "hyla_no_relu", "hyla_no_relu_no_norm", "hyla_softmax"),
  ),
}
SEEDS = (0, 1, 2)
QUICK_VARIANTS = ("softmax", "hyla")


def grid_plan(quick: bool, preset: str = "cpu") -> list[tuple[str, int]]:
  """(attention, seed) pairs: main variants × 3 seeds, then the ablations × seed 0."""
  if quick:
    return [(attention, 0) for attention in QUICK_VARIANTS]
  main, ablations = GRID_VARIANTS[preset]
  return [(attention, seed) for seed in SEEDS for attention in main] + [
    (attention, 0) for attention in ablations
  ]


def build_runs(
  config_file: str,
  task: str,
  preset: str,
  quick: bool,
  steps: int,
  steps_per_call: int = 1,
  seeds_together: bool = False,
) -> list[grid.GridRun]:
  """The grid's ``GridRun``s; ``quick`` uses the configs' ``runlocal``.

  One run per (attention, seed); with ``seeds_together``, one run per attention trains its seeds
  as replicas in one program (batches made on the device). ``steps_per_call > 1`` (or
  ``seeds_together``) trains on device-made batches, that many steps per jitted call.
  """
  label = "quick" if quick else preset
  overrides = (
    {"train_data_on_device": True, "steps_per_call": steps_per_call}
    if steps_per_call > 1 or seeds_together
    else {}
  )
  seeds_by_variant: dict[str, list[int]] = {}
  for attention, seed in grid_plan(quick, preset):
    seeds_by_variant.setdefault(attention, []).append(seed)
  runs = []
  for attention, seeds in seeds_by_variant.items():
    groups = [tuple(seeds)] if seeds_together and len(seeds) > 1 else [(s,) for s in seeds]
    for group in groups:
      config_arg = grid.config_argument(
        dict(preset=preset, attention=attention, seed=group[0]), dict(steps=steps), runlocal=quick
      )
      together = len(group) > 1
      runs.append(
        grid.GridRun(
          name=f"{task}_{label}_{attention}_s{'-'.join(map(str, group))}",
          config_file=config_file,
          config_arg=config_arg,
          tags=dict(attention=attention, preset=label, **({} if together else {"seed": group[0]})),
          overrides=overrides,
          replica_seeds=group if together else (),
        )
      )
  return runs


def sequence_grid_runs(task: str, args: argparse.Namespace) -> list[grid.GridRun]:
  """``build_runs`` of the task's packaged config with the flags of ``add_sequence_grid_arguments``."""
  return build_runs(
    task, task, args.preset, args.quick, args.steps, args.steps_per_call, args.seeds_together
  )


# The flags of the sRAVEN and fuzzy-logic grids: flag → add_argument options.
SEQUENCE_GRID_FLAGS: dict[str, dict[str, Any]] = {
  "--scale": dict(dest="preset", choices=("cpu", "paper"), default="cpu", help="the preset="),
  "--steps": dict(type=int, default=-1, help="override the preset's steps"),
  "--steps_per_call": dict(
    type=int,
    default=1,
    help="optimizer steps per jitted call (> 1: batches made on the device); "
    "must divide the preset's log/eval/checkpoint periods (e.g. 125)",
  ),
  "--seeds_together": dict(
    action="store_true", help="train each variant's seeds as replicas of one program (config.seeds)"
  ),
}


# ------------------------------------------------------------------------------------------------
# Per-run facts read from the workdir (shared with the fuzzy-logic grid).


def read_jsonl(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def learning_curve(workdir: str, names: Sequence[str]) -> dict[str, list]:
  """``{'step': [...], name: [...]}`` from every evaluation record of ``metrics.jsonl``."""
  records = [
    r
    for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if all(r.get(name) is not None for name in names)
  ]
  curve = {"step": [int(r["step"]) for r in records]}
  curve.update({name: [float(r[name]) for r in records] for name in names})
  return curve


def median_steps_per_second(workdir: str) -> float | None:
  """Median logged training speed, leaving out the first log period (it includes compilation)."""
  speeds = [
    r["train/steps_per_second"]
    for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if r.get("train/steps_per_second") is not None
  ]
  if not speeds:
    return None
  return float(np.median(speeds[1:] if len(speeds) > 1 else speeds))


class CurveFigure(NamedTuple):
  """A grid's learning-curves figure: its title, y axis, and the titles of the panels of the
  first ``CURVE_METRICS`` (one panel each)."""

  title: str
  ylabel: str
  panel_titles: tuple[str, ...]


def progress_fields(workdir: str, curve_metrics: Sequence[str]) -> dict[str, Any]:
  """A run's learning curve of ``curve_metrics`` and its median training speed (shared with
  logic.py's records)."""
  return {
    "curve": learning_curve(workdir, curve_metrics),
    "steps_per_second": median_steps_per_second(workdir),
  }


# ------------------------------------------------------------------------------------------------
# Report (shared with the fuzzy-logic grid).


def speed_ratio(
  records: Sequence[Mapping[str, Any]], numerator: str = "hyla", denominator: str = "softmax"
) -> float | None:
  """Step time of ``numerator`` over that of ``denominator`` (mean steps/s over their runs)."""

  def mean_speed(attention):
    speeds = [
      r["steps_per_second"]
      for r in records
      if r["attention"] == attention and r.get("steps_per_second")
    ]
    return float(np.mean(speeds)) if speeds else None

  slow, fast = mean_speed(numerator), mean_speed(denominator)
  if not slow or not fast:
    return None
  return fast / slow  # time per step ∝ 1 / speed


def speed_ratio_line(records: Sequence[Mapping[str, Any]]) -> str:
  """The report's sentence on HYLA's step time relative to softmax's."""
  ratio = speed_ratio(records)
  if not ratio:
    return "HYLA/softmax step-time ratio: not available (needs runs of both)."
  return (
    f"HYLA's training step takes {ratio:.2f}× the time of softmax attention's on the same model "
    "(mean logged steps/s over runs, compilation excluded)."
  )


def environment_line(command: str, records: Sequence[Mapping[str, Any]]) -> str:
  return (
    f"Measured by `{command}` on {grid.describe_hardware(records)}."
    + grid.shared_machine_note(command)
  )


def plot_curves(
  records: Sequence[Mapping[str, Any]],
  panels: Mapping[str, str],
  path: str,
  ylabel: str,
  title: str,
) -> str:
  """One panel per metric (title → curve key), one line per run, coloured by attention."""
  from primal_dual.analysis import plots  # pylint: disable=g-import-not-at-top

  plt = plots.pyplot()
  variants = list(dict.fromkeys(r["attention"] for r in records))
  colours = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
  figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
  for axis, (panel_title, key) in zip(axes[0], panels.items()):
    seen = set()
    for record in records:
      curve = record["curve"]
      label = None if record["attention"] in seen else record["attention"]
      seen.add(record["attention"])
      axis.plot(
        curve["step"], curve[key], color=colours[record["attention"]], alpha=0.8, label=label
      )
    axis.set_title(panel_title)
    axis.set_xlabel("training step")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=8)
  figure.suptitle(title)
  figure.tight_layout()
  return plots.save_figure(figure, path, dpi=100, tight_bbox=False)


def write_curves(
  records: Sequence[Mapping[str, Any]],
  args: argparse.Namespace,
  *,
  panels: Mapping[str, str],
  ylabel: str,
  title: str,
) -> list[str]:
  """The learning-curves figure, ``<--results without .json>_curves.png``."""
  path = os.path.splitext(args.results)[0] + "_curves.png"
  return [plot_curves(records, panels, path, ylabel, title)]


def sequence_reproduction(module_name: str, summary: str) -> grid.Reproduction:
  """The grid of a sequence task (this module's or logic.py's, named by ``module_name``): the
  shared plan and flags, and the learning-curves figure of the module's ``CURVE_FIGURE``."""
  task = module_name.rpartition(".")[2]
  module = sys.modules[module_name]
  figure = module.CURVE_FIGURE
  return grid.module_reproduction(
    module_name,
    task=task,
    summary=summary,
    quick="2 tiny runs (softmax, hyla; the configs' runlocal)",
    build_runs=functools.partial(sequence_grid_runs, task),
    write_figures=functools.partial(
      write_curves,
      panels=dict(zip(figure.panel_titles, module.CURVE_METRICS)),
      ylabel=figure.ylabel,
      title=figure.title,
    ),
  )
