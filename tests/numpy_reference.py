"""The slow, independent float64 NumPy references of every attention kernel (explicit loops over
examples, heads, queries and keys): softmax, linear, random features, Attention-BN, Attention-SH,
BN+SH and HYLA. Nothing here imports primal_dual."""

import math

import numpy as np

RMS_EPS = 1e-6
LINEAR_EPS = 1e-6


def _broadcast(x, target, fill):
  if x is None:
    return np.full(target, fill)
  return np.broadcast_to(np.asarray(x), target)


def _elu_plus_one(x):
  return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _loop_heads(query, key, value, bias, mask, one_head):
  """Calls ``one_head(q [q_len, d], k, v, bias [q_len, kv_len], mask)`` for every (example, head).

  Returns (out [batch..., q_len, heads, d_v], weights [batch..., heads, q_len, kv_len]).
  """
  q, k, v, bias, mask = _float64_inputs(query, key, value, bias, mask, False, "top_left")
  batch_shape, (q_len, heads, _) = q.shape[:-3], q.shape[-3:]
  kv_len, d_v = k.shape[-3], v.shape[-1]
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
  """Attention-BN: per example, head and query i, μ_i and σ_i² (population) of the keys query i may
  attend to, per channel; q̂_i = (q_i − βμ_i)/√(σ_i²+ε), k̂_ij = (k_j − βμ_i)/√(σ_i²+ε); then the
  kernel ('softmax' with 1/√D and bias, or 'linear' dual) on q̂_i, k̂_ij. Under a mask that is the
  same for every query (padding) these are the valid keys' statistics. Returns (out, weights)."""

  def one_head(q, k, bias, mask):
    d = k.shape[1]
    weights = np.zeros(mask.shape)
    for i in range(q.shape[0]):
      seen = [j for j in range(k.shape[0]) if mask[i, j]]
      if not seen:
        continue
      shift, div = _stats_ref([k[j] for j in seen], eps, mean_weight)
      q_hat = ((q[i] - shift) / div)[None]
      k_hat = (k - shift) / div
      if kernel == "softmax":
        row = _softmax_weights_one_head(
          q_hat, k_hat, bias[i : i + 1], mask[i : i + 1], 1 / np.sqrt(d)
        )
      else:
        row = _linear_weights_one_head(q_hat, k_hat, mask[i : i + 1], linear_eps, bias[i : i + 1])
      weights[i] = row[0]
    return weights

  return _loop_heads(query, key, value, bias, mask, one_head)


def _causal(q_len, kv_len, alignment):
  """Query i sees key j <= i (top_left) or j <= i + kv_len - q_len (bottom_right)."""
  offset = {"top_left": 0, "bottom_right": kv_len - q_len}[alignment]
  return np.array([[j <= i + offset for j in range(kv_len)] for i in range(q_len)])


# ------------------------------------------------------------------------------------------------
# Attention-SH.
# ------------------------------------------------------------------------------------------------


def sh_windows_ref(kv_len, ratio, grid_shape=None, num_prefix_tokens=0):
  """Pooling windows as lists of key indices: prefix tokens alone, then 1-D or 2-D windows."""
  p = num_prefix_tokens
  windows = [[t] for t in range(p)]
  if grid_shape is None:
    rest = kv_len - p
    for w in range(math.ceil(rest / ratio)):
      windows.append([p + j for j in range(w * ratio, min((w + 1) * ratio, rest))])
  else:
    gh, gw = grid_shape
    for wr in range(math.ceil(gh / ratio)):
      for wc in range(math.ceil(gw / ratio)):
        windows.append(
          [
            p + y * gw + x
            for y in range(wr * ratio, min((wr + 1) * ratio, gh))
            for x in range(wc * ratio, min((wc + 1) * ratio, gw))
          ]
        )
  return windows


def _pool_ref(rows, pool):
  """rows: list of 1-D arrays (the valid keys of a window, in key order)."""
  if not rows:
    return None
  rows = np.stack(rows)
  return {"avg": rows.mean(0), "max": rows.max(0), "stride": rows[0]}[pool]


def _stats_ref(keys, eps, beta):
  """(β·mean, √(var + ε)) of a list of key vectors; mean 0 and var 1 if the list is empty."""
  if not keys:
    return 0.0, np.sqrt(1.0 + eps)
  keys = np.stack(keys)
  mean = keys.mean(0)
  return beta * mean, np.sqrt(((keys - mean) ** 2).mean(0) + eps)


def _float64_inputs(query, key, value, bias, mask, is_causal, causal_alignment):
  """(q, k, v, bias, mask) in float64 with bias and mask broadcast to [batch..., H, q, kv] and the
  causal constraint added to the mask."""
  q, k, v = (np.asarray(x, np.float64) for x in (query, key, value))
  batch_shape, (q_len, heads) = q.shape[:-3], q.shape[-3:-1]
  target = (*batch_shape, heads, q_len, k.shape[-3])
  bias = _broadcast(bias, target, 0.0).astype(np.float64)
  mask = _broadcast(mask, target, True).astype(bool)
  if is_causal:
    mask = mask & _causal(q_len, k.shape[-3], causal_alignment)
  return q, k, v, bias, mask


