"""Fused HYLA in ``jax.experimental.pallas`` (GPU/Triton backend; interpret mode elsewhere).

Computes exactly the function of :mod:`hyla_blockwise` (and of the dense ``hyla.py``). For one
example, heads ``h, g``, queries ``i``, keys ``j``, scale ``c`` (``1/√D`` by default)::

  s_hij  = c q_hi·k_hj + bias_hij              (0 where masked)
  r_ij   = (mean_h s_hij² + 1e-6)^(-1/2)
  a_hij  = s_hij r_ij  (rms_head)   |   s_hij  (none)
  z_ij   = Σ_g a_gij v_gj
  u_ij   = relu(z_ij) (mlp_relu)    |   z_ij   (mlp_linear)
  out_hi = Σ_j a_hij u_ij                      (linear value network: Σ_j a_hij v_hj)

Kernels (``pl.pallas_call``, one program per (example, tile); every head of a tile together,
since the value network mixes the heads):

* forward, grid ``(B, q_len / bq)``: a ``lax.fori_loop`` over key tiles accumulates
  ``out [H, bq, d_v]`` in float32; no running statistic is needed (the normalisation runs across
  heads, not keys).
* dq pass, grid ``(B, q_len / bq)``: loop over key tiles, recomputing each tile, accumulating
  ``dq [H, bq, D]`` (and writing the bias gradient when the bias varies along the queries).
* dk/dv pass, grid ``(B, kv_len / bk)``: loop over query tiles, accumulating ``dk [H, bk, D]``,
  ``dv [H, bk, d_v]`` (and the query-summed bias gradient when the bias is shared by queries).

The backward is a ``jax.custom_vjp`` whose residuals are the inputs only (each tile recomputed, as
in flash attention); tile gradients follow the formulas of :mod:`hyla_blockwise`. Causal calls
skip the key tiles above the diagonal (forward, dq) and the query tiles below it (dk/dv).

Memory: one program holds ``[H, bq, bk]`` scores and ``[bq, bk, d_v]`` of ``z``/``u`` (float32,
registers/shared memory on a GPU); nothing ``[q_len, kv_len]``-sized is formed unless the caller
passes a full-size mask or bias (kept at its own broadcast size; its gradient has its size, times
the batch when the batch shares it, as in the blockwise path).

Numerics: scores, normalisation, ``z``, ``u`` and all accumulators are float32. As in the other
paths the value network's operands are rounded to the value dtype (``a`` and ``u`` in the
forward); the rounded values are then multiplied in float32. ``precision`` is passed to the
matrix products (``q·k``, the linear value network, and ``dq``, ``dk``, ``dv`` products); the MLP
value networks' mixing and read-out are per-query contractions written as float32 elementwise
products and sums (no matrix unit), so they are exact float32 whatever ``precision`` says.

GPU layout: head and value features are zero-padded to a power of two (at least 16 on a GPU,
Triton's minimum dot size) and lengths to the tile; tiles are powers of two on a GPU. All matrix
products are 2-D (Triton lowers no batched ``dot_general``), hence Python loops over heads.

Backend: every ``pl.pallas_call`` passes ``pallas.triton.CompilerParams`` (``num_warps``,
``num_stages``), which on a GPU is also what selects Triton: without compiler parameters this JAX
lowers a GPU Pallas call with Mosaic GPU, which rejects this kernel (it cannot size
``jax.nn.relu``'s ``custom_jvp`` call, and without relu the kernel asks for more shared memory
than the 227 KiB of an H100: 282 KiB for 4 heads of 64 features at 256 tokens in bfloat16, as
lowered for CUDA on a CPU). JAX deprecates Pallas's Triton backend; a kernel for the tensor cores
(Mosaic GPU's warpgroup matrix products, or cuDNN) is separate work. Off a GPU the kernels run in
interpret mode, which ignores these parameters. ``hyla_attention``'s ``implementation='auto'``
does not pick this kernel (no GPU measurement shows it faster than the XLA blockwise path yet);
``implementation='pallas'`` does.

Not covered (``ValueError``): softmax normalisation (per-key running statistics), and, through
``hyla_attention``, dropout and returned or sown weights. Reverse-mode differentiation only.
Interpret mode (``interpret=None``: automatic when the default backend is not a GPU) runs the same
kernels on CPU, slowly; it is what the test-suite exercises.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from primal_dual.kernels import _common as C
from primal_dual.kernels import hyla_blockwise as hb

NORMALIZATIONS = hb.NORMALIZATIONS
VALUE_NETWORKS = hb.VALUE_NETWORKS
DEFAULT_BLOCK_SIZE = 16  # [bq, bk, d_v] float32 of u must fit a GPU program (untuned: no GPU here)
# Triton's own defaults (untuned: no GPU measurement yet).
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3


class Config(NamedTuple):
  """Static settings of one Pallas call (tiles divide the padded lengths)."""

  scale: float
  normalization: str
  value_network: str
  heads: int
  q_block: int
  k_block: int
  q_len: int  # true lengths: rows/columns at or beyond them are padding
  kv_len: int
  q_blocks: int
  k_blocks: int
  causal_offset: int | None  # query i sees keys j <= i + offset; None: not causal
  precision: Any
  bias_full: tuple[bool, bool, bool, bool] | None  # (B', H', Q', K') > 1; None: no bias
  mask_full: tuple[bool, bool, bool, bool] | None
  interpret: bool
  num_warps: int  # Triton launch parameters (GPU only)
  num_stages: int


# --- Tile maths on per-head lists of 2-D arrays ------------------------------------------------


def _f32(x):
  return x.astype(C.F32)


def _rounded(x, dtype):
  """``x`` rounded to ``dtype`` and held in float32 (exact products of the rounded values)."""
  return x if dtype == C.F32 else _f32(x.astype(dtype))


def _dot(a, b, contract, cfg: Config):
  """2-D ``dot_general`` contracting axis ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=cfg.precision, preferred_element_type=C.F32)


