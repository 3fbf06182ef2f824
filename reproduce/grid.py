"""Run a grid of training jobs that resumes where it stopped, and tabulate the results.

Each run has its own workdir under a root folder. A run whose workdir holds ``final_metrics.json``
is finished and is not trained again; an unfinished one resumes from its last checkpoint (the
trainer does that). As each run ends the records of the finished runs are written to a JSON file,
so a grid killed half-way loses at most the runs in progress; ``--finished_only`` reports the
finished runs of a grid cut short, training nothing.

Each study module ``reproduce/<task>.py`` declares its paper grid as a ``Reproduction`` (which
runs, what each record holds, how the report reads); ``reproduce`` runs it with the flags every
grid shares (``primal-dual reproduce <task>``). The pieces underneath
(``config_file`` is a packaged config's short name or a config file's path, ``load_config``)::

  runs = [GridRun(name=f"jv_{a}_s{s}", config_file="uea",
                  config_arg=f"dataset=JapaneseVowels,attention={a},seed={s}",
                  tags=dict(dataset="JapaneseVowels", attention=a, seed=s)) for a in ... for s in ...]
  records = run_grid(runs, "workdirs/uea_grid", "results/uea.json", record_fn=my_record)
  markdown = summary_table(records, group_by=("dataset", "attention"), value="test_accuracy")
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from primal_dual import atomic
from primal_dual.training import errors

FINAL_METRICS = "final_metrics.json"
RUN_INFO = "grid_run.json"
RUN_LOG = "grid_run.log"


@dataclasses.dataclass(frozen=True)
class GridRun:
  """One job: ``get_config(config_arg)`` of ``config_file``, trained in ``<root>/<name>``.

  ``overrides`` sets config fields after ``get_config`` (dotted names, e.g.
  ``{'steps_per_call': 125}``). With ``replicas`` the overrides hold a sweep (``sweep.seed``,
  ``sweep.optimizer.lr``, ...; docs/training.md) that trains as replicas of one program:
  ``(sub-workdir, tags)`` of each, its sub-workdir named as the trainer names it
  (``primal_dual.training.sweep.replica_name``) and its tags added to its record, one record per
  replica.
  """

  name: str
  config_file: str
  config_arg: str
  tags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  replicas: tuple[tuple[str, Mapping[str, Any]], ...] = ()

  def config(self):
    """The run's config: ``get_config(config_arg)`` with the overrides set."""
    config = load_config(self.config_file, self.config_arg)
    if not self.overrides:
      return config
    from primal_dual.training import config_lib

    return config_lib.with_fields(config, self.overrides)

  def workdirs(self, root: str) -> list[tuple[dict[str, Any], str]]:
    """``(tags, workdir)`` of each model the run trains: the run's own workdir (no tags), or one
    per sweep replica (its tags)."""
    workdir = os.path.join(root, self.name)
    if self.replicas:
      return [(dict(tags), os.path.join(workdir, name)) for name, tags in self.replicas]
    return [({}, workdir)]

  def is_finished(self, root: str) -> bool:
    return all(is_finished(workdir) for _, workdir in self.workdirs(root))


def config_argument(
  required: Mapping[str, Any], optional: Mapping[str, Any], *, runlocal: bool
) -> str:
  """A config's ``key=value,...`` argument: every ``required`` entry, the ``optional`` ones that
  are set (non-empty strings, numbers other than -1 and 0), then the ``runlocal`` flag if asked."""
  given = {key: value for key, value in optional.items() if _is_set(value)}
  pairs = [f"{key}={value}" for key, value in {**required, **given}.items()]
  return ",".join(pairs + ["runlocal"] * runlocal)


# Values of an optional grid flag that mean "the config's own".
UNSET_NUMBERS = (-1, 0)


def _is_set(value: Any) -> bool:
  """An optional grid flag holds a value: a non-empty string or a number other than -1 and 0
  (the config's default); other negatives go to the config, which refuses them."""
  return value not in UNSET_NUMBERS if isinstance(value, (int, float)) else bool(value)


def load_config(config_file: str, config_arg: str | None):
  """``get_config(config_arg)`` of a config file, or of a packaged config named by its short name
  (``"uea"``; ``primal_dual.configs.resolve``).

  Raises:
    errors.UserError: the config refuses ``config_arg``; the message names both.
  """
  from primal_dual import configs

  try:
    return configs.load(config_file, config_arg)
  except errors.UserError as e:
    raise errors.UserError(f"grid run config {config_file}:{config_arg}: {e}") from e


def _read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def _write_json(path: str, payload: Any) -> None:
  atomic.write_json(path, payload, indent=1)


def cached(path: str, key: Any, compute: Callable[[], Any]) -> Any:
  """``compute()``, kept in the JSON file ``path`` with ``key`` and read back while ``key`` is the
  same (a run's analysis in its workdir: a run trained further has another key)."""
  if os.path.exists(path):
    stored = _read_json(path)
    if stored.get("cache_key") == key:
      return stored["analysis"]
  value = compute()
  _write_json(path, {"cache_key": key, "analysis": value})
  return value


