"""Time and memory of every registered attention variant beside the fused reference.

Every variant of ``primal_dual.registry`` is measured, with the options a model gives it
(``registry.model_options``; SH and BN+SH get the ``--sh-ratios``, default ``(1,1,2,2,4,4,8,8)``
for 8 heads) and the learned kernel parameters it declares (``params``, at their initial value).
Kernels with alternative paths are measured on each: a kernel that takes ``implementation`` runs
through its default ``'auto'`` path (row ``softmax``) and through ``'reference'``
(row ``softmax[implementation=reference]``); one that takes ``block_size`` runs dense
(``block_size=None``, row ``hyla``) and blockwise (row ``hyla[block_size=128]``), and on a GPU
HYLA also through its fused Triton kernel (row ``hyla[implementation=tensorcore]``, which the HYLA
targets then read; on a CPU it only interprets, so the row is left out). A variant added
to the registry is measured without any edit here. The fused reference (row ``fused_reference``)
is ``jax.nn.dot_product_attention`` with ``implementation='cudnn'`` on a GPU (bfloat16, float16)
and ``'xla'`` otherwise.

For each case × sequence length × dtype × pass (``forward``: the kernel; ``forward_backward``: the
gradient of ``sum(output)`` with respect to q, k and v) this records the median wall time of warm
calls, its ratio to ``softmax`` and to the fused reference of the same length, dtype and pass,
XLA's memory numbers of the compiled executable (``benchmarks.common``), the registry's FLOP count
(``AttentionVariant.flops`` × batch; ``forward_backward`` = 3 × forward) and XLA's, and the
achieved FLOP/s as a fraction of a large matmul's (the "roofline"). A combination whose
``peak_bytes`` exceeds ``--memory-cap-gib`` is compiled (memory and XLA FLOPs are recorded) but not
run: status ``skipped_memory``; one whose predicted time per call (the previous length's time
scaled quadratically) exceeds ``--time-cap-s`` likewise: ``skipped_time``. One whose largest
intermediate buffer (read from the jaxpr, before any compilation: a dense kernel's
``[B, H, N, N]`` float32 logits) exceeds ``--buffer-cap-gib`` is not even compiled (on a GPU XLA
autotunes such programs for minutes): status ``skipped_buffer``, no memory or XLA FLOPs. Run
``python -m benchmarks.attention --help``; the targets are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import inspect
import operator
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.extend
import jax.numpy as jnp

from benchmarks import common
from primal_dual import registry

DEFAULT_LENGTHS = (1024, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (16, 32)
# Flags whose default depends on --quick.
FULL_DEFAULTS = dict(lengths=list(DEFAULT_LENGTHS), repeats=5, hyla_block=128, matmul_size=2048)
QUICK_DEFAULTS = dict(lengths=list(QUICK_LENGTHS), repeats=1, hyla_block=8, matmul_size=256)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
BACKWARD_OVER_FORWARD = 2.0
FUSED_REFERENCE = "fused_reference"
SOFTMAX = "softmax"


class Shape(NamedTuple):
  """Benchmark sizes: q/k/v are ``[batch, length, heads, head_dim]``."""

  batch: int
  length: int
  heads: int
  head_dim: int


class Case(NamedTuple):
  """One benchmarked attention function (a row of the report).

  Attributes:
    name: ``variant``, ``variant[option=value]`` for an alternative path, or ``fused_reference``.
    variant: the registry name (``softmax`` for the reference, whose FLOPs are softmax's).
    options: the options its factory gets (none for the reference).
    key_padding: the keys of every example end at ``valid_key_length`` of the length, given as
      ``key_value_seq_lengths`` (the form cuDNN takes); name suffix ``[key_padding]``.
  """

  name: str
  variant: str
  options: Mapping[str, Any]
  key_padding: bool = False


# The rows also measured with padded keys (given as lengths): the reference and the variants whose
# targets hold "with and without a key-padding mask".
KEY_PADDING_SUFFIX = "[key_padding]"
KEY_PADDED_VARIANTS = (FUSED_REFERENCE, "softmax", "sh", "bn_sh")


def valid_key_length(length: int) -> int:
  """The keys a padded row keeps: seven eighths of them."""
  return length - length // 8


def is_reference(case: Case) -> bool:
  return case.name.removesuffix(KEY_PADDING_SUFFIX) == FUSED_REFERENCE


def key_padded(case: Case) -> Case:
  """``case`` with padded keys."""
  return case._replace(name=case.name + KEY_PADDING_SUFFIX, key_padding=True)


def default_sh_ratios(heads: int) -> tuple[int, ...]:
  """``(1, 1, 2, 2, 4, 4, 8, 8)`` for 8 heads: quarters of the heads with ratios 1, 2, 4, 8."""
  return tuple(2 ** (h * 4 // heads) for h in range(heads))


# Backends on which the fused kernels are compiled (elsewhere they run interpreted).
FUSED_BACKENDS = ("gpu",)
# The fused GPU kernels measured beside the XLA paths (rows ``hyla[implementation=<name>]``),
# the fastest last.
FUSED_IMPLEMENTATIONS = ("tensorcore",)

# --- The cases, from the registry ----------------------------------------------------------------


def alternative_paths(hyla_block: int) -> dict[str, tuple[Any, Any]]:
  """Kernel options with a second path worth measuring: option -> (main row's value, other's).

  The main row passes its value explicitly, so a kernel default changing does not move the rows.
  """
  return {"implementation": ("auto", "reference"), "block_size": (None, hyla_block)}


def variant_cases(name: str, heads: int, sh_ratios: Sequence[int], hyla_block: int) -> list[Case]:
  """The rows of registry variant ``name``: its main path, then one row per alternative path."""
  options = registry.model_options(name, heads, ratios=tuple(sh_ratios))
  accepted = inspect.signature(registry.make_attention_fn(name, options)).parameters
  paths = {
    option: values for option, values in alternative_paths(hyla_block).items() if option in accepted
  }
  main = {**options, **{option: values[0] for option, values in paths.items()}}
  cases = [Case(name, name, main)]
  for option, (_, other) in paths.items():
    if _serves(name, {**main, option: other}, heads):
      cases.append(Case(f"{name}[{option}={other}]", name, {**main, option: other}))
  # HYLA's fused kernels, measured where they are compiled (on a CPU they run interpreted, which
  # says nothing about their speed): their own default tile.
  for fused in FUSED_IMPLEMENTATIONS:
    fused_options = {**main, "implementation": fused, "block_size": "auto"}
    if (
      jax.default_backend() in FUSED_BACKENDS
      and {"implementation", "block_size"} <= set(accepted)
      and _serves(name, fused_options, heads)
    ):
      cases.append(Case(f"{name}[implementation={fused}]", name, fused_options))
  return cases


def _serves(name: str, options: dict[str, Any], heads: int) -> bool:
  """Whether variant ``name`` accepts ``options`` at all (e.g. the blockwise HYLA path refuses
  the ablations it cannot compute: a ``ValueError``), tried on a tiny input.

  Any other error (a kernel that fails to build on this backend) keeps the case: it claims to
  serve the call, so :func:`measure` records its failure as the row's ``error``.
  """
  x = jnp.ones((1, 16, heads, 2), jnp.float32)  # long enough for the default SH ratios
  try:
    registry.make_attention_fn(name, options)(x, x, x)
  except ValueError:
    return False
  except Exception:  # reported by measure(), not here
    return True
  return True


def all_cases(
  heads: int, sh_ratios: Sequence[int], hyla_block: int, variants: Sequence[str] | None = None
) -> list[Case]:
  """The fused reference, then every registered variant's rows (``variants``: only these)."""
  names = list(registry.ATTENTION_REGISTRY) if variants is None else list(variants)
  cases = [Case(FUSED_REFERENCE, SOFTMAX, {})]  # softmax attention, so softmax's FLOPs
  for name in names:
    cases += variant_cases(name, heads, sh_ratios, hyla_block)
  return cases + [key_padded(c) for c in cases if c.name in KEY_PADDED_VARIANTS]


def reference_implementation(dtype) -> str:
  """``'cudnn'`` on a GPU for the dtypes cuDNN's fused attention takes, else ``'xla'``."""
  cudnn_dtypes = (jnp.bfloat16, jnp.float16)
  return "cudnn" if jax.default_backend() == "gpu" and dtype in cudnn_dtypes else "xla"


def initial_kernel_params(variant: str, shape: Shape) -> dict[str, jax.Array]:
  """The learned parameters the variant's kernel declares (``params``), at their initial value."""
  params = registry.lookup(variant).params
  keys = jax.random.split(jax.random.key(2), max(1, len(params)))
  return {
    name: param.init(key, param.shape(shape.heads, shape.head_dim), jnp.float32)
    for (name, param), key in zip(params.items(), keys)
  }


def build_attention(case: Case, shape: Shape, dtype) -> Callable:
  """``fn(q, k, v) -> out``, all ``[B, N, H, D]``, with the case's kernel parameters (and
  ``key_value_seq_lengths [B]`` of a padded case) bound."""
  padding = {}
  if case.key_padding:
    lengths = jnp.full((shape.batch,), valid_key_length(shape.length), jnp.int32)
    padding = {"key_value_seq_lengths": lengths}
  if is_reference(case):
    return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, implementation=reference_implementation(dtype), **padding
    )
  attention_fn = registry.make_attention_fn(case.variant, case.options)
  kernel_params = initial_kernel_params(case.variant, shape)
  return lambda q, k, v: attention_fn(q, k, v, **padding, **kernel_params)