def _logit_tile(ref, full, h, rows, cols):
  """Tile ``[bq|1, bk|1]`` of head ``h`` of a one-example ``[H', Q', K']`` mask or bias block."""
  return ref[
    h if full[1] else 0, rows if full[2] else slice(None), cols if full[3] else slice(None)
  ]


def _validity(qi, ki, mask_ref, rows, cols, cfg: Config):
  """Per head, bool ``[bq, bk]`` (or one shared array): inside the lengths, causal, mask."""
  row = qi * cfg.q_block + jnp.arange(cfg.q_block)[:, None]
  col = ki * cfg.k_block + jnp.arange(cfg.k_block)[None, :]
  valid = (row < cfg.q_len) & (col < cfg.kv_len)
  if cfg.causal_offset is not None:
    valid = valid & (col <= row + cfg.causal_offset)
  if mask_ref is None:
    return [valid] * cfg.heads
  heads = range(cfg.heads) if cfg.mask_full[1] else [0] * cfg.heads
  return [valid & (_logit_tile(mask_ref, cfg.mask_full, h, rows, cols) != 0) for h in heads]


class Tile(NamedTuple):
  """Recomputed float32 quantities of one tile: per-head lists s, a ``[bq, bk]``; r ``[bq, bk]``
  or None; z, u ``[bq, bk, d_v]`` or None (linear value network)."""

  s: list
  r: Any
  a: list
  z: Any
  u: Any


def _tile(qs, ks, vs, biases, valids, cfg: Config) -> Tile:
  """Scores, normalised scores and value-network activations of one tile (per-head lists:
  qs ``[bq, D]``, ks ``[bk, D]``, vs ``[bk, d_v]``, biases ``[bq|1, bk|1]`` or None)."""
  s = []
  for h in range(cfg.heads):
    sh = _dot(qs[h], ks[h], (1, 1), cfg) * cfg.scale
    if biases is not None:
      sh = sh + _f32(biases[h])
    s.append(jnp.where(valids[h], sh, 0.0))
  r, a = None, s
  if cfg.normalization == "rms_head":
    mean_square = sum(x * x for x in s) / cfg.heads
    r = jax.lax.rsqrt(mean_square + hb.RMS_EPS)
    a = [x * r for x in s]
  if cfg.value_network == "linear":
    return Tile(s, r, a, None, None)
  dtype = vs[0].dtype
  # Operands rounded to the value dtype, as the dense and blockwise einsums cast them.
  z = sum(_rounded(a[h], dtype)[:, :, None] * _f32(vs[h])[None] for h in range(cfg.heads))
  u = jax.nn.relu(z) if cfg.value_network == "mlp_relu" else z
  return Tile(s, r, a, z, u)


