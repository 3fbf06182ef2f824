"""Attention-SH and BN+SH on the fused path: each ratio group attends on its pooled keys through
``jax.nn.dot_product_attention`` without a mask (so cuDNN may take it on a GPU), nothing of size
``q_len × kv_len`` is formed for a group with ratio > 1, and XLA's FLOP count follows the
analytic ratio ``(1/H) Σ_h 1/r_h``. Checked on the CPU through the jaxpr and XLA's cost analysis.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from primal_dual.kernels import fused
from primal_dual.kernels import scaled_head as sh
from primal_dual.kernels.softmax import softmax_attention

VARIANTS = {"sh": {}, "bn_sh": {"batchnorm": True}}


def _qkv(q_len, kv_len, heads, d=8, seed=0, dtype=jnp.float32):
  # Drawn by NumPy: jax.random compiles a sampler per shape and dtype (~2 s each on CPU).
  qkv = helpers.random_qkv(np.random.default_rng(seed), (1,), q_len, kv_len, heads, d, d, dtype)
  return tuple(jnp.asarray(x) for x in qkv)


def _all_shapes(jaxpr):
  """Shapes of every value a jaxpr computes (nested jaxprs included)."""
  shapes = []
  for eqn in jaxpr.eqns:
    shapes += [tuple(var.aval.shape) for var in eqn.outvars if hasattr(var.aval, "shape")]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes += _all_shapes(sub)
  return shapes


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("with_gradient", [False, True])
def test_no_full_width_buffer_for_pooled_groups(variant, with_gradient):
  # Distinct q_len and kv_len so a [.., q_len, kv_len] buffer cannot be mistaken for another.
  ratios, q_len, kv_len = (2, 2, 4, 4), 24, 32
  q, k, v = _qkv(q_len, kv_len, len(ratios))
  attention = functools.partial(
    sh.scaled_head_attention, ratios=ratios, implementation="fused", **VARIANTS[variant]
  )
  fn = attention
  if with_gradient:
    fn = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)), argnums=(0, 1, 2))
  shapes = _all_shapes(jax.make_jaxpr(fn)(q, k, v).jaxpr)
  widest = max(s[-1] for s in shapes if len(s) >= 2 and s[-2] == q_len)
  # The logits of the ratio-2 group are the widest [q_len, ·] buffer: kv_len / 2 per head.
  assert widest == kv_len // 2, sorted(set(shapes))
  assert not [s for s in shapes if q_len in s and kv_len in s], sorted(set(shapes))
  # Nothing per query is bigger than the ratio-2 group's logits (2 heads × q_len × kv_len / 2).
  per_query = [np.prod(s) for s in shapes if q_len in s]
  assert max(per_query) <= 2 * q_len * (kv_len // 2), sorted(set(shapes))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_groups_reach_dot_product_attention_unmasked_and_in_the_input_dtype(variant, monkeypatch):
  calls = []
  original = jax.nn.dot_product_attention

  def recording(query, key, value, bias=None, mask=None, **kwargs):
    calls.append((query.shape[1], key.shape[1], query.dtype, bias is None, mask is None))
    return original(query, key, value, bias, mask, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  q, k, v = _qkv(5, 16, 4, dtype=jnp.bfloat16)
  attention = functools.partial(sh.scaled_head_attention, ratios=(1, 2, 4, 4), **VARIANTS[variant])
  jax.eval_shape(attention, q, k, v)  # the calls are made while tracing: nothing to compile
  # [B, len, heads, d]: one call per group, pooled key lengths 16, 8, 4; no mask, no bias.
  assert calls == [
    (5, 16, jnp.bfloat16, True, True),
    (5, 8, jnp.bfloat16, True, True),
    (5, 4, jnp.bfloat16, True, True),
  ]
  # What cuDNN needs on a GPU: unmasked, bfloat16, head size 8.
  assert fused.backend_implementation(q, head_size=8, masked=False) == (
    "cudnn" if jax.default_backend() == "gpu" else "xla"
  )


def _flops(fn, *args):
  return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("with_gradient", [False, True])
def test_xla_flops_follow_the_analytic_ratio(variant, with_gradient):
  ratios = (1, 1, 2, 2, 4, 4, 8, 8)
  expected = sh.attention_cost_ratio(ratios)
  assert expected == pytest.approx(0.46875)
  q, k, v = _qkv(128, 128, len(ratios), d=16)
  sh_fn = functools.partial(sh.scaled_head_attention, ratios=ratios, **VARIANTS[variant])
  functions = [sh_fn, softmax_attention]
  if with_gradient:
    functions = [
      jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)) for f in functions
    ]
  measured = _flops(functions[0], q, k, v) / _flops(functions[1], q, k, v)
  # Pooling, BN statistics and the softmax's elementwise work add a little to the products.
  assert measured == pytest.approx(expected, abs=0.06), (measured, expected)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("masked", [False, True])
def test_fused_equals_reference_without_and_with_a_mask(variant, masked):
  ratios = (1, 2, 3, 5)
  q, k, v = _qkv(6, 11, len(ratios), seed=3)
  mask = None
  if masked:
    mask = np.random.default_rng(4).random((1, 1, 6, 11)) < 0.7
  outs = [
    jax.jit(
      functools.partial(
        sh.scaled_head_attention, ratios=ratios, implementation=impl, **VARIANTS[variant]
      )
    )(q, k, v, mask=mask)
    for impl in ("fused", "reference")
  ]
  np.testing.assert_allclose(outs[0], outs[1], rtol=2e-5, atol=2e-5)


def _count_primitive(jaxpr, name: str) -> int:
  """How many equations of ``jaxpr`` (nested ones included) apply primitive ``name``."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _count_primitive(sub, name)
  return count