def is_finished(workdir: str) -> bool:
  return os.path.exists(os.path.join(workdir, FINAL_METRICS))


def hardware_info() -> dict[str, Any]:
  """What this process trains on: accelerator kind and count, host, JAX version."""
  import jax

  device = jax.devices()[0]
  return {
    "platform": device.platform,
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "host_machine": platform.machine(),
    "host_cpu_count": os.cpu_count(),
    "jax_version": jax.__version__,
  }


def describe_hardware(records: Sequence[Mapping[str, Any]]) -> str:
  """One phrase naming the distinct training hardware of ``records`` (their ``hardware`` field).

  For example ``"1 × NVIDIA H100 80GB HBM3 (gpu; host x86_64 with 16 CPU cores; JAX 0.11.2)"``;
  a record without the field (trained before it existed) counts as ``"unrecorded hardware"``.
  """
  phrases = []
  for record in records:
    info = record.get("hardware")
    if not info:
      phrase = "unrecorded hardware"
    elif info["platform"] == "cpu":
      phrase = (
        f"{info['host_machine']} CPU with {info['host_cpu_count']} cores "
        f"(JAX {info['jax_version']})"
      )
    else:
      phrase = (
        f"{info['device_count']} × {info['device_kind']} ({info['platform']}; host "
        f"{info['host_machine']} with {info['host_cpu_count']} CPU cores; "
        f"JAX {info['jax_version']})"
      )
    if phrase not in phrases:
      phrases.append(phrase)
  return " and ".join(phrases) if phrases else "no runs"


def load_records(results_json: str) -> list[dict[str, Any]]:
  """The records a grid wrote to ``results_json`` (for re-rendering a report without training)."""
  if not os.path.exists(results_json):
    raise errors.UserError(
      f"{results_json} does not exist: run the grid first (without "
      "--report_only), or pass the results file it wrote"
    )
  return list(_read_json(results_json))


def records_for_report(
  runs: Sequence[GridRun], root: str, results_json: str, *, report_only: bool, **run_grid_kwargs
) -> list[dict[str, Any]]:
  """``run_grid(...)``, or with ``report_only`` the records it wrote before (nothing trains).

  ``report_only`` re-renders a report from its JSON, e.g. on a laptop after the grid ran on an
  accelerator whose workdirs were not kept.
  """
  if report_only:
    return load_records(results_json)
  return run_grid(runs, root, results_json, **run_grid_kwargs)


def invocation(script: str, argv: Sequence[str] | None) -> str:
  """The command line that produced a report: ``python <script> <args>``, minus ``--report_only``
  (a re-rendered report names the command that trained its runs)."""
  args = sys.argv[1:] if argv is None else list(argv)
  return " ".join(["python", script, *(a for a in args if a != "--report_only")])


# The provenance line every report starts with: "Measured by `python scripts/... --jobs=6` on ...".
_PROVENANCE = re.compile(r"Measured by `(python [^`]+)`")


def previous_report_command(markdown_path: str) -> str | None:
  """The command named by the provenance line of the report at ``markdown_path`` (None if there
  is no report or it names none)."""
  if not os.path.exists(markdown_path):
    return None
  with open(markdown_path) as f:
    found = _PROVENANCE.search(f.read())
  return found.group(1) if found else None


def report_command(
  script: str, argv: Sequence[str] | None, markdown_path: str, *, report_only: bool
) -> str:
  """The command a report names as the one that produced its records.

  A grid that trains names its own command line (``invocation``). A re-render (``report_only``)
  keeps the command of the report it replaces: the records came from that command, and the
  re-render may run elsewhere with other arguments (without ``--jobs``, another ``--root``).
  """
  if report_only:
    previous = previous_report_command(markdown_path)
    if previous:
      return current_command(previous)
  return invocation(script, argv)


# Grid scripts and flags of earlier releases that committed reports may still name → today's.
_REMOVED_SCRIPT = re.compile(r"^python scripts/reproduce_(\w+)\.py")
RENAMED_GRID_FLAGS = {"--model_size": "--scale", "--model": "--scale", "--preset": "--scale"}


def current_command(command: str) -> str:
  """``command`` as run today: ``scripts/reproduce_<task>.py`` → ``scripts/reproduce.py <task>``,
  renamed flags (``RENAMED_GRID_FLAGS``) under their new names."""
  command = _REMOVED_SCRIPT.sub(r"python scripts/reproduce.py \1", command)
  words = []
  for word in command.split(" "):
    flag, has_value, value = word.partition("=")
    words.append(RENAMED_GRID_FLAGS.get(flag, flag) + has_value + value)
  return " ".join(words)


