"""Pallas HYLA (primal_dual/kernels/hyla_pallas.py), in interpret mode on CPU, against the
blockwise and dense kernels, jax.grad and the float64 loop reference."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import helpers
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numpy_reference import hyla_ref
from primal_dual.kernels import hyla
from primal_dual.kernels import hyla_blockwise as hb
from primal_dual.kernels import hyla_pallas as hp

COMBINATIONS = list(itertools.product(hp.NORMALIZATIONS, hp.VALUE_NETWORKS))
padding_mask = helpers.padding_mask
assert_close = helpers.assert_close
loss_and_grads = helpers.loss_and_grads


def random_qkv(rng, batch_shape, q_len, kv_len, heads, d=4, d_v=3, dtype=np.float32):
  return helpers.random_qkv(rng, batch_shape, q_len, kv_len, heads, d, d_v, dtype)


def pallas(block_size):
  return functools.partial(hp.hyla_pallas_attention, block_size=block_size)


def assert_pallas_equals(reference, q, k, v, bias, mask, block_size, tol=2e-5, **options):
  """Pallas output and gradients equal ``reference``'s (blockwise or dense)."""
  ref_out, ref_grads = loss_and_grads(reference, q, k, v, bias, mask, **options)
  out, grads = loss_and_grads(pallas(block_size), q, k, v, bias, mask, **options)
  assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
  assert_close(out, ref_out, tol)
  assert len(grads) == len(ref_grads)
  for grad, ref_grad in zip(grads, ref_grads):
    assert grad.shape == ref_grad.shape and grad.dtype == ref_grad.dtype
    # Gradients sum terms as large as the outputs: their magnitude floors the tolerance.
    assert_close(grad, ref_grad, tol, floor=max(0.05, float(np.abs(ref_out).max())))
  return out, grads


def blockwise(block_size):
  return functools.partial(hb.hyla_blockwise_attention, block_size=block_size)


def dense(q, k, v, bias, mask, **options):
  return hyla.hyla_attention(q, k, v, bias, mask, block_size=None, **options)


@pytest.mark.parametrize("case", range(len(COMBINATIONS)))
def test_forward_and_gradients_equal_blockwise_dense_and_reference(case):
  """11 queries, 13 keys in tiles of 8 (both ragged); padding mask, full bias, causal."""
  normalization, value_network = COMBINATIONS[case]
  batch_shape = [(2,), (), (2, 1)][case % 3]
  options = dict(normalization=normalization, value_network=value_network, is_causal=case % 2 == 1)
  rng = np.random.default_rng(case)
  q, k, v = random_qkv(rng, batch_shape, 11, 13, 3)
  mask = padding_mask(rng, batch_shape, 13)
  bias = rng.normal(size=(*batch_shape, 3, 11, 13)).astype(np.float32)
  out, _ = assert_pallas_equals(blockwise(8), q, k, v, bias, mask, 8, **options)
  assert_pallas_equals(dense, q, k, v, bias, mask, 8, tol=1e-4, **options)
  ref_out, _ = hyla_ref(q, k, v, bias, mask, **options)
  assert_close(out, ref_out, 1e-4)
  assert np.abs(out).max() > 0.1  # the comparison is not between zeros


@pytest.mark.parametrize("case", [0, 4])  # rms_head × mlp_relu, none × mlp_linear
def test_gradients_match_float64_finite_differences(case):
  """⟨grad, d⟩ of Σ w·out against a central difference of the float64 loop reference."""
  normalization, value_network = COMBINATIONS[case]
  options = dict(normalization=normalization, value_network=value_network, is_causal=True)
  rng = np.random.default_rng(30 + case)
  q, k, v = random_qkv(rng, (2,), 6, 7, 2)
  mask = padding_mask(rng, (2,), 7)
  bias = rng.normal(size=(2, 1, 6, 7)).astype(np.float32)  # shared by the heads
  w = rng.normal(size=(2, 6, 2, 3))
  args = [q, k, v, bias]

  def loss(*xs):
    return jnp.sum(hp.hyla_pallas_attention(*xs, mask, block_size=4, **options) * w)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
  eps = 1e-5
  for i, grad in enumerate(grads):
    direction = rng.normal(size=args[i].shape)

    def ref_loss(sign):
      moved = [np.asarray(x, np.float64) for x in args]
      moved[i] = moved[i] + sign * eps * direction
      return np.sum(hyla_ref(*moved, mask, **options)[0] * w)

    finite_difference = (ref_loss(1) - ref_loss(-1)) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(grad) * direction), finite_difference, rtol=1e-3)


