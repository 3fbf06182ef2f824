"""Fused HYLA in Triton with the head-coupled products on tensor cores.

Computes the function of :mod:`blockwise` (formulas there). For one example, heads ``h, g``,
queries ``i``, keys ``j``, a tile holds the scores ``s, a [H, bq, bk]``; the products that couple
the heads are written as batched matrix products (``tl.dot`` on 3-D blocks), so a GPU runs them
on its matrix units (``mma``) instead of as elementwise multiply-adds::

  z_j     = A_j [bq, H]  @ V_j [H, d_v]        batched over the tile's keys j
  out_i   = A_i [H, bk]  @ U_i [bk, d_v]       batched over the tile's queries i
  backward: da_i = dout_i [H, d_v] @ U_iᵀ,  du_i = A_iᵀ [bk, H] @ dout_i,
            da_j += dz_j [bq, d_v] @ V_jᵀ,  dv_j = A_j [H, bq] @ dz_j

The heads batch the per-head products (``q·k``, ``dq``, ``dk``) at the next power of two of their
number; where the coupled products contract or stack them they are zero-padded further to
``HEAD_PAD`` (16, the smallest matrix-instruction dimension, ``tl.join`` in registers). Padded
heads hold zeros and contribute nothing (the RMS mean divides by the true head count). The value
features run in chunks of ``value_chunk`` (the products above are independent per chunk), so a
program keeps ``[bk, bq, chunk]`` of ``z``/``u`` at a time.

Speed. Measured on one H100 80GB HBM3 (JAX 0.11.2, ``python3 -m benchmarks.device_suite
--budget-s 370``; bfloat16, forward + backward, B = 1, H = 8, d = 64) with the previous launches
(a separate dq launch; tile 16, value chunk 16, warps 4 forward / 8 backward): 34.1 ms at N = 4096
and 131 ms at 8192, against cuDNN's fused softmax at 0.559 and 1.31 ms (100×; the target is 3×).
The SASS of those launches (``tools/device/gpu_compile.py``, its time estimate) explains it: the
instructions alone would take about 15 ms at one per cycle per scheduler (the ``HMMA`` are only
4–6 % of them), but each main-loop iteration is a chain of 22–111 stages separated by barriers —
shared-memory round trips that turn ``tl.permute``/``tl.join`` results and 3-D ``tl.dot``
operands from one register layout into another — while an SM holds one or two programs (dq and
dk at 238–252 registers × 8 warps: one), so nothing hides the chain: the model (one constant,
fitted to the 131 ms) puts 50 ms each in dq and dk, 22 ms in dv and 10 ms in the forward. Hence
the present launches: dq is added atomically by the dk launch, which already computes every tile
of ``ds`` that the dq launch recomputed; value chunk 32 halves the stages per key tile of the
forward and of the ``da`` loop (causal calls keep 16: at 32 their dq_dk spills); dv runs 4 warps
(two programs per SM); the query loop of a non-causal dq_dk is rotated per key tile so that
concurrent atomic adds land on different rows. Estimated 52 ms at 8k (forward 5, dq_dk 32, dv 15;
the atomic adds unmodelled), still latency-bound; not yet timed on a GPU
(``tools/device/tensorcore_sweep.py`` times each launch). Tiles, chunk, warps and pipelining
stages (:func:`default_tuning`, by operand width and causality) are the clean settings (no
spills, ≤ 255 registers) with the least estimated time in the sm_90a compile report at H = 8,
d = 64 (``benchmarks/results/gpu_compile.md``, its tensorcore section), and the launches ask
jax-triton for those stages (its default, 3, spills float32 operands). Larger tiles, the obvious
way to more work per stage, spill in the backward (tile 32) or exceed an H100's shared memory.

Kernels, one program per (example, tile[, value chunk]); the backward is a ``jax.custom_vjp``
whose residuals are the inputs (tiles recomputed, as in flash attention):

* forward, grid ``(B, q tiles, value chunks)``: loop over key tiles, ``out`` accumulated in
  float32 ``[bq, H, chunk]``;
* dq_dk, grid ``(B, k tiles)``: loop over query tiles, ``da`` summed over the value chunks,
  ``dk`` accumulated; each tile's part of ``dq`` (and of the bias gradient, an array of the bias's
  own broadcast shape, where duplicates along broadcast axes sum, the gradient of a broadcast)
  added atomically into zeroed float32 arrays; non-causal programs start at query tiles rotated
  by their key tile, so that those running at once add into different rows. Float32 sums in the
  order the programs happen to run: on a GPU ``dq`` (and the bias gradient) may differ between
  two runs in their last bits, as in flash attention's backward;
* dv, grid ``(B, k tiles, value chunks)``: loop over query tiles, ``dv`` of one chunk.
Causal calls skip the tiles outside the band. Lengths need no padding in memory: loads and stores
are masked by index (rows at or beyond the lengths load zeros and are masked like the mask).

Why Triton through jax-triton (and not the other two tools), as checked with jax 0.10.2 on a
CPU-only machine:

* Pallas on Triton (``pallas_call`` on GPU; the project's Pallas HYLA kernel, since removed)
  lowers ``dot_general`` without batch dimensions, so the per-key and per-query products above
  cannot be written as batched matrix products there (only as per-key 2-D dots in Python loops, or
  as the elementwise multiply-adds that made that kernel spill); and JAX 0.11 deprecates Pallas's
  Triton backend in favour of Mosaic GPU.
* Mosaic GPU (Pallas's Hopper backend): its interpret mode runs ``jnp``-level kernel code, but not
  its matrix instruction (``plgpu.wgmma`` fails in interpret mode), and a plain ``jnp.dot`` does
  not lower (``dot_general`` is unimplemented in its lane semantics); ``wgmma`` needs swizzled and
  tiled shared-memory operands. Its compilation to SASS happens inside the CUDA runtime, so no
  register or spill figures come out of a CPU-only machine.
* Triton has batched 3-D ``tl.dot``; its interpreter (``triton.runtime.interpreter``) runs the
  very same ``@triton.jit`` source on a CPU (NumPy for the maths, torch tensors as buffers), which
  is what the test-suite does; and ``triton.compile`` builds it for sm_90a on a CPU with the
  wheel's own ``ptxas``, giving registers, spills, shared memory and the matrix instructions
  (``tools/device/gpu_compile.py``). From JAX, ``jax_triton.triton_call`` launches it on a GPU;
  jax-triton imports only with a CUDA jaxlib, so its lowering for CUDA cannot be checked on a
  CPU (the one thing left to a GPU machine, with every timing).

Off GPU the kernels run in Triton's interpreter inside ``jax.pure_callback`` (slow; for tests),
with two bfloat16 faults of the interpreter mended so that it computes what the GPU does
(:mod:`primal_dual.kernels.triton_interpreter`, the one place that patches the interpreter, and
the Triton versions it was checked on). On a GPU, ``jax_triton.triton_call`` with jax-triton's
current API (0.4: ``out_type``, the outputs as zeroed ``jax.Ref`` arguments), or 0.3's where that
is installed (:func:`jax_triton_uses_refs`).
Dependencies: ``triton`` (and ``torch`` for the interpreter, ``jax-triton`` on a GPU), the
``gpu-dev`` extra; this module is imported only when ``implementation='tensorcore'`` is asked for.

Numerics: scores, normalisation, ``z``, ``u``, gradients and accumulators are float32; as in the
other paths the forward's value-network operands are rounded to the value dtype, and the
backward's products take float32 operands. ``precision``: ``HIGHEST`` gives float32 products
(``ieee``), anything else TF32 for float32 operands on a GPU (XLA's default there); the interpreter
always multiplies exactly in float32. 16-bit inputs: on a GPU they run, by default, through the
float32 kernels with ``a`` and ``u`` rounded to their dtype (``widen_16bit``; lease 7 measured the
16-bit kernels wrong as Triton 3.6 compiles them, see :data:`NATIVE_16BIT_ON_GPU`). Not covered
(``ValueError``): softmax normalisation; through ``hyla_attention``: dropout, returned or sown
weights. Reverse-mode differentiation only.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from primal_dual.kernels import _common as C
from primal_dual.kernels import triton_interpreter
from primal_dual.kernels.hyla import blockwise as hb

NORMALIZATIONS = hb.NORMALIZATIONS
VALUE_NETWORKS = hb.VALUE_NETWORKS
HEAD_PAD = 16  # smallest dimension of a matrix instruction (and of tl.dot)
DEFAULT_BLOCK_SIZE = 16  # query and key tile (from the sm_90a compile report; untimed on a GPU)
# Whether a call with ``interpret=None`` runs in Triton's interpreter: off GPU.
interpret_off_gpu = C.interpret_off_gpu


# Lease 7 (one H100, the device image's Triton 3.6.0 through jax-triton 0.3.1, 2026-11-26): with
# bfloat16 inputs the compiled kernels' output was far from the blockwise path (286 of 288
# elements, errors up to 33 on values up to 11), while every float32 case matched it and the
# float64 reference; Triton 3.9's interpreter computes the bfloat16 kernels right. Compiled with a
# mask, Triton 3.6 and 3.7 give the coupled products 16-bit operands of kWidth 8 at K = 16 (3.8
# and 3.9: 4), the fault upstream fixed in triton-lang/triton#11691 (tools/device/README.md).
# Until a device run shows the 16-bit kernels right (``tools/device/tensorcore_probe.py``), a GPU
# call widens 16-bit inputs to float32 (see ``widen_16bit`` of ``hyla_tensorcore_attention``);
# once one has, only under a Triton older than FIRST_TRITON_WITHOUT_16BIT_FAULT.
NATIVE_16BIT_ON_GPU = False
FIRST_TRITON_WITHOUT_16BIT_FAULT = (3, 8)
_ROUNDING_NAMES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16"}


def value_rounding(value_dtype) -> str:
  """The ``VALUE_ROUNDING`` constant for values of ``value_dtype``: ``'bf16'``, ``'fp16'``, or
  ``'fp32'`` (no rounding)."""
  return _ROUNDING_NAMES.get(jnp.dtype(value_dtype), "fp32")


def rounding_dtype(name: str) -> np.dtype:
  """The dtype a ``VALUE_ROUNDING`` or operand name stands for (inverse of
  :func:`value_rounding`): bfloat16 for ``'bf16'``, float16 for ``'fp16'``, float32 for any other
  (``'fp32'``, and the probe's ``'ieee'``)."""
  return next((d for d, n in _ROUNDING_NAMES.items() if n == name), np.dtype(np.float32))


def triton_version_tuple(version: str) -> tuple[int, int]:
  """``(3, 9)`` of ``'3.9.0'`` (or ``'3.9.0+git1a2b'``)."""
  major, minor = version.split(".")[:2]
  return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def widens_16bit(
  requested: bool | None, interpret: bool, triton_version: str | None = None
) -> bool:
  """Whether a call runs 16-bit inputs as float32: as ``requested``; by default on a GPU unless
  :data:`NATIVE_16BIT_ON_GPU` and the installed Triton (or ``triton_version``) is at least
  :data:`FIRST_TRITON_WITHOUT_16BIT_FAULT`; never in the interpreter (it runs the 16-bit kernels
  the tests check)."""
  if requested is not None:
    return bool(requested)
  fixed = triton_version_tuple(triton_version or triton.__version__)
  return not interpret and not (NATIVE_16BIT_ON_GPU and fixed >= FIRST_TRITON_WITHOUT_16BIT_FAULT)


class LaunchWarps(NamedTuple):
  """Warps per program of each launch (names of :func:`launch_grids`)."""

  forward: int
  dq_dk: int
  dv: int


class Tuning(NamedTuple):
  """The GPU settings of a call: value features per chunk, warps per launch, and Triton's
  software-pipelining stages (every launch)."""

  value_chunk: int
  num_warps: LaunchWarps
  num_stages: int


# The defaults: the clean settings (no spills, ≤ 255 registers, shared memory within a block) with
# the least estimated time in the sm_90a compile report at H = 8, d = 64 (Triton 3.9;
# benchmarks/results/gpu_compile.md), by the operands' width and causality. 16-bit: at chunk 32
# ptxas spills the causal dq_dk launch, at 16 it does not; dq_dk needs 8 warps (at 4 it spills).
# Float32 (float32 inputs, and 16-bit ones a GPU call widens) holds twice the registers per
# operand: at 2 stages its dq_dk spills (356/268 B at chunk 32, 36/24 B causal at chunk 16) and so
# does its dv at 4 warps; without software pipelining (1 stage) chunk 32 is clean with dv at 8.
# jax-triton would otherwise launch with 3 stages, which the report does not check.
_DEFAULT_TUNING = {  # (operand bits, causal)
  (16, False): Tuning(32, LaunchWarps(forward=4, dq_dk=8, dv=4), num_stages=2),
  (16, True): Tuning(16, LaunchWarps(forward=4, dq_dk=8, dv=4), num_stages=2),
  (32, False): Tuning(32, LaunchWarps(forward=4, dq_dk=8, dv=8), num_stages=1),
  (32, True): Tuning(32, LaunchWarps(forward=4, dq_dk=8, dv=8), num_stages=1),
}


def default_tuning(operand_dtype, is_causal: bool) -> Tuning:
  """The default :class:`Tuning` for kernels whose ``q, k, v`` operands are ``operand_dtype``
  (after any widening, :func:`widens_16bit`)."""
  bits = 16 if jnp.dtype(operand_dtype).itemsize == 2 else 32
  return _DEFAULT_TUNING[bits, bool(is_causal)]


# --- Tile maths (Triton) -------------------------------------------------------------------------


@triton.jit
def _load_rows(ptr, b, idx, f0, LEN: tl.constexpr, H: tl.constexpr, F: tl.constexpr,
               HP: tl.constexpr, BF: tl.constexpr, TRANSPOSE: tl.constexpr):  # fmt: skip
  """``[HP, len(idx), BF]`` of a contiguous ``[B, LEN, H, F]`` array at rows ``idx`` and features
  ``f0 + arange(BF)`` (``[HP, BF, len(idx)]`` when ``TRANSPOSE``); zeros outside."""
  hs = tl.arange(0, HP)
  fs = f0 + tl.arange(0, BF)
  if TRANSPOSE:
    h3, f3, r3 = hs[:, None, None], fs[None, :, None], idx[None, None, :]
  else:
    h3, r3, f3 = hs[:, None, None], idx[None, :, None], fs[None, None, :]
  offsets = b * LEN * H * F + r3 * H * F + h3 * F + f3
  return tl.load(ptr + offsets, mask=(h3 < H) & (r3 < LEN) & (f3 < F), other=0.0)


@triton.jit
def _logit_offsets(b, rows, cols, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                   S3: tl.constexpr, HP: tl.constexpr):  # fmt: skip
  """Offsets ``[HP, bq, bk]`` into a bias or mask with strides ``S*`` (0 on broadcast axes)."""
  h3 = tl.arange(0, HP)[:, None, None]
  return b * S0 + h3 * S1 + rows[None, :, None] * S2 + cols[None, None, :] * S3


@triton.jit
def _tile_scores(q, k_ptr, bias_ptr, mask_ptr, b, rows, cols,
                 Q_LEN: tl.constexpr, KV_LEN: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                 HP: tl.constexpr, HB: tl.constexpr,
                 HX: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                 SCALE: tl.constexpr, CAUSAL: tl.constexpr, OFFSET: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BS0: tl.constexpr, BS1: tl.constexpr, BS2: tl.constexpr,
                 BS3: tl.constexpr, HAS_MASK: tl.constexpr, MS0: tl.constexpr, MS1: tl.constexpr,
                 MS2: tl.constexpr, MS3: tl.constexpr, RMS: tl.constexpr, EPS: tl.constexpr,
                 PRECISION: tl.constexpr):  # fmt: skip
  """``(s, r, a, valid)`` of one tile: float32 ``s, a [HB, bq, bk]``, ``r [bq, bk]`` (ones
  unless RMS), bool ``valid [HB, bq, bk]``; ``q [HB, bq, DP]`` loaded by the caller."""
  k_t = _load_rows(k_ptr, b, cols, 0, KV_LEN, H, D, HB, DP, True)
  s = tl.dot(q, k_t, input_precision=PRECISION) * SCALE
  h3 = tl.arange(0, HB)[:, None, None]
  r3, c3 = rows[None, :, None], cols[None, None, :]
  valid = (h3 < H) & (r3 < Q_LEN) & (c3 < KV_LEN)
  if CAUSAL:
    valid = valid & (c3 <= r3 + OFFSET)
  if HAS_BIAS:
    offsets = _logit_offsets(b, rows, cols, BS0, BS1, BS2, BS3, HB)
    s += tl.load(bias_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
  if HAS_MASK:
    offsets = _logit_offsets(b, rows, cols, MS0, MS1, MS2, MS3, HB)
    valid = valid & (tl.load(mask_ptr + offsets, mask=valid, other=0) != 0)
  s = tl.where(valid, s, 0.0)
  r = tl.full((BQ, BK), 1.0, tl.float32)
  a = s
  if RMS:
    r = tl.rsqrt(tl.sum(s * s, axis=0) / H + EPS)
    a = s * r[None, :, :]
  return s, r, a, valid


@triton.jit
def mix_heads(a_v, v, RELU: tl.constexpr, PRECISION: tl.constexpr):
  """``(z, u)`` float32 ``[bk, bq, chunk]``: ``z_j = A_j[bq, H] @ V_j[H, chunk]`` per key, from
  ``a_v [HP, bq, bk]`` and ``v [HP, bk, chunk]`` in the value dtype."""
  z = tl.dot(tl.permute(a_v, (2, 1, 0)), tl.permute(v, (1, 0, 2)), input_precision=PRECISION)
  u = tl.maximum(z, 0.0) if RELU else z
  return z, u


@triton.jit
def rounded_as(x, ROUNDING: tl.constexpr):
  """``x`` in the 16-bit dtype ``ROUNDING`` names (``'bf16'``, ``'fp16'``); otherwise unchanged."""
  if ROUNDING == "bf16":
    x = x.to(tl.bfloat16)
  elif ROUNDING == "fp16":
    x = x.to(tl.float16)
  return x


@triton.jit
def _as_value_operand(x, v, VALUE_ROUNDING: tl.constexpr):
  """``x`` rounded to the inputs' value dtype (``VALUE_ROUNDING``: ``'bf16'``, ``'fp16'`` or
  ``'fp32'``), held in ``v``'s dtype: the value dtype itself, or float32 when a GPU call widened
  16-bit inputs (products of the rounded values are then exact in TF32, as in a 16-bit product)."""
  return rounded_as(x, VALUE_ROUNDING).to(v.dtype)


@triton.jit
def _key_tiles_seen(qt, KV_LEN: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                    CAUSAL: tl.constexpr, OFFSET: tl.constexpr):  # fmt: skip
  """Key tiles query tile ``qt`` sees: all, or (causal) up to its last visible column."""
  # Written out rather than tl.cdiv: the interpreter runs only this module's helpers.
  last = KV_LEN
  if CAUSAL:
    last = tl.minimum(tl.maximum(qt * BQ + BQ + OFFSET, 0), KV_LEN)
  return (last + BK - 1) // BK


@triton.jit
def _first_query_tile(kt, Q_LEN: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                      CAUSAL: tl.constexpr, OFFSET: tl.constexpr):  # fmt: skip
  """First query tile that sees key tile ``kt``: 0, or (causal) the one holding its first
  visible row; past the last tile when no row sees it."""
  first = 0
  if CAUSAL:
    first = tl.minimum(tl.maximum(kt * BK - OFFSET, 0), (Q_LEN + BQ - 1) // BQ * BQ) // BQ
  return first


@triton.jit
def pad_heads(x, HX: tl.constexpr):
  """``[n, m, k] -> [n·2^HX, m, k]``, zero heads appended (the head-coupled products contract
  or stack the heads, and a matrix instruction takes at least 16)."""
  for unused in tl.static_range(HX):
    doubled = tl.permute(tl.join(x, tl.zeros_like(x)), (3, 0, 1, 2))  # [2, n, m, k]
    x = tl.reshape(doubled, (2 * x.shape[0], x.shape[1], x.shape[2]))
  return x


@triton.jit
def _cut_heads(x, HX: tl.constexpr):
  """Inverse of :func:`pad_heads`: the first ``n / 2^HX`` heads of ``[n, m, k]``."""
  for unused in tl.static_range(HX):
    halves = tl.reshape(x, (2, x.shape[0] // 2, x.shape[1], x.shape[2]))
    x, padding = tl.split(tl.permute(halves, (1, 2, 3, 0)))
  return x


# --- Kernels -------------------------------------------------------------------------------------

# The constants every kernel takes (constexpr keyword arguments; see :func:`kernel_constants`).
_TILE_PARAMS = """Q_LEN KV_LEN H D DV HP HB HX DP BQ BK BV SCALE CAUSAL OFFSET HAS_BIAS BS0 BS1 BS2 BS3
HAS_MASK MS0 MS1 MS2 MS3 RMS EPS MLP RELU PRECISION VALUE_ROUNDING""".split()


@triton.jit
def forward_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, mask_ptr, out_ptr,
                   Q_LEN: tl.constexpr, KV_LEN: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                   DV: tl.constexpr, HP: tl.constexpr, HB: tl.constexpr,
                   HX: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
                   CAUSAL: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BS0: tl.constexpr, BS1: tl.constexpr, BS2: tl.constexpr, BS3: tl.constexpr,
                   HAS_MASK: tl.constexpr, MS0: tl.constexpr, MS1: tl.constexpr,
                   MS2: tl.constexpr, MS3: tl.constexpr, RMS: tl.constexpr, EPS: tl.constexpr,
                   MLP: tl.constexpr, RELU: tl.constexpr, PRECISION: tl.constexpr,
                   VALUE_ROUNDING: tl.constexpr):  # fmt: skip
  """Program ``(b, query tile, value chunk)``: float32 ``out [B, Q_LEN, H, DV]`` of the chunk."""
  b, qt, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
  rows = qt * BQ + tl.arange(0, BQ)
  q = _load_rows(q_ptr, b, rows, 0, Q_LEN, H, D, HB, DP, False)
  n_key_tiles = _key_tiles_seen(qt, KV_LEN, BQ, BK, CAUSAL, OFFSET)
  acc = tl.zeros((BQ, HP, BV), tl.float32)
  for kt in range(0, n_key_tiles):
    cols = kt * BK + tl.arange(0, BK)
    s, r, a, valid = _tile_scores(q, k_ptr, bias_ptr, mask_ptr, b, rows, cols, Q_LEN, KV_LEN,
                                  H, D, HP, HB, HX, DP, BQ, BK, SCALE, CAUSAL, OFFSET, HAS_BIAS, BS0, BS1,
                                  BS2, BS3, HAS_MASK, MS0, MS1, MS2, MS3, RMS, EPS, PRECISION)  # fmt: skip
    if MLP:
      v = _load_rows(v_ptr, b, cols, chunk * BV, KV_LEN, H, DV, HP, BV, False)
      a_v = _as_value_operand(pad_heads(a, HX), v, VALUE_ROUNDING)
      z, u = mix_heads(a_v, v, RELU, PRECISION)
      # out_i = A_i[H, bk] @ U_i[bk, chunk] per query.
      acc += tl.dot(
        tl.permute(a_v, (1, 0, 2)),
        tl.permute(_as_value_operand(u, v, VALUE_ROUNDING), (1, 0, 2)),
        input_precision=PRECISION,
      )
    else:  # per head: out_h = A_h @ V_h
      v = _load_rows(v_ptr, b, cols, chunk * BV, KV_LEN, H, DV, HB, BV, False)
      out = tl.dot(_as_value_operand(a, v, VALUE_ROUNDING), v, input_precision=PRECISION)
      acc += tl.permute(pad_heads(out, HX), (1, 0, 2))
  hs = tl.arange(0, HP)[None, :, None]
  fs = chunk * BV + tl.arange(0, BV)[None, None, :]
  r3 = rows[:, None, None]
  offsets = b * Q_LEN * H * DV + r3 * H * DV + hs * DV + fs
  tl.store(out_ptr + offsets, acc, mask=(r3 < Q_LEN) & (hs < H) & (fs < DV))


@triton.jit
def _store_rows(ptr, x, b, idx, LEN: tl.constexpr, H: tl.constexpr, F: tl.constexpr,
                HP: tl.constexpr, BF: tl.constexpr):  # fmt: skip
  """Stores ``x [HP, len(idx), BF]`` into a contiguous ``[B, LEN, H, F]`` array (inverse of
  :func:`_load_rows`), skipping padded heads, rows and features."""
  h3 = tl.arange(0, HP)[:, None, None]
  r3, f3 = idx[None, :, None], tl.arange(0, BF)[None, None, :]
  offsets = b * LEN * H * F + r3 * H * F + h3 * F + f3
  tl.store(ptr + offsets, x, mask=(h3 < H) & (r3 < LEN) & (f3 < F))


@triton.jit
def _chunk_backward(a, a_v, v, dout, RELU: tl.constexpr, PRECISION: tl.constexpr):
  """One value chunk of an MLP tile's backward: ``(da, dz)`` with float32 ``da [HP, bq, bk]``
  (this chunk's part) and ``dz [bk, bq, chunk]``; ``a`` float32 and ``a_v`` rounded to the value
  dtype ``[HP, bq, bk]`` (heads padded), ``v [HP, bk, chunk]``, ``dout`` float32
  ``[HP, bq, chunk]``."""
  z, u = mix_heads(a_v, v, RELU, PRECISION)  # [bk, bq, chunk], as in the forward
  v32 = v.to(tl.float32)
  dout_i = tl.permute(dout, (1, 0, 2))  # [bq, HP, chunk]
  # da_i = dout_i [H, chunk] @ U_iᵀ [chunk, bk] per query.
  da = tl.permute(tl.dot(dout_i, tl.permute(u, (1, 2, 0)), input_precision=PRECISION), (1, 0, 2))
  # du_i = A_iᵀ [bk, H] @ dout_i [H, chunk] per query, then dz_j per key.
  du = tl.dot(tl.permute(a, (1, 2, 0)), dout_i, input_precision=PRECISION)  # [bq, bk, chunk]
  dz = tl.permute(du, (1, 0, 2))
  if RELU:
    dz = tl.where(z > 0, dz, 0.0)
  # da_j += dz_j [bq, chunk] @ V_jᵀ [chunk, H] per key.
  da += tl.permute(tl.dot(dz, tl.permute(v32, (1, 2, 0)), input_precision=PRECISION), (2, 1, 0))
  return da, dz


@triton.jit
def _tile_ds(a, s, r, valid, b, rows, cols, v_ptr, dout_ptr,
             Q_LEN: tl.constexpr, KV_LEN: tl.constexpr, H: tl.constexpr, DV: tl.constexpr,
             HP: tl.constexpr, HB: tl.constexpr, HX: tl.constexpr, BQ: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, RMS: tl.constexpr, MLP: tl.constexpr, RELU: tl.constexpr,
             PRECISION: tl.constexpr, VALUE_ROUNDING: tl.constexpr):  # fmt: skip
  """Float32 ``ds [HB, bq, bk]`` of one tile (0 where not valid): ``da`` summed over the value
  chunks, then through the normalisation."""
  n_chunks = (DV + BV - 1) // BV
  if MLP:
    a_p = pad_heads(a, HX)
    da_p = tl.zeros((HP, BQ, BK), tl.float32)
    for chunk in range(0, n_chunks):
      v = _load_rows(v_ptr, b, cols, chunk * BV, KV_LEN, H, DV, HP, BV, False)
      dout = _load_rows(dout_ptr, b, rows, chunk * BV, Q_LEN, H, DV, HP, BV, False)
      da_chunk, dz = _chunk_backward(
        a_p, _as_value_operand(a_p, v, VALUE_ROUNDING), v, dout, RELU, PRECISION
      )
      da_p += da_chunk
    da = _cut_heads(da_p, HX)
  else:  # da_hij = dout_hi · v_hj
    da = tl.zeros((HB, BQ, BK), tl.float32)
    for chunk in range(0, n_chunks):
      v = _load_rows(v_ptr, b, cols, chunk * BV, KV_LEN, H, DV, HB, BV, False)
      dout = _load_rows(dout_ptr, b, rows, chunk * BV, Q_LEN, H, DV, HB, BV, False)
      da += tl.dot(dout, tl.permute(v.to(tl.float32), (0, 2, 1)), input_precision=PRECISION)
  if RMS:
    mean_sda = tl.sum(s * da, axis=0) / H
    da = r[None, :, :] * da - s * (r * r * r)[None, :, :] * mean_sda[None, :, :]
  return tl.where(valid, da, 0.0)


@triton.jit
def _add_rows(ptr, x, b, idx, LEN: tl.constexpr, H: tl.constexpr, F: tl.constexpr,
              HP: tl.constexpr, BF: tl.constexpr):  # fmt: skip
  """Adds ``x [HP, len(idx), BF]`` atomically into a contiguous ``[B, LEN, H, F]`` float32 array
  (as :func:`_store_rows` stores), skipping padded heads, rows and features."""
  h3 = tl.arange(0, HP)[:, None, None]
  r3, f3 = idx[None, :, None], tl.arange(0, BF)[None, None, :]
  offsets = b * LEN * H * F + r3 * H * F + h3 * F + f3
  tl.atomic_add(ptr + offsets, x, mask=(h3 < H) & (r3 < LEN) & (f3 < F), sem="relaxed")


@triton.jit
def dkv_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, mask_ptr, dout_ptr, dq_ptr, dk_ptr, dv_ptr,
               dbias_ptr, Q_LEN: tl.constexpr, KV_LEN: tl.constexpr, H: tl.constexpr,
               D: tl.constexpr, DV: tl.constexpr, HP: tl.constexpr, HB: tl.constexpr,
               HX: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
               CAUSAL: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
               BS0: tl.constexpr, BS1: tl.constexpr, BS2: tl.constexpr, BS3: tl.constexpr,
               HAS_MASK: tl.constexpr, MS0: tl.constexpr, MS1: tl.constexpr,
               MS2: tl.constexpr, MS3: tl.constexpr, RMS: tl.constexpr, EPS: tl.constexpr,
               MLP: tl.constexpr, RELU: tl.constexpr, PRECISION: tl.constexpr,
               VALUE_ROUNDING: tl.constexpr, WANT_DK: tl.constexpr):  # fmt: skip
  """Program ``(b, key tile, value chunk)``. ``WANT_DK`` (launched with one chunk program): float32
  ``dk [B, KV_LEN, H, D]``, and the program's part of ``dq [B, Q_LEN, H, D]`` (and of the bias's
  gradient, the bias's broadcast shape) added atomically into zeroed float32 arrays; otherwise
  ``dv [B, KV_LEN, H, DV]`` of the program's chunk. ``dk`` and ``dq`` need ``da`` summed over
  every chunk while ``dv`` of a chunk needs only that chunk (one launch would hold all of ``dv``
  per program)."""
  b, kt, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
  cols = kt * BK + tl.arange(0, BK)
  dk = tl.zeros((HB, BK, DP), tl.float32)
  dv = tl.zeros((BK, HP, BV), tl.float32)
  k = _load_rows(k_ptr, b, cols, 0, KV_LEN, H, D, HB, DP, False).to(tl.float32)
  first = _first_query_tile(kt, Q_LEN, BQ, BK, CAUSAL, OFFSET)
  n_query_tiles = (Q_LEN + BQ - 1) // BQ
  for step in range(0, n_query_tiles - first):
    qt = first + step  # causal: each program starts at its band's first tile
    if not CAUSAL:  # programs start at query tiles rotated by key tile, so that those running
      qt = (step + kt) % n_query_tiles  # at once add into different rows of dq
    rows = qt * BQ + tl.arange(0, BQ)
    q = _load_rows(q_ptr, b, rows, 0, Q_LEN, H, D, HB, DP, False)
    s, r, a, valid = _tile_scores(q, k_ptr, bias_ptr, mask_ptr, b, rows, cols, Q_LEN, KV_LEN,
                                  H, D, HP, HB, HX, DP, BQ, BK, SCALE, CAUSAL, OFFSET, HAS_BIAS, BS0, BS1,
                                  BS2, BS3, HAS_MASK, MS0, MS1, MS2, MS3, RMS, EPS, PRECISION)  # fmt: skip
    if WANT_DK:
      ds = _tile_ds(a, s, r, valid, b, rows, cols, v_ptr, dout_ptr, Q_LEN, KV_LEN, H, DV, HP,
                    HB, HX, BQ, BK, BV, RMS, MLP, RELU, PRECISION, VALUE_ROUNDING)  # fmt: skip
      dk += tl.dot(tl.permute(ds, (0, 2, 1)), q.to(tl.float32), input_precision=PRECISION)
      dq = tl.dot(ds, k, input_precision=PRECISION) * SCALE
      _add_rows(dq_ptr, dq, b, rows, Q_LEN, H, D, HB, DP)
      if HAS_BIAS:  # broadcast axes have stride 0: the atomic adds sum over them
        offsets = _logit_offsets(b, rows, cols, BS0, BS1, BS2, BS3, HB)
        tl.atomic_add(dbias_ptr + offsets, ds, mask=valid, sem="relaxed")
    else:
      if MLP:  # dv_j = A_j [H, bq] @ dz_j [bq, chunk] per key
        v = _load_rows(v_ptr, b, cols, chunk * BV, KV_LEN, H, DV, HP, BV, False)
        dout = _load_rows(dout_ptr, b, rows, chunk * BV, Q_LEN, H, DV, HP, BV, False)
        a_p = pad_heads(a, HX)
        da_chunk, dz = _chunk_backward(
          a_p, _as_value_operand(a_p, v, VALUE_ROUNDING), v, dout, RELU, PRECISION
        )
        dv += tl.dot(tl.permute(a_p, (2, 0, 1)), dz, input_precision=PRECISION)
      else:  # dv_h = A_hᵀ @ dout_h per head
        dout = _load_rows(dout_ptr, b, rows, chunk * BV, Q_LEN, H, DV, HB, BV, False)
        dv_h = tl.dot(tl.permute(a, (0, 2, 1)), dout, input_precision=PRECISION)
        dv += tl.permute(pad_heads(dv_h, HX), (1, 0, 2))
  if WANT_DK:
    _store_rows(dk_ptr, dk * SCALE, b, cols, KV_LEN, H, D, HB, DP)
  else:
    h3 = tl.arange(0, HP)[None, :, None]
    c3, f3 = cols[:, None, None], chunk * BV + tl.arange(0, BV)[None, None, :]
    offsets = b * KV_LEN * H * DV + c3 * H * DV + h3 * DV + f3
    tl.store(dv_ptr + offsets, dv, mask=(c3 < KV_LEN) & (h3 < H) & (f3 < DV))


# --- Host side -----------------------------------------------------------------------------------


class Config(NamedTuple):
  """Static settings of one call."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  d_qk: int
  d_v: int
  scale: float
  normalization: str
  value_network: str
  block_size: int
  value_chunk: int
  causal_offset: int | None  # query i sees keys j <= i + offset; None: not causal
  precision: Any
  value_rounding: str  # the inputs' value dtype, as the kernels round a and u (value_rounding())
  bias_shape: tuple[int, int, int, int] | None  # [B', H', Q', K'] (1 on broadcast axes)
  mask_shape: tuple[int, int, int, int] | None
  num_warps: LaunchWarps
  num_stages: int
  interpret: bool


def _broadcast_strides(shape) -> tuple[int, int, int, int]:
  """Element strides of a contiguous ``[B', H', Q', K']`` array, 0 along its size-1 axes."""
  if shape is None:
    return (0, 0, 0, 0)
  strides = np.cumprod((1, *shape[:0:-1]))[::-1]
  return tuple(int(s) if n > 1 else 0 for s, n in zip(strides, shape))


def _input_precision(precision) -> str:
  """``tl.dot``'s input precision for float32 operands (bf16/f16 operands ignore it)."""
  highest = precision in (jax.lax.Precision.HIGHEST, "highest", "float32")
  if isinstance(precision, tuple):
    highest = all(p in (jax.lax.Precision.HIGHEST, "highest", "float32") for p in precision)
  return "ieee" if highest else "tf32"


def kernel_constants(cfg: Config) -> dict:
  """The constexpr arguments of every kernel (names of ``_TILE_PARAMS``)."""
  bias, mask = _broadcast_strides(cfg.bias_shape), _broadcast_strides(cfg.mask_shape)
  # Heads batch the per-head products (a power of two) and are padded further where the coupled
  # products contract or stack them.
  head_batch = C.next_power_of_two(cfg.heads)
  head_pad = max(HEAD_PAD, head_batch)
  constants = {
    "Q_LEN": cfg.q_len,
    "KV_LEN": cfg.kv_len,
    "H": cfg.heads,
    "D": cfg.d_qk,
    "DV": cfg.d_v,
    "HP": head_pad,
    "HB": head_batch,
    "HX": (head_pad // head_batch).bit_length() - 1,
    "DP": max(16, C.next_power_of_two(cfg.d_qk)),
    "BQ": cfg.block_size,
    "BK": cfg.block_size,
    "BV": cfg.value_chunk,
    "SCALE": float(cfg.scale),
    "CAUSAL": cfg.causal_offset is not None,
    "OFFSET": 0 if cfg.causal_offset is None else cfg.causal_offset,
    "HAS_BIAS": cfg.bias_shape is not None,
    **{f"BS{i}": s for i, s in enumerate(bias)},
    "HAS_MASK": cfg.mask_shape is not None,
    **{f"MS{i}": s for i, s in enumerate(mask)},
    "RMS": cfg.normalization == "rms_head",
    "EPS": hb.RMS_EPS,
    "MLP": cfg.value_network != "linear",
    "RELU": cfg.value_network == "mlp_relu",
    "PRECISION": _input_precision(cfg.precision),
    "VALUE_ROUNDING": cfg.value_rounding,
  }
  assert sorted(constants) == sorted(_TILE_PARAMS)
  return constants


def _value_chunks(cfg: Config) -> int:
  return -(-cfg.d_v // cfg.value_chunk)


def _tiles(length: int, cfg: Config) -> int:
  return -(-length // cfg.block_size)


def launch_grids(cfg: Config) -> dict[str, tuple[int, int, int]]:
  """The grid of each launch (``forward``, ``dq_dk``, ``dv``): programs per example, per query or
  key tile, per value chunk where the launch splits them."""
  q_tiles, k_tiles, chunks = _tiles(cfg.q_len, cfg), _tiles(cfg.kv_len, cfg), _value_chunks(cfg)
  return {
    "forward": (cfg.batch, q_tiles, chunks),
    "dq_dk": (cfg.batch, k_tiles, 1),
    "dv": (cfg.batch, k_tiles, chunks),
  }


# --- Launching: Triton's interpreter on a CPU, jax-triton on a GPU -------------------------------


def jax_triton_uses_refs(triton_call) -> bool:
  """Whether ``jax_triton.triton_call`` is of jax-triton's current API (0.4: ``out_type``, and
  outputs to start as zeros passed as ``jax.Ref`` arguments, ``out_shape`` and ``zeroed_outputs``
  deprecated) rather than 0.3's (``out_shape``, ``zeroed_outputs``)."""
  return "out_type" in inspect.signature(triton_call).parameters


def _launch(name: str, kernel, out_shapes, cfg: Config, *inputs, **extra_constants):
  """``kernel(*inputs, *outputs)`` over the grid of launch ``name`` (:func:`launch_grids`) with
  its warps; outputs (float32) start as zeros."""
  grid = launch_grids(cfg)[name]
  num_warps = getattr(cfg.num_warps, name)
  constants = {**kernel_constants(cfg), **extra_constants}
  if cfg.interpret:
    run = functools.partial(triton_interpreter.launch, kernel, grid, out_shapes, constants)
    return jax.pure_callback(run, tuple(out_shapes), *inputs)
  import jax_triton  # imports only with a CUDA jaxlib

  launch = functools.partial(
    jax_triton.triton_call,
    kernel=kernel,
    grid=grid,
    num_warps=num_warps,
    num_stages=cfg.num_stages,  # as the compile report checks (jax-triton's own default is 3)
    **constants,
  )
  if not jax_triton_uses_refs(jax_triton.triton_call):  # jax-triton 0.3
    zeroed = tuple(range(len(out_shapes)))
    return launch(*inputs, out_shape=tuple(out_shapes), zeroed_outputs=zeroed)
  outs = [jax.new_ref(jnp.zeros(s.shape, s.dtype)) for s in out_shapes]
  launch(*inputs, *outs, out_type=())  # the kernel writes into the zeroed refs
  return tuple(out[...] for out in outs)


def forward(q, k, v, bias, mask, cfg: Config):
  """Float32 ``out [B, Q, H, d_v]`` (Flax layout in and out; bias/mask at their broadcast
  shapes, or ``[1]`` placeholders)."""
  out_shape = jax.ShapeDtypeStruct((cfg.batch, cfg.q_len, cfg.heads, cfg.d_v), C.F32)
  (out,) = _launch("forward", forward_kernel, [out_shape], cfg, q, k, v, bias, mask)
  return out


# --- Entry point ---------------------------------------------------------------------------------


def _dot_size(n: int) -> int:
  """A tile or chunk size ``tl.dot`` takes: a power of two, at least 16."""
  return max(16, C.next_power_of_two(n))


def hyla_tensorcore_attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  block_size: int = DEFAULT_BLOCK_SIZE,
  value_chunk: int | None = None,
  is_causal: bool = False,
  causal_alignment: str = "top_left",
  normalization: str = "rms_head",
  value_network: str = "mlp_relu",
  scale: float | None = None,
  dtype=None,
  precision=None,
  num_warps: LaunchWarps | tuple[int, int, int] | None = None,
  num_stages: int | None = None,
  interpret: bool | None = None,
  widen_16bit: bool | None = None,
):
  """HYLA as fused Triton kernels; equals ``blockwise.hyla_blockwise_attention``.

  Args:
    query: ``[batch..., q_len, heads, d_qk]``. key: ``[batch..., kv_len, heads, d_qk]``.
    value: ``[batch..., kv_len, heads, d_v]``.
    bias: additive, broadcastable to ``[batch..., heads, q_len, kv_len]`` (kept at its own size;
      its gradient too).
    mask: any dtype, broadcastable like ``bias``; nonzero = may attend.
    block_size: query and key tile, rounded up to a power of two of at least 16; ragged lengths
      are masked by index.
    value_chunk: value features per chunk, rounded like ``block_size`` (capped at ``d_v``'s).
    is_causal, causal_alignment, normalization (``'rms_head'`` | ``'none'``), value_network
      (``'mlp_relu'`` | ``'mlp_linear'`` | ``'linear'``), scale, dtype, precision: as in
      ``hyla_attention``.
    num_warps: warps per program of the ``forward``, ``dq_dk`` and ``dv`` launches on a GPU
      (a :class:`LaunchWarps` or a tuple in that order).
    num_stages: Triton's software-pipelining stages of every launch on a GPU.
      ``value_chunk``, ``num_warps``, ``num_stages``: None takes :func:`default_tuning`'s for the
      kernels' operand dtype (after ``widen_16bit``) and ``is_causal``.
    interpret: run the kernels in Triton's interpreter; None: when the backend is not a GPU.
    widen_16bit: run bfloat16/float16 inputs through the float32 kernels, ``a`` and ``u`` rounded
      to the input dtype as the 16-bit kernels round them (the same function; TF32 products of
      those values are exact), at float32's memory and speed; None: on a GPU, until a device run
      shows the 16-bit kernels right (:data:`NATIVE_16BIT_ON_GPU`), not in the interpreter.

  Returns:
    ``[batch..., q_len, heads, d_v]`` in ``dtype`` (default ``query.dtype``).

  Raises:
    ValueError: bad shapes (naming them), grouped key/value heads, an unsupported
      ``normalization``/``value_network``, or a ``block_size``/``value_chunk``/``num_stages``
      that is not a positive int.
  """
  shapes = hb.check_tiled_call(
    "hyla_tensorcore_attention",
    query,
    key,
    value,
    normalization,
    value_network,
    block_size,
    normalization_note=" (softmax needs per-key running statistics: use the dense path)",
  )
  interpret = C.interpret_off_gpu() if interpret is None else bool(interpret)
  rounding = value_rounding(value.dtype)
  widen = rounding != "fp32" and widens_16bit(widen_16bit, interpret)
  tuning = default_tuning(C.F32 if widen else query.dtype, is_causal)
  value_chunk = tuning.value_chunk if value_chunk is None else value_chunk
  num_stages = tuning.num_stages if num_stages is None else num_stages
  for name, count in (("value_chunk", value_chunk), ("num_stages", num_stages)):
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
      raise ValueError(f"{name} must be a positive int or None; got {count!r}")
  offset = C.causal_offset(causal_alignment, shapes.q_len, shapes.kv_len)
  mask = hb.reduced_broadcast(C.as_bool_mask(mask), "mask", shapes)
  bias = hb.reduced_broadcast(bias, "bias", shapes)
  batch = int(np.prod(shapes.batch_shape, dtype=int))
  cfg = Config(
    batch=batch,
    q_len=shapes.q_len,
    kv_len=shapes.kv_len,
    heads=shapes.heads,
    d_qk=shapes.d_qk,
    d_v=shapes.d_v,
    scale=C.default_scale(shapes.d_qk) if scale is None else scale,
    normalization=normalization,
    value_network=value_network,
    block_size=_dot_size(block_size),
    value_chunk=min(_dot_size(value_chunk), _dot_size(shapes.d_v)),
    causal_offset=offset if is_causal else None,
    precision=precision,
    value_rounding=rounding,
    bias_shape=None if bias is None else tuple(bias.shape),
    mask_shape=None if mask is None else tuple(mask.shape),
    num_warps=LaunchWarps(*(tuning.num_warps if num_warps is None else num_warps)),
    num_stages=num_stages,
    interpret=interpret,
  )
  q, k, v = (x.reshape((batch, *x.shape[-3:])) for x in (query, key, value))
  if widen:
    q, k, v = (x.astype(C.F32) for x in (q, k, v))
  # Placeholders keep one kernel signature when there is no bias or mask (never read).
  bias = jnp.zeros((1,), C.F32) if bias is None else bias
  mask = jnp.zeros((1,), jnp.int8) if mask is None else mask.astype(jnp.int8)
  out = make_tensorcore(cfg)(q, k, v, bias, mask)
  out = out.reshape((*shapes.batch_shape, *out.shape[1:]))
  return out.astype(C.output_dtype(query, dtype))


def make_tensorcore(cfg: Config):
  """``(q, k, v, bias, mask) -> out`` (float32, Flax layout, batch flattened) with the Triton
  backward as its VJP; the mask gets no gradient, nor a placeholder bias."""

  return hb.recomputing_vjp(
    functools.partial(forward, cfg=cfg), functools.partial(backward, cfg=cfg)
  )


def backward_launch(name: str, q, k, v, bias, mask, dout, cfg: Config):
  """Float32 ``(dq, dk, dv, dbias)`` of one backward launch, ``[1]`` placeholders where it writes
  nothing: ``dq_dk`` gives ``dq``, ``dk`` and (with a bias) ``dbias``; ``dv`` gives ``dv``."""
  f32 = functools.partial(jax.ShapeDtypeStruct, dtype=C.F32)
  placeholder = f32((1,))  # one kernel signature for every call
  want_dk = name == "dq_dk"
  if want_dk:
    bias_grad = placeholder if cfg.bias_shape is None else f32(cfg.bias_shape)
    outputs = [f32(q.shape), f32(k.shape), placeholder, bias_grad]
  else:
    outputs = [placeholder, placeholder, f32(v.shape), placeholder]
  inputs = (q, k, v, bias, mask, dout.astype(C.F32))
  return _launch(name, dkv_kernel, outputs, cfg, *inputs, WANT_DK=want_dk)


def backward(q, k, v, bias, mask, dout, cfg: Config):
  """Float32 ``(dq, dk, dv, dbias)`` (Flax layout; ``dbias`` at the bias's broadcast shape, or
  None without a bias)."""
  dq, dk, _, dbias = backward_launch("dq_dk", q, k, v, bias, mask, dout, cfg)
  _, _, dv, _ = backward_launch("dv", q, k, v, bias, mask, dout, cfg)
  return dq, dk, dv, (None if cfg.bias_shape is None else dbias)