def shared_machine_note(command: str) -> str:
  """A sentence for reports whose runs trained ``--jobs N`` at a time (else ``""``)."""
  jobs = [int(a.split("=", 1)[1]) for a in command.split() if a.startswith("--jobs=")]
  if not jobs or jobs[-1] <= 1:
    return ""
  return (
    f" With `--jobs={jobs[-1]}`, {jobs[-1]} runs trained at once on that machine, so "
    "steps/s and wall time are those of one run on a shared machine (for step time alone "
    "see benchmarks/train_throughput.py)."
  )


def train_one(run: GridRun, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) one run; returns its final metrics and the wall time it took here."""
  from primal_dual.training import trainer

  config = run.config()
  start = time.time()
  metrics = trainer.train_and_evaluate(config, workdir)
  info_path = os.path.join(workdir, RUN_INFO)
  previous = _read_json(info_path)["wall_time_s"] if os.path.exists(info_path) else 0.0
  # Wall time adds up over restarts, so an interrupted run reports its total training time.
  _write_json(
    info_path,
    {
      "wall_time_s": previous + time.time() - start,
      "config_file": run.config_file,
      "config_arg": run.config_arg,
      "hardware": hardware_info(),
    },
  )
  return dict(metrics)


def train_in_subprocess(run: GridRun, workdir: str) -> None:
  """``train_one`` in a fresh Python process; its output goes to ``<workdir>/grid_run.log``.

  Several of these share one accelerator (a small model leaves most of a GPU idle), so JAX is
  told not to preallocate 75% of the device memory per process.
  """
  os.makedirs(workdir, exist_ok=True)
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
  command = [
    sys.executable,
    "-m",
    "reproduce.grid",
    run.config_file,
    run.config_arg,
    workdir,
    json.dumps({"overrides": dict(run.overrides)}),
  ]
  log_path = os.path.join(workdir, RUN_LOG)
  with open(log_path, "w") as log_file:
    result = subprocess.run(
      command, stdout=log_file, stderr=subprocess.STDOUT, env=env, check=False
    )
  if result.returncode != 0:
    with open(log_path) as f:
      lines = f.readlines()
    if result.returncode == USER_ERROR_STATUS and lines and lines[-1].startswith("error: "):
      message = lines[-1].removeprefix("error: ").strip()
      raise errors.UserError(f"grid run {run.name}: {message} (log: {log_path})")
    tail = "".join(lines[-20:])
    raise RuntimeError(
      f"grid run {run.name} failed (exit {result.returncode}); last lines of {log_path}:\n{tail}"
    )


def _train_unfinished_in_parallel(
  runs: Sequence[GridRun],
  root: str,
  jobs: int,
  log: Callable[[str], None],
  on_finished: Callable[[GridRun], None],
) -> None:
  """Trains every unfinished run, ``jobs`` subprocesses at a time (finished runs are skipped);
  ``on_finished(run)`` as each one ends."""
  todo = [run for run in runs if not run.is_finished(root)]
  if not todo:
    return
  log(f"training {len(todo)} runs, {jobs} at a time (logs: <workdir>/{RUN_LOG})")
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    futures = {
      pool.submit(train_in_subprocess, run, os.path.join(root, run.name)): run for run in todo
    }
    failures = []
    for future in concurrent.futures.as_completed(futures):
      if (error := future.exception()) is not None:
        failures.append(error)
        continue
      log(f"  {futures[future].name}: done")
      on_finished(futures[future])
  if failures:  # the first failed run's error, once the others have finished and been recorded
    raise failures[0]


def run_records(
  run: GridRun,
  root: str,
  record_fn: Callable[[GridRun, Mapping[str, Any], str], Mapping[str, Any]] | None = None,
  validate_record: Callable[[Mapping[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
  """The records of a finished run, one per replica (see ``run_grid``)."""
  info_path = os.path.join(root, run.name, RUN_INFO)
  # Replicas trained together share one wall time (that of the whole program).
  info = _read_json(info_path) if os.path.exists(info_path) else {"wall_time_s": float("nan")}
  records = []
  for replica_tags, workdir in run.workdirs(root):
    metrics = _read_json(os.path.join(workdir, FINAL_METRICS))
    record = {
      "name": os.path.relpath(workdir, root),
      "config_file": run.config_file,
      "config_arg": run.config_arg,
      **dict(run.tags),
      **replica_tags,
      "wall_time_s": info["wall_time_s"],
      "hardware": info.get("hardware"),
      "metrics": metrics,
    }
    if run.overrides:
      record["overrides"] = dict(run.overrides)
    if record_fn is not None:
      record.update(record_fn(run, metrics, workdir))
    if validate_record is not None:
      validate_record(record)
    records.append(record)
  return records


def run_grid(
  runs: Sequence[GridRun],
  root: str,
  results_json: str,
  *,
  record_fn: Callable[[GridRun, Mapping[str, Any], str], Mapping[str, Any]] | None = None,
  log: Callable[[str], None] = print,
  jobs: int = 1,
  validate_record: Callable[[Mapping[str, Any]], None] | None = None,
  finished_only: bool = False,
) -> list[dict[str, Any]]:
  """Runs every unfinished job, then writes one record per run to ``results_json``.

  The records of the runs finished so far are written each time a run ends (one after another,
  or with ``jobs > 1`` as each parallel run ends), so a grid cut short keeps every finished
  run's record.

  Args:
    runs: the grid; names must be unique.
    root: parent folder of the runs' workdirs.
    results_json: where the records go (rewritten after every run).
    record_fn: ``(run, final_metrics, workdir) -> extra fields`` (e.g. head redundancy); its
      output is merged into the record after the run's tags.
    log: progress messages.
    jobs: runs trained at the same time, each in its own process (for a machine, typically an
      accelerator, that one small run leaves mostly idle); 1 trains them one after another in
      this process.
    validate_record: raises on a malformed record, before it is written.
    finished_only: train nothing; the records of the runs already finished under ``root`` (a
      grid cut short, e.g. at the end of a lease).

  Returns:
    The records, in the order of ``runs``: ``{name, config_file, config_arg, **tags,
    wall_time_s, hardware, metrics, **extra}``; ``hardware`` is ``hardware_info()`` of the
    process that trained the run (None for runs trained before it was recorded).

  Raises:
    errors.UserError: ``jobs < 1``; with ``finished_only``, no finished run.
  """
  names = [run.name for run in runs]
  if len(set(names)) != len(names):
    raise ValueError(
      f"grid run names must be unique; duplicates: "
      f"{sorted({n for n in names if names.count(n) > 1})}"
    )
  if jobs < 1:
    raise errors.UserError(f"--jobs={jobs}: give at least 1 (runs trained at once)")
  if finished_only and not any(run.is_finished(root) for run in runs):
    raise errors.UserError(
      f"no run of the grid has finished under {root}: pass the --root its runs trained in, or "
      "train them (without --finished_only)"
    )
  records_by_run: dict[str, list[dict[str, Any]]] = {}

  def in_grid_order() -> list[dict[str, Any]]:
    return [record for run in runs for record in records_by_run.get(run.name, [])]

  def add_records(run: GridRun) -> None:
    records_by_run[run.name] = run_records(run, root, record_fn, validate_record)
    _write_json(results_json, in_grid_order())

  if jobs > 1 and not finished_only:
    _train_unfinished_in_parallel(runs, root, jobs, log, add_records)
  for index, run in enumerate(runs):
    if run.name in records_by_run:  # trained just now, in parallel
      continue
    if run.is_finished(root):
      log(f"[{index + 1}/{len(runs)}] {run.name}: finished earlier, reusing")
    elif finished_only:
      log(f"[{index + 1}/{len(runs)}] {run.name}: not finished, left out")
      continue
    else:
      log(f"[{index + 1}/{len(runs)}] {run.name}: training")
      try:
        train_one(run, os.path.join(root, run.name))
      except errors.UserError as e:
        raise errors.UserError(f"grid run {run.name}: {e}") from e
    add_records(run)
  return in_grid_order()


def comma_list(cast: Callable[[str], Any] = str) -> Callable[[str], tuple]:
  """An argparse ``type`` parsing ``"a,b,c"`` into a tuple of ``cast`` values (blanks dropped)."""

  def parse(text: str) -> tuple:
    return tuple(cast(item.strip()) for item in text.split(",") if item.strip())

  return parse


def add_variant_and_seed_arguments(
  parser: argparse.ArgumentParser,
  default_variants: Sequence[str],
  quick_variants: Sequence[str] | None = None,
  default_seeds: Sequence[int] = (0, 1, 2),
) -> None:
  """``--variants`` and ``--seeds`` comma lists; ``None`` until ``check_variants_and_seeds``."""
  quick = f"; --quick: {','.join(quick_variants)}" if quick_variants else ""
  parser.add_argument(
    "--variants",
    type=comma_list(),
    default=None,
    help=f"comma list of attention names (default {','.join(default_variants)}{quick})",
  )
  parser.add_argument(
    "--seeds",
    type=comma_list(int),
    default=None,
    help=f"comma list (default {','.join(map(str, default_seeds))}"
    f"{'; --quick: 0' if quick_variants else ''})",
  )


def check_variants_and_seeds(
  parser: argparse.ArgumentParser,
  args: argparse.Namespace,
  default_variants: Sequence[str],
  quick_variants: Sequence[str] | None = None,
  default_seeds: Sequence[int] = (0, 1, 2),
) -> None:
  """Fills the defaults (the quick ones with ``args.quick``) and rejects unknown attention names
  or empty lists through ``parser.error`` (one line, exit status 2)."""
  quick = bool(getattr(args, "quick", False)) and quick_variants is not None
  if args.variants is None:
    args.variants = tuple(quick_variants if quick else default_variants)
  if args.seeds is None:
    args.seeds = (0,) if quick else tuple(default_seeds)
  from primal_dual.layers import ATTENTION_REGISTRY

  unknown = [v for v in args.variants if v not in ATTENTION_REGISTRY]
  if unknown or not args.variants:
    parser.error(
      f"--variants: unknown {unknown or 'empty list'}; choose from {sorted(ATTENTION_REGISTRY)}"
    )
  if not args.seeds:
    parser.error("--seeds: give at least one seed")


# The fields ``run_grid`` gives every record, besides the run's tags and the task's fields (a task's
# RECORD_SCHEMA starts with these).
RUN_RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
  "name": (str,),
  "config_file": (str,),
  "config_arg": (str,),
  "wall_time_s": (int, float),
  "metrics": (dict,),
}


def schema_problems(record: Mapping[str, Any], schema: Mapping[str, tuple[type, ...]]) -> list[str]:
  """Every field of ``schema`` (name → accepted types) missing from ``record`` or of another type
  (a bool is not accepted as an int unless the schema names bool)."""
  problems = []
  for name, types in schema.items():
    if name not in record:
      problems.append(f"{name}: missing")
    elif (isinstance(record[name], bool) and bool not in types) or not isinstance(
      record[name], types
    ):
      problems.append(
        f"{name}: {type(record[name]).__name__} where {[t.__name__ for t in types]} expected"
      )
  return problems


def check_schema(
  record: Mapping[str, Any],
  schema: Mapping[str, tuple[type, ...]],
  label: str,
  extra_problems: Sequence[str] = (),
) -> None:
  """Raises ValueError naming every problem of ``record`` (``schema_problems`` + ``extra``)."""
  problems = schema_problems(record, schema) + list(extra_problems)
  if problems:
    raise ValueError(
      f"{label} record {record.get('name')!r} does not match RECORD_SCHEMA: " + "; ".join(problems)
    )


def field(name: str) -> Callable[[Mapping[str, Any]], Any]:
  """A ``summary_table`` column extractor: ``record[name]`` (None when absent)."""
  return lambda record: record.get(name)


def distinct_values(records: Sequence[Mapping[str, Any]], *names: str) -> list[list[Any]]:
  """For each of ``names``, the sorted distinct values the records hold under it."""
  return [sorted({record[name] for record in records}) for name in names]


def first_by_variant(records: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
  """``{attention: record[name]}`` from each variant's first record (values equal across seeds)."""
  values = {}
  for record in records:
    values.setdefault(record["attention"], record[name])
  return values