def _tile_output(t: Tile, vs, cfg: Config):
  """Per head, float32 ``[bq, d_v]``: ``Σ_j a_hij u_ij`` (or ``Σ_j a_hij v_hj``)."""
  dtype = vs[0].dtype
  if cfg.value_network == "linear":
    return [_dot(_rounded(t.a[h], dtype), _f32(vs[h]), (1, 0), cfg) for h in range(cfg.heads)]
  u = _rounded(t.u, dtype)
  return [jnp.sum(_rounded(t.a[h], dtype)[:, :, None] * u, axis=1) for h in range(cfg.heads)]


def _tile_ds(t: Tile, vs, douts, valids, cfg: Config, need_dv: bool):
  """``(ds, dv)`` of one tile (per-head lists; ``dv`` None unless ``need_dv``), douts float32
  ``[bq, d_v]``; formulas of :mod:`hyla_blockwise`."""
  heads = range(cfg.heads)
  v32 = [_f32(x) for x in vs]
  dv = None
  if cfg.value_network == "linear":
    da = [_dot(douts[h], v32[h], (1, 1), cfg) for h in heads]
    if need_dv:
      dv = [_dot(t.a[h], douts[h], (0, 0), cfg) for h in heads]
  else:
    da = [jnp.sum(douts[h][:, None, :] * t.u, axis=2) for h in heads]
    du = sum(t.a[h][:, :, None] * douts[h][:, None, :] for h in heads)
    dz = jnp.where(t.z > 0, du, 0.0) if cfg.value_network == "mlp_relu" else du
    da = [da[h] + jnp.sum(dz * v32[h][None], axis=2) for h in heads]
    if need_dv:
      dv = [jnp.sum(t.a[h][:, :, None] * dz, axis=0) for h in heads]
  if cfg.normalization == "rms_head":
    mean_sda = sum(t.s[h] * da[h] for h in heads) / cfg.heads
    r3 = t.r * t.r * t.r
    da = [t.r * da[h] - t.s[h] * r3 * mean_sda for h in heads]
  ds = [jnp.where(valids[h], da[h], 0.0) for h in heads]
  return ds, dv


def _bias_grad_tile(ds, full, axis):
  """Summed over heads (``full[1]`` False) and over tile axis ``axis`` (None: none) -> list."""
  if not full[1]:
    ds = [sum(ds)]
  return ds if axis is None else [jnp.sum(x, axis=axis, keepdims=True) for x in ds]


# --- Loop bounds ---------------------------------------------------------------------------------


def _key_blocks_seen(qi, cfg: Config):
  """Key tiles that query tile ``qi`` can see (all of them unless causal)."""
  if cfg.causal_offset is None:
    return cfg.k_blocks
  visible = jnp.clip(
    qi * cfg.q_block + cfg.q_block + cfg.causal_offset, 0, cfg.k_blocks * cfg.k_block
  )
  return jnp.minimum(jax.lax.div(visible + cfg.k_block - 1, cfg.k_block), cfg.k_blocks)


def _first_query_block(ki, cfg: Config):
  """First query tile that can see key tile ``ki`` (0 unless causal)."""
  if cfg.causal_offset is None:
    return 0
  first_row = jnp.clip(ki * cfg.k_block - cfg.causal_offset, 0, cfg.q_blocks * cfg.q_block)
  return jnp.minimum(jax.lax.div(first_row, cfg.q_block), cfg.q_blocks)


