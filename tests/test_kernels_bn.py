"""Attention-BN (docs/maths.md §3.4): reference, invariances, why the queries are normalised, masking."""

import functools

import jax
import numpy as np
import pytest
import hypothesis
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy_reference as ref
from primal_dual.kernels import (
  batchnorm_attention,
  linear_attention,
  padding_mask,
  softmax_attention,
)
from primal_dual.kernels.batchnorm import (
  EXACT_UP_TO,
  key_statistics,
  masked_statistics,
  normalize_with_key_stats,
)
from test_kernels_basic import FIXED_KEY_VALID, FIXED_SHAPE, SHAPES, attention_cases, random_qkv

KERNEL_NAMES = ("softmax", "linear")
# kernel -> jitted Attention-BN with eps = 0, which makes the invariances exact.
BN = {
  kernel: jax.jit(functools.partial(batchnorm_attention, kernel=kernel, eps=0.0))
  for kernel in KERNEL_NAMES
}
BN_WITH_WEIGHTS = {
  kernel: jax.jit(functools.partial(batchnorm_attention, kernel=kernel, return_weights=True))
  for kernel in KERNEL_NAMES
}
# Attention-BN's kernel on raw (unnormalised) queries and keys.
PLAIN = {"softmax": jax.jit(softmax_attention), "linear": jax.jit(linear_attention)}


def fixed_inputs(seed):
  query, key, value = random_qkv(np.random.default_rng(seed), *FIXED_SHAPE)
  return query, key, value, padding_mask(FIXED_KEY_VALID)


def valid_key_statistics(key, key_valid):
  """NumPy mean and population variance over valid keys: [batch, 1, heads, d] each."""
  weights = key_valid[:, :, None, None].astype(np.float64)
  count = weights.sum(axis=1, keepdims=True)
  mean = (weights * key).sum(axis=1, keepdims=True) / count
  var = (weights * (key - mean) ** 2).sum(axis=1, keepdims=True) / count
  return mean, var


UNIT_ROUNDOFF = float(np.finfo(np.float32).eps) / 2
# The reference comparison's numerical regime: inputs that a one-ulp change moves by at most this
# (u·κ, see condition_number), a fifth of its absolute tolerance. The rest is ill-conditioned in
# itself and pinned by test_ill_conditioned_inputs_stay_finite_bounded_and_within_rounding. (The
# kernels stayed within tolerance up to u·κ = 1e-3, but for linear.elu_feature_map: elu(x) + 1
# knows Φ only to u absolute, and one query that sees one key with q̂ < −17 erred at 2.7e-5.)
WELL_CONDITIONED = 1e-5


def condition_number(query, key, mask, kernel, eps=1e-5):
  """κ: how far a one-ulp change of the float32 queries and keys can move the kernel, per unit
  roundoff, to first order, with exact statistics (float64; worst example, head, query and
  visible key).

  With ``s = √(σ² + ε)`` and ``q̂, k̂`` as in Attention-BN, a relative change ``u`` of ``q_c``
  (``k_c``) moves ``q̂_c`` (``k̂_c``) by ``u|q_c|/s_c`` (``u|k_c|/s_c``). Softmax: a logit moves by
  ``u·κ``, ``κ = Σ_c (|k̂_c||q_c| + |q̂_c||k_c|)/(s_c√d)``, and a weight by about as much.
  Linear: ``Φ'/Φ <= 1``, so a score's logarithm moves by ``u·κ``, ``κ = max_c (|q_c| +
  |k_c|)/s_c``. A variance below what float32 resolves (``s`` small next to the keys and
  queries, for instance keys that coincide in a channel with ε tiny) makes κ large, whichever
  algorithm computes it. ``query [..., q_len, heads, d]``, ``key [..., kv_len, heads, d]``,
  ``mask`` broadcastable to ``[..., heads, q_len, kv_len]``; a query that sees no key counts 0.
  """
  q, k = np.asarray(query, np.float64), np.asarray(key, np.float64)
  batch_shape, (q_len, heads, d), kv_len = q.shape[:-3], q.shape[-3:], k.shape[-3]
  mask = np.broadcast_to(mask, (*batch_shape, heads, q_len, kv_len))
  worst = 0.0
  for b in np.ndindex(*batch_shape):
    for h in range(heads):
      for i in range(q_len):
        seen = mask[b + (h, i)] != 0
        if not seen.any():
          continue
        keys, q_i = k[b][seen, h], q[b][i, h]  # [n, d], [d]
        mean, s = keys.mean(0), np.sqrt(keys.var(0) + eps)
        if kernel == "softmax":
          q_hat, k_hat = (q_i - mean) / s, (keys - mean) / s
          moved = ((np.abs(k_hat * q_i) + np.abs(q_hat * keys)) / s).sum(-1) / np.sqrt(d)
        else:
          moved = ((np.abs(q_i) + np.abs(keys)) / s).max(-1)
        worst = max(worst, float(moved.max()))
  return worst