def mean_std(values: Iterable[float]) -> tuple[float, float, int]:
  """Mean, sample standard deviation (0 for one value) and count, ignoring NaNs."""
  values = np.asarray([v for v in values if v is not None and np.isfinite(v)], np.float64)
  if values.size == 0:
    return float("nan"), float("nan"), 0
  std = float(values.std(ddof=1)) if values.size > 1 else 0.0
  return float(values.mean()), std, int(values.size)


def group_records(
  records: Sequence[Mapping[str, Any]], group_by: Sequence[str]
) -> dict[tuple, list[Mapping[str, Any]]]:
  """Records grouped by the values of ``group_by`` (first-seen order)."""
  groups: dict[tuple, list[Mapping[str, Any]]] = {}
  for record in records:
    groups.setdefault(tuple(record.get(k) for k in group_by), []).append(record)
  return groups


def format_mean_std(
  mean: float, std: float, count: int, scale: float = 100.0, digits: int = 1
) -> str:
  if count == 0:
    return "–"
  if count == 1:
    return f"{mean * scale:.{digits}f}"
  return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


def summary_table(
  records: Sequence[Mapping[str, Any]],
  group_by: Sequence[str],
  columns: Mapping[str, Callable[[Mapping[str, Any]], float]],
  scales: Mapping[str, float] | None = None,
  extra_columns: Mapping[str, Callable[[tuple], str]] | None = None,
) -> str:
  """A Markdown table: one row per group, ``mean ± std (n)`` of each column over its records.

  Args:
    records: run records. group_by: record keys forming a row.
    columns: header → function extracting a float from a record.
    scales: header → multiplier for display (default 100, i.e. percentages; use 1 for raw).
    extra_columns: header → function of the group key giving a string (e.g. a reference number).
  """
  scales = dict(scales or {})
  extra_columns = dict(extra_columns or {})
  header = [*group_by, *columns, "n", *extra_columns]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for key, group in group_records(records, group_by).items():
    cells = [str(k) for k in key]
    count = 0
    for title, extract in columns.items():
      mean, std, count_here = mean_std(extract(r) for r in group)
      count = max(count, count_here)
      scale = scales.get(title, 100.0)
      cells.append(format_mean_std(mean, std, count_here, scale, 1 if scale == 100.0 else 3))
    cells.append(str(count))
    cells.extend(fn(key) for fn in extra_columns.values())
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Runs of one variant and seed, and the size and cost fields of a record.


