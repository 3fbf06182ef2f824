"""HYLA attention (primal_dual/kernels/hyla/) against a float64 loop reference; its table of
implementations and the order 'auto' walks."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import helpers
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from primal_dual.kernels import hyla
from numpy_reference import hyla_ref

STATIC = (
  "normalization",
  "value_network",
  "query_chunk_size",
  "is_causal",
  "causal_alignment",
  "return_weights",
  "deterministic",
  "dropout_rate",
)
hyla_jit = jax.jit(hyla.hyla_attention, static_argnames=STATIC)
TOL = dict(rtol=2e-4, atol=2e-5)
COMBINATIONS = list(itertools.product(sorted(hyla.NORMALIZATIONS), sorted(hyla.VALUE_NETWORKS)))


random_qkv = helpers.random_qkv
padding_mask = helpers.padding_mask


def assert_matches_reference(q, k, v, bias, mask, query_chunk_size=None, **options):
  out, weights = hyla_jit(
    q, k, v, bias, mask, return_weights=True, query_chunk_size=query_chunk_size, **options
  )
  ref_out, ref_weights = hyla_ref(q, k, v, bias, mask, **options)
  np.testing.assert_allclose(weights, ref_weights, **TOL)
  np.testing.assert_allclose(out, ref_out, **TOL)


@pytest.mark.parametrize("case", range(len(COMBINATIONS)))
def test_every_normalization_and_value_network_matches_reference(case):
  normalization, value_network = COMBINATIONS[case]
  batch_shape = [(), (2,), (2, 1)][case % 3]
  rng = np.random.default_rng(case)
  q, k, v = random_qkv(rng, batch_shape, 4, 5, 3)
  mask = padding_mask(rng, batch_shape, 5)
  bias = rng.normal(size=(*batch_shape, 3, 4, 5)).astype(np.float32)
  assert_matches_reference(
    q,
    k,
    v,
    bias,
    mask,
    normalization=normalization,
    value_network=value_network,
    is_causal=case % 2 == 1,
  )


@given(data=st.data())
def test_property_matches_reference(data):
  batch_shape = data.draw(st.sampled_from([(), (2,), (1, 2)]))
  heads, q_len, kv_len = (data.draw(st.integers(1, n)) for n in (3, 5, 6))
  normalization, value_network = data.draw(st.sampled_from(COMBINATIONS))
  chunk = data.draw(st.sampled_from([None, 1, 2, 4]))
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
  q, k, v = random_qkv(rng, batch_shape, q_len, kv_len, heads, d_v=data.draw(st.integers(1, 3)))
  mask = data.draw(st.sampled_from([None, padding_mask(rng, batch_shape, kv_len, min_valid=0)]))
  assert_matches_reference(
    q,
    k,
    v,
    None,
    mask,
    normalization=normalization,
    value_network=value_network,
    query_chunk_size=chunk,
    is_causal=data.draw(st.booleans()),
    causal_alignment=data.draw(st.sampled_from(["top_left", "bottom_right"])),
  )


def test_query_chunks_equal_unchunked_dropout_included():
  rng = np.random.default_rng(1)
  q, k, v = random_qkv(rng, (2,), 7, 5, 2)  # 7 queries: not a multiple of the chunk size 3
  mask = padding_mask(rng, (2,), 5)
  dropout = dict(dropout_rng=jax.random.key(3), dropout_rate=0.25, deterministic=False)
  whole = hyla_jit(q, k, v, None, mask, **dropout)
  chunked = hyla_jit(q, k, v, None, mask, query_chunk_size=3, **dropout)
  np.testing.assert_allclose(chunked, whole, **TOL)
  assert not np.allclose(whole, hyla_jit(q, k, v, None, mask))  # dropout did act


def test_chunked_program_holds_only_chunk_sized_value_network():
  q, k, v = random_qkv(np.random.default_rng(2), (1,), 8, 5, 2, d_v=3)
  jaxpr = jax.make_jaxpr(lambda *x: hyla.hyla_attention(*x, query_chunk_size=2))(q, k, v)
  text = str(jaxpr)
  assert "f32[1,2,5,3]" in text  # u for one block of 2 queries: [B, c, kv_len, d_v]
  assert "f32[1,8,5,3]" not in text  # never the whole [B, q_len, kv_len, d_v]


def test_rms_head_normalization_has_unit_mean_square_over_heads():
  rng = np.random.default_rng(4)
  q, k, v = random_qkv(rng, (2,), 3, 4, 4, d=4)
  mask = padding_mask(rng, (2,), 4)
  _, a = hyla_jit(q, k, v, None, mask, return_weights=True)
  mean_square = np.mean(np.square(a), axis=1)  # [batch, q_len, kv_len]
  visible = np.broadcast_to(mask[:, 0], mean_square.shape)
  np.testing.assert_allclose(mean_square[visible], 1.0, rtol=1e-3)
  np.testing.assert_array_equal(mean_square[~visible], 0.0)


def test_value_heads_that_do_not_match_query_heads_raise():
  q, k, v = random_qkv(np.random.default_rng(5), (2,), 3, 4, 2)
  split_differently = v.reshape(2, 4, 1, 4)  # same features, one head of d_v = 4
  with pytest.raises(ValueError, match=r"value.shape=\(2, 4, 1, 4\)"):
    hyla.hyla_attention(q, k, split_differently)


def test_grouped_key_value_heads_raise():
  """HYLA's value network sums v over heads with per-head weights: no shared heads."""
  q, k, v = random_qkv(np.random.default_rng(5), (2,), 3, 4, 2)
  with pytest.raises(
    ValueError,
    match=r"hyla_attention does not support grouped key/value heads"
    r".*2 query heads and 1 key/value heads",
  ):
    hyla.hyla_attention(q, k[..., :1, :], v[..., :1, :])