@settings(max_examples=10)
@given(attention_cases(key_only=False), st.sampled_from(KERNEL_NAMES))
def test_matches_reference(case, kernel):
  query, key, value, mask, rng = case
  # Well-conditioned inputs only (a conditioning bound, not a count of keys): where a one-ulp
  # change of the inputs moves the result by more than a fifth of the tolerance (one visible key
  # and ε small, keys that coincide in a channel) no float32 kernel can promise the float64
  # result; test_ill_conditioned_inputs_stay_finite_bounded_and_within_rounding pins that case.
  hypothesis.assume(UNIT_ROUNDOFF * condition_number(query, key, mask, kernel) <= WELL_CONDITIONED)
  bias = rng.normal(size=(query.shape[-2], query.shape[-3], key.shape[-3])).astype(np.float32)
  out, weights = BN_WITH_WEIGHTS[kernel](query, key, value, bias, mask)
  expected_out, expected_weights = ref.batchnorm_attention_ref(
    query, key, value, bias, mask, kernel=kernel
  )
  np.testing.assert_allclose(out, expected_out, atol=5e-5, rtol=5e-4)
  np.testing.assert_allclose(weights, expected_weights, atol=5e-5, rtol=5e-4)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_invariant_to_shift_and_positive_channel_scaling(kernel):
  """With eps = 0, q, k -> A(q + c), A(k + c) (A positive diagonal, per head) changes nothing."""
  query, key, value, mask = fixed_inputs(0)
  rng = np.random.default_rng(1)
  shift = rng.normal(size=query.shape[-2:]).astype(np.float32) * 3
  scale = rng.uniform(0.2, 5.0, size=query.shape[-2:]).astype(np.float32)
  expected = BN[kernel](query, key, value, mask=mask)
  shifted = BN[kernel](query + shift, key + shift, value, mask=mask)
  scaled = BN[kernel](query * scale, key * scale, value, mask=mask)
  np.testing.assert_allclose(shifted, expected, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(scaled, expected, atol=2e-5, rtol=1e-4)
  # The raw kernel is not invariant: the test inputs are not trivially symmetric.
  assert not np.allclose(
    PLAIN[kernel](query + shift, key + shift, value, mask=mask),
    PLAIN[kernel](query, key, value, mask=mask),
    atol=1e-3,
  )


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_equals_plain_kernel_on_standardised_keys(kernel):
  """Keys with zero mean and unit variance over the valid keys: normalisation is the identity."""
  query, key, value, mask = fixed_inputs(2)
  mean, var = valid_key_statistics(key, FIXED_KEY_VALID)
  standard_key = ((key - mean) / np.sqrt(var)).astype(np.float32)
  np.testing.assert_allclose(
    BN[kernel](query, standard_key, value, mask=mask),
    PLAIN[kernel](query, standard_key, value, mask=mask),
    atol=2e-5,
    rtol=1e-4,
  )


def test_centering_only_the_keys_is_a_no_op_so_queries_must_be_normalised_too():
  """softmax_j(qᵀ(k_j − μ)) = softmax_j(qᵀk_j − qᵀμ) = softmax_j(qᵀk_j): a BN that centred only the
  keys would do nothing. Attention-BN also moves the queries, which changes the weights, and
  only that version is shift invariant."""
  query, key, value, mask = fixed_inputs(3)
  mean, var = valid_key_statistics(key, FIXED_KEY_VALID)
  plain = PLAIN["softmax"](query, key, value, mask=mask)
  centred_keys = PLAIN["softmax"](query, (key - mean).astype(np.float32), value, mask=mask)
  np.testing.assert_allclose(centred_keys, plain, atol=1e-5)

  # Centering (β = 1) vs scaling only (β = 0) differ because the queries are centred too.
  center = BN["softmax"](query, key, value, mask=mask)
  scale_only = jax.jit(functools.partial(batchnorm_attention, eps=0.0, mean_weight=0.0))(
    query, key, value, mask=mask
  )
  assert not np.allclose(center, scale_only, atol=1e-3)

  def keys_only_bn(query, key):
    mean, var = valid_key_statistics(key, FIXED_KEY_VALID)
    return PLAIN["softmax"](
      query, ((key - mean) / np.sqrt(var)).astype(np.float32), value, mask=mask
    )

  shift = np.float32(2.0)
  assert not np.allclose(
    keys_only_bn(query + shift, key + shift), keys_only_bn(query, key), atol=1e-3
  )
  np.testing.assert_allclose(
    BN["softmax"](query + shift, key + shift, value, mask=mask),
    BN["softmax"](query, key, value, mask=mask),
    atol=2e-5,
    rtol=1e-4,
  )


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_a_single_valid_key_stays_finite(kernel):
  """Zero key variance (one valid key): finite output; softmax then returns that key's value."""
  query, key, value, _ = fixed_inputs(6)
  key_valid = np.zeros(FIXED_KEY_VALID.shape, bool)
  key_valid[:, 2] = True
  out = np.asarray(BN_WITH_WEIGHTS[kernel](query, key, value, mask=padding_mask(key_valid))[0])
  assert np.isfinite(out).all()
  if kernel == "softmax":
    expected = np.broadcast_to(value[:, 2:3], out.shape)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
  else:  # weight Φ(q̂)ᵀΦ(k̂) / (Φ(q̂)ᵀΦ(k̂) + eps) ∈ [0, 1] times that value
    ratio = out / np.broadcast_to(value[:, 2:3], out.shape)
    assert ((ratio > -1e-6) & (ratio < 1 + 1e-6)).all()


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_padded_keys_never_reach_the_statistics(kernel):
  query, key, value, mask = fixed_inputs(4)
  padded = ~FIXED_KEY_VALID[:, :, None, None]
  garbage = np.random.default_rng(5).normal(size=key.shape).astype(np.float32) * 100
  out = BN[kernel](query, key, value, mask=mask)
  changed = BN[kernel](
    query, np.where(padded, garbage, key), np.where(padded, garbage[..., :3], value), mask=mask
  )
  np.testing.assert_allclose(changed, out, atol=1e-6)
  # Statistics are per example: changing example 0 leaves example 1 alone.
  other = BN[kernel](query, np.concatenate([garbage[:1], key[1:]]), value, mask=mask)
  np.testing.assert_allclose(other[1], out[1], atol=1e-6)
  assert not np.allclose(other[0], out[0], atol=1e-3)


def test_key_statistics_and_normalisation():
  rng = np.random.default_rng(6)
  keys = rng.normal(size=(5, 3)).astype(np.float32)
  valid = np.array([True, False, True, True, False])
  mean, var = key_statistics(keys, valid)
  assert mean.dtype == var.dtype == np.float32
  np.testing.assert_allclose(mean, keys[valid].mean(axis=0), atol=1e-6)
  np.testing.assert_allclose(var, keys[valid].var(axis=0), atol=1e-6)
  half_keys = keys.astype(np.float16)
  _, var_all = key_statistics(half_keys, None)  # Any input dtype: float32 statistics.
  assert var_all.dtype == np.float32
  np.testing.assert_allclose(var_all, half_keys.astype(np.float64).var(axis=0), rtol=1e-5)
  empty_mean, empty_var = key_statistics(keys, np.zeros(5, bool))
  np.testing.assert_array_equal(empty_mean, 0.0)
  np.testing.assert_array_equal(empty_var, 1.0)
  normalized = normalize_with_key_stats(keys, mean, var, eps=0.0, mean_weight=0.5)
  mean, var = np.asarray(mean), np.asarray(var)  # NumPy broadcasting in the expected value
  np.testing.assert_allclose(normalized, (keys - 0.5 * mean) / np.sqrt(var), atol=1e-5)


@pytest.mark.parametrize("statistics", ["queries", "queries_and_keys"])
def test_other_statistics_sources_agree_when_queries_are_the_keys(statistics):
  query, _, value, _ = fixed_inputs(7)
  value = value[:, :4]  # Self-attention: kv_len = q_len.
  expected = batchnorm_attention(query, query, value)
  np.testing.assert_allclose(
    batchnorm_attention(query, query, value, statistics=statistics), expected, atol=1e-5
  )


def test_option_errors():
  query, key, value, _ = fixed_inputs(8)
  with pytest.raises(ValueError, match="kernel must be one of.*'cosine'"):
    batchnorm_attention(query, key, value, kernel="cosine")
  with pytest.raises(ValueError, match="statistics must be one of.*'values'"):
    batchnorm_attention(query, key, value, statistics="values")


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_statistics_are_those_of_the_keys_each_query_sees(kernel, alignment):
  """``is_causal`` (with key padding): query i's statistics over the valid keys j <= i + offset
  (prefix sums), against the per-query NumPy reference; the softmax kernel's fused and reference
  paths agree, and an explicit causal mask (masked sums) gives the same rows."""
  query, key, value, mask = fixed_inputs(9)
  query = query[:, -4:]  # q_len < kv_len: the alignments differ
  q_len, kv_len = query.shape[-3], key.shape[-3]
  causal = ref._causal(q_len, kv_len, alignment)
  expected, _ = ref.batchnorm_attention_ref(
    query, key, value, mask=np.asarray(mask) & causal, kernel=kernel
  )
  run = functools.partial(batchnorm_attention, kernel=kernel, causal_alignment=alignment)
  implementations = ("auto", "reference") if kernel == "softmax" else ("reference",)
  for implementation in implementations:
    out = run(query, key, value, mask=mask, is_causal=True, implementation=implementation)
    np.testing.assert_allclose(out, expected, atol=5e-5, rtol=5e-4)
  explicit = np.asarray(mask) & causal
  np.testing.assert_allclose(run(query, key, value, mask=explicit), expected, atol=5e-5, rtol=5e-4)


def test_pooled_statistics_sources_are_refused_under_causal_masks():
  query, _, value, _ = fixed_inputs(10)
  for statistics in ("queries", "queries_and_keys"):
    with pytest.raises(ValueError, match="use statistics='keys'"):
      batchnorm_attention(query, query, value[:, :4], statistics=statistics, is_causal=True)


def _random_mask_case(shape_index, seed):
  """attention_cases' query-dependent branch, replayed from a seed: (q, k, v, mask, bias)."""
  batch_shape, q_len, kv_len, heads = SHAPES[shape_index]
  rng = np.random.default_rng(seed)
  query, key, value = random_qkv(rng, batch_shape, q_len, kv_len, heads)
  mask = rng.random((*batch_shape, heads, q_len, kv_len)) < 0.6
  bias = rng.normal(size=(heads, q_len, kv_len)).astype(np.float32)
  return query, key, value, mask, bias


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_nearly_coinciding_visible_keys_match_reference(kernel):
  """A query that sees two keys nearly coinciding in a channel (σ² ≈ 1e-6 next to k² ≈ 1):
  E[k²] − E[k]² lost that variance's digits and put 3 of 36 outputs (linear) 6.9e-4 off the
  float64 reference; the per-query two-pass statistics keep them."""
  query, key, value, mask, bias = _random_mask_case(2, 169)
  for run, expected in zip(
    BN_WITH_WEIGHTS[kernel](query, key, value, bias, mask),
    ref.batchnorm_attention_ref(query, key, value, bias, mask, kernel=kernel),
  ):
    np.testing.assert_allclose(run, expected, atol=5e-5, rtol=5e-4)


def _offset_inputs(seed, tokens, mask_kind):
  """1 example, 2 heads, d 4: queries and keys ``30·sign + N(0, 1)`` per channel (an offset 30×
  the spread, shared by the channel's queries and keys) and a mask of ``mask_kind`` in which
  every query sees a key."""
  rng = np.random.default_rng(seed)
  centre = 30.0 * np.sign(rng.normal(size=(2, 4)))
  query, key = (centre + rng.normal(size=(1, tokens, 2, 4)) for _ in range(2))
  value = rng.normal(size=(1, tokens, 2, 3))
  mask = {
    "none": None,
    "causal": np.tril(np.ones((tokens, tokens), bool))[None, None],  # as nn.make_causal_mask
    "random": rng.random((1, 2, tokens, tokens)) < 0.6,
  }[mask_kind]
  if mask is not None:
    mask[..., 0] |= ~mask.any(-1)
  return [np.asarray(x, np.float32) for x in (query, key, value)], mask


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize(
  "mask_kind, tokens", [("none", 8), ("causal", 8), ("random", 8), ("causal", 24)]
)
def test_keys_sharing_a_large_offset_match_reference_under_masks(kernel, mask_kind, tokens):
  """Channels whose queries and keys share an offset 30× their spread: Attention-BN is
  shift-invariant, so masks must not cost accuracy (E[k²] − E[k]² about zero was 5e-1 off,
  normwise, under an explicit causal mask). Within 1e-4 normwise of float64; 24 tokens take the
  masked products about key 0 for the queries that see more than EXACT_UP_TO keys."""
  run = jax.jit(functools.partial(batchnorm_attention, kernel=kernel))
  for seed in range(3):
    (query, key, value), mask = _offset_inputs(seed, tokens, mask_kind)
    out = np.asarray(run(query, key, value, mask=mask), np.float64)
    expected, _ = ref.batchnorm_attention_ref(query, key, value, mask=mask, kernel=kernel)
    assert np.linalg.norm(out - expected) <= 1e-4 * np.linalg.norm(expected)


@pytest.mark.parametrize("exact_up_to, shared", [(EXACT_UP_TO, False), (0, True)])
def test_masked_statistics_keep_their_digits_where_visible_keys_nearly_coincide(
  exact_up_to, shared
):
  """Keys at 30 whose visible subsets spread by 1e-3 (two coincide in a channel): each query's
  mean and variance equal the float64 ones to float32 rounding, by the two-pass of its own keys
  (any mask) and by the masked products about a key every query sees (E[k²] − E[k]² about zero
  erred by ~u·900 ≈ 5e-5, fifty times these variances). A query that sees no key: 0 and 1."""
  rng = np.random.default_rng(12)
  key = (30 + 1e-3 * rng.normal(size=(6, 3))).astype(np.float32)
  key[4, 0] = key[5, 0]
  mask = np.zeros((5, 6), bool)  # query 0 sees nothing, query 1 the two coinciding keys
  for i, seen in enumerate([(), (4, 5), (0, 1, 2), (1, 3, 4), (0, 2, 3, 5)]):
    mask[i, list(seen)] = True
  mask[1:, 0] |= shared  # without it no key is seen by every query: the shift is 0
  stats = masked_statistics(key, mask, exact_up_to=exact_up_to)
  for i in range(1, 5):
    seen = key[mask[i]].astype(np.float64)
    np.testing.assert_allclose(stats.mean[i], seen.mean(0), rtol=1e-7)
    np.testing.assert_allclose(stats.var[i], seen.var(0), rtol=1e-4, atol=1e-12)
  if not shared:
    assert stats.var[1, 0] == 0.0  # coinciding keys, two-pass: exactly no variance
  np.testing.assert_array_equal(stats.mean[0], 0.0)
  np.testing.assert_array_equal(stats.var[0], 1.0)


@pytest.mark.parametrize("exact_up_to", [EXACT_UP_TO, 0])
def test_masked_statistics_derivatives_are_the_two_pass_formulas(exact_up_to):
  """Forward and reverse derivatives equal autodiff of the textbook two-pass formulas on either
  path, and a hidden key gets an exact zero."""
  rng = np.random.default_rng(13)
  key = rng.normal(size=(5, 3)).astype(np.float32)
  mask = rng.random((4, 5)) < 0.6
  mask[:, 0] = True
  visible = mask.astype(np.float32)

  def two_pass(k):
    count = visible.sum(-1, keepdims=True)
    mean = visible @ k / count
    deviation = visible[:, :, None] * (k[None] - mean[:, None])
    return mean, (deviation**2).sum(1) / count

  def kernel_statistics(k):
    stats = masked_statistics(k, mask, exact_up_to=exact_up_to)
    return stats.mean, stats.var

  hidden = ~mask[:, None, :, None]  # [q, 1, kv, 1] against the Jacobians' [q, d, kv, d]
  for jacobian in (jax.jacfwd, jax.jacrev):
    for got, expected in zip(jacobian(kernel_statistics)(key), jacobian(two_pass)(key)):
      np.testing.assert_allclose(got, expected, atol=1e-5)
      assert np.all(np.where(hidden, got, 0.0) == 0.0)


def _ill_conditioned_inputs():
  """Keys and queries at 30 ± 0.5; query 0 sees no key, query 1 one key, query 2 two keys that
  coincide in channel 0 and are one ulp apart in channel 1 (σ² 0 and 9e-13: below what float32
  resolves at 30), query 3 every key."""
  rng = np.random.default_rng(11)
  key = (30 + 0.5 * rng.normal(size=(1, 5, 1, 4))).astype(np.float32)
  key[0, 2, 0, 0] = key[0, 1, 0, 0]
  key[0, 2, 0, 1] = np.nextafter(key[0, 1, 0, 1], np.float32(np.inf))
  query = (30 + 0.5 * rng.normal(size=(1, 4, 1, 4))).astype(np.float32)
  value = rng.normal(size=(1, 5, 1, 4)).astype(np.float32)  # d_v = d: the fused path serves
  mask = np.zeros((1, 1, 4, 5), bool)
  mask[0, 0, 1, 3] = True
  mask[0, 0, 2, 1:3] = True
  mask[0, 0, 3] = True
  return query, key, value, mask


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_ill_conditioned_inputs_stay_finite_bounded_and_within_rounding(kernel):
  """Beyond the reference comparison's conditioning bound: what the kernel still promises.
  Finite; zeros for a query that sees no key; weights in [0, 1], zero on hidden keys, rows that
  sum to 1 (softmax) or at most 1 (linear); statistics equal to the float64 ones rounded to
  float32 (a zero variance exactly zero); and within 4·u·κ of the float64 result, the change that
  a few ulps of the inputs could make."""
  query, key, value, mask = _ill_conditioned_inputs()
  rows = np.arange(mask.shape[-2])[:, None]
  kappa = np.array([condition_number(query, key, mask & (rows == i), kernel) for i in rows[:, 0]])
  assert UNIT_ROUNDOFF * kappa.max() > 10 * WELL_CONDITIONED  # what test_matches_reference skips
  out, weights = (np.asarray(x) for x in BN_WITH_WEIGHTS[kernel](query, key, value, mask=mask))
  assert np.isfinite(out).all() and np.isfinite(weights).all()
  np.testing.assert_array_equal(out[:, 0], 0.0)
  assert np.all(weights[~mask] == 0.0) and np.all((weights >= 0) & (weights <= 1))
  sums = weights.sum(-1)[mask.any(-1)]
  if kernel == "softmax":
    np.testing.assert_allclose(sums, 1.0, atol=1e-6)
    fused = batchnorm_attention(query, key, value, mask=mask, implementation="fused")
    np.testing.assert_allclose(fused, out, atol=1e-5)
  else:
    assert np.all(sums <= 1 + 1e-6)
  stats = masked_statistics(key[0, :, 0], mask[0, 0])
  assert stats.var[2, 0] == 0.0
  np.testing.assert_allclose(stats.var[2], key[0, 1:3, 0].astype(np.float64).var(0), rtol=1e-6)
  expected_out, expected_weights = ref.batchnorm_attention_ref(
    query, key, value, mask=mask, kernel=kernel
  )
  bound = 4 * UNIT_ROUNDOFF * kappa  # per query
  weights_bound = np.broadcast_to(bound[:, None] + 1e-7, weights.shape)
  np.testing.assert_array_less(np.abs(weights - expected_weights), weights_bound)
  out_bound = bound[:, None, None] * np.abs(value).sum(1)  # Σ_j |δw_j||v_j|, [q, heads, d_v]
  np.testing.assert_array_less(
    np.abs(out - expected_out), np.broadcast_to(out_bound + 1e-7, out.shape)
  )