def scaled_head_ref(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  ratios,
  pool="avg",
  kernel="softmax",
  batchnorm=False,
  statistics="pooled",
  eps=1e-5,
  mean_weight=1.0,
  grid_shape=None,
  num_prefix_tokens=0,
  is_causal=False,
  causal_alignment="top_left",
):
  """Attention-SH (and BN+SH) with loops.

  Returns:
    (out [batch..., q_len, heads, d_v], weights): weights is a list with one array per head,
    ``[batch..., q_len, n_h]`` where n_h is the number of windows of head h.
  """
  q, k, v, bias, mask = _float64_inputs(query, key, value, bias, mask, is_causal, causal_alignment)
  batch_shape, (q_len, heads, d) = q.shape[:-3], q.shape[-3:]
  kv_len, d_v = k.shape[-3], v.shape[-1]
  out = np.zeros((*batch_shape, q_len, heads, d_v))
  weights = []
  for h in range(heads):
    windows = sh_windows_ref(kv_len, ratios[h], grid_shape, num_prefix_tokens)
    n = len(windows)
    w_h = np.zeros((*batch_shape, q_len, n))
    for b in np.ndindex(*batch_shape):
      m = mask[b + (h,)]
      valid = m.any(0)
      pk, pv, pvalid = [], [], []
      for win in windows:
        keys = [k[b + (j, h)] for j in win if valid[j]]
        vals = [v[b + (j, h)] for j in win if valid[j]]
        pvalid.append(bool(keys))
        pk.append(_pool_ref(keys, pool) if keys else np.zeros(d))
        pv.append(_pool_ref(vals, pool) if vals else np.zeros(d_v))
      for i in range(q_len):
        # A pooled key is visible when every valid key of its window is.
        visible = [
          w for w, win in enumerate(windows) if pvalid[w] and all(m[i, j] for j in win if valid[j])
        ]
        if not visible:
          continue
        qi, pki = q[b + (i, h)], pk
        if batchnorm:
          src = (
            [pk[w] for w in visible]
            if statistics == "pooled"
            else [k[b + (j, h)] for j in range(kv_len) if m[i, j]]
          )
          shift, div = _stats_ref(src, eps, mean_weight)
          qi, pki = (qi - shift) / div, [(x - shift) / div for x in pk]
        pooled_bias = np.array(
          [np.mean([bias[b + (h, i, j)] for j in windows[w] if m[i, j]]) for w in visible]
        )
        if kernel == "softmax":
          logits = np.array([qi @ pki[w] / np.sqrt(d) for w in visible]) + pooled_bias
          p = np.exp(logits - logits.max())
          p /= p.sum()
        else:  # the bias is a factor exp(b - max b) on the kernel
          s = np.array([_elu_plus_one(qi) @ _elu_plus_one(pki[w]) for w in visible])
          s = s * np.exp(pooled_bias - pooled_bias.max())
          p = s / (s.sum() + LINEAR_EPS)
        for pw, w in zip(p, visible):
          w_h[b + (i, w)] = pw
          out[b + (i, h)] += pw * pv[w]
    weights.append(w_h)
  return out, weights


# ------------------------------------------------------------------------------------------------
# HYLA.
# ------------------------------------------------------------------------------------------------


def hyla_ref(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  normalization="rms_head",
  value_network="mlp_relu",
  is_causal=False,
  causal_alignment="top_left",
):
  """HYLA with loops. Returns (out [batch..., q_len, heads, d_v], a [batch..., heads, q, kv])."""
  q, k, v, bias, mask = _float64_inputs(query, key, value, bias, mask, is_causal, causal_alignment)
  batch_shape, (q_len, heads, d) = q.shape[:-3], q.shape[-3:]
  kv_len, d_v = k.shape[-3], v.shape[-1]
  a = np.zeros(bias.shape)
  out = np.zeros((*batch_shape, q_len, heads, d_v))
  for b in np.ndindex(*batch_shape):
    s = np.zeros((heads, q_len, kv_len))
    for h in range(heads):
      for i in range(q_len):
        for j in range(kv_len):
          if mask[b + (h, i, j)]:
            s[h, i, j] = q[b + (i, h)] @ k[b + (j, h)] / np.sqrt(d) + bias[b + (h, i, j)]
    for i in range(q_len):
      for j in range(kv_len):
        if normalization == "rms_head":
          a[b + (slice(None), i, j)] = s[:, i, j] / np.sqrt(np.mean(s[:, i, j] ** 2) + RMS_EPS)
        elif normalization == "none":
          a[b + (slice(None), i, j)] = s[:, i, j]
    if normalization == "softmax":
      for h in range(heads):
        for i in range(q_len):
          seen = [j for j in range(kv_len) if mask[b + (h, i, j)]]
          if seen:
            e = np.exp(s[h, i, seen] - s[h, i, seen].max())
            a[b + (h, i, seen)] = e / e.sum()
    for i in range(q_len):
      for j in range(kv_len):
        mixed = sum(a[b + (h, i, j)] * v[b + (j, h)] for h in range(heads))
        u = {"mlp_relu": np.maximum(mixed, 0.0), "mlp_linear": mixed}.get(value_network)
        for h in range(heads):
          contribution = u if value_network != "linear" else v[b + (j, h)]
          out[b + (i, h)] += a[b + (h, i, j)] * contribution
  return out, a
