"""Shared machinery of the benchmarks: timing, XLA's memory and cost numbers, metadata, output.

Timing is the median of warm runs: the function is compiled ahead of time (``jit(...).lower(...)
.compile()``), called once to warm caches, then called ``repeats`` times, each call followed by
``jax.block_until_ready``; compile time never enters a measurement.

Memory and FLOPs come from the compiled executable and are deterministic (no timing involved):

* ``temp_bytes``: ``memory_analysis().temp_size_in_bytes``, the scratch buffers XLA allocates for
  the computation itself. For an attention kernel this is its working memory (logits, weights,
  residuals kept for the backward pass, ...).
* ``peak_bytes``: ``argument_size_in_bytes + output_size_in_bytes + temp_size_in_bytes −
  alias_size_in_bytes``: everything the executable holds at once, inputs and outputs included
  (an upper bound on the live memory: XLA reuses temp buffers, but their total size is what it
  reserves). XLA's own ``peak_memory_in_bytes`` field is not used: on the CPU backend it leaves the
  temp buffers out.
* ``xla_flops``: ``cost_analysis()['flops']``. XLA counts the body of a loop (``lax.map``,
  ``lax.scan``) once, not once per iteration, so it under-counts chunked kernels; the analytic
  counts in ``benchmarks.attention`` do not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax
import numpy as np


# ---------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------


class Timing(NamedTuple):
  """Wall time of warm calls, in seconds.

  Attributes:
    median_s: median of the samples.
    iqr_s: interquartile range (75th − 25th percentile) of the samples; 0 with one sample.
    samples_s: every measured call.
  """

  median_s: float
  iqr_s: float
  samples_s: tuple[float, ...]


def summarize_samples(samples: Sequence[float]) -> Timing:
  """Median and interquartile range of timing samples (seconds)."""
  values = np.asarray(samples, dtype=np.float64)
  q25, q75 = np.percentile(values, [25, 75])
  return Timing(float(np.median(values)), float(q75 - q25), tuple(float(x) for x in values))


def time_call(fn: Callable[..., Any], *args: Any) -> float:
  """Seconds taken by one call of ``fn(*args)``, waiting for every output to be ready."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def repeats_within_budget(first_call_s: float, repeats: int, budget_s: float) -> int:
  """How many timed calls fit in ``budget_s`` given one call's duration; between 1 and ``repeats``.

  Slow combinations (seconds per call) get fewer samples instead of stalling the sweep.
  """
  if first_call_s <= 0 or math.isinf(budget_s):
    return repeats
  return max(1, min(repeats, int(budget_s // first_call_s)))


def time_warm(
  fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 1, budget_s: float = math.inf
) -> Timing:
  """Median of ``repeats`` warm calls of an already compiled ``fn``.

  The first ``warmup`` calls are not measured (the last of them sets how many repeats fit in
  ``budget_s``, see :func:`repeats_within_budget`).
  """
  last = 0.0
  for _ in range(max(warmup, 1)):
    last = time_call(fn, *args)
  count = repeats_within_budget(last, repeats, budget_s)
  return summarize_samples([time_call(fn, *args) for _ in range(count)])


# ---------------------------------------------------------------------------------------------
# XLA's memory and cost analyses.
# ---------------------------------------------------------------------------------------------


class CompiledStats(NamedTuple):
  """Deterministic numbers of one compiled executable (see the module docstring)."""

  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  peak_bytes: int
  xla_flops: float | None


def memory_numbers(compiled) -> dict[str, int]:
  """``temp/argument/output/alias/peak`` bytes of a compiled executable (see module docstring)."""
  analysis = compiled.memory_analysis()
  temp = int(analysis.temp_size_in_bytes)
  argument = int(analysis.argument_size_in_bytes)
  output = int(analysis.output_size_in_bytes)
  alias = int(analysis.alias_size_in_bytes)
  return dict(
    temp_bytes=temp,
    argument_bytes=argument,
    output_bytes=output,
    alias_bytes=alias,
    peak_bytes=argument + output + temp - alias,
  )


def xla_flops(compiled) -> float | None:
  """``cost_analysis()['flops']``; the analysis is a dict or (older JAX) a list of dicts."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # Some backends do not implement it.
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  flops = (analysis or {}).get("flops")
  return None if flops is None or flops < 0 else float(flops)


def compiled_stats(compiled) -> CompiledStats:
  return CompiledStats(**memory_numbers(compiled), xla_flops=xla_flops(compiled))


def compile_for(fn: Callable[..., Any], *args: Any):
  """``jax.jit(fn).lower(*args).compile()``: the executable that is then timed and analysed."""
  return jax.jit(fn).lower(*args).compile()


# ---------------------------------------------------------------------------------------------
# Metadata and file names.
# ---------------------------------------------------------------------------------------------


def cpu_model() -> str:
  """The CPU's model name (from /proc/cpuinfo on Linux, else ``platform.processor()``)."""
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.lower().startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def default_device_label() -> str:
  """``cpu`` on the host platform, else the platform and device kind, e.g. ``gpu-nvidia-h100``."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return "cpu"
  kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower()).strip("-")
  return f"{device.platform}-{kind}"


def result_path(out_dir: str | os.PathLike, stem: str, suffix: str, device_label: str) -> Path:
  """``out_dir/stem.suffix`` for CPU runs, ``out_dir/stem_<label>.suffix`` for any other label.

  GPU/TPU results therefore sit beside the CPU ones without overwriting them.
  """
  name = stem if device_label in ("", "cpu") else f"{stem}_{device_label}"
  return Path(out_dir) / f"{name}.{suffix}"


def run_metadata(device_label: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Where and how a benchmark ran: device, software versions, CPU, date and command line."""
  import flax  # Local import: only needed for its version.

  devices = jax.devices()
  return {
    "device_label": device_label,
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "device_count": len(devices),
    "jax_version": jax.__version__,
    "jaxlib_version": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
    "flax_version": flax.__version__,
    "python_version": platform.python_version(),
    "cpu_model": cpu_model(),
    "cpu_count": os.cpu_count(),
    "os": platform.platform(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "command": " ".join([Path(sys.executable).name, "-m", _module_name(), *(argv or sys.argv[1:])]),
  }


def _jaxlib_version() -> str | None:
  try:
    import jaxlib

    return jaxlib.__version__
  except Exception:
    return None


def _module_name() -> str:
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  return spec.name if spec is not None else Path(sys.argv[0]).stem


# ---------------------------------------------------------------------------------------------
# Output: JSON and Markdown.
# ---------------------------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
  """NaN/inf become None (strict JSON); NumPy scalars and tuples become plain Python."""
  if isinstance(value, Mapping):
    return {str(k): _json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_safe(v) for v in value]
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    value = float(value)
    return value if math.isfinite(value) else None
  return value


def write_json(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
  """Writes ``payload`` as indented, strict JSON (no NaN), creating the folder."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(_json_safe(payload), indent=2, allow_nan=False) + "\n")
  return path


class Column(NamedTuple):
  """A Markdown table column: header, record key, formatter of the value."""

  header: str
  key: str
  format: Callable[[Any], str] = str


def render_markdown_table(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]]) -> str:
  """A GitHub Markdown table; missing values render as ``–``."""
  lines = [
    "| " + " | ".join(c.header for c in columns) + " |",
    "|" + "|".join("---" for _ in columns) + "|",
  ]
  for row in rows:
    cells = [("–" if row.get(c.key) is None else c.format(row[c.key])) for c in columns]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plain_columns(*keys: str) -> tuple[Column, ...]:
  """Columns headed by their record key, values as they are."""
  return tuple(Column(key, key) for key in keys)


def timing_columns(time_header: str) -> tuple[Column, Column]:
  """The columns of a :class:`Timing` record: median time and interquartile range, in ms."""
  return Column(time_header, "time_s", format_ms), Column("IQR ms", "time_iqr_s", format_ms)


def render_metadata(metadata: Mapping[str, Any], keys: Sequence[str]) -> str:
  """A bullet list of selected metadata entries."""
  return "\n".join(f"- {key}: `{metadata.get(key)}`" for key in keys)


# The metadata a report shows under its title.
REPORT_METADATA_KEYS = (
  "device_label",
  "device_kind",
  "cpu_model",
  "cpu_count",
  "jax_version",
  "flax_version",
  "date_utc",
  "command",
)


def report_header(
  title: str, metadata: Mapping[str, Any], keys: Sequence[str] = REPORT_METADATA_KEYS
) -> list[str]:
  """A report's first lines: the title, a blank line and the metadata bullets."""
  return [f"# {title}", "", render_metadata(metadata, keys)]


def write_reports(
  out_dir: str | os.PathLike,
  stem: str,
  device_label: str,
  payload: Mapping[str, Any],
  render: Callable[[Mapping[str, Any]], str],
) -> dict[str, Path]:
  """Writes ``payload`` as JSON and its rendering as Markdown; returns both paths.

  The Markdown is rendered from the JSON as written (tuples become lists, NaN None), so
  ``render(json.load(...))`` of a result file gives its Markdown back exactly.
  """
  json_path = write_json(result_path(out_dir, stem, "json", device_label), payload)
  markdown_path = result_path(out_dir, stem, "md", device_label)
  markdown_path.write_text(render(json.loads(json_path.read_text())))
  return {"json": json_path, "markdown": markdown_path}


# ---------------------------------------------------------------------------------------------
# Command lines.
# ---------------------------------------------------------------------------------------------


def comma_list(cast: Callable[[str], Any] = str, choices: Iterable[str] | None = None):
  """An argparse ``type``: ``'a,b'`` -> ``[cast('a'), cast('b')]``, names checked in ``choices``."""
  known = None if choices is None else sorted(choices)

  def parse(text: str) -> list[Any]:
    items = [x for x in text.split(",") if x]
    unknown = [] if known is None else sorted(set(items) - set(known))
    if unknown:
      raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {known}")
    return [cast(x) for x in items]

  return parse


def add_variants_argument(
  parser: argparse.ArgumentParser, default: Sequence[str] | None = None
) -> None:
  """``--variants``: registry names (``primal_dual.registry``); ``default`` None = every one."""
  from primal_dual import registry  # Local import: the timing helpers do not need the library.

  parser.add_argument(
    "--variants",
    type=comma_list(choices=registry.ATTENTION_REGISTRY),
    default=default,
    help="registry variants to measure, comma-separated (default: "
    f"{'every registered one' if default is None else ','.join(default)})",
  )


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
  """``--out-dir`` and ``--device-label``, the same in every benchmark."""
  parser.add_argument("--out-dir", default="benchmarks/results")
  parser.add_argument(
    "--device-label",
    default=None,
    help="name in the file names and report (default: cpu, or platform-kind)",
  )


def format_ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3g}"


def format_mib(num_bytes: float) -> str:
  return f"{num_bytes / 2**20:.3g}"


def format_giga(value: float) -> str:
  return f"{value / 1e9:.3g}"


def format_ratio(value: float) -> str:
  return f"{value:.3g}"


def format_percent(value: float) -> str:
  return f"{100 * value:.3g}%"
