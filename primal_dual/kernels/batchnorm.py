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
"""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import driver, fused
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
  del scale  # Φ = elu + 1 has no temperature; a bias multiplies the kernel by exp(bias).
  return linear_weights_one_head(q, k, bias, mask, eps=linear_eps, precision=precision)


# The kernels of Attention-BN and Attention-SH, run on one head's normalised and/or pooled queries
# and keys: (q, k, bias, mask, *, scale, linear_eps, precision) -> float32 weights [q_len, kv_len].
KERNELS: dict[str, Callable] = {
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
  values are untouched. With ``is_causal`` the statistics still pool every key (they are per
  sequence, not per prefix), so early queries see statistics of later keys; for the same reason
  decoding with a key/value cache (keys valid up to the current step) is not a full causal pass:
  each step uses the statistics of the keys seen so far. With grouped key/value heads the shared
  head's statistics serve every query head of its group.

  Args:
    query, key, value, bias, mask and Flax's other ``attention_fn`` arguments: see
      :class:`driver.AttentionCall`.
    bias: added to the softmax logits, or a factor ``exp(bias)`` on the linear kernel (see
      ``linear.positional_factor``).
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
  scale = C.default_scale(call.shapes.d_qk) if scale is None else scale
  kernel_one_head = functools.partial(
    C.lookup(KERNELS, kernel, "kernel"),
    scale=scale,
    linear_eps=linear_eps,
    precision=call.precision,
  )
  C.lookup(STATISTICS_SOURCES, statistics, "statistics")
  normalize = functools.partial(
    normalized_one_head, eps=eps, mean_weight=mean_weight, statistics=statistics
  )
  if call.takes_fused(implementation, softmax_kernel=kernel == "softmax"):
    q, k, v = call.heads_major()
    mask, bias = call.mask_and_bias()
    q_hat, k_hat = C.map_heads(normalize, q, k, mask)
    return call.finish(
      fused.attend(q_hat, k_hat, v, bias, mask, scale=scale, dtype=call.compute_dtype)
    )

  def weights_one_head(q, k, bias, mask):
    return kernel_one_head(*normalize(q, k, mask), bias, mask)

  return call.attend(weights_one_head)
