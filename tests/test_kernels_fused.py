"""The fused path (kernels/fused.py, jax.nn.dot_product_attention) of softmax, Attention-BN,
Attention-SH and BN+SH equals their reference path, and is taken exactly when it applies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from primal_dual.kernels import batchnorm_attention, fused, scaled_head_attention, softmax_attention

KERNELS = {
  "softmax": softmax_attention,
  "bn": batchnorm_attention,
  "sh": functools.partial(scaled_head_attention, ratios=(1, 2, 2, 3)),
  "bn_sh": functools.partial(scaled_head_attention, ratios=(1, 2, 2, 3), batchnorm=True),
}


def _inputs(dtype=jnp.float32, kv_heads=4, batch=(2,)):
  # Drawn by NumPy: jax.random compiles a sampler per shape and dtype (~2 s each on CPU).
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(*batch, 5, 4, 8)), dtype)
  k = jnp.asarray(rng.normal(size=(*batch, 7, kv_heads, 8)), dtype)
  v = jnp.asarray(rng.normal(size=(*batch, 7, kv_heads, 8)), dtype)
  mask = rng.random((*batch, 1, 5, 7)) < 0.6
  mask[(0,) * len(batch) + (0, 1)] = False  # a query that sees no key
  bias = jnp.asarray(0.5 * rng.normal(size=(1, 4, 5, 7)), jnp.float32)
  return q, k, v, jnp.asarray(mask), bias


CASES = {
  "plain": {},
  "mask": {"mask": True},
  "float_mask": {"mask": "float"},
  "causal": {"is_causal": True},
  "mask_and_causal": {"mask": True, "is_causal": True},
  "bias": {"bias": True},
}


# The kernels run jitted here, as in a model: one XLA compilation per program. Eagerly, every
# primitive compiles on its own (hundreds per gradient of Attention-BN, ~0.05 s each on CPU).
def _jitted_kernel(kernel, **static_options):
  return jax.jit(functools.partial(KERNELS[kernel], **static_options))


def _call(kernel, q, k, v, mask, bias, case, implementation):
  options = {}
  if case.get("mask"):
    options["mask"] = mask.astype(jnp.float32) if case["mask"] == "float" else mask
  if case.get("bias"):
    options["bias"] = bias
  attention = _jitted_kernel(
    kernel, implementation=implementation, is_causal=case.get("is_causal", False)
  )
  return attention(q, k, v, **options)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_reference(kernel, case):
  q, k, v, mask, bias = _inputs()
  fused_out = _call(kernel, q, k, v, mask, bias, CASES[case], "fused")
  reference = _call(kernel, q, k, v, mask, bias, CASES[case], "reference")
  np.testing.assert_allclose(fused_out, reference, rtol=2e-5, atol=2e-6)
  assert np.isfinite(np.asarray(fused_out)).all()
  if CASES[case].get("mask"):
    np.testing.assert_array_equal(np.asarray(fused_out)[0, 1], 0.0)  # the query with no key


def _gradients_and_output(kernel, implementation, is_causal=False):
  """Jitted ``(q, k, v, **masking) -> (grads of Σ sin(out) w.r.t. q, k, v; out)``."""

  def loss(q, k, v, **masking):
    out = KERNELS[kernel](q, k, v, is_causal=is_causal, implementation=implementation, **masking)
    return jnp.sum(jnp.sin(out)), out

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


# The reference path never calls what the tests patch (jax.nn.dot_product_attention,
# fused.backend_implementation), so one program per kernel and causal flag serves every test of
# a mask and bias of the same shapes: the gradient test's and all the lengths tests'.
@functools.cache
def _reference_gradients_and_output(kernel, *, is_causal):
  return _gradients_and_output(kernel, "reference", is_causal)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_fused_gradients_equal_reference(kernel):
  q, k, v, mask, bias = _inputs(batch=(3,))  # the lengths tests' shapes: one reference program
  got_grads, _ = _gradients_and_output(kernel, "fused")(q, k, v, mask=mask, bias=bias)
  want_grads, _ = _reference_gradients_and_output(kernel, is_causal=False)(
    q, k, v, mask=mask, bias=bias
  )
  for got, want in zip(got_grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_grouped_heads_bfloat16_and_batch_dims(kernel):
  fused_path, reference_path = (
    _jitted_kernel(kernel, implementation=i) for i in ("fused", "reference")
  )
  q, k, v, mask, _ = _inputs(kv_heads=2, batch=(2, 3))
  np.testing.assert_allclose(
    fused_path(q, k, v, mask=mask),
    reference_path(q, k, v, mask=mask),
    rtol=2e-5,
    atol=2e-6,
  )
  q, k, v, mask, _ = _inputs(jnp.bfloat16)
  out = fused_path(q, k, v, mask=mask)
  reference = reference_path(q, k, v, mask=mask)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(out, np.float32), np.asarray(reference, np.float32), rtol=3e-2, atol=3e-2
  )


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_auto_takes_the_fused_path_only_when_it_applies(kernel, monkeypatch):
  calls = helpers.dot_product_attention_keywords(monkeypatch)
  q, k, v, mask, _ = _inputs()

  def trace(**options):  # the path is chosen while tracing: nothing needs compiling
    return jax.eval_shape(functools.partial(KERNELS[kernel], **options), q, k, v)

  trace(mask=mask)
  assert calls and {c["implementation"] for c in calls} == {"xla"}  # CPU: XLA's implementation
  calls.clear()
  trace(mask=mask, return_weights=True)
  trace(dropout_rate=0.5, deterministic=False, dropout_rng=jax.random.key(1))
  trace(implementation="reference")
  assert not calls
  with pytest.raises(ValueError, match="implementation='fused' cannot serve this call"):
    trace(return_weights=True, implementation="fused")


def test_linear_kernels_and_unknown_names_refuse_the_fused_path():
  q, k, v, _, _ = _inputs()
  with pytest.raises(ValueError, match="kernel is not softmax"):
    batchnorm_attention(q, k, v, kernel="linear", implementation="fused")
  with pytest.raises(ValueError, match="implementation must be one of"):
    softmax_attention(q, k, v, implementation="flash")
  assert fused.backend_implementation(q, head_size=8, masked=False) == (
    "cudnn" if jax.default_backend() == "gpu" else "xla"
  )


# --- Padding given as lengths -------------------------------------------------------------------

# Three examples: all 7 keys, 3 keys, none (a fully padded row); and their real queries.
KEY_LENGTHS, QUERY_LENGTHS = (7, 3, 0), (5, 2, 4)
LENGTH_CASES = {
  "keys": dict(queries=False, is_causal=False),
  "keys_and_queries": dict(queries=True, is_causal=False),
  "keys_and_causal": dict(queries=False, is_causal=True),
}


def _lengths_and_mask(queries: bool) -> tuple[dict, np.ndarray]:
  """The lengths keywords of a case and the bool mask ``[3, 1, 5, 7]`` they mean."""
  keys = np.arange(7)[None, :] < np.array(KEY_LENGTHS)[:, None]
  lengths = {"key_value_seq_lengths": jnp.array(KEY_LENGTHS, jnp.int32)}
  real = np.ones((3, 5), bool)
  if queries:
    lengths["query_seq_lengths"] = jnp.array(QUERY_LENGTHS, jnp.int32)
    real = np.arange(5)[None, :] < np.array(QUERY_LENGTHS)[:, None]
  return lengths, keys[:, None, None, :] & real[:, None, :, None]


@pytest.mark.parametrize("operands", ["as_given", "prepared_for_cudnn"])
@pytest.mark.parametrize("case", sorted(LENGTH_CASES))
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_lengths_give_their_masks_outputs_and_gradients(kernel, case, operands, monkeypatch):
  """Key (and query) lengths on the fused path equal the boolean mask they mean on the reference
  path, outputs and gradients; the example of key length 0 and the padded queries give 0."""
  q, k, v, _, bias = _inputs(batch=(3,))
  queries, is_causal = LENGTH_CASES[case]["queries"], LENGTH_CASES[case]["is_causal"]
  lengths, mask = _lengths_and_mask(queries)
  if operands == "prepared_for_cudnn":
    helpers.run_cudnn_operands_on_xla(monkeypatch)  # padded heads, both lengths

  fused_path = _gradients_and_output(kernel, "fused", is_causal)
  got_grads, got = fused_path(q, k, v, bias=bias, **lengths)
  reference_path = _reference_gradients_and_output(kernel, is_causal=is_causal)
  want_grads, want = reference_path(q, k, v, bias=bias, mask=mask)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()
  assert all(np.isfinite(np.asarray(g)).all() for g in got_grads)
  np.testing.assert_array_equal(np.asarray(got)[2], 0.0)  # no key
  np.testing.assert_array_equal(np.asarray(got_grads[0])[2], 0.0)
  if queries:
    np.testing.assert_array_equal(np.asarray(got)[1, 2:], 0.0)  # padded queries


@pytest.mark.parametrize("kernel", ["softmax", "bn"])
def test_lengths_reach_jax_nn_as_lengths_and_a_mask_as_a_mask(kernel, monkeypatch):
  """What decides cuDNN's path (tests/test_lowering.py pins it): lengths alone are passed as
  ``key_value_seq_lengths``/``query_seq_lengths`` ``[B]`` with no mask or bias; a mask (a padding
  one too: its values are data) as a mask; lengths with a mask, folded into it."""
  calls = helpers.dot_product_attention_keywords(monkeypatch)
  q, k, v, _, _ = _inputs(batch=(3,))
  lengths, mask = _lengths_and_mask(queries=True)
  KERNELS[kernel](q, k, v, **lengths)
  KERNELS[kernel](q, k, v, mask=mask)
  KERNELS[kernel](q, k, v, mask=mask, **lengths)
  by_lengths, by_mask, both = calls
  assert by_lengths["mask"] is None and by_lengths["bias"] is None
  for name, value in lengths.items():
    np.testing.assert_array_equal(by_lengths[name], value)
  assert by_mask["mask"] is not None and "key_value_seq_lengths" not in by_mask
  assert both["mask"] is not None and "key_value_seq_lengths" not in both


def test_attend_refuses_lengths_of_other_shapes():
  q = jnp.zeros((2, 3, 4, 8))
  with pytest.raises(ValueError, match=r"key_lengths must be int \[B\] or \[B, H\] = \[2\] or"):
    fused.attend(q, q, q, None, None, scale=1.0, key_lengths=jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"query_lengths must be int \[B\] = \[2\]; got shape"):
    fused.attend(q, q, q, None, None, scale=1.0, query_lengths=jnp.zeros((2, 3), jnp.int32))
