"""MultiHeadAttention: registry, Flax parameter compatibility, sowing, sharding annotations."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primal_dual import layers
from primal_dual.kernels import padding_mask, softmax_attention

HEADS, WIDTH, LENGTH = 4, 8, 6
# Options each variant needs at this head count (SH ratios have one entry per head).
OPTIONS = {
  "sh": {"ratios": (1, 1, 2, 3)},
  "bn_sh": {"ratios": (1, 2, 2, 3)},
  "random_feature": {"num_features": 16},
}


@pytest.fixture(scope="module")
def inputs():
  x = jax.random.normal(jax.random.key(0), (2, LENGTH, WIDTH))
  valid = jnp.arange(LENGTH)[None, :] < jnp.array([[LENGTH], [LENGTH - 2]])
  return x, valid


def _layer(name, **kw):
  return layers.MultiHeadAttention(
    num_heads=HEADS, attention=name, attention_options=OPTIONS.get(name, {}), **kw
  )


def test_unknown_variant_lists_known_names(inputs):
  x, _ = inputs
  with pytest.raises(ValueError, match="unknown attention variant 'nope'.*softmax"):
    _layer("nope").init(jax.random.key(0), x)


def test_heads_must_divide_width(inputs):
  x, _ = inputs
  with pytest.raises(ValueError, match="not divisible by num_heads=3"):
    layers.MultiHeadAttention(num_heads=3).init(jax.random.key(0), x)


def test_bad_variant_option_is_a_value_error(inputs):
  x, _ = inputs
  with pytest.raises(ValueError, match="ratios"):
    layers.MultiHeadAttention(
      num_heads=HEADS, attention="sh", attention_options={"ratios": (1, 2)}
    ).init(jax.random.key(0), x)


def test_every_variant_runs_with_the_same_parameters(inputs):
  x, valid = inputs
  mask = padding_mask(valid)
  counts = {}
  for name in layers.ATTENTION_REGISTRY:
    layer = _layer(name)
    variables = layer.init(jax.random.key(0), x, mask=mask)
    out = layer.apply(variables, x, mask=mask)
    assert out.shape == x.shape, name
    assert np.isfinite(np.asarray(out)).all(), name
    counts[name] = sum(p.size for p in jax.tree.leaves(variables))
  assert len(set(counts.values())) == 1, counts


def test_parameters_load_into_flax_and_softmax_matches(inputs):
  x, valid = inputs
  mask = padding_mask(valid)
  ours = _layer("softmax")
  variables = nn.meta.unbox(ours.init(jax.random.key(1), x, mask=mask))
  flax_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  flax_variables = flax_layer.init(jax.random.key(2), x, mask=mask)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, flax_variables)
  np.testing.assert_allclose(
    ours.apply(variables, x, mask=mask), flax_layer.apply(variables, x, mask=mask), atol=1e-5
  )
  # ... and the other way round.
  np.testing.assert_allclose(
    ours.apply(flax_variables, x, mask=mask),
    flax_layer.apply(flax_variables, x, mask=mask),
    atol=1e-5,
  )


def test_logical_axis_names_on_parameters(inputs):
  x, _ = inputs
  variables = _layer("softmax").init(jax.random.key(0), x)
  specs = nn.get_partition_spec(variables)["params"]
  assert tuple(specs["query"]["kernel"]) == ("embed", "heads", "kv")
  assert tuple(specs["out"]["kernel"]) == ("heads", "kv", "embed")


def test_sow_weights_into_intermediates(inputs):
  x, valid = inputs
  mask = padding_mask(valid)
  layer = _layer("softmax")
  variables = layer.init(jax.random.key(0), x, mask=mask)
  _, state = layer.apply(variables, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  (weights,) = state["intermediates"]["attention_weights"]
  assert weights.shape == (2, HEADS, LENGTH, LENGTH)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  assert float(jnp.abs(weights[1, :, :, LENGTH - 2 :]).max()) == 0.0  # padded keys unused


def test_dropout_uses_the_rng_stream_and_is_off_in_eval(inputs):
  x, _ = inputs
  layer = layers.MultiHeadAttention(num_heads=HEADS, dropout_rate=0.5)
  variables = layer.init(jax.random.key(0), x)
  a = layer.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  b = layer.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  assert not np.allclose(a, b)
  np.testing.assert_allclose(
    layer.apply(variables, x), layer.apply(variables, x, deterministic=True)
  )


def test_users_can_register_their_own_variant(inputs):
  x, _ = inputs
  calls = []

  def factory(*, temperature=1.0):
    def attention_fn(query, key, value, bias=None, mask=None, **kwargs):
      calls.append(temperature)
      return softmax_attention(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        scale=temperature / np.sqrt(query.shape[-1]),
        **kwargs,
      )

    return attention_fn

  layers.register_attention("tempered_softmax_test", factory, "test variant")
  try:
    with pytest.raises(ValueError, match="already registered"):
      layers.register_attention("tempered_softmax_test", factory)
    layer = layers.MultiHeadAttention(
      num_heads=HEADS, attention="tempered_softmax_test", attention_options={"temperature": 2.0}
    )
    layer.init(jax.random.key(0), x)
    assert calls == [2.0]
  finally:
    del layers.ATTENTION_REGISTRY["tempered_softmax_test"]


def test_context_options_reach_only_kernels_that_declare_them():
  fn = layers.make_attention_fn("softmax", {}, {"grid_shape": (2, 2), "num_prefix_tokens": 1})
  assert not isinstance(fn, functools.partial) or "grid_shape" not in fn.keywords
  fn = layers.make_attention_fn("sh", {"ratios": (1, 2)}, {"num_prefix_tokens": 1})
  assert fn.keywords["num_prefix_tokens"] == 1


@pytest.mark.parametrize("name", ["softmax", "hyla", "bn", "linear_bn"])
def test_decoding_with_a_cache_equals_the_full_causal_pass(name, inputs):
  x, _ = inputs
  params = _layer(name).init(jax.random.key(0), x)["params"]
  full = _layer(name).apply({"params": params}, x, mask=nn.make_causal_mask(x[..., 0]))
  decoder = _layer(name, decode=True)
  cache = decoder.init(jax.random.key(0), x)["cache"]  # sized by the full-length input
  assert cache["cached_key"].shape == (2, LENGTH, HEADS, WIDTH // HEADS)
  step = jax.jit(functools.partial(decoder.apply, mutable=["cache"]))
  outputs = []
  for t in range(LENGTH):
    out, variables = step({"params": params, "cache": cache}, x[:, t : t + 1])
    cache = variables["cache"]
    outputs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), full, rtol=1e-5, atol=1e-6)
  assert int(cache["cache_index"]) == LENGTH
  with pytest.raises(ValueError, match="one position at a time"):
    decoder.apply({"params": params, "cache": cache}, x[:, :2], mutable=["cache"])
