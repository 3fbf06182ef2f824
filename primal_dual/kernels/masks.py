"""Boolean attention masks (True = may attend), broadcasting to ``[batch..., heads, q, k]``.

The kernels also take masks of any other dtype (nonzero = may attend), such as the float32 masks
of ``flax.linen.make_attention_mask``; :func:`combine_masks` does too and returns bool.

Sparse attention (docs/maths.md §3.3) fits each query's SVR on a subset of the keys; these masks say which.
They combine with every kernel through its ``mask`` argument; :func:`combine_masks` intersects or
unites them (the union of a local and a strided pattern is Child et al.'s fixed sparse pattern).
"""

from __future__ import annotations

import jax.numpy as jnp

from primal_dual.kernels import _common as C


def _check_positive(name: str, value: int) -> None:
  if int(value) != value or value < 1:
    raise ValueError(f"{name} must be a positive integer; got {name}={value!r}")


def _offsets(q_len: int, kv_len: int):
  """``i − j`` for every (query i, key j): int32 ``[q_len, kv_len]``."""
  return jnp.arange(q_len)[:, None] - jnp.arange(kv_len)[None, :]


def causal_mask(q_len: int, kv_len: int | None = None, *, alignment: str = "top_left"):
  """The mask of ``is_causal=True``: query ``i`` may attend to keys ``j <= i + offset``.

  ``alignment='top_left'`` (default, as Flax and ``jax.nn.dot_product_attention``): offset 0,
  query ``i`` sees keys ``j <= i``. ``'bottom_right'``: offset ``kv_len − q_len``, the queries are
  the last ``q_len`` positions of a longer key sequence and the last query sees every key. Both
  agree when ``kv_len = q_len`` (the default).

  Returns:
    bool ``[q_len, kv_len]``.
  """
  kv_len = q_len if kv_len is None else kv_len
  _check_positive("q_len", q_len)
  _check_positive("kv_len", kv_len)
  return _offsets(q_len, kv_len) >= -C.causal_offset(alignment, q_len, kv_len)


def padding_mask(key_valid, query_valid=None):
  """Mask from per-position validity.

  Args:
    key_valid: bool ``[batch..., kv_len]``.
    query_valid: bool ``[batch..., q_len]`` or None. Padded queries then attend to nothing and get
      zero outputs.

  Returns:
    bool ``[batch..., 1, 1, kv_len]`` (key-only, accepted by the primal forms) or, with
    ``query_valid``, ``[batch..., 1, q_len, kv_len]``.
  """
  key_valid = jnp.asarray(key_valid)
  if key_valid.dtype != jnp.bool_ or key_valid.ndim < 1:
    raise ValueError(
      f"key_valid must be a bool array [batch..., kv_len]; got dtype "
      f"{key_valid.dtype}, shape {tuple(key_valid.shape)}"
    )
  mask = key_valid[..., None, None, :]
  if query_valid is None:
    return mask
  query_valid = jnp.asarray(query_valid)
  if query_valid.dtype != jnp.bool_ or query_valid.shape[:-1] != key_valid.shape[:-1]:
    raise ValueError(
      f"query_valid must be a bool array [batch..., q_len] with the batch dimensions of "
      f"key_valid; got query_valid dtype {query_valid.dtype}, shape "
      f"{tuple(query_valid.shape)}, key_valid.shape={tuple(key_valid.shape)}"
    )
  return jnp.logical_and(mask, query_valid[..., None, :, None])


def local_mask(length: int, window: int, *, causal: bool = False):
  """Sliding-window mask of width ``window`` over a sequence of ``length`` positions.

  Non-causal: query ``i`` sees keys with ``|i − j| <= window // 2`` (``window`` keys for odd
  ``window``, ``window + 1`` for even). Causal: ``0 <= i − j < window`` (itself and the
  ``window − 1`` previous positions).

  Returns:
    bool ``[length, length]``.
  """
  _check_positive("length", length)
  _check_positive("window", window)
  offsets = _offsets(length, length)
  if causal:
    return (offsets >= 0) & (offsets < window)
  return jnp.abs(offsets) <= window // 2


def strided_mask(length: int, stride: int, *, causal: bool = False):
  """Strided mask of Child et al.: query ``i`` sees keys ``j`` with ``(i − j) mod stride == 0``.

  The local band is NOT included (apart from ``j = i``); the sparse-transformer pattern is
  ``combine_masks(local_mask(length, stride, causal=...), strided_mask(...), op='or')``.
  ``causal=True`` also requires ``j <= i``.

  Returns:
    bool ``[length, length]``.
  """
  _check_positive("length", length)
  _check_positive("stride", stride)
  offsets = _offsets(length, length)
  mask = offsets % stride == 0
  return mask & (offsets >= 0) if causal else mask


# op name -> elementwise combination of two bool arrays.
MASK_OPS = {"and": jnp.logical_and, "or": jnp.logical_or}


def combine_masks(*masks, op: str = "and"):
  """Intersection (``op='and'``) or union (``op='or'``) of broadcastable masks.

  Masks may have any dtype (nonzero = may attend, e.g. Flax's float32 masks). None entries are
  ignored; with no mask left the result is None.

  Returns:
    bool array of the broadcast shape, or None.
  """
  if op not in MASK_OPS:
    raise ValueError(f"op must be one of {sorted(MASK_OPS)}; got op={op!r}")
  present = [C.as_bool_mask(m) for m in masks if m is not None]
  if not present:
    return None
  shapes = [tuple(m.shape) for m in present]
  try:
    jnp.broadcast_shapes(*shapes)
  except ValueError:
    raise ValueError(f"masks do not broadcast together; got shapes {shapes}") from None
  combined = present[0]
  for m in present[1:]:
    combined = MASK_OPS[op](combined, m)
  return combined