@settings(max_examples=6, deadline=None)  # each example compiles four programs
@given(data=st.data())
def test_property_random_shapes_tiles_and_broadcasts_equal_blockwise(data):
  """Any lengths and tile; mask and bias broadcast along random axes (dbias keeps them)."""
  batch_shape = data.draw(st.sampled_from([(), (2,), (2, 1)]))
  heads, q_len, kv_len = (data.draw(st.integers(1, n)) for n in (3, 9, 9))
  normalization, value_network = data.draw(st.sampled_from(COMBINATIONS))
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
  q, k, v = random_qkv(rng, batch_shape, q_len, kv_len, heads, d_v=data.draw(st.integers(1, 3)))
  full = (*batch_shape, heads, q_len, kv_len)

  def broadcast_shape():  # each axis kept or set to 1
    return tuple(n if data.draw(st.booleans()) else 1 for n in full)

  mask = data.draw(st.sampled_from([None, rng.random(broadcast_shape()) > 0.3]))
  bias = data.draw(st.sampled_from([None, rng.normal(size=broadcast_shape()).astype(np.float32)]))
  block_size = data.draw(st.integers(1, 5))
  options = dict(
    normalization=normalization,
    value_network=value_network,
    is_causal=data.draw(st.booleans()),
    causal_alignment=data.draw(st.sampled_from(["top_left", "bottom_right"])),
  )
  assert_pallas_equals(blockwise(block_size), q, k, v, bias, mask, block_size, **options)


@pytest.mark.parametrize(
  "bias_shape",
  [(3, 1, 9), (2, 1, 7, 1), (1, 1, 1, 1)],  # shared by queries; by keys; by everything
)
def test_broadcast_bias_gradients_keep_their_shape(bias_shape):
  """The dk/dv pass sums over queries, the dq pass over keys, and the batch sum happens after."""
  rng = np.random.default_rng(31)
  q, k, v = random_qkv(rng, (2,), 7, 9, 3)
  mask = (rng.random((2, 3, 7, 9)) > 0.3).astype(np.float32)  # per-head, full, given as floats
  bias = rng.normal(size=bias_shape).astype(np.float32)
  _, grads = assert_pallas_equals(blockwise(4), q, k, v, bias, mask, 4, is_causal=True)
  assert grads[3].shape == bias_shape and np.abs(grads[3]).max() > 0


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_alignments_with_unequal_lengths(alignment):
  """bottom_right with more queries than keys leaves the first queries with no key at all."""
  rng = np.random.default_rng(32)
  for q_len, kv_len in ((5, 11), (11, 5)):
    q, k, v = random_qkv(rng, (2,), q_len, kv_len, 2)
    assert_pallas_equals(
      blockwise(3), q, k, v, None, None, 3, is_causal=True, causal_alignment=alignment
    )


@pytest.mark.parametrize("normalization", hp.NORMALIZATIONS)
def test_fully_masked_rows_give_zeros_and_finite_gradients(normalization):
  rng = np.random.default_rng(33)
  q, k, v = random_qkv(rng, (2,), 5, 6, 2)
  mask = np.ones((2, 1, 5, 6), bool)
  mask[0, :, 1] = False  # query 1 of example 0 sees nothing
  mask[1] = False  # example 1 sees nothing at all
  out, grads = assert_pallas_equals(
    blockwise(2), q, k, v, None, mask, 2, normalization=normalization
  )
  np.testing.assert_array_equal(out[0, 1], 0.0)
  np.testing.assert_array_equal(out[1], 0.0)
  assert np.abs(out[0, 0]).sum() > 0
  assert all(np.isfinite(g).all() for g in grads)
  np.testing.assert_array_equal(grads[0][1], 0.0)  # example 1: no path from q to the output


