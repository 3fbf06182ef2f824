"""HYLA, hypernetwork linear attention (docs/maths.md §3.7).

For one example, with heads ``h``, queries ``i`` and keys ``j``::

  s_hij = (q_hi / √D) · k_hj + bias_hij          (0 where masked)
  a_hij = normalise(s)_hij                       (rms_head | softmax | none)
  u_ij  = value_network(Σ_h a_hij v_hj) ∈ R^{D_v} (relu | identity)
  out_hi = Σ_j a_hij u_ij                        (value_network='linear': Σ_j a_hij v_hj)

The attention scores act as the latent code of a per-(i, j) two-layer value network whose weights
are shared by every head, so the heads talk to each other through ``u``. There are no parameters
beyond those of softmax attention.

Memory: the two MLP value networks hold ``u`` of shape ``[B, q_len, kv_len, D_v]``. With
``query_chunk_size=c`` they run over query blocks with ``jax.lax.map``, so only
``[B, c, kv_len, D_v]`` of it exists at a time (the scores ``a`` of shape ``[B, H, q_len, kv_len]``
are still computed in full: they are returned, sown and dropped out exactly like softmax weights,
which keeps chunked and unchunked results identical, dropout included).
The blockwise path (:mod:`hyla_blockwise`) tiles queries and keys and never stores ``u`` nor the
scores (forward and backward memory linear in the length); it covers rms_head/none × every value
network, masks, bias and causal, but not softmax normalisation, active dropout, or returned or
sown weights. ``block_size`` picks the path: ``'auto'`` (default) goes blockwise, with tiles of
``AUTO_BLOCK_SIZE``, when the call allows it and there are at least ``AUTO_BLOCKWISE_MIN_PAIRS``
query-key pairs per example (``q_len·kv_len``: past it the dense ``[B, q_len, kv_len, D_v]``
tensor costs more time than the tiles, on CPU as measured), and dense otherwise (sRAVEN's and the
fuzzy-logic task's short sequences stay dense); an int is blockwise with that tile (ValueError
when the call does not allow it); None is dense.

``implementation`` picks how tiles run: ``'auto'`` (default) and ``'xla'`` run the XLA blockwise
path on every backend (GPU included: the fused kernel has no measured GPU speed-up yet, see
``AUTO_PALLAS_BACKENDS``); ``'pallas'`` runs the fused Pallas kernel (:mod:`hyla_pallas`: forward,
dq and dk/dv Triton kernels; tiles of an int ``block_size``, ``hyla_pallas.DEFAULT_BLOCK_SIZE``
for ``'auto'``; Pallas interpret mode off GPU; ValueError for a call the tiled paths cannot
serve). The Pallas kernel computes the blockwise function, with the same memory (nothing
``[q_len, kv_len]``-sized).
``'tensorcore'`` runs the fused Triton kernels of :mod:`hyla_tensorcore` (head-coupled
products on matrix units; Triton's interpreter off GPU; needs the ``gpu-dev`` extra), only when
asked for.

Numerics: scores, normalisation, value-network activations and accumulators are float32; the
value network's operands are rounded to the value dtype. On CPU, narrower einsum operands are
upcast to float32 after that rounding (XLA:CPU has no bfloat16 × bfloat16 -> float32 dot), which
gives the same products. ``precision`` goes to every einsum of the dense and blockwise paths and
to every matrix product of the Pallas kernel (whose MLP value network uses exact float32
elementwise products instead, see :mod:`hyla_pallas`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import driver, hyla_blockwise, hyla_pallas

RMS_EPS = hyla_blockwise.RMS_EPS  # one constant for the dense and the blockwise paths


def _operands(*xs):
  """The einsum operands, upcast to float32 on CPU when narrower (XLA:CPU has no bfloat16 dot
  with a float32 result; the products of the rounded values are exact in float32, so the result
  is that of a bfloat16 × bfloat16 -> float32 dot). Unchanged on other backends."""
  if jax.default_backend() != "cpu" or all(x.dtype == C.F32 for x in xs):
    return xs
  return tuple(x.astype(C.F32) for x in xs)


def hyla_scores(q, k, bias, mask, *, scale: float, precision=None):
  """Raw scores of every head, zero where masked.

  Args:
    q: ``[B, q_len, H, d_qk]``. k: ``[B, kv_len, H, d_qk]`` (Flax's layout, batch flattened:
      batched einsums in this layout are what XLA runs fastest, no heads-major copies).
    bias: ``[B, H, q_len, kv_len]`` additive or None. mask: bool, the same shape, or None.
    scale: multiplies ``qᵀk`` (``1/√d_qk`` by default).

  Returns:
    float32 ``[B, H, q_len, kv_len]``.
  """
  q, k = _operands(q, k)
  scores = (
    jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision, preferred_element_type=C.F32) * scale
  )
  if bias is not None:
    scores = scores + bias.astype(C.F32)
  if mask is not None:
    scores = jnp.where(mask, scores, 0.0)
  return scores


# --- Normalisations: float32 scores [B, H, q, kv] (masked entries 0), mask or None -> a. ---------


def rms_head_normalization(scores, mask):
  """``a_hij = s_hij / √(mean_h s_hij² + 1e-6)``: RMS over the head axis, no learned scale.

  The mean runs over every head, masked ones included (their score is 0), as in docs/maths.md §3.7.
  """
  del mask  # Masked scores are already 0 and stay 0.
  mean_square = jnp.mean(jnp.square(scores), axis=1, keepdims=True)
  return scores * jax.lax.rsqrt(mean_square + RMS_EPS)


def softmax_normalization(scores, mask):
  """Standard per-head softmax over the keys, masked keys excluded (fully masked rows give 0)."""
  return C.masked_softmax(scores, mask)


def no_normalization(scores, mask):
  """``a = s`` (masked entries already 0)."""
  del mask
  return scores


NORMALIZATIONS: dict[str, Callable] = {
  "rms_head": rms_head_normalization,
  "softmax": softmax_normalization,
  "none": no_normalization,
}


# --- Value networks: a [B, H, q, kv] float32, v [B, kv, H, d_v] (Flax layout) -> [B, q, H, d_v]
# float32 (Flax layout again). Operands are cast to the value dtype and accumulated in float32 (like
# _common.contract_values); every batch and head is one einsum (the heads are coupled anyway).


def _mix_heads(a, v, precision):
  """``Σ_h a_hij v_hj`` -> ``[B, q, kv, d_v]`` float32."""
  a, v = _operands(a.astype(v.dtype), v)
  return jnp.einsum("bhqk,bkhd->bqkd", a, v, precision=precision, preferred_element_type=C.F32)


def _read_out(a, u, dtype, precision):
  """``out_hi = Σ_j a_hij u_ij`` -> ``[B, q, H, d_v]`` float32."""
  a, u = _operands(a.astype(dtype), u.astype(dtype))
  return jnp.einsum("bhqk,bqkd->bqhd", a, u, precision=precision, preferred_element_type=C.F32)


def mlp_relu_value_network(a, v, precision=None):
  """``u_ij = relu(Σ_h a_hij v_hj)``, ``out_hi = Σ_j a_hij u_ij``."""
  return _read_out(a, jax.nn.relu(_mix_heads(a, v, precision)), v.dtype, precision)


def mlp_linear_value_network(a, v, precision=None):
  """As ``mlp_relu`` without the relu (an ablation)."""
  return _read_out(a, _mix_heads(a, v, precision), v.dtype, precision)


def linear_value_network(a, v, precision=None):
  """``out_hi = Σ_j a_hij v_hj``: plain per-head attention with weights ``a``."""
  a, v = _operands(a.astype(v.dtype), v)
  return jnp.einsum("bhqk,bkhd->bqhd", a, v, precision=precision, preferred_element_type=C.F32)


VALUE_NETWORKS: dict[str, Callable] = {
  "mlp_relu": mlp_relu_value_network,
  "mlp_linear": mlp_linear_value_network,
  "linear": linear_value_network,
}


def _chunked_over_queries(fn: Callable, a, v, chunk: int):
  """Runs ``fn(a_block, v) -> [B, c, H, d_v]`` over query blocks of size ``chunk``.

  ``a`` is ``[B, H, q_len, kv]``; q_len is zero-padded to a multiple of ``chunk`` (padded rows have
  a = 0, hence output 0) and sliced off again. Returns ``[B, q_len, H, d_v]``.
  """
  batch, heads, q_len, kv_len = a.shape
  num_chunks = -(-q_len // chunk)
  a = jnp.pad(a, ((0, 0), (0, 0), (0, num_chunks * chunk - q_len), (0, 0)))
  blocks = jnp.moveaxis(a.reshape(batch, heads, num_chunks, chunk, kv_len), 2, 0)
  out = jax.lax.map(lambda block: fn(block, v), blocks)  # [chunks, B, c, H, d_v]
  out = jnp.moveaxis(out, 0, 1).reshape(batch, num_chunks * chunk, heads, -1)
  return out[:, :q_len]


# block_size='auto': blockwise from this many query-key pairs per example, with this tile size.
AUTO_BLOCKWISE_MIN_PAIRS = 128 * 128
AUTO_BLOCK_SIZE = 64


def blockwise_blockers(call: driver.AttentionCall, normalization: str) -> list[str]:
  """What keeps a ``hyla_attention`` call off the blockwise path (empty: it can run blockwise).

  Softmax normalises over keys (it would need running statistics), dropout and returned or sown
  weights need the whole ``[H, q_len, kv_len]`` weights.
  """
  return [
    reason
    for reason, present in (
      (f"normalization={normalization!r}", normalization not in hyla_blockwise.NORMALIZATIONS),
      ("dropout on the weights", call.dropout_active),
      ("sowing weights (module given)", call.module is not None),
      ("return_weights=True", call.return_weights),
    )
    if present
  ]


def blockwise_tile(call: driver.AttentionCall, normalization: str, block_size) -> int | None:
  """The tile size of the blockwise path for ``block_size`` (see the module docstring), or None
  for the dense path.

  Raises:
    ValueError: ``block_size`` not ``'auto'``, None or a positive int; an int for a call the
      blockwise path cannot serve.
  """
  if block_size is None:
    return None
  blockers = blockwise_blockers(call, normalization)
  if block_size == "auto":
    pairs = call.shapes.q_len * call.shapes.kv_len
    return AUTO_BLOCK_SIZE if pairs >= AUTO_BLOCKWISE_MIN_PAIRS and not blockers else None
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f"block_size must be 'auto', a positive int or None; got {block_size!r}")
  if blockers:
    raise ValueError(
      f"block_size={block_size} runs blockwise, which cannot serve this call "
      f"({', '.join(blockers)}); use block_size='auto' or None"
    )
  return block_size


IMPLEMENTATIONS = ("auto", "xla", "pallas", "tensorcore")

# Backends on which implementation='auto' runs the fused Pallas kernel where it would go
# blockwise. None yet: add "gpu" only once a committed GPU benchmark row shows the fused kernel
# faster (benchmarks/results/attention_gpu-<device>.json, row `hyla[implementation=pallas]` under
# the blockwise row `hyla[block_size=...]`, bfloat16, forward + backward), citing that figure here.
AUTO_PALLAS_BACKENDS: tuple[str, ...] = ()


def select_path(
  call: driver.AttentionCall, normalization: str, block_size, implementation: str
) -> tuple[str, int | None]:
  """``(path, tile)`` of a call: ``('dense', None)``, ``('blockwise', tile)`` or
  ``('pallas', tile)`` or ``('tensorcore', tile)`` (module docstring; tile None: the kernel's
  default).

  Raises:
    ValueError: an unknown ``implementation``, ``block_size`` errors of :func:`blockwise_tile`,
      ``implementation='pallas'`` with ``block_size=None`` or for a call it cannot serve.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be one of {list(IMPLEMENTATIONS)}; got implementation="
      f"{implementation!r}"
    )
  if implementation in ("pallas", "tensorcore"):
    blockers = blockwise_blockers(call, normalization)
    if block_size is None:
      raise ValueError(
        f"implementation={implementation!r} is tiled: block_size must be 'auto' or an int"
      )
    if blockers:
      raise ValueError(
        f"implementation={implementation!r} cannot serve this call ({', '.join(blockers)}); use "
        "implementation='auto' or 'xla'"
      )
    if block_size == "auto":  # the kernel's default tile (the Triton module is imported lazily)
      return implementation, hyla_pallas.DEFAULT_BLOCK_SIZE if implementation == "pallas" else None
    return implementation, blockwise_tile(call, normalization, block_size)
  tile = blockwise_tile(call, normalization, block_size)
  if tile is None:
    return "dense", None
  if implementation == block_size == "auto" and jax.default_backend() in AUTO_PALLAS_BACKENDS:
    return "pallas", hyla_pallas.DEFAULT_BLOCK_SIZE
  return "blockwise", tile