SINGLE_LAUNCH_CASES = {
  "no mask": {},
  "padding": {"mask": np.arange(10)[None, None, None, :] < np.array([10, 6])[:, None, None, None]},
  "causal": {"is_causal": True},
  "bias and query padding": {
    "bias": np.random.default_rng(3).normal(size=(4, 10, 10)).astype(np.float32),
    "mask": (np.arange(10) < 7)[None, None, :, None] & (np.arange(10) < 8)[None, None, None, :],
  },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", sorted(SINGLE_LAUNCH_CASES))
def test_every_ratio_group_in_one_launch_is_the_same_function(variant, case):
  """``single_launch=True``: one ``jax.nn.dot_product_attention`` (two products, logits and
  values, where the per-group path has two per group) with heads folded into the batch and each
  row's pooled length as its key length; the reference path's outputs and gradients."""
  ratios = (1, 2, 3, 2)
  q, k, v = _qkv(10, 10, len(ratios))
  q, k, v = (jnp.concatenate([x, x[:, ::-1] * 0.5]) for x in (q, k, v))  # batch of 2
  run = {
    implementation: functools.partial(
      sh.scaled_head_attention,
      ratios=ratios,
      implementation=implementation,
      **VARIANTS[variant],
      **SINGLE_LAUNCH_CASES[case],
    )
    for implementation in ("fused", "reference")
  }
  single = functools.partial(run["fused"], single_launch=True)

  def gradients_and_output(fn):  # one jitted program per path: outputs and gradients
    def loss(q, k, v):
      out = fn(q, k, v)
      return jnp.sum(jnp.sin(out)), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  grads, out = gradients_and_output(single)
  expected, expected_out = gradients_and_output(run["reference"])
  np.testing.assert_allclose(out, expected_out, atol=2e-6)
  for grad, want in zip(grads, expected):
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5)
  products = {
    launch: _count_primitive(
      jax.make_jaxpr(functools.partial(run["fused"], single_launch=launch))(q, k, v).jaxpr,
      "dot_general",
    )
    for launch in (True, False)
  }
  groups = len(set(ratios))
  assert products[False] - products[True] == 2 * (groups - 1), products


