"""Blockwise HYLA (primal_dual/kernels/hyla/blockwise.py) against the dense kernel and jax.grad."""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import helpers
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from primal_dual.kernels import hyla
from primal_dual.kernels.hyla import blockwise as hb

COMBINATIONS = list(itertools.product(hb.NORMALIZATIONS, hb.VALUE_NETWORKS))
STATIC = ("normalization", "value_network", "is_causal", "causal_alignment", "block_size")


def random_qkv(rng, batch_shape, q_len, kv_len, heads, d=4, d_v=3, dtype=np.float32):
  return helpers.random_qkv(rng, batch_shape, q_len, kv_len, heads, d, d_v, dtype)


padding_mask = helpers.padding_mask
assert_close = helpers.assert_close
loss_and_grads = helpers.loss_and_grads


def assert_blockwise_equals_dense(q, k, v, bias, mask, block_size, tol=2e-5, **options):
  dense_out, dense_grads = loss_and_grads(hyla.hyla_attention, q, k, v, bias, mask, **options)
  block = functools.partial(hb.hyla_blockwise_attention, block_size=block_size)
  out, grads = loss_and_grads(block, q, k, v, bias, mask, **options)
  assert out.shape == dense_out.shape and out.dtype == dense_out.dtype
  assert_close(out, dense_out, tol)
  assert len(grads) == len(dense_grads)
  for grad, dense_grad in zip(grads, dense_grads):
    assert grad.shape == dense_grad.shape and grad.dtype == dense_grad.dtype
    # A gradient is a sum of terms as large as the outputs (out = Σ a·u), however small the sum:
    # float32 rounding is relative to those terms, so the outputs' magnitude floors the tolerance.
    assert_close(grad, dense_grad, tol, floor=max(0.05, float(np.abs(dense_out).max())))
  return out


@pytest.mark.parametrize("case", range(len(COMBINATIONS)))
def test_forward_and_gradients_equal_dense_ragged_masked_biased(case):
  """7 queries and 9 keys in blocks of 4: both lengths ragged; padding mask, bias, causal."""
  normalization, value_network = COMBINATIONS[case]
  batch_shape = [(2,), (), (2, 1)][case % 3]
  rng = np.random.default_rng(case)
  q, k, v = random_qkv(rng, batch_shape, 7, 9, 3)
  mask = padding_mask(rng, batch_shape, 9)
  bias = rng.normal(size=(*batch_shape, 3, 7, 9)).astype(np.float32)
  out = assert_blockwise_equals_dense(
    q,
    k,
    v,
    bias,
    mask,
    4,
    normalization=normalization,
    value_network=value_network,
    is_causal=case % 2 == 1,
  )
  assert np.abs(out).max() > 0.1  # the comparison is not between zeros


@settings(max_examples=8)  # each example compiles four programs
@given(data=st.data())
def test_property_random_shapes_blocks_and_broadcasts_equal_dense(data):
  """Any lengths and block size; mask and bias broadcast along random axes (dbias keeps them)."""
  batch_shape = data.draw(st.sampled_from([(), (2,), (2, 1)]))
  heads, q_len, kv_len = (data.draw(st.integers(1, n)) for n in (3, 7, 7))
  normalization, value_network = data.draw(st.sampled_from(COMBINATIONS))
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
  q, k, v = random_qkv(rng, batch_shape, q_len, kv_len, heads, d_v=data.draw(st.integers(1, 3)))
  full = (*batch_shape, heads, q_len, kv_len)

  def broadcast_shape():  # each axis kept or set to 1
    return tuple(n if data.draw(st.booleans()) else 1 for n in full)

  mask = data.draw(st.sampled_from([None, rng.random(broadcast_shape()) > 0.3]))
  bias = data.draw(st.sampled_from([None, rng.normal(size=broadcast_shape()).astype(np.float32)]))
  assert_blockwise_equals_dense(
    q,
    k,
    v,
    bias,
    mask,
    data.draw(st.integers(1, 4)),
    normalization=normalization,
    value_network=value_network,
    is_causal=data.draw(st.booleans()),
  )


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_alignments_with_unequal_lengths_and_block_sizes(alignment):
  rng = np.random.default_rng(11)
  q, k, v = random_qkv(rng, (2,), 5, 11, 2)
  for block_size in (1, 3, 64):  # 64 > both lengths: clipped to them
    assert_blockwise_equals_dense(
      q, k, v, None, None, block_size, is_causal=True, causal_alignment=alignment
    )


