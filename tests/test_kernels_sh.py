"""Attention-SH and Attention-BN+SH (primal_dual/kernels/scaled_head.py) against float64 loops."""

import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import helpers
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from primal_dual.kernels import scaled_head as sh
from primal_dual.kernels.batchnorm import batchnorm_attention
from primal_dual.kernels.softmax import softmax_attention
from numpy_reference import softmax_attention_ref
from numpy_reference import scaled_head_ref, sh_windows_ref

STATIC = (
  "ratios",
  "pool",
  "kernel",
  "batchnorm",
  "statistics",
  "grid_shape",
  "num_prefix_tokens",
  "is_causal",
  "causal_alignment",
  "return_weights",
  "deterministic",
  "dropout_rate",
)
sh_jit = jax.jit(sh.scaled_head_attention, static_argnames=STATIC)
bn_jit = jax.jit(batchnorm_attention, static_argnames=("kernel",))
softmax_jit = jax.jit(
  softmax_attention, static_argnames=("return_weights", "deterministic", "dropout_rate")
)
TOL = dict(rtol=2e-4, atol=2e-5)


random_qkv = helpers.random_qkv
padding_mask = helpers.padding_mask


def head_weights(weights, ratios):
  """Per-head weights ``[batch..., q_len, n_h]`` from the per-group tuple, via head_groups."""
  per_head = {}
  for group_weights, (_, heads) in zip(weights, sh.head_groups(ratios)):
    for row, h in enumerate(heads):
      per_head[h] = np.asarray(group_weights)[..., row, :, :]
  return [per_head[h] for h in range(len(ratios))]


def assert_matches_reference(q, k, v, bias, mask, **options):
  out, weights = sh_jit(q, k, v, bias, mask, return_weights=True, **options)
  ref_out, ref_weights = scaled_head_ref(q, k, v, bias, mask, **options)
  np.testing.assert_allclose(out, ref_out, **TOL)
  for got, want in zip(head_weights(weights, options["ratios"]), ref_weights):
    np.testing.assert_allclose(got, want, **TOL)


CASES = [
  # batch_shape, q_len, kv_len, options, with bias
  ((), 4, 7, dict(ratios=(1, 2, 3)), True),
  ((2,), 3, 9, dict(ratios=(2, 4), pool="max"), True),
  ((2, 1), 5, 5, dict(ratios=(3, 1), pool="stride", is_causal=True), False),
  ((2,), 3, 13, dict(ratios=(2, 1, 3), grid_shape=(3, 4), num_prefix_tokens=1), True),
  (
    (1, 2),
    3,
    12,
    dict(ratios=(3, 2), grid_shape=(3, 4), pool="max", batchnorm=True, statistics="full"),
    False,
  ),
  ((2,), 4, 8, dict(ratios=(3, 1), num_prefix_tokens=2, pool="stride"), True),
  ((2,), 4, 7, dict(ratios=(2, 3), kernel="linear", batchnorm=True, is_causal=True), False),
  ((2,), 4, 7, dict(ratios=(1, 2), is_causal=True, causal_alignment="bottom_right"), True),
  ((2,), 4, 7, dict(ratios=(1, 3, 2), batchnorm=True), True),
  # The linear kernel takes a bias as a factor exp(bias), as batchnorm_attention's does.
  ((2,), 4, 7, dict(ratios=(2, 1), kernel="linear"), True),
]


@pytest.mark.parametrize("batch_shape,q_len,kv_len,options,with_bias", CASES)
def test_matches_numpy_reference(batch_shape, q_len, kv_len, options, with_bias):
  rng = np.random.default_rng(len(CASES) * q_len + kv_len)
  heads = len(options["ratios"])
  q, k, v = random_qkv(rng, batch_shape, q_len, kv_len, heads)
  # At least two pooled keys per head: BN statistics of a single key are degenerate (σ = 0).
  mask = padding_mask(rng, batch_shape, kv_len, min_valid=min(kv_len, max(options["ratios"]) + 1))
  bias = (
    rng.normal(size=(*batch_shape, heads, q_len, kv_len)).astype(np.float32) if with_bias else None
  )
  assert_matches_reference(q, k, v, bias, mask, **options)


