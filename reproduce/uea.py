"""The UEA time-series study: accuracy and head redundancy of softmax, linear, BN, SH and BN+SH
on the archive's data sets under both protocols (``best_test``, optimistic, and ``clean``, selected
on validation; the task, ``primal_dual/tasks/uea.py``, defines them): its grid, record schema,
report, reference numbers and figures (``primal-dual reproduce uea``).
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Any, Mapping, Sequence

import numpy as np

from primal_dual.configs import uea as uea_config
from reproduce import grid


# ------------------------------------------------------------------------------------------------
# The reproduction grid (``primal-dual reproduce uea``).

GRID_COMMANDS = r"""
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

Commands (from the repository root; ``primal-dual reproduce uea`` where the package is
installed)::

  # The published grid (the default): the primal_dual/configs/default.py model (d 64, 4 heads),
  # 40 epochs, on the data sets found (JapaneseVowels and BasicMotions offline): 2 × 6 × 3 × 2 =
  # 72 runs (measured step times: JapaneseVowels ~1 s per epoch, BasicMotions ~0.3 s, plus ~20 s
  # of compilation and ~10 s of analysis per run).
  .venv/bin/python scripts/reproduce.py uea

  # The protocol's reference model (d 512, 8 heads): about 16 s per JapaneseVowels epoch and 8 s
  # per BasicMotions epoch on 2 cores, i.e. about a day for the same 72 runs (an accelerator is
  # the place for it); add --manual_dir=<folder with <Name>/<Name>_{TRAIN,TEST}.ts> for the
  # other data sets of the protocol.
  .venv/bin/python scripts/reproduce.py uea --scale=reference --epochs=-1

  # List the runs (and which are finished) without training anything.
  .venv/bin/python scripts/reproduce.py uea --dry_run

  # Smoke test (tiny model, 2 epochs): seconds per run.
  .venv/bin/python scripts/reproduce.py uea --quick --root=/tmp/uea_smoke \
      --results=/tmp/uea_smoke/uea.json --variants=softmax,bn_sh --seeds=0
"""
CONFIG_FILE = "uea"  # a packaged config (primal_dual/configs/uea.py)
# The grid of results/uea.md, run by `primal-dual reproduce uea` without flags.
PUBLISHED_MODEL_SIZE = "small"
PUBLISHED_EPOCHS = 40
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
_OPTIONAL_NUMBER = (int, float, type(None))
RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
  **grid.RUN_RECORD_SCHEMA,
  "dataset": (str,),
  "attention": (str,),
  "protocol": (str,),
  "seed": (int,),
  "model_size": (str,),
  "epochs": (int,),
  "runlocal": (bool,),
  "test_accuracy": grid.NUMBER,
  "best_epoch_accuracy": grid.NUMBER,
  "best_epoch_step": (int,),
  "final_test_accuracy": grid.NUMBER,
  "head_distance_per_layer": (list,),
  "head_distance": _OPTIONAL_NUMBER,
  "redundancy_checkpoint": (str,),
  "redundancy_step": (int,),
  "redundancy_examples": (int,),
  "num_params": (int,),
  "padded_length": (int,),
  "attention_flops": grid.NUMBER,
  "attention_flops_per_layer": (list,),
  "attention_flops_relative": grid.NUMBER,
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
  from primal_dual.data import uea

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
  from primal_dual.data import uea

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
  """The grid in seed-major order (within each data set), so a half-finished grid already covers
  every variant."""
  # --quick (runlocal) replaces the model by a tiny one: record that, not the size it overrides.
  size_label = "runlocal" if args.quick else args.model

  def run(dataset: str, seed: int, protocol: str, attention: str) -> grid.GridRun:
    point = dict(dataset=dataset, attention=attention, protocol=protocol)
    config_arg = grid.config_argument(
      dict(point, size=args.model, seed=seed, epochs=args.epochs),
      dict(manual_dir=args.manual_dir, data_dir=args.data_dir),
      runlocal=args.quick,
    )
    epochs = int(grid.load_config(CONFIG_FILE, config_arg).num_epochs)
    return grid.GridRun(
      name=run_name(dataset, protocol, attention, size_label, seed, args.epochs),
      config_file=CONFIG_FILE,
      config_arg=config_arg,
      tags=dict(point, seed=seed, model_size=size_label, epochs=epochs, runlocal=args.quick),
    )

  axes = (args.datasets, args.seeds, args.protocols, args.variants)
  return [run(*values) for values in itertools.product(*axes)]


# ------------------------------------------------------------------------------------------------
# Per-run analysis (cached in the workdir).


def analyse_workdir(workdir: str, checkpoint: str, max_examples: int) -> dict[str, Any]:
  """Head redundancy on the test split, parameter count and attention FLOPs of one checkpoint."""
  from primal_dual.analysis import attention_maps
  from primal_dual.models import parameter_count
  from primal_dual.analysis import flops
  from primal_dual.training import evaluation

  program, state = evaluation.restore_workdir(workdir, checkpoint)
  redundancy = attention_maps.run_redundancy(
    program, state, split="test", max_examples=max_examples, out_dir=workdir
  )
  padded_length = int(program.metadata["max_length"])
  attention_flops = flops.attention_flops(program.config.model, padded_length)
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
  return grid.cached(
    os.path.join(workdir, ANALYSIS_FILE),
    key,
    lambda: analyse_workdir(workdir, checkpoint, max_examples),
  )


def record_fn(
  run: grid.GridRun, metrics: Mapping[str, Any], workdir: str, args: argparse.Namespace
) -> dict[str, Any]:
  """A record's task fields: protocol accuracy, redundancy, size and cost of a run."""
  accuracy_key, checkpoint = PROTOCOLS[run.tags["protocol"]]
  return {
    "test_accuracy": float(metrics[accuracy_key]),
    "best_epoch_accuracy": float(metrics["best/test_accuracy"]),
    "best_epoch_step": int(metrics["best/test_step"]),
    "final_test_accuracy": float(metrics["test/accuracy"]),
    **cached_analysis(workdir, checkpoint, metrics, args.redundancy_examples),
  }


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