def test_per_head_float_mask_and_shared_bias():
  """A full per-head mask given as floats, and a bias shared by the batch: dbias keeps its shape."""
  rng = np.random.default_rng(12)
  q, k, v = random_qkv(rng, (2,), 6, 6, 3)
  mask = (rng.random((2, 3, 6, 6)) > 0.3).astype(np.float32)
  bias = rng.normal(size=(3, 1, 6)).astype(np.float32)  # heads × keys, broadcast over the rest
  assert_blockwise_equals_dense(q, k, v, bias, mask, 4)


def test_fully_masked_rows_give_zeros_and_finite_gradients():
  rng = np.random.default_rng(13)
  q, k, v = random_qkv(rng, (2,), 5, 6, 2)
  mask = np.ones((2, 1, 5, 6), bool)
  mask[0, :, 1] = False  # query 1 of example 0 sees nothing
  mask[1] = False  # example 1 sees nothing at all
  for normalization in hb.NORMALIZATIONS:
    out = assert_blockwise_equals_dense(q, k, v, None, mask, 2, normalization=normalization)
    np.testing.assert_array_equal(out[0, 1], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    _, grads = loss_and_grads(
      functools.partial(hb.hyla_blockwise_attention, block_size=2),
      q,
      k,
      v,
      None,
      mask,
      normalization=normalization,
    )
    assert all(np.isfinite(g).all() for g in grads)


def test_single_query_and_mask_without_batch_dimensions():
  rng = np.random.default_rng(14)
  q, k, v = random_qkv(rng, (3,), 1, 7, 2)
  mask = rng.random((1, 7)) > 0.4  # [q_len, kv_len]: broadcast over batch and heads
  mask[0, 0] = True
  assert_blockwise_equals_dense(q, k, v, None, mask, 3)


def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients_close_to_float32():
  rng = np.random.default_rng(15)
  q, k, v = random_qkv(rng, (2,), 6, 5, 2)
  mask = padding_mask(rng, (2,), 5)
  low = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  block = functools.partial(hb.hyla_blockwise_attention, block_size=4)
  out, grads = loss_and_grads(block, *low, None, mask)
  dense_low_out, _ = loss_and_grads(hyla.hyla_attention, *low, None, mask)
  ref_out, ref_grads = loss_and_grads(hyla.hyla_attention, q, k, v, None, mask)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  # bfloat16 rounding of the inputs and of a, u: the same error budget as the dense kernel's.
  np.testing.assert_allclose(
    out.astype(np.float32), dense_low_out.astype(np.float32), rtol=0.05, atol=0.05
  )
  np.testing.assert_allclose(out.astype(np.float32), ref_out, rtol=0.1, atol=0.1)
  for grad, ref in zip(grads, ref_grads):
    np.testing.assert_allclose(grad.astype(np.float32), ref, rtol=0.1, atol=0.1)


# --- Dispatch from hyla_attention ----------------------------------------------------------------


def _has_loop(fn, *args):
  return "scan" in str(jax.make_jaxpr(fn)(*args))


def test_hyla_attention_block_size_dispatches_to_blockwise():
  rng = np.random.default_rng(16)
  q, k, v = random_qkv(rng, (2,), 6, 7, 2)
  mask = padding_mask(rng, (2,), 7)
  via_option = jax.jit(functools.partial(hyla.hyla_attention, block_size=4))(q, k, v, mask=mask)
  direct = hb.hyla_blockwise_attention(q, k, v, mask=mask, block_size=4)
  np.testing.assert_array_equal(via_option, direct)
  assert _has_loop(functools.partial(hyla.hyla_attention, block_size=4), q, k, v)
  assert not _has_loop(hyla.hyla_attention, q, k, v)


@pytest.fixture
def auto_blockwise_from_one_pair(monkeypatch):
  """block_size='auto' picks the blockwise path wherever the call allows it (tiny shapes)."""
  monkeypatch.setattr(hyla, "AUTO_BLOCKWISE_MIN_PAIRS", 1)


UNSUPPORTED_OPTIONS = [
  dict(normalization="softmax"),
  dict(return_weights=True),
  dict(dropout_rng=jax.random.key(0), dropout_rate=0.2, deterministic=False),
]


@pytest.mark.parametrize("options", UNSUPPORTED_OPTIONS)
def test_unsupported_calls_run_the_dense_path(options, auto_blockwise_from_one_pair):
  rng = np.random.default_rng(17)
  q, k, v = random_qkv(rng, (2,), 5, 5, 2)
  with_blocks = hyla.hyla_attention(q, k, v, block_size="auto", **options)
  dense = hyla.hyla_attention(q, k, v, block_size=None, **options)
  jax.tree.map(np.testing.assert_array_equal, with_blocks, dense)
  assert not _has_loop(lambda *x: hyla.hyla_attention(*x, block_size="auto", **options), q, k, v)


@pytest.mark.parametrize("options", UNSUPPORTED_OPTIONS)
def test_an_int_block_size_refuses_unsupported_calls(options):
  q, k, v = random_qkv(np.random.default_rng(17), (2,), 5, 5, 2)
  with pytest.raises(ValueError, match=r"block_size=2 runs blockwise.*block_size='auto' or None"):
    hyla.hyla_attention(q, k, v, block_size=2, **options)


def test_module_given_runs_the_dense_path_and_sows_weights(auto_blockwise_from_one_pair):
  import flax.linen as nn

  class Sower(nn.Module):
    @nn.compact
    def __call__(self, q, k, v):
      return hyla.hyla_attention(q, k, v, module=self, block_size="auto")

  q, k, v = random_qkv(np.random.default_rng(18), (2,), 5, 5, 2)
  out, state = Sower().apply({}, q, k, v, mutable=["intermediates"])
  np.testing.assert_array_equal(out, hyla.hyla_attention(q, k, v, block_size=None))
  assert state["intermediates"]["attention_weights"][0].shape == (2, 2, 5, 5)


@pytest.mark.parametrize(
  "length,blockwise",
  [(32, False), (36, False), (math.isqrt(hyla.AUTO_BLOCKWISE_MIN_PAIRS), True)],  # logic, sRAVEN
)
def test_auto_block_size_picks_blockwise_for_long_sequences_and_agrees_with_dense(
  length, blockwise
):
  q, k, v = random_qkv(np.random.default_rng(19), (1,), length, length, 2, d=4)
  assert _has_loop(hyla.hyla_attention, q, k, v) == blockwise
  dense = jax.jit(functools.partial(hyla.hyla_attention, block_size=None))
  np.testing.assert_allclose(
    jax.jit(hyla.hyla_attention)(q, k, v), dense(q, k, v), rtol=2e-5, atol=2e-5
  )


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda q, k, v: hyla.hyla_attention(q, k, v, block_size=0), "block_size"),
    (lambda q, k, v: hb.hyla_blockwise_attention(q, k, v, block_size=2.0), "block_size"),
    (
      lambda q, k, v: hb.hyla_blockwise_attention(q, k, v, normalization="softmax"),
      "normalization",
    ),
    (lambda q, k, v: hb.hyla_blockwise_attention(q, k, v, value_network="gelu"), "value_network"),
    (
      lambda q, k, v: hb.hyla_blockwise_attention(q, k, v, mask=np.ones((3, 4, 5), bool)),
      r"mask of shape \(3, 4, 5\) does not broadcast to .*\(2, 2, 3, 4\)",
    ),
    (lambda q, k, v: hb.hyla_blockwise_attention(q, k[..., :2], v), r"key.shape=\(2, 4, 2, 2\)"),
  ],
)
def test_bad_arguments_raise(call, match):
  q, k, v = random_qkv(np.random.default_rng(19), (2,), 3, 4, 2)
  with pytest.raises(ValueError, match=match):
    call(q, k, v)


