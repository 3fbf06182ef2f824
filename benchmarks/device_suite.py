"""Every GPU figure the benchmarks' targets read, in one call that fits a short device lease.

``python -m benchmarks.device_suite --budget-s 480`` runs, in this order (what the targets read
first), each as one *row*:

1. attention, bfloat16, forward + backward (``benchmarks.attention.measure``): the fused reference
   (cuDNN on a GPU), softmax, bn, sh, bn_sh, HYLA blockwise and HYLA fused (tensorcore; on a GPU only)
   at N = 4k, 8k, 32k (the rows the attention targets read); then, at 4k, softmax, sh and bn_sh
   once and 8 times in one program (``benchmarks.call_cost``): a call's fixed cost apart from its
   per-call cost;
2. small-model throughput (``benchmarks.small_models.time_steps``): the sRAVEN and logic paper
   models with softmax, linear_plain and hyla, K = 100 steps per call, 1, 4, 12 and 24 replicas
   (N = 4k: the paper grid's lr × weight decay × k seeds, each seed its own held-out split);
3. where the sRAVEN step's time goes: on-device data generation, forward, forward + backward +
   update on ready batches, the whole trainer step, and an evaluation pass, each timed alone;
4. every other attention row (other variants, reference and dense paths) at 4k.

Before each row the suite compares its estimated cost (the slowest row of its group so far, else
a prior) with the time left in ``--budget-s``: a row that does not fit is recorded as ``skipped``
(reason ``budget``) and the next is tried. A row that raises is recorded as ``failed`` with the
error, and the suite goes on. The JSON and Markdown reports are rewritten after every row, so a run
cut short keeps what it measured: ``device_suite_<label>.{json,md}`` in ``--out-dir``
(label ``gpu-h100`` on an H100, from the device kind).

JAX's persistent compilation cache is on (``--cache-dir``, every program cached whatever its
compile time or size), so a second call on the same machine skips compiling. ``--tiny`` runs the
same rows at toy sizes (the CPU test); benchmarks/README.md says how to run it on a lent device.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from benchmarks import attention, call_cost, common, small_models

STEM = "device_suite"
TARGET_VARIANTS = ("softmax", "bn", "sh", "bn_sh", "hyla")
SMALL_MODEL_VARIANTS = tuple(small_models.PAPER_CODE_CPU_MS)  # softmax, linear_plain, hyla
PASS = "forward_backward"
DTYPE = "bfloat16"


class Sizes(NamedTuple):
  """The suite's sizes: the full run on a GPU, or toy ones (``--tiny``)."""

  lengths: tuple[int, ...]  # the first is where every other attention row runs
  heads: int
  head_dim: int
  hyla_block: int
  steps_per_call: int
  replicas: tuple[int, ...]
  quick_models: bool  # the configs' runlocal models
  repeats: int


FULL = Sizes((4096, 8192, 32768), 8, 64, 128, 100, (1, 4, 12, 24), False, 3)
TINY = Sizes((16, 32), 2, 8, 8, 2, (1, 2), True, 1)

# Prior estimates (seconds) of one row on an H100, by group; replaced by the slowest row measured
# in the same group. Rows of a group not listed fall back to DEFAULT_ESTIMATE_S.
PRIOR_ESTIMATES_S = {
  "attention/32768": 10.0,
  "small_models/1": 15.0,
  "small_models/4": 15.0,
  "small_models/12": 20.0,
  "small_models/24": 25.0,
  "step_breakdown": 45.0,
  "call_cost": 10.0,
  "hyla_mosaic/32768": 30.0,
}
DEFAULT_ESTIMATE_S = 5.0

# --- Rows ----------------------------------------------------------------------------------------


class Row(NamedTuple):
  """One measurement of the suite.

  Attributes:
    section: ``attention``, ``small_models`` or ``step_breakdown``.
    name: what the row measures, unique in the suite.
    group: rows of similar cost (estimates are shared within a group).
    measure: ``() -> dict`` of the row's fields; raising marks the row failed.
  """

  section: str
  name: str
  group: str
  measure: Callable[[], dict[str, Any]]


def attention_limits(sizes: Sizes) -> attention.RunLimits:
  """Repeats and caps of the attention rows (one H100's memory; dense [B, H, N, N] rows at 32k
  are skipped before compiling)."""
  return attention.RunLimits(
    repeats=sizes.repeats,
    budget_s=5.0,
    time_cap_s=10.0,
    memory_cap_bytes=60 * 2**30,
    buffer_cap_bytes=8 * 2**30,
  )