def forward_flops(case: Case, shape: Shape) -> float:
  """The registry's FLOPs of one layer on one example, times the batch."""
  attention_shape = registry.AttentionShape(shape.length, shape.heads, shape.head_dim)
  return shape.batch * registry.lookup(case.variant).flops(attention_shape, case.options)


# --- Passes --------------------------------------------------------------------------------------


def forward_pass(attention: Callable) -> Callable:
  return attention


def forward_backward_pass(attention: Callable) -> Callable:
  """``(q, k, v) -> (dq, dk, dv)`` of ``sum(attention(q, k, v))`` (summed in float32)."""

  def loss(q, k, v):
    return jnp.sum(attention(q, k, v).astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


# pass name -> (transform of the kernel, analytic FLOPs relative to the forward pass).
PASSES: dict[str, tuple[Callable[[Callable], Callable], float]] = {
  "forward": (forward_pass, 1.0),
  "forward_backward": (forward_backward_pass, 1.0 + BACKWARD_OVER_FORWARD),
}


# --- Measurement ---------------------------------------------------------------------------------


class RunLimits(NamedTuple):
  repeats: int
  budget_s: float
  time_cap_s: float
  memory_cap_bytes: float
  buffer_cap_bytes: float = float("inf")


def _jaxpr_buffers(jaxpr):
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      aval = var.aval
      if hasattr(aval, "shape") and hasattr(aval, "dtype"):
        yield aval.size * aval.dtype.itemsize
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _jaxpr_buffers(sub)


def largest_buffer_bytes(fn: Callable, *inputs) -> int:
  """Bytes of the largest value ``fn`` computes, from its jaxpr (tracing only: no compilation,
  no autotuning). Dense attention shows its ``[B, H, N, N]`` logits here; fused cuDNN calls are
  opaque custom calls and show none."""
  jaxpr = jax.make_jaxpr(fn)(*inputs).jaxpr
  return max(_jaxpr_buffers(jaxpr), default=0)


def make_inputs(shape: Shape, dtype, seed: int = 0):
  """Standard-normal ``q, k, v`` of shape ``[B, N, H, D]`` in ``dtype``."""
  keys = jax.random.split(jax.random.key(seed), 3)
  size = (shape.batch, shape.length, shape.heads, shape.head_dim)
  return tuple(jax.random.normal(k, size, jnp.float32).astype(dtype) for k in keys)


def predicted_seconds(previous: tuple[int, float] | None, length: int) -> float:
  """Time per call at ``length`` from the previous length's, assuming quadratic cost."""
  if previous is None:
    return 0.0
  previous_length, previous_seconds = previous
  return previous_seconds * (length / previous_length) ** 2


def _failed(record, stage: str, error: Exception) -> dict[str, Any]:
  return {**record, "status": "error", "reason": f"{stage}: {type(error).__name__}: {error}"[:400]}


def measure(
  case: Case,
  shape: Shape,
  dtype_name: str,
  pass_name: str,
  limits: RunLimits,
  previous: tuple[int, float] | None,
) -> dict[str, Any]:
  """One record: compile, read XLA's numbers, then time unless a cap says not to."""
  transform, flop_factor = PASSES[pass_name]
  dtype = DTYPES[dtype_name]
  analytic = flop_factor * forward_flops(case, shape)
  record: dict[str, Any] = {
    "kernel": case.name,
    "variant": case.variant,
    "options": dict(case.options),
    "length": shape.length,
    "dtype": dtype_name,
    "pass": pass_name,
    "batch": shape.batch,
    "heads": shape.heads,
    "head_dim": shape.head_dim,
    "analytic_flops": analytic,
    "time_s": None,
    "time_iqr_s": None,
    "repeats": 0,
    "achieved_flops_per_s": None,
    "fraction_of_roofline": None,
    "time_vs_softmax": None,
    "time_vs_reference": None,
    "status": "ok",
    "reason": "",
  }
  record["key_padding"] = case.key_padding
  if is_reference(case):
    record["options"] = {"implementation": reference_implementation(dtype)}
  try:
    inputs = make_inputs(shape, dtype)
    function = transform(build_attention(case, shape, dtype))
  except Exception as error:  # A kernel that cannot be built here is reported, not fatal.
    return _failed(record, "build", error)
  try:
    largest = largest_buffer_bytes(function, *inputs)
  except Exception as error:  # A kernel that cannot run here is reported, not fatal.
    return _failed(record, "trace", error)
  record["largest_buffer_bytes"] = largest
  if largest > limits.buffer_cap_bytes:
    return {
      **record,
      "status": "skipped_buffer",
      "reason": f"largest buffer {largest / 2**30:.2f} GiB > cap "
      f"{limits.buffer_cap_bytes / 2**30:.2f} GiB (not compiled)",
    }
  try:
    compiled = common.compile_for(function, *inputs)
  except Exception as error:  # A kernel that cannot run here is reported, not fatal.
    return _failed(record, "compile", error)
  stats = common.compiled_stats(compiled)
  record.update(stats._asdict())
  if stats.peak_bytes > limits.memory_cap_bytes:
    return {
      **record,
      "status": "skipped_memory",
      "reason": f"peak {stats.peak_bytes / 2**30:.2f} GiB > cap "
      f"{limits.memory_cap_bytes / 2**30:.2f} GiB",
    }
  expected = predicted_seconds(previous, shape.length)
  if expected > limits.time_cap_s:
    return {
      **record,
      "status": "skipped_time",
      "reason": f"predicted {expected:.1f} s per call (quadratic from length "
      f"{previous[0]}) > cap {limits.time_cap_s:g} s",
    }
  try:
    timing = common.time_warm(compiled, *inputs, repeats=limits.repeats, budget_s=limits.budget_s)
  except Exception as error:
    return _failed(record, "run", error)
  return {
    **record,
    "time_s": timing.median_s,
    "time_iqr_s": timing.iqr_s,
    "repeats": len(timing.samples_s),
    "achieved_flops_per_s": analytic / timing.median_s,
  }


def sweep(cases, lengths, dtype_names, pass_names, *, batch, heads, head_dim, limits, log=print):
  """Every record, lengths increasing within each (dtype, pass, case) for the time prediction."""
  records = []
  for dtype_name in dtype_names:
    for pass_name in pass_names:
      for case in cases:
        previous = None
        for length in lengths:
          shape = Shape(batch, length, heads, head_dim)
          record = measure(case, shape, dtype_name, pass_name, limits, previous)
          if record["time_s"] is not None:
            previous = (length, record["time_s"])
          log(_progress_line(record))
          records.append(record)
  return records


def attach_time_ratios(records) -> None:
  """Sets ``time_vs_softmax`` and ``time_vs_reference`` (same length, dtype and pass)."""
  index = RecordIndex(records)
  for r in records:
    for field, denominator in (
      ("time_vs_softmax", SOFTMAX),
      ("time_vs_reference", FUSED_REFERENCE),
    ):
      r[field] = index.ratio(r["kernel"], denominator, r["length"], "time_s", r["dtype"], r["pass"])


def _progress_line(r: Mapping[str, Any]) -> str:
  time_text = "-" if r["time_s"] is None else f"{r['time_s'] * 1e3:9.3f} ms"
  peak = r.get("peak_bytes")
  peak_text = "-" if peak is None else f"{peak / 2**20:8.2f} MiB"
  return (
    f"{r['dtype']:8s} {r['pass']:16s} {r['kernel']:36s} N={r['length']:5d} "
    f"{time_text:>12s} peak {peak_text:>12s} {r['status']} {r['reason']}"
  )


# --- Roofline ------------------------------------------------------------------------------------


def measure_matmul(size: int, dtype_name: str, repeats: int) -> dict[str, Any]:
  """FLOP/s of a ``size × size × size`` matmul (2·size³ FLOPs), median of warm calls."""
  dtype = DTYPES[dtype_name]
  keys = jax.random.split(jax.random.key(1), 2)
  a, b = (jax.random.normal(k, (size, size), jnp.float32).astype(dtype) for k in keys)
  compiled = common.compile_for(jnp.matmul, a, b)
  timing = common.time_warm(compiled, a, b, repeats=repeats)
  flops = 2.0 * size**3
  return dict(
    dtype=dtype_name,
    size=size,
    flops=flops,
    time_s=timing.median_s,
    time_iqr_s=timing.iqr_s,
    flops_per_s=flops / timing.median_s,
  )


def attach_roofline(records, roofline: Mapping[str, Mapping[str, Any]]) -> None:
  """Sets ``fraction_of_roofline`` = achieved FLOP/s / the same dtype's matmul FLOP/s."""
  for r in records:
    if r["achieved_flops_per_s"] is not None and r["dtype"] in roofline:
      r["fraction_of_roofline"] = r["achieved_flops_per_s"] / roofline[r["dtype"]]["flops_per_s"]


# --- Targets (benchmarks/README.md) --------------------------------------------------------------

COMPARISONS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge}
TARGET_PASS = "forward_backward"