def _tensorcore_attention(*args, **kwargs):
  """:func:`hyla_tensorcore.hyla_tensorcore_attention`, imported on first use (it needs Triton,
  the ``gpu-dev`` extra)."""
  from primal_dual.kernels import hyla_tensorcore

  return hyla_tensorcore.hyla_tensorcore_attention(*args, **kwargs)


@driver.attention_kernel
def hyla_attention(
  call: driver.AttentionCall,
  *,
  normalization: str = "rms_head",
  value_network: str = "mlp_relu",
  query_chunk_size: int | None = None,
  scale: float | None = None,
  block_size: int | str | None = "auto",
  implementation: str = "auto",
):
  """HYLA attention (docs/maths.md §3.7).

  Scale: the value network sums over keys without dividing by their number (the scores are
  normalised across heads, not over keys), so the output grows about as √kv_len for unit-variance
  inputs: its RMS is 5.6, 12.1, 22.2 and 43.4 at 16, 64, 256 and 1024 keys (4 heads, d 16,
  standard normal q, k, v), while softmax's falls. The models follow it with a residual and a
  normalisation layer; a standalone use may rescale.

  Args:
    query, key, value, bias, mask and Flax's other ``attention_fn`` arguments: see
      :class:`driver.AttentionCall`.
    key, value: as many heads as the query (no grouped heads); d_v is shared by all heads (the
      value network sums over heads).
    bias, mask: on the scores ``s``; masked scores are 0, so a fully masked query gets a zero
      output (with finite gradients).
    broadcast_dropout, dropout_rng, dropout_rate, deterministic: applied once to the normalised
      scores ``a``; the dropped ``a`` is used both in the value network and in the read-out.
    module, return_weights: sow / return ``a`` (before dropout) as the weights.
    normalization: ``'rms_head'`` (default; ``s / √(mean_h s² + 1e-6)`` across heads),
      ``'softmax'`` (standard masked softmax over keys, per head) or ``'none'`` (``a = s``).
    value_network: ``'mlp_relu'`` (default), ``'mlp_linear'`` (no relu) or ``'linear'``
      (``Σ_j a_hij v_hj``).
    query_chunk_size: if set, run the value network over query blocks of this size (same result,
      ``[B, c, kv_len, d_v]`` peak memory for ``u``); q_len need not be a multiple of it.
    scale: score scale, default ``1/√d_qk``.
    block_size: ``'auto'`` (default: the blockwise path
      :func:`hyla_blockwise.hyla_blockwise_attention` over (query block × key block) tiles when
      the call allows it and ``q_len·kv_len >= AUTO_BLOCKWISE_MIN_PAIRS``, else dense), an int
      (blockwise with tiles of that size; ValueError for a call it cannot serve, see
      :func:`blockwise_blockers`) or None (dense). Both paths agree to float rounding; the
      blockwise one holds no ``[q_len, kv_len]``-sized tensor in the forward or backward pass.
    implementation: ``'auto'`` (default) and ``'xla'``: the XLA paths chosen by ``block_size``,
      on every backend (``AUTO_PALLAS_BACKENDS``); ``'pallas'``: the fused Pallas kernel
      :func:`hyla_pallas.hyla_pallas_attention`, with tiles of ``block_size``
      (``hyla_pallas.DEFAULT_BLOCK_SIZE`` for ``'auto'``; Pallas interpret mode off GPU;
      ValueError for a call it cannot serve or ``block_size=None``);
      ``'tensorcore'``: :func:`hyla_tensorcore.hyla_tensorcore_attention`, likewise, never chosen
      by ``'auto'``.

  Returns:
    ``[batch..., q_len, heads, d_v]`` in ``dtype`` (and ``a`` if requested).

  Raises:
    ValueError: bad shapes (naming them), grouped key/value heads (fewer than the query heads),
      unknown ``normalization``/``value_network``/``implementation``, a ``query_chunk_size``
      below 1, a bad ``block_size`` or an int one (or ``implementation='pallas'``) for a call
      only the dense path serves.
  """
  # Flax's value layout [..., kv_len, heads, d_v] gives every head the same d_v, which the
  # head sum of the value network needs; validate_qkv rejects any other head split of value.
  C.refuse_grouped_heads(
    call.shapes,
    "hyla_attention",
    "its value network sums the values over heads with per-head weights",
  )
  normalize = C.lookup(NORMALIZATIONS, normalization, "normalization")
  network = C.lookup(VALUE_NETWORKS, value_network, "value_network")
  if query_chunk_size is not None and (
    not isinstance(query_chunk_size, int) or query_chunk_size < 1
  ):
    raise ValueError(f"query_chunk_size must be a positive int or None; got {query_chunk_size!r}")
  path, tile = select_path(call, normalization, block_size, implementation)
  if path != "dense":
    tiled = {
      "blockwise": hyla_blockwise.hyla_blockwise_attention,
      "pallas": hyla_pallas.hyla_pallas_attention,
      "tensorcore": _tensorcore_attention,
    }[path]
    tile_option = {} if tile is None else {"block_size": tile}
    return tiled(
      call.query,
      call.key,
      call.value,
      call.bias,
      call.mask,
      **tile_option,
      is_causal=call.is_causal,
      causal_alignment=call.causal_alignment,
      normalization=normalization,
      value_network=value_network,
      scale=scale,
      dtype=call.dtype,
      precision=call.precision,
    )
  # A bias or mask shared by the examples or heads keeps size 1 there: the einsums broadcast it.
  mask, bias = call.mask_and_bias()
  scale = C.default_scale(call.shapes.d_qk) if scale is None else scale
  q, k, v = (x.reshape((-1, *x.shape[-3:])) for x in (call.query, call.key, call.value))

  weights = normalize(hyla_scores(q, k, bias, mask, scale=scale, precision=call.precision), mask)
  dropped = call.dropout(weights)
  run_network = functools.partial(network, precision=call.precision)
  if query_chunk_size is None:
    out = run_network(dropped, v)
  else:
    out = _chunked_over_queries(run_network, dropped, v, query_chunk_size)
  out = jnp.swapaxes(out, 1, 2)  # finish takes heads-major; XLA folds the two transposes
  return call.finish(out, weights)
