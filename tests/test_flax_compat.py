"""Every registered kernel as the ``attention_fn`` of Flax's own attention modules.

Drives ``flax.linen.MultiHeadDotProductAttention`` and ``flax.nnx.MultiHeadAttention`` the way a
Flax user would: float32 masks from ``nn.make_attention_mask`` / ``nn.make_causal_mask``, extra
batch dimensions, ``sow_weights=True``, dropout with ``deterministic=False``, bfloat16,
autoregressive decoding with ``decode=True`` and grouped key/value heads (``num_kv_heads``).
Shapes are tiny; each kernel compiles a handful of times.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primal_dual.layers import ATTENTION_REGISTRY, make_attention_fn

HEADS, FEATURES, LENGTH = 2, 8, 4
# Options a variant needs at this head count.
OPTIONS = {"sh": {"ratios": (1, 2)}, "bn_sh": {"ratios": (1, 2)}}
NAMES = sorted(ATTENTION_REGISTRY)
# Primal forms never form the weights: key-only masks, no dropout, nothing sown.
PRIMAL = {"random_feature"}
# A cached decoding step equals the full causal pass's row except for the variants whose registry
# entry says so (decodes=False: SH pools windows that a step cannot tell from padding); our
# layers refuse to decode them, Flax's layer with our kernel shows the difference.
NOT_DECODING = {name for name in NAMES if not ATTENTION_REGISTRY[name].decodes}
# Variants built on hyla_attention (linear_plain is its normalization='none', value_network='linear').
HYLA = {name for name in NAMES if name.startswith("hyla")} | {"linear_plain"}


def attention_fn(name):
  return make_attention_fn(name, OPTIONS.get(name))


def test_every_registered_variant_is_covered():
  """A new registry entry must declare here whether it is primal, per-sequence or neither."""
  assert {"softmax", "linear", "random_feature", "bn", "sh", "bn_sh", "hyla"} <= set(NAMES)
  assert PRIMAL | NOT_DECODING | HYLA <= set(NAMES)


# ---------------------------------------------------------------------------------------------
# Linen: float masks, extra batch dimensions, sown weights, dropout, bfloat16.
# ---------------------------------------------------------------------------------------------

_RNG = np.random.default_rng(0)
# Two batch dimensions [2, 2]; the flattened twin has one batch dimension [4].
INPUTS = jnp.asarray(_RNG.normal(size=(2, 2, LENGTH, FEATURES)), jnp.float32)
FLAT_INPUTS = INPUTS.reshape(4, LENGTH, FEATURES)
VALID = np.array(
  [[[1, 1, 1, 1], [1, 1, 1, 0]], [[1, 1, 0, 0], [1, 0, 0, 0]]], bool
)  # [2, 2, LENGTH]; nobody fully padded


def flax_float_mask(name):
  """What a Flax user writes: float32 masks. Query-dependent (padding and causal) for kernels
  that form the weights; key-only padding for the primal forms."""
  if name in PRIMAL:
    return nn.make_attention_mask(np.ones((2, 2, 1), bool), VALID)  # [2, 2, 1, 1, LENGTH]
  padding = nn.make_attention_mask(VALID, VALID)  # [2, 2, 1, LENGTH, LENGTH]
  causal = nn.make_causal_mask(VALID)  # [2, 2, 1, LENGTH, LENGTH], from VALID's shape only
  return nn.combine_masks(padding, causal)


def linen_module(name, **options):
  return nn.MultiHeadDotProductAttention(
    num_heads=HEADS, qkv_features=FEATURES, attention_fn=attention_fn(name), **options
  )


PARAMS = jax.jit(nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES).init)(
  jax.random.key(1), FLAT_INPUTS
)


@functools.lru_cache(maxsize=None)
def flat_reference(name):
  """float32 output on the flattened batch with a bool mask: the baseline of the tests below."""
  mask = np.asarray(flax_float_mask(name)).astype(bool)
  mask = mask.reshape(4, *mask.shape[2:])
  return mask, jax.jit(linen_module(name).apply)(PARAMS, FLAT_INPUTS, mask=mask)


@pytest.mark.parametrize("name", NAMES)
def test_linen_float_flax_masks_and_extra_batch_dims_with_sown_weights(name):
  mask = flax_float_mask(name)
  assert mask.dtype == jnp.float32
  apply = jax.jit(
    functools.partial(linen_module(name).apply, sow_weights=True, mutable=["intermediates"])
  )
  out, state = apply(PARAMS, INPUTS, mask=mask)
  assert out.shape == INPUTS.shape and out.dtype == jnp.float32
  # The float mask means what the bool mask means, and batch dimensions are independent.
  _, flat_out = flat_reference(name)
  np.testing.assert_allclose(out.reshape(flat_out.shape), flat_out, rtol=1e-5, atol=1e-6)
  # ... and the mask matters (padded keys of the last example are really excluded). An all-ones
  # mask hides nothing, and reuses the program compiled above.
  unmasked, _ = apply(PARAMS, INPUTS, mask=jnp.ones_like(mask))
  assert not np.allclose(out[1, 1], unmasked[1, 1], atol=1e-4)
  assert_sown_weights(name, state, batch_shape=(2, 2))


def assert_sown_weights(name, state, batch_shape):
  sown = state.get("intermediates", {}).get("attention_weights")
  if name in PRIMAL:
    assert sown is None
    return
  (weights,) = sown
  if name in ("sh", "bn_sh"):  # one array per ratio group: ratio 1 on head 0, ratio 2 on head 1
    assert [w.shape for w in weights] == [
      (*batch_shape, 1, LENGTH, LENGTH),
      (*batch_shape, 1, LENGTH, LENGTH // 2),
    ]
  else:
    assert weights.shape == (*batch_shape, HEADS, LENGTH, LENGTH)
  for w in jax.tree.leaves(weights):
    assert np.all(np.isfinite(w))


@pytest.mark.parametrize("name", NAMES)
def test_linen_dropout_with_deterministic_false(name):
  mask, clean = flat_reference(name)
  module = linen_module(name, dropout_rate=0.5)
  if name in PRIMAL:
    with pytest.raises(ValueError, match="dropout"):
      module.apply(
        PARAMS, FLAT_INPUTS, mask=mask, deterministic=False, rngs={"dropout": jax.random.key(0)}
      )
    return
  apply = jax.jit(functools.partial(module.apply, deterministic=False))

  def dropped(seed):
    return apply(PARAMS, FLAT_INPUTS, mask=mask, rngs={"dropout": jax.random.key(seed)})

  first = dropped(0)
  assert np.all(np.isfinite(first))
  np.testing.assert_array_equal(first, dropped(0))  # same rng, same pattern
  assert not np.allclose(first, clean, atol=1e-4)  # dropout happened
  assert not np.allclose(first, dropped(1), atol=1e-4)  # and follows the rng
  np.testing.assert_allclose(  # deterministic=True turns it off
    jax.jit(functools.partial(module.apply, deterministic=True))(PARAMS, FLAT_INPUTS, mask=mask),
    clean,
    atol=1e-6,
  )


@pytest.mark.parametrize("name", NAMES)
def test_linen_bfloat16(name):
  mask, full = flat_reference(name)
  half = jax.jit(linen_module(name, dtype=jnp.bfloat16).apply)(PARAMS, FLAT_INPUTS, mask=mask)
  assert half.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(half, np.float32)))
  scale = float(np.max(np.abs(full)))
  np.testing.assert_allclose(np.asarray(half, np.float32), full, atol=0.05 * scale, rtol=0.05)


def test_linen_softmax_with_float_masks_equals_flax_default():
  mask = flax_float_mask("softmax")
  default = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES)
  ours = jax.jit(linen_module("softmax").apply)(PARAMS, INPUTS, mask=mask)
  theirs = jax.jit(default.apply)(PARAMS, INPUTS, mask=mask)
  # Padded queries attend to nothing: Flax's softmax averages all values there, ours gives zeros
  # before the output projection (so the output bias). Every other position agrees.
  np.testing.assert_allclose(ours[VALID], theirs[VALID], atol=1e-6)
  out_bias = np.asarray(PARAMS["params"]["out"]["bias"])
  np.testing.assert_allclose(ours[~VALID], np.broadcast_to(out_bias, ours[~VALID].shape), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# NNX: autoregressive decoding with a cache, sown weights, grouped key/value heads.
# ---------------------------------------------------------------------------------------------

SEQUENCE = jnp.asarray(np.random.default_rng(1).normal(size=(2, LENGTH, FEATURES)), jnp.float32)


def nnx_module(name, **options):
  """Same seed, same parameters for every kernel."""
  return nnx.MultiHeadAttention(
    num_heads=HEADS,
    in_features=FEATURES,
    qkv_features=FEATURES,
    attention_fn=attention_fn(name),
    decode=False,
    rngs=nnx.Rngs(0),
    **options,
  )


@nnx.jit
def _full_causal_pass(module, x):
  return module(x, is_causal=True)


@nnx.jit
def _decode_step(module, token):
  return module(token, decode=True)


def decode_token_by_token(module, x):
  """Feeds ``x [batch, LENGTH, features]`` one position at a time through the key/value cache."""
  module.init_cache(x.shape)
  return jnp.concatenate([_decode_step(module, x[:, t : t + 1]) for t in range(x.shape[1])], axis=1)


@nnx.jit
def _prefix_passes(module, x):
  """Row t of a non-causal pass whose keys are the first t + 1 positions (key padding)."""
  seen = jnp.arange(LENGTH)[None, :] <= jnp.arange(LENGTH)[:, None]  # [t, key]
  # Key-only float32 mask [t, 1, 1, 1, key] (the primal forms need key-only masks).
  mask = nn.make_attention_mask(jnp.ones((LENGTH, 1, 1)), seen[:, None, :])
  out = module(jnp.broadcast_to(x, (LENGTH, *x.shape)), mask=mask)  # [t, batch, LENGTH, F]
  return jnp.stack([out[t, :, t] for t in range(LENGTH)], axis=1)


@pytest.mark.parametrize("name", NAMES)
def test_nnx_decoding_with_a_cache(name):
  """Decoding equals attending to the keys seen so far; for every kernel but SH's that is the full
  causal pass (Attention-BN's causal statistics are those of the keys seen so far). SH and BN+SH
  differ before the last position (the step pools the incomplete window the full pass hides) and
  agree at it."""
  module = nnx_module(name)
  full = _full_causal_pass(module, SEQUENCE)
  decoded = decode_token_by_token(module, SEQUENCE)
  assert decoded.shape == full.shape
  assert np.all(np.isfinite(decoded))
  np.testing.assert_allclose(decoded, _prefix_passes(module, SEQUENCE), rtol=1e-4, atol=1e-5)
  if name not in NOT_DECODING:
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-5)
    return
  np.testing.assert_allclose(decoded[:, -1], full[:, -1], rtol=1e-4, atol=1e-5)
  assert not np.allclose(decoded[:, :-1], full[:, :-1], atol=1e-3)


@pytest.mark.parametrize("name", ["softmax", "sh", "hyla"])
def test_nnx_sow_weights(name):
  module = nnx_module(name)
  out, intermediates = nnx.capture(module, nnx.Intermediate)(
    SEQUENCE, is_causal=True, sow_weights=True
  )
  np.testing.assert_allclose(out, _full_causal_pass(module, SEQUENCE), rtol=1e-5, atol=1e-6)
  (weights,) = intermediates["attention_weights"].get_value()
  assert_sown_weights(name, {"intermediates": {"attention_weights": (weights,)}}, batch_shape=(2,))
  if name == "softmax":  # causal: nothing above the diagonal
    np.testing.assert_array_equal(np.triu(np.asarray(weights), k=1), 0.0)


@pytest.mark.parametrize("name", NAMES)
def test_nnx_grouped_key_value_heads(name):
  """``num_kv_heads=1`` (MQA); HYLA refuses grouped heads."""
  module = nnx_module(name, num_kv_heads=1)
  if name in HYLA:
    with pytest.raises(ValueError, match="does not support grouped key/value heads"):
      module(SEQUENCE)
    return
  out = _full_causal_pass(module, SEQUENCE)
  assert out.shape == SEQUENCE.shape and np.all(np.isfinite(out))
  if name == "softmax":  # Flax's own grouping: query head h uses key/value head h // groups
    default = nnx.MultiHeadAttention(
      num_heads=HEADS,
      in_features=FEATURES,
      qkv_features=FEATURES,
      num_kv_heads=1,
      decode=False,
      rngs=nnx.Rngs(0),
    )
    np.testing.assert_allclose(out, default(SEQUENCE, is_causal=True), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Flax's function contract: its shape-error wording and its einsum keyword arguments.
# ---------------------------------------------------------------------------------------------

_X = jnp.ones((1, 3, 2, 4))
# (q, k, v shapes) that flax.nnx.dot_product_attention refuses, with its message's key phrase.
FLAX_SHAPE_ERRORS = {
  "batch dims must match": ((2, 3, 2, 4), (3, 3, 2, 4), (3, 3, 2, 4)),
  "lengths must match": ((1, 3, 2, 4), (1, 3, 2, 4), (1, 4, 2, 4)),
  "depths must match": ((1, 3, 2, 4), (1, 3, 2, 5), (1, 3, 2, 5)),
  "must be multiple": ((1, 3, 5, 4), (1, 3, 2, 4), (1, 3, 2, 4)),
  "must have same rank": ((1, 3, 2, 4), (3, 2, 4), (3, 2, 4)),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("phrase", sorted(FLAX_SHAPE_ERRORS))
def test_shape_errors_are_value_errors_with_flax_wording(name, phrase):
  q, k, v = (jnp.ones(s) for s in FLAX_SHAPE_ERRORS[phrase])
  # Flax's own function says the same on its weights path (dropout_rate > 0 keeps it off the
  # jax.nn fast path, whose messages differ).
  with pytest.raises(ValueError, match=phrase):
    nnx.dot_product_attention(q, k, v, dropout_rate=0.5, deterministic=True)
  with pytest.raises(ValueError, match=phrase):
    attention_fn(name)(q, k, v)


def _einsum_hook():
  return functools.partial(jnp.einsum, precision=None)


@pytest.mark.parametrize("name", NAMES)
def test_flax_einsum_keywords_are_value_errors_like_flax(name):
  fn = attention_fn(name)
  # Flax's own checks, same exception type and wording.
  for call in (nn.dot_product_attention, fn):
    with pytest.raises(ValueError, match="must be specified together"):
      call(_X, _X, _X, qk_attn_weights_einsum=_einsum_hook())
    with pytest.raises(ValueError, match="mutually exclusive"):
      call(
        _X,
        _X,
        _X,
        precision="highest",
        qk_attn_weights_einsum=_einsum_hook(),
        attn_weights_value_einsum=_einsum_hook(),
      )
  # Hooks Flax would use: our kernels refuse them with a ValueError, never a TypeError.
  with pytest.raises(ValueError, match="custom einsum hooks"):
    fn(_X, _X, _X, einsum_dot_general=jax.lax.dot_general)
  np.testing.assert_array_equal(fn(_X, _X, _X, einsum_dot_general=None), fn(_X, _X, _X))


def test_linen_module_passes_its_einsum_hooks_and_we_refuse_them():
  """MultiHeadDotProductAttention passes the keyword arguments our signature lists: None by
  default (works, tested above), a hook when ``*_einsum_cls`` is set (refused with ValueError)."""
  module = nn.MultiHeadDotProductAttention(
    num_heads=HEADS,
    qkv_features=FEATURES,
    attention_fn=attention_fn("softmax"),
    qk_attn_weights_einsum_cls=_einsum_hook,
    attn_weights_value_einsum_cls=_einsum_hook,
  )
  with pytest.raises(ValueError, match="custom einsum hooks"):
    module.apply(PARAMS, FLAT_INPUTS)