# --- Memory --------------------------------------------------------------------------------------


def _grad_program(attention, q, k, v):
  loss = lambda q, k, v: jnp.sum(attention(q, k, v))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v)


def test_backward_never_holds_a_length_squared_buffer():
  """N = 512: the dense backward keeps [B, q, k, d_v]; the blockwise one only tiles."""
  n, heads, d, d_v = 512, 2, 4, 4
  q, k, v = random_qkv(np.random.default_rng(20), (1,), n, n, heads, d=d, d_v=d_v)
  block = functools.partial(hyla.hyla_attention, block_size=64, is_causal=True)
  dense = functools.partial(hyla.hyla_attention, block_size=None, is_causal=True)
  block_text = _grad_program(block, q, k, v).as_text()
  for shape in (f"{n},{n},{d_v}", f"{heads},{n},{n}", f"{n},{n}]"):
    assert shape not in block_text, shape
  block_temp = _grad_program(block, q, k, v).compile().memory_analysis().temp_size_in_bytes
  dense_temp = _grad_program(dense, q, k, v).compile().memory_analysis().temp_size_in_bytes
  assert dense_temp >= n * n * d_v * 4  # the dense program does hold the quadratic tensor
  assert block_temp < dense_temp / 4, (block_temp, dense_temp)
  assert block_temp < n * n * 4  # below even one [q, k] float32 score matrix