def write_figures(records: Sequence[Mapping[str, Any]], args: argparse.Namespace) -> list[str]:
  """uea_redundancy.png and uea_attention_maps.png (next to --results) from the grid's records
  and the workdirs under --root."""
  from primal_dual.analysis import attention_maps
  from primal_dual.analysis import plots

  out_dir = os.path.dirname(os.path.abspath(args.results))
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
    path = os.path.join(args.root, record["name"], attention_maps.EXAMPLE_MAPS_FILE)
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
    print(f"no {' / '.join(MAPS_VARIANTS)} runs with saved maps: {MAPS_PLOT} not written")
  return written


# The data set --quick trains unless --datasets is given (softmax, both protocols: 2 runs).
QUICK_DATASET = "JapaneseVowels"

# The grid's own flags: flag → add_argument options.
FLAGS: dict[str, dict[str, Any]] = {
  "--datasets": dict(
    type=grid.comma_list(),
    default=(),
    help="comma list; default: those available (bundled + --manual_dir)",
  ),
  "--protocols": dict(type=grid.comma_list(), default=tuple(PROTOCOLS)),
  # The published grid (results/uea.md) by default: the small model, 40 epochs.
  # (--quick keeps runlocal's 2 epochs unless --epochs is given.)
  "--epochs": dict(
    type=int,
    default=None,
    help=f"default {PUBLISHED_EPOCHS} (--quick: runlocal's); -1: the protocol's (100, PEMS 400)",
  ),
  "--scale": dict(
    dest="model",
    choices=sorted(uea_config.MODEL_SIZES),
    default=PUBLISHED_MODEL_SIZE,
    help="model size: small (published, CPU) or reference (the protocol's, about a day)",
  ),
  "--manual_dir": dict(default="", help="folder of <Name>/<Name>_{TRAIN,TEST}.ts"),
  "--data_dir": dict(default="", help="TFDS data folder"),
  "--redundancy_examples": dict(
    type=int, default=512, help="head redundancy on the first N test examples (0 = all)"
  ),
}


def check_arguments(args: argparse.Namespace) -> None:
  """Known protocols, data sets whose files exist (default: every one found), and the epochs:
  the published grid's unless --quick (its runlocal config's) or given."""
  if args.epochs is None:
    args.epochs = -1 if args.quick else PUBLISHED_EPOCHS
  # A smoke test (--quick) trains 2 runs, as the other grids' do: one data set and variant.
  if args.quick and not args.datasets:
    args.datasets = (QUICK_DATASET,)
  unknown = [p for p in args.protocols if p not in PROTOCOLS]
  if unknown or not args.protocols:
    raise ValueError(
      f"--protocols: unknown {unknown or 'empty list'}; choose from {sorted(PROTOCOLS)}"
    )
  if args.datasets:
    check_datasets(args.datasets, args.manual_dir)
  else:
    args.datasets = tuple(available_datasets(args.manual_dir))


REPRODUCTION = grid.module_reproduction(
  __name__,
  task="uea",
  summary="UEA accuracy and head redundancy of softmax, BN, SH and BN+SH (the time-series claims).",
  quick=f"tiny model, 2 epochs (the config's runlocal), {QUICK_DATASET}, softmax",
  variants=grid.VariantChoice(
    ("softmax", "bn", "sh", "bn_sh", "linear", "linear_bn"), ("softmax",)
  ),
)