def _measure_attention(case, length, sizes: Sizes, previous: dict) -> dict[str, Any]:
  shape = attention.Shape(1, length, sizes.heads, sizes.head_dim)
  record = attention.measure(
    case, shape, DTYPE, PASS, attention_limits(sizes), previous.get(case.name)
  )
  if record["time_s"] is not None:  # the next length's time prediction starts here
    previous[case.name] = (length, record["time_s"])
  return record


def attention_rows(sizes: Sizes, variants: Sequence[str]) -> tuple[list[Row], list[Row]]:
  """The target rows at every length, and the other rows of ``variants`` at the first length."""
  cases = attention.all_cases(
    sizes.heads, attention.default_sh_ratios(sizes.heads), sizes.hyla_block, variants
  )
  blockwise = f"hyla[block_size={sizes.hyla_block}]"
  target_names = (attention.FUSED_REFERENCE, *TARGET_VARIANTS[:-1], blockwise)
  target_names += tuple(n + attention.KEY_PADDING_SUFFIX for n in attention.KEY_PADDED_VARIANTS)
  target_names += tuple(f"hyla[implementation={f}]" for f in attention.FUSED_IMPLEMENTATIONS)
  targets = [c for c in cases if c.name in target_names]
  others = [c for c in cases if c.name not in target_names]
  previous: dict[str, tuple[int, float]] = {}
  target_rows = [
    _attention_row(case, length, sizes, previous) for length in sizes.lengths for case in targets
  ]
  other_rows = [_attention_row(case, sizes.lengths[0], sizes, previous) for case in others]
  return target_rows, other_rows


def _attention_row(case, length, sizes, previous) -> Row:
  return Row(
    "attention",
    f"{case.name} N={length}",
    f"attention/{length}",
    functools.partial(_measure_attention, case, length, sizes, previous),
  )


def call_cost_rows(sizes: Sizes, variants: Sequence[str] | None) -> list[Row]:
  """Softmax, sh and bn_sh (those of ``variants``) at the first length: one forward + backward
  per program against ``call_cost.DEFAULT_CALLS`` in one (``benchmarks.call_cost``)."""
  names = [v for v in call_cost.VARIANTS if variants is None or v in variants]
  cases = attention.all_cases(
    sizes.heads, attention.default_sh_ratios(sizes.heads), sizes.hyla_block, names
  )
  length, calls = sizes.lengths[0], call_cost.DEFAULT_CALLS
  shape = attention.Shape(1, length, sizes.heads, sizes.head_dim)
  return [
    Row(
      "call_cost",
      f"{case.name} N={length} 1 vs {calls} calls",
      "call_cost",
      functools.partial(call_cost.measure, case, shape, DTYPE, calls=calls, repeats=sizes.repeats),
    )
    for case in cases
    if case.name in names
  ]


def small_model_rows(sizes: Sizes, models: Sequence[str], variants: Sequence[str]) -> list[Row]:
  """Model-steps per second of each model × variant × replica count, K steps per call: N
  replicas of the paper grid's program (2 lr × 2 weight decays × N/4 seeds, each seed its own
  held-out split) where 4 divides N, else N seeds."""
  rows = []
  for model in models:
    for replicas in sizes.replicas:
      for variant in variants:
        measurement = small_models.Measurement(
          model,
          variant,
          sizes.steps_per_call,
          device_data=True,
          quick=sizes.quick_models,
          num_replicas=replicas,
          sweep="lr_wd_seeds" if replicas % small_models.POINTS_PER_SEED == 0 else "seeds",
        )
        rows.append(
          Row(
            "small_models",
            f"{model} {variant} K={sizes.steps_per_call} N={replicas}",
            f"small_models/{replicas}",
            functools.partial(small_models.time_steps, measurement, sizes.repeats),
          )
        )
  return rows


# --- The Mosaic GPU HYLA forward kernel beside its predicted time --------------------------------


