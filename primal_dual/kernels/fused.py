"""The fused path of the softmax family: ``jax.nn.dot_product_attention``.

Softmax, Attention-BN (softmax kernel), Attention-SH and BN+SH all end in the same product,

  out_hi = Σ_j softmax_j(scale · q̃_hi·k̃_hj + bias_hij) ṽ_hj      (masked keys excluded)

on their own queries, keys and values (BN: normalised q and k; SH: each ratio group's pooled keys
and values). When a call needs neither the weights back (``return_weights``, sowing) nor dropout
on them, that product goes to ``jax.nn.dot_product_attention``, with ``implementation='cudnn'``
(fused flash attention, memory linear in the length) on NVIDIA GPUs where the dtype (bfloat16 or
float16), head size (≤ 128, a multiple of 8, the same for keys and values) and masking (none, or
only a top-left causal mask) allow, and XLA's implementation elsewhere. Otherwise, or with
``implementation='reference'``, the kernels take their own path (``_common`` + one-head maths);
the two agree within the dtype's rounding (tests). Rows with no visible key give zeros on both
paths (XLA's implementation alone would average every value there).

Two rules of the fused path, exactly:

* **Precision.** ``jax.nn.dot_product_attention`` takes no ``precision``. A call with a
  ``precision`` other than None or ``DEFAULT`` (``'highest'``, ``Precision.HIGH``, a tuple of
  them, an algorithm preset) therefore takes the reference path under ``'auto'``, whose einsums
  pass it on, and is refused (ValueError) under ``'fused'``.
* **Dtype.** The product runs in the promoted dtype of the call's query, key and value as given
  (``jnp.result_type``): q, k and v are cast to it. float32 inputs are never rounded; bfloat16
  inputs run in bfloat16 (which is what lets cuDNN take them), so Attention-BN's float32
  normalised q̂, k̂ are rounded to bfloat16 there (the reference path keeps them float32); a
  float32 query with bfloat16 keys and values runs in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common


IMPLEMENTATIONS = ("auto", "fused", "reference")
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def use_fused(
  implementation: str,
  *,
  return_weights: bool,
  module,
  dropout_rate: float,
  deterministic: bool,
  same_head_size: bool = True,
  softmax_kernel: bool = True,
  precision=None,
) -> bool:
  """Whether a call takes the fused path.

  Raises:
    ValueError: unknown ``implementation``, or ``'fused'`` for a call only the reference path can
      serve (weights returned or sown, dropout on the weights, key and value head sizes differ,
      a kernel other than softmax).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
  if implementation == "reference":
    return False
  blockers = [
    reason
    for reason, present in (
      ("return_weights=True", return_weights),
      ("sowing weights (module given)", module is not None),
      ("dropout on the weights", _common.dropout_on(dropout_rate, deterministic)),
      ("key and value head sizes differ", not same_head_size),
      ("kernel is not softmax", not softmax_kernel),
      (
        f"precision={precision!r} (jax.nn.dot_product_attention takes none)",
        not is_default_precision(precision),
      ),
    )
    if present
  ]
  if blockers and implementation == "fused":
    raise ValueError(
      f"implementation='fused' cannot serve this call ({', '.join(blockers)}); "
      "use implementation='auto' or 'reference'"
    )
  return not blockers


def is_default_precision(precision) -> bool:
  """Whether ``precision`` asks for nothing beyond the backend default (None or ``DEFAULT``,
  alone or in a tuple)."""
  values = precision if isinstance(precision, (tuple, list)) else (precision,)
  for value in values:
    if value is None:
      continue
    try:
      if jax.lax.Precision(value) != jax.lax.Precision.DEFAULT:
        return False
    except (ValueError, TypeError):  # an algorithm preset or an unknown name: not the default
      return False
  return True


def backend_implementation(query: jax.Array, *, head_size: int, masked: bool) -> str:
  """``'cudnn'`` where cuDNN's fused attention takes the call (see module docstring), else
  ``'xla'``."""
  if (
    jax.default_backend() == "gpu"
    and query.dtype in _CUDNN_DTYPES
    and head_size <= 128
    and head_size % 8 == 0
    and not masked
  ):
    return "cudnn"
  return "xla"


def attend(q, k, v, bias, mask, *, scale: float, is_causal: bool = False, dtype=None):
  """Softmax attention of heads-major arrays through ``jax.nn.dot_product_attention``.

  Args:
    q: ``[B, H, q_len, d]``; k: ``[B, H, kv_len, d]``; v: ``[B, H, kv_len, d]`` (same head size).
    bias: ``[B, H, q_len, kv_len]`` or None. mask: bool, the same shape, or None.
    scale: logits scale.
    is_causal: a top-left causal mask on top of ``mask`` (query i sees keys j ≤ i).
    dtype: the dtype the product runs in (q, k and v are cast to it); default ``v``'s. The
      kernels pass the call's promoted input dtype (module docstring, "Dtype").

  Returns:
    ``[B, H, q_len, d]`` in ``dtype``; rows with no visible key are 0.
  """
  dtype = v.dtype if dtype is None else dtype
  q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
  implementation = backend_implementation(
    q, head_size=q.shape[-1], masked=mask is not None or bias is not None
  )
  out = jax.nn.dot_product_attention(
    *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)),
    bias=bias,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    implementation=implementation,
  )
  out = jnp.swapaxes(out, 1, 2)
  if mask is not None:
    out = jnp.where(jnp.any(mask, axis=-1)[..., None], out, jnp.zeros((), out.dtype))
  return out
