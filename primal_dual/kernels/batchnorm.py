"""Attention-BN: batch normalisation on the input of the SVR primal (docs/maths.md §3.4).

The keys are the SVR's training inputs, so their statistics (over the key axis, per example, head
and channel, valid keys only) normalise both the keys and the queries (the test inputs) before the
kernel runs: ``q̂ = (q − βμ)/√(σ² + ε)``, ``k̂ = (k − βμ)/√(σ² + ε)``. Normalising only the keys
would be wrong: centering the keys alone leaves softmax unchanged (``q_iᵀμ`` is constant over j),
so the queries must be moved into the same coordinates. There are no running averages: training and
evaluation compute the same thing.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import fused
from primal_dual.kernels.linear import DEFAULT_EPS as LINEAR_EPS
from primal_dual.kernels.linear import linear_weights_one_head
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
  var = jnp.einsum("k,kd->d", weights, (k - mean) ** 2) / safe_count
  return mean, jnp.where(count > 0, var, 1.0)


def normalize_with_key_stats(x, mean, var, *, eps: float, mean_weight: float):
  """``(x − β·mean)/√(var + eps)`` in float32; ``x [n, d]``, ``mean, var [d]`` -> ``[n, d]``.

  With ``eps = 0`` a constant channel (``var = 0``) divides by zero; keep ``eps > 0`` in practice.
  """
  return (x.astype(C.F32) - mean_weight * mean) / jnp.sqrt(var + eps)


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
  del scale  # Φ = elu + 1 has no temperature; a bias multiplies the kernel by exp(bias).
  return linear_weights_one_head(q, k, mask, bias=bias, eps=linear_eps, precision=precision)


# Kernels run on the normalised queries and keys of one head:
# (q̂, k̂, bias, mask, *, scale, linear_eps, precision) -> float32 weights [q_len, kv_len].
BN_KERNELS: dict[str, Callable] = {
  "softmax": _softmax_kernel,
  "linear": _linear_kernel,
}


def normalized_one_head(q, k, mask, *, eps: float, mean_weight: float, statistics: str):
  """``(q̂ [q_len, d], k̂ [kv_len, d])`` float32 of one head: both normalised with the statistics
  named by ``statistics`` (``STATISTICS_SOURCES``), over valid rows only."""
  mean, var = STATISTICS_SOURCES[statistics](q, k, mask)
  return tuple(
    normalize_with_key_stats(x, mean, var, eps=eps, mean_weight=mean_weight) for x in (q, k)
  )


def batchnorm_weights_one_head(
  q,
  k,
  bias,
  mask,
  *,
  kernel: str = "softmax",
  eps: float = DEFAULT_EPS,
  mean_weight: float = 1.0,
  statistics: str = "keys",
  scale: float | None = None,
  linear_eps: float = LINEAR_EPS,
  precision=None,
):
  """Attention-BN weights of one head: normalise q and k with the key statistics, then the kernel.

  Args:
    q: ``[q_len, d]``. k: ``[kv_len, d]``. bias, mask: ``[q_len, kv_len]`` or None.
    kernel, eps, mean_weight, statistics, scale, linear_eps, precision: as in
      :func:`batchnorm_attention`.

  Returns:
    float32 ``[q_len, kv_len]``.
  """
  q_hat, k_hat = normalized_one_head(
    q, k, mask, eps=eps, mean_weight=mean_weight, statistics=statistics
  )
  scale = C.default_scale(q.shape[-1]) if scale is None else scale
  return BN_KERNELS[kernel](
    q_hat, k_hat, bias, mask, scale=scale, linear_eps=linear_eps, precision=precision
  )


def _check_choice(name: str, value: str, registry: dict) -> None:
  if value not in registry:
    raise ValueError(f"{name} must be one of {sorted(registry)}; got {name}={value!r}")


def batchnorm_attention(
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
  return_weights: bool = False,
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
  values are untouched. With ``is_causal`` the statistics still pool every key (they are per
  sequence, not per prefix), so early queries see statistics of later keys; for the same reason
  decoding with a key/value cache (keys valid up to the current step) is not a full causal pass:
  each step uses the statistics of the keys seen so far. With grouped key/value heads the shared
  head's statistics serve every query head of its group.

  Args:
    query: ``[batch..., q_len, heads, d_qk]``.
    key: ``[batch..., kv_len, kv_heads, d_qk]``; ``kv_heads`` divides ``heads`` (grouped heads).
    value: ``[batch..., kv_len, kv_heads, d_v]``.
    bias: logits bias broadcastable to ``[batch..., heads, q_len, kv_len]``: added to the softmax
      logits, or a factor ``exp(bias)`` on the linear kernel (see ``linear.positional_factor``).
    mask: any dtype, broadcastable like ``bias``; nonzero = may attend. Fully masked rows give
      zeros.
    broadcast_dropout, dropout_rng, dropout_rate, deterministic: dropout on the weights (Flax).
    dtype: output dtype (default ``query.dtype``); statistics and weights are float32.
    precision: passed to the einsums.
    module: a Flax module to sow the weights into (``intermediates/attention_weights``).
    is_causal: add a causal mask, aligned by ``causal_alignment``.
    causal_alignment: ``'top_left'`` (default, as Flax: query ``i`` sees keys ``j <= i``) or
      ``'bottom_right'`` (``j <= i + kv_len - q_len``).
    return_weights: also return the float32 weights ``[batch..., heads, q_len, kv_len]``.
    kernel: ``'softmax'`` (``q̂ᵀk̂·scale + bias``) or ``'linear'`` (dual form, ``Φ = elu + 1``).
    eps: ε of the normalisation.
    mean_weight: β, how much of the mean is removed (0 = scale only).
    statistics: whose statistics normalise: ``'keys'`` (docs/maths.md), ``'queries'`` or
      ``'queries_and_keys'`` (pooled), each over its valid rows.
    scale: softmax logits scale, default ``1/√d_qk``.
    linear_eps: denominator guard of the linear kernel.
    implementation: ``'auto'`` (softmax kernel: normalise, then ``jax.nn.dot_product_attention``
      when no weights or dropout are needed, see ``kernels.fused``), ``'fused'`` or
      ``'reference'``.

  Returns:
    ``[batch..., q_len, heads, d_v]`` (and the weights if requested).
  """
  _check_choice("kernel", kernel, BN_KERNELS)
  _check_choice("statistics", statistics, STATISTICS_SOURCES)
  shapes = C.validate_qkv(query, key, value)
  key, value = C.repeat_kv_heads(key, value, shapes)
  mask, bias = C.prepare_mask_and_bias(mask, bias, shapes, is_causal, causal_alignment)
  q, k, v = (C.to_heads_major(x) for x in (query, key, value))
  if fused.use_fused(
    implementation,
    return_weights=return_weights,
    module=module,
    dropout_rate=dropout_rate,
    deterministic=deterministic,
    same_head_size=shapes.d_qk == shapes.d_v,
    softmax_kernel=kernel == "softmax",
  ):
    q_hat, k_hat = C.map_heads(
      lambda q, k, mask: normalized_one_head(
        q, k, mask, eps=eps, mean_weight=mean_weight, statistics=statistics
      ),
      q,
      k,
      mask,
    )
    out = fused.attend(
      q_hat, k_hat, v, bias, mask, scale=C.default_scale(shapes.d_qk) if scale is None else scale
    )
    return fused.finish(out, shapes=shapes, query=query, dtype=dtype)

  def weights_fn(q, k, bias, mask):
    return batchnorm_weights_one_head(
      q,
      k,
      bias,
      mask,
      kernel=kernel,
      eps=eps,
      mean_weight=mean_weight,
      statistics=statistics,
      scale=scale,
      linear_eps=linear_eps,
      precision=precision,
    )

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