def _measure_mosaic_forward(length: int, e_tile: int, sizes: Sizes) -> dict[str, Any]:
  """Median forward time of ``hyla.mosaic.hyla_mosaic_forward`` (bfloat16, batch 1), and the
  latency model's prediction where the shape is the model's (H 8, d 64). Off GPU the kernel runs
  in JAX's Mosaic GPU interpreter (the CPU test: a time of no meaning)."""
  from primal_dual.kernels import mosaic_interpreter
  from primal_dual.kernels.hyla import mosaic
  from tools.device import hyla_latency_model

  heads, head_dim = sizes.heads, max(sizes.head_dim, 16)  # the kernel's D is a multiple of 16
  q, k, v = attention.make_inputs(attention.Shape(1, length, heads, head_dim), jnp.bfloat16)
  interpret = mosaic_interpreter.params() if jax.default_backend() == "cpu" else None
  forward = jax.jit(
    functools.partial(mosaic.hyla_mosaic_forward, e_tile=e_tile, interpret=interpret)
  )
  measured_ms = 1e3 * common.time_warm(forward, q, k, v, repeats=sizes.repeats).median_s
  predicted_ms = None
  if (heads, head_dim) == (hyla_latency_model.HEADS, hyla_latency_model.HEAD_DIM):
    predicted_ms = hyla_latency_model.mosaic_forward_prediction(length, e_tile)["forward_ms"]
  return {
    "length": length,
    "e_tile": e_tile,
    "time_ms": measured_ms,
    "predicted_ms": predicted_ms,
    "predicted_over_measured": None if predicted_ms is None else predicted_ms / measured_ms,
  }


def hyla_mosaic_rows(sizes: Sizes) -> list[Row]:
  """The Mosaic GPU HYLA forward at every length, one program per query tile (``e_tile`` = d)
  and two (``d / 2``): the rows that check ``tools/device/hyla_latency_model.py``'s prediction."""
  head_dim = max(sizes.head_dim, 16)
  return [
    Row(
      "hyla_mosaic",
      f"hyla mosaic forward N={length} e_tile={e_tile}",
      f"hyla_mosaic/{length}",
      functools.partial(_measure_mosaic_forward, length, e_tile, sizes),
    )
    for length in sizes.lengths
    for e_tile in (head_dim, head_dim // 2)
  ]


# --- Where the sRAVEN step's time goes -----------------------------------------------------------


def _median_call_s(fn: Callable, *args, repeats: int) -> float:
  """Median seconds of ``repeats`` warm calls of ``fn(*args)`` (one untimed call first)."""
  return common.time_warm(fn, *args, repeats=max(repeats, 1)).median_s


def _scan_steps(step: Callable) -> Callable:
  """``(carry, xs) -> carry``: ``step(carry, x)`` for each ``x`` of ``xs`` in one program (a
  ``lax.scan``), as the trainer's K-step call runs, so launch overhead is amortised the same way.
  Every step reads its own ``x``, so XLA cannot hoist the work out of the loop."""

  def run(carry, xs):
    return jax.lax.scan(lambda c, x: (step(c, x), None), carry, xs)[0]

  return jax.jit(run)


def step_breakdown(sizes: Sizes, variant: str = "softmax", model: str = "sraven") -> dict[str, Any]:
  """Milliseconds per step of each part of ``model``'s training step with attention ``variant``,
  each run alone, K steps per program: data generation, forward (loss), forward + backward +
  update on K ready batches (the backward + update is their difference), the trainer's whole
  step, and one evaluation pass."""
  from primal_dual.training import evaluation, steps

  k = sizes.steps_per_call
  measurement = small_models.Measurement(model, variant, k, True, sizes.quick_models)
  # One replica: the Program's state has no replica axis, and its one optimizer is replica 0's.
  program, state = small_models.build(measurement)
  config, task = program.config, program.task
  stream = task.device_train_stream(config, program.metadata)
  make_batch = functools.partial(stream.batch, arguments=stream.arguments)
  tx = program.optimizer.transformation(
    {name: jnp.asarray(values[0]) for name, values in program.optimizer.hyperparameters.items()}
  )

  def records_of(step_index):  # uint32 []: the records of training step `step_index`
    return step_index * jnp.uint32(config.batch_size) + jnp.arange(
      config.batch_size, dtype=jnp.uint32
    )

  def generate(checksum, step_index):  # the checksum keeps every batch live
    batch = make_batch(records_of(step_index))
    return checksum + sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(batch))

  def forward(total, batch):
    variables = steps.model_variables(state.params, state.batch_stats)
    outputs = program.model.apply(variables, batch["inputs"], mask=batch.get("mask"), train=False)
    return total + task.loss_and_metrics(outputs, batch)[0]

  def train(current, batch):
    bound = dict(model=program.model, tx=tx, loss_fn=task.loss_and_metrics)
    return steps.train_step(current, batch, **bound)[0]

  step_indices = jnp.arange(k, dtype=jnp.uint32)
  batches = jax.jit(jax.vmap(lambda i: make_batch(records_of(i))))(step_indices)
  timed = {
    "data_ms": (generate, jnp.float32(0), step_indices),
    "forward_ms": (forward, jnp.float32(0), batches),
    "forward_backward_update_ms": (train, state, batches),
  }
  per_step = {
    key: _median_call_s(_scan_steps(step), carry, xs, repeats=sizes.repeats)
    for key, (step, carry, xs) in timed.items()
  }
  per_step = {key: 1e3 * seconds / k for key, seconds in per_step.items()}
  per_step["backward_update_ms"] = per_step["forward_backward_update_ms"] - per_step["forward_ms"]
  whole = small_models.time_steps(measurement, sizes.repeats)
  # The selection split (the others are larger: the report gives examples/s to scale by); the
  # first pass builds the split and compiles the eval step.
  split = (config.selection.split,)
  evaluation.evaluate_runs(program, state, split)
  start = time.perf_counter()
  evaluation.evaluate_runs(program, state, split)
  evaluation_s = time.perf_counter() - start
  examples = len(program.splits[config.selection.split])
  return {
    "model": model,
    "variant": variant,
    "steps_per_call": k,
    **per_step,
    "trainer_step_ms": whole["ms_per_step"],
    "evaluation_split": config.selection.split,
    "evaluation_examples": examples,
    "evaluation_s": evaluation_s,
    "evaluation_examples_per_s": examples / evaluation_s,
  }