class RecordIndex:
  """Records looked up by ``(case, length, dtype, pass)``."""

  def __init__(self, records, dtype="bfloat16", pass_name=TARGET_PASS):
    self._by_key = {(r["kernel"], r["length"], r["dtype"], r["pass"]): r for r in records}
    self.lengths = sorted({r["length"] for r in records})
    dtypes = list(dict.fromkeys(r["dtype"] for r in records))
    # The targets' dtype: bfloat16, or the run's first dtype when it has none (e.g. a CPU run).
    self.dtype = dtype if dtype in dtypes or not dtypes else dtypes[0]
    self.pass_name = pass_name

  def get(self, case, length, field, dtype=None, pass_name=None):
    key = (case, length, dtype or self.dtype, pass_name or self.pass_name)
    record = self._by_key.get(key)
    return None if record is None else record.get(field)

  def ratio(self, numerator, denominator, length, field="time_s", dtype=None, pass_name=None):
    top = self.get(numerator, length, field, dtype, pass_name)
    bottom = self.get(denominator, length, field, dtype, pass_name)
    return None if top is None or not bottom else top / bottom

  def lengths_from(self, low):
    """Run lengths ``>= low``; every run length if none is (e.g. a --quick run)."""
    return [n for n in self.lengths if n >= low] or list(self.lengths)

  def length_or_largest(self, wanted):
    return wanted if wanted in self.lengths else max(self.lengths)


