"""Every kernel as the ``attention_fn`` of Flax's Linen and NNX multi-head attention modules."""

import functools
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primal_dual.kernels import (
  batchnorm_attention,
  hyla_attention,
  linear_attention,
  padding_mask,
  random_feature_attention,
  scaled_head_attention,
  softmax_attention,
)

HEADS, FEATURES = 2, 8
# name -> (kernel with options bound, whether it forms N×N weights).
KERNELS = {
  "softmax": (softmax_attention, True),
  "linear_dual": (functools.partial(linear_attention, form="dual"), True),
  "linear_primal": (functools.partial(linear_attention, form="primal"), False),
  "random_features": (
    functools.partial(random_feature_attention, num_features=16, feature_key=jax.random.key(0)),
    False,
  ),
  "bn_softmax": (functools.partial(batchnorm_attention, kernel="softmax"), True),
  "bn_linear": (functools.partial(batchnorm_attention, kernel="linear"), True),
}

INPUTS = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, FEATURES)), jnp.float32)
MASK = padding_mask(np.array([[True] * 5, [True, True, True, False, False]]))


def linen_module(attention_fn=nn.dot_product_attention, **options):
  return nn.MultiHeadDotProductAttention(
    num_heads=HEADS, qkv_features=FEATURES, attention_fn=attention_fn, **options
  )


PARAMS = jax.jit(linen_module().init)(jax.random.key(1), INPUTS, mask=MASK)


def linen_apply(attention_fn=nn.dot_product_attention, **call_options):
  """Jitted forward pass of the Linen module with the shared parameters."""
  apply = functools.partial(linen_module(attention_fn).apply, **call_options)
  return jax.jit(apply)(PARAMS, INPUTS, mask=MASK)


def test_linen_softmax_reproduces_default_module():
  np.testing.assert_allclose(linen_apply(softmax_attention), linen_apply(), atol=1e-6)


def test_linen_softmax_dropout_reproduces_default_module():
  """Same rng, same broadcast pattern as Flax's own dropout."""

  def apply(attention_fn):
    module = linen_module(attention_fn, dropout_rate=0.3)
    return jax.jit(functools.partial(module.apply, deterministic=False))(
      PARAMS, INPUTS, mask=MASK, rngs={"dropout": jax.random.key(2)}
    )

  dropped = apply(softmax_attention)
  np.testing.assert_allclose(dropped, apply(nn.dot_product_attention), atol=1e-6)
  assert not np.allclose(dropped, linen_apply(softmax_attention), atol=1e-4)


@pytest.mark.parametrize("name", KERNELS)
def test_linen_drop_in_with_sown_weights(name):
  kernel, forms_weights = KERNELS[name]
  out, state = linen_apply(kernel, sow_weights=True, mutable=["intermediates"])
  assert out.shape == INPUTS.shape
  assert np.all(np.isfinite(out))
  if not forms_weights:  # Primal forms never form the weights and sow nothing.
    assert not state.get("intermediates")
    return
  (weights,) = state["intermediates"]["attention_weights"]
  assert weights.shape == (2, HEADS, 5, 5)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-4)
  np.testing.assert_array_equal(weights[1, :, :, 3:], 0.0)  # padded keys get no weight
  if name == "softmax":
    _, default_state = linen_apply(sow_weights=True, mutable=["intermediates"])
    np.testing.assert_allclose(
      weights, default_state["intermediates"]["attention_weights"][0], atol=1e-6
    )


def nnx_module(attention_fn=nnx.dot_product_attention):
  """Same seed, same parameters, whatever the attention function."""
  return nnx.MultiHeadAttention(
    num_heads=HEADS,
    in_features=FEATURES,
    qkv_features=FEATURES,
    attention_fn=attention_fn,
    decode=False,
    rngs=nnx.Rngs(0),
  )


@pytest.mark.parametrize("name", KERNELS)
def test_nnx_drop_in(name):
  """NNX also passes is_causal; padding and causal masks together."""
  out = nnx_module(KERNELS[name][0])(INPUTS, mask=MASK, is_causal=True)
  assert out.shape == INPUTS.shape
  assert np.all(np.isfinite(out))
  if name == "softmax":
    default = nnx_module()(INPUTS, mask=MASK, is_causal=True)
    np.testing.assert_allclose(out, default, atol=1e-6)


def sown_nnx_weights(attention_fn):
  """The weights an NNX module sows, read with ``nnx.capture`` (Flax's recommended way)."""
  forward = nnx.capture(nnx_module(attention_fn), nnx.Intermediate)
  _, intermediates = forward(INPUTS, mask=MASK, sow_weights=True)
  (weights,) = intermediates["attention_weights"].get_value()
  return weights


def test_nnx_sow_weights():
  weights = sown_nnx_weights(softmax_attention)
  assert weights.shape == (2, HEADS, 5, 5)
  np.testing.assert_allclose(weights, sown_nnx_weights(nnx.dot_product_attention), atol=1e-6)


FLAX_ARGUMENTS = {
  "query": inspect.Parameter.POSITIONAL_OR_KEYWORD,
  "key": inspect.Parameter.POSITIONAL_OR_KEYWORD,
  "value": inspect.Parameter.POSITIONAL_OR_KEYWORD,
  "bias": inspect.Parameter.POSITIONAL_OR_KEYWORD,
  "mask": inspect.Parameter.POSITIONAL_OR_KEYWORD,
  **dict.fromkeys(
    (
      "broadcast_dropout",
      "dropout_rng",
      "dropout_rate",
      "deterministic",
      "dtype",
      "precision",
      "module",
      "is_causal",
      "causal_alignment",
      "return_weights",
    ),
    inspect.Parameter.KEYWORD_ONLY,
  ),
}


@pytest.mark.parametrize(
  "kernel,options",
  [
    (softmax_attention, ("scale", "implementation")),
    (linear_attention, ("form", "eps")),
    (random_feature_attention, ("num_features", "feature_key")),
    (batchnorm_attention, ("kernel", "eps", "mean_weight", "statistics", "linear_eps")),
    (scaled_head_attention, ("ratios", "pool", "batchnorm", "statistics", "grid_shape")),
    (hyla_attention, ("normalization", "value_network", "query_chunk_size", "block_size")),
  ],
)
def test_signatures_list_flax_arguments_and_options(kernel, options):
  """The driver-built kernels show Flax's contract and their own options to inspect.signature."""
  parameters = inspect.signature(kernel).parameters
  assert {name: parameters[name].kind for name in FLAX_ARGUMENTS} == FLAX_ARGUMENTS
  assert list(parameters)[:5] == ["query", "key", "value", "bias", "mask"]
  for name in options:
    assert parameters[name].kind == inspect.Parameter.KEYWORD_ONLY, name
  assert parameters["return_weights"].default is False
  assert kernel.__name__.endswith("_attention") and kernel.__doc__
  with pytest.raises(TypeError, match="unknown_option"):
    kernel(INPUTS, INPUTS, INPUTS, unknown_option=1)
