"""Where the tensor-core HYLA kernels' 16-bit path goes wrong on a GPU: each matrix-product pattern
of ``primal_dual/kernels/hyla/tensorcore.py`` alone, then its forward kernel, in bfloat16, float16
and float32 operands, against NumPy (float64, operands rounded as the kernel rounds them).

Why: lease 7 (one H100, the device image's Triton 3.6.0, jax-triton 0.3.1) ran the kernels' tests
on the GPU. Every float32 case equalled the blockwise path and the float64 reference; bfloat16
inputs gave an output far from them (286 of 288 elements). Triton 3.9's interpreter computes the
bfloat16 kernels right. Each pattern is a small ``@triton.jit`` kernel launched by Triton itself on
torch tensors (no JAX in the launch):

* ``loaded``: a 3-D ``tl.dot`` of two loaded blocks (``q · k``: heads batched);
* ``mix_heads``: the kernels' ``mix_heads`` on loaded ``a [16, bq, bk]`` and ``v [16, bk, chunk]``
  (``z_j = A_j @ V_j``, both operands permuted in registers);
* ``mix_heads_permuted_wide``: the same with both loaded as float32, permuted, then rounded to the
  operand dtype (a candidate repair: the permutes on 32-bit values);
* ``read_out``: ``z`` rounded to the operand dtype and fed, permuted, to the second product
  (``out_i = A_i @ U_i``: a product's accumulator as another's operand);
* ``padded``: the forward's chain from a float32 scores tile ``[4, bq, bk]``: ``pad_heads`` to 16
  heads, rounded, ``mix_heads``, the read-out;
* ``forward``: the module's ``forward_kernel`` itself (``rms_head``, ``mlp_relu``, a padding mask;
  3 heads, 12 queries, 20 keys, d = d_v = 8: the failing test's shape), against the blockwise path
  run on the CPU; ``forward_widened``: float32 inputs rounded as ``bf16``/``fp16`` inside, what a
  GPU call runs today (``widen_16bit``); ``forward_unmasked``: the 16-bit forward without the mask.

Compiled here for sm_90a, Triton 3.6 and 3.7 give the masked forward's head-coupled 16-bit
products operands of ``kWidth`` 8 at K = 16 (without the mask, and in every pattern above, 2 or 4;
Triton 3.8 and 3.9: 4 everywhere), past the quarter of K a thread holds per ``mma.m16n8k16``
(``tools/device/gpu_compile.py``, ``dot_operand_widths``); upstream fixed wrong results of exactly
that (triton-lang/triton#11691). If the device shows the 16-bit ``forward`` wrong, and
``forward_unmasked`` and the patterns right, that is the fault.

Operands: ``bf16``, ``fp16``, ``fp32`` (TF32 products) and ``ieee`` (float32 products); warps 4 and
8. A row is right when ‖out − ref‖ / ‖ref‖ is within its operands' tolerance
(:data:`TOLERANCES`); a row that raises is recorded with its error.

  python3 -m tools.device.tensorcore_probe --out "$OUT/tensorcore_probe.json"   # on a GPU
  python3 -m tools.device.tensorcore_probe --interpret --out /tmp/probe.json      # CPU (the test)
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from primal_dual.kernels import triton_interpreter
from primal_dual.kernels.hyla import blockwise as hb
from primal_dual.kernels.hyla import tensorcore as ht

# Relative Frobenius error allowed per operands: one rounding of a 16-bit operand is 2^-8 (bf16)
# or 2^-11 (fp16) relative, TF32's 2^-11; the faults this looks for give errors of order 1.
TOLERANCES = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 5e-3, "ieee": 1e-5}
OPERANDS = tuple(TOLERANCES)
WARPS = (4, 8)
HEADS_BATCHED, HEADS_PADDED, TILE, CHUNK = 4, ht.HEAD_PAD, 16, 16


def _precision(operands: str) -> str:
  return "ieee" if operands == "ieee" else "tf32"


def _storage(operands: str) -> str:
  """The dtype an operand is held in, by the kernels' name (``ieee`` and ``fp32``: float32)."""
  return ht.value_rounding(ht.rounding_dtype(operands))


def rounded(x: np.ndarray, operands: str) -> np.ndarray:
  """``x`` (float64) rounded to the operand dtype and back (float32 operands: to float32)."""
  return np.asarray(x).astype(np.float32).astype(ht.rounding_dtype(operands)).astype(np.float64)


