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
from primal_dual.kernels.batchnorm import key_statistics, normalize_with_key_stats
from test_kernels_basic import FIXED_KEY_VALID, FIXED_SHAPE, attention_cases, random_qkv

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


def min_valid_keys(query, key, mask):
  """Fewest keys a query that sees any key may see: the keys Attention-BN takes its statistics
  over."""
  batch_shape, (q_len, heads), kv_len = query.shape[:-3], query.shape[-3:-1], key.shape[-3]
  seen = np.broadcast_to(mask, (*batch_shape, heads, q_len, kv_len)).sum(axis=-1)
  return int(seen[seen > 0].min(initial=kv_len))


@settings(max_examples=10)
@given(attention_cases(key_only=False), st.sampled_from(KERNEL_NAMES))
def test_matches_reference(case, kernel):
  query, key, value, mask, rng = case
  # One valid key has zero variance: the statistics are degenerate, q̂ is (q − k)/√eps, and float32
  # and float64 legitimately part (up to 1% seen with the linear kernel, whose weights then are
  # of the order of its eps). That case is pinned by test_a_single_valid_key_stays_finite.
  hypothesis.assume(min_valid_keys(query, key, mask) >= 2)
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