def _target(name, description, measured, limit, comparison="<=", lengths=(), details=None):
  if measured is None:
    status = "N/A"
  else:
    status = "PASS" if COMPARISONS[comparison](measured, limit) else "MISS"
  return dict(
    name=name,
    description=description,
    measured=measured,
    target=limit,
    comparison=comparison,
    status=status,
    lengths=list(lengths),
    details=details or {},
  )


def _worst(values: Mapping[int, float | None]) -> float | None:
  known = [v for v in values.values() if v is not None]
  return max(known) if known else None


def _worst_time_ratio(index, name, description, numerator, denominator, limit):
  lengths = index.lengths_from(4096)
  ratios = {n: index.ratio(numerator, denominator, n) for n in lengths}
  details = {"ratio_by_length": ratios, "dtype": index.dtype}
  return _target(name, description, _worst(ratios), limit, lengths=lengths, details=details)


def target_softmax_vs_reference(index, cases):
  return _worst_time_ratio(
    index,
    "softmax_vs_fused_reference",
    "softmax time / fused reference time, fwd+bwd, worst length >= 4k",
    SOFTMAX,
    FUSED_REFERENCE,
    1.05,
  )


def target_bn_vs_softmax(index, cases):
  return _worst_time_ratio(
    index,
    "bn_vs_softmax",
    "Attention-BN time / softmax time, fwd+bwd, worst length >= 4k",
    "bn",
    SOFTMAX,
    1.15,
  )