def relative_error(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


class Row(NamedTuple):
  pattern: str
  operands: str
  warps: int
  relative_error: float | None
  tolerance: float
  ok: bool
  error: str = ""


# --- The pattern kernels -------------------------------------------------------------------------


@triton.jit
def _block_offsets(X: tl.constexpr, Y: tl.constexpr, Z: tl.constexpr):
  """Offsets ``[X, Y, Z]`` of a contiguous block."""
  x = tl.arange(0, X)[:, None, None]
  y = tl.arange(0, Y)[None, :, None]
  return x * Y * Z + y * Z + tl.arange(0, Z)[None, None, :]


@triton.jit
def _loaded_kernel(a_ptr, b_ptr, out_ptr, NB: tl.constexpr, M: tl.constexpr, K: tl.constexpr,
                   N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
  a = tl.load(a_ptr + _block_offsets(NB, M, K))
  b = tl.load(b_ptr + _block_offsets(NB, K, N))
  tl.store(out_ptr + _block_offsets(NB, M, N), tl.dot(a, b, input_precision=PRECISION))


@triton.jit
def _mix_heads_kernel(a_ptr, v_ptr, out_ptr, HP: tl.constexpr, BQ: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, OPERANDS: tl.constexpr,
                      PRECISION: tl.constexpr, WIDE_PERMUTE: tl.constexpr):  # fmt: skip
  """``z [BK, BQ, BV]`` from ``a [HP, BQ, BK]`` and ``v [HP, BK, BV]``; ``WIDE_PERMUTE``: loaded
  as float32, permuted, then rounded."""
  a = tl.load(a_ptr + _block_offsets(HP, BQ, BK))
  v = tl.load(v_ptr + _block_offsets(HP, BK, BV))
  if WIDE_PERMUTE:
    a_t = ht.rounded_as(tl.permute(a, (2, 1, 0)), OPERANDS)
    v_t = ht.rounded_as(tl.permute(v, (1, 0, 2)), OPERANDS)
    z = tl.dot(a_t, v_t, input_precision=PRECISION)
  else:
    z, u = ht.mix_heads(a, v, False, PRECISION)
  tl.store(out_ptr + _block_offsets(BK, BQ, BV), z)


@triton.jit
def _read_out_kernel(a_ptr, v_ptr, out_ptr, HP: tl.constexpr, BQ: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, OPERANDS: tl.constexpr,
                     PRECISION: tl.constexpr, FROM_SCORES: tl.constexpr, HX: tl.constexpr):  # fmt: skip
  """``out [BQ, HP, BV]`` of the forward's inner step. ``FROM_SCORES``: ``a`` is a float32 scores
  tile ``[HP / 2^HX, BQ, BK]`` padded by ``pad_heads`` and rounded, as the forward does."""
  v = tl.load(v_ptr + _block_offsets(HP, BK, BV))
  if FROM_SCORES:
    a = ht.rounded_as(ht.pad_heads(tl.load(a_ptr + _block_offsets(HP >> HX, BQ, BK)), HX), OPERANDS)
  else:
    a = tl.load(a_ptr + _block_offsets(HP, BQ, BK))
  z, u = ht.mix_heads(a, v, True, PRECISION)
  out = tl.dot(
    tl.permute(a, (1, 0, 2)),
    tl.permute(ht.rounded_as(u, OPERANDS), (1, 0, 2)),
    input_precision=PRECISION,
  )
  tl.store(out_ptr + _block_offsets(BQ, HP, BV), out)


# --- Running a kernel: Triton on a GPU, its interpreter on a CPU ---------------------------------


class Launcher(NamedTuple):
  interpret: bool

  @property
  def device(self) -> str:
    return "cpu" if self.interpret else "cuda"

  def tensor(self, x: np.ndarray, storage: str):
    import torch

    dtypes = {
      "bf16": torch.bfloat16,
      "fp16": torch.float16,
      "fp32": torch.float32,
      "i8": torch.int8,
    }
    held = np.int8 if storage == "i8" else np.float32  # rounded once, from float32, as NumPy
    x = torch.from_numpy(np.ascontiguousarray(x, dtype=held))
    return x.to(self.device).to(dtypes[storage]).contiguous()

  def run(self, kernel, grid, args, constants: dict, num_warps: int, num_stages=None) -> None:
    """``kernel[grid](*args)``; ``num_stages`` None: Triton's default (the patterns have no
    loop to pipeline)."""
    if self.interpret:
      # This module's helpers and the kernels' (``ht.rounded_as`` etc.) interpreted.
      triton_interpreter.run(kernel, grid, args, constants, vars(ht))
    else:
      stages = {} if num_stages is None else {"num_stages": num_stages}
      kernel[grid](*args, **constants, num_warps=num_warps, **stages)


def _as_numpy(t) -> np.ndarray:
  return t.float().cpu().numpy().astype(np.float64)


# --- The patterns: (launcher, operands, warps, rng) -> (out, ref) ---------------------------------


def _loaded(launch: Launcher, operands: str, warps: int, rng) -> tuple[np.ndarray, np.ndarray]:
  nb, m, k, n = HEADS_BATCHED, TILE, 16, TILE
  a, b = rng.normal(size=(nb, m, k)), rng.normal(size=(nb, k, n))
  out = launch.tensor(np.zeros((nb, m, n), np.float32), "fp32")
  args = [launch.tensor(a, _storage(operands)), launch.tensor(b, _storage(operands)), out]
  constants = dict(NB=nb, M=m, K=k, N=n, PRECISION=_precision(operands))
  launch.run(_loaded_kernel, (1,), args, constants, warps)
  return _as_numpy(out), rounded(a, operands) @ rounded(b, operands)


def _mix_heads(wide: bool):
  def pattern(launch: Launcher, operands: str, warps: int, rng):
    hp, bq, bk, bv = HEADS_PADDED, TILE, TILE, CHUNK
    a, v = rng.normal(size=(hp, bq, bk)), rng.normal(size=(hp, bk, bv))
    out = launch.tensor(np.zeros((bk, bq, bv), np.float32), "fp32")
    storage = "fp32" if wide else _storage(operands)
    args = [launch.tensor(a, storage), launch.tensor(v, storage), out]
    constants = dict(HP=hp, BQ=bq, BK=bk, BV=bv, OPERANDS=operands, PRECISION=_precision(operands))
    launch.run(_mix_heads_kernel, (1,), args, dict(constants, WIDE_PERMUTE=wide), warps)
    ref = np.einsum("hqk,hkv->kqv", rounded(a, operands), rounded(v, operands))
    return _as_numpy(out), ref

  return pattern


def _read_out(from_scores: bool):
  def pattern(launch: Launcher, operands: str, warps: int, rng):
    hp, bq, bk, bv = HEADS_PADDED, TILE, TILE, CHUNK
    heads = HEADS_BATCHED if from_scores else hp
    hx = (hp // heads).bit_length() - 1
    a, v = rng.normal(size=(heads, bq, bk)), rng.normal(size=(hp, bk, bv))
    out = launch.tensor(np.zeros((bq, hp, bv), np.float32), "fp32")
    a_storage = "fp32" if from_scores else _storage(operands)
    args = [launch.tensor(a, a_storage), launch.tensor(v, _storage(operands)), out]
    constants = dict(HP=hp, BQ=bq, BK=bk, BV=bv, OPERANDS=operands, PRECISION=_precision(operands))
    constants.update(FROM_SCORES=from_scores, HX=hx)
    launch.run(_read_out_kernel, (1,), args, constants, warps)
    a_padded = np.concatenate([a, np.zeros((hp - heads, bq, bk))])
    a_r, v_r = rounded(a_padded, operands), rounded(v, operands)
    u = rounded(np.maximum(np.einsum("hqk,hkv->kqv", a_r, v_r), 0.0), operands)
    return _as_numpy(out), np.einsum("hqk,kqv->qhv", a_r, u)

  return pattern


def _forward(launch: Launcher, operands: str, warps: int, rng, widened=False, masked=True):
  """The module's forward kernel at the failing test's shape; ``widened``: the 16-bit inputs held
  as float32, the kernel rounding as their dtype (what a GPU call runs by default); ``masked``:
  with the key-padding mask (Triton 3.6 then gives the coupled products' 16-bit operands kWidth 8
  at K = 16; without it, 4)."""
  batch, q_len, kv_len, heads, d = 1, 12, 20, 3, 8
  storage = "fp32" if widened else _storage(operands)
  np_dtype = ht.rounding_dtype(operands)
  q, k, v = (
    rng.normal(size=(batch, n, heads, d)).astype(np_dtype) for n in (q_len, kv_len, kv_len)
  )
  mask = (np.arange(kv_len) < (14 if masked else kv_len))[None, None, None, :]
  tuning = ht.default_tuning(ht.rounding_dtype(storage), is_causal=False)  # as a call would launch
  cfg = ht.Config(
    batch=batch,
    q_len=q_len,
    kv_len=kv_len,
    heads=heads,
    d_qk=d,
    d_v=d,
    scale=d**-0.5,
    normalization="rms_head",
    value_network="mlp_relu",
    block_size=16,
    value_chunk=16,
    causal_offset=None,
    precision="highest" if operands == "ieee" else None,
    value_rounding=ht.value_rounding(np_dtype),
    bias_shape=None,
    mask_shape=mask.shape if masked else None,
    num_warps=tuning.num_warps._replace(forward=warps),
    num_stages=tuning.num_stages,
    interpret=launch.interpret,
  )
  out = launch.tensor(np.zeros((batch, q_len, heads, d), np.float32), "fp32")
  inputs = [launch.tensor(x.astype(np.float32), storage) for x in (q, k, v)]
  placeholders = [launch.tensor(np.zeros(1), "fp32"), launch.tensor(mask.astype(np.int8), "i8")]
  grid = ht.launch_grids(cfg)["forward"]
  args = [*inputs, *placeholders, out]
  launch.run(ht.forward_kernel, grid, args, ht.kernel_constants(cfg), warps, cfg.num_stages)
  # The blockwise path on the CPU, on the values the kernel rounds as (np_dtype).
  with jax.default_device(jax.devices("cpu")[0]):
    ref = hb.hyla_blockwise_attention(
      *(jnp.asarray(x.astype(np.float32), np_dtype) for x in (q, k, v)),
      None,
      jnp.asarray(mask),
      block_size=8,
      dtype=jnp.float32,
      precision=jax.lax.Precision.HIGHEST,
    )
  return _as_numpy(out), np.asarray(ref, np.float64)


def _widened_forward(launch: Launcher, operands: str, warps: int, rng):
  return _forward(launch, operands, warps, rng, widened=True)


def _unmasked_forward(launch: Launcher, operands: str, warps: int, rng):
  return _forward(launch, operands, warps, rng, masked=False)


PATTERNS: dict[str, tuple[Callable, tuple[str, ...]]] = {
  "loaded": (_loaded, OPERANDS),
  "mix_heads": (_mix_heads(wide=False), OPERANDS),
  "mix_heads_permuted_wide": (_mix_heads(wide=True), ("bf16", "fp16")),
  "read_out": (_read_out(from_scores=False), OPERANDS),
  "padded": (_read_out(from_scores=True), OPERANDS),
  "forward": (_forward, OPERANDS),
  "forward_widened": (_widened_forward, ("bf16", "fp16")),  # float32 kernels, rounded as these
  "forward_unmasked": (_unmasked_forward, ("bf16", "fp16")),
}


def _tolerance(pattern: str, operands: str) -> float:
  # A widened forward multiplies in TF32; its rounding of a and u is that of ``operands``.
  return TOLERANCES["fp32"] if pattern == "forward_widened" else TOLERANCES[operands]


def probe(interpret: bool, warps=WARPS, patterns=None, log=print) -> list[Row]:
  """Every pattern × its operands × ``warps``; fresh random inputs per row (seeded)."""
  launch = Launcher(interpret)
  rows = []
  for index, (name, (pattern, operand_list)) in enumerate(PATTERNS.items()):
    if patterns is not None and name not in patterns:
      continue
    for operands in operand_list:
      for num_warps in warps:
        tolerance = _tolerance(name, operands)
        rng = np.random.default_rng([index, OPERANDS.index(operands), num_warps])
        try:
          out, ref = pattern(launch, operands, num_warps, rng)
          error = relative_error(out, ref)
          row = Row(name, operands, num_warps, error, tolerance, bool(error <= tolerance))
        except Exception as e:  # a compiler or launch failure is a result too
          detail = "".join(traceback.format_exception_only(type(e), e)).strip()[-500:]
          row = Row(name, operands, num_warps, None, tolerance, False, detail)
        rows.append(row)
        shown = "raised" if row.relative_error is None else f"{row.relative_error:.2e}"
        log(f"{name:24s} {operands:5s} warps {num_warps}: {shown} ({'ok' if row.ok else 'WRONG'})")
  return rows


def environment() -> dict[str, Any]:
  import torch

  device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
  return dict(
    triton=triton.__version__, torch=torch.__version__, jax=jax.__version__, device=device
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="the JSON written (rows and versions)")
  parser.add_argument("--interpret", action="store_true", help="Triton's interpreter on the CPU")
  parser.add_argument("--patterns", default=None, help="comma list of PATTERNS (default: all)")
  args = parser.parse_args(argv)
  patterns = None if args.patterns is None else args.patterns.split(",")
  warps = (WARPS[0],) if args.interpret else WARPS  # the interpreter has no warps
  rows = probe(args.interpret, warps, patterns)
  with open(args.out, "w") as f:
    json.dump({"environment": environment(), "rows": [r._asdict() for r in rows]}, f, indent=1)
  wrong = [r for r in rows if not r.ok]
  print(f"{len(rows) - len(wrong)} of {len(rows)} rows right; wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
