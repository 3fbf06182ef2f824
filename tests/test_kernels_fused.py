"""The fused path (kernels/fused.py, jax.nn.dot_product_attention) of softmax, Attention-BN,
Attention-SH and BN+SH equals their reference path, and is taken exactly when it applies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
  calls = []
  original = jax.nn.dot_product_attention

  def counting(*args, **kwargs):
    calls.append(kwargs["implementation"])
    return original(*args, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", counting)
  q, k, v, mask, _ = _inputs()
  KERNELS[kernel](q, k, v, mask=mask)
  assert calls and set(calls) == {"xla"}  # CPU: XLA's implementation
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