def breakdown_rows(sizes: Sizes, variants: Sequence[str]) -> list[Row]:
  """One step breakdown of the sRAVEN paper model per attention variant."""
  return [
    Row(
      "step_breakdown",
      f"sraven {variant} step parts",
      "step_breakdown",
      functools.partial(step_breakdown, sizes, variant),
    )
    for variant in variants
  ]


# --- The suite -----------------------------------------------------------------------------------


class Budget:
  """Seconds left of ``total_s`` since creation, and each group's estimated row cost."""

  def __init__(self, total_s: float, clock: Callable[[], float] = time.perf_counter):
    self.total_s, self._clock, self._start = total_s, clock, clock()
    self._slowest: dict[str, float] = {}

  def now(self) -> float:
    return self._clock()

  def left_s(self) -> float:
    return self.total_s - (self._clock() - self._start)

  def estimate_s(self, group: str) -> float:
    return self._slowest.get(group, PRIOR_ESTIMATES_S.get(group, DEFAULT_ESTIMATE_S))

  def record(self, group: str, seconds: float) -> None:
    self._slowest[group] = max(seconds, self._slowest.get(group, 0.0))


def run_row(row: Row, budget: Budget) -> dict[str, Any]:
  """The row's record: measured (``ok``, or the measurement's own status), ``failed`` with the
  error, or ``skipped`` (reason ``budget``) when its estimate exceeds the time left."""
  base = {"section": row.section, "row": row.name, "group": row.group}
  estimate, left = budget.estimate_s(row.group), budget.left_s()
  base["estimate_s"] = estimate
  if estimate > left:
    reason = f"budget: estimated {estimate:.1f} s, {max(left, 0.0):.1f} s left"
    return {**base, "status": "skipped", "reason": reason, "wall_s": 0.0}
  start = budget.now()
  try:
    fields = row.measure()
  except Exception as error:  # a failing row is recorded; the suite goes on
    wall = budget.now() - start
    budget.record(row.group, wall)
    reason = f"{type(error).__name__}: {error}"[:600]
    return {**base, "status": "failed", "reason": reason, "wall_s": wall}
  wall = budget.now() - start
  budget.record(row.group, wall)
  return {"status": "ok", "reason": "", **fields, **base, "wall_s": wall}


def run_suite(
  rows: Sequence[Row], budget: Budget, write: Callable[[list[dict]], Any], log=print
) -> list[dict[str, Any]]:
  """Every row in order, ``write(records so far)`` after each."""
  records: list[dict[str, Any]] = []
  for row in rows:
    record = run_row(row, budget)
    records.append(record)
    write(records)
    log(_progress_line(record))
  return records