def _excess_over_flop_ratio(index, name, variant, label, suffix=""):
  # Excess of the time ratio over the FLOP ratio: pooled keys should save time in proportion.
  lengths = index.lengths_from(4096)
  excess = {}
  for n in lengths:
    time_ratio = index.ratio(variant + suffix, SOFTMAX + suffix, n)
    flop_ratio = index.ratio(variant, SOFTMAX, n, "analytic_flops")
    excess[n] = None if time_ratio is None or flop_ratio is None else time_ratio - flop_ratio
  padded = ", keys padded (as lengths) to 7/8" if suffix else ""
  return _target(
    name,
    f"{label} time / softmax time minus {label} FLOPs / softmax FLOPs, fwd+bwd{padded}, "
    "worst length >= 4k",
    _worst(excess),
    0.1,
    lengths=lengths,
    details={"excess_by_length": excess, "dtype": index.dtype},
  )


def target_sh_vs_flop_ratio(index, cases):
  return _excess_over_flop_ratio(index, "sh_time_vs_flop_ratio", "sh", "SH")


def target_sh_padded_vs_flop_ratio(index, cases):
  return _excess_over_flop_ratio(
    index, "sh_padded_time_vs_flop_ratio", "sh", "SH", KEY_PADDING_SUFFIX
  )


def target_bn_sh_padded_vs_flop_ratio(index, cases):
  return _excess_over_flop_ratio(
    index, "bn_sh_padded_time_vs_flop_ratio", "bn_sh", "BN+SH", KEY_PADDING_SUFFIX
  )


def target_bn_sh_vs_flop_ratio(index, cases):
  return _excess_over_flop_ratio(index, "bn_sh_time_vs_flop_ratio", "bn_sh", "BN+SH")


def target_sh_memory_scaling(index, cases):
  # SH's peak memory from 4k to 32k (or the run's shortest/longest) against linear growth.
  short = 4096 if 4096 in index.lengths else min(index.lengths)
  long = index.length_or_largest(32768)
  top, bottom = index.get("sh", long, "peak_bytes"), index.get("sh", short, "peak_bytes")
  growth = None if top is None or not bottom or long == short else top / bottom / (long / short)
  return _target(
    "sh_peak_memory_linear",
    f"SH peak bytes({long}) / peak bytes({short}) over {long}/{short}, fwd+bwd",
    growth,
    1.25,
    lengths=[short, long],
    details={"dtype": index.dtype},
  )


