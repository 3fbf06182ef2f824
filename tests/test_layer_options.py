"""Grouped key/value heads (`num_kv_heads`) and `is_causal` in both layers (Linen and NNX): the
parameter layout, equality with the dense forms they stand for, decoding, and one-line refusals."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primal_dual import layers
from primal_dual import nnx as pd_nnx

BATCH, LENGTH, FEATURES, HEADS = 2, 5, 8, 4
X = jax.random.normal(jax.random.key(3), (BATCH, LENGTH, FEATURES))
CAUSAL = nn.make_causal_mask(X[..., 0])


def _linen_params(**kw):
  layer = layers.MultiHeadAttention(num_heads=HEADS, **kw)
  return layer, nn.meta.unbox(layer.init(jax.random.key(1), X))["params"]


def _repeat_kv_heads(params, groups):
  """The full-head parameters that a grouped layer stands for: each key/value head repeated
  for the `groups` query heads that share it."""
  full = dict(params)
  for name in ("key", "value"):
    full[name] = {
      "kernel": jnp.repeat(params[name]["kernel"], groups, axis=1),
      "bias": jnp.repeat(params[name]["bias"], groups, axis=0),
    }
  return full


@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("name", ["softmax", "linear", "bn"])
def test_grouped_heads_equal_the_repeated_full_heads_layer(name, num_kv_heads):
  grouped, params = _linen_params(attention=name, num_kv_heads=num_kv_heads)
  head_dim = FEATURES // HEADS
  assert params["key"]["kernel"].shape == (FEATURES, num_kv_heads, head_dim)
  assert params["query"]["kernel"].shape == (FEATURES, HEADS, head_dim)
  full, _ = _linen_params(attention=name)
  expected = full.apply({"params": _repeat_kv_heads(params, HEADS // num_kv_heads)}, X)
  np.testing.assert_allclose(grouped.apply({"params": params}, X), expected, rtol=1e-5, atol=1e-6)

  module = pd_nnx.MultiHeadAttention(
    HEADS, FEATURES, attention=name, num_kv_heads=num_kv_heads, rngs=nnx.Rngs(0)
  )
  pd_nnx.load_linen_params(module, params)  # same layout: the checkpoint moves
  np.testing.assert_allclose(module(X), expected, rtol=1e-5, atol=1e-6)


def test_grouped_heads_decode_through_a_smaller_cache():
  module = pd_nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=2, rngs=nnx.Rngs(0))
  full = module(X, mask=CAUSAL)
  module.init_cache(X.shape)
  assert module.cached_key[...].shape == (BATCH, LENGTH, 2, FEATURES // HEADS)
  decoded = jnp.concatenate([module(X[:, t : t + 1], decode=True) for t in range(LENGTH)], axis=1)
  np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [3, 0, 8])
def test_kv_heads_that_do_not_divide_the_heads_are_refused(bad):
  with pytest.raises(ValueError, match=f"num_kv_heads={bad} must divide num_heads={HEADS}"):
    pd_nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=bad, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=f"num_kv_heads={bad} must divide"):
    _linen_params(num_kv_heads=bad)


def test_hyla_refuses_grouped_heads_in_one_line():
  with pytest.raises(ValueError) as error:
    _linen_params(attention="hyla", num_kv_heads=2)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["softmax", "hyla", "sh"])
def test_is_causal_equals_flax_causal_mask(name):
  options = {"ratios": (1, 1, 2, 2)} if name == "sh" else {}
  causal, params = _linen_params(attention=name, attention_options=options, is_causal=True)
  plain = layers.MultiHeadAttention(num_heads=HEADS, attention=name, attention_options=options)
  expected = plain.apply({"params": params}, X, mask=CAUSAL)
  np.testing.assert_allclose(causal.apply({"params": params}, X), expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(plain.apply({"params": params}, X), expected, atol=1e-4)

  module = pd_nnx.MultiHeadAttention(
    HEADS, FEATURES, attention=name, attention_options=options, is_causal=True, rngs=nnx.Rngs(0)
  )
  pd_nnx.load_linen_params(module, params)
  np.testing.assert_allclose(module(X), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["softmax", "hyla"])
def test_is_causal_layers_decode_like_their_full_pass(name):
  """While decoding, the cache's mask of the keys seen so far is the causal mask: `is_causal` is
  not applied again to the one-row query (which would hide every key but the first)."""
  module = pd_nnx.MultiHeadAttention(
    HEADS, FEATURES, attention=name, is_causal=True, rngs=nnx.Rngs(0)
  )
  full = module(X)
  module.init_cache(X.shape)
  decoded = jnp.concatenate([module(X[:, t : t + 1], decode=True) for t in range(LENGTH)], axis=1)
  np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-6)

  linen = layers.MultiHeadAttention(num_heads=HEADS, attention=name, is_causal=True, decode=True)
  variables = {**linen.init(jax.random.key(0), X), "params": pd_nnx.linen_params(module)}
  for t in range(LENGTH):
    out, cache = linen.apply(variables, X[:, t : t + 1], mutable=["cache"])
    variables = {**variables, **cache}
    np.testing.assert_allclose(out[:, 0], full[:, t], rtol=1e-5, atol=1e-6)


def test_an_option_typo_is_one_line_naming_the_options():
  layer = layers.MultiHeadAttention(
    num_heads=HEADS, attention="bn", attention_options={"kernal": "linear"}
  )
  with pytest.raises(ValueError) as info:
    layer.init(jax.random.key(1), X)
  assert str(info.value) == (
    "unknown option 'kernal' for attention variant 'bn' (did you mean 'kernel'?); its options: "
    "eps, implementation, kernel, linear_eps, mean_weight, scale, statistics"
  )


def test_scaled_heads_without_ratios_say_what_to_pass():
  layer = layers.MultiHeadAttention(num_heads=HEADS, attention="bn_sh")
  with pytest.raises(ValueError, match=r"ratios is required: .*ratios=\(1, 1, 1, 1\)") as info:
    layer.init(jax.random.key(1), X)
  assert "attention_options={'ratios': ...}" in str(info.value)