@pytest.mark.parametrize(
  "options,match",
  [
    (dict(normalization="layer"), "normalization"),
    (dict(value_network="mlp_gelu"), "value_network"),
    (dict(query_chunk_size=0), "query_chunk_size"),
  ],
)
def test_bad_options_raise(options, match):
  q, k, v = random_qkv(np.random.default_rng(6), (), 3, 4, 2)
  with pytest.raises(ValueError, match=match):
    hyla.hyla_attention(q, k, v, **options)


def test_bfloat16_in_bfloat16_out_and_jit_agrees_with_eager():
  rng = np.random.default_rng(7)
  q, k, v = random_qkv(rng, (2,), 3, 4, 2)
  mask = padding_mask(rng, (2,), 4)
  eager = hyla.hyla_attention(q, k, v, mask=mask)
  np.testing.assert_allclose(hyla_jit(q, k, v, None, mask), eager, rtol=1e-5, atol=1e-6)
  low = hyla_jit(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), None, mask)
  assert low.dtype == jnp.bfloat16
  np.testing.assert_allclose(low.astype(np.float32), eager, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("normalization", sorted(hyla.NORMALIZATIONS))
def test_fully_masked_query_gives_zeros_and_finite_grads(normalization):
  rng = np.random.default_rng(8)
  q, k, v = random_qkv(rng, (2,), 3, 4, 2)
  mask = np.ones((2, 1, 3, 4), bool)
  mask[0, :, 1] = False  # query 1 of example 0 sees nothing
  mask[1] = False  # example 1 sees nothing at all

  def loss(q, k, v):
    out = hyla.hyla_attention(q, k, v, mask=mask, normalization=normalization)
    return jnp.sum(jnp.sin(out)), out

  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  np.testing.assert_array_equal(out[0, 1], 0.0)
  np.testing.assert_array_equal(out[1], 0.0)
  assert np.abs(out[0, 0]).sum() > 0
  assert all(np.isfinite(g).all() for g in grads)


def test_bfloat16_dense_runs_at_a_real_shape_close_to_float32():
  """B=2, N=128, H=4, D=16: XLA:CPU has no bfloat16 × bfloat16 -> float32 dot at this size, so
  the dense path upcasts the rounded operands; outputs and gradients within bfloat16 error."""
  rng = np.random.default_rng(9)
  q, k, v = random_qkv(rng, (2,), 128, 128, 4, 16, 16)
  mask = padding_mask(rng, (2,), 128)

  def run(q, k, v):
    def loss(q, k, v):
      out = hyla.hyla_attention(q, k, v, mask=mask, block_size=None)
      return jnp.mean(jnp.sin(out.astype(jnp.float32))), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  low = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  grads, out = run(*low)
  # float32 at the rounded inputs: the gradients' sensitivity to the input rounding (~10% here,
  # the same in the blockwise path) is the problem's, not the kernel's.
  ref_grads, ref_out = run(*(x.astype(jnp.float32) for x in low))
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  # Relative error of the whole array (single elements that cancel to ~0 have no relative
  # accuracy). The output rounds once per einsum operand (~0.4% each); the gradients also carry
  # bfloat16 cotangents through the einsums' transposes (measured ~5% at this shape).
  for low_result, ref, tol in zip((out, *grads), (ref_out, *ref_grads), (0.01, 0.08, 0.08, 0.08)):
    error = np.linalg.norm(np.asarray(low_result, np.float32) - ref) / np.linalg.norm(ref)
    assert error < tol, error


def test_the_output_grows_about_as_the_square_root_of_the_key_count():
  """As the docstring says: the value network sums over keys without normalising by their count."""
  from primal_dual import registry

  attend = registry.make_attention_fn("hyla", {"block_size": None})
  rms = []
  for length in (16, 256):
    q, k, v = (
      jax.random.normal(key, (1, length, 4, 16)) for key in jax.random.split(jax.random.key(0), 3)
    )
    rms.append(float(jnp.sqrt(jnp.mean(attend(q, k, v) ** 2))))
  assert 2.5 < rms[1] / rms[0] < 6  # √16 = 4
  assert "√kv_len" in hyla.hyla_attention.__doc__


# --- The table of implementations and 'auto' ---------------------------------------------------


@pytest.mark.parametrize("unknown", ["pallas", "triton", "dense"])
def test_an_unknown_implementation_raises_naming_the_known_ones(unknown):
  q, k, v = random_qkv(np.random.default_rng(40), (2,), 3, 4, 2)
  with pytest.raises(ValueError, match=r"one of \['mosaic', 'tensorcore', 'xla'\]") as raised:
    hyla.hyla_attention(q, k, v, implementation=unknown)
  assert "'auto'" in str(raised.value) and repr(unknown) in str(raised.value)
  assert sorted(hyla.IMPLEMENTATIONS) == ["mosaic", "tensorcore", "xla"]


def test_every_backends_order_names_known_implementations_and_ends_with_xla():
  """'xla' serves every call, so 'auto' always finds one; the orders stay on XLA for now."""
  for backend in ("cpu", "gpu", "tpu", "some_future_backend"):
    order = hyla.default_order(backend)
    assert set(order) <= set(hyla.IMPLEMENTATIONS) and order[-1] == "xla", (backend, order)
  assert hyla.DEFAULT_ORDER == {"cpu": ("xla",), "gpu": ("xla",), "tpu": ("xla",)}


def test_auto_takes_the_first_implementation_of_the_order_that_serves(monkeypatch):
  """A fake first implementation that refuses softmax: 'auto' runs it for rms_head, falls back to
  'xla' for softmax; by name, its refusal is a ValueError."""
  served = []

  def fake(call, *, normalization, **options):
    if normalization == "softmax":
      raise hyla.Unsupported(f"normalization={normalization!r}")
    served.append(normalization)
    return jnp.zeros(call.query.shape[:-1] + call.value.shape[-1:])

  monkeypatch.setitem(hyla.IMPLEMENTATIONS, "fake", fake)
  monkeypatch.setitem(hyla.DEFAULT_ORDER, jax.default_backend(), ("fake", "xla"))
  q, k, v = random_qkv(np.random.default_rng(41), (1,), 4, 5, 2)
  assert not np.any(hyla.hyla_attention(q, k, v)) and served == ["rms_head"]
  out = hyla.hyla_attention(q, k, v, normalization="softmax")
  np.testing.assert_allclose(out, hyla_ref(q, k, v, None, None, normalization="softmax")[0], **TOL)
  with pytest.raises(ValueError, match=r"implementation='fake' cannot serve this call"):
    hyla.hyla_attention(q, k, v, normalization="softmax", implementation="fake")
  monkeypatch.setitem(hyla.DEFAULT_ORDER, jax.default_backend(), ("fake",))
  with pytest.raises(ValueError, match=r"implementation='fake' cannot serve"):
    hyla.hyla_attention(q, k, v, normalization="softmax")  # no implementation of the order serves


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("length,path", [(32, "dense"), (128, "blockwise")])
def test_auto_on_a_device_backend_stays_on_the_xla_paths(monkeypatch, backend, length, path):
  """Selection only: with the backend reported as a GPU or TPU, 'auto' takes 'xla', dense for
  short sequences and blockwise from AUTO_BLOCKWISE_MIN_PAIRS pairs (as on a CPU)."""
  taken = []
  for path_name, module, function in (
    ("dense", hyla.dense, "dense_attention"),
    ("blockwise", hyla.blockwise, "hyla_blockwise_attention"),
  ):
    original = getattr(module, function)
    recording = lambda *a, _name=path_name, _run=original, **kw: (
      taken.append(_name) or _run(*a, **kw)
    )
    monkeypatch.setattr(module, function, recording)
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  q, k, v = random_qkv(np.random.default_rng(39), (1,), length, length, 2)
  jax.make_jaxpr(lambda *x: hyla.hyla_attention(*x))(q, k, v)  # a fresh trace
  assert taken == [path]


def _grad_jaxpr(attention, q, k, v):
  loss = lambda q, k, v: jnp.sum(attention(q, k, v))
  return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))


