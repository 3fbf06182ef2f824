"""Edge cases every kernel meets through ``kernels/driver.py`` (HYLA included): empty key axis,
non-float inputs, unbatched inputs with a batched mask, Flax's wording and keyword arguments,
``map_heads`` sizes, SH ratios above the length, and the fused path's precision and dtype rules.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primal_dual.kernels import (
  batchnorm_attention,
  hyla_attention,
  linear_attention,
  random_feature_attention,
  scaled_head_attention,
  softmax_attention,
)
from primal_dual.kernels._common import map_heads

KERNELS = {
  "softmax": softmax_attention,
  "linear": linear_attention,
  "random_feature": functools.partial(random_feature_attention, feature_key=jax.random.key(0)),
  "bn": batchnorm_attention,
  "sh": functools.partial(scaled_head_attention, ratios=(1, 2)),
  "bn_sh": functools.partial(scaled_head_attention, ratios=(1, 2), batchnorm=True),
  "hyla": hyla_attention,
}
NAMES = sorted(KERNELS)


def _x(shape, seed=0, dtype=jnp.float32):
  # Drawn by NumPy: jax.random compiles a sampler per shape and dtype (~2 s each on CPU).
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


@pytest.mark.parametrize("name", NAMES)
def test_empty_key_axis_raises_naming_the_shapes(name):
  q, kv = _x((1, 3, 2, 4)), jnp.zeros((1, 0, 2, 4))
  with pytest.raises(ValueError, match=r"kv_len >= 1.*key.shape=\(1, 0, 2, 4\)"):
    KERNELS[name](q, kv, kv)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_non_float_inputs_raise(name, dtype):
  x = jnp.ones((1, 3, 2, 4), dtype)
  with pytest.raises(ValueError, match=f"real floating-point.*query={jnp.dtype(dtype)}"):
    KERNELS[name](x, x, x)
  # One non-float argument is enough.
  with pytest.raises(ValueError, match="real floating-point"):
    KERNELS[name](_x((1, 3, 2, 4)), _x((1, 3, 2, 4)), x)


@pytest.mark.parametrize("name", NAMES)
def test_unbatched_inputs_take_a_batched_mask_as_jax_and_nnx_do(name):
  q, k, v = _x((4, 2, 8), 0), _x((5, 2, 8), 1), _x((5, 2, 8), 2)
  mask = np.ones((1, 1, 1, 5), bool)  # key-only, which the primal forms take too
  mask[..., 3:] = False  # padding: the last two keys
  out = KERNELS[name](q, k, v, mask=mask)
  assert out.shape == (4, 2, 8)
  # The same as the batched call with that mask, and as dropping the padded keys.
  batched = KERNELS[name](q[None], k[None], v[None], mask=mask)
  np.testing.assert_allclose(out, batched[0], rtol=1e-5, atol=1e-5)
  if name not in ("sh", "bn_sh", "random_feature"):  # SH pools windows; features are random
    np.testing.assert_allclose(out, KERNELS[name](q, k[:3], v[:3]), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 1, 5\) does not broadcast"):
    KERNELS[name](q, k, v, mask=np.ones((2, 1, 1, 5), bool))


# Flax's messages (flax.nnx.dot_product_attention's checks and linen's asserts).
FLAX_WORDING = [
  ("q, k, v batch dims must match", (2, 3, 2, 4), (3, 3, 2, 4), (3, 3, 2, 4)),
  ("k, v lengths must match", (1, 3, 2, 4), (1, 3, 2, 4), (1, 4, 2, 4)),
  ("q, k depths must match", (1, 3, 2, 4), (1, 3, 2, 5), (1, 3, 2, 5)),
  ("must be multiple of", (1, 3, 5, 4), (1, 3, 2, 4), (1, 3, 2, 4)),
  ("must be a multiple of", (1, 3, 5, 4), (1, 3, 2, 4), (1, 3, 2, 4)),
  ("q, k, v must have same rank", (1, 3, 2, 4), (3, 2, 4), (3, 2, 4)),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("wording,q_shape,k_shape,v_shape", FLAX_WORDING)
def test_shape_errors_carry_flax_wording(name, wording, q_shape, k_shape, v_shape):
  with pytest.raises(ValueError, match=wording):
    KERNELS[name](_x(q_shape), _x(k_shape), _x(v_shape))


@pytest.mark.parametrize("name", NAMES)
def test_flax_einsum_hooks_are_accepted_as_none_and_refused_otherwise(name):
  x = _x((1, 3, 2, 4))
  reference = KERNELS[name](x, x, x)
  none_given = KERNELS[name](
    x,
    x,
    x,
    einsum_dot_general=None,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    force_fp32_for_softmax=True,
  )
  np.testing.assert_array_equal(none_given, reference)
  with pytest.raises(ValueError, match="must be specified together"):
    KERNELS[name](x, x, x, qk_attn_weights_einsum=jnp.einsum)
  with pytest.raises(ValueError, match="mutually exclusive"):
    KERNELS[name](
      x,
      x,
      x,
      precision="highest",
      qk_attn_weights_einsum=jnp.einsum,
      attn_weights_value_einsum=jnp.einsum,
    )
  for hooks in (
    dict(einsum_dot_general=jax.lax.dot_general),
    dict(qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum),
  ):
    with pytest.raises(ValueError, match="custom einsum hooks"):
      KERNELS[name](x, x, x, **hooks)


def test_map_heads_refuses_leading_sizes_that_disagree():
  def add(a, b):
    return a + b

  ok = map_heads(add, jnp.ones((2, 3, 4)), jnp.ones((1, 3, 4)))
  assert ok.shape == (2, 3, 4)
  with pytest.raises(ValueError, match=r"B=3, H=3.*\(2, 3, 4\), \(3, 3, 4\)"):
    map_heads(add, jnp.ones((2, 3, 4)), jnp.ones((3, 3, 4)))
  with pytest.raises(ValueError, match=r"H=3.*\(2, 2, 4\), \(2, 3, 4\)"):
    map_heads(add, jnp.ones((2, 2, 4)), jnp.ones((2, 3, 4)))


@pytest.mark.parametrize(
  "options,kv_len,match",
  [
    (dict(ratios=(1, 9)), 8, r"ratios \[9\] exceed the pooled length \(8 keys"),
    (dict(ratios=(1, 8), num_prefix_tokens=1), 8, r"\(7 keys after the prefix"),
    (dict(ratios=(5, 2), grid_shape=(4, 2)), 8, r"ratios \[5\].*grid side of \(4, 2\)"),
  ],
)
def test_sh_ratio_above_the_length_raises(options, kv_len, match):
  q, kv = _x((1, 3, 2, 4)), _x((1, kv_len, 2, 4))
  with pytest.raises(ValueError, match=match):
    scaled_head_attention(q, kv, kv, **options)
  # A ratio equal to the pooled length is one window: accepted.
  fine = dict(
    options,
    ratios=tuple(min(r, kv_len - options.get("num_prefix_tokens", 0)) for r in options["ratios"]),
  )
  if "grid_shape" in options:
    fine["ratios"] = (4, 2)
  assert scaled_head_attention(q, kv, kv, **fine).shape == (1, 3, 2, 4)


FUSED = {
  "softmax": softmax_attention,
  "bn": batchnorm_attention,
  "sh": functools.partial(scaled_head_attention, ratios=(1, 2)),
  "bn_sh": functools.partial(scaled_head_attention, ratios=(1, 2), batchnorm=True),
}


def _count_fused(monkeypatch):
  calls = []
  original = jax.nn.dot_product_attention

  def counting(*args, **kwargs):
    calls.append(args[0].dtype)
    return original(*args, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", counting)
  return calls


@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("precision", ["highest", jax.lax.Precision.HIGH, ("highest", "highest")])
def test_precision_sends_auto_to_the_reference_path(name, precision, monkeypatch):
  calls = _count_fused(monkeypatch)
  q, k, v = _x((1, 6, 2, 8), 0), _x((1, 6, 2, 8), 1), _x((1, 6, 2, 8), 2)
  out = FUSED[name](q, k, v, precision=precision)
  assert not calls
  reference = FUSED[name](q, k, v, precision=precision, implementation="reference")
  np.testing.assert_array_equal(out, reference)
  with pytest.raises(ValueError, match="precision=.*takes none"):
    FUSED[name](q, k, v, precision=precision, implementation="fused")
  # None and DEFAULT leave the fused path open.
  for default in (None, "default", jax.lax.Precision.DEFAULT):
    FUSED[name](q, k, v, precision=default)
  assert len(calls) == 3 * (2 if name in ("sh", "bn_sh") else 1)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_product_runs_in_the_promoted_input_dtype(name, monkeypatch):
  calls = _count_fused(monkeypatch)
  q = _x((1, 6, 2, 8), 0)
  k, v = _x((1, 6, 2, 8), 1, jnp.bfloat16), _x((1, 6, 2, 8), 2, jnp.bfloat16)
  # A float32 query with bfloat16 keys and values: float32 (the query is not rounded).
  mixed = FUSED[name](q, k, v)
  assert set(calls) == {jnp.dtype(jnp.float32)} and mixed.dtype == jnp.float32
  reference = FUSED[name](q, k, v, implementation="reference")
  # The reference path rounds its weights to the values' dtype (bfloat16) before the product.
  np.testing.assert_allclose(mixed, reference, rtol=2e-2, atol=1e-2)
  calls.clear()
  FUSED[name](q.astype(jnp.bfloat16), k, v)
  assert set(calls) == {jnp.dtype(jnp.bfloat16)}
