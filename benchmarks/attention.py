"""Speed, memory and FLOPs of every attention kernel beside JAX's and Flax's own attention.

For each kernel × sequence length × dtype × pass (``forward``: the kernel; ``forward_backward``:
the gradient of ``sum(output)`` with respect to q, k and v) this records the median wall time of
warm calls, XLA's memory numbers of the compiled executable, an analytic FLOP count and XLA's
FLOP count, and the achieved FLOP/s as a fraction of a large matmul's FLOP/s measured in the same
run (the practical hardware limit, "roofline"). Definitions of the timing and memory numbers are
in :mod:`benchmarks.common`. Run ``python -m benchmarks.attention --help``.

Analytic FLOPs (forward pass). Notation: batch B, heads H, length N (queries = keys), head size
D = d_qk = d_v. A multiply-add counts 2; every elementwise operation (including exp, rsqrt,
divisions and the terms of a reduction) counts 1::

  softmax, jax.nn.dot_product_attention, flax dot_product_attention:
      B·H·(2N²D [QKᵀ] + 2N²D [PV] + 6N² [scale, max, subtract, exp, sum, divide])
  linear, dual form (Φ = elu + 1, no 1/√D):
      B·H·(6ND [Φ(q), Φ(k): 3 ops each] + 2N²D [Φ(Q)Φ(K)ᵀ] + 2N² [row sum, divide] + 2N²D [PV])
  linear, primal form:
      B·H·(6ND [Φ] + 2ND² [S = Φ(K)ᵀV] + ND [z] + 2ND² [Φ(Q)S] + 2ND [Φ(Q)z] + ND [divide])
  random features (m features):
      B·H·(4NDm [ωᵀq̃, ωᵀk̃] + 6ND [scaling, ‖x̃‖²] + 6Nm [shift, exp, max]
           + 2NmD [S] + Nm [z] + 2NmD [Φ(Q)S] + 2Nm [Φ(Q)z] + ND [divide])
  Attention-BN (softmax): softmax + B·H·10ND [key mean and variance: 4ND; normalise q and k: 6ND]
  Attention-SH (ratios r_h; heads with the same ratio run together on M_h = ceil(N/r_h) keys):
      Σ_h B·(2N·M_h·D [QKᵀ] + 2N·M_h·D [PV] + 6N·M_h + [r_h > 1]·2ND [pool keys and values])
  HYLA (rms_head normalisation, relu value MLP), per example with the head sum explicit:
      B·(2HN²D [scores] + 5HN² [scale, square, mean over heads, multiply] + N² [rsqrt]
         + 2HN²D [u = Σ_h a_h v_h] + N²D [relu] + 2HN²D [out = Σ_j a u])
      The chunked form (query_chunk_size) does the same arithmetic block by block, and so does the
      blockwise form (block_size) over (query block × key block) tiles; its backward pass
      recomputes every tile, about one more forward, which the 3 × rule below does not count.

  forward_backward = 3 × forward (the backward pass costs about twice the forward: one matmul per
  operand gradient for each forward matmul). This is the usual rule of thumb, not an exact count.

Memory: ``temp_bytes`` (XLA's temp buffer size) is the attention's working memory;
``peak_bytes = arguments + outputs + temp − aliased``. Both come from
``jax.jit(f).lower(...).compile().memory_analysis()`` and are deterministic. A combination whose
``peak_bytes`` exceeds ``--memory-cap-gib`` is compiled (memory and XLA FLOPs are recorded) but not
run: status ``skipped_memory``. One whose predicted time per call (the previous length's time
scaled quadratically) exceeds ``--time-cap-s`` is also compiled but not run: ``skipped_time``.
"""

from __future__ import annotations

import argparse
import functools
import math
import operator
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from primal_dual import kernels
from primal_dual.kernels.hyla import hyla_attention
from primal_dual.kernels.scaled_head import pooled_length, scaled_head_attention

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (16, 32)
# Flags whose default depends on --quick.
FULL_DEFAULTS = dict(
  lengths=list(DEFAULT_LENGTHS), repeats=5, hyla_chunk=128, hyla_block=128, matmul_size=2048
)
QUICK_DEFAULTS = dict(
  lengths=list(QUICK_LENGTHS), repeats=1, hyla_chunk=8, hyla_block=8, matmul_size=256
)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
SOFTMAX_ELEMENTWISE_PER_LOGIT = 6
BACKWARD_OVER_FORWARD = 2.0


