"""Shared machinery of every attention kernel.

Shapes follow Flax (docs/maths.md §1): ``query [batch..., q_len, heads, d_qk]``, ``key [batch..., kv_len,
kv_heads, d_qk]``, ``value [batch..., kv_len, kv_heads, d_v]``; ``mask`` (any dtype, nonzero = may
attend) and ``bias`` (additive) broadcast to ``[batch..., heads, q_len, kv_len]``.

Grouped key/value heads (GQA, MQA): ``kv_heads`` may be any divisor of ``heads``; query head ``h``
uses key/value head ``h // (heads // kv_heads)`` (Flax's grouping). :func:`repeat_kv_heads` repeats
the shared heads before the per-head maths, so every per-head statistic (Attention-BN's moments,
Attention-SH's pooling) is computed on the shared head.

Causal masks are top-left aligned by default, as in Flax and ``jax.nn.dot_product_attention``:
query ``i`` sees keys ``j <= i``. ``causal_alignment='bottom_right'`` aligns the ends instead
(``j <= i + kv_len - q_len``, the queries being the last ``q_len`` positions of the keys).

Kernels are written for ONE head (``q [q_len, d]``, ``k [kv_len, d]``, ``v [kv_len, d_v]``,
``bias/mask [q_len, kv_len]`` or None) and lifted to every head and example by :func:`map_heads`,
which applies ``jax.vmap`` twice (heads, then the flattened batch), sharing the arguments that
have size 1 on those axes. ``kernels.driver`` runs a whole call around that one-head maths.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
F32 = jnp.float32


class QKVShapes(NamedTuple):
  """Validated sizes of a query/key/value triple (``heads`` counts the query heads)."""

  batch_shape: tuple[int, ...]
  q_len: int
  kv_len: int
  heads: int
  d_qk: int
  d_v: int
  kv_heads: int

  @property
  def kv_groups(self) -> int:
    """Query heads per key/value head (1 without grouping)."""
    return self.heads // self.kv_heads


def next_power_of_two(n: int) -> int:
  """The smallest power of two ≥ ``n`` (1 for ``n`` ≤ 1): Triton's tile sizes."""
  return 1 << max(n - 1, 0).bit_length()


def interpret_off_gpu() -> bool:
  """Whether a Triton kernel must run in Triton's interpreter: unless the default backend is a
  GPU."""
  return jax.default_backend() != "gpu"


def _shape_str(**arrays: Any) -> str:
  return ", ".join(f"{name}.shape={tuple(x.shape)}" for name, x in arrays.items() if x is not None)


