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
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (*batch, 5, 4, 8), dtype)
  k = jax.random.normal(keys[1], (*batch, 7, kv_heads, 8), dtype)
  v = jax.random.normal(keys[2], (*batch, 7, kv_heads, 8), dtype)
  mask = jax.random.bernoulli(keys[3], 0.6, (*batch, 1, 5, 7))
  mask = mask.at[(0,) * len(batch) + (0, 1)].set(False)  # a query that sees no key
  bias = 0.5 * jax.random.normal(keys[4], (1, 4, 5, 7))
  return q, k, v, mask, bias


CASES = {
  "plain": {},
  "mask": {"mask": True},
  "float_mask": {"mask": "float"},
  "causal": {"is_causal": True},
  "mask_and_causal": {"mask": True, "is_causal": True},
  "bias": {"bias": True},
}


def _call(kernel, q, k, v, mask, bias, case, implementation):
  options = {"is_causal": case.get("is_causal", False)}
  if case.get("mask"):
    options["mask"] = mask.astype(jnp.float32) if case["mask"] == "float" else mask
  if case.get("bias"):
    options["bias"] = bias
  return KERNELS[kernel](q, k, v, implementation=implementation, **options)


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


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_fused_gradients_equal_reference(kernel):
  q, k, v, mask, bias = _inputs()

  def loss(implementation, q, k, v):
    out = KERNELS[kernel](q, k, v, mask=mask, bias=bias, implementation=implementation)
    return jnp.sum(jnp.sin(out))

  for got, want in zip(
    jax.grad(functools.partial(loss, "fused"), argnums=(0, 1, 2))(q, k, v),
    jax.grad(functools.partial(loss, "reference"), argnums=(0, 1, 2))(q, k, v),
  ):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_grouped_heads_bfloat16_and_batch_dims(kernel):
  q, k, v, mask, _ = _inputs(kv_heads=2, batch=(2, 3))
  np.testing.assert_allclose(
    KERNELS[kernel](q, k, v, mask=mask, implementation="fused"),
    KERNELS[kernel](q, k, v, mask=mask, implementation="reference"),
    rtol=2e-5,
    atol=2e-6,
  )
  q, k, v, mask, _ = _inputs(jnp.bfloat16)
  out = KERNELS[kernel](q, k, v, mask=mask, implementation="fused")
  reference = KERNELS[kernel](q, k, v, mask=mask, implementation="reference")
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(out, np.float32), np.asarray(reference, np.float32), rtol=3e-2, atol=3e-2
  )


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_auto_takes_the_fused_path_only_when_it_applies(kernel, monkeypatch):
  calls = helpers.dot_product_attention_keywords(monkeypatch)
  q, k, v, mask, _ = _inputs()
  KERNELS[kernel](q, k, v, mask=mask)
  assert calls and {c["implementation"] for c in calls} == {"xla"}  # CPU: XLA's implementation
  calls.clear()
  KERNELS[kernel](q, k, v, mask=mask, return_weights=True)
  KERNELS[kernel](q, k, v, dropout_rate=0.5, deterministic=False, dropout_rng=jax.random.key(1))
  KERNELS[kernel](q, k, v, implementation="reference")
  assert not calls
  with pytest.raises(ValueError, match="implementation='fused' cannot serve this call"):
    KERNELS[kernel](q, k, v, return_weights=True, implementation="fused")


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

  def loss(q, k, v, implementation, **masking):
    out = KERNELS[kernel](
      q, k, v, bias=bias, is_causal=is_causal, implementation=implementation, **masking
    )
    return jnp.sum(jnp.sin(out)), out

  grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
  got_grads, got = grad(q, k, v, "fused", **lengths)
  want_grads, want = grad(q, k, v, "reference", mask=mask)
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