@pytest.mark.parametrize(
  "kv_heads,options",
  [
    (2, dict(ratios=(1, 2, 2, 3))),  # GQA: head pairs (0, 1) and (2, 3) share keys and values
    (1, dict(ratios=(2, 1, 3), batchnorm=True, is_causal=True)),  # MQA, BN+SH
  ],
)
def test_grouped_kv_heads_equal_reference_on_explicitly_repeated_heads(kv_heads, options):
  """Each query head pools (and, with BN, normalises by) its shared key/value head."""
  rng = np.random.default_rng(31)
  heads = len(options["ratios"])
  q, _, _ = random_qkv(rng, (2,), 4, 7, heads)
  _, k, v = random_qkv(rng, (2,), 4, 7, kv_heads)
  mask = padding_mask(rng, (2,), 7, min_valid=4)
  out, weights = sh_jit(q, k, v, None, mask, return_weights=True, **options)
  repeated = [np.repeat(x, heads // kv_heads, axis=-2) for x in (k, v)]
  ref_out, ref_weights = scaled_head_ref(q, *repeated, None, mask, **options)
  np.testing.assert_allclose(out, ref_out, **TOL)
  for got, want in zip(head_weights(weights, options["ratios"]), ref_weights):
    np.testing.assert_allclose(got, want, **TOL)


@given(data=st.data())
def test_property_matches_reference(data):
  batch_shape = data.draw(st.sampled_from([(), (2,), (1, 2)]))
  ratios = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
  # Ratios above the pooled length are refused (test_ratio_above_the_length_raises).
  kv_len = data.draw(st.integers(max(ratios) + 1, 9))
  q_len = data.draw(st.integers(1, 4))
  options = dict(
    ratios=ratios,
    pool=data.draw(st.sampled_from(sorted(sh.POOLS))),
    num_prefix_tokens=data.draw(st.integers(0, min(1, kv_len))),
    is_causal=data.draw(st.booleans()),
    batchnorm=data.draw(st.booleans()),
    causal_alignment=data.draw(st.sampled_from(["top_left", "bottom_right"])),
    statistics=data.draw(st.sampled_from(sorted(sh.STATISTICS_SOURCES))),
  )
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
  q, k, v = random_qkv(rng, batch_shape, q_len, kv_len, len(ratios))
  mask = data.draw(
    st.sampled_from(
      [
        None,
        padding_mask(rng, batch_shape, kv_len, min_valid=0),
        rng.random((*batch_shape, 1, 1, kv_len)) < 0.7,
      ]
    )
  )  # keys masked anywhere
  assert_matches_reference(q, k, v, None, mask, **options)


def test_unit_ratios_equal_softmax_dropout_included():
  rng = np.random.default_rng(1)
  q, k, v = random_qkv(rng, (2,), 4, 6, 3)
  mask = padding_mask(rng, (2,), 6)
  bias = rng.normal(size=(2, 3, 4, 6)).astype(np.float32)
  dropout = dict(dropout_rng=jax.random.key(0), dropout_rate=0.3, deterministic=False)
  got, (weights,) = sh_jit(q, k, v, bias, mask, ratios=(1, 1, 1), return_weights=True, **dropout)
  want, want_weights = softmax_jit(q, k, v, bias, mask, return_weights=True, **dropout)
  np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(weights, want_weights, **TOL)
  undropped = softmax_jit(q, k, v, bias, mask)
  assert not np.allclose(got, undropped)  # dropout did act


@pytest.mark.parametrize("kernel", ["softmax", "linear"])
def test_unit_ratios_with_batchnorm_equal_batchnorm_attention(kernel):
  rng = np.random.default_rng(2)
  q, k, v = random_qkv(rng, (2,), 4, 7, 2)
  mask = padding_mask(rng, (2,), 7)
  want = bn_jit(q, k, v, None, mask, kernel=kernel)
  stats = "full" if kernel == "linear" else "pooled"  # both sources, without a 4th compile
  got = sh_jit(q, k, v, None, mask, ratios=(1, 1), batchnorm=True, kernel=kernel, statistics=stats)
  np.testing.assert_allclose(got, want, **TOL)


def test_linear_kernel_takes_a_bias_as_batchnorm_attention_does():
  """BN+SH with unit ratios and the linear kernel is Attention-BN's linear kernel, bias included."""
  rng = np.random.default_rng(21)
  q, k, v = random_qkv(rng, (2,), 4, 7, 2)
  mask = padding_mask(rng, (2,), 7)
  bias = rng.normal(size=(2, 4, 7)).astype(np.float32)
  want = bn_jit(q, k, v, bias, mask, kernel="linear")
  got = sh_jit(q, k, v, bias, mask, ratios=(1, 1), batchnorm=True, kernel="linear")
  np.testing.assert_allclose(got, want, **TOL)
  assert not np.allclose(
    got, sh_jit(q, k, v, None, mask, ratios=(1, 1), batchnorm=True, kernel="linear")
  )


def test_average_pooling_commutes_with_projection():
  """Pooling K/V after their projections = pooling the inputs, then projecting (docs/maths.md §3.5)."""
  rng = np.random.default_rng(3)
  batch, kv_len, d_in, heads, d, ratio = 2, 7, 5, 2, 3, 3
  x = rng.normal(size=(batch, kv_len, d_in))
  key_proj, value_proj = rng.normal(size=(2, d_in, heads, d))
  q = rng.normal(size=(batch, 4, heads, d)).astype(np.float32)
  key_valid = np.arange(kv_len) < np.array([[7], [5]])  # lengths 7 and 5
  project = lambda inputs, w: np.einsum("bni,ihd->bnhd", inputs, w).astype(np.float32)
  mask = key_valid[:, None, None, :]
  got = sh_jit(q, project(x, key_proj), project(x, value_proj), None, mask, ratios=(ratio,) * heads)

  windows = sh_windows_ref(kv_len, ratio)
  pooled_x = np.zeros((batch, len(windows), d_in))
  pooled_valid = np.zeros((batch, len(windows)), bool)
  for b in range(batch):
    for w, win in enumerate(windows):
      seen = [j for j in win if key_valid[b, j]]
      pooled_valid[b, w] = bool(seen)
      if seen:
        pooled_x[b, w] = x[b, seen].mean(0)
  want, _ = softmax_attention_ref(
    q,
    project(pooled_x, key_proj),
    project(pooled_x, value_proj),
    mask=pooled_valid[:, None, None, :],
  )
  np.testing.assert_allclose(got, want, **TOL)


def test_weights_have_pooled_width_per_group():
  rng = np.random.default_rng(4)
  ratios = (4, 1, 2, 4)
  q, k, v = random_qkv(rng, (2, 1), 3, 9, len(ratios))
  _, weights = sh_jit(q, k, v, None, None, ratios=ratios, return_weights=True)
  groups = sh.head_groups(ratios)
  assert groups == ((1, (1,)), (2, (2,)), (4, (0, 3)))
  assert [w.shape for w in weights] == [(2, 1, 1, 3, 9), (2, 1, 1, 3, 5), (2, 1, 2, 3, 3)]
  assert [sh.pooled_length(9, r) for r, _ in groups] == [9, 5, 3]
  for w in weights:  # no mask: every pooled key is visible, rows sum to one
    np.testing.assert_allclose(np.sum(w, -1), 1.0, rtol=1e-5)


def _dot_general_shapes(jaxpr):
  """Output shapes of every dot_general in a closed jaxpr, nested jaxprs included."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      shapes.append(tuple(eqn.outvars[0].aval.shape))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes.extend(_dot_general_shapes(sub))
  return shapes


def test_compiled_computation_works_on_pooled_length():
  ratios, q_len, kv_len, d = (1, 1, 2, 2, 4, 4, 8, 8), 5, 24, 4
  q, k, v = random_qkv(np.random.default_rng(5), (1,), q_len, kv_len, len(ratios), d=d, d_v=d)
  fn = functools.partial(sh.scaled_head_attention, ratios=ratios, implementation="reference")
  shapes = _dot_general_shapes(jax.make_jaxpr(fn)(q, k, v).jaxpr)
  # Per group of 2 heads: logits [B, 2, q_len, ceil(N/r)] and weights·values [B, 2, q_len, d_v].
  # No product ever has the full width N for heads with r > 1.
  expected = [(1, 2, q_len, kv_len // r) for r in (1, 2, 4, 8)] + [(1, 2, q_len, d)] * 4
  assert sorted(shapes) == sorted(expected), shapes
  # The fused path (jax.nn.dot_product_attention per group) attends on the same pooled lengths:
  # one logits product per group, of width ceil(N/r), and only the ratio-1 group's is N wide.
  fused_shapes = _dot_general_shapes(
    jax.make_jaxpr(
      functools.partial(sh.scaled_head_attention, ratios=ratios, implementation="fused")
    )(q, k, v).jaxpr
  )
  widths = [shape[-1] for shape in fused_shapes]
  assert {kv_len // r for r in (1, 2, 4, 8)} <= set(widths), fused_shapes
  assert widths.count(kv_len) == 1, fused_shapes

  # XLA's own count shrinks roughly like attention_cost_ratio once attention dominates.
  q, k, v = random_qkv(np.random.default_rng(5), (1,), 64, 64, len(ratios), d=8, d_v=8)

  def flops(r):
    compiled = (
      jax.jit(functools.partial(sh.scaled_head_attention, ratios=r)).lower(q, k, v).compile()
    )
    return compiled.cost_analysis()["flops"]

  measured = flops(ratios) / flops((1,) * len(ratios))
  expected = sh.attention_cost_ratio(ratios)
  assert expected == pytest.approx((2 + 1 + 0.5 + 0.25) / 8)
  assert measured == pytest.approx(expected, abs=0.05), (measured, expected)


def test_2d_pooling_keeps_prefix_tokens_hand_computed():
  """CLS + 4×4 grid, ratio 2: windows {1,2,5,6}, {3,4,7,8}, {9,10,13,14}, {11,12,15,16}."""
  kv_len = 17
  value = np.arange(kv_len, dtype=np.float32).reshape(1, kv_len, 1, 1)
  key = np.zeros((1, kv_len, 1, 2), np.float32)
  query = np.zeros((1, 1, 1, 2), np.float32)  # uniform weights over the visible pooled keys
  options = dict(ratios=(2,), grid_shape=(4, 4), num_prefix_tokens=1, return_weights=True)
  out, (weights,) = sh_jit(query, key, value, None, None, **options)
  assert weights.shape == (1, 1, 1, 5)
  np.testing.assert_allclose(out[0, 0, 0, 0], np.mean([0, 3.5, 5.5, 11.5, 13.5]), rtol=1e-6)

  valid = np.isin(np.arange(kv_len), [0, 5, 6, 11])  # windows 2 and 3 have no valid key
  out, (weights,) = sh_jit(query, key, value, None, valid[None, None, None], **options)
  np.testing.assert_allclose(weights[0, 0, 0], [1 / 3, 1 / 3, 0, 0, 1 / 3], rtol=1e-6)
  np.testing.assert_allclose(out[0, 0, 0, 0], np.mean([0, 5.5, 11]), rtol=1e-6)


@pytest.mark.parametrize(
  "pool,pooled_values", [("avg", [1.5, 5, 6]), ("max", [2, 5, 6]), ("stride", [1, 5, 6])]
)
def test_1d_pools_skip_invalid_keys_hand_computed(pool, pooled_values):
  """7 keys, ratio 3, keys 0, 3, 4 invalid: windows {1, 2}, {5}, {6} of valid keys."""
  value = np.array([10, 1, 2, 30, 40, 5, 6], np.float32).reshape(1, 7, 1, 1)  # invalid keys big
  key, query = np.zeros((1, 7, 1, 2), np.float32), np.zeros((1, 1, 1, 2), np.float32)
  valid = np.array([False, True, True, False, False, True, True])
  out = sh_jit(query, key, value, None, valid[None, None, None], ratios=(3,), pool=pool)
  np.testing.assert_allclose(out[0, 0, 0, 0], np.mean(pooled_values), rtol=1e-6)


def test_key_windows_uneven_grid_hand_listed():
  """CLS + 3×3 grid, ratio 2 (ceil on both sides): {0} | {1,2,4,5} {3,6} {7,8} {9}."""
  windows = sh.key_windows(10, 2, (3, 3), 1)
  listed = [
    sorted(int(i) for i, real in zip(idx, ok) if real)
    for idx, ok in zip(windows.index, windows.real)
  ]
  assert listed == [[0], [1, 2, 4, 5], [3, 6], [7, 8], [9]]
  assert sh.pooled_length(10, 2, grid_shape=(3, 3), num_prefix_tokens=1) == 5
  assert sh.pooled_length(7, 3) == 3


def test_fully_masked_window_and_query_row():
  rng = np.random.default_rng(6)
  q, k, v = random_qkv(rng, (2,), 3, 6, 2)
  key_valid = np.array(
    [
      [True, True, False, False, True, False],  # window 1 of ratio 2 empty
      [False] * 6,
    ]
  )  # example 1: nothing to attend to
  mask = key_valid[:, None, None, :]

  def loss(q, k, v):
    out, weights = sh.scaled_head_attention(q, k, v, mask=mask, ratios=(2, 3), return_weights=True)
    return jnp.sum(out**2), (out, weights)

  grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
  grads, (out, (w2, _)) = grad_fn(q, k, v)
  np.testing.assert_array_equal(w2[0, 0, :, 1], 0.0)
  np.testing.assert_allclose(np.sum(w2[0], -1), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(out[1], 0.0)
  assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("ratios", [(1, 2), (1, 0, 2), (1, 2.0, 2), (True, 1, 1), 2, (1, 2, 3, 4)])
def test_bad_ratios_raise(ratios):
  q, k, v = random_qkv(np.random.default_rng(7), (), 2, 4, 3)
  with pytest.raises(ValueError, match=r"ratios.*heads=3"):
    sh.scaled_head_attention(q, k, v, ratios=ratios)


def test_traced_ratios_raise():
  q, k, v = random_qkv(np.random.default_rng(7), (), 2, 4, 2)
  with pytest.raises(ValueError, match=r"ratios.*heads=2"):
    jax.jit(lambda r: sh.scaled_head_attention(q, k, v, ratios=r))(jnp.array([1, 2]))


@pytest.mark.parametrize(
  "options,match",
  [
    (dict(pool="median"), "pool"),
    (dict(kernel="cosine"), "kernel"),
    (dict(statistics="batch"), "statistics"),
    (dict(grid_shape=(2, 2)), "grid_shape"),
    (dict(grid_shape=(2, 2), num_prefix_tokens=1), "grid_shape"),
    (dict(num_prefix_tokens=7), "num_prefix_tokens"),
    (dict(kernel="linear", bias=np.zeros((3, 6))), "bias"),
  ],
)
def test_bad_options_raise(options, match):
  q, k, v = random_qkv(np.random.default_rng(8), (), 2, 6, 2)
  with pytest.raises(ValueError, match=match):
    sh.scaled_head_attention(q, k, v, ratios=(1, 2), **options)


def test_bfloat16_and_flax_attention_fn():
  q, k, v = random_qkv(np.random.default_rng(9), (2,), 4, 5, 2, dtype=jnp.bfloat16)
  out = sh_jit(q, k, v, None, None, ratios=(1, 2))
  assert out.dtype == jnp.bfloat16
  reference = sh_jit(*(x.astype(np.float32) for x in (q, k, v)), None, None, ratios=(1, 2))
  np.testing.assert_allclose(out.astype(np.float32), reference, atol=5e-2)

  layer = nn.MultiHeadDotProductAttention(
    num_heads=2,
    qkv_features=4,
    attention_fn=functools.partial(sh.scaled_head_attention, ratios=(1, 3)),
  )
  x = jnp.ones((2, 5, 3))
  # With every collection mutable, one compiled init both runs the layer and sows.
  init = jax.jit(functools.partial(layer.init_with_output, sow_weights=True, mutable=True))
  y, variables = init(jax.random.key(0), x)
  assert y.shape == (2, 5, 3)
  (sown,) = variables["intermediates"]["attention_weights"]
  assert [w.shape for w in sown] == [(2, 1, 5, 5), (2, 1, 5, 2)]