def seed_major_runs(
  args: argparse.Namespace, make_run: Callable[[str, int], GridRun]
) -> list[GridRun]:
  """``make_run(attention, seed)`` for every seed of ``args.seeds`` and within it every variant
  of ``args.variants``: a half-finished grid already covers every variant."""
  return [make_run(attention, seed) for seed in args.seeds for attention in args.variants]


# The tags variant_run gives every run besides its labels.
VARIANT_RUN_SCHEMA: dict[str, tuple[type, ...]] = {
  "attention": (str,),
  "seed": (int,),
  "steps": (int,),
  "quick": (bool,),
}


def variant_run(
  config_file: str,
  config_arg: str,
  labels: Mapping[str, Any],
  attention: str,
  seed: int,
  steps: int,
  quick: bool,
  **more_tags: Any,
) -> GridRun:
  """A run of ``config_file`` with ``config_arg``, named ``<labels' values>-<attention>-steps<steps>-s<seed>`` and
  tagged with ``labels``, the variant, seed, steps, ``quick`` and ``more_tags``."""
  return GridRun(
    name="-".join([*map(str, labels.values()), attention, f"steps{steps}", f"s{seed}"]),
    config_file=config_file,
    config_arg=config_arg,
    tags=dict(labels, attention=attention, seed=seed, steps=steps, quick=bool(quick), **more_tags),
  )


