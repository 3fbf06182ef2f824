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
heads are gathered, pooled once and attended on the pooled length, and the group outputs are
scattered back into the original head order. Nothing is padded back to N.

Conventions (chosen here, where docs/maths.md is silent):

* **Validity.** A key is valid for a head if some query of that head may see it
  (``_common.key_validity``; for padding masks this is the padding). Pooling only uses valid keys;
  a window with no valid key is masked out.
* **Pooled mask.** Query ``i`` may see a pooled key iff it may see at least one key of the window.
  With causal or local masks a pooled key therefore summarises keys that query ``i`` could not see
  individually (up to ``r - 1`` future positions under a causal mask).
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
# Pooling of one head.
# ---------------------------------------------------------------------------------------------


def _masked_mean(x, valid):
  """x ``[n, w, d]``, valid ``[n, w]`` -> mean of the valid slots ``[n, d]`` (0 if none)."""
  valid = valid[..., None]
  total = jnp.sum(jnp.where(valid, x.astype(C.F32), 0.0), axis=1)
  count = jnp.sum(valid, axis=1)
  return (total / jnp.maximum(count, 1)).astype(x.dtype)


def _masked_max(x, valid):
  """Channel-wise max of the valid slots ``[n, d]`` (0 if none)."""
  valid = valid[..., None]
  top = jnp.max(jnp.where(valid, x.astype(C.F32), -jnp.inf), axis=1)
  return jnp.where(jnp.any(valid, axis=1), top, 0.0).astype(x.dtype)


def _first_valid(x, valid):
  """The first valid slot of each window ``[n, d]`` (slot 0 if none; such windows are masked)."""
  first = jnp.argmax(valid, axis=1)
  return jnp.take_along_axis(x, first[:, None, None], axis=1)[:, 0]


POOLS: dict[str, Callable] = {"avg": _masked_mean, "max": _masked_max, "stride": _first_valid}


class PooledKeys(NamedTuple):
  """One head's keys after pooling (``n`` = pooled length)."""

  key: jax.Array  # [n, d_qk], input dtype
  value: jax.Array  # [n, d_v], input dtype
  bias: jax.Array | None  # [q_len, n] float32
  mask: jax.Array | None  # [q_len, n] bool; None when the call has no mask (all visible)
  key_valid: jax.Array  # [n] bool, window holds a valid key


def pool_keys_one_head(
  k, v, bias, mask, key_valid, *, windows: KeyWindows, pool: Callable
) -> PooledKeys:
  """Pools one head's keys, values, bias and mask over ``windows``.

  Args:
    k: ``[kv_len, d_qk]``. v: ``[kv_len, d_v]``.
    bias: ``[q_len, kv_len]`` or None. mask: ``[q_len, kv_len]`` bool or None.
    key_valid: bool ``[kv_len]``, keys that may be pooled.
    windows: static windows from :func:`key_windows`.
    pool: an entry of :data:`POOLS`.
  """
  index, real = jnp.asarray(windows.index), jnp.asarray(windows.real)
  valid = real & key_valid[index]  # [n, w]
  pooled_valid = jnp.any(valid, axis=-1)
  if mask is None:
    visible = valid[None]  # [1, n, w]: every query sees every valid key.
    # Without a mask every key is valid and every window holds a real key, so every query sees
    # every pooled key: no pooled mask either, which leaves the fused path free to use cuDNN
    # (a mask, even all True, sends jax.nn.dot_product_attention to XLA's dense [q, n] path).
    pooled_mask = None
  else:
    visible = mask[:, index] & real[None]  # [q_len, n, w]
    pooled_mask = jnp.any(visible, axis=-1)
  pooled_bias = None
  if bias is not None:
    # Mean over the entries query i may see; 0 where it sees none (then masked anyway).
    total = jnp.sum(jnp.where(visible, bias[:, index].astype(C.F32), 0.0), axis=-1)
    pooled_bias = total / jnp.maximum(jnp.sum(visible, axis=-1), 1)
  return PooledKeys(
    pool(k[index], valid), pool(v[index], valid), pooled_bias, pooled_mask, pooled_valid
  )


# ---------------------------------------------------------------------------------------------
# One head of one ratio group.
# ---------------------------------------------------------------------------------------------

# statistics option of BN+SH -> (keys [kv_len, d], key_valid [kv_len], PooledKeys) -> the keys
# whose statistics normalise and their validity.
STATISTICS_SOURCES: dict[str, Callable] = {
  "pooled": lambda k, key_valid, pooled: (pooled.key, pooled.key_valid),
  "full": lambda k, key_valid, pooled: (k, key_valid),
}


