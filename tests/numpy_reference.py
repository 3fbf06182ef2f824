"""Slow, independent NumPy references for the attention kernels (float64, explicit loops over
examples and heads). Nothing here imports primal_dual."""

import numpy as np


def _broadcast(x, batch_shape, heads, q_len, kv_len, fill):
  target = (*batch_shape, heads, q_len, kv_len)
  if x is None:
    return np.full(target, fill)
  return np.broadcast_to(np.asarray(x), target)


def _elu_plus_one(x):
  return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _loop_heads(query, key, value, bias, mask, one_head):
  """Calls ``one_head(q [q_len, d], k, v, bias [q_len, kv_len], mask)`` for every (example, head).

  Returns (out [batch..., q_len, heads, d_v], weights [batch..., heads, q_len, kv_len]).
  """
  q, k, v = (np.asarray(x, np.float64) for x in (query, key, value))
  batch_shape, (q_len, heads, _) = q.shape[:-3], q.shape[-3:]
  kv_len, d_v = k.shape[-3], v.shape[-1]
  bias = _broadcast(bias, batch_shape, heads, q_len, kv_len, 0.0).astype(np.float64)
  mask = _broadcast(mask, batch_shape, heads, q_len, kv_len, True).astype(bool)
  out = np.zeros((*batch_shape, q_len, heads, d_v))
  weights = np.zeros((*batch_shape, heads, q_len, kv_len))
  for b in np.ndindex(*batch_shape):
    for h in range(heads):
      w = one_head(q[b][:, h], k[b][:, h], bias[b + (h,)], mask[b + (h,)])
      weights[b + (h,)] = w
      for i in range(q_len):
        for j in range(kv_len):
          out[b + (i, h)] += w[i, j] * v[b + (j, h)]
  return out, weights


def _linear_weights_one_head(q, k, mask, eps, bias=None):
  """A_ij = Φ(q_i)·Φ(k_j) e^{b_ij} m_ij / (Σ_j' Φ(q_i)·Φ(k_j') e^{b_ij'} m_ij' + eps), Φ = elu + 1.

  The bias factor is shifted by the row maximum of the bias (as the kernel does, so that eps
  plays the same role)."""
  q_len, kv_len = q.shape[0], k.shape[0]
  bias = np.zeros((q_len, kv_len)) if bias is None else np.asarray(bias, np.float64)
  weights = np.zeros((q_len, kv_len))
  for i in range(q_len):
    shift = max(bias[i])
    scores = [
      float(_elu_plus_one(q[i]) @ _elu_plus_one(k[j])) * np.exp(bias[i, j] - shift)
      if mask[i, j]
      else 0.0
      for j in range(kv_len)
    ]
    total = sum(scores) + eps
    weights[i] = [s / total for s in scores]
  return weights


def _softmax_weights_one_head(q, k, bias, mask, scale):
  q_len, kv_len = q.shape[0], k.shape[0]
  weights = np.zeros((q_len, kv_len))
  for i in range(q_len):
    valid = [j for j in range(kv_len) if mask[i, j]]
    if not valid:
      continue
    logits = np.array([q[i] @ k[j] * scale + bias[i, j] for j in valid])
    p = np.exp(logits - logits.max())
    weights[i, valid] = p / p.sum()
  return weights


def softmax_attention_ref(query, key, value, bias=None, mask=None, scale=None):
  """out[..., i, h, :] = Σ_j softmax_j(q·k/√D + bias) v_j over valid j; zeros if none valid.

  Returns (out [batch..., q_len, heads, d_v], weights [batch..., heads, q_len, kv_len]).
  """
  scale = 1.0 / np.sqrt(np.shape(query)[-1]) if scale is None else scale
  return _loop_heads(
    query, key, value, bias, mask, lambda q, k, b, m: _softmax_weights_one_head(q, k, b, m, scale)
  )


def linear_attention_ref(query, key, value, mask=None, eps=1e-6, bias=None):
  """Dual-form linear attention (Φ = elu + 1, no 1/√D; a bias multiplies the kernel by e^bias).

  Returns (out, weights) like softmax."""
  return _loop_heads(
    query, key, value, bias, mask, lambda q, k, b, m: _linear_weights_one_head(q, k, m, eps, b)
  )


def random_feature_attention_ref(query, key, value, omega, mask=None):
  """Softmax attention with the kernel exp(q·k/√D) replaced by Φ(q)·Φ(k), written in dual form.

  Φ(x) = exp(ω x̃ − |x̃|²/2)/√m with x̃ = x/D^¼, ``omega [m, D]``. Rows with no valid key are zero.
  """
  omega = np.asarray(omega, np.float64)
  m = omega.shape[0]

  def features(x):
    x = x / x.shape[-1] ** 0.25
    return np.array([np.exp(w @ x - 0.5 * x @ x) for w in omega]) / np.sqrt(m)

  def one_head(q, k, bias, mask):
    weights = np.zeros((q.shape[0], k.shape[0]))
    for i in range(q.shape[0]):
      scores = [
        float(features(q[i]) @ features(k[j])) if mask[i, j] else 0.0 for j in range(k.shape[0])
      ]
      if sum(scores) > 0:
        weights[i] = np.array(scores) / sum(scores)
    return weights

  return _loop_heads(query, key, value, None, mask, one_head)


def batchnorm_attention_ref(
  query,
  key,
  value,
  bias=None,
  mask=None,
  kernel="softmax",
  eps=1e-5,
  mean_weight=1.0,
  linear_eps=1e-6,
):
  """Attention-BN: per example and head, μ and σ² (population) of the keys over the valid keys
  (keys some query may attend to), per channel; q̂ = (q − βμ)/√(σ²+ε), k̂ likewise; then the kernel
  ('softmax' with 1/√D and bias, or 'linear' dual) on q̂, k̂. Returns (out, weights)."""

  def one_head(q, k, bias, mask):
    valid = [j for j in range(k.shape[0]) if mask[:, j].any()]
    d = k.shape[1]
    mean, var = np.zeros(d), np.ones(d)
    if valid:
      for c in range(d):
        column = [k[j, c] for j in valid]
        mean[c] = sum(column) / len(column)
        var[c] = sum((x - mean[c]) ** 2 for x in column) / len(column)
    q_hat = (q - mean_weight * mean) / np.sqrt(var + eps)
    k_hat = (k - mean_weight * mean) / np.sqrt(var + eps)
    if kernel == "softmax":
      return _softmax_weights_one_head(q_hat, k_hat, bias, mask, 1.0 / np.sqrt(d))
    return _linear_weights_one_head(q_hat, k_hat, mask, linear_eps, bias)

  return _loop_heads(query, key, value, bias, mask, one_head)