def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients_close_to_blockwise():
  rng = np.random.default_rng(34)
  q, k, v = random_qkv(rng, (2,), 9, 7, 2)
  mask = padding_mask(rng, (2,), 7)
  low = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  out, grads = loss_and_grads(pallas(4), *low, None, mask)
  block_out, block_grads = loss_and_grads(blockwise(4), *low, None, mask)
  ref_out, ref_grads = loss_and_grads(blockwise(4), q, k, v, None, mask)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  # The same roundings of a and u as the blockwise path: equal up to float32 summation order
  # and one bfloat16 rounding of the result.
  np.testing.assert_allclose(out.astype(np.float32), block_out.astype(np.float32), rtol=2e-2)
  np.testing.assert_allclose(out.astype(np.float32), ref_out, rtol=0.1, atol=0.1)
  for grad, block_grad, ref in zip(grads, block_grads, ref_grads):
    np.testing.assert_allclose(
      grad.astype(np.float32), block_grad.astype(np.float32), rtol=2e-2, atol=2e-2
    )
    np.testing.assert_allclose(grad.astype(np.float32), ref, rtol=0.1, atol=0.1)


# --- Program structure: memory, precision --------------------------------------------------------


def _grad_jaxpr(attention, q, k, v, bias=None):
  loss = lambda q, k, v, bias: jnp.sum(attention(q, k, v, bias))
  return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bias))


def test_pallas_program_holds_no_length_squared_intermediate():
  """N = 40 in tiles of 8: no [B, q, kv, ·] nor [H, q, kv] array in the forward or backward
  program (the kernels' own jaxprs included), whereas the dense program has them."""
  n, heads, d_v = 40, 2, 3
  q, k, v = random_qkv(np.random.default_rng(35), (1,), n, n, heads, d_v=d_v)
  attention = functools.partial(hyla.hyla_attention, implementation="pallas", block_size=8)
  text = _grad_jaxpr(lambda *x: attention(*x[:3], is_causal=True), q, k, v)
  assert text.count("pallas_call") >= 3  # forward, dq and dk/dv kernels
  dense_text = _grad_jaxpr(lambda *x: dense(*x[:3], None, None, is_causal=True), q, k, v)
  for pattern in (f"{n},{n},{d_v}]", f"{n},{n},4]", f"{heads},{n},{n}]", f"{n},{n}]"):
    assert pattern not in text, pattern
  assert f"1,{n},{n},{d_v}]" in dense_text and f"{heads},{n},{n}]" in dense_text


def _dot_precisions(text):
  """The ``precision`` parameter of every dot_general in a printed jaxpr (nested ones included)."""
  params = [re.split(r"\]\s", chunk)[0] for chunk in text.split("dot_general[")[1:]]
  found = [re.search(r"precision=(\([^)]*\)|\S+)", p) for p in params]
  return [m.group(1) if m else "None" for m in found]  # the printer omits precision=None


@pytest.mark.parametrize("path", ["dense", "blockwise", "pallas"])
@pytest.mark.parametrize("value_network", hp.VALUE_NETWORKS)
def test_every_matrix_product_of_every_path_honours_precision(path, value_network):
  """``precision=HIGHEST`` reaches every dot_general of the forward and backward programs."""
  q, k, v = random_qkv(np.random.default_rng(36), (2,), 5, 6, 2)
  block_size, implementation = {
    "dense": (None, "xla"),
    "blockwise": (4, "xla"),
    "pallas": (4, "pallas"),
  }[path]
  attention = functools.partial(
    hyla.hyla_attention,
    block_size=block_size,
    implementation=implementation,
    value_network=value_network,
    precision=jax.lax.Precision.HIGHEST,
  )
  precisions = _dot_precisions(_grad_jaxpr(lambda *x: attention(*x[:3]), q, k, v))
  assert len(precisions) >= 3, precisions
  assert all("HIGHEST" in p for p in precisions), precisions
  default = functools.partial(attention, precision=None)
  assert not any(
    "HIGHEST" in p for p in _dot_precisions(_grad_jaxpr(lambda *x: default(*x[:3]), q, k, v))
  )


# --- Dispatch from hyla_attention ----------------------------------------------------------------