class BatchNormOptions(NamedTuple):
  """Attention-BN after pooling (``batchnorm_attention``'s names for ε and β)."""

  statistics: str  # 'pooled' | 'full'
  eps: float
  mean_weight: float


def _attention_inputs_one_head(
  q,
  k,
  v,
  bias,
  mask,
  *,
  windows: KeyWindows | None,
  pool: Callable,
  batchnorm: BatchNormOptions | None,
):
  """What one head of one group attends with: ``(q [q_len, d], PooledKeys)``.

  ``windows`` is None for ratio 1 (no pooling). With ``batchnorm``, q and the pooled keys are
  normalised with key statistics of the pooled keys (``statistics='pooled'``) or the full-length
  keys.
  """
  kv_len = k.shape[0]
  key_valid = C.key_validity(mask, kv_len)
  key_valid = jnp.ones((kv_len,), bool) if key_valid is None else key_valid
  if windows is None:
    pooled = PooledKeys(k, v, bias, mask, key_valid)
  else:
    pooled = pool_keys_one_head(k, v, bias, mask, key_valid, windows=windows, pool=pool)
  if batchnorm is None:
    return q, pooled
  mean, var = bn_lib.key_statistics(*STATISTICS_SOURCES[batchnorm.statistics](k, key_valid, pooled))
  q, pooled_key = (
    bn_lib.normalize_with_key_stats(
      x, mean, var, eps=batchnorm.eps, mean_weight=batchnorm.mean_weight
    )
    for x in (q, pooled.key)
  )
  return q, pooled._replace(key=pooled_key)


def _one_head(q, k, v, bias, mask, *, inputs: Callable, kernel: Callable):
  """Weights ``[q_len, n]`` (float32) and values ``[n, d_v]`` of one head of one group."""
  q, pooled = inputs(q, k, v, bias, mask)
  return kernel(q, pooled.key, pooled.bias, pooled.mask), pooled.value


def _select_heads(x, heads: np.ndarray, num_heads: int):
  """``x[:, heads]`` for ``[B, H, ...]`` arrays; a no-op for None, arrays shared by the heads
  (size 1 on that axis) and when ``heads`` is every head in order."""
  if x is None or x.shape[1] != num_heads or np.array_equal(heads, np.arange(num_heads)):
    return x
  return x[:, heads]


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
    is_causal: applied before pooling (see "Pooled mask"). Decoding with a key/value cache is
      therefore not a full causal pass: a cached step pools only the keys seen so far, the full
      pass pools whole windows.
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
  bn_options = BatchNormOptions(statistics, eps, mean_weight) if batchnorm else None
  q, k, v = call.heads_major()
  mask, bias = call.mask_and_bias()

  groups = head_groups(ratios)
  take_fused = call.takes_fused(implementation, softmax_kernel=kernel == "softmax")
  outputs, weights = [], []
  for ratio, heads in groups:
    windows = (
      None if ratio == 1 else key_windows(shapes.kv_len, ratio, grid_shape, num_prefix_tokens)
    )
    inputs_one_head = functools.partial(
      _attention_inputs_one_head, windows=windows, pool=pool_fn, batchnorm=bn_options
    )
    group_inputs = [
      _select_heads(x, np.asarray(heads), shapes.heads) for x in (q, k, v, bias, mask)
    ]
    if take_fused:
      group_q, pooled = C.map_heads(inputs_one_head, *group_inputs)
      outputs.append(
        fused.attend(
          group_q,
          pooled.key,
          pooled.value,
          pooled.bias,
          pooled.mask,
          scale=scale,
          dtype=call.compute_dtype,
        )
      )
      continue
    group_rng = call.dropout_rng
    if group_rng is not None and len(groups) > 1:
      group_rng = jax.random.fold_in(group_rng, ratio)
    group_out, group_weights = call.weigh_values(
      functools.partial(_one_head, inputs=inputs_one_head, kernel=kernel_one_head),
      *group_inputs,
      dropout_rng=group_rng,
    )
    outputs.append(group_out)
    weights.append(group_weights)

  # Scatter the groups back into head order: position p of the concatenation is head order[p].
  order = np.concatenate([np.asarray(heads) for _, heads in groups])
  out = _select_heads(jnp.concatenate(outputs, axis=1), np.argsort(order), shapes.heads)
  return call.finish(out, tuple(weights) if weights else None)
