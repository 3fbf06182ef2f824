r"""Reproduce the sRAVEN claim: HYLA against softmax and linear attention on held-out rule combos.

Run it as ``python scripts/reproduce_sraven.py`` from a clone or ``primal-dual reproduce sraven``
where the package is installed (the same flags; outputs relative to the current folder).

Runs the grid (``primal_dual/configs/sraven.py``, one workdir per run under ``--root``):
the preset's main variants × seeds 0, 1, 2 and its ablations × seed 0 (``GRID_VARIANTS``: for
``cpu`` softmax, linear, hyla and hyla_no_relu, hyla_no_norm; for ``paper`` the paper's baselines
softmax, linear_plain, hyla and the other Table A1 rows). The fuzzy-logic grid uses the same plan.
For every run it records

* in-distribution (``test``) and OOD (``ood``, held-out rule combinations) whole-panel accuracy of
  the checkpoint selected on ``validation`` (never on OOD), plus the last evaluation's values;
* the learning curve (every evaluation in the run's ``metrics.jsonl``);
* latent-code decoding accuracy (``primal_dual/analysis/latent_code.py``, on the OOD split, at
  the selected checkpoint; cached in the workdir as ``latent_code.json``);
* training speed: the median of the logged ``train/steps_per_second`` after the first log period
  (which includes compilation), and the wall time of the run;

and writes ``<out>/sraven.json`` (one record per run), ``<out>/sraven.md`` (mean ± std over seeds,
HYLA's step time relative to softmax's, the GPU command for the reference scale) and
``<out>/sraven_curves.png``.

Commands (from the repository root)::

  # CPU preset: 11 runs of 12k steps. At the speeds measured on this 2-core CPU under a load
  # average of 6-8 (primal_dual/configs/sraven.py): softmax ~12 min, HYLA and its ablations
  # ~35 min per run; linear ~20 min (estimated from its step time, 76 ms vs softmax's 42 ms): ~4.5 h in all.
  .venv/bin/python scripts/reproduce_sraven.py

  # The paper's setup (primal_dual/configs/sraven.py `paper`, 156,250 steps of batch 128): an
  # accelerator.
  python scripts/reproduce_sraven.py --preset=paper --root=workdirs/sraven_paper

  # Smoke test: 2 tiny runs (softmax and hyla, runlocal), seconds each.
  .venv/bin/python scripts/reproduce_sraven.py --quick --root=/tmp/sraven_quick \
      --out=/tmp/sraven_quick

Re-running the same command resumes: finished runs are not trained again, an interrupted one
continues from its last checkpoint, and cached analyses are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from primal_dual.experiments import grid

CONFIG_FILE = "sraven"  # a packaged config (primal_dual/configs/sraven.py)
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
LATENT_CACHE = "latent_code.json"
RESULTS_STEM = "sraven"
REFERENCE_COMMAND = (
  "python scripts/reproduce_sraven.py --preset=paper "
  "--root=workdirs/sraven_paper --out=results/paper"
)
REFERENCE_SINGLE_RUN = (
  "python train.py --config=primal_dual/configs/sraven.py:preset=paper,"
  "attention=hyla,seed=0 --workdir=workdirs/sraven_paper_hyla"
)


# ------------------------------------------------------------------------------------------------
# The grid.


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
      config_arg = f"preset={preset},attention={attention},seed={group[0]}"
      config_arg += f",steps={steps}" if steps > 0 else ""
      config_arg += ",runlocal" if quick else ""
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


# ------------------------------------------------------------------------------------------------
# Per-run facts read from the workdir (shared with reproduce_logic.py).


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


def restore_for_analysis(workdir: str, checkpoint: str = "selected"):
  """``(experiment, state)`` of a workdir's checkpoint, without re-generating the train split.

  Same as ``trainer.restore_workdir`` except that the train split is read on the fly instead of
  generated up front (only its first record is read, for the model's input shape); model,
  evaluation splits and optimizer state shapes are those of the run.
  """
  from primal_dual.training import checkpointing  # pylint: disable=g-import-not-at-top
  from primal_dual.training import config_lib  # pylint: disable=g-import-not-at-top
  from primal_dual.training import trainer  # pylint: disable=g-import-not-at-top

  config = config_lib.read_config(workdir)
  config.data.materialize_train = False
  experiment = trainer.build_experiment(trainer.resolve_config(config))
  directory = (
    checkpointing.SELECTED_DIR if checkpoint == "selected" else (checkpointing.CHECKPOINT_DIR)
  )
  with checkpointing.Checkpointer(
    os.path.join(workdir, directory), keep=None, async_save=False
  ) as checkpointer:
    state, _ = checkpointer.restore(None, experiment.restore_target())
  return experiment, state


def cached_latent_code(
  workdir: str, metrics: Mapping[str, Any], max_examples: int
) -> dict[str, Any]:
  """The latent-code analysis of the selected checkpoint, cached in ``latent_code.json``."""
  key = [metrics.get("step"), metrics.get("selected/step"), max_examples]
  path = os.path.join(workdir, LATENT_CACHE)
  if os.path.exists(path):
    with open(path) as f:
      cached = json.load(f)
    if cached.get("cache_key") == key:
      return cached["analysis"]
  from primal_dual.analysis import latent_code  # pylint: disable=g-import-not-at-top

  experiment, state = restore_for_analysis(workdir, "selected")
  analysis = latent_code.run(
    experiment, state, split="ood", max_examples=max_examples, out_dir=workdir
  )
  with open(path + ".tmp", "w") as f:
    json.dump({"cache_key": key, "analysis": analysis}, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)
  return analysis


CURVE_METRICS = (
  "test/whole_panel_accuracy",
  "ood/whole_panel_accuracy",
  "validation/whole_panel_accuracy",
)


def make_record_fn(max_examples: int) -> Callable[..., dict[str, Any]]:
  """``run_grid``'s ``record_fn``: accuracies, curve, latent decoding and speed of a run."""

  def record_fn(run: grid.GridRun, metrics: Mapping[str, Any], workdir: str) -> dict[str, Any]:
    latent = cached_latent_code(workdir, metrics, max_examples)
    return {
      "id_whole_panel": float(metrics["selected/test_whole_panel_accuracy"]),
      "ood_whole_panel": float(metrics["selected/ood_whole_panel_accuracy"]),
      "id_feature": float(metrics["selected/test_feature_accuracy"]),
      "ood_feature": float(metrics["selected/ood_feature_accuracy"]),
      "selected_step": int(metrics["selected/step"]),
      "final_id_whole_panel": float(metrics["test/whole_panel_accuracy"]),
      "final_ood_whole_panel": float(metrics["ood/whole_panel_accuracy"]),
      "curve": learning_curve(workdir, CURVE_METRICS),
      "steps_per_second": median_steps_per_second(workdir),
      "latent_decoding": (latent.get("best_layer_accuracy") if latent.get("available") else None),
      "latent_decoding_chance": (
        latent["per_layer"][0]["chance"] if latent.get("available") else None
      ),
      "latent_code": latent,
    }

  return record_fn


# ------------------------------------------------------------------------------------------------
# Report (shared with reproduce_logic.py).


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


def markdown_report(records: Sequence[Mapping[str, Any]], command: str, chance: float) -> str:
  columns = {
    "ID whole-panel %": grid.field("id_whole_panel"),
    "OOD whole-panel %": grid.field("ood_whole_panel"),
    "OOD feature %": grid.field("ood_feature"),
    "OOD last eval %": grid.field("final_ood_whole_panel"),
    "latent decoding %": grid.field("latent_decoding"),
    "decoding chance %": grid.field("latent_decoding_chance"),
    "steps/s": grid.field("steps_per_second"),
    "wall time (min)": grid.field("wall_time_s"),
  }
  scales = {"steps/s": 1.0, "wall time (min)": 1 / 60}
  ratio = speed_ratio(records)
  ratio_line = (
    "HYLA's training step takes "
    f"{ratio:.2f}× the time of softmax attention's on the same model (mean logged "
    "steps/s over runs, compilation excluded)."
    if ratio
    else "HYLA/softmax step-time ratio: not available (needs runs of both)."
  )
  presets = sorted({str(r["preset"]) for r in records})
  lines = [
    "# sRAVEN: compositional generalisation of HYLA, softmax and linear attention\n",
    environment_line(command, records) + f" Preset: {', '.join(presets)} "
    "(primal_dual/configs/sraven.py). Cells are mean ± std over seeds (n runs). Accuracies are "
    "those of the checkpoint selected on the "
    "in-distribution validation split: ID = the in-distribution test split, OOD = problems "
    "whose rule combination was held out of training. Whole-panel accuracy is the exact match "
    f"of every feature of the answer panel; chance is {100 * chance:.2f}%. Latent decoding: "
    "accuracy of a ridge decoder reading each feature's rule from the attention weights across "
    "heads (best layer, fitted on half of the OOD problems, scored on the other half; "
    "primal_dual/analysis/latent_code.py); its chance is the majority rule. Per-run records and "
    "learning curves: the .json of the same name; curves: the _curves.png next to it.\n",
    grid.summary_table(records, ("attention",), columns, scales),
    "\n" + ratio_line + "\n",
    "\n## Reference scale (accelerator)\n",
    "The HYLA paper's setup (F = 4, V = 8, 8 rules, shuffled slots; d 128, 16 heads of q/k/v "
    "width 64, 4 layers; 156,250 steps of batch 128) is the `paper` preset, meant for an "
    "accelerator:\n",
    f"```\n{REFERENCE_COMMAND}\n# or a single run:\n{REFERENCE_SINGLE_RUN}\n```\n",
    "\nPublished claim (reference, not measured here): HYLA ahead of softmax and linear "
    "attention on OOD whole-panel accuracy (Schug et al.).\n",
  ]
  return "\n".join(lines)


def whole_panel_chance(config_file: str, config_arg: str) -> float:
  """``V^−F``: the whole-panel accuracy of guessing uniformly."""
  config = grid.load_config(config_file, config_arg)
  return float(config.data.num_values) ** -float(config.data.num_features)


def write_report(
  records: Sequence[Mapping[str, Any]],
  out_dir: str,
  stem: str,
  markdown: str,
  plot: Callable[[str], str],
) -> dict[str, str]:
  """Writes ``<stem>.json``, ``<stem>.md`` and the curves figure; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {
    "json": os.path.join(out_dir, f"{stem}.json"),
    "md": os.path.join(out_dir, f"{stem}.md"),
    "png": os.path.join(out_dir, f"{stem}_curves.png"),
  }
  with open(paths["json"], "w") as f:
    json.dump(list(records), f, indent=1, sort_keys=True)
  with open(paths["md"], "w") as f:
    f.write(markdown)
  plot(paths["png"])
  return paths


# ------------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: Sequence[str] | None, description: str) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=description, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--preset", choices=("cpu", "paper"), default="cpu")
  parser.add_argument(
    "--quick",
    action="store_true",
    help="2 tiny runs (softmax, hyla; the configs' runlocal) for smoke tests",
  )
  parser.add_argument("--steps", type=int, default=-1, help="override the preset's steps")
  parser.add_argument(
    "--steps_per_call",
    type=int,
    default=1,
    help="optimizer steps per jitted call (> 1: batches made on the device); "
    "must divide the preset's log/eval/checkpoint periods (e.g. 125)",
  )
  parser.add_argument(
    "--seeds_together",
    action="store_true",
    help="train each variant's seeds as replicas of one program (config.seeds)",
  )
  parser.add_argument("--root", default="", help="parent of the runs' workdirs")
  parser.add_argument(
    "--jobs", type=int, default=1, help="runs trained at once, one process each (e.g. 6 on a GPU)"
  )
  parser.add_argument("--out", default="results", help="folder of the JSON, Markdown and figure")
  parser.add_argument(
    "--max_examples",
    type=int,
    default=1024,
    help="OOD problems used by the latent-code analysis (sRAVEN only)",
  )
  parser.add_argument(
    "--report_only",
    action="store_true",
    help="rewrite the report from the existing results JSON; train nothing",
  )
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv, __doc__.split("\n\n")[0])
  root = args.root or os.path.join("workdirs", f"sraven_{'quick' if args.quick else args.preset}")
  stem = RESULTS_STEM + ("_quick" if args.quick else "")
  runs = build_runs(
    CONFIG_FILE,
    "sraven",
    args.preset,
    args.quick,
    args.steps,
    args.steps_per_call,
    args.seeds_together,
  )
  print(f"sRAVEN grid: {len(runs)} runs under {root}")
  results_json = os.path.join(args.out, f"{stem}.json")
  records = grid.records_for_report(
    runs,
    root,
    results_json,
    report_only=args.report_only,
    record_fn=make_record_fn(args.max_examples),
    jobs=args.jobs,
  )
  command = grid.report_command(
    "scripts/reproduce_sraven.py",
    argv,
    os.path.join(args.out, f"{stem}.md"),
    report_only=args.report_only,
  )
  chance = whole_panel_chance(runs[0].config_file, runs[0].config_arg)
  paths = write_report(
    records,
    args.out,
    stem,
    markdown_report(records, command, chance),
    lambda path: plot_curves(
      records,
      {
        "in-distribution (test)": CURVE_METRICS[0],
        "held-out rule combinations (ood)": CURVE_METRICS[1],
      },
      path,
      "whole-panel accuracy",
      "sRAVEN learning curves",
    ),
  )
  print("\n".join(f"wrote {path}" for path in paths.values()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
