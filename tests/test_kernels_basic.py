"""Softmax, linear and random-feature kernels: references, forms, dtypes, masking, dropout, errors.

Shapes are tiny and drawn from a few values so jitted kernels are compiled a handful of times.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy_reference as ref
from primal_dual.kernels import (
  batchnorm_attention,
  linear_attention,
  padding_mask,
  random_feature_attention,
  softmax_attention,
)
from primal_dual.kernels._common import map_heads
from primal_dual.kernels.linear import draw_random_features

# rbg keys compile much faster than threefry on CPU (the Flax tests use the default threefry).
FEATURE_KEY = jax.random.key(7, impl="rbg")
NUM_FEATURES = 8

# name -> kernel with its options bound; every kernel of this task, in every form.
KERNELS = {
  "softmax": softmax_attention,
  "linear_dual": functools.partial(linear_attention, form="dual"),
  "linear_primal": functools.partial(linear_attention, form="primal"),
  "random_features": functools.partial(
    random_feature_attention, num_features=NUM_FEATURES, feature_key=FEATURE_KEY
  ),
  "bn_softmax": functools.partial(batchnorm_attention, kernel="softmax"),
  "bn_linear": functools.partial(batchnorm_attention, kernel="linear"),
}
# Kernels that form N×N weights (dropout, query-dependent masks, return_weights).
WEIGHT_KERNELS = ("softmax", "linear_dual", "bn_softmax", "bn_linear")
JITTED = {
  name: jax.jit(fn, static_argnames=("is_causal", "causal_alignment"))
  for name, fn in KERNELS.items()
}
ALIGNMENTS = ("top_left", "bottom_right")

# (batch_shape, q_len, kv_len, heads): 0, 1 and 2 batch dimensions, one query or several.
# Few shapes on purpose: each new shape is a new compilation.
SHAPES = [((), 1, 3, 1), ((2,), 4, 5, 2), ((2, 1), 3, 5, 2)]
# The shape of the fixed-input tests (shared with SHAPES so compilations are reused).
FIXED_SHAPE = ((2,), 4, 5, 2)
# Key padding of FIXED_SHAPE's two examples.
FIXED_KEY_VALID = np.array([[True] * 5, [True, True, True, False, False]])
# Each example compiles anew for a new shape or mask kind: fewer than the profile's default.
PROPERTY_SETTINGS = settings(max_examples=10)


def random_qkv(rng, batch_shape, q_len, kv_len, heads, d=4, d_v=3, scale=1.0):
  query = rng.normal(size=(*batch_shape, q_len, heads, d)) * scale
  key = rng.normal(size=(*batch_shape, kv_len, heads, d)) * scale
  value = rng.normal(size=(*batch_shape, kv_len, heads, d_v))
  return tuple(np.asarray(x, np.float32) for x in (query, key, value))


@st.composite
def attention_cases(draw, key_only: bool):
  """Random (query, key, value, mask, rng); random padding masks may empty whole rows."""
  batch_shape, q_len, kv_len, heads = draw(st.sampled_from(SHAPES))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  query, key, value = random_qkv(rng, batch_shape, q_len, kv_len, heads)
  # Always a (possibly all-True) mask: mask=None is covered by the fixed-input tests.
  if key_only or draw(st.booleans()):
    mask = np.asarray(padding_mask(rng.random((*batch_shape, kv_len)) < 0.7))
  else:
    mask = rng.random((*batch_shape, heads, q_len, kv_len)) < 0.6
  return query, key, value, mask, rng


def assert_close(actual, expected, atol=2e-5, rtol=2e-4):
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# Against the float64 NumPy references.
# ---------------------------------------------------------------------------------------------


SOFTMAX_WITH_WEIGHTS = jax.jit(functools.partial(softmax_attention, return_weights=True))
LINEAR_WITH_WEIGHTS = jax.jit(
  functools.partial(linear_attention, return_weights=True),
  static_argnames=("is_causal", "causal_alignment"),
)


@PROPERTY_SETTINGS
@given(attention_cases(key_only=False))
def test_softmax_matches_reference(case):
  query, key, value, mask, rng = case
  bias = rng.normal(size=(query.shape[-2], query.shape[-3], key.shape[-3])).astype(np.float32)
  out, weights = SOFTMAX_WITH_WEIGHTS(query, key, value, bias, mask)
  expected_out, expected_weights = ref.softmax_attention_ref(query, key, value, bias, mask)
  assert_close(out, expected_out)
  assert_close(weights, expected_weights)


@PROPERTY_SETTINGS
@given(attention_cases(key_only=False))
def test_linear_dual_matches_reference(case):
  query, key, value, mask, _ = case
  out, weights = LINEAR_WITH_WEIGHTS(query, key, value, mask=mask)
  expected_out, expected_weights = ref.linear_attention_ref(query, key, value, mask)
  assert_close(out, expected_out)
  assert_close(weights, expected_weights)


def causal_pattern(q_len, kv_len, alignment):
  """Written out: top_left lets query i see keys j <= i; bottom_right j <= i + kv_len - q_len."""
  offset = 0 if alignment == "top_left" else kv_len - q_len
  return np.array([[j <= i + offset for j in range(kv_len)] for i in range(q_len)])


def _with_causal(mask, q_len, kv_len, alignment):
  causal = causal_pattern(q_len, kv_len, alignment)
  return causal if mask is None else np.asarray(mask) & np.asarray(causal)  # NumPy broadcasting


@PROPERTY_SETTINGS
@given(attention_cases(key_only=True), st.booleans(), st.sampled_from(ALIGNMENTS))
def test_linear_primal_matches_reference(case, is_causal, alignment):
  query, key, value, mask, _ = case
  out = JITTED["linear_primal"](
    query, key, value, mask=mask, is_causal=is_causal, causal_alignment=alignment
  )
  if is_causal:
    mask = _with_causal(mask, query.shape[-3], key.shape[-3], alignment)
  expected, _ = ref.linear_attention_ref(query, key, value, mask)
  assert_close(out, expected)


@pytest.mark.parametrize("is_causal", [False, True])
def test_linear_primal_equals_dual(is_causal):
  query, key, value = random_qkv(np.random.default_rng(9), *FIXED_SHAPE)
  mask = padding_mask(FIXED_KEY_VALID)
  primal = JITTED["linear_primal"](query, key, value, mask=mask, is_causal=is_causal)
  dual = JITTED["linear_dual"](query, key, value, mask=mask, is_causal=is_causal)
  np.testing.assert_allclose(primal, dual, atol=1e-6, rtol=1e-5)


@PROPERTY_SETTINGS
@given(attention_cases(key_only=True), st.booleans(), st.sampled_from(ALIGNMENTS))
def test_random_features_match_reference(case, is_causal, alignment):
  query, key, value, mask, _ = case
  query, key = query * 0.5, key * 0.5
  out = JITTED["random_features"](
    query, key, value, mask=mask, is_causal=is_causal, causal_alignment=alignment
  )
  omega = draw_random_features(FEATURE_KEY, NUM_FEATURES, query.shape[-1])
  if is_causal:
    mask = _with_causal(mask, query.shape[-3], key.shape[-3], alignment)
  expected, _ = ref.random_feature_attention_ref(query, key, value, np.asarray(omega), mask)
  assert_close(out, expected, atol=5e-5)


@pytest.mark.parametrize("q_len,kv_len", [(3, 5), (5, 3)])
@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_causal_linear_primal_equals_dual_when_lengths_differ(alignment, q_len, kv_len):
  """top_left: query i sees keys j <= i; bottom_right: the last query sees every key."""
  query, key, value = random_qkv(np.random.default_rng(0), (2,), q_len, kv_len, 2)
  primal = JITTED["linear_primal"](query, key, value, is_causal=True, causal_alignment=alignment)
  dual, weights = LINEAR_WITH_WEIGHTS(query, key, value, is_causal=True, causal_alignment=alignment)
  np.testing.assert_allclose(primal, dual, atol=1e-5)
  np.testing.assert_array_equal(
    np.asarray(weights[0, 0] > 0), causal_pattern(q_len, kv_len, alignment)
  )


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_is_causal_equals_the_written_out_causal_mask(name, alignment):
  """Every kernel, q_len < kv_len so the alignments differ; top_left is the default."""
  query, key, value = random_qkv(np.random.default_rng(11), (2,), 3, 5, 2)
  mask = padding_mask(FIXED_KEY_VALID)  # key-only, so the primal forms take it too
  options = {} if alignment == "top_left" else dict(causal_alignment=alignment)
  causal = JITTED[name](query, key, value, mask=mask, is_causal=True, **options)
  if name in ("linear_primal", "random_features"):  # key-only masks: compare with the dual form
    reference = {"linear_primal": JITTED["linear_dual"], "random_features": _random_features_dual}[
      name
    ]
  else:
    reference = JITTED[name]
  written_out = reference(query, key, value, mask=_with_causal(mask, 3, 5, alignment))
  np.testing.assert_allclose(causal, written_out, atol=2e-5, rtol=2e-4)


def _random_features_dual(query, key, value, mask):
  omega = draw_random_features(FEATURE_KEY, NUM_FEATURES, query.shape[-1])
  out, _ = ref.random_feature_attention_ref(query, key, value, np.asarray(omega), mask)
  return out


def test_is_causal_is_top_left_like_jax_and_flax():
  query, key, value = random_qkv(np.random.default_rng(12), (2,), 3, 5, 2, d_v=4)
  ours = JITTED["softmax"](query, key, value, is_causal=True)
  np.testing.assert_allclose(
    ours, jax.nn.dot_product_attention(query, key, value, is_causal=True), atol=1e-6
  )
  flax_causal = nn.make_causal_mask(np.zeros((2, 5)))[..., :3, :]  # float32 [2, 1, 3, 5]
  np.testing.assert_allclose(
    ours, JITTED["softmax"](query, key, value, mask=flax_causal), atol=1e-6
  )


@pytest.mark.parametrize("name", KERNELS)
def test_unknown_causal_alignment_raises(name):
  with pytest.raises(ValueError, match="causal_alignment must be one of.*'diagonal'"):
    KERNELS[name](_Q, _K, _V, is_causal=True, causal_alignment="diagonal")


def test_softmax_matches_jax_and_flax_dot_product_attention():
  rng = np.random.default_rng(1)
  query, key, value = random_qkv(rng, (2,), 4, 5, 2, d=4, d_v=4)
  mask = rng.random((2, 2, 4, 5)) < 0.7
  mask[..., 0] = True  # Fully masked rows differ by design: jax.nn averages all values, we give 0.
  bias = rng.normal(size=(2, 2, 4, 5)).astype(np.float32)
  ours = jax.jit(softmax_attention)(query, key, value, bias, mask)
  np.testing.assert_allclose(
    ours, jax.jit(jax.nn.dot_product_attention)(query, key, value, bias, mask), atol=1e-6
  )
  flax_attention = jax.jit(functools.partial(nn.dot_product_attention, deterministic=True))
  np.testing.assert_allclose(ours, flax_attention(query, key, value, bias, mask), atol=1e-6)


def test_random_feature_error_falls_with_num_features():
  """The positive-random-feature estimate of softmax converges as the feature count grows."""
  query, key, value = random_qkv(np.random.default_rng(2), (2,), 4, 6, 2, scale=0.5)
  exact = softmax_attention(query, key, value)

  @functools.partial(jax.jit, static_argnums=0)
  def error(num_features, feature_key):
    approx = random_feature_attention(
      query, key, value, num_features=num_features, feature_key=feature_key
    )
    return jnp.mean(jnp.abs(approx - exact))

  errors = [
    np.mean([error(m, jax.random.key(seed, impl="rbg")) for seed in range(4)])
    for m in (16, 256, 4096)
  ]
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[2] < 0.25 * errors[0], errors


# ---------------------------------------------------------------------------------------------
# Properties shared by every kernel.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", KERNELS)
def test_bfloat16_in_bfloat16_out(name):
  """Compared with float32 on the same (bf16-rounded) inputs: only the kernel's own rounding."""
  inputs = random_qkv(np.random.default_rng(3), *FIXED_SHAPE, scale=0.5)
  half_inputs = [jnp.asarray(x, jnp.bfloat16) for x in inputs]
  mask = padding_mask(FIXED_KEY_VALID)
  full = JITTED[name](*(x.astype(jnp.float32) for x in half_inputs), mask=mask)
  half = JITTED[name](*half_inputs, mask=mask)
  assert half.dtype == jnp.bfloat16
  assert full.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(half, np.float32), full, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", KERNELS)
