"""primal_dual.nnx.MultiHeadAttention: the Linen layer's outputs and parameter layout in NNX,
checkpoints both ways, learned kernel parameters, decoding with a cache, dropout."""

import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primal_dual import layers, registry
from primal_dual import nnx as pd_nnx
from primal_dual.kernels import padding_mask

BATCH, LENGTH, FEATURES, HEADS = 2, 5, 8, 2
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X = jax.random.normal(jax.random.key(0), (BATCH, LENGTH, FEATURES))
# Key padding (accepted by every kernel, the primal forms included): example 1 has 3 valid keys.
MASK = padding_mask(jnp.arange(LENGTH)[None, :] < jnp.array([[LENGTH], [3]]))


def _options(name):
  return registry.model_options(
    name, HEADS, **({"num_features": 16} if name == "random_feature" else {})
  )


def _linen(name, **kw):
  return layers.MultiHeadAttention(
    num_heads=HEADS, attention=name, attention_options=_options(name), **kw
  )


def _nnx(name, seed=0, **kw):
  return pd_nnx.MultiHeadAttention(
    HEADS, FEATURES, attention=name, attention_options=_options(name), rngs=nnx.Rngs(seed), **kw
  )


def _shapes(tree):
  return jax.tree.map(jnp.shape, tree)


@nnx.jit
def _nnx_apply(module, x, mask):
  return module(x, mask=mask)


@pytest.mark.parametrize("name", sorted(registry.ATTENTION_REGISTRY))
def test_nnx_equals_linen_and_parameters_move_both_ways(name):
  linen = _linen(name)
  params = nn.meta.unbox(linen.init(jax.random.key(1), X, mask=MASK))["params"]
  module = _nnx(name)
  # Same names and shapes, but NNX's own initialisation: the outputs differ before loading.
  assert _shapes(pd_nnx.linen_params(module)) == _shapes(params)
  expected = jax.jit(linen.apply)({"params": params}, X, mask=MASK)
  assert not np.allclose(_nnx_apply(module, X, MASK), expected, atol=1e-4)

  pd_nnx.load_linen_params(module, {"params": params})
  np.testing.assert_allclose(_nnx_apply(module, X, MASK), expected, rtol=1e-5, atol=1e-6)

  # Round trip: a fresh NNX layer's state loads into Linen and gives the NNX output.
  other = _nnx(name, seed=7)
  converted = pd_nnx.linen_params(other)
  assert _shapes(converted) == _shapes(params)
  np.testing.assert_allclose(
    jax.jit(linen.apply)({"params": converted}, X, mask=MASK),
    _nnx_apply(other, X, MASK),
    rtol=1e-5,
    atol=1e-6,
  )


def test_loading_refuses_wrong_names_and_shapes():
  module = _nnx("softmax")
  params = pd_nnx.linen_params(module)
  with pytest.raises(ValueError, match="missing.*out/bias"):
    pd_nnx.load_linen_params(module, {**params, "out": {"kernel": params["out"]["kernel"]}})
  wrong = {**params, "out": {**params["out"], "bias": jnp.zeros(FEATURES + 1)}}
  with pytest.raises(ValueError, match=r"out/bias: shape \(9,\)"):
    pd_nnx.load_linen_params(module, wrong)


