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

This module is the maths of every HYLA path and the dense one, :func:`dense_attention` (which
alone serves softmax normalisation, dropout and returned or sown weights); the tiled paths and
the choice between them are in the package's ``__init__``.

Numerics: scores, normalisation, value-network activations and accumulators are float32; the
value network's operands are rounded to the value dtype. On CPU, narrower einsum operands are
upcast to float32 after that rounding (XLA:CPU has no bfloat16 × bfloat16 -> float32 dot), which
gives the same products. ``precision`` goes to every einsum of the dense and blockwise paths.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import driver

RMS_EPS = 1e-6  # one constant for every path (blockwise.py imports it)


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


def dense_attention(
  call: driver.AttentionCall,
  *,
  normalization: str,
  value_network: str,
  query_chunk_size: int | None,
  scale: float | None,
):
  """The dense path of ``hyla_attention`` (arguments there, already validated): every
  ``[B, H, q_len, kv_len]`` score and, for the MLP value networks, ``u`` of shape
  ``[B, q_len, kv_len, d_v]`` (``[B, c, kv_len, d_v]`` at a time with ``query_chunk_size=c``)."""
  normalize = NORMALIZATIONS[normalization]
  network = VALUE_NETWORKS[value_network]
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