def _has_pallas(fn, *args):
  return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_implementation_pallas_dispatches_and_equals_the_direct_call():
  rng = np.random.default_rng(37)
  q, k, v = random_qkv(rng, (2,), 6, 7, 2)
  mask = padding_mask(rng, (2,), 7)
  attention = functools.partial(hyla.hyla_attention, implementation="pallas", block_size=4)
  via_option = jax.jit(attention)(q, k, v, mask=mask)
  np.testing.assert_array_equal(via_option, pallas(4)(q, k, v, mask=mask))
  assert _has_pallas(attention, q, k, v)
  default_tile = functools.partial(hyla.hyla_attention, implementation="pallas")
  assert _has_pallas(default_tile, q, k, v)


def test_auto_on_cpu_never_picks_pallas():
  """The CPU behaviour of block_size='auto' is unchanged: dense for short, blockwise for long."""
  for n in (32, 128):
    q, k, v = random_qkv(np.random.default_rng(38), (1,), n, n, 2)
    assert not _has_pallas(hyla.hyla_attention, q, k, v)


@pytest.mark.parametrize("n,expected", [(32, "dense"), (128, "blockwise")])
def test_auto_on_a_gpu_backend_picks_xla_paths(monkeypatch, n, expected):
  """Selection only (nothing is compiled): the backend is reported as a GPU; 'auto' stays on the
  XLA paths there until the fused kernel is measured faster, and 'pallas' is still explicit."""
  q, k, v = random_qkv(np.random.default_rng(39), (1,), n, n, 2)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  call = hyla.driver.AttentionCall(q, k, v)
  assert hyla.select_path(call, "rms_head", "auto", "auto")[0] == expected
  assert hyla.select_path(call, "rms_head", "auto", "xla")[0] == expected
  assert hyla.select_path(call, "rms_head", "auto", "pallas") == (
    "pallas",
    hyla.hyla_pallas.DEFAULT_BLOCK_SIZE,
  )
  assert hyla.select_path(call, "rms_head", 8, "auto") == ("blockwise", 8)
  # The switch to the fused kernel is one setting.
  monkeypatch.setattr(hyla, "AUTO_PALLAS_BACKENDS", ("gpu",))
  assert hyla.select_path(call, "rms_head", "auto", "auto")[0] == expected.replace(
    "blockwise", "pallas"
  )
  assert hyla.select_path(call, "rms_head", 8, "auto") == ("blockwise", 8)  # explicit tile
  assert hyla.select_path(call, "softmax", "auto", "auto")[0] == "dense"


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda q, k, v: hyla.hyla_attention(q, k, v, implementation="triton"), "implementation"),
    (
      lambda q, k, v: hyla.hyla_attention(
        q, k, v, implementation="pallas", normalization="softmax"
      ),
      r"implementation='pallas' cannot serve this call \(normalization='softmax'\)",
    ),
    (
      lambda q, k, v: hyla.hyla_attention(q, k, v, implementation="pallas", return_weights=True),
      "return_weights",
    ),
    (
      lambda q, k, v: hyla.hyla_attention(q, k, v, implementation="pallas", block_size=None),
      "block_size",
    ),
    (lambda q, k, v: hp.hyla_pallas_attention(q, k, v, block_size=0), "block_size"),
    (lambda q, k, v: hp.hyla_pallas_attention(q, k, v, normalization="softmax"), "normalization"),
    (lambda q, k, v: hp.hyla_pallas_attention(q, k, v, value_network="gelu"), "value_network"),
    (lambda q, k, v: hp.hyla_pallas_attention(q, k, v, num_warps=0), "num_warps=0"),
    (lambda q, k, v: hp.hyla_pallas_attention(q, k, v, num_stages=1.5), "num_stages=1.5"),
    (
      lambda q, k, v: hp.hyla_pallas_attention(q, k, v, mask=np.ones((3, 4, 5), bool)),
      r"mask of shape \(3, 4, 5\) does not broadcast to .*\(2, 2, 3, 4\)",
    ),
    (lambda q, k, v: hp.hyla_pallas_attention(q, k[..., :2], v), r"key.shape=\(2, 4, 2, 2\)"),
    (
      lambda q, k, v: hp.hyla_pallas_attention(q, k[..., :1, :], v[..., :1, :]),
      "grouped key/value heads",
    ),
  ],
)
def test_bad_arguments_raise(call, match):
  q, k, v = random_qkv(np.random.default_rng(40), (2,), 3, 4, 2)
  with pytest.raises(ValueError, match=match):
    call(q, k, v)
