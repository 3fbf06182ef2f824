"""``kernels.fused`` meets cuDNN's conditions without changing the product: head sizes padded to a
multiple of 8, odd lengths padded to even, a mask or bias of full lengths, explicit lengths, and,
on a jax whose cuDNN batching rules mishandle operands the vmap does not batch, a full-size mask
batched with the queries.

The CPU has no cuDNN: the prepared operands run through XLA's implementation (``cudnn_on_xla``)
and must give the unprepared call's outputs and gradients; lowering for CUDA (no device needed)
shows that a vmapped gradient with a shared mask, a sweep's replicas, becomes cuDNN calls whose
bias rows match their queries.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax._src.cudnn import fused_attention_stablehlo  # its cuDNN version check is stubbed

from primal_dual.kernels import fused

B, H, T, S, D = 2, 3, 7, 9, 4  # odd lengths and a head size cuDNN refuses as they are
STUB_CUDNN_VERSION = 90800


def _inputs(q_len=T, kv_len=S) -> tuple[np.ndarray, ...]:
  """float32 ``q [B, H, q_len, D]``, ``k``/``v [B, H, kv_len, D]``, ``bias [1, H, q_len,
  kv_len]`` and a key-padding ``mask [B, 1, 1, kv_len]`` (example 1: 3 keys)."""
  rng = np.random.default_rng(0)
  q, k, v = (
    rng.standard_normal((B, H, length, D), np.float32) for length in (q_len, kv_len, kv_len)
  )
  bias = rng.standard_normal((1, H, q_len, kv_len), np.float32)
  valid = np.arange(kv_len)[None, :] < np.array([kv_len, 3])[:, None]
  return q, k, v, bias, valid[:, None, None, :]


# Each case: (bias?, mask?, key_lengths?, is_causal).
CASES = {
  "plain": (False, False, False, False),
  "key_padding_mask": (False, True, False, False),
  "bias": (True, False, False, False),
  "mask_and_bias": (True, True, False, False),
  "key_lengths": (False, False, True, False),
  "causal": (False, False, False, True),
  "causal_bias_mask": (True, True, False, True),
}


def _call(case, q, k, v, bias, mask):
  with_bias, with_mask, with_lengths, causal = CASES[case]
  lengths = jnp.array([[S] * H, [4, 5, 6]], jnp.int32) if with_lengths else None
  return fused.attend(
    q,
    k,
    v,
    bias if with_bias else None,
    mask if with_mask else None,
    scale=0.5,
    is_causal=causal,
    key_lengths=lengths,
  )


def _value_and_grads(case, inputs):
  """The output and the gradients w.r.t. q, k, v and bias of a loss of it (jitted)."""

  def loss(q, k, v, bias, mask):
    out = _call(case, q, k, v, bias, mask)
    return jnp.sum(out * jnp.cos(out)), out  # a cotangent that depends on the output

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*inputs)
  return out, grads


@pytest.fixture
def cudnn_on_xla(monkeypatch):
  helpers.run_cudnn_operands_on_xla(monkeypatch)


@pytest.mark.parametrize("case", list(CASES))
def test_cudnn_operands_leave_outputs_and_gradients_unchanged(case, monkeypatch):
  inputs = _inputs(q_len=S if CASES[case][3] else T)
  expected = _value_and_grads(case, inputs)
  helpers.run_cudnn_operands_on_xla(monkeypatch)
  got = _value_and_grads(case, inputs)
  for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)


def test_cudnn_operands_under_vmap_with_a_shared_mask_are_unchanged(cudnn_on_xla):
  """Replicas share the batch's mask (in_axes None): the workaround's batched mask gives each
  replica its own queries' result."""
  q, k, v, bias, mask = _inputs()
  stacked = [np.stack([x, 2 * x]) for x in (q, k, v)]
  one = jax.jit(lambda q, k, v, bias, mask: _call("mask_and_bias", q, k, v, bias, mask))

  got = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, None, None)))(*stacked, bias, mask)
  for replica in range(2):
    want = one(*(x[replica] for x in stacked), bias, mask)
    np.testing.assert_allclose(got[replica], want, rtol=1e-5, atol=1e-5)