def _progress_line(r: Mapping[str, Any]) -> str:
  return (
    f"[{r['section']}] {r['row']:44s} {r['status']:8s} {r['wall_s']:7.1f} s  {r.get('reason', '')}"
  )


def enable_compilation_cache(cache_dir: str | Path) -> None:
  """JAX's persistent compilation cache in ``cache_dir``, every program cached (none is too small
  or too quick to compile: the suite's programs are small, and a lease is short)."""
  jax.config.update("jax_compilation_cache_dir", str(cache_dir))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def device_label() -> str:
  """``cpu``, or the platform and the chip's name: ``gpu-h100`` for an 'NVIDIA H100 80GB HBM3'."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return "cpu"
  words = [w for w in device.device_kind.lower().split() if w not in ("nvidia", "tesla")]
  chip = "".join(c for c in (words or ["unknown"])[0] if c.isalnum())
  return f"{device.platform}-{chip}"


# --- Reports -------------------------------------------------------------------------------------

ATTENTION_COLUMNS = (
  common.Column("row", "row"),
  *common.timing_columns("time ms"),
  common.Column("/ softmax", "time_vs_softmax", common.format_ratio),
  common.Column("/ reference", "time_vs_reference", common.format_ratio),
  common.Column("peak MiB", "peak_bytes", common.format_mib),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)
CALL_COST_COLUMNS = (
  common.Column("row", "row"),
  common.Column("1 call ms", "one_call_s", common.format_ms),
  common.Column("calls", "calls"),
  common.Column("all calls ms", "calls_s", common.format_ms),
  common.Column("per call ms", "per_call_s", common.format_ms),
  common.Column("fixed ms", "fixed_s", common.format_ms),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)
SMALL_MODEL_COLUMNS = (
  common.Column("row", "row"),
  common.Column("ms / model-step", "ms_per_step", lambda v: f"{v:.3g}"),
  common.Column("model-steps/s", "model_steps_per_s", lambda v: f"{v:.4g}"),
  common.Column("first call s", "first_call_s", lambda v: f"{v:.3g}"),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)
BREAKDOWN_COLUMNS = (
  common.Column("row", "row"),
  *(
    common.Column(f"{part} ms/step", f"{part}_ms", lambda v: f"{v:.3g}")
    for part in ("data", "forward", "backward_update", "forward_backward_update", "trainer_step")
  ),
  common.Column("evaluation s", "evaluation_s", lambda v: f"{v:.3g}"),
  common.Column("eval examples/s", "evaluation_examples_per_s", lambda v: f"{v:.4g}"),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)
HYLA_MOSAIC_COLUMNS = (
  common.Column("row", "row"),
  common.Column("measured ms", "time_ms", common.format_ratio),
  common.Column("predicted ms", "predicted_ms", common.format_ratio),
  common.Column("predicted / measured", "predicted_over_measured", common.format_ratio),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)
SECTIONS = {
  "attention": ("Attention, bfloat16, forward + backward", ATTENTION_COLUMNS),
  "call_cost": (
    "A call's fixed cost: 1 vs several forward + backward in one program",
    CALL_COST_COLUMNS,
  ),
  "small_models": ("Small models, model-steps per second", SMALL_MODEL_COLUMNS),
  "step_breakdown": ("Where the sRAVEN step's time goes (each part alone)", BREAKDOWN_COLUMNS),
  "hyla_mosaic": (
    "HYLA's Mosaic GPU forward kernel (bfloat16), the latency model's prediction beside",
    HYLA_MOSAIC_COLUMNS,
  ),
}
TARGET_COLUMNS = tuple(c for c in attention.TARGET_COLUMNS if c.key != "description") + (
  common.Column("what", "description"),
)


def render_markdown(payload) -> str:
  records, config = payload["records"], payload["config"]
  statuses = collections.Counter(r["status"] for r in records)
  counts = ", ".join(f"{n} {status}" for status, n in sorted(statuses.items()))
  parts = [
    *common.report_header("Device suite", payload["metadata"]),
    "",
    f"Budget {config['budget_s']:g} s; {len(records)} of {config['rows']} rows written "
    f"({counts or 'none'}); "
    f"{payload['elapsed_s']:.0f} s elapsed. Sizes: {config['sizes']}. Definitions: "
    "benchmarks/README.md.",
  ]
  if payload.get("attention_targets"):
    parts += [
      "",
      "## Attention targets",
      "",
      common.render_markdown_table(TARGET_COLUMNS, payload["attention_targets"]),
    ]
  for section, (title, columns) in SECTIONS.items():
    rows = [r for r in records if r["section"] == section]
    if rows:
      parts += ["", f"## {title}", "", common.render_markdown_table(columns, rows)]
  return "\n".join(parts) + "\n"


def attention_summary(records) -> tuple[list[dict], list[dict]]:
  """The attention records with their time ratios set, and the attention targets they give."""
  measured = [r for r in records if r["section"] == "attention" and "kernel" in r]
  attention.attach_time_ratios(measured)
  cases = [
    attention.Case(r["kernel"], r["variant"], r["options"], r.get("key_padding", False))
    for r in measured
  ]
  targets = attention.evaluate_targets(measured, cases) if measured else []
  return measured, targets


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.device_suite",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--budget-s", type=float, default=480.0, help="rows that do not fit: skipped")
  parser.add_argument("--cache-dir", default=".jax_cache", help="JAX's persistent compile cache")
  parser.add_argument("--tiny", action="store_true", help="toy sizes (the CPU test)")
  parser.add_argument(
    "--sections",
    type=common.comma_list(choices=SECTIONS),
    default=list(SECTIONS),
    help="which parts to run",
  )
  common.add_variants_argument(parser)  # attention rows: None = every registered variant
  parser.add_argument("--models", type=common.comma_list(choices=small_models.MODELS), default=None)
  parser.add_argument(
    "--model-variants", type=common.comma_list(), default=list(SMALL_MODEL_VARIANTS)
  )
  parser.add_argument("--lengths", type=common.comma_list(int), default=None)
  parser.add_argument("--replicas", type=common.comma_list(int), default=None)
  common.add_output_arguments(parser)
  return parser.parse_args(argv)


def sizes_of(args) -> Sizes:
  sizes = TINY if args.tiny else FULL
  if args.lengths:
    sizes = sizes._replace(lengths=tuple(args.lengths))
  if args.replicas:
    sizes = sizes._replace(replicas=tuple(args.replicas))
  return sizes


def build_rows(args, sizes: Sizes) -> list[Row]:
  """The rows of ``args.sections``: the attention target rows, the call-cost rows, small models,
  the step breakdown, then the other attention rows (which no target reads)."""
  wanted = set(args.sections)
  targets, others = attention_rows(sizes, args.variants) if "attention" in wanted else ([], [])
  models = args.models or list(small_models.MODELS)
  rows = list(targets)
  if "call_cost" in wanted:
    rows += call_cost_rows(sizes, args.variants)
  if "small_models" in wanted:
    rows += small_model_rows(sizes, models, args.model_variants)
  if "step_breakdown" in wanted:
    rows += breakdown_rows(sizes, args.model_variants)
  if "hyla_mosaic" in wanted:
    rows += hyla_mosaic_rows(sizes)
  return rows + others


def run(
  args, rows: Sequence[Row] | None = None, budget: Budget | None = None, log=print
) -> dict[str, Path]:
  """Runs the suite (``rows``: those of ``args`` by default; ``budget``: ``--budget-s`` from
  now by default) and writes its reports."""
  enable_compilation_cache(args.cache_dir)
  budget = Budget(args.budget_s) if budget is None else budget
  sizes = sizes_of(args)
  label = args.device_label or device_label()
  rows = build_rows(args, sizes) if rows is None else list(rows)
  config = dict(
    budget_s=args.budget_s,
    cache_dir=str(args.cache_dir),
    sizes=sizes._asdict(),
    rows=len(rows),
    dtype=DTYPE,
    attention_pass=PASS,
  )
  metadata = common.run_metadata(label)
  paths: dict[str, Path] = {}

  def write(records):
    _, targets = attention_summary(records)
    payload = dict(
      metadata=metadata,
      config=config,
      elapsed_s=budget.total_s - budget.left_s(),
      attention_targets=targets,
      records=records,
    )
    paths.update(common.write_reports(args.out_dir, STEM, label, payload, render_markdown))

  records = run_suite(rows, budget, write, log)
  if not records:
    write(records)
  return paths


def main(argv: Sequence[str] | None = None) -> None:
  paths = run(parse_args(argv))
  print("wrote", *map(str, paths.values()))


if __name__ == "__main__":
  main(sys.argv[1:])
