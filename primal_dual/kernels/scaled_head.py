"""Attention-SH (scaled heads) and Attention-BN+SH (docs/maths.md §3.5, §3.6).

For head ``h`` with ratio ``r_h`` and key windows ``W_w`` of ``r_h`` keys (``r_h × r_h`` on a
grid), ``w`` running over the ``ceil(N / r_h)`` windows::

  k̃_hw = pool_{j ∈ W_w} k_hj,   ṽ_hw = pool_{j ∈ W_w} v_hj
  b̃_hiw = mean_{j ∈ W_w seen by i} bias_hij
  out_hi = Σ_w kernel(q_hi, k̃_h, b̃_hi)_w ṽ_hw

with BN+SH normalising ``q_h`` and ``k̃_h`` first, as Attention-BN does (``batchnorm.py``).

In the SVR view each head is a regression fitted on the keys; Attention-SH fits head ``h`` on fewer
training points: its keys and values are pooled along the key axis in windows of ``ratios[h]``
(stride = window), so head ``h`` attends to ``ceil(N / r_h)`` pooled keys. Queries and the output
length are unchanged. Attention cost relative to softmax: ``(1/H) Σ_h 1/r_h``
(:func:`attention_cost_ratio`).

The compute really shrinks: heads that share a ratio form a group (static, in Python), the group's
heads are static slices, pooled once and attended on the pooled length, and the group outputs go
back into the original head order by static slices. Pooling is padding and reshaping the key axis
into windows and reducing them (a broadcast in the backward): no gather, whose backward would be a
scatter-add. On the fused path keys and values are pooled side by side, and BN+SH's statistics of
one set per sequence are reductions over every head at once. In one launch without a mask, average
pooling is a single product for every head whatever its ratio (:func:`pool_every_head_at_once`):
no groups at all, each head's pooled keys a prefix of its rows, given to the launch as lengths.

Conventions (chosen here, where docs/maths.md is silent):

* **Validity.** A key is valid for a head if some query of that head may see it
  (``_common.key_validity``; for padding masks this is the padding). Pooling only uses valid keys;
  a window with no valid key is masked out.
* **Pooled mask.** Query ``i`` may see a pooled key iff it may see *every* valid key of the window
  (and the window has one): a pooled key mixes its keys' values, so this is what keeps a key the
  mask hides from query ``i`` out of query ``i``'s row (docs/maths.md, "Under masks"). Under a
  causal mask (``is_causal``, either alignment, or an explicit one) query ``i`` sees the windows
  whose last key it may see; the first ``r − 1`` queries of a top-left causal call see no pooled
  key of a head with ratio ``r`` and get zeros from it. Padding alone hides nothing valid.
* **BN+SH statistics.** One set per sequence without a causal constraint and with a mask the same
  for every query (as Attention-BN); otherwise each query's, over the pooled keys (or the keys,
  ``statistics='full'``) it may see.
* **Pooled bias.** The bias of a pooled key is the mean of ``bias_ij`` over the window's keys that
  query ``i`` may see (whatever the pool type); it is 0 (and masked) where none is visible.
* **Pool types.** ``avg``: mean of the valid keys; ``max``: channel-wise max of the valid keys;
  ``stride``: the first valid key of the window (the first key when nothing is masked). Keys and
  values are pooled the same way.
* **Images.** With ``grid_shape=(gh, gw)`` the keys after the first ``num_prefix_tokens`` (e.g.
  CLS) are a row-major ``gh × gw`` grid pooled in ``r × r`` windows (``ceil`` on each side,
  row-major window order); prefix tokens are never pooled and come first. ``num_prefix_tokens``
  also works without a grid (1-D pooling of the remaining keys).
* **Weights.** With ``return_weights=True`` the weights are a tuple with one float32 array per
  distinct ratio, in increasing ratio order, each ``[batch..., heads_in_group, q_len, pooled_len]``.
  :func:`head_groups` gives, for the same order, the head indices of each array's rows.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from primal_dual.kernels import _common as C
from primal_dual.kernels import batchnorm as bn_lib
from primal_dual.kernels import driver, fused
from primal_dual.kernels import linear as linear_lib


# ---------------------------------------------------------------------------------------------
# Ratios, groups and pooled lengths (static Python).
# ---------------------------------------------------------------------------------------------


def _is_static_int(r) -> bool:
  return isinstance(r, (int, np.integer)) and not isinstance(r, (bool, np.bool_))


def validate_ratios(ratios, heads: int) -> tuple[int, ...]:
  """Returns ``ratios`` as a tuple of Python ints, one per head, each >= 1.

  Raises:
    ValueError: naming ``ratios`` and the head count, when ``ratios`` is not a sequence of
      ``heads`` static ints >= 1.
  """
  if ratios is None:
    raise ValueError(
      f"ratios is required: one pooling ratio per head (heads={heads}), e.g. "
      f"ratios={(1,) * heads} (no pooling) or primal_dual.registry.default_ratios({heads}); in a "
      "layer pass attention_options={'ratios': ...}"
    )
  try:
    values = tuple(ratios)
  except TypeError:
    values = None
  if (
    values is None or len(values) != heads or not all(_is_static_int(r) and r >= 1 for r in values)
  ):
    raise ValueError(
      f"ratios must be a sequence of {heads} static Python ints >= 1, one per head "
      f"(heads={heads}); got ratios={ratios!r}"
    )
  return tuple(int(r) for r in values)


def head_groups(ratios: Sequence[int]) -> tuple[tuple[int, tuple[int, ...]], ...]:
  """``(ratio, head_indices)`` per distinct ratio, in increasing ratio order.

  This is the order of the weights tuple: row ``g`` of ``weights[n][..., g, :, :]`` belongs to
  head ``head_groups(ratios)[n][1][g]``.

  >>> head_groups((2, 1, 2, 4))
  ((1, (1,)), (2, (0, 2)), (4, (3,)))
  """
  return tuple((r, tuple(h for h, rh in enumerate(ratios) if rh == r)) for r in sorted(set(ratios)))


def attention_cost_ratio(ratios: Sequence[int]) -> float:
  """Attention cost relative to softmax attention: ``(1/H) Σ_h 1/r_h``."""
  return sum(1.0 / r for r in ratios) / len(ratios)


def pooled_length(
  kv_len: int, ratio: int, *, grid_shape: tuple[int, int] | None = None, num_prefix_tokens: int = 0
) -> int:
  """Number of keys a head with this ratio attends to.

  ``ceil(N / r)`` in 1-D without prefix; ``P + ceil(gh / r) * ceil(gw / r)`` on a grid.
  """
  return key_windows(kv_len, ratio, grid_shape, num_prefix_tokens).index.shape[0]


class KeyWindows(NamedTuple):
  """Static pooling windows over the key axis.

  Attributes:
    index: int32 ``[pooled_len, window]``, key index of each window slot (0 in padding slots).
    real: bool ``[pooled_len, window]``, False in padding slots (past the end of a row or grid).
  """

  index: np.ndarray
  real: np.ndarray


def _validate_layout(kv_len: int, grid_shape, num_prefix_tokens: int):
  if not _is_static_int(num_prefix_tokens) or not 0 <= num_prefix_tokens <= kv_len:
    raise ValueError(
      f"num_prefix_tokens must be an int in [0, kv_len={kv_len}]; got {num_prefix_tokens!r}"
    )
  if grid_shape is None:
    return
  if (
    len(grid_shape) != 2
    or not all(_is_static_int(s) and s >= 1 for s in grid_shape)
    or kv_len != num_prefix_tokens + grid_shape[0] * grid_shape[1]
  ):
    raise ValueError(
      "grid_shape must be two positive ints (gh, gw) with kv_len == num_prefix_tokens + gh*gw;"
      f" got grid_shape={grid_shape!r}, num_prefix_tokens={num_prefix_tokens}, kv_len={kv_len}"
    )


def _windows_1d(length: int, ratio: int):
  slots = np.arange(-(-length // ratio) * ratio).reshape(-1, ratio)
  return slots, slots < length


def _windows_2d(grid_shape: tuple[int, int], ratio: int):
  gh, gw = grid_shape
  ph, pw = -(-gh // ratio), -(-gw // ratio)
  rows = np.arange(ph * ratio)[:, None]
  cols = np.arange(pw * ratio)[None, :]
  slots = rows * gw + cols
  real = (rows < gh) & (cols < gw)

  def to_windows(x):  # [ph*r, pw*r] -> [ph*pw, r*r], row-major windows.
    x = x.reshape(ph, ratio, pw, ratio).transpose(0, 2, 1, 3)
    return x.reshape(ph * pw, ratio * ratio)

  return to_windows(slots), to_windows(real)


@functools.lru_cache(maxsize=256)
def key_windows(
  kv_len: int, ratio: int, grid_shape: tuple[int, int] | None = None, num_prefix_tokens: int = 0
) -> KeyWindows:
  """Pooling windows for one ratio: prefix tokens alone, then 1-D or 2-D windows of the rest."""
  _validate_layout(kv_len, grid_shape, num_prefix_tokens)
  if grid_shape is None:
    slots, real = _windows_1d(kv_len - num_prefix_tokens, ratio)
  else:
    slots, real = _windows_2d(tuple(grid_shape), ratio)
  slots = np.where(real, slots + num_prefix_tokens, 0)
  width = slots.shape[1]
  prefix_slots = np.zeros((num_prefix_tokens, width), np.int64)
  prefix_slots[:, 0] = np.arange(num_prefix_tokens)
  prefix_real = np.zeros((num_prefix_tokens, width), bool)
  prefix_real[:, 0] = True
  return KeyWindows(
    np.concatenate([prefix_slots, slots]).astype(np.int32), np.concatenate([prefix_real, real])
  )


def _refuse_ratios_above_length(ratios, kv_len: int, grid_shape, num_prefix_tokens: int) -> None:
  """Raises ValueError when a ratio > 1 exceeds the pooled axis (the keys after the prefix, or
  the longer grid side): it would pool everything into one window, like a ratio equal to the
  length, which is more likely a configuration slip (ratios meant for longer inputs)."""
  length = kv_len - num_prefix_tokens if grid_shape is None else max(grid_shape)
  too_long = [r for r in ratios if r > 1 and r > length]
  if too_long:
    axis = "keys after the prefix" if grid_shape is None else f"grid side of {tuple(grid_shape)}"
    raise ValueError(
      f"ratios {too_long} exceed the pooled length ({length} {axis}; kv_len={kv_len}, "
      f"num_prefix_tokens={num_prefix_tokens}); got ratios={ratios}"
    )


# ---------------------------------------------------------------------------------------------
# Pooling of one head: the windows by padding and reshaping (no gather; a broadcast backward).
# ---------------------------------------------------------------------------------------------


class WindowLayout(NamedTuple):
  """The static layout of one ratio's windows over the key axis (see :func:`key_windows`)."""

  kv_len: int
  ratio: int
  grid_shape: tuple[int, int] | None
  num_prefix_tokens: int

  @property
  def real(self) -> np.ndarray:
    """bool ``[pooled_len, window]``: False in padding slots."""
    return key_windows(*self).real