def validate_qkv(query: Array, key: Array, value: Array) -> QKVShapes:
  """Checks ranks, sizes and dtypes of ``query``, ``key`` and ``value``.

  The messages carry Flax's wording (``"q, k, v batch dims must match"``, ``"k, v lengths must
  match"``, ``"q, k depths must match"``, ``"must be multiple of"``) so that code and tests written
  against ``flax.linen``/``flax.nnx`` attention recognise them.

  Raises:
    ValueError: naming the offending argument and every shape seen: rank < 3 or ranks that
      differ, batch dimensions that differ, key/value heads that differ or do not divide the
      query heads, ``d_qk`` of query and key or ``kv_len`` of key and value that differ,
      ``kv_len == 0`` (no key to attend to), or a dtype that is not a real floating type
      (integers and bools would silently give integer outputs; complex numbers have no softmax
      order).
  """
  shapes = _shape_str(query=query, key=key, value=value)
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim < 3:
      raise ValueError(
        f"{name} must have rank >= 3 ([batch..., length, heads, features]); got {shapes}"
      )
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(f"q, k, v must have same rank; got {shapes}")
  if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
    raise ValueError(f"q, k, v batch dims must match; got {shapes}")
  kv_heads = key.shape[-2]
  if kv_heads != value.shape[-2]:
    raise ValueError(
      f"k, v num_heads must match (key and value must have the same number of heads); got {shapes}"
    )
  if kv_heads < 1 or query.shape[-2] % kv_heads:
    raise ValueError(
      f"query heads ({query.shape[-2]}) must be multiple of key/value heads ({kv_heads}) "
      "(grouped heads: the key/value heads must divide the number of query heads, which must "
      f"be a multiple of them); got {shapes}"
    )
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"q, k depths must match (feature size d_qk, axis -1); got {shapes}")
  if key.shape[-3] != value.shape[-3]:
    raise ValueError(f"k, v lengths must match (kv_len, axis -3); got {shapes}")
  if key.shape[-3] == 0:
    raise ValueError(f"attention needs at least one key (kv_len >= 1); got {shapes}")
  dtypes = {
    name: jnp.dtype(x.dtype) for name, x in (("query", query), ("key", key), ("value", value))
  }
  bad = {name: dtype for name, dtype in dtypes.items() if not jnp.issubdtype(dtype, jnp.floating)}
  if bad:
    raise ValueError(
      "query, key and value must be real floating-point arrays (cast integers with "
      ".astype(jnp.float32); complex inputs are not supported); got dtypes "
      + ", ".join(f"{name}={dtype}" for name, dtype in dtypes.items())
      + f" with {shapes}"
    )
  return QKVShapes(
    tuple(query.shape[:-3]),
    query.shape[-3],
    key.shape[-3],
    query.shape[-2],
    query.shape[-1],
    value.shape[-1],
    key.shape[-2],
  )


def repeat_kv_heads(key: Array, value: Array, shapes: QKVShapes) -> tuple[Array, Array]:
  """Repeats grouped key/value heads to one per query head (``h -> h // kv_groups``).

  A no-op without grouping. The repeat is materialised: memory of key and value grows by
  ``kv_groups``, the attention maths is that of ordinary multi-head attention.
  """
  if shapes.kv_groups == 1:
    return key, value
  return (jnp.repeat(key, shapes.kv_groups, axis=-2), jnp.repeat(value, shapes.kv_groups, axis=-2))


def refuse_grouped_heads(shapes: QKVShapes, kernel: str, reason: str) -> None:
  """Raises ValueError if the key/value heads are grouped (fewer than the query heads)."""
  if shapes.kv_groups != 1:
    raise ValueError(
      f"{kernel} does not support grouped key/value heads ({reason}); got "
      f"{shapes.heads} query heads and {shapes.kv_heads} key/value heads"
    )


def broadcast_logits_arg(x: Array | None, name: str, shapes: QKVShapes) -> Array | None:
  """A mask or bias as ``[B | 1, H | 1, q_len, kv_len]`` with the batch flattened.

  The batch and head axes keep size 1 where ``x`` broadcasts along them (a padding mask
  ``[batch, 1, 1, kv_len]`` becomes ``[B, 1, q_len, kv_len]``, a relative-position bias
  ``[heads, q, k]`` becomes ``[1, H, q, k]``): :func:`map_heads` and batched einsums share such
  axes instead of copying them.

  Returns None for None. Raises ValueError when ``x`` does not broadcast.
  """
  if x is None:
    return None
  target = (*shapes.batch_shape, shapes.heads, shapes.q_len, shapes.kv_len)
  x = jnp.asarray(x)
  extra = x.ndim - len(target)
  if extra > 0 and all(n == 1 for n in x.shape[:extra]):
    # Unbatched q/k/v ([len, heads, d]) with a batched 4-D mask [1, heads, q, kv], as
    # jax.nn.dot_product_attention and flax.nnx accept: size-1 leading axes carry nothing.
    x = x.reshape(x.shape[extra:])
  try:
    full = jnp.broadcast_shapes(x.shape, target)
  except ValueError:
    full = None
  if full != target:
    raise ValueError(
      f"{name} of shape {tuple(x.shape)} does not broadcast to [batch..., heads, q_len, kv_len]"
      f" = {target}"
    )
  x = with_rank(x, len(target))
  batch_axes = len(shapes.batch_shape)
  shared_batch = all(n == 1 for n in x.shape[:batch_axes])
  batch_shape = (1,) * batch_axes if shared_batch else shapes.batch_shape
  heads = x.shape[batch_axes]
  x = jnp.broadcast_to(x, (*batch_shape, heads, shapes.q_len, shapes.kv_len))
  return x.reshape((-1, heads, shapes.q_len, shapes.kv_len))


