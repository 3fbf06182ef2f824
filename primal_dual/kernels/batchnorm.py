"""Attention-BN: batch normalisation on the input of the SVR primal (docs/maths.md §3.4).

For one example and head, over the valid keys ``j`` and per channel::

  μ = mean_j k_j,   σ² = mean_j (k_j − μ)²
  q̂ = (q − βμ)/√(σ² + ε),   k̂ = (k − βμ)/√(σ² + ε)
  out = kernel(q̂, k̂, bias, mask) · v              (softmax or linear, see KERNELS)

The keys are the SVR's training inputs, so their statistics (over the key axis, per example, head
and channel, valid keys only) normalise both the keys and the queries (the test inputs) before the
kernel runs: ``q̂ = (q − βμ)/√(σ² + ε)``, ``k̂ = (k − βμ)/√(σ² + ε)``. Normalising only the keys
would be wrong: centering the keys alone leaves softmax unchanged (``q_iᵀμ`` is constant over j),
so the queries must be moved into the same coordinates. There are no running averages: training and
evaluation compute the same thing.

Under a causal or query-dependent mask each query takes the statistics of the keys *it* may see
(docs/maths.md, "Under masks"): prefix sums under ``is_causal``; under any other mask, the two-pass
moments of its own keys when it sees few, else masked sums (see :func:`masked_statistics`).
For the softmax kernel the per-query mean and scale fold into the query, ``a_i = (q_i −
βμ_i)/(σ_i² + ε)``, the remaining term being constant along the keys, so the product stays one
softmax attention of shared keys (``jax.nn.dot_product_attention``). Without a causal constraint and
with a mask the same for every query (none, padding) this is the paper's per-sequence definition,
computed as it always was.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import driver, fused
from primal_dual.kernels.linear import DEFAULT_EPS as LINEAR_EPS
from primal_dual.kernels.linear import (
  causal_prefix,
  elu_feature_map,
  key_only_validity,
  linear_weights_one_head,
  normalize_linear_scores,
)
from primal_dual.kernels.softmax import softmax_weights_one_head

DEFAULT_EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# One-head building blocks.
# ---------------------------------------------------------------------------------------------


def key_statistics(k, key_valid):
  """Population mean and variance of the valid rows of ``k``, per channel, in float32.

  Args:
    k: ``[kv_len, d]``, any float dtype.
    key_valid: bool ``[kv_len]`` or None (all keys valid).

  Returns:
    ``(mean [d], var [d])`` float32, ``var = mean_j (k_j − mean)²``. With no valid key the
    statistics are ``mean = 0, var = 1`` (normalisation is then the identity up to ε), so nothing
    is NaN and gradients stay finite.
  """
  k = k.astype(C.F32)
  weights = jnp.ones(k.shape[:1], C.F32) if key_valid is None else key_valid.astype(C.F32)
  count = jnp.sum(weights)
  safe_count = jnp.maximum(count, 1.0)
  mean = jnp.einsum("k,kd->d", weights, k) / safe_count
  var = jnp.einsum("k,kd->d", weights, (k - mean[None]) ** 2) / safe_count
  return mean, jnp.where(count > 0, var, 1.0)


def normalize_with_key_stats(x, mean, var, *, eps: float, mean_weight: float):
  """``(x − β·mean)/√(var + eps)`` in float32; ``x [n, d]``, ``mean, var [d]`` -> ``[n, d]``.

  With ``eps = 0`` a constant channel (``var = 0``) divides by zero; keep ``eps > 0`` in practice.
  """
  return (x.astype(C.F32) - mean_weight * mean[None]) / jnp.sqrt(var + eps)[None]


def _statistics_of_keys(q, k, mask):
  del q
  return key_statistics(k, C.key_validity(mask, k.shape[0]))


def _statistics_of_queries(q, k, mask):
  del k
  query_valid = None if mask is None else jnp.any(mask, axis=1)
  return key_statistics(q, query_valid)


def _statistics_of_queries_and_keys(q, k, mask):
  rows = jnp.concatenate([q.astype(C.F32), k.astype(C.F32)], axis=0)
  if mask is None:
    return key_statistics(rows, None)
  valid = jnp.concatenate([jnp.any(mask, axis=1), C.key_validity(mask, k.shape[0])])
  return key_statistics(rows, valid)


# statistics source -> (q [q_len, d], k [kv_len, d], mask [q_len, kv_len] | None) -> (mean, var).
# 'keys' is docs/maths.md §3.4; a query (key) is valid when it may attend to (be seen by) any key (query).
STATISTICS_SOURCES: dict[str, Callable] = {
  "keys": _statistics_of_keys,
  "queries": _statistics_of_queries,
  "queries_and_keys": _statistics_of_queries_and_keys,
}


def _softmax_kernel(q, k, bias, mask, *, scale, linear_eps, precision):
  del linear_eps
  return softmax_weights_one_head(q, k, bias, mask, scale=scale, precision=precision)


def _linear_kernel(q, k, bias, mask, *, scale, linear_eps, precision):
  """Dual-form linear weights; ``k`` is ``[kv_len, d]`` (shared by the queries) or ``[q_len,
  kv_len, d]`` (each query's own normalised keys, see :func:`per_query_inputs`)."""
  del scale  # Φ = elu + 1 has no temperature; a bias multiplies the kernel by exp(bias).
  if k.ndim == 2:
    return linear_weights_one_head(q, k, bias, mask, eps=linear_eps, precision=precision)
  scores = jnp.einsum("qd,qkd->qk", elu_feature_map(q), elu_feature_map(k), precision=precision)
  return normalize_linear_scores(scores, bias, mask, eps=linear_eps)


# The kernels of Attention-BN and Attention-SH, run on one head's normalised and/or pooled queries
# and keys: (q, k, bias, mask, *, scale, linear_eps, precision) -> float32 weights [q_len, kv_len].
KERNELS: dict[str, Callable] = {
  "softmax": _softmax_kernel,
  "linear": _linear_kernel,
}


# ---------------------------------------------------------------------------------------------
# Statistics of the keys each query may see (causal and query-dependent masks).
# ---------------------------------------------------------------------------------------------


class QueryStatistics(NamedTuple):
  """Key statistics of one head, one row per query (float32).

  Attributes:
    mean: ``[q_len, d]``. var: ``[q_len, d]`` (population variance); ``0, 1`` for a query that
      sees no key.
    shift: ``[d]``, the point the moments were taken about, the same for every query, without
      a gradient (under ``is_causal`` the first valid key, else :func:`shared_shift`). Any row
      constant subtracted from the keys leaves softmax unchanged, and this one keeps the folded
      logits small (see :func:`per_query_inputs`).
  """

  mean: jax.Array
  var: jax.Array
  shift: jax.Array


def first_valid_key(k, key_valid):
  """The first row of ``k [kv_len, d]`` with ``key_valid`` (row 0 when none), float32, without a
  gradient: it only shifts the data the moments are taken of, which they do not depend on."""
  first = 0 if key_valid is None else jnp.argmax(key_valid)
  return jax.lax.stop_gradient(k[first].astype(C.F32))


def _with_value(x, value):
  """``value`` exactly, with the derivative of ``x`` (both the same function up to rounding)."""
  return jax.lax.stop_gradient(value) + (x - jax.lax.stop_gradient(x))


def _moments(count, first, second, shift):
  """Mean and variance from the count and the first two moments about ``shift`` (shifted-data
  sums: no cancellation when the keys share a large offset). A variance that rounding makes
  negative reads 0 but keeps its derivative."""
  safe = jnp.maximum(count, 1.0)[:, None]
  centred_mean = first / safe
  var = second / safe - centred_mean**2
  var = _with_value(var, jnp.maximum(var, 0.0))
  seen = (count > 0)[:, None]
  return jnp.where(seen, shift[None] + centred_mean, 0.0), jnp.where(seen, var, 1.0)


def prefix_statistics(k, key_valid, *, q_len: int, offset: int) -> QueryStatistics:
  """Causal statistics of one head: query ``i`` takes those of the valid keys ``j <= i + offset``
  (prefix sums in float32, O(kv_len·d)).

  Args:
    k: ``[kv_len, d]``. key_valid: bool ``[kv_len]`` or None (all valid; a key-only mask).
    q_len, offset: query ``i`` sees keys ``j <= i + offset`` (``_common.causal_offset``).
  """
  weights = jnp.ones(k.shape[:1], C.F32) if key_valid is None else key_valid.astype(C.F32)
  shift = first_valid_key(k, key_valid)
  centred = (k.astype(C.F32) - shift[None]) * weights[:, None]
  count, first, second = (
    causal_prefix(x, q_len, offset) for x in (weights, centred, centred * centred)
  )
  return QueryStatistics(*_moments(count, first, second, shift), shift)


def shared_shift(k, mask):
  """The point a head's per-query moments are taken about, ``[d]`` float32 without a gradient:
  a key that every query which sees a key sees (key 0 under a causal mask, the first valid key
  under causal and padding masks), else 0.

  Moments about a point amid the keys keep their digits when the keys share an offset; they do
  not depend on the point, only their rounding does, so the point must be one that no query has
  hidden: a key every query sees. (The mean of the head's valid keys, which a hidden key moves,
  moved the gradient of a query's output by up to 3e-3 of its largest entry.)

  Args:
    k: ``[kv_len, d]``. mask: bool ``[q_len, kv_len]``.
  """
  seen = jnp.any(mask, axis=-1)
  shared = jnp.all(mask | ~seen[:, None], axis=0) & jnp.any(seen)
  shift = jnp.where(jnp.any(shared), k[jnp.argmax(shared)].astype(C.F32), 0.0)
  return jax.lax.stop_gradient(shift)


# A query that sees at most this many keys takes the two-pass moments of its own keys (gathered,
# [q_len, EXACT_UP_TO, d]): few keys are where a variance is small next to the shift's distance.
EXACT_UP_TO = 16


def _two_pass_of_first_visible(x, mask, size: int):
  """Mean and variance ``[q_len, d]`` of the first ``size`` rows of ``x [kv_len, d]`` (float32)
  each query sees, by the corrected two-pass algorithm (Chan, Golub & LeVeque): a mean ``c``,
  then ``r = mean(x − c)``, ``μ = c + r`` and ``σ² = mean((x − c)²) − r²``, the deviations formed
  before any square. Which rows are gathered depends on the mask alone, and a row beyond a
  query's count is multiplied by an exact zero."""
  _, index = jax.lax.top_k(mask.astype(C.F32), size)  # ties: the lower index first
  taken = jnp.take_along_axis(mask, index, axis=-1).astype(C.F32)[:, :, None]  # [q, size, 1]
  rows = x[index] * taken  # [q, size, d]
  count = jnp.maximum(jnp.sum(taken, axis=1), 1.0)
  rough = jnp.sum(rows, axis=1) / count
  deviation = taken * (rows - rough[:, None])
  residual = jnp.sum(deviation, axis=1) / count
  var = jnp.sum(deviation * deviation, axis=1) / count - residual**2
  return rough + residual, jnp.maximum(var, 0.0)


def masked_statistics(
  k, mask, *, precision=None, exact_up_to: int = EXACT_UP_TO
) -> QueryStatistics:
  """Per-query statistics of one head under any mask: query ``i`` takes those of the keys it may
  attend to, ``mask [q_len, kv_len]`` bool (O(q_len·kv_len·d) time, O(q_len·d) memory).

  A query that sees at most ``exact_up_to`` keys takes the corrected two-pass moments of its own
  keys (gathered, ``[q_len, exact_up_to, d]``): its variance is known to rounding of ``σ_i²``
  itself. Any other query takes masked sums of ``x = k − shift`` and ``x²`` (two matrix
  products, as before) about :func:`shared_shift`: its variance is known to rounding of
  ``E_i[x²]``, ``σ_i²`` or so when the shift is a key it sees, but the keys' offset when the
  mask has no key that every query sees (the shift is then 0). The derivative is always the
  products' (the same function), so the backward pass is as before. A hidden key is multiplied
  by an exact zero on every path and moves no shift: it reaches no query even through rounding.

  The moments about zero used before, ``E[k²] − E[k]²``, lost a variance's digits whenever it
  was small next to ``k²``: keys sharing an offset, or the two or three keys a query sees
  nearly coinciding in a channel. Measured against float64, before → after: variances (keys
  ``offset + spread·N(0, 1)`` per channel, 2 to 8 of 8 keys per query), worst relative error at
  offset 30 with spread 1 or 1e-3: 0.26 or 8e4 → 2e-7. Attention-BN normwise (8 tokens, 2 heads,
  d 4, queries and keys sharing the offset, worst of 20 draws), explicit causal mask / random
  masks: offset 30, spread 1: softmax 4.9e-1 / 8.7e-4 → 6.1e-7 / 1.1e-5, linear 6.2e-2 /
  2.4e-3 → 3.4e-6 / 1.6e-6; offset 4, spread 0.05: softmax 2.9e-2 / 1.2e-2 → 3.8e-6 / 2.1e-5,
  linear 9.8e-3 / 6.8e-3 → 4.0e-3 / 3.4e-6, where the 4.0e-3 is a first query that sees one
  key, whose ``q̂ < −17`` is below what ``elu(q̂) + 1`` resolves in float32
  (``linear.elu_feature_map``; ``exp`` there gives 4.6e-6). The reference comparison's random
  cases (2 or more keys per query): 60 (linear) and 17 (softmax) of 15,000 off tolerance → 0.
  40 tokens, offset 30: causal 6.0e-7 / 2.4e-7, but random masks (about 24 keys per query, no
  shared key) 1.4e-4 / 4.7e-5. Cost on a CPU (512 tokens, 2 heads, d 64, explicit causal
  mask, best of 20): softmax forward 2.7 → 4.6 to 5.5 ms (choosing the keys, ``top_k``, about
  1 ms a head), gradient 9.7 → 12 ms; linear unchanged (68 and 650 ms). A two-pass for every
  query, elementwise over ``[q_len, kv_len, d]``, took 14 to 70 times the statistics' products.
  """
  mask = mask.astype(bool)
  visible = mask.astype(C.F32)
  count = jnp.sum(visible, axis=-1)
  shift = shared_shift(k, mask)
  centred = k.astype(C.F32) - shift[None]
  first, second = (
    jnp.einsum("qk,kd->qd", visible, x, precision=precision) for x in (centred, centred * centred)
  )
  mean, var = _moments(count, first, second, shift)
  size = min(exact_up_to, k.shape[0])
  if size > 0:
    few = ((count > 0) & (count <= size))[:, None]
    exact_mean, exact_var = _two_pass_of_first_visible(centred, mask, size)
    # The two-pass values with the products' derivative (the same function): the backward pass
    # stays two matrix products, with no scatter of the gather.
    mean = _with_value(mean, jnp.where(few, shift[None] + exact_mean, mean))
    var = _with_value(var, jnp.where(few, exact_var, var))
  return QueryStatistics(mean, var, shift)


def _fold_into_query(q, k, stats: QueryStatistics, *, eps: float, mean_weight: float):
  """Softmax: ``q̂_iᵀk̂_ij = a_iᵀk_j − β a_iᵀμ_i`` with ``a_i = (q_i − βμ_i)/(σ_i² + ε)``; the
  second term is constant along the keys, so the softmax takes ``(a_i, k_j − shift)`` and the
  keys stay shared by the queries (docs/maths.md, "Under masks")."""
  folded = (q.astype(C.F32) - mean_weight * stats.mean) / (stats.var + eps)
  return folded, k.astype(C.F32) - stats.shift[None]


def _normalize_keys_per_query(q, k, stats: QueryStatistics, *, eps: float, mean_weight: float):
  """Linear kernel: ``q̂_i`` ``[q_len, d]`` and each query's own ``k̂_ij`` ``[q_len, kv_len, d]``
  (Φ does not commute with the per-query normalisation)."""
  scale = jnp.sqrt(stats.var + eps)
  q_hat = (q.astype(C.F32) - mean_weight * stats.mean) / scale
  k_hat = (k.astype(C.F32)[None] - mean_weight * stats.mean[:, None]) / scale[:, None]
  return q_hat, k_hat


# kernel -> (q [q_len, d], k [kv_len, d], QueryStatistics, *, eps, mean_weight) -> the (q, k) the
# kernel runs on.
PER_QUERY_INPUTS: dict[str, Callable] = {
  "softmax": _fold_into_query,
  "linear": _normalize_keys_per_query,
}


def per_query_inputs(q, k, stats: QueryStatistics, *, kernel: str, eps: float, mean_weight: float):
  """What ``kernel`` runs on when each query has its own key statistics (``PER_QUERY_INPUTS``)."""
  return PER_QUERY_INPUTS[kernel](q, k, stats, eps=eps, mean_weight=mean_weight)


def normalized_one_head(q, k, mask, *, eps: float, mean_weight: float, statistics: str):
  """``(q̂ [q_len, d], k̂ [kv_len, d])`` float32 of one head: both normalised with the statistics
  named by ``statistics`` (``STATISTICS_SOURCES``), over valid rows only."""
  mean, var = STATISTICS_SOURCES[statistics](q, k, mask)
  return tuple(
    normalize_with_key_stats(x, mean, var, eps=eps, mean_weight=mean_weight) for x in (q, k)
  )


def _sequence_inputs(q, k, mask, key_valid, *, kernel, eps, mean_weight, statistics, offset):
  del key_valid, kernel, offset
  return normalized_one_head(q, k, mask, eps=eps, mean_weight=mean_weight, statistics=statistics)


def _prefix_inputs(q, k, mask, key_valid, *, kernel, eps, mean_weight, statistics, offset):
  del mask, statistics
  stats = prefix_statistics(k, key_valid, q_len=q.shape[0], offset=offset)
  return per_query_inputs(q, k, stats, kernel=kernel, eps=eps, mean_weight=mean_weight)


def _query_inputs(q, k, mask, key_valid, *, kernel, eps, mean_weight, statistics, offset):
  del key_valid, statistics, offset
  stats = masked_statistics(k, mask)
  return per_query_inputs(q, k, stats, kernel=kernel, eps=eps, mean_weight=mean_weight)


# Whose keys a query's statistics come from -> (q, k, mask, key_valid, *, kernel, eps,
# mean_weight, statistics, offset) -> the (q, k) the kernel runs on, for one head.
#   'sequence': no causal constraint and a mask the same for every query (none, padding): one
#     set of statistics per sequence, over the valid keys (the paper's definition).
#   'prefix': is_causal with such a mask: query i's statistics over the valid keys j <= i + offset.
#   'query': any mask that depends on the query: each query's over the keys it may attend to.
STATISTICS_SCOPES: dict[str, Callable] = {
  "sequence": _sequence_inputs,
  "prefix": _prefix_inputs,
  "query": _query_inputs,
}


def statistics_scope(mask, *, is_causal: bool, q_len: int) -> str:
  """The ``STATISTICS_SCOPES`` entry of a call (static: from shapes and flags only)."""
  if not C.is_key_only_mask(mask, q_len):
    return "query"
  return "prefix" if is_causal else "sequence"


def _refuse_pooled_statistics_under_masks(statistics: str, scope: str) -> None:
  if statistics != "keys" and scope != "sequence":
    raise ValueError(
      f"statistics={statistics!r} pools rows that a causal or query-dependent mask hides from "
      "some queries; use statistics='keys' (each query's own visible keys) with such masks"
    )


@driver.attention_kernel
def batchnorm_attention(
  call: driver.AttentionCall,
  *,
  kernel: str = "softmax",
  eps: float = DEFAULT_EPS,
  mean_weight: float = 1.0,
  statistics: str = "keys",
  scale: float | None = None,
  linear_eps: float = LINEAR_EPS,
  implementation: str = "auto",
):
  """Attention-BN: the kernel on queries and keys normalised with the key statistics.

  For each example, head and channel: ``μ = mean_j k_j``, ``σ² = mean_j (k_j − μ)²`` over the
  valid keys (keys that some query may attend to; padded keys never enter), then
  ``q̂ = (q − βμ)/√(σ² + ε)``, ``k̂ = (k − βμ)/√(σ² + ε)`` and the chosen kernel on ``(q̂, k̂)``;
  values are untouched. That is the call without ``is_causal`` and with a mask the same for every
  query (none, or padding). Otherwise each query ``i`` has its own statistics over the keys it may
  see (:data:`STATISTICS_SCOPES`): with ``is_causal`` (either alignment) the valid keys
  ``j <= i + offset``, through float32 prefix sums; under any other mask the keys of its mask
  row. A hidden key therefore never reaches a query, and decoding with a key/value cache (keys
  valid up to the current step) gives the rows of the full causal pass. The softmax kernel folds
  the per-query statistics into the query and keeps the fused path; the linear kernel forms each
  query's normalised keys, ``[q_len, kv_len, d]`` per head. With grouped key/value heads the
  shared head's statistics serve every query head of its group.

  Args:
    query, key, value, bias, mask and Flax's other ``attention_fn`` arguments: see
      :class:`driver.AttentionCall`.
    bias: added to the softmax logits, or a factor ``exp(bias)`` on the linear kernel (see
      ``linear.positional_factor``).
    kernel: ``'softmax'`` (``q̂ᵀk̂·scale + bias``) or ``'linear'`` (dual form, ``Φ = elu + 1``).
    eps: ε of the normalisation.
    mean_weight: β, how much of the mean is removed (0 = scale only).
    statistics: whose statistics normalise: ``'keys'`` (docs/maths.md), ``'queries'`` or
      ``'queries_and_keys'`` (pooled), each over its valid rows. The last two pool rows a
      causal or query-dependent mask hides from some queries: ValueError with such a mask.
    scale: softmax logits scale, default ``1/√d_qk``.
    linear_eps: denominator guard of the linear kernel.
    implementation: ``'auto'`` (softmax kernel: normalise, then ``jax.nn.dot_product_attention``
      when no weights or dropout are needed, see ``kernels.fused``), ``'fused'`` or
      ``'reference'``.

  Returns:
    ``[batch..., q_len, heads, d_v]`` (and the weights if requested).
  """
  scale = C.default_scale(call.shapes.d_qk) if scale is None else scale
  kernel_one_head = functools.partial(
    C.lookup(KERNELS, kernel, "kernel"),
    scale=scale,
    linear_eps=linear_eps,
    precision=call.precision,
  )
  C.lookup(STATISTICS_SOURCES, statistics, "statistics")
  scope = statistics_scope(call.mask, is_causal=call.is_causal, q_len=call.shapes.q_len)
  _refuse_pooled_statistics_under_masks(statistics, scope)
  inputs = functools.partial(
    STATISTICS_SCOPES[scope],
    kernel=kernel,
    eps=eps,
    mean_weight=mean_weight,
    statistics=statistics,
    offset=C.causal_offset(call.causal_alignment, call.shapes.q_len, call.shapes.kv_len),
  )
  q, k, v = call.heads_major()
  mask, bias = call.mask_and_bias()
  key_valid = None
  if scope == "prefix":
    key_valid = key_only_validity(call.mask, call.shapes, "")
  if call.takes_fused(implementation, softmax_kernel=kernel == "softmax"):
    q_in, k_in = C.map_heads(inputs, q, k, mask, key_valid)
    # The statistics saw the whole mask; the product takes lengths and a causal constraint alone
    # as such (cuDNN skips the masked blocks).
    mask, bias, masking = call.fused_masking()
    return call.finish(
      fused.attend(q_in, k_in, v, bias, mask, scale=scale, dtype=call.compute_dtype, **masking)
    )

  def one_head(q, k, v, bias, mask, key_valid):
    return kernel_one_head(*inputs(q, k, mask, key_valid), bias, mask), v

  return call.finish(*call.weigh_values(one_head, q, k, v, bias, mask, key_valid))
