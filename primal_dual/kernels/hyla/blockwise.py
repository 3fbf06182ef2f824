"""Blockwise HYLA: the dense kernel of :mod:`dense` over (query block × key block) tiles.

For one example, with heads ``h, g``, queries ``i``, keys ``j`` and scale ``c`` (``1/√D``)::

  s_hij  = c q_hi·k_hj + bias_hij              (0 where masked)
  r_ij   = (mean_h s_hij² + 1e-6)^(-1/2)
  a_hij  = s_hij r_ij  (rms_head)   |   s_hij  (none)
  z_ij   = Σ_g a_gij v_gj
  u_ij   = relu(z_ij) (mlp_relu)    |   z_ij   (mlp_linear)
  out_hi = Σ_j a_hij u_ij                      (linear value network: Σ_j a_hij v_hj)

The normalisation runs across heads, not across keys, so every quantity of tile ``(I, J)`` needs
only that tile's ``q, k, v, bias, mask``: the forward pass accumulates ``out [H, bq, d_v]``
(float32) over key blocks and no running statistic is needed.

Backward (``jax.custom_vjp``; each tile is recomputed, the only residuals are the inputs). With
``dout [H, q, d_v]``::

  mlp value networks:                       linear value network:
    da_hij  = dout_hi·u_ij                    da_hij  = dout_hi·v_hj
    du_ij   = Σ_h a_hij dout_hi               dv_hj  += Σ_i a_hij dout_hi
    dz_ij   = du_ij ⊙ [z_ij > 0] (relu) | du_ij
    da_gij += dz_ij·v_gj
    dv_gj  += Σ_i a_gij dz_ij
  rms_head: ds_hij = r_ij da_hij − s_hij r_ij³ (1/H) Σ_g s_gij da_gij;   none: ds = da
  ds = 0 where masked
  dq_hi = c Σ_j ds_hij k_hj,   dk_hj = c Σ_i ds_hij q_hi,   dbias_hij = ds_hij

Memory: one tile holds ``[H, bq, bk]`` scores and ``[bq, bk, d_v]`` of ``z``/``u``; the carried
accumulators (``out``, and ``dq``, ``dk``, ``dv`` in the backward) are linear in the lengths. A mask
or bias is kept at its own broadcast size (a padding mask ``[B, 1, 1, kv]`` stays that size), the
causal mask and the padding of ragged lengths are computed per tile from indices, so without a
full-size mask or bias the peak memory is linear in the length for fixed block sizes. The bias
gradient has the bias's own size.

Not covered (``hyla_attention`` falls back to the dense path for them): softmax normalisation (a
per-key normalisation that needs running statistics), dropout, returned or sown weights. Being a
``custom_vjp``, the kernel supports reverse-mode differentiation only (``jax.grad``, ``jax.vjp``;
not ``jax.jvp``/``jax.jacfwd``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels.hyla.dense import RMS_EPS

NORMALIZATIONS = ("rms_head", "none")
VALUE_NETWORKS = ("mlp_relu", "mlp_linear", "linear")


class Config(NamedTuple):
  """Static settings of one blockwise call (block sizes divide the padded lengths)."""

  scale: float
  normalization: str
  value_network: str
  q_block: int
  k_block: int
  q_len: int  # true lengths: rows/columns at or beyond them are padding
  kv_len: int
  causal_offset: int | None  # query i sees keys j <= i + offset; None: not causal
  precision: Any


# --- Masks and biases at their own broadcast size ------------------------------------------------


def reduced_broadcast(x, name: str, shapes: C.QKVShapes):
  """``x`` broadcastable to ``[batch..., H, q_len, kv_len]`` as ``[B', H', Q', K']``.

  Each of ``B', H', Q', K'`` is 1 where ``x`` broadcasts along that axis and the full size
  otherwise (``B`` is the flattened batch), so nothing is materialised beyond ``x``'s own size.
  None stays None.

  Raises:
    ValueError: ``x`` does not broadcast (naming its shape and the target).
  """
  if x is None:
    return None
  x = jnp.asarray(x)
  target = (*shapes.batch_shape, shapes.heads, shapes.q_len, shapes.kv_len)
  if x.ndim > len(target) or any(n not in (1, t) for n, t in zip(x.shape[::-1], target[::-1])):
    raise ValueError(
      f"{name} of shape {tuple(x.shape)} does not broadcast to [batch..., heads, q_len, kv_len]"
      f" = {target}"
    )
  x = x.reshape((1,) * (len(target) - x.ndim) + x.shape)
  batch_rank = len(shapes.batch_shape)
  if all(n == 1 for n in x.shape[:batch_rank]):
    return x.reshape((1, *x.shape[batch_rank:]))
  x = jnp.broadcast_to(x, (*shapes.batch_shape, *x.shape[batch_rank:]))
  return x.reshape((-1, *x.shape[batch_rank:]))


def pad_axis(x, axis: int, size: int, value=0):
  """Pads axis ``axis`` of ``x`` at the end to ``size`` (no-op for an axis of size 1)."""
  if x is None or x.shape[axis] in (1, size):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _tile_window(shape, qi, ki, cfg: Config):
  """``(starts, sizes)`` of tile ``(qi, ki)`` in a ``[H', Q', K']`` array (axes of size 1 stay)."""
  q_full, k_full = shape[1] > 1, shape[2] > 1
  starts = (0, qi * cfg.q_block if q_full else 0, ki * cfg.k_block if k_full else 0)
  sizes = (shape[0], cfg.q_block if q_full else 1, cfg.k_block if k_full else 1)
  return starts, sizes


def tile_of(x, qi, ki, cfg: Config):
  """The ``[H', bq|1, bk|1]`` tile ``(qi, ki)`` of a one-example ``[H', Q', K']`` mask or bias."""
  if x is None:
    return None
  starts, sizes = _tile_window(x.shape, qi, ki, cfg)
  return jax.lax.dynamic_slice(x, starts, sizes)


def add_tile(acc, tile, qi, ki, cfg: Config):
  """``acc`` (``[H', Q', K']``) plus ``tile`` (``[H, bq, bk]``) summed over ``acc``'s broadcast
  axes and added at tile ``(qi, ki)``."""
  starts, sizes = _tile_window(acc.shape, qi, ki, cfg)
  axes = tuple(a for a in range(3) if sizes[a] == 1 and tile.shape[a] > 1)
  tile = jnp.sum(tile, axis=axes, keepdims=True).astype(acc.dtype)
  current = jax.lax.dynamic_slice(acc, starts, sizes)
  return jax.lax.dynamic_update_slice(acc, current + tile, starts)


def tile_validity(mask_tile, qi, ki, cfg: Config):
  """Bool ``[H'|1, bq, bk]``: inside the true lengths, causal if asked, and allowed by the mask."""
  rows = qi * cfg.q_block + jnp.arange(cfg.q_block)[:, None]
  cols = ki * cfg.k_block + jnp.arange(cfg.k_block)[None, :]
  valid = (rows < cfg.q_len) & (cols < cfg.kv_len)
  if cfg.causal_offset is not None:
    valid = valid & (cols <= rows + cfg.causal_offset)
  valid = valid[None]
  return valid if mask_tile is None else valid & mask_tile


# --- One tile ------------------------------------------------------------------------------------


class TileState(NamedTuple):
  """Recomputed quantities of one tile (float32): s, a ``[H, bq, bk]``; r ``[1, bq, bk]`` or None;
  z, u ``[bq, bk, d_v]`` or None (linear value network)."""

  s: jax.Array
  r: jax.Array | None
  a: jax.Array
  z: jax.Array | None
  u: jax.Array | None


def tile_state(qb, kb, vb, bias_tile, valid, cfg: Config) -> TileState:
  """Scores, normalised scores and value-network activations of one tile.

  Args:
    qb: ``[H, bq, D]``. kb: ``[H, bk, D]``. vb: ``[H, bk, d_v]``.
    bias_tile: ``[H'|1, bq|1, bk|1]`` or None. valid: bool broadcastable to ``[H, bq, bk]``.
  """
  s = (
    jnp.einsum("hqd,hkd->hqk", qb, kb, precision=cfg.precision, preferred_element_type=C.F32)
    * cfg.scale
  )
  if bias_tile is not None:
    s = s + bias_tile.astype(C.F32)
  s = jnp.where(valid, s, 0.0)
  r = None
  a = s
  if cfg.normalization == "rms_head":
    r = jax.lax.rsqrt(jnp.mean(jnp.square(s), axis=0, keepdims=True) + RMS_EPS)
    a = s * r
  if cfg.value_network == "linear":
    return TileState(s, r, a, None, None)
  # Casts as in the dense kernel: operands in the value dtype, float32 accumulation.
  z = jnp.einsum(
    "hqk,hkd->qkd", a.astype(vb.dtype), vb, precision=cfg.precision, preferred_element_type=C.F32
  )
  u = jax.nn.relu(z) if cfg.value_network == "mlp_relu" else z
  return TileState(s, r, a, z, u)


def tile_output(state: TileState, vb, cfg: Config):
  """``Σ_j a_hij u_ij`` (or ``Σ_j a_hij v_hj``) of one tile: float32 ``[H, bq, d_v]``."""
  dtype = vb.dtype
  if cfg.value_network == "linear":
    return jnp.einsum(
      "hqk,hkd->hqd",
      state.a.astype(dtype),
      vb,
      precision=cfg.precision,
      preferred_element_type=C.F32,
    )
  return jnp.einsum(
    "hqk,qkd->hqd",
    state.a.astype(dtype),
    state.u.astype(dtype),
    precision=cfg.precision,
    preferred_element_type=C.F32,
  )


def tile_gradients(state: TileState, qb, kb, vb, dout, valid, cfg: Config):
  """Gradients of one tile's output with respect to its inputs (module docstring).

  Args:
    state: :func:`tile_state` of the tile. qb, kb, vb: as there. dout: float32 ``[H, bq, d_v]``.

  Returns:
    float32 ``(dq [H, bq, D], dk [H, bk, D], dv [H, bk, d_v], ds [H, bq, bk])``; ``ds`` is also
    the gradient of the bias tile.
  """
  f32 = {"precision": cfg.precision, "preferred_element_type": C.F32}
  v32 = vb.astype(C.F32)
  if cfg.value_network == "linear":
    da = jnp.einsum("hqd,hkd->hqk", dout, v32, **f32)
    dv = jnp.einsum("hqk,hqd->hkd", state.a, dout, **f32)
  else:
    da = jnp.einsum("hqd,qkd->hqk", dout, state.u, **f32)
    du = jnp.einsum("hqk,hqd->qkd", state.a, dout, **f32)
    dz = du * (state.z > 0) if cfg.value_network == "mlp_relu" else du
    da = da + jnp.einsum("qkd,hkd->hqk", dz, v32, **f32)
    dv = jnp.einsum("hqk,qkd->hkd", state.a, dz, **f32)
  if cfg.normalization == "rms_head":
    mean_sda = jnp.mean(state.s * da, axis=0, keepdims=True)
    ds = state.r * da - state.s * state.r**3 * mean_sda
  else:
    ds = da
  ds = jnp.where(valid, ds, 0.0)
  dq = jnp.einsum("hqk,hkd->hqd", ds, kb.astype(C.F32), **f32) * cfg.scale
  dk = jnp.einsum("hqk,hqd->hkd", ds, qb.astype(C.F32), **f32) * cfg.scale
  return dq, dk, dv, ds


# --- One example: loops over tiles ---------------------------------------------------------------


def _blocks(x, block: int):
  """``[H, L, F] -> [L / block, H, block, F]`` (L a multiple of ``block``)."""
  heads, length, features = x.shape
  return jnp.moveaxis(x.reshape(heads, length // block, block, features), 1, 0)


def _unblocks(x):
  """Inverse of :func:`_blocks`."""
  n, heads, block, features = x.shape
  return jnp.moveaxis(x, 0, 1).reshape(heads, n * block, features)


def forward_one(q, k, v, bias, mask, cfg: Config):
  """Float32 ``out [H, Q, d_v]`` of one example.

  Args:
    q: ``[H, Q, D]``, k: ``[H, K, D]``, v: ``[H, K, d_v]`` with Q, K multiples of the blocks.
    bias, mask: ``[H', Q', K']`` (each 1 or full) or None.
  """
  k_blocks, v_blocks = _blocks(k, cfg.k_block), _blocks(v, cfg.k_block)
  key_index = jnp.arange(k_blocks.shape[0])

  def query_block(xs):
    qb, qi = xs

    def key_block(acc, ys):
      kb, vb, ki = ys
      valid = tile_validity(tile_of(mask, qi, ki, cfg), qi, ki, cfg)
      state = tile_state(qb, kb, vb, tile_of(bias, qi, ki, cfg), valid, cfg)
      return acc + tile_output(state, vb, cfg), None

    init = jnp.zeros((q.shape[0], cfg.q_block, v.shape[-1]), C.F32)
    out, _ = jax.lax.scan(key_block, init, (k_blocks, v_blocks, key_index))
    return out

  q_blocks = _blocks(q, cfg.q_block)
  out = jax.lax.map(query_block, (q_blocks, jnp.arange(q_blocks.shape[0])))
  return _unblocks(out)


def backward_one(q, k, v, bias, mask, dout, cfg: Config):
  """Float32 ``(dq, dk, dv, dbias)`` of one example; ``dbias`` has ``bias``'s shape or is None.

  Outer loop over query blocks (carrying ``dk``, ``dv`` and ``dbias``), inner loop over key blocks
  (carrying the query block's ``dq``).
  """
  k_blocks, v_blocks = _blocks(k, cfg.k_block), _blocks(v, cfg.k_block)
  q_blocks, dout_blocks = _blocks(q, cfg.q_block), _blocks(dout.astype(C.F32), cfg.q_block)
  key_index = jnp.arange(k_blocks.shape[0])

  def query_block(carry, xs):
    dk_acc, dv_acc, dbias_acc = carry
    qb, doutb, qi = xs

    def key_block(inner, ys):
      dq_acc, dbias_acc = inner
      kb, vb, ki = ys
      valid = tile_validity(tile_of(mask, qi, ki, cfg), qi, ki, cfg)
      state = tile_state(qb, kb, vb, tile_of(bias, qi, ki, cfg), valid, cfg)
      dq, dk, dv, ds = tile_gradients(state, qb, kb, vb, doutb, valid, cfg)
      if dbias_acc is not None:
        dbias_acc = add_tile(dbias_acc, ds, qi, ki, cfg)
      return (dq_acc + dq, dbias_acc), (dk, dv)

    dq0 = jnp.zeros(qb.shape, C.F32)
    (dq, dbias_acc), (dk, dv) = jax.lax.scan(
      key_block, (dq0, dbias_acc), (k_blocks, v_blocks, key_index)
    )
    return (dk_acc + dk, dv_acc + dv, dbias_acc), dq

  init = (
    jnp.zeros(k_blocks.shape, C.F32),
    jnp.zeros(v_blocks.shape, C.F32),
    None if bias is None else jnp.zeros(bias.shape, C.F32),
  )
  (dk, dv, dbias), dq = jax.lax.scan(
    query_block, init, (q_blocks, dout_blocks, jnp.arange(q_blocks.shape[0]))
  )
  return _unblocks(dq), _unblocks(dk), _unblocks(dv), dbias


# --- Batch and custom VJP ------------------------------------------------------------------------


def _shared_or_mapped(x):
  """``(x, vmap axis)``: an array of batch size 1 is shared by every example (axis None)."""
  if x is None or x.shape[0] != 1:
    return x, (None if x is None else 0)
  return x[0], None


def _over_batch(fn, q, k, v, bias, mask, *rest):
  """``jax.vmap(fn)(q, k, v, bias, mask, *rest)`` with batch-1 masks and biases shared."""
  bias, bias_axis = _shared_or_mapped(bias)
  mask, mask_axis = _shared_or_mapped(mask)
  in_axes = (0, 0, 0, bias_axis, mask_axis) + (0,) * len(rest)
  return jax.vmap(fn, in_axes=in_axes)(q, k, v, bias, mask, *rest)


def make_blockwise(cfg: Config):
  """``(q, k, v, bias, mask) -> out`` with a tile-recomputing VJP.

  Shapes: q ``[B, H, Q, D]``, k ``[B, H, K, D]``, v ``[B, H, K, d_v]`` (Q, K multiples of the
  blocks), bias and mask ``[B', H', Q', K']`` or None (mask bool). Returns float32
  ``[B, H, Q, d_v]``. The residuals are the inputs only; the mask gets no gradient.
  """

  return recomputing_vjp(
    lambda *x: _over_batch(lambda *y: forward_one(*y, cfg), *x),
    lambda *x: _over_batch(lambda *y: backward_one(*y, cfg), *x),
  )


def recomputing_vjp(forward, backward):
  """``attend(q, k, v, bias, mask) = forward(q, k, v, bias, mask)``, differentiated by
  ``backward(q, k, v, bias, mask, dout) -> (dq, dk, dv, dbias)``, which recomputes the tiles from
  the inputs (the only residuals, as in flash attention); the mask gets no gradient.

  The kernels' shared VJP (blockwise, tensor-core). ``dbias`` may be None (no bias, or a
  placeholder bias, which gets zeros) or per example ``[B, H', Q', K']`` where the bias is shared
  by the batch (``B' = 1``: summed over it); cotangents come back in their inputs' dtypes.
  """

  @jax.custom_vjp
  def attend(q, k, v, bias, mask):
    return forward(q, k, v, bias, mask)

  def attend_fwd(q, k, v, bias, mask):
    return forward(q, k, v, bias, mask), (q, k, v, bias, mask)

  def attend_bwd(residuals, dout):
    q, k, v, bias, mask = residuals
    dq, dk, dv, dbias = backward(q, k, v, bias, mask, dout)
    return (
      dq.astype(q.dtype),
      dk.astype(k.dtype),
      dv.astype(v.dtype),
      _bias_cotangent(dbias, bias),
      None,
    )

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def _bias_cotangent(dbias, bias):
  if dbias is None:
    return None if bias is None else jnp.zeros_like(bias)
  if dbias.shape[0] != bias.shape[0]:  # per example; a bias shared by the batch sums over it
    dbias = jnp.sum(dbias, axis=0, keepdims=True)
  return dbias.astype(bias.dtype)


# --- Entry point ---------------------------------------------------------------------------------


def _round_up(n: int, block: int) -> int:
  return -(-n // block) * block


def check_tiled_call(
  name: str,
  query,
  key,
  value,
  normalization: str,
  value_network: str,
  block_size,
  *,
  normalization_note: str = "",
) -> C.QKVShapes:
  """The checks every tiled HYLA entry point (``name``: this module's, the tensor-core kernel's) makes
  before tiling; returns the validated shapes.

  Raises:
    ValueError: bad shapes (naming them), grouped key/value heads, an unsupported
      ``normalization`` (its message ending in ``normalization_note``) or ``value_network``, or a
      ``block_size`` that is not a positive int.
  """
  shapes = C.validate_qkv(query, key, value)
  C.refuse_grouped_heads(
    shapes, name, "its value network sums the values over heads with per-head weights"
  )
  if normalization not in NORMALIZATIONS:
    raise ValueError(
      f"{name}: normalization must be one of {list(NORMALIZATIONS)}; got "
      f"{normalization!r}{normalization_note}"
    )
  if value_network not in VALUE_NETWORKS:
    raise ValueError(
      f"{name}: value_network must be one of {list(VALUE_NETWORKS)}; got {value_network!r}"
    )
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f"block_size must be a positive int; got {block_size!r}")
  return shapes


def hyla_blockwise_attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  block_size: int = 128,
  is_causal: bool = False,
  causal_alignment: str = "top_left",
  normalization: str = "rms_head",
  value_network: str = "mlp_relu",
  scale: float | None = None,
  dtype=None,
  precision=None,
):
  """HYLA over (query block × key block) tiles; equals the dense path of ``hyla_attention`` (module docstring).

  Args:
    query: ``[batch..., q_len, heads, d_qk]``. key: ``[batch..., kv_len, heads, d_qk]``.
    value: ``[batch..., kv_len, heads, d_v]``.
    bias: additive, broadcastable to ``[batch..., heads, q_len, kv_len]`` (kept at its own size).
    mask: any dtype, broadcastable like ``bias``; nonzero = may attend.
    block_size: query and key block size (clipped to the lengths); ragged lengths are padded and
      the padding masked.
    is_causal, causal_alignment, normalization (``'rms_head'`` | ``'none'``), value_network
    (``'mlp_relu'`` | ``'mlp_linear'`` | ``'linear'``), scale, dtype, precision: as in
      ``hyla_attention``.

  Returns:
    ``[batch..., q_len, heads, d_v]`` in ``dtype`` (default ``query.dtype``).

  Raises:
    ValueError: bad shapes (naming them), grouped key/value heads, an unsupported
      ``normalization``/``value_network``, or a ``block_size`` that is not a positive int.
  """
  shapes = check_tiled_call(
    "hyla_blockwise_attention", query, key, value, normalization, value_network, block_size
  )
  offset = C.causal_offset(causal_alignment, shapes.q_len, shapes.kv_len)
  q_block, k_block = min(block_size, shapes.q_len), min(block_size, shapes.kv_len)
  q_pad, k_pad = _round_up(shapes.q_len, q_block), _round_up(shapes.kv_len, k_block)
  cfg = Config(
    scale=C.default_scale(shapes.d_qk) if scale is None else scale,
    normalization=normalization,
    value_network=value_network,
    q_block=q_block,
    k_block=k_block,
    q_len=shapes.q_len,
    kv_len=shapes.kv_len,
    causal_offset=offset if is_causal else None,
    precision=precision,
  )
  mask = reduced_broadcast(C.as_bool_mask(mask), "mask", shapes)
  bias = reduced_broadcast(bias, "bias", shapes)
  q, k, v = (C.to_heads_major(x) for x in (query, key, value))
  q = pad_axis(q, 2, q_pad)
  k, v = pad_axis(k, 2, k_pad), pad_axis(v, 2, k_pad)
  mask = pad_axis(pad_axis(mask, 2, q_pad, False), 3, k_pad, False)
  bias = pad_axis(pad_axis(bias, 2, q_pad), 3, k_pad)
  out = make_blockwise(cfg)(q, k, v, bias, mask)[:, :, : shapes.q_len]
  return C.finish(
    out, None, shapes=shapes, dtype=C.output_dtype(query, dtype), module=None, return_weights=False
  )
