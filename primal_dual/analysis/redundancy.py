"""Head redundancy: how different the attention maps of a layer's heads are.

Definition (used everywhere in this project). For one layer, one example with valid query rows
``Q`` and attention maps ``A_h [q_len, kv_len]`` (rows sum to 1 over valid keys), the distance of
heads ``h`` and ``g`` is the mean Euclidean distance of their rows::

    d_hg = (1/|Q|) Σ_{i∈Q} ‖A_h[i, :] − A_g[i, :]‖₂

The layer's *head distance* is the mean of ``d_hg`` over all unordered pairs ``h < g`` and over the
examples of an evaluation set. Identical heads give 0; larger values mean less redundant heads.
The redundancy reported per variant is this distance per layer and its mean over layers (the paper
reports redundancy as "heads are more similar"; we report the distance so nothing is inverted).

Attention-SH heads attend over ``ceil(N/r_h)`` pooled keys. To compare them with full-width heads,
each pooled column is spread back over the keys it pooled: repeated over its window and divided by
the number of keys in that window (``r_h`` for full windows; fewer for the last, partial one and for
windows with padded keys), so every row still sums to 1 over the ``N`` keys. Prefix tokens such
as CLS are never pooled and stay their own column; on a ViT patch grid the windows are ``r×r``
squares (:func:`expand_by_window` takes any window layout).

Details that make the number well defined:

* Padded query rows (the example's padding mask) are left out of ``Q``; padded keys carry weight 0
  in every kernel, so they add nothing to a row distance. Padding rows of an evaluation batch (its
  ``valid`` flag) are dropped before anything is accumulated.
* The evaluation-set mean weights every example equally (:class:`RedundancyAccumulator` sums
  per-example distances and divides by the example count once at the end).
* With one head there are no pairs and the distance is 0. HYLA's weights are not row-stochastic
  (they may be negative and do not sum to 1); the same formula is applied to them as they are.
* Range: for row-stochastic maps ``0 ≤ d_hg ≤ √2`` (two one-hot rows on different keys).

Memory: distances are computed one head pair at a time (``[batch, q_len, kv_len]`` at once), never
as a ``[batch, H, H, q_len, kv_len]`` tensor, so long series (1751 steps) fit.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np


def _validated(
  weights: np.ndarray, query_valid: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
  """``weights`` as float64 ``[B, H, Q, K]`` and ``query_valid`` as bool ``[B, Q]``."""
  weights = np.asarray(weights, np.float64)
  if weights.ndim != 4:
    raise ValueError(f"weights must be [batch, heads, q_len, kv_len]; got shape {weights.shape}")
  batch, _, q_len, _ = weights.shape
  if query_valid is None:
    query_valid = np.ones((batch, q_len), bool)
  query_valid = np.asarray(query_valid, bool)
  if query_valid.shape != (batch, q_len):
    raise ValueError(
      f"query_valid must be [batch, q_len] = {(batch, q_len)}; got {query_valid.shape}"
    )
  return weights, query_valid


def head_distance_sums(weights: np.ndarray, query_valid: np.ndarray | None = None) -> np.ndarray:
  """``d_hg`` of every example, summed over the batch (for streaming means).

  Args:
    weights: ``[batch, heads, q_len, kv_len]`` attention maps.
    query_valid: ``[batch, q_len]`` bool; padded query rows are ignored. None = all valid.

  Returns:
    ``[heads, heads]`` float64, symmetric, zero diagonal: ``Σ_batch d_hg``.
  """
  weights, query_valid = _validated(weights, query_valid)
  heads = weights.shape[1]
  rows = np.maximum(query_valid.sum(axis=1), 1)  # [B]
  sums = np.zeros((heads, heads))
  for h, g in itertools.combinations(range(heads), 2):
    diff = weights[:, h] - weights[:, g]  # [B, Q, K]
    row_distance = np.sqrt(np.einsum("bqk,bqk->bq", diff, diff))
    per_example = np.sum(row_distance * query_valid, axis=-1) / rows
    sums[h, g] = sums[g, h] = per_example.sum()
  return sums


def head_distance_matrix(weights: np.ndarray, query_valid: np.ndarray | None = None) -> np.ndarray:
  """Mean pairwise row distance between heads.

  Args:
    weights: ``[batch, heads, q_len, kv_len]`` attention maps.
    query_valid: ``[batch, q_len]`` bool; padded query rows are ignored. None = all valid.

  Returns:
    ``[heads, heads]`` float64, symmetric, zero diagonal: ``d_hg`` averaged over the batch.
  """
  weights, query_valid = _validated(weights, query_valid)
  return head_distance_sums(weights, query_valid) / max(weights.shape[0], 1)


def mean_pairwise(matrix: np.ndarray) -> float:
  """Mean of the strictly upper triangle of a ``[heads, heads]`` matrix (0 for one head)."""
  heads = matrix.shape[0]
  if heads < 2:
    return 0.0
  upper = np.triu_indices(heads, k=1)
  return float(matrix[upper].mean())


def layer_head_distance(weights: np.ndarray, query_valid: np.ndarray | None = None) -> float:
  """The layer's head distance: mean over head pairs of :func:`head_distance_matrix`."""
  return mean_pairwise(head_distance_matrix(weights, query_valid))


