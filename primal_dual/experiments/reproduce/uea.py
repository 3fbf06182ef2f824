r"""Reproduce the time-series claims: UEA accuracy and head redundancy of softmax, BN, SH and BN+SH.

Run it as ``python scripts/reproduce_uea.py`` from a clone or ``primal-dual reproduce uea``
where the package is installed (the same flags; outputs relative to the current folder).

Runs the grid data sets × variants × seeds × protocols with ``primal_dual/configs/uea.py`` (one
workdir per run under ``--root``), then for every run computes head redundancy on the test split,
parameter count and analytic attention FLOPs, and writes

* ``--results`` (default results/uea.json): one record per run (``RECORD_SCHEMA``);
* the same path with ``.md``: mean ± std over seeds per data set × variant, one table per
  protocol, with the published number in a column labelled "reference (published, best-test)";
* ``uea_redundancy.png`` (head distance per variant) and ``uea_attention_maps.png`` (one test
  example, heads × layers, softmax and bn_sh) next to it.

Resuming: a run whose workdir holds ``final_metrics.json`` is not trained again, an interrupted
one resumes from its last checkpoint, and a run's analysis is cached in its workdir
(``uea_analysis.json``), so re-running the same command only does what is missing.

Which numbers: ``test_accuracy`` is ``best/test_accuracy`` (best over epochs, optimistic) under
``best_test`` and ``selected/test_accuracy`` (checkpoint chosen on validation) under ``clean``.
Head redundancy is computed on the first ``--redundancy_examples`` (default 512; JapaneseVowels
has 370, BasicMotions 40, so all of them) test examples, at the final checkpoint (``best_test``)
or the selected one (``clean``); definition in ``primal_dual/analysis/redundancy.py``.

Commands (from the repository root)::

  # CPU budget: the primal_dual/configs/default.py model (d 64, 4 heads), 100 epochs, on the data
  # sets found (JapaneseVowels and BasicMotions offline): 2 × 6 × 3 × 2 = 72 runs, about 2 h on 2 cores
  # (measured step times: JapaneseVowels ~1 s per epoch, BasicMotions ~0.3 s, plus ~20 s of
  # compilation and ~10 s of analysis per run).
  .venv/bin/python scripts/reproduce_uea.py --model_size=small

  # The protocol's reference model (d 512, 8 heads): about 16 s per JapaneseVowels epoch and 8 s
  # per BasicMotions epoch on 2 cores, i.e. about a day for the same 72 runs (an accelerator is
  # the place for it); add --manual_dir=<folder with <Name>/<Name>_{TRAIN,TEST}.ts> for the
  # other data sets of the protocol.
  .venv/bin/python scripts/reproduce_uea.py --model_size=reference

  # List the runs (and which are finished) without training anything.
  .venv/bin/python scripts/reproduce_uea.py --model_size=small --dry_run

  # Smoke test (tiny model, 2 epochs): seconds per run.
  .venv/bin/python scripts/reproduce_uea.py --runlocal --root=/tmp/uea_smoke \
      --results=/tmp/uea_smoke/uea.json --variants=softmax,bn_sh --seeds=0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from primal_dual.configs import uea as uea_config
from primal_dual.experiments import grid

CONFIG_FILE = "uea"  # a packaged config (primal_dual/configs/uea.py)
DEFAULT_VARIANTS = ("softmax", "bn", "sh", "bn_sh", "linear", "linear_bn")
DEFAULT_SEEDS = (0, 1, 2)
ANALYSIS_FILE = "uea_analysis.json"
REDUNDANCY_PLOT = "uea_redundancy.png"
MAPS_PLOT = "uea_attention_maps.png"
MAPS_VARIANTS = ("softmax", "bn_sh")

# Protocol → (metric reported as test accuracy, checkpoint head redundancy is measured on).
PROTOCOLS = {
  "best_test": ("best/test_accuracy", "latest"),
  "clean": ("selected/test_accuracy", "selected"),
}
PROTOCOL_TITLES = {
  "best_test": "best_test protocol — test accuracy = best over epochs (optimistic: the test "
  "set picks the epoch)",
  "clean": "clean protocol — test accuracy of the checkpoint selected on a validation split "
  "carved from TRAIN",
}
# docs/maths.md §5, published by others (best test accuracy over epochs): (data set, variant) → accuracy.
REFERENCE = {("JapaneseVowels", "softmax"): 0.987}
REFERENCE_TEN_DATASET_AVERAGE = {"softmax": 0.719}
REFERENCE_HEADER = "reference (published, best-test)"

# Field → accepted types of every record in results/uea.json.
_NUMBER = (int, float)
_OPTIONAL_NUMBER = (int, float, type(None))
RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
  "name": (str,),
  "config_file": (str,),
  "config_arg": (str,),
  "dataset": (str,),
  "attention": (str,),
  "protocol": (str,),
  "seed": (int,),
  "model_size": (str,),
  "epochs": (int,),
  "runlocal": (bool,),
  "test_accuracy": _NUMBER,
  "best_epoch_accuracy": _NUMBER,
  "best_epoch_step": (int,),
  "final_test_accuracy": _NUMBER,
  "head_distance_per_layer": (list,),
  "head_distance": _OPTIONAL_NUMBER,
  "redundancy_checkpoint": (str,),
  "redundancy_step": (int,),
  "redundancy_examples": (int,),
  "num_params": (int,),
  "padded_length": (int,),
  "attention_flops": _NUMBER,
  "attention_flops_per_layer": (list,),
  "attention_flops_relative": _NUMBER,
  "wall_time_s": _NUMBER,
  "metrics": (dict,),
}


def validate_record(record: Mapping[str, Any]) -> None:
  """Raises ValueError naming every field of ``RECORD_SCHEMA`` missing or of the wrong type."""
  extra = (
    []
    if record.get("protocol") in PROTOCOLS
    else [f"protocol: {record.get('protocol')!r} is not one of {sorted(PROTOCOLS)}"]
  )
  grid.check_schema(record, RECORD_SCHEMA, "UEA", extra)


# ------------------------------------------------------------------------------------------------
# The grid.


def available_datasets(manual_dir: str | None) -> list[str]:
  """Configured data sets whose ``.ts`` files exist: the bundled ones first, then the others."""
  from primal_dual.data import uea  # pylint: disable=g-import-not-at-top

  order = [
    *uea_config.BUNDLED_DATASETS,
    *(d for d in uea_config.DATASETS if d not in uea_config.BUNDLED_DATASETS),
  ]
  found = []
  for name in order:
    try:
      uea.ts_paths(name, manual_dir or None)
    except FileNotFoundError:
      continue
    found.append(name)
  return found


def check_datasets(names: Sequence[str], manual_dir: str | None) -> None:
  """Fails before any training when a requested data set is unknown or its files are missing."""
  from primal_dual.data import uea  # pylint: disable=g-import-not-at-top

  for name in names:
    if name not in uea_config.DATASETS:
      raise ValueError(
        f"--datasets: {name!r} is not configured in primal_dual/configs/uea.py; "
        f"choose from {', '.join(uea_config.DATASETS)}"
      )
    uea.ts_paths(name, manual_dir or None)  # FileNotFoundError says where to put the files.


def run_name(
  dataset: str, protocol: str, attention: str, model_size: str, seed: int, epochs: int
) -> str:
  """The run's workdir name, e.g. ``JapaneseVowels-clean-bn_sh-small-s1`` (``-e40``: --epochs)."""
  parts = [dataset, protocol, attention, model_size, f"s{seed}"]
  if epochs >= 0:
    parts.append(f"e{epochs}")
  return "-".join(parts)