NUMBER = (int, float)
SIZE_AND_COST_SCHEMA: dict[str, tuple[type, ...]] = {
  "num_params": (int,),
  "sequence_length": (int,),
  "attention_flops": NUMBER,
  "attention_flops_relative": NUMBER,
}


def size_and_cost_fields(
  model_summary: Callable[[Any], Mapping[str, Any]], run: GridRun
) -> dict[str, Any]:
  """The ``SIZE_AND_COST_SCHEMA`` fields of a run, from its config alone."""
  summary = model_summary(load_config(run.config_file, run.config_arg))
  return {
    "num_params": int(summary["parameters"]),
    "sequence_length": int(summary["sequence_length"]),
    "attention_flops": float(summary["attention_flops"]),
    "attention_flops_relative": float(summary["attention_flops_relative"]),
  }


def size_and_cost_columns(
  records: Sequence[Mapping[str, Any]], per: str
) -> dict[str, Callable[[tuple], str]]:
  """``summary_table`` extra columns (rows keyed by attention): parameters, attention MFLOPs per
  ``per`` (e.g. 'image') and attention FLOPs relative to softmax."""
  params = first_by_variant(records, "num_params")
  flops = first_by_variant(records, "attention_flops")
  relative = first_by_variant(records, "attention_flops_relative")
  return {
    "params": lambda key: f"{params[key[0]]:,}",
    f"attention MFLOPs / {per}": lambda key: f"{flops[key[0]] / 1e6:.4g}",
    "attention FLOPs / softmax": lambda key: f"{relative[key[0]]:.2f}",
  }


# ------------------------------------------------------------------------------------------------
# A task's paper grid and the one command line that runs it.