class Shape(NamedTuple):
  """Benchmark sizes: q/k/v are ``[batch, length, heads, head_dim]``."""

  batch: int
  length: int
  heads: int
  head_dim: int


class Options(NamedTuple):
  """Variant options shared by all kernels of one run."""

  sh_ratios: tuple[int, ...]
  hyla_chunk: int
  num_features: int
  hyla_block: int = 128


class KernelSpec(NamedTuple):
  """A benchmarked kernel.

  Attributes:
    build: ``Options -> fn(q, k, v) -> out`` (all ``[B, N, H, D]``).
    forward_flops: ``(Shape, Options) -> float``, analytic forward FLOPs (module docstring).
    description: one line for the report.
  """

  build: Callable[[Options], Callable]
  forward_flops: Callable[[Shape, Options], float]
  description: str


def default_sh_ratios(heads: int) -> tuple[int, ...]:
  """``(1, 1, 2, 2, 4, 4, 8, 8)`` for 8 heads: quarters of the heads with ratios 1, 2, 4, 8."""
  return tuple(2 ** (h * 4 // heads) for h in range(heads))


# --- Analytic forward FLOPs ----------------------------------------------------------------------


def softmax_flops(s: Shape, o: Options) -> float:
  del o
  n, d = s.length, s.head_dim
  return s.batch * s.heads * (4 * n * n * d + SOFTMAX_ELEMENTWISE_PER_LOGIT * n * n)


def linear_dual_flops(s: Shape, o: Options) -> float:
  del o
  n, d = s.length, s.head_dim
  return s.batch * s.heads * (6 * n * d + 4 * n * n * d + 2 * n * n)


def linear_primal_flops(s: Shape, o: Options) -> float:
  del o
  n, d = s.length, s.head_dim
  return s.batch * s.heads * (6 * n * d + 4 * n * d * d + n * d + 2 * n * d + n * d)


def random_feature_flops(s: Shape, o: Options) -> float:
  n, d, m = s.length, s.head_dim, o.num_features
  return (
    s.batch * s.heads * (4 * n * d * m + 6 * n * d + 6 * n * m + 4 * n * m * d + 3 * n * m + n * d)
  )


def batchnorm_flops(s: Shape, o: Options) -> float:
  return softmax_flops(s, o) + s.batch * s.heads * 10 * s.length * s.head_dim


def scaled_head_flops(s: Shape, o: Options) -> float:
  n, d = s.length, s.head_dim

  def one_head(ratio: int) -> float:
    m = pooled_length(n, ratio)
    pooling = 2 * n * d if ratio > 1 else 0
    return 4 * n * m * d + SOFTMAX_ELEMENTWISE_PER_LOGIT * n * m + pooling

  return s.batch * sum(one_head(r) for r in o.sh_ratios)


def hyla_flops(s: Shape, o: Options) -> float:
  del o
  n, d, h = s.length, s.head_dim, s.heads
  return s.batch * (6 * h * n * n * d + 5 * h * n * n + n * n + n * n * d)


# --- The kernels ---------------------------------------------------------------------------------


def _fixed(fn, **options) -> Callable[[Options], Callable]:
  return lambda o: functools.partial(fn, **options)


def _random_feature(o: Options):
  return functools.partial(
    kernels.random_feature_attention, num_features=o.num_features, feature_key=jax.random.key(0)
  )


def _flax_attention(query, key, value):
  # deterministic=True: Flax's default (False) would ask for a dropout rng.
  return nn.dot_product_attention(query, key, value, deterministic=True)


KERNELS: dict[str, KernelSpec] = {
  "softmax": KernelSpec(
    _fixed(kernels.softmax_attention), softmax_flops, "primal_dual softmax_attention"
  ),
  "jax_dot_product_attention": KernelSpec(
    _fixed(jax.nn.dot_product_attention, implementation="xla"),
    softmax_flops,
    "jax.nn.dot_product_attention(implementation='xla')",
  ),
  "flax_dot_product_attention": KernelSpec(
    lambda o: _flax_attention, softmax_flops, "flax.linen.dot_product_attention"
  ),
  "linear_dual": KernelSpec(
    _fixed(kernels.linear_attention, form="dual"),
    linear_dual_flops,
    "linear_attention(form='dual'), O(N²)",
  ),
  "linear_primal": KernelSpec(
    _fixed(kernels.linear_attention, form="primal"),
    linear_primal_flops,
    "linear_attention(form='primal'), O(N)",
  ),
  "random_feature": KernelSpec(
    _random_feature, random_feature_flops, "random_feature_attention (num_features m)"
  ),
  "batchnorm_softmax": KernelSpec(
    _fixed(kernels.batchnorm_attention, kernel="softmax"),
    batchnorm_flops,
    "batchnorm_attention(kernel='softmax')",
  ),
  "scaled_head": KernelSpec(
    lambda o: functools.partial(scaled_head_attention, ratios=o.sh_ratios),
    scaled_head_flops,
    "scaled_head_attention(ratios)",
  ),
  # block_size=None: the dense paths, not the blockwise default (block_size='auto').
  "hyla": KernelSpec(_fixed(hyla_attention, block_size=None), hyla_flops, "hyla_attention, naive"),
  "hyla_chunked": KernelSpec(
    lambda o: functools.partial(hyla_attention, query_chunk_size=o.hyla_chunk, block_size=None),
    hyla_flops,
    "hyla_attention(query_chunk_size)",
  ),
  "hyla_blockwise": KernelSpec(
    lambda o: functools.partial(hyla_attention, block_size=o.hyla_block),
    hyla_flops,
    "hyla_attention(block_size), query × key tiles",
  ),
}


REFERENCE_KERNELS = frozenset({"jax_dot_product_attention", "flax_dot_product_attention"})


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


def measure(
  kernel: str,
  shape: Shape,
  dtype_name: str,
  pass_name: str,
  options: Options,
  limits: RunLimits,
  previous: tuple[int, float] | None,
) -> dict[str, Any]:
  """One record: compile, read XLA's numbers, then time unless a cap says not to."""
  spec = KERNELS[kernel]
  transform, flop_factor = PASSES[pass_name]
  analytic = flop_factor * spec.forward_flops(shape, options)
  record: dict[str, Any] = {
    "kernel": kernel,
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
    "status": "ok",
    "reason": "",
  }
  inputs = make_inputs(shape, DTYPES[dtype_name])
  try:
    compiled = common.compile_for(transform(spec.build(options)), *inputs)
  except Exception as error:  # A kernel that cannot run here is reported, not fatal.
    reason = f"compile: {type(error).__name__}: {error}"
    return {**record, "status": "error", "reason": reason[:400]}
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
    return {**record, "status": "error", "reason": f"run: {type(error).__name__}: {error}"[:400]}
  return {
    **record,
    "time_s": timing.median_s,
    "time_iqr_s": timing.iqr_s,
    "repeats": len(timing.samples_s),
    "achieved_flops_per_s": analytic / timing.median_s,
  }


def sweep(
  kernel_names,
  lengths,
  dtype_names,
  pass_names,
  *,
  batch,
  heads,
  head_dim,
  options,
  limits,
  log=print,
) -> list[dict[str, Any]]:
  """Every record, lengths increasing within each (dtype, pass, kernel) for the time prediction."""
  records = []
  for dtype_name in dtype_names:
    for pass_name in pass_names:
      for kernel in kernel_names:
        previous = None
        for length in lengths:
          record = measure(
            kernel,
            Shape(batch, length, heads, head_dim),
            dtype_name,
            pass_name,
            options,
            limits,
            previous,
          )
          if record["time_s"] is not None:
            previous = (length, record["time_s"])
          log(_progress_line(record))
          records.append(record)
  return records


def _progress_line(r: Mapping[str, Any]) -> str:
  time_text = "-" if r["time_s"] is None else f"{r['time_s'] * 1e3:9.3f} ms"
  temp = r.get("temp_bytes")
  temp_text = "-" if temp is None else f"{temp / 2**20:8.2f} MiB"
  return (
    f"{r['dtype']:8s} {r['pass']:16s} {r['kernel']:27s} N={r['length']:5d} "
    f"{time_text:>12s} temp {temp_text:>12s} {r['status']} {r['reason']}"
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


# --- HYLA chunked vs naive outputs ---------------------------------------------------------------


def hyla_chunk_agreement(shape: Shape, options: Options, memory_cap_bytes: float) -> dict:
  """Max |naive − chunked| of HYLA's forward output (float32) at ``shape``."""
  inputs = make_inputs(shape, jnp.float32)
  try:
    compiled = {
      name: common.compile_for(KERNELS[name].build(options), *inputs)
      for name in ("hyla", "hyla_chunked")
    }
  except Exception as error:  # e.g. RESOURCE_EXHAUSTED while a GPU compiler autotunes.
    return dict(
      length=shape.length,
      max_abs_diff=None,
      reason=f"compile: {type(error).__name__}: {error}"[:400],
    )
  peak = max(common.memory_numbers(c)["peak_bytes"] for c in compiled.values())
  if peak > memory_cap_bytes:
    return dict(
      length=shape.length, max_abs_diff=None, reason=f"peak {peak / 2**30:.2f} GiB > memory cap"
    )
  naive, chunked = (
    np.asarray(compiled[name](*inputs), np.float64) for name in ("hyla", "hyla_chunked")
  )
  return dict(
    length=shape.length,
    max_abs_diff=float(np.max(np.abs(naive - chunked))),
    max_abs_output=float(np.max(np.abs(naive))),
    reason="",
  )


# --- Targets -------------------------------------------------------------------------------------

COMPARISONS = {"<=": operator.le, "<": operator.lt}


class RecordIndex:
  """Records looked up by ``(kernel, length, dtype, pass)``."""

  def __init__(self, records):
    self._by_key = {(r["kernel"], r["length"], r["dtype"], r["pass"]): r for r in records}
    self.lengths = sorted({r["length"] for r in records})

  def get(self, kernel, length, field, dtype="float32", pass_name="forward_backward"):
    record = self._by_key.get((kernel, length, dtype, pass_name))
    return None if record is None else record.get(field)

  def ratio(
    self,
    numerator,
    denominator,
    length,
    field="time_s",
    dtype="float32",
    pass_name="forward_backward",
  ):
    top = self.get(numerator, length, field, dtype, pass_name)
    bottom = self.get(denominator, length, field, dtype, pass_name)
    return None if top is None or not bottom else top / bottom

  def lengths_in(self, low, high):
    """Run lengths in ``[low, high]``; every run length if none is (e.g. a --quick run)."""
    inside = [n for n in self.lengths if low <= n <= high]
    return inside or list(self.lengths)

  def length_or_largest(self, wanted):
    return wanted if wanted in self.lengths else max(self.lengths)


def _target(name, description, measured, target, comparison="<=", lengths=(), details=None):
  if measured is None:
    status = "N/A"
  else:
    status = "PASS" if COMPARISONS[comparison](measured, target) else "MISS"
  return dict(
    name=name,
    description=description,
    measured=measured,
    target=target,
    comparison=comparison,
    status=status,
    lengths=list(lengths),
    details=details or {},
  )


def _worst_ratio(index, numerator, denominator, lengths, **kwargs):
  ratios = {n: index.ratio(numerator, denominator, n, **kwargs) for n in lengths}
  known = [v for v in ratios.values() if v is not None]
  return (max(known) if known else None), ratios


def target_softmax_vs_jax(index, extra):
  lengths = index.lengths_in(512, 2048)
  worst, ratios = _worst_ratio(index, "softmax", "jax_dot_product_attention", lengths)
  return _target(
    "softmax_vs_jax_dot_product_attention",
    "softmax time / jax.nn.dot_product_attention time, fwd+bwd, float32, worst length",
    worst,
    1.10,
    lengths=lengths,
    details={"ratio_by_length": ratios},
  )


def target_bn_vs_softmax(index, extra):
  lengths = index.lengths_in(512, 2048)
  worst, ratios = _worst_ratio(index, "batchnorm_softmax", "softmax", lengths)
  return _target(
    "batchnorm_vs_softmax",
    "Attention-BN time / softmax time, fwd+bwd, float32, worst length",
    worst,
    1.25,
    lengths=lengths,
    details={"ratio_by_length": ratios},
  )


def target_sh_time(index, extra):
  n = index.length_or_largest(2048)
  return _target(
    "scaled_head_time_vs_softmax",
    "Attention-SH time / softmax time, fwd+bwd, float32",
    index.ratio("scaled_head", "softmax", n),
    0.6,
    lengths=[n],
    details={"forward_ratio": index.ratio("scaled_head", "softmax", n, pass_name="forward")},
  )


def target_sh_memory(index, extra):
  # Measured on fwd+bwd: that is where the N×N weights must be kept (as residuals), so the pooled
  # lengths show. In the forward pass alone XLA on CPU fuses softmax with both matmuls and keeps no
  # N×N buffer for plain softmax, so its forward temp bytes say little about attention memory.
  n = index.length_or_largest(2048)
  return _target(
    "scaled_head_memory_vs_softmax",
    "Attention-SH temp bytes / softmax temp bytes, fwd+bwd, float32",
    index.ratio("scaled_head", "softmax", n, "temp_bytes"),
    0.5,
    lengths=[n],
    details={
      "forward_ratio": index.ratio("scaled_head", "softmax", n, "temp_bytes", pass_name="forward")
    },
  )


def target_linear_primal_faster(index, extra):
  lengths = index.lengths_in(1024, math.inf)
  worst, ratios = _worst_ratio(index, "linear_primal", "linear_dual", lengths)
  return _target(
    "linear_primal_faster_than_dual",
    "linear primal time / linear dual time, fwd+bwd, float32, worst length >= 1024",
    worst,
    1.0,
    "<",
    lengths=lengths,
    details={"ratio_by_length": ratios},
  )


def target_linear_primal_scaling(index, extra):
  short, long = (
    (1024, 4096) if {1024, 4096} <= set(index.lengths) else (min(index.lengths), max(index.lengths))
  )
  # 5 for a 4× longer sequence (linear cost plus slack); scaled the same for other lengths.
  target = 1.25 * long / short
  return _target(
    "linear_primal_scaling",
    f"linear primal time({long}) / time({short}), fwd+bwd, float32",
    _length_ratio(index, "linear_primal", long, short),
    target,
    lengths=[short, long],
  )


def _length_ratio(index, kernel, long, short):
  top, bottom = index.get(kernel, long, "time_s"), index.get(kernel, short, "time_s")
  return None if top is None or not bottom else top / bottom


def target_hyla_chunk_memory(index, extra):
  # Forward pass: the chunks bound the live part of u [B, c, N, D]. In fwd+bwd, lax.map keeps every
  # chunk's residuals for the backward pass, so the saving shrinks (reported in the details).
  n = index.length_or_largest(2048)
  agreement = extra.get("hyla_agreement") or {}
  return _target(
    "hyla_chunked_memory_vs_naive",
    "HYLA chunked temp bytes / naive temp bytes, forward, float32",
    index.ratio("hyla_chunked", "hyla", n, "temp_bytes", pass_name="forward"),
    0.25,
    lengths=[n],
    details={
      "max_abs_diff": agreement.get("max_abs_diff"),
      "agreement": agreement,
      "forward_backward_ratio": index.ratio("hyla_chunked", "hyla", n, "temp_bytes"),
    },
  )


TARGETS: dict[str, Callable[[RecordIndex, Mapping[str, Any]], dict]] = {
  "softmax_vs_jax_dot_product_attention": target_softmax_vs_jax,
  "batchnorm_vs_softmax": target_bn_vs_softmax,
  "scaled_head_time_vs_softmax": target_sh_time,
  "scaled_head_memory_vs_softmax": target_sh_memory,
  "linear_primal_faster_than_dual": target_linear_primal_faster,
  "linear_primal_scaling": target_linear_primal_scaling,
  "hyla_chunked_memory_vs_naive": target_hyla_chunk_memory,
}


def evaluate_targets(records, extra) -> list[dict[str, Any]]:
  index = RecordIndex(records)
  return [fn(index, extra) for fn in TARGETS.values()]


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
  """Rows: kernels; columns: lengths; cells: ``field`` of the (dtype, pass) records."""
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
  ("Working memory: XLA temp buffers (MiB)", "temp_bytes", common.format_mib),
  (
    "Achieved FLOP/s as a fraction of the matmul roofline",
    "fraction_of_roofline",
    common.format_percent,
  ),
)

DETAIL_COLUMNS = (
  common.Column("kernel", "kernel"),
  common.Column("dtype", "dtype"),
  common.Column("pass", "pass"),
  common.Column("N", "length"),
  common.Column("time ms", "time_s", common.format_ms),
  common.Column("IQR ms", "time_iqr_s", common.format_ms),
  common.Column("temp MiB", "temp_bytes", common.format_mib),
  common.Column("peak MiB", "peak_bytes", common.format_mib),
  common.Column("analytic GFLOP", "analytic_flops", common.format_giga),
  common.Column("XLA GFLOP", "xla_flops", common.format_giga),
  common.Column("GFLOP/s", "achieved_flops_per_s", common.format_giga),
  common.Column("of roofline", "fraction_of_roofline", common.format_percent),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)


def render_markdown(payload) -> str:
  meta, records = payload["metadata"], payload["records"]
  config = payload["config"]
  lengths, kernel_names = config["lengths"], config["kernels"]
  parts = [
    "# Attention kernels: time, memory, FLOPs",
    "",
    common.render_metadata(
      meta,
      (
        "device_label",
        "device_kind",
        "cpu_model",
        "cpu_count",
        "jax_version",
        "flax_version",
        "date_utc",
        "command",
      ),
    ),
    "",
    f"Sizes: batch {config['batch']}, heads {config['heads']}, head dim {config['head_dim']}; "
    f"SH ratios {tuple(config['sh_ratios'])}; HYLA query_chunk_size {config['hyla_chunk']}, "
    f"block_size {config.get('hyla_block')}; "
    f"random features m = {config['num_features']}. Times are medians of warm calls "
    "(compile excluded). Definitions: benchmarks/README.md.",
    "",
    "## Roofline (large matmul)",
    "",
    common.render_markdown_table(
      (
        common.Column("dtype", "dtype"),
        common.Column("size", "size"),
        common.Column("time ms", "time_s", common.format_ms),
        common.Column("GFLOP/s", "flops_per_s", common.format_giga),
      ),
      payload["roofline"].values(),
    ),
    "",
    "## Targets",
    "",
    common.render_markdown_table(
      (
        common.Column("target", "name"),
        common.Column("measured", "measured", common.format_ratio),
        common.Column("must be", "comparison"),
        common.Column("limit", "target", common.format_ratio),
        common.Column("status", "status"),
        common.Column("lengths", "lengths", lambda v: ", ".join(map(str, v))),
        common.Column("what", "description"),
      ),
      payload["targets"],
    ),
  ]
  hyla = next((t for t in payload["targets"] if t["name"] == "hyla_chunked_memory_vs_naive"), None)
  if hyla is not None:
    parts += [
      "",
      f"HYLA chunked vs naive forward output, max abs diff: {hyla['details'].get('max_abs_diff')}",
    ]
  for dtype_name in config["dtypes"]:
    for pass_name in config["passes"]:
      for title, field, fmt in PIVOTS:
        parts += [
          "",
          f"## {title}: {dtype_name}, {pass_name}",
          "",
          pivot_table(records, kernel_names, lengths, dtype_name, pass_name, field, fmt),
        ]
  parts += ["", "## All records", "", common.render_markdown_table(DETAIL_COLUMNS, records), ""]
  return "\n".join(parts)


def plot_times(payload, path) -> Path:
  """Log-log time vs length, one line per kernel, one panel per dtype × pass."""
  from primal_dual.analysis import plots  # pylint: disable=g-import-not-at-top

  plt = plots.pyplot()

  config, records = payload["config"], payload["records"]
  dtypes, passes = config["dtypes"], config["passes"]
  fig, axes = plt.subplots(
    len(dtypes), len(passes), figsize=(6 * len(passes), 4.5 * len(dtypes)), squeeze=False
  )
  for row, dtype_name in enumerate(dtypes):
    for col, pass_name in enumerate(passes):
      ax = axes[row][col]
      for kernel in config["kernels"]:
        points = sorted(
          (r["length"], r["time_s"])
          for r in records
          if r["kernel"] == kernel
          and r["dtype"] == dtype_name
          and r["pass"] == pass_name
          and r["time_s"] is not None
        )
        if points:  # JAX's and Flax's own attention dashed: they are the references.
          style = "--" if kernel in REFERENCE_KERNELS else "-"
          ax.plot(*zip(*points), style, marker="o", label=kernel)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("sequence length")
      ax.set_ylabel("median time (s)")
      ax.set_title(f"{dtype_name}, {pass_name}")
      ax.grid(True, which="both", alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.suptitle(f"Attention kernels on {payload['metadata']['device_label']}")
  fig.tight_layout()
  return Path(plots.save_figure(fig, path, dpi=120, tight_bbox=False))


# --- Command line --------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _name_list(choices):
  def parse(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = sorted(set(names) - set(choices))
    if unknown:
      raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {sorted(choices)}")
    return names

  return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.attention",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--lengths",
    type=_int_list,
    default=None,
    help=f"default {DEFAULT_LENGTHS} ({QUICK_LENGTHS} with --quick)",
  )
  parser.add_argument("--dtypes", type=_name_list(DTYPES), default=list(DTYPES))
  parser.add_argument("--kernels", type=_name_list(KERNELS), default=list(KERNELS))
  parser.add_argument("--passes", type=_name_list(PASSES), default=list(PASSES))
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
    "--hyla-chunk",
    type=int,
    default=None,
    help="HYLA query_chunk_size (default 128; 8 with --quick)",
  )
  parser.add_argument(
    "--hyla-block",
    type=int,
    default=None,
    help="HYLA blockwise block_size (default 128; 8 with --quick)",
  )
  parser.add_argument("--num-features", type=int, default=256, help="random features m")
  parser.add_argument(
    "--sh-ratios",
    type=_int_list,
    default=None,
    help="one per head; default (1,1,2,2,4,4,8,8) pattern for any head count",
  )
  parser.add_argument(
    "--matmul-size",
    type=int,
    default=None,
    help="roofline matmul size (default 2048; 256 with --quick)",
  )
  parser.add_argument("--out-dir", default="benchmarks/results")
  parser.add_argument(
    "--device-label",
    default=None,
    help="name in the file names and report (default: cpu, or platform-kind)",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="tiny run: lengths 16,32, 1 repeat, matmul 256, HYLA chunk and block "
    "8 (flags given explicitly still win)",
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
  options = Options(args.sh_ratios, args.hyla_chunk, args.num_features, args.hyla_block)
  limits = RunLimits(args.repeats, args.budget_s, args.time_cap_s, args.memory_cap_gib * 2**30)
  lengths = sorted(args.lengths)
  roofline = {d: measure_matmul(args.matmul_size, d, max(args.repeats, 3)) for d in args.dtypes}
  for entry in roofline.values():
    log(f"roofline {entry['dtype']}: {entry['flops_per_s'] / 1e9:.1f} GFLOP/s")
  records = sweep(
    args.kernels,
    lengths,
    args.dtypes,
    args.passes,
    batch=args.batch,
    heads=args.heads,
    head_dim=args.head_dim,
    options=options,
    limits=limits,
    log=log,
  )
  attach_roofline(records, roofline)
  extra = {}
  if {"hyla", "hyla_chunked"} <= set(args.kernels):
    # Check agreement at a length the sweep could run naive HYLA at (the largest lengths can be
    # out of memory for it: N² × d floats).
    fits = [
      r["length"]
      for r in records
      if r["kernel"] == "hyla" and r["pass"] == "forward" and r["status"] == "ok"
    ]
    n = 2048 if 2048 in fits else max(fits or lengths)
    extra["hyla_agreement"] = hyla_chunk_agreement(
      Shape(args.batch, n, args.heads, args.head_dim), options, limits.memory_cap_bytes
    )
  config = dict(
    lengths=lengths,
    dtypes=list(args.dtypes),
    passes=list(args.passes),
    kernels=list(args.kernels),
    batch=args.batch,
    heads=args.heads,
    head_dim=args.head_dim,
    repeats=args.repeats,
    budget_s=args.budget_s,
    time_cap_s=args.time_cap_s,
    memory_cap_gib=args.memory_cap_gib,
    sh_ratios=list(args.sh_ratios),
    hyla_chunk=args.hyla_chunk,
    hyla_block=args.hyla_block,
    num_features=args.num_features,
    matmul_size=args.matmul_size,
    kernel_descriptions={k: KERNELS[k].description for k in args.kernels},
  )
  payload = dict(
    metadata=common.run_metadata(label),
    config=config,
    roofline=roofline,
    targets=evaluate_targets(records, extra),
    records=records,
  )
  paths = {
    "json": common.write_json(
      common.result_path(args.out_dir, "attention", "json", label), payload
    ),
    "markdown": common.result_path(args.out_dir, "attention", "md", label),
    "plot": plot_times(payload, common.result_path(args.out_dir, "attention_time", "png", label)),
  }
  paths["markdown"].write_text(render_markdown(payload))
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