def expand_by_window(
  pooled: np.ndarray, window_of_key: np.ndarray, key_valid: np.ndarray | None = None
) -> np.ndarray:
  """Spreads pooled attention columns back over the keys they pooled (any window layout).

  Each key belongs to exactly one pooling window (a prefix token such as CLS is its own window).
  A pooled column's weight is shared equally by the valid keys of its window.

  Args:
    pooled: ``[batch, heads, q_len, pooled_len]``.
    window_of_key: int ``[kv_len]``, the pooled column (in ``[0, pooled_len)``) of every key.
    key_valid: ``[batch, kv_len]`` bool; padded keys get weight 0. None = all valid.

  Returns:
    ``[batch, heads, q_len, kv_len]`` float64 with the row sums of ``pooled``.
  """
  pooled = np.asarray(pooled, np.float64)
  window_of_key = np.asarray(window_of_key, np.int64)
  batch, pooled_len = pooled.shape[0], pooled.shape[-1]
  if (
    window_of_key.ndim != 1
    or window_of_key.size
    and (window_of_key.min() < 0 or window_of_key.max() >= pooled_len)
  ):
    raise ValueError(
      f"window_of_key must be [kv_len] ints in [0, {pooled_len}); got shape "
      f"{window_of_key.shape}, range [{window_of_key.min(initial=0)}, "
      f"{window_of_key.max(initial=0)}]"
    )
  kv_len = window_of_key.shape[0]
  if key_valid is None:
    key_valid = np.ones((batch, kv_len), bool)
  key_valid = np.asarray(key_valid, np.float64)
  if key_valid.shape != (batch, kv_len):
    raise ValueError(
      f"key_valid must be [batch, kv_len] = {(batch, kv_len)}; got {key_valid.shape}"
    )
  counts = (
    np.stack(
      [np.bincount(window_of_key, weights=key_valid[b], minlength=pooled_len) for b in range(batch)]
    )
    if batch
    else np.zeros((0, pooled_len))
  )
  share = key_valid / np.maximum(counts[:, window_of_key], 1)  # [B, N]
  return pooled[..., window_of_key] * share[:, None, None, :]


def expand_pooled_columns(
  pooled: np.ndarray, ratio: int, kv_len: int, key_valid: np.ndarray | None = None
) -> np.ndarray:
  """Spreads 1-D pooled attention columns back over the keys they pooled.

  Args:
    pooled: ``[batch, heads, q_len, ceil(kv_len/ratio)]``.
    ratio: the window (and stride) of the pooling.
    kv_len: N, the unpooled key count.
    key_valid: ``[batch, kv_len]`` bool; padded keys get weight 0. None = all valid.

  Returns:
    ``[batch, heads, q_len, kv_len]``; each pooled weight is shared equally by the valid keys of
    its window, so row sums are preserved.
  """
  return expand_by_window(pooled, np.arange(kv_len) // ratio, key_valid)


def grid_window_of_key(ratio: int, grid_shape: Sequence[int], num_prefix_tokens: int) -> np.ndarray:
  """``window_of_key`` of prefix tokens (each alone) then a ``gh×gw`` grid pooled ``r×r``."""
  grid_h, grid_w = grid_shape
  pooled_w = -(-grid_w // ratio)
  rows, cols = np.divmod(np.arange(grid_h * grid_w), grid_w)
  window = (rows // ratio) * pooled_w + cols // ratio
  return np.concatenate([np.arange(num_prefix_tokens), num_prefix_tokens + window])


def expand_grid_columns(
  pooled: np.ndarray, ratio: int, grid_shape: Sequence[int], num_prefix_tokens: int
) -> np.ndarray:
  """Spreads 2-D pooled columns (prefix tokens kept, a ``gh×gw`` grid pooled ``r×r``) back.

  Args:
    pooled: ``[batch, heads, q_len, prefix + ceil(gh/r)·ceil(gw/r)]``.

  Returns:
    ``[batch, heads, q_len, prefix + gh·gw]``.
  """
  return expand_by_window(pooled, grid_window_of_key(ratio, grid_shape, num_prefix_tokens))


def redundancy_summary(
  layer_maps: Sequence[np.ndarray], query_valid: np.ndarray | None = None
) -> dict[str, object]:
  """Per-layer head distances and their mean.

  Args:
    layer_maps: one ``[batch, heads, q_len, kv_len]`` array per layer (already full width).
    query_valid: ``[batch, q_len]`` or None.

  Returns:
    ``{'per_layer': [float, ...], 'mean': float}``.
  """
  per_layer = [layer_head_distance(w, query_valid) for w in layer_maps]
  return {"per_layer": per_layer, "mean": float(np.mean(per_layer)) if per_layer else 0.0}


class RedundancyAccumulator:
  """Streams per-layer head distances over the batches of an evaluation set.

  Example::

    acc = RedundancyAccumulator()
    for layer_maps, query_valid in batches:      # full-width [B, H, Q, K] per layer
      acc.add(layer_maps, query_valid)
    acc.summary()   # {'per_layer': [...], 'mean': ..., 'num_examples': ...}
  """

  def __init__(self):
    self._sums: list[np.ndarray] = []
    self.num_examples = 0

  def add(self, layer_maps: Sequence[np.ndarray], query_valid: np.ndarray | None = None) -> None:
    """Adds one batch: one ``[batch, heads, q_len, kv_len]`` array per layer (same batch)."""
    sums = [head_distance_sums(w, query_valid) for w in layer_maps]
    if self._sums and len(sums) != len(self._sums):
      raise ValueError(
        f"every batch must have the same number of layers; got {len(sums)} after {len(self._sums)}"
      )
    self._sums = sums if not self._sums else [a + b for a, b in zip(self._sums, sums)]
    self.num_examples += int(np.asarray(layer_maps[0]).shape[0]) if len(layer_maps) else 0

  def summary(self) -> dict[str, object]:
    """``{'per_layer': [float], 'mean': float, 'num_examples': int}`` (mean over layers)."""
    count = max(self.num_examples, 1)
    per_layer = [mean_pairwise(s / count) for s in self._sums]
    return {
      "per_layer": per_layer,
      "mean": float(np.mean(per_layer)) if per_layer else 0.0,
      "num_examples": self.num_examples,
    }
