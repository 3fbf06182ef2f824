"""What the Linen and NNX layers share once their projections are made: head counts, the kernel
call and its Flax arguments.

Both layers expose the same settings under the same attribute names (``attention``,
``attention_options``, ``attention_context``, ``num_heads``, ``num_kv_heads``, ``is_causal``,
``dropout_rate``, ``broadcast_dropout``, ``dtype``, ``precision``), which is what lets one function
serve both.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax

from primal_dual import _decode
from primal_dual.registry import make_attention_fn


def head_dim(qkv_features: int, num_heads: int) -> int:
  """``qkv_features // num_heads``.

  Raises:
    ValueError: ``qkv_features`` is not divisible by ``num_heads``.
  """
  if qkv_features % num_heads:
    raise ValueError(
      f"qkv_features={qkv_features} is not divisible by num_heads="
      f"{num_heads}; choose a width that is a multiple of the head count"
    )
  return qkv_features // num_heads


def kv_heads(num_heads: int, num_kv_heads: int | None) -> int:
  """The key/value head count: ``num_kv_heads`` (grouped heads) or ``num_heads``.

  Raises:
    ValueError: ``num_kv_heads`` is not a positive divisor of ``num_heads``.
  """
  if num_kv_heads is None:
    return num_heads
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(
      f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (grouped key/value heads)"
    )
  return num_kv_heads


def attend(
  layer: Any,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  mask: jax.Array | None,
  bias: jax.Array | None,
  dropout_rng: jax.Array | None,
  sow_weights: bool,
  decoding: bool,
  kernel_params: Mapping[str, jax.Array],
  is_causal: bool | None = None,
  seq_lengths: Mapping[str, jax.Array | None] | None = None,
) -> jax.Array:
  """Runs ``layer``'s kernel on projected ``query [batch..., q_len, heads, d]`` and ``key/value
  [batch..., kv_len, kv_heads, d]``; returns ``[batch..., q_len, heads, d_v]``.

  ``is_causal`` (default ``layer.is_causal``) adds Flax's top-left causal mask, except while
  decoding, where the cache's mask of the keys seen so far is already causal (a one-row top-left
  mask would hide all but the first key). It is passed only when set, so kernels registered with
  Flax's plain ``attention_fn`` signature keep working. ``decoding`` with a variant whose registry
  entry says ``decodes=False`` raises ValueError. ``seq_lengths`` (``query_seq_lengths``,
  ``key_value_seq_lengths``, as ``jax.nn.dot_product_attention``) are passed when given. Dropout is on exactly when ``dropout_rng`` is given
  (the layers give one only when not deterministic and ``dropout_rate > 0``).
  """
  if decoding:
    _decode.check_variant_decodes(layer.attention)
  attention_fn = make_attention_fn(
    layer.attention, dict(layer.attention_options), dict(layer.attention_context)
  )
  is_causal = layer.is_causal if is_causal is None else is_causal
  causal = {"is_causal": True} if is_causal and not decoding else {}
  lengths = {name: x for name, x in (seq_lengths or {}).items() if x is not None}
  return attention_fn(
    query,
    key,
    value,
    bias=bias,
    mask=mask,
    dropout_rng=dropout_rng,
    dropout_rate=layer.dropout_rate,
    broadcast_dropout=layer.broadcast_dropout,
    deterministic=dropout_rng is None,
    dtype=layer.dtype,
    precision=layer.precision,
    module=layer if sow_weights else None,
    **causal,
    **lengths,
    **kernel_params,
  )
