"""The Mosaic GPU HYLA forward kernel (primal_dual/kernels/hyla/mosaic.py), its own code run by
JAX's Mosaic GPU interpreter on the CPU against the float64 loop reference and the library's XLA
path, and lowered for CUDA at the issue's shapes."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import hyla_ref

from primal_dual.kernels import hyla, mosaic_interpreter
from primal_dual.kernels.hyla import hyla_attention, mosaic

# q 70 queries: two query tiles, the second padded; 20 keys: two key blocks, the second padded.
SHAPE = dict(batch=1, q_len=70, kv_len=20, heads=2, d_qk=16, d_v=16)
COMBINATIONS = list(itertools.product(mosaic.NORMALIZATIONS, mosaic.VALUE_NETWORKS))


def bfloat16_operands(seed, batch, q_len, kv_len, heads, d_qk, d_v):
  """q, k, v already on the bfloat16 grid (the kernel's operands), held as float32."""
  rng = np.random.default_rng(seed)
  shapes = [(batch, q_len, heads, d_qk), (batch, kv_len, heads, d_qk), (batch, kv_len, heads, d_v)]
  return [np.asarray(jnp.asarray(rng.standard_normal(s), jnp.bfloat16), np.float32) for s in shapes]


@pytest.mark.parametrize("normalization,value_network", COMBINATIONS)
def test_interpreted_kernel_equals_the_float64_reference_and_the_xla_path(
  normalization, value_network
):
  q, k, v = bfloat16_operands(0, **SHAPE)
  options = dict(normalization=normalization, value_network=value_network)
  # e_tile 8 of d_v 16: two value-column programs per query tile (the grid's third axis).
  out = mosaic.hyla_mosaic_forward(q, k, v, e_tile=8, interpret=mosaic_interpreter.params(),
                                   **options)  # fmt: skip
  reference, _ = hyla_ref(q, k, v, **options)
  scale = np.abs(reference).max()
  # float32 accumulation in another order than the float64 loops: relative to the output's size.
  np.testing.assert_allclose(np.asarray(out) / scale, reference / scale, rtol=0, atol=2e-6)
  xla = hyla_attention(q, k, v, implementation="xla", block_size=None, **options)
  np.testing.assert_allclose(np.asarray(out) / scale, np.asarray(xla) / scale, rtol=0, atol=2e-6)


def prefix_mask(batch, heads, q_len, kv_len, key_lengths, query_lengths):
  """bool ``[B, H, q_len, kv_len]``: query ``i`` sees key ``j`` iff both are within their lengths."""
  i = np.arange(q_len)[None, :, None]
  j = np.arange(kv_len)[None, None, :]
  mask = (j < np.asarray(key_lengths)[:, None, None]) & (
    i < np.asarray(query_lengths)[:, None, None]
  )
  return np.broadcast_to(mask[:, None], (batch, heads, q_len, kv_len))


@pytest.mark.parametrize(
  "masking",
  [
    dict(key_lengths=[20, 7], query_lengths=[70, 33]),  # ragged: example 1 skips a key block
    dict(is_causal=True, causal_alignment="top_left"),
    dict(
      is_causal=True, causal_alignment="bottom_right"
    ),  # 70 queries, 36 keys: rows 0-33 see none
    dict(is_causal=True, causal_alignment="bottom_right", key_lengths=[36, 30]),
  ],
)
def test_lengths_and_causal_masks_give_the_masked_reference(masking):
  shape = dict(SHAPE, batch=2, kv_len=36)
  q, k, v = bfloat16_operands(2, **shape)
  out = mosaic.hyla_mosaic_forward(q, k, v, interpret=mosaic_interpreter.params(), **masking)
  lengths = {
    name: masking.pop(name) for name in ("key_lengths", "query_lengths") if name in masking
  }
  mask = None
  if lengths:
    mask = prefix_mask(2, shape["heads"], shape["q_len"], shape["kv_len"],
                       lengths.get("key_lengths", [shape["kv_len"]] * 2),
                       lengths.get("query_lengths", [shape["q_len"]] * 2))  # fmt: skip
  reference, _ = hyla_ref(q, k, v, None, mask, **masking)
  scale = np.abs(reference).max()
  np.testing.assert_allclose(np.asarray(out) / scale, reference / scale, rtol=0, atol=2e-6)
  hidden_rows = ~reference.any(axis=(2, 3))
  assert hidden_rows.any() == (masking.get("causal_alignment") == "bottom_right" or bool(lengths))
  assert not np.asarray(out)[hidden_rows].any()  # a query that sees no key gets exact zeros


def test_the_comparison_can_fail_a_kernel_that_drops_a_key_block():
  """The same check against a reference missing the second key block (keys 16–19): what the
  kernel would give if its loop stopped one block short."""
  q, k, v = bfloat16_operands(1, **SHAPE)
  out = mosaic.hyla_mosaic_forward(q, k, v, interpret=mosaic_interpreter.params())
  short, _ = hyla_ref(q, k[:, :16], v[:, :16])
  assert np.abs(np.asarray(out) - short).max() / np.abs(short).max() > 1e-2


@pytest.mark.parametrize(
  "e_tile,masking", [(64, {}), (32, {}), (64, dict(is_causal=True, key_lengths=jnp.array([200])))]
)
def test_lowers_for_cuda_at_the_benchmark_shapes(e_tile, masking):
  """H 8, d 64 (the device suite's HYLA rows), 128 queries, 256 keys: one Mosaic GPU launch."""
  q = jnp.zeros((1, 128, 8, 64), jnp.bfloat16)
  k = jnp.zeros((1, 256, 8, 64), jnp.bfloat16)
  text = (
    jax.jit(lambda q, k, v: mosaic.hyla_mosaic_forward(q, k, v, e_tile=e_tile, **masking))
    .trace(q, k, k)
    .lower(lowering_platforms=("cuda",))
    .as_text()
  )
  assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize(
  "shapes,options,message",
  [
    (((1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 3, 16)), {}, r"shapes do not match: q \(1, 8, 2, 16\)"),
    (((1, 8, 2, 12), (1, 8, 2, 12), (1, 8, 2, 16)), {}, r"D a multiple of 16.*q \(1, 8, 2, 12\)"),
    (((1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16)), {"e_tile": 12}, r"e_tile 12"),
    (((1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16)), {"normalization": "softmax"}, "softmax"),
  ],
)
def test_bad_input_is_a_value_error_naming_it(shapes, options, message):
  q, k, v = (jnp.zeros(s, jnp.float32) for s in shapes)
  with pytest.raises(ValueError, match=message):
    mosaic.hyla_mosaic_forward(q, k, v, **options)


# --- implementation='mosaic': the kernel's forward, the blockwise path's gradient ---------------


@pytest.mark.parametrize(
  "masking",
  [dict(), dict(key_lengths=np.array([20, 9]), query_lengths=np.array([70, 40]), is_causal=True)],
)
def test_the_implementation_is_the_kernel_forward_with_the_blockwise_gradient(masking):
  shape = dict(SHAPE, batch=2)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in bfloat16_operands(3, **shape))
  options = dict(is_causal=masking.get("is_causal", False), normalization="rms_head",
                 value_network="mlp_relu", scale=None, causal_alignment="top_left")  # fmt: skip
  lengths = (masking.get("key_lengths"), masking.get("query_lengths"))
  attend = functools.partial(
    hyla.mosaic_forward_blockwise_backward, interpret=mosaic_interpreter.params(), **options
  )
  cotangent = jnp.asarray(np.random.default_rng(4).standard_normal((2, 70, 2, 16)), jnp.float32)
  out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, *lengths), q, k, v)
  mask = None
  if masking:
    mask = prefix_mask(2, 2, 70, 20, *lengths)
  reference, _ = hyla_ref(q, k, v, None, mask, is_causal=options["is_causal"])
  scale = np.abs(reference).max()
  np.testing.assert_allclose(np.asarray(out) / scale, reference / scale, rtol=0, atol=2e-6)

  def blockwise(q, k, v):
    return hyla.blockwise.hyla_blockwise_attention(
      q, k, v, None, None if mask is None else mask[:, :1], block_size=hyla.AUTO_BLOCK_SIZE,
      dtype=jnp.float32, **options,
    )  # fmt: skip

  want = jax.vjp(blockwise, q, k, v)[1](cotangent)
  for got, expected in zip(pullback(cotangent), want):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


def test_the_implementation_refuses_what_it_does_not_serve():
  q, k, v = (jnp.zeros((1, 8, 2, 16), jnp.bfloat16) for _ in range(3))
  with pytest.raises(ValueError, match="it runs on NVIDIA GPUs"):
    hyla_attention(q, k, v, implementation="mosaic")
  call = hyla.driver.AttentionCall(q, k, v, bias=jnp.zeros((1, 2, 8, 8)))
  reasons = hyla.mosaic_blockers(call, "softmax")
  assert any("softmax" in r for r in reasons) and "a bias" in reasons


def test_the_implementation_lowers_for_cuda_forward_and_backward():
  """bfloat16, H 8, d 64: the kernel's launch in the forward; the blockwise backward beside it."""
  from tools.device import lowered_ops

  q = jax.ShapeDtypeStruct((1, 128, 8, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = hyla_attention(q, k, v, implementation="mosaic", is_causal=True)
    return jnp.sum(out.astype(jnp.float32))

  step = jax.value_and_grad(loss, argnums=(0, 1, 2))  # the value needs the forward's launch
  text = lowered_ops.lower_for(step, (q, q, q), "cuda").as_text()
  assert re.findall(r"custom_call @(\w+)", text).count("mosaic_gpu_v2") == 1