# --- Kernels -------------------------------------------------------------------------------------


def _split_refs(refs, cfg: Config, n_in: int):
  """``(q, k, v, bias|None, mask|None, *rest)`` from the flat refs."""
  refs = list(refs)
  q, k, v = refs[:3]
  i = 3
  bias = mask = None
  if cfg.bias_full is not None:
    bias, i = refs[i], i + 1
  if cfg.mask_full is not None:
    mask, i = refs[i], i + 1
  return q, k, v, bias, mask, refs[i : i + n_in], refs[i + n_in :]


def _load_heads(ref, rows, cfg: Config):
  return [ref[h, rows, :] for h in range(cfg.heads)]


def _forward_kernel(*refs, cfg: Config):
  """Refs: q ``[H, bq, D]``, k ``[H, K, D]``, v ``[H, K, d_v]``, bias/mask ``[H', bq|1, K'|1]``;
  out ``[H, bq, d_v]``."""
  q_ref, k_ref, v_ref, bias_ref, mask_ref, _, (out_ref,) = _split_refs(refs, cfg, 0)
  qi = pl.program_id(1)
  qs = _load_heads(q_ref, slice(None), cfg)
  rows = slice(None)

  def body(ki, acc):
    cols = pl.ds(ki * cfg.k_block, cfg.k_block)
    ks, vs = _load_heads(k_ref, cols, cfg), _load_heads(v_ref, cols, cfg)
    valids = _validity(qi, ki, mask_ref, rows, cols, cfg)
    biases = _biases(bias_ref, rows, cols, cfg)
    outs = _tile_output(_tile(qs, ks, vs, biases, valids, cfg), vs, cfg)
    return tuple(x + y for x, y in zip(acc, outs))

  init = tuple(jnp.zeros((cfg.q_block, out_ref.shape[-1]), C.F32) for _ in range(cfg.heads))
  acc = jax.lax.fori_loop(0, _key_blocks_seen(qi, cfg), body, init)
  for h in range(cfg.heads):
    out_ref[h] = acc[h].astype(out_ref.dtype)


def _biases(bias_ref, rows, cols, cfg: Config):
  if bias_ref is None:
    return None
  heads = range(cfg.heads) if cfg.bias_full[1] else [0] * cfg.heads
  return [_logit_tile(bias_ref, cfg.bias_full, h, rows, cols) for h in heads]


def _dq_kernel(*refs, cfg: Config):
  """Refs as the forward's plus dout ``[H, bq, d_v]``; out dq ``[H, bq, D]`` and, when the bias
  varies along the queries, dbias ``[H', bq, K'|1]``."""
  q_ref, k_ref, v_ref, bias_ref, mask_ref, (dout_ref,), outs = _split_refs(refs, cfg, 1)
  dq_ref = outs[0]
  dbias_ref = outs[1] if len(outs) > 1 else None
  k_full = dbias_ref is not None and cfg.bias_full[3]
  qi = pl.program_id(1)
  rows = slice(None)
  qs = _load_heads(q_ref, rows, cfg)
  douts = [_f32(x) for x in _load_heads(dout_ref, rows, cfg)]

  def body(ki, carry):
    dq, dbias_rows = carry
    cols = pl.ds(ki * cfg.k_block, cfg.k_block)
    ks, vs = _load_heads(k_ref, cols, cfg), _load_heads(v_ref, cols, cfg)
    valids = _validity(qi, ki, mask_ref, rows, cols, cfg)
    t = _tile(qs, ks, vs, _biases(bias_ref, rows, cols, cfg), valids, cfg)
    ds, _ = _tile_ds(t, vs, douts, valids, cfg, need_dv=False)
    dq = tuple(dq[h] + _dot(ds[h], _f32(ks[h]), (1, 0), cfg) for h in range(cfg.heads))
    if dbias_ref is not None:
      if k_full:  # this tile of the bias gradient is complete: write it
        for h, x in enumerate(_bias_grad_tile(ds, cfg.bias_full, None)):
          dbias_ref[h, :, cols] = x.astype(dbias_ref.dtype)
      else:  # the bias is shared by the keys: sum them
        parts = _bias_grad_tile(ds, cfg.bias_full, 1)
        dbias_rows = tuple(x + y for x, y in zip(dbias_rows, parts))
    return dq, dbias_rows

  n_bias_heads = cfg.heads if cfg.bias_full is not None and cfg.bias_full[1] else 1
  dq0 = tuple(jnp.zeros((cfg.q_block, q_ref.shape[-1]), C.F32) for _ in range(cfg.heads))
  rows0 = tuple(jnp.zeros((cfg.q_block, 1), C.F32) for _ in range(n_bias_heads))
  seen = _key_blocks_seen(qi, cfg)
  dq, dbias_rows = jax.lax.fori_loop(0, seen, body, (dq0, rows0))
  for h in range(cfg.heads):
    dq_ref[h] = (dq[h] * cfg.scale).astype(dq_ref.dtype)
  if dbias_ref is not None:
    if k_full:  # tiles above the causal diagonal were skipped: their gradient is 0

      def zero(ki, carry):  # the loop carry is unused; returning it keeps its type
        cols = pl.ds(ki * cfg.k_block, cfg.k_block)
        for h in range(n_bias_heads):
          dbias_ref[h, :, cols] = jnp.zeros((cfg.q_block, cfg.k_block), dbias_ref.dtype)
        return carry

      jax.lax.fori_loop(seen, cfg.k_blocks, zero, 0)
    else:
      for h in range(n_bias_heads):
        dbias_ref[h] = dbias_rows[h].astype(dbias_ref.dtype)