def _window_means(x, ratio):
  """NumPy float64 reference: each head's window means in key order, ``[B, H, N / ratio, C]``."""
  batch, heads, length, channels = x.shape
  return np.asarray(x, np.float64).reshape(batch, heads, length // ratio, ratio, channels).mean(3)


@pytest.mark.parametrize(
  "ratios, length",
  [((1, 1, 2, 2, 4, 4, 8, 8), 24), ((1, 2, 3, 6), 18), ((2, 4), 8), ((3, 3), 6)],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pooling_every_head_at_once_gives_each_heads_window_means(ratios, length, dtype):
  rng = np.random.default_rng(len(ratios) + length)
  x = jnp.asarray(rng.normal(size=(2, len(ratios), length, 5)), dtype)
  pooled = np.asarray(jax.jit(sh.pool_every_head_at_once, static_argnums=1)(x, ratios), np.float64)
  block = sh.pooling_block(ratios)
  assert pooled.shape == (2, len(ratios), length // min(ratios), 5)
  for head, ratio in enumerate(ratios):
    means = _window_means(np.asarray(x[:, head : head + 1], np.float32), ratio)[:, 0]
    count, per_block = length // ratio, block // ratio
    # Row p·(N/L) + n holds window n·(L/r) + p (block-major); the rows after the head's N/r are 0.
    rows = [p * (length // block) + n for p in range(per_block) for n in range(length // block)]
    windows = [n * per_block + p for p in range(per_block) for n in range(length // block)]
    got = pooled[:, head, rows]
    want = np.asarray(jnp.asarray(means[:, windows], dtype), np.float64)  # rounded as x is
    np.testing.assert_allclose(got, want, rtol=0 if dtype == jnp.bfloat16 else 1e-6, atol=1e-7)
    assert not pooled[:, head, count:].any()
  with pytest.raises(ValueError, match=r"\(2, 2, 8, 5\).*lcm\(ratios\) = 6"):
    sh.pool_every_head_at_once(jnp.zeros((2, 2, 8, 5)), (2, 3))


# 24 keys where a ratio is 6: BN over the 2 pooled keys of 12 is so ill-conditioned that float32
# rounding gives gradient errors of 2e-5 against float64 on one CPU and not another.
ONE_PRODUCT_CASES = {
  "sh, powers of two": ("sh", (1, 2, 4, 4), 16, {}),
  "sh, ratio 3 (a division)": ("sh", (1, 2, 3, 6), 24, {}),
  "bn_sh, powers of two": ("bn_sh", (1, 2, 4, 4), 16, {}),
  "bn_sh, ratio 3 (a division)": ("bn_sh", (1, 2, 3, 6), 24, {}),
  "bn_sh, full statistics": ("bn_sh", (1, 2, 4, 4), 16, {"statistics": "full"}),
}


@pytest.mark.parametrize("case", sorted(ONE_PRODUCT_CASES))
def test_unmasked_single_launch_pools_in_one_product_and_is_the_same_function(case):
  """Without a mask (and ``kv_len`` a multiple of ``lcm(ratios)``) the one launch pools every head
  at once: one product more than the launch's two, no per-group reduction; outputs and gradients
  those of the reference path. At a length the block does not divide it pools group by group."""
  variant, ratios, length, options = ONE_PRODUCT_CASES[case]
  q, k, v = (jnp.concatenate([x, x[:, ::-1] * 0.5]) for x in _qkv(7, length, len(ratios)))
  run = {
    implementation: functools.partial(
      sh.scaled_head_attention,
      ratios=ratios,
      implementation=implementation,
      single_launch=True,
      **VARIANTS[variant],
      **options,
    )
    for implementation in ("fused", "reference")
  }

  def gradients_and_output(fn, *args):
    def loss(q, k, v):
      out = fn(q, k, v)
      return jnp.sum(jnp.sin(out)), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)

  grads, out = gradients_and_output(run["fused"], q, k, v)
  expected, expected_out = gradients_and_output(run["reference"], q, k, v)
  np.testing.assert_allclose(out, expected_out, atol=2e-6)
  for grad, want in zip(grads, expected):
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5)

  def primitives(length):
    shorter = [x[:, :length] for x in (k, v)]
    jaxpr = jax.make_jaxpr(run["fused"])(q, *shorter).jaxpr
    return _count_primitive(jaxpr, "dot_general"), _count_primitive(jaxpr, "reduce_sum")

  assert primitives(length)[0] == 3, primitives(length)
  uneven = length - 1 if length % 2 else length - 2  # a multiple of no block here but 1
  dots, sums = primitives(uneven)
  assert dots == 2 and sums >= len(set(ratios)) - 1, (dots, sums)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_padding_given_as_lengths_stays_unmasked_in_one_launch(variant, monkeypatch):
  """Key and query lengths (``jax.nn.dot_product_attention``'s arguments) mean the padding mask
  they describe; on the one-launch path they reach ``jax.nn.dot_product_attention`` as per-row
  pooled key lengths with no mask, which cuDNN takes."""
  ratios, prefix = (1, 2, 3, 4), 1
  q, k, v = (jnp.concatenate([x, x * 0.5, -x]) for x in _qkv(10, 10, len(ratios)))
  key_lengths, query_lengths = jnp.array([10, 4, 7]), jnp.array([10, 5, 9])
  mask = (np.arange(10)[None, :] < np.asarray(key_lengths)[:, None])[:, None, None, :] & (
    np.arange(10)[None, :] < np.asarray(query_lengths)[:, None]
  )[:, None, :, None]
  attention = functools.partial(
    sh.scaled_head_attention, ratios=ratios, num_prefix_tokens=prefix, **VARIANTS[variant]
  )
  expected = jax.jit(functools.partial(attention, implementation="reference"))(q, k, v, mask=mask)
  calls = helpers.dot_product_attention_keywords(monkeypatch)
  lengths = {"key_value_seq_lengths": key_lengths, "query_seq_lengths": query_lengths}

  @functools.partial(jax.jit, static_argnames="single_launch")
  def fused_path(q, k, v, lengths, single_launch):
    first = len(calls)
    out = attention(q, k, v, single_launch=single_launch, implementation="fused", **lengths)
    # The key lengths this path's first call received, returned to be read (traced, they have
    # no value here).
    return out, calls[first].get("key_value_seq_lengths")

  out, received_key_lengths = fused_path(q, k, v, lengths, single_launch=True)
  np.testing.assert_allclose(out, expected, atol=2e-6)
  out, _ = fused_path(q, k, v, lengths, single_launch=False)
  np.testing.assert_allclose(out, expected, atol=2e-6)
  single_call = calls[0]
  assert single_call["mask"] is None and single_call["bias"] is None
  # One row per (example, head): the pooled lengths of each head's ratio.
  rows = np.asarray(received_key_lengths).reshape(3, len(ratios))
  expected_rows = [[1 + -(-(n - 1) // r) for r in ratios] for n in (10, 4, 7)]
  np.testing.assert_array_equal(rows, expected_rows)
  # The per-group path has the padding as a mask instead.
  assert len(calls) == 1 + len(set(ratios)) and all(c["mask"] is not None for c in calls[1:])


def test_lengths_mean_their_padding_mask_for_every_kernel_and_layer():
  from primal_dual import nnx as pd_nnx
  from primal_dual import registry
  from flax import nnx

  q, k, v = (jnp.concatenate([x, x * 0.5]) for x in _qkv(6, 6, 2))
  key_lengths = jnp.array([6, 3])
  mask = (np.arange(6)[None, :] < np.asarray(key_lengths)[:, None])[:, None, None, :]
  for name in sorted(registry.ATTENTION_REGISTRY):
    options = {"ratios": (1, 2)} if registry.lookup(name).takes_ratios else {}
    fn = jax.jit(registry.make_attention_fn(name, options))
    np.testing.assert_allclose(
      fn(q, k, v, key_value_seq_lengths=key_lengths), fn(q, k, v, mask=mask), atol=1e-6
    )
  layer = pd_nnx.MultiHeadAttention(
    2, 8, attention="sh", attention_options={"ratios": (1, 2)}, rngs=nnx.Rngs(0)
  )
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, 8)), jnp.float32)
  np.testing.assert_allclose(
    layer(x, key_value_seq_lengths=key_lengths), layer(x, mask=mask), atol=1e-6
  )
  with pytest.raises(ValueError, match="key_value_seq_lengths must be an int array"):
    registry.make_attention_fn("softmax")(q, k, v, key_value_seq_lengths=jnp.array([6.0, 3.0]))