@pytest.fixture
def learned_temperature():
  path = os.path.join(REPO_ROOT, "docs", "examples", "learned_temperature.py")
  spec = importlib.util.spec_from_file_location("learned_temperature_nnx_test", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  yield module.NAME
  del registry.ATTENTION_REGISTRY[module.NAME]


def test_learned_kernel_parameter_in_both_layouts(learned_temperature):
  name = learned_temperature
  linen = _linen(name)
  params = nn.meta.unbox(linen.init(jax.random.key(1), X))["params"]
  module = _nnx(name)
  assert params["log_temperature"].shape == (HEADS,)
  assert module.log_temperature[...].shape == (HEADS,)
  assert _shapes(pd_nnx.linen_params(module)) == _shapes(params)
  assert module.log_temperature.get_metadata()["out_sharding"] == ("heads",)
  # A non-zero temperature (the initial 0 is plain softmax) moves with the checkpoint and is used.
  tempered = {**params, "log_temperature": jnp.array([1.0, -1.0])}
  expected = linen.apply({"params": tempered}, X)
  assert not np.allclose(expected, linen.apply({"params": params}, X), atol=1e-4)
  pd_nnx.load_linen_params(module, tempered)
  np.testing.assert_allclose(module.log_temperature[...], [1.0, -1.0])
  np.testing.assert_allclose(module(X), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(pd_nnx.linen_params(module)["log_temperature"], [1.0, -1.0])


@nnx.jit
def _causal_pass(module, x):
  return module(x, is_causal=True)  # per call, as flax.nnx.MultiHeadAttention


@nnx.jit
def _decode_step(module, token):
  return module(token, decode=True)


DECODING = sorted(name for name, entry in registry.ATTENTION_REGISTRY.items() if entry.decodes)


@pytest.mark.parametrize("name", DECODING)
def test_decoding_equals_the_full_causal_pass(name):
  module = _nnx(name)
  full = _causal_pass(module, X)
  module.init_cache(X.shape)
  decoded = jnp.concatenate([_decode_step(module, X[:, t : t + 1]) for t in range(LENGTH)], axis=1)
  np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-6)
  assert int(module.cache_index[...]) == LENGTH
  # Without the causal mask the rows differ: the cache really hides the positions not yet fed.
  assert not np.allclose(full[:, 0], module(X)[:, 0], atol=1e-4)


def test_per_call_is_causal_overrides_the_attribute():
  causal = _nnx("softmax", is_causal=True)
  plain = _nnx("softmax")
  np.testing.assert_allclose(causal(X), plain(X, is_causal=True), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(causal(X, is_causal=False), plain(X), rtol=1e-6, atol=1e-6)
  assert not np.allclose(plain(X), plain(X, is_causal=True), atol=1e-4)


@pytest.mark.parametrize("name", ["sh", "bn_sh"])
def test_pooled_variants_refuse_to_decode_in_both_layers(name):
  """A decoding step cannot tell the keys not yet fed from padding, so SH would pool the
  incomplete window that the full causal pass hides: both layers refuse, in one line."""
  assert not registry.lookup(name).decodes
  module = _nnx(name)
  module.init_cache(X.shape)
  with pytest.raises(ValueError, match="cannot decode with a key/value cache"):
    module(X[:, :1], decode=True)
  with pytest.raises(ValueError, match="cannot decode with a key/value cache"):
    _linen(name, decode=True).init(jax.random.key(0), X)


def test_decoding_needs_a_cache_and_one_position():
  module = _nnx("softmax", decode=True)
  with pytest.raises(ValueError, match="init_cache"):
    module(X[:, :1])
  module.init_cache(X.shape)
  with pytest.raises(ValueError, match="one position at a time"):
    module(X[:, :2])


def test_dropout_only_when_not_deterministic():
  module = _nnx("softmax", dropout_rate=0.5)
  clean = _nnx("softmax")(X)  # same seed, same parameters, no dropout
  np.testing.assert_allclose(module(X), clean, atol=1e-6)  # deterministic by default
  np.testing.assert_allclose(module(X, deterministic=True), clean, atol=1e-6)
  dropped = module(X, deterministic=False)
  assert np.all(np.isfinite(dropped)) and not np.allclose(dropped, clean, atol=1e-4)
  assert not np.allclose(module(X, deterministic=False), dropped, atol=1e-4)  # the stream moves
  # A call's own rngs decide the pattern; the attribute sets the default.
  same = [module(X, deterministic=False, rngs=nnx.Rngs(dropout=3)) for _ in range(2)]
  np.testing.assert_array_equal(*same)
  training = _nnx("softmax", dropout_rate=0.5, deterministic=False)
  assert not np.allclose(training(X), clean, atol=1e-4)
  np.testing.assert_allclose(training(X, deterministic=True), clean, atol=1e-6)


def test_sow_weights():
  module = _nnx("softmax")
  out, intermediates = nnx.capture(module, nnx.Intermediate)(X, mask=MASK, sow_weights=True)
  np.testing.assert_allclose(out, module(X, mask=MASK), atol=1e-6)
  (weights,) = intermediates["attention_weights"].get_value()
  assert weights.shape == (BATCH, HEADS, LENGTH, LENGTH)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  assert float(jnp.abs(weights[1, :, :, 3:]).max()) == 0.0  # padded keys unused


def test_bad_construction_is_a_value_error():
  with pytest.raises(ValueError, match="unknown attention variant 'nope'"):
    pd_nnx.MultiHeadAttention(HEADS, FEATURES, attention="nope", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="not divisible by num_heads=3"):
    pd_nnx.MultiHeadAttention(3, FEATURES, rngs=nnx.Rngs(0))
  module = pd_nnx.MultiHeadAttention(
    HEADS, FEATURES, attention="sh", attention_options={"ratios": (1,)}, rngs=nnx.Rngs(0)
  )
  with pytest.raises(ValueError, match="ratios"):  # the kernel checks its ratios on the shapes
    module(X)


def test_primal_dual_exposes_nnx_lazily():
  import primal_dual

  assert primal_dual.nnx.MultiHeadAttention is pd_nnx.MultiHeadAttention
  assert "nnx" in primal_dual.__all__