def _dkv_kernel(*refs, cfg: Config):
  """Refs: q ``[H, Q, D]``, k ``[H, bk, D]``, v ``[H, bk, d_v]``, bias/mask ``[H', Q'|1, bk|1]``,
  dout ``[H, Q, d_v]``; out dk ``[H, bk, D]``, dv ``[H, bk, d_v]`` and, when the bias is shared
  by the queries, its query-summed gradient ``[H', 1, bk]``."""
  q_ref, k_ref, v_ref, bias_ref, mask_ref, (dout_ref,), outs = _split_refs(refs, cfg, 1)
  dk_ref, dv_ref = outs[:2]
  dbias_ref = outs[2] if len(outs) > 2 else None
  ki = pl.program_id(1)
  cols = slice(None)
  ks, vs = _load_heads(k_ref, cols, cfg), _load_heads(v_ref, cols, cfg)

  def body(qi, carry):
    dk, dv, dbias_cols = carry
    rows = pl.ds(qi * cfg.q_block, cfg.q_block)
    qs = _load_heads(q_ref, rows, cfg)
    douts = [_f32(x) for x in _load_heads(dout_ref, rows, cfg)]
    valids = _validity(qi, ki, mask_ref, rows, cols, cfg)
    t = _tile(qs, ks, vs, _biases(bias_ref, rows, cols, cfg), valids, cfg)
    ds, dv_tile = _tile_ds(t, vs, douts, valids, cfg, need_dv=True)
    dk = tuple(dk[h] + _dot(ds[h], _f32(qs[h]), (0, 0), cfg) for h in range(cfg.heads))
    dv = tuple(x + y for x, y in zip(dv, dv_tile))
    if dbias_ref is not None:
      parts = _bias_grad_tile(ds, cfg.bias_full, 0)
      dbias_cols = tuple(x + y for x, y in zip(dbias_cols, parts))
    return dk, dv, dbias_cols

  n_bias_heads = cfg.heads if cfg.bias_full is not None and cfg.bias_full[1] else 1
  init = (
    tuple(jnp.zeros((cfg.k_block, k_ref.shape[-1]), C.F32) for _ in range(cfg.heads)),
    tuple(jnp.zeros((cfg.k_block, v_ref.shape[-1]), C.F32) for _ in range(cfg.heads)),
    tuple(jnp.zeros((1, cfg.k_block), C.F32) for _ in range(n_bias_heads)),
  )
  dk, dv, dbias_cols = jax.lax.fori_loop(_first_query_block(ki, cfg), cfg.q_blocks, body, init)
  for h in range(cfg.heads):
    dk_ref[h] = (dk[h] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[h] = dv[h].astype(dv_ref.dtype)
  if dbias_ref is not None:
    for h in range(n_bias_heads):
      dbias_ref[h] = dbias_cols[h].astype(dbias_ref.dtype)


# --- pallas_call wrappers ------------------------------------------------------------------------


def _logit_spec(x, full, q_tiled: bool, cfg: Config):
  """BlockSpec of a ``[B', H', Q', K']`` mask or bias for a grid ``(B, tiles)``: the query tile
  (``q_tiled``) or the key tile of the program along each full axis, everything else whole."""
  _, heads, q_size, k_size = x.shape
  q_part = cfg.q_block if q_tiled and full[2] else q_size
  k_part = cfg.k_block if not q_tiled and full[3] else k_size

  def index(b, t):
    return (
      b if full[0] else 0,
      0,
      t if q_tiled and full[2] else 0,
      t if not q_tiled and full[3] else 0,
    )

  return pl.BlockSpec((None, heads, q_part, k_part), index)


def _heads_spec(x, block):
  """BlockSpec of ``[B, H, L, F]``: tile ``block`` of the length (None: whole) of example b."""
  _, heads, length, features = x.shape
  if block is None:
    return pl.BlockSpec((None, heads, length, features), lambda b, t: (b, 0, 0, 0))
  return pl.BlockSpec((None, heads, block, features), lambda b, t: (b, 0, t, 0))


def _call(kernel, grid, in_specs, out_specs, out_shape, cfg: Config, name: str):
  return pl.pallas_call(
    functools.partial(kernel, cfg=cfg),
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    interpret=cfg.interpret,
    name=name,
    # Triton parameters also select the Triton backend on a GPU (without them this JAX lowers
    # to Mosaic GPU, which this kernel cannot use: see the module docstring). Interpret mode
    # ignores them.
    compiler_params=pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
  )


def _inputs_and_specs(q, k, v, bias, mask, cfg: Config, q_tiled: bool):
  args = [q, k, v] + [x for x in (bias, mask) if x is not None]
  specs = [
    _heads_spec(q, cfg.q_block if q_tiled else None),
    _heads_spec(k, None if q_tiled else cfg.k_block),
    _heads_spec(v, None if q_tiled else cfg.k_block),
  ]
  if bias is not None:
    specs.append(_logit_spec(bias, cfg.bias_full, q_tiled, cfg))
  if mask is not None:
    specs.append(_logit_spec(mask, cfg.mask_full, q_tiled, cfg))
  return args, specs


def forward(q, k, v, bias, mask, cfg: Config):
  """Float32 ``out [B, H, Q, d_v]`` of heads-major padded inputs (shapes of :func:`make_pallas`)."""
  batch, heads, q_pad, _ = q.shape
  args, specs = _inputs_and_specs(q, k, v, bias, mask, cfg, q_tiled=True)
  out_shape = jax.ShapeDtypeStruct((batch, heads, q_pad, v.shape[-1]), C.F32)
  out_spec = pl.BlockSpec((None, heads, cfg.q_block, v.shape[-1]), lambda b, t: (b, 0, t, 0))
  return _call(
    _forward_kernel, (batch, cfg.q_blocks), specs, out_spec, out_shape, cfg, "hyla_forward"
  )(*args)


def backward(q, k, v, bias, mask, dout, cfg: Config):
  """Float32 ``(dq, dk, dv, dbias)``; ``dbias`` per example, ``[B, H', Q', K']``, or None."""
  batch, heads, q_pad, d = q.shape
  k_pad, d_v = k.shape[2], v.shape[-1]
  dout = dout.astype(C.F32)
  bias_heads = None if bias is None else bias.shape[1]
  q_bias = bias is not None and cfg.bias_full[2]  # the dq pass writes the bias gradient
  k_bias = bias is not None and not cfg.bias_full[2]  # the dk/dv pass sums it over queries

  args, specs = _inputs_and_specs(q, k, v, bias, mask, cfg, q_tiled=True)
  out_shape = [jax.ShapeDtypeStruct(q.shape, C.F32)]
  out_specs = [pl.BlockSpec((None, heads, cfg.q_block, d), lambda b, t: (b, 0, t, 0))]
  if q_bias:
    k_size = bias.shape[3]
    out_shape.append(jax.ShapeDtypeStruct((batch, bias_heads, q_pad, k_size), C.F32))
    out_specs.append(
      pl.BlockSpec((None, bias_heads, cfg.q_block, k_size), lambda b, t: (b, 0, t, 0))
    )
  dq_out = _call(
    _dq_kernel,
    (batch, cfg.q_blocks),
    specs + [_heads_spec(dout, cfg.q_block)],
    out_specs,
    out_shape,
    cfg,
    "hyla_backward_dq",
  )(*args, dout)
  dq, dbias = dq_out[0], (dq_out[1] if q_bias else None)

  args, specs = _inputs_and_specs(q, k, v, bias, mask, cfg, q_tiled=False)
  out_shape = [jax.ShapeDtypeStruct(k.shape, C.F32), jax.ShapeDtypeStruct(v.shape, C.F32)]
  out_specs = [
    pl.BlockSpec((None, heads, cfg.k_block, d), lambda b, t: (b, 0, t, 0)),
    pl.BlockSpec((None, heads, cfg.k_block, d_v), lambda b, t: (b, 0, t, 0)),
  ]
  if k_bias:
    out_shape.append(jax.ShapeDtypeStruct((batch, bias_heads, 1, k_pad), C.F32))
    out_specs.append(pl.BlockSpec((None, bias_heads, 1, cfg.k_block), lambda b, t: (b, 0, 0, t)))
  dkv_out = _call(
    _dkv_kernel,
    (batch, cfg.k_blocks),
    specs + [_heads_spec(dout, None)],
    out_specs,
    out_shape,
    cfg,
    "hyla_backward_dkv",
  )(*args, dout)
  dk, dv = dkv_out[:2]
  if k_bias:
    dbias = dkv_out[2]
    if not cfg.bias_full[3]:  # the bias is shared by the keys too
      dbias = jnp.sum(dbias, axis=3, keepdims=True)
  return dq, dk, dv, dbias


def make_pallas(cfg: Config):
  """``(q, k, v, bias, mask) -> out`` with a Pallas VJP.

  Shapes: q ``[B, H, Q, D]``, k ``[B, H, K, D]``, v ``[B, H, K, d_v]`` (Q, K multiples of the
  tiles), bias ``[B', H', Q', K']`` or None, mask int8 of that kind or None (each primed axis 1
  or full, padded with the lengths). Returns float32 ``[B, H, Q, d_v]``. The residuals are the
  inputs only; the mask gets no gradient.
  """

  return hb.recomputing_vjp(
    functools.partial(forward, cfg=cfg), functools.partial(backward, cfg=cfg)
  )


# --- Entry point ---------------------------------------------------------------------------------


def _pad_last(x, size: int):
  return (
    x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])
  )