def _dot_precisions(text):
  """The ``precision`` parameter of every dot_general in a printed jaxpr (nested ones included)."""
  params = [re.split(r"\]\s", chunk)[0] for chunk in text.split("dot_general[")[1:]]
  found = [re.search(r"precision=(\([^)]*\)|\S+)", p) for p in params]
  return [m.group(1) if m else "None" for m in found]  # the printer omits precision=None


@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("value_network", sorted(hyla.VALUE_NETWORKS))
def test_every_matrix_product_of_the_xla_paths_honours_precision(block_size, value_network):
  """``precision=HIGHEST`` reaches every dot_general of the forward and backward programs, dense
  (block_size None) and blockwise."""
  q, k, v = random_qkv(np.random.default_rng(36), (2,), 5, 6, 2)
  attention = functools.partial(
    hyla.hyla_attention,
    block_size=block_size,
    implementation="xla",
    value_network=value_network,
    precision=jax.lax.Precision.HIGHEST,
  )
  precisions = _dot_precisions(_grad_jaxpr(attention, q, k, v))
  assert len(precisions) >= 3, precisions
  assert all("HIGHEST" in p for p in precisions), precisions
  default = functools.partial(attention, precision=None)
  assert not any("HIGHEST" in p for p in _dot_precisions(_grad_jaxpr(default, q, k, v)))