def _cudnn_call_shapes(text: str) -> list[list[str]]:
  """Operand shapes (``'6x8x3x8'``) of each cuDNN attention call in lowered StableHLO."""
  calls = re.findall(r"custom_call @__cudnn\$fmha\w*\([^)]*\)[^\n]*: \(([^)]*)\)", text)
  return [re.findall(r"tensor<([\dx]*)x\w+>", operands) for operands in calls]


@pytest.mark.parametrize("case", ["key_padding_mask", "mask_and_bias", "key_lengths", "plain"])
def test_vmapped_gradient_with_a_shared_mask_lowers_to_cudnn_for_cuda(case, monkeypatch):
  """What a sweep's replicas do: jax.vmap over a gradient whose mask the vmap does not batch. On
  jax 0.10.2 this failed to lower (``cannot reshape array``) or paired each replica's queries
  with the bias rows of the first."""
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: STUB_CUDNN_VERSION)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q, k, v, bias, mask = (
    jax.ShapeDtypeStruct(x.shape, jnp.bool_ if x.dtype == bool else jnp.bfloat16) for x in _inputs()
  )

  def replica(q, k, v, w, bias, mask):
    def loss(q, k, v):
      out = _call(case, q * w, k, v, bias, mask)
      return jnp.sum(out.astype(jnp.float32) * q.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  stacked = [jax.ShapeDtypeStruct((2, *x.shape), x.dtype) for x in (q, k, v)]
  weights = jax.ShapeDtypeStruct((2,), jnp.bfloat16)
  replicas = jax.vmap(replica, in_axes=(0, 0, 0, 0, None, None))  # bias and mask shared
  try:
    lowered = jax.jit(replicas).trace(*stacked, weights, bias, mask)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
  finally:
    jax.clear_caches()  # traces made while the backend reported 'gpu'
  shapes = _cudnn_call_shapes(text)
  # Forward and backward; a mask alone is also looked at as padding (fused.attend): a second pair,
  # with the lengths it implies, in the other branch of a cond.
  assert len(shapes) == (4 if case == "key_padding_mask" else 2), shapes
  if case == "key_padding_mask":
    assert ["4", "4"] in [operands[3:] for operands in shapes], shapes  # replicas × examples
  for operands in shapes:
    rows = int(operands[0].split("x")[0])  # the queries' batch: replicas × examples (× heads)
    assert rows == 2 * B * (H if case == "key_lengths" else 1), operands
    # Every operand of a batch axis (the bias cuDNN makes of the mask, the lengths) has the
    # queries' rows or one (0: the placeholder of an absent operand): none pairs a replica's
    # queries with another's rows.
    assert all(int(shape.split("x")[0]) in (0, 1, rows) for shape in operands if shape), operands


def test_the_workaround_is_one_log_line_and_only_for_a_jax_that_needs_it(monkeypatch, caplog):
  q, k, v, bias, mask = (jnp.asarray(x) for x in _inputs(q_len=8, kv_len=8))
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # length-major, as attend lays them out
  monkeypatch.setattr(fused, "_workaround_logged", False)
  monkeypatch.setattr(fused, "VMAP_SAFE_JAX", (99, 0, 0))  # a jax without the fix
  with caplog.at_level("INFO", logger=fused.__name__):
    for _ in range(2):
      *_, full_mask, _ = fused._cudnn_operands(q, k, v, bias, mask, {})
  assert full_mask.shape == (B, H, 8, 8)
  (record,) = caplog.records
  assert "jax >= 99.0.0 passes them as given" in record.getMessage()
  monkeypatch.setattr(fused, "VMAP_SAFE_JAX", (0, 0, 0))  # a jax with it: the mask as given
  *_, given_mask, _ = fused._cudnn_operands(q, k, v, bias, mask, {})
  assert given_mask.shape == (B, 1, 8, 8)