def hyla_pallas_attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  block_size: int = DEFAULT_BLOCK_SIZE,
  is_causal: bool = False,
  causal_alignment: str = "top_left",
  normalization: str = "rms_head",
  value_network: str = "mlp_relu",
  scale: float | None = None,
  dtype=None,
  precision=None,
  interpret: bool | None = None,
  num_warps: int = DEFAULT_NUM_WARPS,
  num_stages: int = DEFAULT_NUM_STAGES,
):
  """HYLA as fused Pallas kernels; equals ``hyla_blockwise.hyla_blockwise_attention``.

  Args:
    query: ``[batch..., q_len, heads, d_qk]``. key: ``[batch..., kv_len, heads, d_qk]``.
    value: ``[batch..., kv_len, heads, d_v]``.
    bias: additive, broadcastable to ``[batch..., heads, q_len, kv_len]`` (kept at its own size).
    mask: any dtype, broadcastable like ``bias``; nonzero = may attend.
    block_size: query and key tile (clipped to the lengths, and on a GPU rounded up to a power
      of two); ragged lengths are padded and the padding masked.
    is_causal, causal_alignment, normalization (``'rms_head'`` | ``'none'``), value_network
      (``'mlp_relu'`` | ``'mlp_linear'`` | ``'linear'``), scale, dtype, precision: as in
      ``hyla_attention``.
    interpret: run the kernels in Pallas interpret mode; None: when the backend is not a GPU.
    num_warps, num_stages: Triton's warps per program and software-pipelining stages (GPU only;
      ignored in interpret mode).

  Returns:
    ``[batch..., q_len, heads, d_v]`` in ``dtype`` (default ``query.dtype``).

  Raises:
    ValueError: bad shapes (naming them), grouped key/value heads, an unsupported
      ``normalization``/``value_network``, or a ``block_size``, ``num_warps`` or
      ``num_stages`` that is not a positive int.
  """
  shapes = hb.check_tiled_call(
    "hyla_pallas_attention",
    query,
    key,
    value,
    normalization,
    value_network,
    block_size,
    normalization_note=" (softmax needs per-key running statistics: use the dense path)",
  )
  for name, count in (("num_warps", num_warps), ("num_stages", num_stages)):
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
      raise ValueError(f"{name} must be a positive int; got {name}={count!r}")
  interpret = C.interpret_off_gpu() if interpret is None else bool(interpret)
  offset = C.causal_offset(causal_alignment, shapes.q_len, shapes.kv_len)

  def tile(length):
    size = min(block_size, length)
    # Triton tiles are powers of two (and dots at least 16 wide); interpret mode takes any size.
    return size if interpret else max(16, C.next_power_of_two(size))

  q_block, k_block = tile(shapes.q_len), tile(shapes.kv_len)
  q_pad, k_pad = hb._round_up(shapes.q_len, q_block), hb._round_up(shapes.kv_len, k_block)
  mask = hb.reduced_broadcast(C.as_bool_mask(mask), "mask", shapes)
  bias = hb.reduced_broadcast(bias, "bias", shapes)
  cfg = Config(
    scale=C.default_scale(shapes.d_qk) if scale is None else scale,
    normalization=normalization,
    value_network=value_network,
    heads=shapes.heads,
    q_block=q_block,
    k_block=k_block,
    q_len=shapes.q_len,
    kv_len=shapes.kv_len,
    q_blocks=q_pad // q_block,
    k_blocks=k_pad // k_block,
    causal_offset=offset if is_causal else None,
    precision=precision,
    bias_full=None if bias is None else tuple(n > 1 for n in bias.shape),
    mask_full=None if mask is None else tuple(n > 1 for n in mask.shape),
    interpret=interpret,
    num_warps=num_warps,
    num_stages=num_stages,
  )
  minimum = 1 if interpret else 16
  d_pad = max(minimum, C.next_power_of_two(shapes.d_qk))
  d_v_pad = max(minimum, C.next_power_of_two(shapes.d_v))
  q, k, v = (C.to_heads_major(x) for x in (query, key, value))
  # Zero features change no product; zero-padded lengths are masked by index.
  q, k = _pad_last(hb.pad_axis(q, 2, q_pad), d_pad), _pad_last(hb.pad_axis(k, 2, k_pad), d_pad)
  v = _pad_last(hb.pad_axis(v, 2, k_pad), d_v_pad)
  if mask is not None:
    mask = hb.pad_axis(hb.pad_axis(mask, 2, q_pad, False), 3, k_pad, False).astype(jnp.int8)
  bias = hb.pad_axis(hb.pad_axis(bias, 2, q_pad), 3, k_pad)
  out = make_pallas(cfg)(q, k, v, bias, mask)[:, :, : shapes.q_len, : shapes.d_v]
  return C.finish(
    out, None, shapes=shapes, dtype=C.output_dtype(query, dtype), module=None, return_weights=False
  )