def _blockwise_hyla(cases) -> str | None:
  """HYLA's linear-memory row the targets read: the first fused kernel of
  ``FUSED_IMPLEMENTATIONS[::-1]`` measured (the fastest first), else the blockwise path."""
  tiled = [c for c in cases if c.variant == "hyla" and c.options.get("block_size")]
  fused = [
    c.name
    for implementation in FUSED_IMPLEMENTATIONS[::-1]
    for c in tiled
    if c.options.get("implementation") == implementation
  ]
  return (fused or [c.name for c in tiled] or [None])[0]


def target_hyla_blockwise_time(index, cases):
  n = index.length_or_largest(8192)
  return _target(
    "hyla_blockwise_vs_softmax",
    "HYLA blockwise time / softmax time at 8k, fwd+bwd",
    index.ratio(_blockwise_hyla(cases), SOFTMAX, n),
    3.0,
    lengths=[n],
    details={"dtype": index.dtype},
  )


def target_hyla_blockwise_runs(index, cases):
  blockwise = _blockwise_hyla(cases)
  ran = [n for n in index.lengths if index.get(blockwise, n, "status") == "ok"]
  longest = index.length_or_largest(32768)
  return _target(
    "hyla_blockwise_runs_at_32k",
    "longest length HYLA blockwise ran at, fwd+bwd",
    max(ran) if ran else None,
    longest,
    ">=",
    lengths=[longest],
    details={"dtype": index.dtype},
  )


# The fused paths that the issue asks to hold memory linear in N.
LINEAR_MEMORY_VARIANTS = ("softmax", "bn", "sh", "bn_sh")


def target_memory_linear(index, cases):
  # Peak bytes are known for every compiled record, skipped ones included.
  short, long = min(index.lengths), max(index.lengths)
  names = [FUSED_REFERENCE, *(c.name for c in cases if c.name in LINEAR_MEMORY_VARIANTS)]
  names += [name for name in [_blockwise_hyla(cases)] if name]
  growth = {}
  for name in names:
    top, bottom = index.get(name, long, "peak_bytes"), index.get(name, short, "peak_bytes")
    growth[name] = None if top is None or not bottom else top / bottom / (long / short)
  return _target(
    "peak_memory_linear",
    f"peak bytes({long}) / peak bytes({short}) over {long}/{short}, fused paths, worst, fwd+bwd",
    _worst(growth),
    1.25,
    lengths=[short, long],
    details={"growth_over_linear": growth, "dtype": index.dtype},
  )


TARGETS: dict[str, Callable[[RecordIndex, Sequence[Case]], dict]] = {
  "softmax_vs_fused_reference": target_softmax_vs_reference,
  "bn_vs_softmax": target_bn_vs_softmax,
  "sh_time_vs_flop_ratio": target_sh_vs_flop_ratio,
  "bn_sh_time_vs_flop_ratio": target_bn_sh_vs_flop_ratio,
  "sh_padded_time_vs_flop_ratio": target_sh_padded_vs_flop_ratio,
  "bn_sh_padded_time_vs_flop_ratio": target_bn_sh_padded_vs_flop_ratio,
  "sh_peak_memory_linear": target_sh_memory_scaling,
  "hyla_blockwise_vs_softmax": target_hyla_blockwise_time,
  "hyla_blockwise_runs_at_32k": target_hyla_blockwise_runs,
  "peak_memory_linear": target_memory_linear,
}


def evaluate_targets(records, cases) -> list[dict[str, Any]]:
  index = RecordIndex(records)
  return [fn(index, cases) for fn in TARGETS.values()]


# --- Reports -------------------------------------------------------------------------------------


def _cell(record, field, fmt):
  if record is None:
    return "–"
  if record["status"] == "error":
    return "err"
  value = record.get(field)
  if value is None:
    return "skip" if record["status"].startswith("skipped") else "–"
  return fmt(value)


def pivot_table(records, kernel_names, lengths, dtype_name, pass_name, field, fmt) -> str:
  """Rows: cases; columns: lengths; cells: ``field`` of the (dtype, pass) records."""
  by_key = {
    (r["kernel"], r["length"]): r
    for r in records
    if r["dtype"] == dtype_name and r["pass"] == pass_name
  }
  rows = [
    {"kernel": k, **{str(n): _cell(by_key.get((k, n)), field, fmt) for n in lengths}}
    for k in kernel_names
  ]
  columns = [common.Column("kernel", "kernel")] + [common.Column(f"N={n}", str(n)) for n in lengths]
  return common.render_markdown_table(columns, rows)


PIVOTS = (
  ("Median time (ms)", "time_s", common.format_ms),
  ("Time / softmax", "time_vs_softmax", common.format_ratio),
  ("Time / fused reference", "time_vs_reference", common.format_ratio),
  ("Peak memory: XLA arguments + outputs + temp (MiB)", "peak_bytes", common.format_mib),
  (
    "Achieved FLOP/s as a fraction of the matmul roofline",
    "fraction_of_roofline",
    common.format_percent,
  ),
)