def _pad_axis(x, axis: int, size: int):
  """``x`` padded at the end of ``axis`` with zeros (False) to ``size``."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def to_windows(x, axis: int, layout: WindowLayout):
  """``x`` with its key axis ``axis`` (``kv_len``) split into ``[pooled_len, window]``: slot
  ``(w, s)`` holds ``x[..., index[w, s], ...]`` of :func:`key_windows`, padding slots 0 (False).

  Static slices, pads, reshapes and (on a grid) one transpose: no gather, so the gradient is
  their transposes (slices, reshapes, pads), never a scatter-add.
  """
  axis = axis % x.ndim
  kv_len, ratio, grid_shape, prefix = layout
  before, after = x.shape[:axis], x.shape[axis + 1 :]
  rest = jax.lax.slice_in_dim(x, prefix, kv_len, axis=axis) if prefix else x
  if grid_shape is None:
    count = -(-(kv_len - prefix) // ratio)
    rest = _pad_axis(rest, axis, count * ratio).reshape(*before, count, ratio, *after)
  else:
    (gh, gw), (ph, pw) = grid_shape, (-(-grid_shape[0] // ratio), -(-grid_shape[1] // ratio))
    rest = rest.reshape(*before, gh, gw, *after)
    rest = _pad_axis(_pad_axis(rest, axis, ph * ratio), axis + 1, pw * ratio)
    rest = rest.reshape(*before, ph, ratio, pw, ratio, *after)
    order = list(range(rest.ndim))
    order[axis + 1], order[axis + 2] = order[axis + 2], order[axis + 1]  # row-major windows
    rest = rest.transpose(order).reshape(*before, ph * pw, ratio * ratio, *after)
  if not prefix:
    return rest
  # Prefix tokens: a window each, of one real slot.
  head = jnp.expand_dims(jax.lax.slice_in_dim(x, 0, prefix, axis=axis), axis + 1)
  return jnp.concatenate([_pad_axis(head, axis + 1, rest.shape[axis + 1]), rest], axis=axis)


def _is_static(valid) -> bool:
  """Whether a validity is known when tracing (NumPy: the windows' padding alone)."""
  return isinstance(valid, np.ndarray)


def _masked_mean(x, valid):
  """x ``[n, w, d]``, valid ``[n, w]`` (NumPy when static) -> mean of the valid slots ``[n, d]``
  (0 if none)."""
  x32 = x.astype(C.F32)
  if _is_static(valid) and valid.all():
    return (jnp.sum(x32, axis=1) / valid.shape[1]).astype(x.dtype)
  total = jnp.sum(jnp.where(valid[..., None], x32, 0.0), axis=1)
  count = (np if _is_static(valid) else jnp).sum(valid, axis=1)[:, None]
  return (total / jnp.maximum(count, 1)).astype(x.dtype)


def _masked_max(x, valid):
  """Channel-wise max of the valid slots ``[n, d]`` (0 if none); exact in ``x``'s dtype."""
  if _is_static(valid) and valid.all():
    return jnp.max(x, axis=1)
  top = jnp.max(jnp.where(valid[..., None], x, -jnp.inf), axis=1)
  return jnp.where(jnp.any(valid, axis=1)[:, None], top, 0).astype(x.dtype)


def _first_valid(x, valid):
  """The first valid slot of each window ``[n, d]`` (slot 0 if none; such windows are masked)."""
  if _is_static(valid) and valid[:, 0].all():  # slot 0 of every window is real
    return x[:, 0]
  first = jnp.argmax(valid, axis=1)
  # A one-hot sum rather than take_along_axis: a select and a reduction, no gather (a scatter-add
  # backward); adding exact zeros leaves the picked slot as it is.
  pick = jnp.arange(x.shape[1])[None] == first[:, None]
  return jnp.sum(jnp.where(pick[..., None], x, jnp.zeros((), x.dtype)), axis=1).astype(x.dtype)


POOLS: dict[str, Callable] = {"avg": _masked_mean, "max": _masked_max, "stride": _first_valid}


class PooledKeys(NamedTuple):
  """One head's keys after pooling (``n`` = pooled length)."""

  key: jax.Array  # [n, d_qk], input dtype
  value: jax.Array | None  # [n, d_v], input dtype; None: ``key`` holds [keys | values]
  bias: jax.Array | None  # [q_len, n] float32
  mask: jax.Array | None  # [q_len, n] bool; None when the call has no mask (all visible)
  key_valid: jax.Array | None  # [n] bool, window holds a valid key; None: every one does


def pool_keys_one_head(
  k, v, bias, mask, key_valid, *, layout: WindowLayout, pool: Callable
) -> PooledKeys:
  """Pools one head's keys, values, bias and mask over the windows of ``layout``.

  Args:
    k: ``[kv_len, d_qk]``. v: ``[kv_len, d_v]``, or None when ``k`` holds keys and values side
      by side (``[kv_len, d_qk + d_v]``, pooled together; the value is then None).
    bias: ``[q_len, kv_len]`` or None. mask: ``[q_len, kv_len]`` bool or None.
    key_valid: bool ``[kv_len]``, keys that may be pooled; None: every key.
    layout: static windows (:class:`WindowLayout`).
    pool: an entry of :data:`POOLS`.
  """
  real = layout.real  # [n, w]
  # Without a mask the validity is the windows' padding, static: the pools then skip the selects.
  valid = real if key_valid is None else real & to_windows(key_valid, 0, layout)
  pooled_valid = None if key_valid is None else jnp.any(valid, axis=-1)
  if mask is None:
    visible = valid[None]  # [1, n, w]: every query sees every valid key.
    # Without a mask every key is valid and every window holds a real key, so every query sees
    # every pooled key: no pooled mask either, which leaves the fused path free to use cuDNN
    # (a mask, even all True, sends jax.nn.dot_product_attention to XLA's dense [q, n] path).
    pooled_mask = None
  else:
    visible = to_windows(mask, 1, layout) & real[None]  # [q_len, n, w]
    # A pooled key mixes the values of every valid key of its window: query i may see it only
    # when it may see all of them, else a hidden key would reach it (module docstring).
    sees_every_valid = jnp.all(visible | ~valid[None], axis=-1)
    pooled_mask = sees_every_valid
    if pooled_valid is not None:
      pooled_mask = pooled_mask & pooled_valid[None]
  pooled_bias = None
  if bias is not None:
    # Mean over the entries query i may see; 0 where it sees none (then masked anyway).
    windows = to_windows(bias.astype(C.F32), 1, layout)
    total = jnp.sum(jnp.where(visible, windows, 0.0), axis=-1)
    pooled_bias = total / jnp.maximum(jnp.sum(visible, axis=-1), 1)
  return PooledKeys(
    pool(to_windows(k, 0, layout), valid),
    None if v is None else pool(to_windows(v, 0, layout), valid),
    pooled_bias,
    pooled_mask,
    pooled_valid,
  )


# ---------------------------------------------------------------------------------------------
# One head of one ratio group.
# ---------------------------------------------------------------------------------------------

# statistics option of BN+SH -> (keys [kv_len, d], key_valid [kv_len], mask [q_len, kv_len] | None,
# PooledKeys) -> (the keys whose statistics normalise, their validity, which query sees which).
STATISTICS_SOURCES: dict[str, Callable] = {
  "pooled": lambda k, key_valid, mask, pooled: (pooled.key, pooled.key_valid, pooled.mask),
  "full": lambda k, key_valid, mask, pooled: (k, key_valid, mask),
}


class BatchNormOptions(NamedTuple):
  """Attention-BN after pooling (``batchnorm_attention``'s names for ε and β).

  ``per_query``: each query's statistics over the keys it may see (a causal or query-dependent
  mask, ``batchnorm.statistics_scope``), else one set per sequence over the valid keys.
  """

  statistics: str  # 'pooled' | 'full'
  eps: float
  mean_weight: float
  kernel: str  # a key of batchnorm.KERNELS
  per_query: bool


def key_statistics(k, key_valid, count=None):
  """``batchnorm.key_statistics`` over the key axis ``-2`` of ``k [..., n, d]``, by sums:
  ``(mean, var)`` float32 ``[..., 1, d]`` over the valid rows (``key_valid`` bool ``[..., n]`` of
  ``k``'s rank minus one, NumPy when static, or None: every row); ``0, 1`` with no valid row.
  ``count``: the valid rows ``[..., 1, 1]`` when known statically (NumPy), else None.

  Masked sums rather than products with 0/1 weights: reductions over every head at once that fuse
  with the pooling before them, where an einsum per head is a matrix-vector product of its own.
  """
  k = k.astype(C.F32)
  if key_valid is None:
    mean = jnp.mean(k, axis=-2, keepdims=True)
    return mean, jnp.mean(jnp.square(k - mean), axis=-2, keepdims=True)
  valid = key_valid[..., None]
  if count is None:
    count = (np if _is_static(valid) else jnp).sum(valid, axis=-2, keepdims=True, dtype=np.float32)
  safe_count = np.maximum(count, 1.0) if _is_static(count) else jnp.maximum(count, 1.0)
  mean = jnp.sum(jnp.where(valid, k, 0.0), axis=-2, keepdims=True) / safe_count
  var = jnp.sum(jnp.where(valid, jnp.square(k - mean), 0.0), axis=-2, keepdims=True) / safe_count
  if _is_static(count) and (count > 0).all():
    return mean, var
  return mean, jnp.where(count > 0, var, 1.0)


def _normalise(xs, mean, var, batchnorm: BatchNormOptions) -> list:
  """Each of ``xs`` as ``(x − β·mean)/√(var + ε)`` in float32
  (``batchnorm.normalize_with_key_stats``), any leading axes."""
  shift = mean if batchnorm.mean_weight == 1.0 else batchnorm.mean_weight * mean
  spread = jnp.sqrt(var + batchnorm.eps)
  return [(x.astype(C.F32) - shift) / spread for x in xs]


def _attention_inputs_one_head(
  q,
  k,
  v,
  bias,
  mask,
  *,
  layout: WindowLayout | None,
  pool: Callable,
  batchnorm: BatchNormOptions | None,
):
  """What one head of one group attends with: ``(q [q_len, d], PooledKeys)``.

  ``layout`` is None for ratio 1 (no pooling). With ``batchnorm``, q and the pooled keys are
  normalised with key statistics of the pooled keys (``statistics='pooled'``) or the full-length
  keys: one set per sequence (``per_query=False``), else each query's over the keys it may see.
  """
  key_valid = C.key_validity(mask, k.shape[0])  # None without a mask: every key
  if layout is None:
    pooled = PooledKeys(k, v, bias, mask, key_valid)
  else:
    pooled = pool_keys_one_head(k, v, bias, mask, key_valid, layout=layout, pool=pool)
  if batchnorm is None:
    return q, pooled
  keys, valid, visible = STATISTICS_SOURCES[batchnorm.statistics](k, key_valid, mask, pooled)
  if batchnorm.per_query:
    stats = bn_lib.masked_statistics(keys, visible)
    q, pooled_key = bn_lib.per_query_inputs(
      q,
      pooled.key,
      stats,
      kernel=batchnorm.kernel,
      eps=batchnorm.eps,
      mean_weight=batchnorm.mean_weight,
    )
    return q, pooled._replace(key=pooled_key)
  q, pooled_key = _normalise((q, pooled.key), *key_statistics(keys, valid), batchnorm)
  return q, pooled._replace(key=pooled_key)


def _one_head(q, k, v, bias, mask, *, inputs: Callable, kernel: Callable):
  """Weights ``[q_len, n]`` (float32) and values ``[n, d_v]`` of one head of one group."""
  q, pooled = inputs(q, k, v, bias, mask)
  return kernel(q, pooled.key, pooled.bias, pooled.mask), pooled.value


def _runs(heads: Sequence[int]) -> list[tuple[int, int]]:
  """``heads`` as ``[start, stop)`` runs of consecutive indices, in order."""
  runs = []
  for h in heads:
    if runs and runs[-1][1] == h:
      runs[-1] = (runs[-1][0], h + 1)
    else:
      runs.append((h, h + 1))
  return runs


def _take_heads(x, heads: Sequence[int], num_heads: int):
  """``x[:, heads]`` for ``[B, H, ...]`` arrays, as static slices (one per run of consecutive
  heads, concatenated): no gather, so no scatter-add in the backward. A no-op for None, arrays
  shared by the heads (size 1 on that axis) and when ``heads`` is every head in order."""
  if x is None or x.shape[1] != num_heads or tuple(heads) == tuple(range(num_heads)):
    return x
  parts = [jax.lax.slice_in_dim(x, start, stop, axis=1) for start, stop in _runs(heads)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _split_heads(x, groups, num_heads: int) -> list:
  """``x``'s heads of each group (:func:`_take_heads`); when the groups are consecutive runs in
  head order (e.g. ratios ``(1, 1, 2, 2, 4, 4)``), one ``jnp.split``, whose backward is a single
  concatenation rather than a pad and an add per group."""
  order = [h for _, heads in groups for h in heads]
  if x is None or x.shape[1] != num_heads or order != list(range(num_heads)):
    return [_take_heads(x, heads, num_heads) for _, heads in groups]
  if len(groups) == 1:
    return [x]
  return jnp.split(x, np.cumsum([len(heads) for _, heads in groups])[:-1].tolist(), axis=1)


def _pool_group(k, v, bias, mask, *, layout: WindowLayout | None, pool: Callable) -> PooledKeys:
  """One group's keys after pooling, ``[B, H_g, ...]`` arrays (:func:`pool_keys_one_head` on every
  head; ratio 1, ``layout`` None: the keys as they are)."""
  key_valid = None if mask is None else jnp.any(mask, axis=-2)  # _common.key_validity per head
  if layout is None:
    return PooledKeys(k, v, bias, mask, key_valid)
  one_head = functools.partial(pool_keys_one_head, layout=layout, pool=pool)
  return C.map_heads(one_head, k, v, bias, mask, key_valid)


def _pad_keys(x, length: int, axis: int, fill):
  """``x`` padded with ``fill`` to ``length`` along ``axis`` (the pooled-key axis)."""
  if x.shape[axis] == length:
    return x
  widths = [(0, 0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis], 0)
  return jax.lax.pad(x, jnp.asarray(fill, x.dtype), widths)


def _concatenate_heads(parts):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _stack_pairwise(queries, pooled, field: str, length: int, absent, padding):
  """The groups' pooled ``bias`` or ``mask`` (``field``), each ``[B, H_g, q_len, n_g]`` (``absent``
  where a group has none), padded with ``padding`` to ``length`` keys and concatenated along the
  heads; None when no group has one."""
  parts = [getattr(p, field) for p in pooled]
  if all(x is None for x in parts):
    return None
  padded = []
  for q, p, x in zip(queries, pooled, parts):
    shape = (*q.shape[:3], p.key.shape[2])
    x = jnp.full(shape, absent) if x is None else jnp.broadcast_to(x, shape)
    padded.append(_pad_keys(x, length, 3, padding))
  return _concatenate_heads(padded)


def _stacked_validity(pooled, length: int):
  """``(validity [B | 1, H, length], count)`` of the groups' pooled keys padded to ``length`` and
  stacked along the heads (False in the padding); ``count`` ``[1, H, 1, 1]`` (NumPy) where it is
  static (no mask), else None."""
  if all(p.key_valid is None for p in pooled):
    # No mask: head h's first n_h keys, as a comparison with an iota (no [H, length] constant).
    counts = np.concatenate([np.full(p.key.shape[1], p.key.shape[2]) for p in pooled])
    valid = jnp.arange(length)[None, None, :] < counts[None, :, None]
    return valid, counts.reshape(1, -1, 1, 1).astype(np.float32)
  parts = []
  for p in pooled:
    heads, n = p.key.shape[1:3]
    valid = np.ones((1, 1, n), bool) if p.key_valid is None else p.key_valid  # [B|1, H_g|1, n]
    valid = jnp.broadcast_to(valid, (valid.shape[0], heads, n))
    parts.append(_pad_keys(valid, length, 2, False))
  batch = max(x.shape[0] for x in parts)
  return _concatenate_heads([jnp.broadcast_to(x, (batch, *x.shape[1:])) for x in parts]), None


def pooled_key_lengths(key_lengths, ratio: int, num_prefix_tokens: int = 0):
  """Valid pooled keys (1-D windows) when each example's valid keys are its first
  ``key_lengths`` (int ``[B]``): the prefix tokens, then one window per ``ratio`` of the rest,
  a partial last window included. Returns int32 ``[B]``."""
  key_lengths = jnp.asarray(key_lengths, jnp.int32)
  prefix = jnp.minimum(key_lengths, num_prefix_tokens)
  rest = jnp.maximum(key_lengths - num_prefix_tokens, 0)
  return prefix + (rest + ratio - 1) // ratio


# The widest block of keys :func:`pool_every_head_at_once` takes: its product costs
# ``N · L / min(ratios)`` multiply-adds per channel, a few copies of the keys for small blocks.
MAX_POOLING_BLOCK = 16


def pooling_block(ratios: Sequence[int]) -> int:
  """The block of keys in which every head's windows tile exactly: ``lcm(ratios)``."""
  return int(np.lcm.reduce(np.asarray(ratios, np.int64)))


def _block_pooling_matrix(ratios: tuple[int, ...]) -> np.ndarray:
  """0/1 float32 ``[H, L / min(ratios), L]``, ``L`` :func:`pooling_block`: row ``p`` of head
  ``h`` picks window ``p`` of a block (keys ``[p r_h, (p + 1) r_h)``); rows ``p ≥ L / r_h`` are 0."""
  block = pooling_block(ratios)
  rows = np.arange(block // min(ratios))[None, :, None]
  keys = np.arange(block)[None, None, :]
  return (keys // np.asarray(ratios)[:, None, None] == rows).astype(np.float32)


def pool_every_head_at_once(x, ratios: Sequence[int]):
  """Average pooling of every head with its own ratio, as one product (no per-group ops).

  The key axis is cut into blocks of ``L`` = :func:`pooling_block` keys, in which every head's
  windows tile exactly; one einsum with a static 0/1 matrix per head sums each window (float32
  accumulation, exact for 0/1 weights), and the sums are divided by the head's ratio, as the
  per-group pooling does.

  Args:
    x: ``[B, H, N, C]`` (keys, or keys and values side by side), ``N`` a multiple of ``L``.
    ratios: one per head.

  Returns:
    ``[B, H, N / min(ratios), C]`` in ``x``'s dtype. Head ``h``'s ``N / r_h`` pooled keys are its
    first rows, block-major: row ``p · (N / L) + n`` is window ``n · (L / r_h) + p``. Softmax
    attention and key statistics do not depend on the keys' order; the rows after them are 0.
  """
  batch, heads, length, channels = x.shape
  ratios = tuple(ratios)
  block = pooling_block(ratios)
  if len(ratios) != heads or length % block:
    raise ValueError(
      f"x [B, H, N, C] = {tuple(x.shape)} needs one ratio per head and N a multiple of "
      f"lcm(ratios) = {block}; got ratios={ratios}"
    )
  blocks = x.reshape(batch, heads, length // block, block, channels)
  ratios_array = np.asarray(ratios)
  # Powers of two: 1/r is exact in every float dtype and scaling by it is exact, so the matrix
  # holds 1/r and no division follows (the same values as dividing the sums).
  exact_inverse = bool(np.all(ratios_array & (ratios_array - 1) == 0))
  matrix = _block_pooling_matrix(ratios)
  if exact_inverse:
    matrix = matrix / ratios_array[:, None, None]
  # The matrix batched over the examples too, so that the product's axes come out as
  # [B, H, p, n, C] (batch axes first, then the matrix's rows, then the blocks'): no transpose.
  matrix = jnp.broadcast_to(jnp.asarray(matrix, x.dtype), (batch, *matrix.shape))
  sums = jax.lax.dot_general(
    matrix,
    blocks,
    (((3,), (3,)), ((0, 1), (0, 1))),
    precision=jax.lax.Precision.HIGHEST,  # float32 keys are never rounded to TF32 or bfloat16
    preferred_element_type=C.F32,
  )
  means = sums if exact_inverse else sums / ratios_array.reshape(1, -1, 1, 1, 1).astype(np.float32)
  return means.astype(x.dtype).reshape(batch, heads, -1, channels)


def pools_every_head_at_once(call, ratios, *, pool: str, grid_shape, num_prefix_tokens) -> bool:
  """Whether a fused single-launch call pools by :func:`pool_every_head_at_once`: average
  pooling in 1-D without prefix tokens, no mask, lengths, bias or causal constraint (each
  head's pooled keys are then all valid, so a prefix of the block-major order), keys and values
  of one dtype, and ``kv_len`` a multiple of a block of at most ``MAX_POOLING_BLOCK`` keys."""
  block = pooling_block(ratios)
  return (
    pool == "avg"
    and grid_shape is None
    and num_prefix_tokens == 0
    and call.mask is None
    and call.bias is None
    and not call.is_causal
    and call.key.dtype == call.value.dtype
    and block <= MAX_POOLING_BLOCK
    and call.shapes.kv_len % block == 0
  )


def _attend_pooled_at_once(call, q, k, v, ratios, *, scale: float, batchnorm, statistics: str):
  """Softmax SH / BN+SH in one ``jax.nn.dot_product_attention`` call on the pooling of
  :func:`pool_every_head_at_once`: ``[B, H, q_len, d_v]`` in head order. Each (example, head)
  row goes with its pooled length ``N / r_h`` as its key length."""
  d_qk, (batch, heads, kv_len) = call.shapes.d_qk, k.shape[:3]
  keys, values = jnp.split(
    pool_every_head_at_once(jnp.concatenate([k, v], axis=-1), ratios), [d_qk], axis=-1
  )
  counts = kv_len // np.asarray(ratios)
  if batchnorm is not None:
    if statistics == "full":
      stats = key_statistics(k, None)
    else:
      valid = jnp.arange(keys.shape[2])[None, None, :] < counts[None, :, None]
      stats = key_statistics(keys, valid, counts.reshape(1, -1, 1, 1).astype(np.float32))
    q, keys = _normalise((q, keys), *stats, batchnorm)
  return fused.attend(
    q,
    keys,
    values,
    None,
    None,
    scale=scale,
    dtype=call.compute_dtype,
    key_lengths=np.broadcast_to(counts.astype(np.int32), (batch, heads)),
  )


class FusedOptions(NamedTuple):
  """The static choices of the fused path (``jax.nn.dot_product_attention``).

  Attributes:
    single_launch: every group in one call, else one call per group.
    by_lengths: padding given as lengths alone (1-D windows, no causal constraint): the valid
      pooled keys of each group are a prefix, so they go to the one launch as lengths and no mask
      (cuDNN keeps the call), padded queries zeroed after it (the rows the pooled masks give).
    scale: logits scale.
    num_prefix_tokens: as the kernel's.
    ratios: each group's ratio, in group order.
  """

  single_launch: bool
  by_lengths: bool
  scale: float
  num_prefix_tokens: int
  ratios: tuple[int, ...]


def _keys_and_values(p: PooledKeys, d_qk: int) -> PooledKeys:
  """``p`` with keys and values apart (pooled side by side: ``value`` None)."""
  if p.value is not None:
    return p
  key, value = jnp.split(p.key, [d_qk], axis=-1)
  return p._replace(key=key, value=value)


def _batchnorm_by_sequence(queries, pooled, full_statistics, batchnorm):
  """BN+SH with one set of statistics per sequence, group by group: ``(queries, pooled)`` with q
  and the pooled keys normalised. ``full_statistics``: each group's ``(mean, var)`` of its
  full-length keys (``statistics='full'``), else None (of its pooled keys)."""
  normalised = [], []
  for index, (q, p) in enumerate(zip(queries, pooled)):
    if full_statistics is None:
      mean, var = key_statistics(p.key, p.key_valid)
    else:
      mean, var = full_statistics[index]
    q, key = _normalise((q, p.key), mean, var, batchnorm)
    normalised[0].append(q)
    normalised[1].append(p._replace(key=key))
  return normalised


def _attend_fused(
  call, query, queries, pooled, *, options: FusedOptions, batchnorm=None, full_statistics=None
):
  """Softmax SH / BN+SH through ``jax.nn.dot_product_attention``: ``[B, H, q_len, d_v]``, the
  groups' heads in group order.

  Args:
    call: the kernel's call.
    query: the groups' queries concatenated in group order (q itself when the groups are in head
      order), or None: they are concatenated here.
    queries: each group's ``[B, H_g, q_len, d]``. pooled: each group's :class:`PooledKeys`
      (keys and values apart, or side by side in ``key``).
    options: :class:`FusedOptions`.
    batchnorm: BN+SH with one set of statistics per sequence (normalised here, every head at once
      on the single launch), or None: q and the keys go as they are (or were normalised before).
    full_statistics: ``(mean, var)`` ``[B, H, 1, d]`` in group order of the full-length keys
      (``statistics='full'``), or None.
  """
  dtype, scale, d_qk = call.compute_dtype, options.scale, call.shapes.d_qk
  if not options.single_launch:
    pooled = [_keys_and_values(p, d_qk) for p in pooled]
    if batchnorm is not None:
      if full_statistics is not None:
        sizes = np.cumsum([q.shape[1] for q in queries])[:-1].tolist()
        full_statistics = list(zip(*(jnp.split(x, sizes, axis=1) for x in full_statistics)))
      queries, pooled = _batchnorm_by_sequence(queries, pooled, full_statistics, batchnorm)
    return _concatenate_heads(
      [
        fused.attend(q, p.key, p.value, p.bias, p.mask, scale=scale, dtype=dtype)
        for q, p in zip(queries, pooled)
      ]
    )
  # One launch: pooled keys and values padded to the longest and stacked along the heads, each
  # row's pooled length as its key length (the padding is never seen).
  length = max(p.key.shape[2] for p in pooled)
  if all(p.value is None for p in pooled):  # pooled side by side: stacked, then apart
    stacked = _concatenate_heads([_pad_keys(p.key, length, 2, 0) for p in pooled])
    keys, values = jnp.split(stacked, [d_qk], axis=-1)
  else:
    pooled = [_keys_and_values(p, d_qk) for p in pooled]
    keys, values = (
      _concatenate_heads([_pad_keys(getattr(p, field), length, 2, 0) for p in pooled])
      for field in ("key", "value")
    )
  query = _concatenate_heads(queries) if query is None else query
  if batchnorm is not None:
    if full_statistics is None:
      full_statistics = key_statistics(keys, *_stacked_validity(pooled, length))
    query, keys = _normalise((query, keys), *full_statistics, batchnorm)
  batch = query.shape[0]
  bias = _stack_pairwise(queries, pooled, "bias", length, absent=0.0, padding=0.0)
  if options.by_lengths:
    key_lengths = call.key_value_seq_lengths
    key_lengths = call.shapes.kv_len if key_lengths is None else key_lengths
    key_lengths = jnp.broadcast_to(jnp.asarray(key_lengths, jnp.int32), call.shapes.batch_shape)
    key_lengths = key_lengths.reshape(batch)
    key_lengths = _concatenate_heads(
      [
        jnp.repeat(
          pooled_key_lengths(key_lengths, ratio, options.num_prefix_tokens)[:, None],
          p.key.shape[1],
          axis=1,
        )
        for ratio, p in zip(options.ratios, pooled)
      ]
    )
    mask = None
  else:
    key_lengths = np.concatenate([np.full(p.key.shape[1], p.key.shape[2]) for p in pooled])
    key_lengths = np.broadcast_to(key_lengths.astype(np.int32), (batch, key_lengths.size))
    mask = _stack_pairwise(queries, pooled, "mask", length, absent=True, padding=False)
  out = fused.attend(
    query, keys, values, bias, mask, scale=scale, dtype=dtype, key_lengths=key_lengths
  )
  if options.by_lengths and call.query_seq_lengths is not None:
    query_lengths = jnp.asarray(call.query_seq_lengths).reshape(batch)
    real = jnp.arange(call.shapes.q_len)[None, :] < query_lengths[:, None]  # [B, q_len]
    out = jnp.where(real[:, None, :, None], out, jnp.zeros((), out.dtype))
  return out


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------


@driver.attention_kernel
def scaled_head_attention(
  call: driver.AttentionCall,
  *,
  ratios: Sequence[int] | None = None,
  pool: str = "avg",
  kernel: str = "softmax",
  batchnorm: bool = False,
  statistics: str = "pooled",
  eps: float = bn_lib.DEFAULT_EPS,
  mean_weight: float = 1.0,
  linear_eps: float = linear_lib.DEFAULT_EPS,
  grid_shape: tuple[int, int] | None = None,
  num_prefix_tokens: int = 0,
  scale: float | None = None,
  implementation: str = "auto",
  single_launch: bool | None = None,
):
  """Attention-SH, and Attention-BN+SH with ``batchnorm=True`` (see the module docstring).

  Args:
    query, key, value, bias, mask and Flax's other ``attention_fn`` arguments: see
      :class:`driver.AttentionCall`.
    key, value: with grouped heads each query head pools its own copy of the shared key/value
      head, with its own ratio.
    bias: pooled by a mean over each window's visible entries, then added to the softmax logits
      or a factor ``exp(bias)`` on the linear kernel (``linear.positional_factor``).
    dropout_rng: a single group uses it itself (so all-1 ratios reproduce ``softmax_attention``
      exactly); several groups use ``fold_in(dropout_rng, ratio)``, and ``broadcast_dropout``
      shares a pattern across the examples and heads of one group.
    is_causal: applied before pooling (see "Pooled mask": a window is visible once all its
      keys are). Decoding with a key/value cache is not a full causal pass: a cached step cannot
      tell the keys not yet fed from padding and pools the incomplete window; the layers refuse
      ``decode=True`` for SH.
    return_weights, module: the weights are a tuple of float32 arrays, one per distinct ratio in
      increasing order, each ``[batch..., heads_in_group, q_len, pooled_length(kv_len, ratio)]``;
      map rows to heads with :func:`head_groups`.
    ratios: one static int >= 1 per head (required).
    pool: ``'avg'`` (default), ``'max'`` or ``'stride'``.
    kernel: ``'softmax'`` (default, scaled by ``scale``) or ``'linear'`` (dual form, elu + 1),
      the one-head kernels of ``batchnorm.KERNELS``.
    batchnorm: Attention-BN after pooling: q and the pooled keys normalised with key statistics.
    statistics: ``'pooled'`` (statistics of the pooled keys the head uses, default) or ``'full'``
      (of the full-length keys), over valid keys only.
    eps, mean_weight: ε and β of Attention-BN (as in ``batchnorm_attention``).
    linear_eps: denominator guard of the linear kernel.
    grid_shape: ``(gh, gw)`` to pool the non-prefix keys 2-D over an image patch grid.
    num_prefix_tokens: leading keys (e.g. CLS) kept unpooled.
    scale: softmax logits scale, default ``1/√d_qk``.
    implementation: ``'auto'`` (softmax kernel: each group's pooled keys and values go to
      ``jax.nn.dot_product_attention`` when no weights or dropout are needed, see
      ``kernels.fused``), ``'fused'`` or ``'reference'``.
    single_launch: on the fused path, every ratio group in one ``jax.nn.dot_product_attention``
      call (heads folded into the batch, pooled keys padded to the longest group, each row's
      pooled length as ``key_value_seq_lengths``) instead of one call per group; without a mask,
      lengths or bias (:func:`pools_every_head_at_once`) every head is pooled by one product.
      None (default): on a GPU only, where one cuDNN launch replaces several; elsewhere XLA's
      dense product would pay for the padding.

  Returns:
    ``[batch..., q_len, heads, d_v]`` (and the weights tuple if requested).

  Raises:
    ValueError: bad ``ratios`` (naming them and the head count), unknown ``pool``/``kernel``/
      ``statistics``, a grid that does not match ``kv_len``, bad shapes.
  """
  shapes = call.shapes
  ratios = validate_ratios(ratios, shapes.heads)
  pool_fn = C.lookup(POOLS, pool, "pool")
  scale = C.default_scale(shapes.d_qk) if scale is None else scale
  kernel_one_head = functools.partial(
    C.lookup(bn_lib.KERNELS, kernel, "kernel"),
    scale=scale,
    linear_eps=linear_eps,
    precision=call.precision,
  )
  C.lookup(STATISTICS_SOURCES, statistics, "statistics")
  grid_shape = None if grid_shape is None else tuple(grid_shape)
  _validate_layout(shapes.kv_len, grid_shape, num_prefix_tokens)
  _refuse_ratios_above_length(ratios, shapes.kv_len, grid_shape, num_prefix_tokens)
  scope = bn_lib.statistics_scope(call.mask, is_causal=call.is_causal, q_len=shapes.q_len)
  bn_options = None
  if batchnorm:
    bn_options = BatchNormOptions(statistics, eps, mean_weight, kernel, scope != "sequence")
  q, k, v = call.heads_major()
  mask, bias = call.mask_and_bias()

  groups = head_groups(ratios)
  layouts = [
    None if ratio == 1 else WindowLayout(shapes.kv_len, ratio, grid_shape, num_prefix_tokens)
    for ratio, _ in groups
  ]
  order = [h for _, heads in groups for h in heads]  # head of each position in group order
  in_order = order == list(range(shapes.heads))
  # Each group's heads as static slices of q, k, v, bias and mask (no gather).
  split = [_split_heads(x, groups, shapes.heads) for x in (q, k, v, bias, mask)]
  group_args = [[parts[index] for parts in split] for index in range(len(groups))]
  weights = None
  fused_path = call.takes_fused(implementation, softmax_kernel=kernel == "softmax")
  single = jax.default_backend() == "gpu" if single_launch is None else single_launch
  if (
    fused_path
    and single
    and pools_every_head_at_once(
      call, ratios, pool=pool, grid_shape=grid_shape, num_prefix_tokens=num_prefix_tokens
    )
  ):
    out = _attend_pooled_at_once(
      call, q, k, v, ratios, scale=scale, batchnorm=bn_options, statistics=statistics
    )
    return call.finish(out)
  if fused_path:
    options = FusedOptions(
      single_launch=single,
      by_lengths=single and call.lengths_only and not call.is_causal and grid_shape is None,
      scale=scale,
      num_prefix_tokens=num_prefix_tokens,
      ratios=tuple(ratio for ratio, _ in groups),
    )
    if bn_options is not None and bn_options.per_query:
      # Each query's own statistics: q and the keys normalised head by head with the pooling.
      pairs = [
        C.map_heads(
          functools.partial(
            _attention_inputs_one_head, layout=layout, pool=pool_fn, batchnorm=bn_options
          ),
          *args,
        )
        for layout, args in zip(layouts, group_args)
      ]
      queries, pooled = ([pair[i] for pair in pairs] for i in (0, 1))
      out = _attend_fused(call, None, queries, pooled, options=options)
    else:
      if k.dtype == v.dtype:
        # Keys and values side by side: one pooling (a reduction, a broadcast backward) per
        # group for both, and one split once the groups are stacked.
        keys_values = _split_heads(jnp.concatenate([k, v], axis=-1), groups, shapes.heads)
        group_args = [[args[0], kv, None, *args[3:]] for args, kv in zip(group_args, keys_values)]
      pooled = [
        _pool_group(*args[1:], layout=layout, pool=pool_fn)
        for layout, args in zip(layouts, group_args)
      ]
      full_statistics = None
      if bn_options is not None and statistics == "full":
        # The full-length keys' statistics, every head at once.
        full_statistics = key_statistics(k, None if mask is None else jnp.any(mask, axis=-2))
        full_statistics = tuple(_take_heads(x, order, shapes.heads) for x in full_statistics)
      out = _attend_fused(
        call,
        q if in_order else None,
        split[0],
        pooled,
        options=options,
        batchnorm=bn_options,
        full_statistics=full_statistics,
      )
  else:
    outputs, weights = [], []
    for (ratio, _), layout, args in zip(groups, layouts, group_args):
      inputs_one_head = functools.partial(
        _attention_inputs_one_head, layout=layout, pool=pool_fn, batchnorm=bn_options
      )
      group_rng = call.dropout_rng
      if group_rng is not None and len(groups) > 1:
        group_rng = jax.random.fold_in(group_rng, ratio)
      group_out, group_weights = call.weigh_values(
        functools.partial(_one_head, inputs=inputs_one_head, kernel=kernel_one_head),
        *args,
        dropout_rng=group_rng,
      )
      outputs.append(group_out)
      weights.append(group_weights)
    out, weights = _concatenate_heads(outputs), tuple(weights)

  # Back into head order: position p of the group order is head order[p] (static slices).
  out = _take_heads(out, np.argsort(order).tolist(), shapes.heads)
  return call.finish(out, weights)