def build_runs(args: argparse.Namespace) -> list[grid.GridRun]:
  """The grid in seed-major order, so a half-finished grid already covers every variant."""
  config_file = CONFIG_FILE
  # --runlocal replaces the model by a tiny one: record that, not the size it overrides.
  size_label = "runlocal" if args.runlocal else args.model_size
  runs = []
  for dataset in args.datasets:
    for seed in args.seeds:
      for protocol in args.protocols:
        for attention in args.variants:
          config_arg = (
            f"dataset={dataset},attention={attention},protocol={protocol},"
            f"size={args.model_size},seed={seed},epochs={args.epochs}"
          )
          config_arg += "".join(
            f",{key}={value}"
            for key, value in (("manual_dir", args.manual_dir), ("data_dir", args.data_dir))
            if value
          )
          config_arg += ",runlocal" if args.runlocal else ""
          epochs = int(grid.load_config(config_file, config_arg).num_epochs)
          runs.append(
            grid.GridRun(
              name=run_name(dataset, protocol, attention, size_label, seed, args.epochs),
              config_file=config_file,
              config_arg=config_arg,
              tags=dict(
                dataset=dataset,
                attention=attention,
                protocol=protocol,
                seed=seed,
                model_size=size_label,
                epochs=epochs,
                runlocal=args.runlocal,
              ),
            )
          )
  return runs