def with_rank(x: Array, rank: int) -> Array:
  """``x`` with leading axes of size 1 added up to ``rank`` (explicit NumPy broadcasting)."""
  return x.reshape((1,) * (rank - x.ndim) + x.shape)


# causal_alignment -> offset(q_len, kv_len): query i sees keys j <= i + offset.
CAUSAL_OFFSETS: dict[str, Callable[[int, int], int]] = {
  "top_left": lambda q_len, kv_len: 0,
  "bottom_right": lambda q_len, kv_len: kv_len - q_len,
}


def causal_offset(alignment: str, q_len: int, kv_len: int) -> int:
  """The diagonal of a causal mask: query ``i`` sees keys ``j <= i + offset``.

  ``'top_left'`` (Flax, ``jax.nn.dot_product_attention``): offset 0. ``'bottom_right'``: offset
  ``kv_len - q_len`` (the last query sees every key). Raises ValueError for other names.
  """
  if alignment not in CAUSAL_OFFSETS:
    raise ValueError(
      f"causal_alignment must be one of {sorted(CAUSAL_OFFSETS)}; got "
      f"causal_alignment={alignment!r}"
    )
  return CAUSAL_OFFSETS[alignment](q_len, kv_len)


def combine_causal(
  mask: Array | None, is_causal: bool, q_len: int, kv_len: int, alignment: str = "top_left"
) -> Array | None:
  """Adds a causal constraint (query i sees keys j <= i + causal_offset) to a bool ``mask``."""
  offset = causal_offset(alignment, q_len, kv_len)  # validates the name even when not causal
  if not is_causal:
    return mask
  causal = jnp.tril(jnp.ones((q_len, kv_len), bool), k=offset)
  if mask is None:
    return causal
  rank = max(mask.ndim, causal.ndim)
  return jnp.logical_and(with_rank(mask, rank), with_rank(causal, rank))


def as_bool_mask(mask) -> Array | None:
  """A mask of any dtype as bool: nonzero (True) = may attend. None stays None.

  Flax's ``make_attention_mask``/``make_causal_mask`` return float32 masks by default.
  """
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  return mask if mask.dtype == jnp.bool_ else mask != 0


def prepare_mask_and_bias(
  mask,
  bias,
  shapes: QKVShapes,
  is_causal: bool = False,
  causal_alignment: str = "top_left",
):
  """Validated ``(mask, bias)`` as ``[B | 1, H | 1, q_len, kv_len]`` arrays or None (see
  :func:`broadcast_logits_arg`).

  ``mask`` may have any dtype (nonzero = may attend); the result is bool.
  """
  mask = combine_causal(
    as_bool_mask(mask), is_causal, shapes.q_len, shapes.kv_len, causal_alignment
  )
  return (
    broadcast_logits_arg(mask, "mask", shapes),
    broadcast_logits_arg(bias, "bias", shapes),
  )


def to_heads_major(x: Array) -> Array:
  """``[batch..., L, H, D] -> [B, H, L, D]`` with the batch dimensions flattened."""
  x = x.reshape((-1, *x.shape[-3:]))
  return jnp.swapaxes(x, 1, 2)


def from_heads_major(x: Array, batch_shape: Sequence[int]) -> Array:
  """``[B, H, L, D] -> [batch..., L, H, D]``."""
  x = jnp.swapaxes(x, 1, 2)
  return x.reshape((*batch_shape, *x.shape[1:]))


