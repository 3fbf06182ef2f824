"""Softmax attention: the SVR dual with the exponential kernel (docs/maths.md §3.1).

For one head, with queries ``i``, keys ``j`` and scale ``c`` (``1/√D``)::

  a_ij  = softmax_j(c q_i·k_j + bias_ij)         (masked keys excluded; no visible key: a_i = 0)
  out_i = Σ_j a_ij v_j

Without weights to return, sow or drop out, the product goes to ``jax.nn.dot_product_attention``
(``kernels.fused``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import driver, fused


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


@driver.attention_kernel
def softmax_attention(
  call: driver.AttentionCall, *, scale: float | None = None, implementation: str = "auto"
):
  """Softmax attention, ``out_i = Σ_j softmax_j(q_iᵀk_j/√D + bias_ij) v_j``.

  Args:
    query, key, value, bias, mask and Flax's other ``attention_fn`` arguments: see
      :class:`driver.AttentionCall`.
    scale: logits scale, default ``1/√d_qk``.
    implementation: ``'auto'`` (``jax.nn.dot_product_attention`` when the call needs no weights
      and no dropout on them, see ``kernels.fused``), ``'fused'`` (that path or a ValueError) or
      ``'reference'`` (this module's own maths).

  Returns:
    ``[batch..., q_len, heads, d_v]`` (and the weights if requested).
  """
  scale = C.default_scale(call.shapes.d_qk) if scale is None else scale
  if not call.takes_fused(implementation):
    return call.attend(
      functools.partial(softmax_weights_one_head, scale=scale, precision=call.precision)
    )
  # Lengths and a causal constraint alone go to jax.nn as such (cuDNN skips the masked blocks).
  mask, bias, masking = call.fused_masking()
  out = fused.attend(
    *call.heads_major(), bias, mask, scale=scale, dtype=call.compute_dtype, **masking
  )
  return call.finish(out)
