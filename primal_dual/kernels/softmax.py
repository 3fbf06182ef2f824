"""Softmax attention: the SVR dual with the exponential kernel ``exp(qᵀk/√D)`` (docs/maths.md §3.1)."""

from __future__ import annotations

import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import fused


def softmax_weights_one_head(q, k, bias, mask, *, scale: float, precision=None):
  """Attention weights of one head.

  Args:
    q: ``[q_len, d_qk]``. k: ``[kv_len, d_qk]``.
    bias: ``[q_len, kv_len]`` additive or None. mask: ``[q_len, kv_len]`` bool or None.
    scale: multiplies ``qᵀk`` (``1/√d_qk`` by default in the kernels).

  Returns:
    float32 ``[q_len, kv_len]``; rows with no valid key are zero.
  """
  logits = jnp.einsum("qd,kd->qk", q, k, precision=precision, preferred_element_type=C.F32) * scale
  if bias is not None:
    logits = logits + bias.astype(C.F32)
  return C.masked_softmax(logits, mask)


def softmax_attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  broadcast_dropout: bool = True,
  dropout_rng=None,
  dropout_rate: float = 0.0,
  deterministic: bool = True,
  dtype=None,
  precision=None,
  module=None,
  is_causal: bool = False,
  causal_alignment: str = "top_left",
  scale: float | None = None,
  return_weights: bool = False,
  implementation: str = "auto",
):
  """Softmax attention, ``out_i = Σ_j softmax_j(q_iᵀk_j/√D + bias_ij) v_j``.

  Args:
    query: ``[batch..., q_len, heads, d_qk]``.
    key: ``[batch..., kv_len, kv_heads, d_qk]``; ``kv_heads`` divides ``heads`` (grouped heads:
      query head ``h`` uses key/value head ``h // (heads // kv_heads)``).
    value: ``[batch..., kv_len, kv_heads, d_v]``.
    bias: additive logits bias broadcastable to ``[batch..., heads, q_len, kv_len]``.
    mask: any dtype, broadcastable like ``bias``; nonzero = may attend. Fully masked rows give
      zeros.
    broadcast_dropout, dropout_rng, dropout_rate, deterministic: dropout on the weights (Flax).
    dtype: output dtype (default: ``query.dtype``). Softmax statistics are float32 regardless.
    precision: passed to the einsums.
    module: a Flax module to sow the weights into (``intermediates/attention_weights``).
    is_causal: add a causal mask, aligned by ``causal_alignment``.
    causal_alignment: ``'top_left'`` (default, as Flax: query ``i`` sees keys ``j <= i``) or
      ``'bottom_right'`` (``j <= i + kv_len - q_len``).
    scale: logits scale, default ``1/√d_qk``.
    return_weights: also return the float32 weights ``[batch..., heads, q_len, kv_len]``.
    implementation: ``'auto'`` (``jax.nn.dot_product_attention`` when the call needs no weights
      and no dropout on them, see ``kernels.fused``), ``'fused'`` (that path or a ValueError) or
      ``'reference'`` (this module's own maths).

  Returns:
    ``[batch..., q_len, heads, d_v]`` (and the weights if requested).
  """
  shapes = C.validate_qkv(query, key, value)
  key, value = C.repeat_kv_heads(key, value, shapes)
  scale = C.default_scale(shapes.d_qk) if scale is None else scale
  if fused.use_fused(
    implementation,
    return_weights=return_weights,
    module=module,
    dropout_rate=dropout_rate,
    deterministic=deterministic,
    same_head_size=shapes.d_qk == shapes.d_v,
  ):
    # A causal mask alone goes to jax.nn as is_causal (cuDNN skips the masked blocks).
    causal_apart = is_causal and mask is None and causal_alignment == "top_left"
    mask, bias = C.prepare_mask_and_bias(
      mask, bias, shapes, is_causal and not causal_apart, causal_alignment
    )
    out = fused.attend(
      *(C.to_heads_major(x) for x in (query, key, value)),
      bias,
      mask,
      scale=scale,
      is_causal=causal_apart,
    )
    return fused.finish(out, shapes=shapes, query=query, dtype=dtype)
  mask, bias = C.prepare_mask_and_bias(mask, bias, shapes, is_causal, causal_alignment)
  q, k, v = (C.to_heads_major(x) for x in (query, key, value))

  def weights_fn(q, k, bias, mask):
    return softmax_weights_one_head(q, k, bias, mask, scale=scale, precision=precision)

  return C.attend_with_weights(
    weights_fn,
    q,
    k,
    v,
    bias,
    mask,
    shapes=shapes,
    query=query,
    dtype=dtype,
    module=module,
    return_weights=return_weights,
    dropout_rng=dropout_rng,
    dropout_rate=dropout_rate,
    broadcast_dropout=broadcast_dropout,
    deterministic=deterministic,
    precision=precision,
  )