# ------------------------------------------------------------------------------------------------
# Per-run analysis (cached in the workdir).


def _read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def analyse_workdir(workdir: str, checkpoint: str, max_examples: int) -> dict[str, Any]:
  """Head redundancy on the test split, parameter count and attention FLOPs of one checkpoint."""
  from primal_dual.analysis import attention_maps  # pylint: disable=g-import-not-at-top
  from primal_dual.models import parameter_count  # pylint: disable=g-import-not-at-top
  from primal_dual.analysis import flops  # pylint: disable=g-import-not-at-top
  from primal_dual.training import trainer  # pylint: disable=g-import-not-at-top

  experiment, state = trainer.restore_workdir(workdir, checkpoint)
  redundancy = attention_maps.run_redundancy(
    experiment, state, split="test", max_examples=max_examples, out_dir=workdir
  )
  padded_length = int(experiment.metadata["max_length"])
  attention_flops = flops.attention_flops(experiment.config.model, padded_length)
  return {
    "head_distance_per_layer": redundancy["head_distance_per_layer"],
    "head_distance": redundancy["head_distance"],
    "redundancy_checkpoint": checkpoint,
    "redundancy_step": redundancy["step"],
    "redundancy_examples": redundancy["num_examples"],
    "num_params": parameter_count(state.params),
    "padded_length": padded_length,
    "attention_flops": attention_flops["total"],
    "attention_flops_per_layer": attention_flops["per_layer"],
    "attention_flops_relative": attention_flops["relative_to_softmax"],
  }


def cached_analysis(
  workdir: str, checkpoint: str, metrics: Mapping[str, Any], max_examples: int
) -> dict[str, Any]:
  """:func:`analyse_workdir`, reused from ``<workdir>/uea_analysis.json`` when still valid.

  The cache is valid for the same checkpoint kind, the same training length and selected step
  (a run trained further is analysed again) and the same example cap.
  """
  key = [checkpoint, metrics.get("step"), metrics.get("selected/step"), max_examples]
  path = os.path.join(workdir, ANALYSIS_FILE)
  if os.path.exists(path):
    cached = _read_json(path)
    if cached.get("cache_key") == key:
      return cached["analysis"]
  analysis = analyse_workdir(workdir, checkpoint, max_examples)
  with open(path + ".tmp", "w") as f:
    json.dump({"cache_key": key, "analysis": analysis}, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)
  return analysis