def _head_axes(args: Sequence[Any], size: int) -> tuple[int | None, ...]:
  """vmap ``in_axes``: 0 for arrays of ``size`` on axis 0, None for None and shared arrays."""
  return tuple(0 if x is not None and x.shape[0] == size else None for x in args)


def _drop_shared_axis(args: Sequence[Any], size: int) -> tuple[Any, ...]:
  """Arrays shared along axis 0 (size 1 where others have ``size``) without that axis."""
  return tuple(x if x is None or x.shape[0] == size else x[0] for x in args)


def map_heads(per_head: Callable[..., Any], *args: Any) -> Any:
  """Applies a one-head function to every (example, head).

  Each argument is None or an array whose two leading axes are ``[B, H]``, either of which may
  be 1 where the others have more: that argument is then shared by every example (or head), not
  broadcast. ``per_head`` sees the arguments without those two axes; the result is ``[B, H, ...]``.
  """
  arrays = [x for x in args if x is not None]
  batch = max(x.shape[0] for x in arrays)
  heads = max(x.shape[1] for x in arrays)
  if any(
    x.ndim < 2 or x.shape[0] not in (1, batch) or x.shape[1] not in (1, heads) for x in arrays
  ):
    # vmap would otherwise refuse with a less legible error, or an axis of size 1 be mistaken
    # for a shared one while another argument disagrees.
    raise ValueError(
      f"map_heads needs arguments whose two leading axes are [B, H] with B={batch}, H={heads} "
      f"(or 1 where shared); got shapes {[tuple(x.shape) for x in arrays]}"
    )

  def over_heads(*example_args):
    return jax.vmap(per_head, in_axes=_head_axes(example_args, heads))(
      *_drop_shared_axis(example_args, heads)
    )

  return jax.vmap(over_heads, in_axes=_head_axes(args, batch))(*_drop_shared_axis(args, batch))


def masked_softmax(logits: Array, mask: Array | None) -> Array:
  """Softmax over the last axis in float32, masked entries excluded.

  A row with no valid entry returns zeros (never NaN), and its gradient is finite.
  """
  logits = logits.astype(F32)
  if mask is None:
    return jax.nn.softmax(logits, axis=-1)
  neg = jnp.finfo(F32).min
  logits = jnp.where(mask, logits, neg)
  logits = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  unnormalized = jnp.exp(logits) * mask
  total = jnp.sum(unnormalized, axis=-1, keepdims=True)
  return unnormalized / jnp.where(total > 0, total, 1.0)


def dropout_on(rate: float | Array, deterministic: bool) -> bool:
  """Whether dropout at ``rate`` acts: in training, at a rate other than a constant 0.

  A traced rate ``[]`` (replicas of a sweep set it apart inside one program) always acts; at 0 it
  keeps every entry (``uniform < 1``) and divides by 1, which is no dropout.
  """
  return not deterministic and (isinstance(rate, jax.Array) or rate != 0.0)


def apply_dropout(
  weights: Array,
  *,
  dropout_rng,
  dropout_rate: float | Array,
  broadcast_dropout: bool,
  deterministic: bool,
) -> Array:
  """Dropout on attention weights ``[B, H, q_len, kv_len]``, following Flax; ``dropout_rate`` a
  number or a traced float32 ``[]`` (see ``dropout_on``).

  With ``broadcast_dropout`` the same drop pattern is used for every example and head.
  """
  if not dropout_on(dropout_rate, deterministic):
    return weights
  if not isinstance(dropout_rate, jax.Array) and not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1); got {dropout_rate}")
  if dropout_rng is None:
    raise ValueError("dropout_rng is required when deterministic=False and dropout_rate > 0")
  keep_prob = 1.0 - dropout_rate
  shape = ((1, 1) + weights.shape[-2:]) if broadcast_dropout else weights.shape
  keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
  return jnp.where(keep, weights / keep_prob, 0.0).astype(weights.dtype)