RecordFn = Callable[[GridRun, Mapping[str, Any], str], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class VariantChoice:
  """The defaults of ``--variants`` and ``--seeds`` (``quick``: ``--quick``'s variants, whose
  seed is 0; None keeps the default variants)."""

  default: tuple[str, ...]
  quick: tuple[str, ...] | None = None
  seeds: tuple[int, ...] = (0, 1, 2)


# --variants of the ListOps and images grids: the five attention forms of the SVR view; by default
# softmax and SH.
ATTENTION_FORMS = VariantChoice(("softmax", "linear", "bn", "sh", "bn_sh"), ("softmax", "sh"))


@dataclasses.dataclass(frozen=True)
class Reproduction:
  """A task's paper grid, declared by its study module as ``REPRODUCTION`` and run by ``reproduce``.

  Every grid takes ``--root``, ``--results``, ``--jobs``, ``--quick``, ``--dry_run`` and
  ``--report_only`` (and ``--variants``/``--seeds`` where ``variants`` is given), plus the task's own
  ``flags``.

  Attributes:
    task: the task's name; the defaults are ``--root=workdirs/<task>_grid`` and
      ``--results=results/<task>.json`` (with ``--quick``: ``workdirs/<task>_quick`` and
      ``<root>/<task>_quick.json``, out of the committed ``results/``).
    summary: what the grid measures (the first line of ``--help``).
    commands: the commands for each scale and what they cost (the end of ``--help``).
    quick: what ``--quick`` runs (its help).
    build_runs: ``args -> [GridRun]``.
    record_fn: ``(run, final_metrics, workdir, args) -> the record's task fields``.
    markdown_report: ``(records, command) -> the report`` (``command`` made the records).
    flags: the task's own flags: flag → ``add_argument`` options.
    check_arguments: completes ``args`` or raises ValueError / FileNotFoundError (one line).
    validate_record: raises ValueError naming what is wrong with a record.
    write_figures: ``(records, args) -> paths of the figures written next to --results``.
    variants: the defaults of ``--variants``/``--seeds``; None: the grid has neither flag.
  """

  task: str
  summary: str
  commands: str
  quick: str
  build_runs: Callable[[argparse.Namespace], list[GridRun]]
  record_fn: Callable[..., Mapping[str, Any]]
  markdown_report: Callable[[Sequence[Mapping[str, Any]], str], str]
  flags: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  check_arguments: Callable[[argparse.Namespace], None] | None = None
  validate_record: Callable[[Mapping[str, Any]], None] | None = None
  write_figures: Callable[[Sequence[Mapping[str, Any]], argparse.Namespace], list[str]] | None = (
    None
  )
  variants: VariantChoice | None = None


# Reproduction fields → the module-level names a study module gives them (module_reproduction).
MODULE_FIELDS = {
  "commands": "GRID_COMMANDS",
  "flags": "FLAGS",
  "build_runs": "build_runs",
  "record_fn": "record_fn",
  "markdown_report": "markdown_report",
  "check_arguments": "check_arguments",
  "validate_record": "validate_record",
  "write_figures": "write_figures",
}


def module_reproduction(module_name: str, **fields: Any) -> Reproduction:
  """The grid of study module ``module_name`` (its ``__name__``, called at its end): ``fields``,
  and for the others the module's own definitions named as in ``MODULE_FIELDS``, where it has them.
  """
  module = sys.modules[module_name]
  found = {
    field: getattr(module, name) for field, name in MODULE_FIELDS.items() if hasattr(module, name)
  }
  return Reproduction(**{**found, **fields})


# The flags of every grid besides --quick (whose help is the task's): flag → add_argument options.
SHARED_FLAGS: dict[str, dict[str, Any]] = {
  "--root": dict(default="", help="parent of the runs' workdirs (default workdirs/<task>_grid)"),
  "--results": dict(
    default="",
    help="records (JSON); the .md and the figures go next to it (default results/<task>.json)",
  ),
  "--jobs": dict(
    type=int, default=1, help="runs trained at once, one process each (e.g. 6 on a GPU)"
  ),
  "--dry_run": dict(action="store_true", help="list the runs and whether each is finished"),
  "--report_only": dict(
    action="store_true",
    help="re-render the report from every record of --results; train nothing",
  ),
  "--finished_only": dict(
    action="store_true",
    help="report the runs finished under --root (a grid cut short, e.g. at the end of a lease); "
    "train nothing; the report lists the runs left out",
  ),
}


USER_ERROR_STATUS = 2


class _OneLineArgumentParser(argparse.ArgumentParser):
  """argparse, with a bad flag reported as one line ``error: ...`` (exit status 2) that points
  to ``--help`` instead of the usage block."""

  def error(self, message: str):
    print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(USER_ERROR_STATUS)


def parse_arguments(reproduction: Reproduction, argv: Sequence[str] | None) -> argparse.Namespace:
  """The grid's flags: those shared by every grid plus the task's; defaults filled in.

  A bad flag exits with one line ``error: ...`` and status 2."""
  parser = _OneLineArgumentParser(
    prog=f"primal-dual reproduce {reproduction.task}",
    description=reproduction.summary,
    epilog=reproduction.commands,
    formatter_class=argparse.RawDescriptionHelpFormatter,
    allow_abbrev=False,  # `--job=2` is a typo, not `--jobs=2`
  )
  choice = reproduction.variants
  if choice is not None:
    add_variant_and_seed_arguments(parser, choice.default, choice.quick, choice.seeds)
  for flag, options in {**reproduction.flags, **SHARED_FLAGS}.items():
    parser.add_argument(flag, **options)
  parser.add_argument("--quick", action="store_true", help=f"smoke test: {reproduction.quick}")
  args = parser.parse_args(argv)
  if args.jobs < 1:
    parser.error(f"--jobs={args.jobs}: give at least 1 (runs trained at once)")
  if choice is not None:
    check_variants_and_seeds(parser, args, choice.default, choice.quick, choice.seeds)
  stem = reproduction.task + ("_quick" if args.quick else "")
  args.root = args.root or os.path.join("workdirs", stem if args.quick else f"{stem}_grid")
  # A smoke test's report stays beside its runs, out of the committed results/.
  args.results = args.results or os.path.join(
    args.root if args.quick else "results", f"{stem}.json"
  )
  return args


def runs_without_records(
  runs: Sequence[GridRun], records: Sequence[Mapping[str, Any]]
) -> list[str]:
  """The names of the runs of ``runs`` none of ``records`` comes from (a record is named after its
  run, ``<run>`` or ``<run>/<replica>``)."""
  covered = {str(record["name"]).split("/")[0] for record in records}
  return [run.name for run in runs if run.name not in covered]


def left_out_section(left_out: Sequence[str], total: int) -> str:
  """The end of a ``--finished_only`` report: the grid's runs it does not cover (``total``: the
  grid's number of runs)."""
  if not left_out:
    return ""
  names = "\n".join(f"- `{name}`" for name in left_out)
  return (
    f"\n## Runs of the grid not in this report\n\n{len(left_out)} of the grid's {total} runs "
    f"had not finished (`--finished_only`):\n\n{names}\n"
  )


def _print_dry_run(runs: Sequence[GridRun], root: str) -> None:
  for run in runs:
    done = is_finished(os.path.join(root, run.name))
    print(f"  {'finished' if done else 'to train'}  {run.name}  ({run.config_arg})")


def reproduce(reproduction: Reproduction, argv: Sequence[str] | None = None) -> int:
  """Trains the grid's unfinished runs and writes its records, report and figures.

  Returns the exit status: 0, or 2 after a one-line ``error: ...`` on a problem the user can fix
  (a bad flag, a run whose config refuses its arguments, a missing results file, a full disk).
  """
  args = parse_arguments(reproduction, argv)
  try:
    return _reproduce(reproduction, args, argv)
  except errors.UserError as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return USER_ERROR_STATUS
  except OSError as e:  # writing the records, report or figures
    if not errors.is_disk_full(e):
      raise
    print(
      f"error: {errors.DiskFullError(os.path.dirname(os.path.abspath(e.filename or args.results)))}",
      file=sys.stderr,
    )
    return USER_ERROR_STATUS


def check_run_configs(runs: Sequence[GridRun]) -> None:
  """Builds every run's config before anything trains.

  Raises:
    errors.UserError: the first run whose config refuses its arguments, named.
  """
  for run in runs:
    try:
      run.config()
    except errors.UserError as e:
      raise errors.UserError(f"{run.name}: {e}") from e


def _reproduce(reproduction: Reproduction, args: argparse.Namespace, argv) -> int:
  """``reproduce`` once its flags are parsed; user errors propagate."""
  if reproduction.check_arguments is not None:
    try:
      reproduction.check_arguments(args)
    except (ValueError, FileNotFoundError) as e:  # its documented one-line refusals
      raise errors.UserError(str(e)) from e
  runs = reproduction.build_runs(args)
  print(f"{reproduction.task} grid: {len(runs)} runs under {args.root}")
  if args.dry_run:
    _print_dry_run(runs, args.root)
    return 0
  if args.report_only and args.finished_only:
    raise errors.UserError(
      "--report_only reads --results, --finished_only reads the runs under --root: pass one"
    )
  if not args.report_only:
    check_run_configs(runs)
  # --report_only re-renders every record of the results JSON, whatever workdirs exist here.
  records = records_for_report(
    runs,
    args.root,
    args.results,
    report_only=args.report_only,
    record_fn=functools.partial(reproduction.record_fn, args=args),
    jobs=args.jobs,
    validate_record=reproduction.validate_record,
    finished_only=args.finished_only,
  )
  if reproduction.validate_record is not None:
    for record in records:
      reproduction.validate_record(record)
  markdown_path = os.path.splitext(args.results)[0] + ".md"
  command = report_command(
    f"scripts/reproduce.py {reproduction.task}",
    argv,
    markdown_path,
    report_only=args.report_only,
  )
  report = reproduction.markdown_report(records, command)
  if "--finished_only" in command.split():  # also when --report_only re-renders such a report
    report += left_out_section(runs_without_records(runs, records), len(runs))
  atomic.write_text(markdown_path, report)
  written = [args.results, markdown_path]
  if reproduction.write_figures is not None:
    written += reproduction.write_figures(records, args)
  print("wrote " + ", ".join(written))
  return 0


def _main(argv: Sequence[str]) -> int:
  """``python -m reproduce.grid CONFIG_FILE CONFIG_ARG WORKDIR [JSON]``: one run;
  JSON holds its ``overrides``."""
  if len(argv) not in (3, 4):
    print(
      "usage: python -m reproduce.grid CONFIG_FILE CONFIG_ARG WORKDIR [JSON]",
      file=sys.stderr,
    )
    return 2
  config_file, config_arg, workdir = argv[:3]
  extra = json.loads(argv[3]) if len(argv) == 4 else {}
  # JSON has no tuples: a sweep's value lists come back as lists.
  overrides = {
    k: tuple(v) if isinstance(v, list) else v for k, v in extra.get("overrides", {}).items()
  }
  run = GridRun(
    name=os.path.basename(workdir),
    config_file=config_file,
    config_arg=config_arg,
    overrides=overrides,
  )
  try:
    train_one(run, workdir)
  except errors.UserError as e:  # the grid reads this last line of the run's log
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return USER_ERROR_STATUS
  return 0


if __name__ == "__main__":
  sys.exit(_main(sys.argv[1:]))