def make_record_fn(max_examples: int):
  """``run_grid``'s ``record_fn``: protocol accuracy, redundancy, size and cost of a run."""

  def record_fn(run: grid.GridRun, metrics: Mapping[str, Any], workdir: str) -> dict[str, Any]:
    protocol = run.tags["protocol"]
    accuracy_key, checkpoint = PROTOCOLS[protocol]
    record = {
      "test_accuracy": float(metrics[accuracy_key]),
      "best_epoch_accuracy": float(metrics["best/test_accuracy"]),
      "best_epoch_step": int(metrics["best/test_step"]),
      "final_test_accuracy": float(metrics["test/accuracy"]),
      **cached_analysis(workdir, checkpoint, metrics, max_examples),
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

  return record_fn


# ------------------------------------------------------------------------------------------------
# Report: Markdown and figures.


def _reference_cell(key: tuple) -> str:
  value = REFERENCE.get((key[0], key[1]))
  return "–" if value is None else f"{100 * value:.1f}"


def _ten_dataset_average(records: Sequence[Mapping[str, Any]]) -> str:
  """Per variant: mean over the ten protocol data sets of the seed-mean best_test accuracy."""
  chosen = [r for r in records if r["protocol"] == "best_test"]
  datasets = {r["dataset"] for r in chosen}
  if not set(uea_config.PROTOCOL_DATASETS) <= datasets:
    return ""
  lines = [
    "\n### Average over the ten protocol data sets (best_test)\n",
    f"| attention | mean test acc % | {REFERENCE_HEADER} |",
    "|---|---|---|",
  ]
  groups = grid.group_records(chosen, ("attention", "dataset"))
  for attention in dict.fromkeys(r["attention"] for r in chosen):
    per_dataset = [
      grid.mean_std(r["test_accuracy"] for r in groups[(attention, d)])[0]
      for d in uea_config.PROTOCOL_DATASETS
      if (attention, d) in groups
    ]
    if len(per_dataset) < len(uea_config.PROTOCOL_DATASETS):
      continue
    reference = REFERENCE_TEN_DATASET_AVERAGE.get(attention)
    lines.append(
      f"| {attention} | {100 * np.mean(per_dataset):.1f} | "
      f"{'–' if reference is None else f'{100 * reference:.1f}'} |"
    )
  return "\n".join(lines) + "\n"


def markdown_report(records: Sequence[Mapping[str, Any]], command: str) -> str:
  """results/uea.md: one table per protocol, mean ± std over seeds (n = seeds)."""
  columns = {
    "test acc %": grid.field("test_accuracy"),
    "head distance": grid.field("head_distance"),
    "params (M)": grid.field("num_params"),
    "attn FLOPs / softmax": grid.field("attention_flops_relative"),
    "train time (min)": grid.field("wall_time_s"),
  }
  scales = {
    "head distance": 1.0,
    "params (M)": 1e-6,
    "attn FLOPs / softmax": 1.0,
    "train time (min)": 1 / 60,
  }
  sizes = sorted({str(r["model_size"]) for r in records})
  epochs = sorted({int(r["epochs"]) for r in records})
  seeds = sorted({int(r["seed"]) for r in records})
  lines = [
    "# UEA time-series classification: accuracy and head redundancy\n",
    f"Measured by `{command}` on {grid.describe_hardware(records)}; model size {', '.join(sizes)}, epochs "
    f"{', '.join(map(str, epochs))}, seeds {', '.join(map(str, seeds))}. Cells are mean ± std "
    "over seeds (n runs). Head distance: mean over layers of the mean pairwise distance between "
    "the heads' attention maps on the test split (higher = heads less redundant; see "
    "primal_dual/analysis/redundancy.py). Attention FLOPs are analytic (QK and AV products at "
    "the padded length, primal_dual/analysis/flops.py), relative to softmax. Train time is the "
    "wall time of training and per-epoch evaluation."
    + grid.shared_machine_note(command)
    + " Per-run records: uea.json.\n",
  ]
  for protocol, title in PROTOCOL_TITLES.items():
    chosen = [r for r in records if r["protocol"] == protocol]
    if not chosen:
      continue
    extra = {REFERENCE_HEADER: _reference_cell} if protocol == "best_test" else {}
    lines.append(f"\n## {title}\n")
    lines.append(grid.summary_table(chosen, ("dataset", "attention"), columns, scales, extra))
  lines.append(_ten_dataset_average(records))
  return "\n".join(lines)


def redundancy_values(
  records: Sequence[Mapping[str, Any]],
) -> dict[str, dict[str, tuple[float, float]]]:
  """``'dataset (protocol)'`` → variant → (mean, std) of head distance over seeds."""
  values: dict[str, dict[str, tuple[float, float]]] = {}
  for (dataset, protocol, attention), group in grid.group_records(
    records, ("dataset", "protocol", "attention")
  ).items():
    mean, std, count = grid.mean_std(r["head_distance"] for r in group)
    if count:
      values.setdefault(f"{dataset}\n{protocol}", {})[attention] = (mean, std)
  return values


def write_figures(
  records: Sequence[Mapping[str, Any]], root: str, out_dir: str, log=print
) -> list[str]:
  """uea_redundancy.png and uea_attention_maps.png from the grid's records and workdirs."""
  from primal_dual.analysis import attention_maps  # pylint: disable=g-import-not-at-top
  from primal_dual.analysis import plots  # pylint: disable=g-import-not-at-top

  written = []
  values = redundancy_values(records)
  if values:
    written.append(
      plots.plot_redundancy_bars(
        values,
        os.path.join(out_dir, REDUNDANCY_PLOT),
        title="Head distance per variant (mean ± std over seeds; higher = less redundant)",
      )
    )
  first = records[0] if records else None
  maps = {}
  for variant in MAPS_VARIANTS:
    candidates = [
      r
      for r in records
      if r["attention"] == variant
      and first is not None
      and r["dataset"] == first["dataset"]
      and r["protocol"] == first["protocol"]
    ]
    if not candidates:
      continue
    record = min(candidates, key=lambda r: r["seed"])
    path = os.path.join(root, record["name"], attention_maps.EXAMPLE_MAPS_FILE)
    if os.path.exists(path):
      maps[f"{variant} (seed {record['seed']})"] = attention_maps.load_example_maps(path)
  if maps:
    written.append(
      plots.plot_attention_grid(
        maps,
        os.path.join(out_dir, MAPS_PLOT),
        title=f"{first['dataset']}, {first['protocol']} protocol: test example 0",
      )
    )
  else:
    log(f"no {' / '.join(MAPS_VARIANTS)} runs with saved maps: {MAPS_PLOT} not written")
  return written


# ------------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--datasets",
    type=grid.comma_list(),
    default=(),
    help="comma list; default: those available (bundled + --manual_dir)",
  )
  grid.add_variant_and_seed_arguments(parser, DEFAULT_VARIANTS, default_seeds=DEFAULT_SEEDS)
  parser.add_argument("--protocols", type=grid.comma_list(), default=tuple(PROTOCOLS))
  parser.add_argument("--root", default="workdirs/uea_grid", help="parent of the runs' workdirs")
  parser.add_argument(
    "--jobs", type=int, default=1, help="runs trained at once, one process each (e.g. 6 on a GPU)"
  )
  parser.add_argument(
    "--results", default="results/uea.json", help="records; the .md and the figures go next to it"
  )
  parser.add_argument("--epochs", type=int, default=-1, help="-1: the protocol's (100, PEMS 400)")
  parser.add_argument("--model_size", choices=sorted(uea_config.MODEL_SIZES), default="reference")
  parser.add_argument("--manual_dir", default="", help="folder of <Name>/<Name>_{TRAIN,TEST}.ts")
  parser.add_argument("--data_dir", default="", help="TFDS data folder")
  parser.add_argument(
    "--redundancy_examples",
    type=int,
    default=512,
    help="head redundancy on the first N test examples (0 = all)",
  )
  parser.add_argument("--runlocal", action="store_true", help="tiny model, 2 epochs (smoke test)")
  parser.add_argument(
    "--dry_run",
    action="store_true",
    help="list the runs and whether each is finished; train nothing",
  )
  parser.add_argument(
    "--report_only",
    action="store_true",
    help="re-render the tables and figures from every record of --results; train nothing",
  )
  args = parser.parse_args(argv)
  grid.check_variants_and_seeds(parser, args, DEFAULT_VARIANTS, default_seeds=DEFAULT_SEEDS)
  unknown = [p for p in args.protocols if p not in PROTOCOLS]
  if unknown or not args.protocols:
    parser.error(f"--protocols: unknown {unknown or 'empty list'}; choose from {sorted(PROTOCOLS)}")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    if args.datasets:
      check_datasets(args.datasets, args.manual_dir)
    else:
      args.datasets = tuple(available_datasets(args.manual_dir))
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  runs = build_runs(args)
  print(
    f"UEA grid: {len(runs)} runs ({', '.join(args.datasets)} × {len(args.variants)} variants "
    f"× {len(args.seeds)} seeds × {len(args.protocols)} protocols) under {args.root}"
  )
  if args.dry_run:
    for run in runs:
      done = grid.is_finished(os.path.join(args.root, run.name))
      print(f"  {'finished' if done else 'to train'}  {run.name}  ({run.config_arg})")
    return 0
  # --report_only re-renders every record of the results JSON, whatever workdirs exist here.
  records = grid.records_for_report(
    runs,
    args.root,
    args.results,
    report_only=args.report_only,
    record_fn=make_record_fn(args.redundancy_examples),
    jobs=args.jobs,
  )
  for record in records:
    validate_record(record)
  markdown_path = os.path.splitext(args.results)[0] + ".md"
  command = grid.report_command(
    "scripts/reproduce_uea.py", argv, markdown_path, report_only=args.report_only
  )
  with open(markdown_path, "w") as f:
    f.write(markdown_report(records, command))
  figures = write_figures(records, args.root, os.path.dirname(os.path.abspath(args.results)))
  print(f"wrote {args.results}, {markdown_path}" + "".join(f", {p}" for p in figures))
  return 0


if __name__ == "__main__":
  sys.exit(main())