def contract_values(weights: Array, value: Array, precision=None) -> Array:
  """``out[q, d] = Σ_k weights[q, k] value[k, d]`` for one head, accumulated in float32."""
  return jnp.einsum(
    "qk,kd->qd", weights.astype(value.dtype), value, precision=precision, preferred_element_type=F32
  )


def lookup(table: dict, name: str, argument: str):
  """``table[name]`` for a string option; ValueError naming ``argument`` and the choices."""
  if name not in table:
    raise ValueError(f"{argument} must be one of {sorted(table)}; got {argument}={name!r}")
  return table[name]


def output_dtype(query: Array, dtype) -> jnp.dtype:
  return jnp.dtype(dtype) if dtype is not None else query.dtype


def finish(
  out: Array,
  weights: Any,
  *,
  shapes: QKVShapes,
  dtype,
  module,
  return_weights: bool,
  weights_name: str = "attention_weights",
):
  """Restores ``[batch..., q_len, heads, d_v]``, casts, sows and optionally returns weights.

  ``out`` is ``[B, H, q_len, d_v]``; ``weights`` is a ``[B, H, q_len, kv]`` array or a tuple of
  such arrays (one per SH ratio group), reshaped back to the caller's batch dimensions.
  """
  out = from_heads_major(out, shapes.batch_shape).astype(dtype)
  if weights is not None:
    weights = jax.tree.map(lambda w: w.reshape((*shapes.batch_shape, *w.shape[1:])), weights)
  if module is not None and weights is not None:
    module.sow("intermediates", weights_name, weights)
  if return_weights:
    return out, weights
  return out


def default_scale(d_qk: int) -> float:
  return 1.0 / math.sqrt(d_qk)


def key_validity(mask: Array | None, kv_len: int) -> Array | None:
  """Per-key validity ``[kv_len]`` of a one-head mask ``[q_len, kv_len]``: visible to any query.

  For padding masks (the source of invalid keys) this is exactly the key padding; for causal or
  local masks every key is visible to some query, so all keys count.
  """
  if mask is None:
    return None
  return jnp.any(mask, axis=0)


def is_key_only_mask(mask, q_len: int) -> bool:
  """Whether ``mask`` (any dtype, or None) is the same for every query: None, of size 1 on the
  q_len axis (e.g. ``masks.padding_mask(key_valid)``), or a call with one query. Static (shapes
  only)."""
  return mask is None or q_len == 1 or jnp.ndim(mask) < 2 or jnp.shape(mask)[-2] == 1


def lengths_mask(query_lengths, key_lengths, shapes: QKVShapes) -> Array | None:
  """bool ``[batch..., 1, q_len | 1, kv_len]`` from per-example lengths (``jax.nn``'s
  ``query_seq_lengths``/``key_value_seq_lengths``, int ``[batch...]``): query ``i < query_lengths``
  and key ``j < key_lengths``. None when both are None; key-only (size 1 on q_len) without query
  lengths.

  Raises:
    ValueError: lengths of another shape than the batch dimensions.
  """
  parts = []
  # name, lengths, axis size, the new axes around it: [batch..., 1, q_len, 1] or [..., 1, 1, kv].
  for name, lengths, size, new_axes in (
    ("query_seq_lengths", query_lengths, shapes.q_len, (-3, -1)),
    ("key_value_seq_lengths", key_lengths, shapes.kv_len, (-3, -2)),
  ):
    if lengths is None:
      continue
    lengths = jnp.asarray(lengths)
    if tuple(lengths.shape) != shapes.batch_shape or not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(
        f"{name} must be an int array of the batch shape {shapes.batch_shape}; got "
        f"shape {tuple(lengths.shape)}, dtype {lengths.dtype}"
      )
    positions = with_rank(jnp.arange(size), lengths.ndim + 1)
    valid = positions < lengths[..., None]  # [batch..., size]
    parts.append(jnp.expand_dims(valid, new_axes))
  if not parts:
    return None
  return parts[0] if len(parts) == 1 else jnp.logical_and(*parts)