DETAIL_COLUMNS = (
  *common.plain_columns("kernel", "dtype", "pass"),
  common.Column("N", "length"),
  *common.timing_columns("time ms"),
  common.Column("/ softmax", "time_vs_softmax", common.format_ratio),
  common.Column("/ reference", "time_vs_reference", common.format_ratio),
  common.Column("temp MiB", "temp_bytes", common.format_mib),
  common.Column("peak MiB", "peak_bytes", common.format_mib),
  common.Column("largest buffer MiB", "largest_buffer_bytes", common.format_mib),
  common.Column("analytic GFLOP", "analytic_flops", common.format_giga),
  common.Column("XLA GFLOP", "xla_flops", common.format_giga),
  common.Column("of roofline", "fraction_of_roofline", common.format_percent),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)

TARGET_COLUMNS = (
  common.Column("target", "name"),
  common.Column("measured", "measured", common.format_ratio),
  common.Column("must be", "comparison"),
  common.Column("limit", "target", common.format_ratio),
  common.Column("status", "status"),
  common.Column("lengths", "lengths", lambda v: ", ".join(map(str, v))),
  common.Column("what", "description"),
)

ROOFLINE_COLUMNS = (
  common.Column("dtype", "dtype"),
  common.Column("size", "size"),
  common.Column("time ms", "time_s", common.format_ms),
  common.Column("GFLOP/s", "flops_per_s", common.format_giga),
)


def _case_rows(config) -> list[dict[str, str]]:
  return [
    {
      "kernel": name,
      "variant": case["variant"],
      "options": ", ".join(f"{key}={value}" for key, value in case["options"].items()),
    }
    for name, case in config["cases"].items()
  ]


def render_markdown(payload) -> str:
  records, config = payload["records"], payload["config"]
  parts = [
    *common.report_header("Attention variants: time, memory, FLOPs", payload["metadata"]),
    "",
    f"Sizes: batch {config['batch']}, heads {config['heads']}, head dim {config['head_dim']}; "
    f"SH ratios {tuple(config['sh_ratios'])}; HYLA blockwise block_size {config['hyla_block']}. "
    "Times are medians of warm calls (compile excluded); the fused reference is "
    "jax.nn.dot_product_attention (cudnn on a GPU in bfloat16, xla otherwise). Definitions and "
    "targets: benchmarks/README.md.",
    "",
    "## Targets",
    "",
    common.render_markdown_table(TARGET_COLUMNS, payload["targets"]),
    "",
    "## Cases",
    "",
    common.render_markdown_table(
      common.plain_columns("kernel", "variant", "options"),
      _case_rows(config),
    ),
    "",
    "## Roofline (large matmul)",
    "",
    common.render_markdown_table(ROOFLINE_COLUMNS, payload["roofline"].values()),
  ]
  for dtype_name in config["dtypes"]:
    for pass_name in config["passes"]:
      for title, field, fmt in PIVOTS:
        parts += [
          "",
          f"## {title}: {dtype_name}, {pass_name}",
          "",
          pivot_table(
            records, config["cases"], config["lengths"], dtype_name, pass_name, field, fmt
          ),
        ]
  parts += ["", "## All records", "", common.render_markdown_table(DETAIL_COLUMNS, records), ""]
  return "\n".join(parts)


def _time_points(records, kernel, dtype_name, pass_name) -> list[tuple[int, float]]:
  return sorted(
    (r["length"], r["time_s"])
    for r in records
    if (r["kernel"], r["dtype"], r["pass"]) == (kernel, dtype_name, pass_name)
    and r["time_s"] is not None
  )


def plot_times(payload, path) -> Path:
  """Log-log time vs length, one line per case, one panel per dtype × pass."""
  from primal_dual.analysis import plots

  plt = plots.pyplot()
  config, records = payload["config"], payload["records"]
  dtypes, passes = config["dtypes"], config["passes"]
  fig, axes = plt.subplots(
    len(dtypes), len(passes), figsize=(6 * len(passes), 4.5 * len(dtypes)), squeeze=False
  )
  for row, dtype_name in enumerate(dtypes):
    for col, pass_name in enumerate(passes):
      ax = axes[row][col]
      for kernel in config["cases"]:
        points = _time_points(records, kernel, dtype_name, pass_name)
        if points:  # The fused reference dashed.
          style = "--" if kernel == FUSED_REFERENCE else "-"
          ax.plot(*zip(*points), style, marker="o", label=kernel)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("sequence length")
      ax.set_ylabel("median time (s)")
      ax.set_title(f"{dtype_name}, {pass_name}")
      ax.grid(True, which="both", alpha=0.3)
  axes[0][0].legend(fontsize=6)
  fig.suptitle(f"Attention variants on {payload['metadata']['device_label']}")
  fig.tight_layout()
  return Path(plots.save_figure(fig, path, dpi=120, tight_bbox=False))