def test_fully_masked_rows_zeros_finite_gradients_and_jit_agrees_with_eager(name):
  """Example 0 has no valid key: every query of it attends to nothing."""
  query, key, value = random_qkv(np.random.default_rng(4), *FIXED_SHAPE)
  mask = padding_mask(np.array([[False] * 5, [True, True, False, True, True]]))
  kernel = KERNELS[name]
  out = JITTED[name](query, key, value, mask=mask)
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[0], 0.0)
  assert np.all(np.any(np.asarray(out[1]) != 0.0, axis=-1))
  np.testing.assert_allclose(kernel(query, key, value, mask=mask), out, atol=1e-6)

  grads = jax.jit(
    jax.grad(lambda q, k, v: jnp.sum(kernel(q, k, v, mask=mask) ** 2), argnums=(0, 1, 2))
  )(query, key, value)
  for grad in grads:
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("name", KERNELS)
def test_padded_keys_and_values_never_matter(name):
  """Huge values in padded positions change nothing (no overflow, no leak into statistics)."""
  query, key, value = random_qkv(np.random.default_rng(10), *FIXED_SHAPE)
  mask = padding_mask(FIXED_KEY_VALID)
  padded = ~FIXED_KEY_VALID[:, :, None, None]
  out = JITTED[name](query, key, value, mask=mask)
  changed = JITTED[name](
    query,
    np.where(padded, np.float32(300.0), key),
    np.where(padded, np.float32(1e6), value),
    mask=mask,
  )
  np.testing.assert_allclose(changed, out, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Grouped key/value heads (GQA, MQA).
# ---------------------------------------------------------------------------------------------

# name -> float64 reference output for (query, key, value, key-only mask), heads not grouped.
REFERENCES = {
  "softmax": lambda q, k, v, mask: ref.softmax_attention_ref(q, k, v, None, mask)[0],
  "linear_dual": lambda q, k, v, mask: ref.linear_attention_ref(q, k, v, mask)[0],
  "linear_primal": lambda q, k, v, mask: ref.linear_attention_ref(q, k, v, mask)[0],
  "random_features": lambda q, k, v, mask: _random_features_dual(q, k, v, mask),
  "bn_softmax": lambda q, k, v, mask: ref.batchnorm_attention_ref(q, k, v, None, mask)[0],
  "bn_linear": lambda q, k, v, mask: ref.batchnorm_attention_ref(
    q, k, v, None, mask, kernel="linear"
  )[0],
}
# (batch_shape, q_len, kv_len, heads, kv_heads, key_valid): GQA with two groups, then MQA.
GROUPED_CASES = [
  ((2,), 3, 5, 4, 2, FIXED_KEY_VALID),
  ((), 2, 4, 3, 1, np.array([True, True, True, False])),
]


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("case", range(len(GROUPED_CASES)))
def test_grouped_kv_heads_equal_reference_on_explicitly_repeated_heads(name, case):
  """Query head h uses key/value head h // (heads // kv_heads), as in Flax's GQA."""
  batch_shape, q_len, kv_len, heads, kv_heads, key_valid = GROUPED_CASES[case]
  rng = np.random.default_rng(20 + case)
  query = rng.normal(size=(*batch_shape, q_len, heads, 4)) * 0.5
  key = rng.normal(size=(*batch_shape, kv_len, kv_heads, 4)) * 0.5
  value = rng.normal(size=(*batch_shape, kv_len, kv_heads, 3))
  query, key, value = (np.asarray(x, np.float32) for x in (query, key, value))
  mask = np.asarray(padding_mask(key_valid))
  out = JITTED[name](query, key, value, mask=mask)
  assert out.shape == (*batch_shape, q_len, heads, 3)
  repeated = [np.repeat(x, heads // kv_heads, axis=-2) for x in (key, value)]
  assert_close(out, REFERENCES[name](query, *repeated, mask), atol=5e-5)


# ---------------------------------------------------------------------------------------------
# Dropout (weight-forming kernels only; primal forms refuse it).
# ---------------------------------------------------------------------------------------------


def _dropout_probe(heads=2, length=4):
  """Same q, k in every example and head, one-hot values: the output row IS the dropped weights."""
  rng = np.random.default_rng(6)
  q = np.broadcast_to(rng.normal(size=(1, length, 1, 4)), (2, length, heads, 4))
  k = np.broadcast_to(rng.normal(size=(1, length, 1, 4)), (2, length, heads, 4))
  v = np.broadcast_to(np.eye(length)[None, :, None, :], (2, length, heads, length))
  return tuple(np.asarray(x, np.float32) for x in (q, k, v))


@pytest.mark.parametrize("name", WEIGHT_KERNELS)
def test_dropout(name):
  query, key, value = _dropout_probe()
  kernel = KERNELS[name]
  rng = jax.random.key(0, impl="rbg")
  clean, weights = kernel(query, key, value, return_weights=True)
  options = dict(dropout_rate=0.5, dropout_rng=rng)

  np.testing.assert_array_equal(kernel(query, key, value, deterministic=True, **options), clean)
  shared = kernel(query, key, value, deterministic=False, broadcast_dropout=True, **options)
  np.testing.assert_array_equal(
    shared, kernel(query, key, value, deterministic=False, broadcast_dropout=True, **options)
  )
  other_rng = jax.random.key(1, impl="rbg")
  assert not np.allclose(
    shared, kernel(query, key, value, deterministic=False, dropout_rate=0.5, dropout_rng=other_rng)
  )
  # Output [b, i, h, j] = dropped weight (b, h, i, j): either 0 or weight / keep_prob.
  dropped = np.transpose(np.asarray(shared), (0, 2, 1, 3))
  assert np.all(np.isclose(dropped, 0.0) | np.isclose(dropped, 2 * np.asarray(weights)))
  assert np.any(np.isclose(dropped, 0.0) & (np.asarray(weights) > 0))
  # broadcast_dropout: one pattern for every example and head; otherwise they differ.
  np.testing.assert_array_equal(shared, np.broadcast_to(shared[:1, :, :1], shared.shape))
  separate = kernel(query, key, value, deterministic=False, broadcast_dropout=False, **options)
  assert not np.array_equal(separate, np.broadcast_to(separate[:1, :, :1], separate.shape))


@pytest.mark.parametrize("name", ["linear_primal", "random_features"])
def test_primal_forms_refuse_dropout_but_accept_deterministic(name):
  query, key, value = random_qkv(np.random.default_rng(4), *FIXED_SHAPE)
  mask = padding_mask(FIXED_KEY_VALID)
  kernel = KERNELS[name]
  with pytest.raises(ValueError, match="dropout"):
    kernel(
      query,
      key,
      value,
      mask=mask,
      dropout_rate=0.1,
      dropout_rng=jax.random.key(0),
      deterministic=False,
    )
  np.testing.assert_allclose(
    kernel(query, key, value, mask=mask, dropout_rate=0.1, deterministic=True),
    JITTED[name](query, key, value, mask=mask),
    atol=1e-6,
  )


# ---------------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------------

_Q, _K, _V = random_qkv(np.random.default_rng(8), (2,), 3, 4, 2)

BAD_SHAPES = {
  "wrong rank": ((_Q[0, 0], _K[0, 0], _V[0, 0]), r"query must have rank >= 3.*shape=\(2, 4\)"),
  # Two query heads cannot be shared out among three key/value heads.
  "heads not dividing": (
    (_Q, np.concatenate([_K, _K[..., :1, :]], -2), np.concatenate([_V, _V[..., :1, :]], -2)),
    r"divide the number of query heads.*key.shape=\(2, 4, 3, 4\)",
  ),
  "key/value heads differ": ((_Q, _K, _V[..., :1, :]), r"same number of heads.*\(2, 4, 1, 3\)"),
  "no key heads": ((_Q, _K[..., :0, :], _V[..., :0, :]), r"heads.*key.shape=\(2, 4, 0, 4\)"),
  "d_qk mismatch": ((_Q, _K[..., :3], _V), r"d_qk.*key.shape=\(2, 4, 2, 3\)"),
  "kv_len mismatch": ((_Q, _K, _V[:, :3]), r"kv_len.*value.shape=\(2, 3, 2, 3\)"),
}


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("case", BAD_SHAPES)
def test_bad_shapes_raise(name, case):
  arrays, message = BAD_SHAPES[case]
  with pytest.raises(ValueError, match=message):
    KERNELS[name](*arrays)


@pytest.mark.parametrize("name", KERNELS)
def test_bad_masks_raise(name):
  with pytest.raises(ValueError, match=r"mask.*\(3,\).*\(2, 2, (3|1), 4\)"):
    KERNELS[name](_Q, _K, _V, mask=np.ones((3,), bool))


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_masks_of_any_dtype_mean_nonzero_may_attend(name, dtype):
  """Flax's make_attention_mask gives float32 masks; any nonzero value means "may attend"."""
  query, key, value = random_qkv(np.random.default_rng(13), *FIXED_SHAPE)
  bool_mask = np.asarray(padding_mask(FIXED_KEY_VALID))
  weights = np.where(bool_mask, np.float32(2.5), np.float32(0.0))  # not just 0/1
  expected = JITTED[name](query, key, value, mask=bool_mask)
  np.testing.assert_array_equal(
    JITTED[name](query, key, value, mask=jnp.asarray(weights, dtype)), expected
  )
  assert not np.allclose(expected, JITTED[name](query, key, value), atol=1e-4)


@pytest.mark.parametrize("name", ["linear_primal", "random_features"])
def test_primal_forms_refuse_query_dependent_masks(name):
  mask = padding_mask(np.ones((2, 4), bool), np.array([[True, True, False]] * 2))
  with pytest.raises(ValueError, match=r"key-only mask.*\(2, 1, 3, 4\)"):
    KERNELS[name](_Q, _K, _V, mask=mask)


def test_linear_option_errors():
  with pytest.raises(ValueError, match="form must be one of.*'sideways'"):
    linear_attention(_Q, _K, _V, form="sideways")
  with pytest.raises(ValueError, match=r"bias.*\(3, 4\)"):
    linear_attention(_Q, _K, _V, bias=np.zeros((3, 4), np.float32), form="primal")
  with pytest.raises(ValueError, match="return_weights"):
    linear_attention(_Q, _K, _V, form="primal", return_weights=True)
  with pytest.raises(ValueError, match="form='dual'"):
    linear_attention(_Q, _K, _V, form="primal", mask=np.ones((3, 4), bool))


def test_random_feature_option_errors():
  with pytest.raises(ValueError, match="feature_key"):
    random_feature_attention(_Q, _K, _V)
  with pytest.raises(ValueError, match="num_features"):
    random_feature_attention(_Q, _K, _V, feature_key=FEATURE_KEY, num_features=0)
  with pytest.raises(ValueError, match="bias"):
    random_feature_attention(_Q, _K, _V, bias=np.zeros((3, 4), np.float32), feature_key=FEATURE_KEY)


def test_linear_dual_bias_multiplies_the_kernel():
  # A relative position bias enters the linear kernel as exp(bias), like a logit bias in softmax.
  rng = np.random.default_rng(3)
  query, key, value = (
    rng.normal(size=s).astype(np.float32) for s in ((2, 5, 3, 4), (2, 6, 3, 4), (2, 6, 3, 2))
  )
  bias = rng.normal(size=(3, 5, 6)).astype(np.float32)
  mask = rng.random((2, 1, 5, 6)) < 0.7
  out, weights = linear_attention(query, key, value, bias=bias, mask=mask, return_weights=True)
  expected_out, expected_weights = ref.linear_attention_ref(query, key, value, mask, bias=bias)
  np.testing.assert_allclose(out, expected_out, atol=1e-5)
  np.testing.assert_allclose(weights, expected_weights, atol=1e-5)
  # A constant bias per query row changes nothing; a varying one does.
  np.testing.assert_allclose(
    linear_attention(query, key, value, bias=np.ones((5, 1)) * 3.0),
    linear_attention(query, key, value),
    atol=1e-5,
  )
  assert not np.allclose(out, linear_attention(query, key, value, mask=mask), atol=1e-3)


def test_map_heads_shares_size_one_axes_instead_of_broadcasting():
  """Per-argument axes: a [1, 1, n] argument reaches every (example, head) as it is."""
  x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
  shared = np.array([[[1.0, 0.0, 2.0, 3.0]]], np.float32)
  per_head = np.array([[[1.0], [2.0], [3.0]]], np.float32)  # [1, H, 1]: shared by the examples
  got = map_heads(lambda a, b, c: a * b + c, x, shared, per_head)
  np.testing.assert_array_equal(got, x * shared + per_head)