def test_blockwise_memory_grows_linearly_with_length():
  """Forward+backward temp bytes at fixed blocks: doubling N adds about twice the last increment
  (a quadratic buffer would add four times)."""

  def temp_bytes(n):
    q, k, v = (jax.ShapeDtypeStruct((1, n, 2, 4), jnp.float32) for _ in range(3))
    block = functools.partial(hyla.hyla_attention, block_size=32, is_causal=True)
    return _grad_program(block, q, k, v).compile().memory_analysis().temp_size_in_bytes

  sizes = [temp_bytes(n) for n in (256, 512, 1024, 2048)]
  increments = np.diff(sizes)
  assert np.all(increments > 0), sizes
  assert np.all(increments[1:] <= 2.5 * increments[:-1]), sizes


def test_layer_option_block_size_gives_the_dense_layer_and_gradients():
  """``attention_options={'block_size': b}`` on the registry's 'hyla' layer: same output and
  parameter gradients as the dense layer."""
  from primal_dual.layers import MultiHeadAttention

  rng = np.random.default_rng(21)
  x = rng.normal(size=(2, 7, 8)).astype(np.float32)
  mask = padding_mask(rng, (2,), 7)
  dense = MultiHeadAttention(num_heads=2, attention="hyla")
  block = MultiHeadAttention(num_heads=2, attention="hyla", attention_options={"block_size": 3})
  params = dense.init(jax.random.key(0), x)

  def run(layer):
    loss = lambda p: jnp.sum(jnp.sin(layer.apply(p, x, mask=mask, deterministic=True)))
    return jax.jit(jax.value_and_grad(loss))(params)

  assert _has_loop(lambda p: block.apply(p, x, mask=mask, deterministic=True), params)
  (value, grads), (dense_value, dense_grads) = run(block), run(dense)
  assert_close(value, dense_value)
  jax.tree.map(assert_close, grads, dense_grads)