# --- Command line --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.attention",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--lengths",
    type=common.comma_list(int),
    default=None,
    help=f"default {DEFAULT_LENGTHS} ({QUICK_LENGTHS} with --quick)",
  )
  parser.add_argument("--dtypes", type=common.comma_list(choices=DTYPES), default=list(DTYPES))
  common.add_variants_argument(parser)
  parser.add_argument("--passes", type=common.comma_list(choices=PASSES), default=list(PASSES))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument(
    "--repeats",
    type=int,
    default=None,
    help="timed warm calls per combination (default 5; 1 with --quick)",
  )
  parser.add_argument(
    "--budget-s",
    type=float,
    default=30.0,
    help="fewer repeats (at least 1) when repeats × one call exceeds this",
  )
  parser.add_argument(
    "--time-cap-s",
    type=float,
    default=20.0,
    help="skip timing when the predicted time per call exceeds this",
  )
  parser.add_argument(
    "--memory-cap-gib",
    type=float,
    default=6.0,
    help="skip timing when XLA's peak bytes exceed this",
  )
  parser.add_argument(
    "--buffer-cap-gib",
    type=float,
    default=8.0,
    help="skip compiling (and running) when the largest intermediate buffer in the jaxpr "
    "exceeds this (dense [B, H, N, N] logits; on a GPU such programs autotune for minutes)",
  )
  parser.add_argument(
    "--hyla-block",
    type=int,
    default=None,
    help="block_size of the blockwise rows (default 128; 8 with --quick)",
  )
  parser.add_argument(
    "--sh-ratios",
    type=common.comma_list(int),
    default=None,
    help="one per head; default (1,1,2,2,4,4,8,8) pattern for any head count",
  )
  parser.add_argument(
    "--matmul-size",
    type=int,
    default=None,
    help="roofline matmul size (default 2048; 256 with --quick)",
  )
  common.add_output_arguments(parser)
  parser.add_argument(
    "--quick",
    action="store_true",
    help="tiny run: lengths 16,32, 1 repeat, matmul 256, HYLA block 8 (flags given explicitly "
    "still win)",
  )
  args = parser.parse_args(argv)
  for name, value in (QUICK_DEFAULTS if args.quick else FULL_DEFAULTS).items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.sh_ratios = tuple(args.sh_ratios or default_sh_ratios(args.heads))
  return args


def run(args: argparse.Namespace, log=print) -> dict[str, Path]:
  """Runs the benchmark described by ``args`` and writes JSON, Markdown and the plot."""
  label = args.device_label or common.default_device_label()
  cases = all_cases(args.heads, args.sh_ratios, args.hyla_block, args.variants)
  limits = RunLimits(
    args.repeats,
    args.budget_s,
    args.time_cap_s,
    args.memory_cap_gib * 2**30,
    args.buffer_cap_gib * 2**30,
  )
  lengths = sorted(args.lengths)
  roofline = {d: measure_matmul(args.matmul_size, d, max(args.repeats, 3)) for d in args.dtypes}
  for entry in roofline.values():
    log(f"roofline {entry['dtype']}: {entry['flops_per_s'] / 1e9:.1f} GFLOP/s")
  sizes = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim)
  records = sweep(cases, lengths, args.dtypes, args.passes, **sizes, limits=limits, log=log)
  attach_roofline(records, roofline)
  attach_time_ratios(records)
  config = dict(
    lengths=lengths,
    dtypes=list(args.dtypes),
    passes=list(args.passes),
    **sizes,
    repeats=args.repeats,
    budget_s=args.budget_s,
    time_cap_s=args.time_cap_s,
    memory_cap_gib=args.memory_cap_gib,
    buffer_cap_gib=args.buffer_cap_gib,
    sh_ratios=list(args.sh_ratios),
    hyla_block=args.hyla_block,
    matmul_size=args.matmul_size,
    cases={c.name: dict(variant=c.variant, options=dict(c.options)) for c in cases},
  )
  payload = dict(
    metadata=common.run_metadata(label),
    config=config,
    roofline=roofline,
    targets=evaluate_targets(records, cases),
    records=records,
  )
  paths = common.write_reports(args.out_dir, "attention", label, payload, render_markdown)
  paths["plot"] = plot_times(payload, common.result_path(args.out_dir, "attention", "png", label))
  for target in payload["targets"]:
    log(
      f"target {target['name']}: {target['measured']} {target['comparison']} "
      f"{target['target']} -> {target['status']}"
    )
  return paths


def main(argv: Sequence[str] | None = None) -> None:
  paths = run(parse_args(argv))
  print("wrote", *map(str, paths.values()))


if __name__ == "__main__":
  main(sys.argv[1:])
