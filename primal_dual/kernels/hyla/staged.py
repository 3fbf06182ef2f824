"""A pure-JAX emulation of the staged HYLA kernel design of issue #52 (forward only).

Not a library path (no implementation of ``hyla_attention``; neither the package's
``__init__`` nor the registry imports it): it fixes, before any kernel is written, the tiling, the
staging order and the points where the kernel rounds, so that a kernel can later be checked
against it number for number. Formulas: :mod:`dense` (module
docstring); with heads ``h``, queries ``i``, keys ``j`` and scale ``c`` (``1/√D`` by default)::

  s_hij  = c q_hi·k_hj
  a_hij  = s_hij (mean_h s_hij² + 1e-6)^(-1/2)   (rms_head)  |  s_hij  (none)
  u_ij   = relu(Σ_h a_hij v_hj)                  (mlp_relu)  |  Σ_h a_hij v_hj  (mlp_linear)
  out_hi = Σ_j a_hij u_ij

The tiling. One program (CTA) holds ``Q_TILE = 64`` queries of one example and all ``H`` heads;
it loops over the keys in sub-blocks of ``K_TILE = 16``. Per key block:

1. ``S_h = q_h · k_hᵀ`` per head: ``[64, D] × [D, 16]``, operands in the stage dtype (bfloat16),
   float32 accumulation; the scale multiplies the float32 accumulator (as ``dense.hyla_scores``).
2. ``rms_head`` across the heads, in float32; ``a`` rounded to the stage dtype into the A-stage
   ``[16 keys][64 queries][H heads]``.
3. per key ``j``: ``U_j = A_j @ V_j``, ``[64, H] × [H, d_v]`` (the value network's hidden layer,
   contracting the heads; float32 accumulation), relu, rounded to the stage dtype into the
   U-stage ``[16 keys][64 queries][d_v]``.
4. per query ``i``: ``out_iᵀ += U_iᵀ @ A_i``, ``[d_v, 16] × [16, H]`` (``N = H``), into a float32
   accumulator ``[64 queries][d_v][H]`` carried over the key blocks.

Rounding: exactly at the kernel's stages: ``q``, ``k``, ``v`` as loaded (the stage dtype), ``a``
(A-stage) and ``u`` (U-stage); everything else, including every product's accumulation, is float32.
Products of two bfloat16 values are exact in float32, so the rounded operands are held as float32
(``lax.reduce_precision``) and multiplied at ``Precision.HIGHEST``: what remains between this
function and a kernel is the order of float32 additions. With ``stage_dtype=jnp.float32`` nothing
is rounded beyond float32 (the function of ``hyla.hyla_attention`` in float32).

Masks and biases are not covered; lengths need not be multiples of the tiles: the padding is
zeros, whose scores, ``a`` and ``u`` are exactly 0 and add nothing (padded queries are dropped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Q_TILE = 64  # queries per program (CTA)
K_TILE = 16  # keys per sub-block (one matrix instruction's K)
RMS_EPS = 1e-6  # as dense.RMS_EPS
NORMALIZATIONS = ("rms_head", "none")
VALUE_NETWORKS = ("mlp_relu", "mlp_linear")
F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def _round(x, stage_dtype):
  """``x`` rounded to ``stage_dtype`` (to nearest, even), held as float32.

  ``lax.reduce_precision`` rather than a float32 -> bfloat16 -> float32 round trip: XLA may drop
  such a pair of converts (``xla_allow_excess_precision``, on by default), and did so here on CPU.
  """
  x = x.astype(F32)
  if jnp.dtype(stage_dtype) == F32:
    return x
  info = jnp.finfo(stage_dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _product(spec: str, x, y):
  """An einsum of two float32-held stage-dtype operands with float32 accumulation (the products
  of rounded operands are exact in float32)."""
  return jnp.einsum(spec, x, y, precision=_HIGHEST)


def pad_to(x, axis: int, multiple: int):
  """``x`` zero-padded at the end of ``axis`` to a multiple of ``multiple``."""
  size = x.shape[axis]
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, -size % multiple)
  return jnp.pad(x, widths)


def key_block_update(
  acc, q_tile, k_block, v_block, *, scale, normalization, value_network, stage_dtype
):
  """One key block of every program: stages 1–4 of the module docstring.

  Args:
    acc: float32 ``[P, 64, d_v, H]`` (``out_iᵀ`` of each query of each program ``P``).
    q_tile: ``[P, 64, H, D]``. k_block: ``[P, 16, H, D]``, v_block: ``[P, 16, H, d_v]`` (each
      program's example's keys); float32 holding stage-dtype values.

  Returns:
    ``(acc', a_stage [P, 16, 64, H], u_stage [P, 16, 64, d_v])``; the stages are float32 arrays
    holding stage-dtype values.
  """
  # 1. Per head, [64, D] × [D, 16] -> [H, 64, 16] float32; scale on the accumulator.
  s = _product("pihd,pjhd->phij", q_tile, k_block) * scale
  # 2. Across heads, float32; the A-stage is key-major [16][64][H] (per key j, A_j is [64, H]).
  if normalization == "rms_head":
    s = s * jax.lax.rsqrt(jnp.mean(jnp.square(s), axis=1, keepdims=True) + RMS_EPS)
  a_stage = _round(jnp.transpose(s, (0, 3, 2, 1)), stage_dtype)  # [P, j, i, h]
  # 3. Per key j: A_j [64, H] @ V_j [H, d_v] -> [64, d_v], float32, relu, rounded: the U-stage.
  z = _product("pjih,pjhe->pjie", a_stage, v_block)
  u_stage = _round(jax.nn.relu(z) if value_network == "mlp_relu" else z, stage_dtype)
  # 4. Per query i: U_iᵀ [d_v, 16] @ A_i [16, H] -> [d_v, H], added to the float32 accumulator.
  acc = acc + _product("pjie,pjih->pieh", u_stage, a_stage)
  return acc, a_stage, u_stage


def hyla_staged(
  query,
  key,
  value,
  *,
  normalization: str = "rms_head",
  value_network: str = "mlp_relu",
  scale: float | None = None,
  stage_dtype=jnp.bfloat16,
):
  """HYLA's forward pass as the staged kernel would compute it (module docstring).

  Args:
    query: ``[B, q_len, H, D]``. key: ``[B, kv_len, H, D]``. value: ``[B, kv_len, H, d_v]``
      (Flax's layout, as ``hyla.hyla_attention``).
    normalization: ``'rms_head'`` or ``'none'``. value_network: ``'mlp_relu'`` or
      ``'mlp_linear'``.
    scale: multiplies ``qᵀk``; default ``1/√D``.
    stage_dtype: the dtype of the loaded operands and of the A- and U-stages (``jnp.bfloat16``:
      the kernel; ``jnp.float32``: no rounding beyond float32).

  Returns:
    float32 ``[B, q_len, H, d_v]``.

  Raises:
    ValueError: an unsupported normalisation or value network, or mismatched shapes.
  """
  if normalization not in NORMALIZATIONS or value_network not in VALUE_NETWORKS:
    raise ValueError(
      f"hyla_staged covers normalization in {NORMALIZATIONS} and value_network in "
      f"{VALUE_NETWORKS}; got {normalization!r}, {value_network!r}"
    )
  batch, q_len, heads, d_qk = query.shape
  if key.shape[0] != batch or key.shape[2:] != (heads, d_qk) or value.shape[:3] != key.shape[:3]:
    raise ValueError(f"shapes do not match: q {query.shape}, k {key.shape}, v {value.shape}")
  d_v = value.shape[-1]
  scale = d_qk**-0.5 if scale is None else scale
  # Loaded tiles are in the stage dtype; zero padding adds nothing (module docstring).
  q = pad_to(_round(query, stage_dtype), 1, Q_TILE)
  k = pad_to(_round(key, stage_dtype), 1, K_TILE)
  v = pad_to(_round(value, stage_dtype), 1, K_TILE)
  q_tiles = q.shape[1] // Q_TILE
  k_blocks = k.shape[1] // K_TILE
  programs = batch * q_tiles
  # Programs (example, query tile) flattened; each sees its example's keys.
  q_prog = q.reshape(programs, Q_TILE, heads, d_qk)
  k_prog = jnp.repeat(k.reshape(batch, k_blocks, K_TILE, heads, d_qk), q_tiles, axis=0)
  v_prog = jnp.repeat(v.reshape(batch, k_blocks, K_TILE, heads, d_v), q_tiles, axis=0)

  def body(block, acc):
    acc, _, _ = key_block_update(
      acc,
      q_prog,
      k_prog[:, block],
      v_prog[:, block],
      scale=scale,
      normalization=normalization,
      value_network=value_network,
      stage_dtype=stage_dtype,
    )
    return acc

  acc = jax.lax.fori_loop(0, k_blocks, body, jnp.zeros((programs, Q_TILE, d_v, heads), F32))
  out = jnp.transpose(acc, (0, 1, 3, 2)).reshape(batch, q_tiles * Q_TILE, heads, d_v)
  return out[:, :q_len]
