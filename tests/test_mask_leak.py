"""Every registered variant honours its mask: a key or value that the mask hides from query ``i``
never changes query ``i``'s output, nor the gradient of that output with respect to the inputs
query ``i`` may see (and the gradient with respect to the hidden ones is zero).

Hypothesis draws the mask (padding, ``is_causal`` with either alignment, explicit causal, local
and strided masks, random boolean or float masks, per-head masks), the inputs, the query and the
perturbation of the hidden keys and values; each (variant, mask layout) is compiled once.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primal_dual import registry
from primal_dual.kernels import masks

B, H, D = 2, 2, 4
Q = KV = 8
Q_SHORT = 5  # bottom-right causal calls: fewer queries than keys
RATIOS = (2, 3)  # SH: even and uneven windows (8 keys = 2·3 + 2)
TOLERANCE = 2e-6  # float32; most variants give exactly 0
# Attention-BN's statistics multiply a hidden key by an exact zero (masked sums, per-query
# deviations) and its softmax fold subtracts a key every query sees: a hidden key reaches a query
# not even through rounding, so these are held to exactly 0. (A shift that a hidden key could
# move, such as the mean of all the head's valid keys, moved gradients by up to 3e-3 here.)
EXACT = ("bn", "linear_bn", "bn_sh")

# How the mask reaches the kernel (what the kernel may decide from shapes alone):
#   q_len, mask shape (None: no mask), is_causal, causal_alignment.
LAYOUTS = {
  "padding": (Q, (B, 1, 1, KV), False, "top_left"),
  "causal": (Q, None, True, "top_left"),
  "causal_bottom_right_padding": (Q_SHORT, (B, 1, 1, KV), True, "bottom_right"),
  "query_dependent": (Q, (B, H, Q, KV), False, "top_left"),
}
# Masks the primal forms refuse (they need a key-only mask), with their one-line message.
KEY_ONLY_REFUSAL = "key-only mask"


def _attention_fn(name: str):
  options = {"ratios": RATIOS} if registry.lookup(name).takes_ratios else {}
  return registry.make_attention_fn(name, options)


@functools.lru_cache(maxsize=None)
def _output_and_gradients(name: str, layout: str):
  """Jitted ``(q, k, v, mask, cotangent) -> (out, (dq, dk, dv))`` of one variant and layout;
  ``cotangent`` selects the rows whose gradient is taken."""
  _, _, is_causal, alignment = LAYOUTS[layout]
  attention_fn = _attention_fn(name)

  def run(q, k, v, mask, cotangent):
    def forward(q, k, v):
      return attention_fn(q, k, v, mask=mask, is_causal=is_causal, causal_alignment=alignment)

    out, pullback = jax.vjp(forward, q, k, v)
    return out, pullback(cotangent)

  return jax.jit(run)


def _mask_values(kind: str, rng: np.random.Generator, shape, q_len: int) -> np.ndarray:
  """A mask of ``shape`` ([B, H | 1, Q | 1, KV]) drawn as ``kind``; float 0/1 for 'float'."""
  batch, heads, rows, kv = shape
  if rows == 1 and kind not in ("random", "float"):
    kind = "random"  # a key-only layout: padding
  if kind == "local":
    pattern = np.asarray(
      masks.local_mask(kv, int(rng.integers(1, 4)), causal=bool(rng.random() < 0.5))
    )
  elif kind == "strided":
    pattern = np.asarray(
      masks.strided_mask(kv, int(rng.integers(2, 4)), causal=bool(rng.random() < 0.5))
    )
  elif kind == "causal":  # as flax.linen.make_causal_mask, and with padded queries and keys
    valid = rng.random((batch, kv)) < 0.75
    pattern = np.tril(np.ones((kv, kv), bool)) & np.asarray(masks.padding_mask(valid, valid))
  elif kind == "query_padding":
    valid = rng.random((batch, kv)) < 0.75
    pattern = np.asarray(masks.padding_mask(valid, valid))
  else:
    pattern = rng.random(shape) < rng.uniform(0.3, 0.9)
  pattern = np.broadcast_to(pattern, shape)
  return pattern.astype(np.float32) if kind == "float" else pattern


def _visible(mask, layout: str) -> np.ndarray:
  """bool [B, H, q_len, KV]: which key each query of each head may see (mask and causality)."""
  q_len, _, is_causal, alignment = LAYOUTS[layout]
  visible = np.ones((B, H, q_len, KV), bool)
  if mask is not None:
    visible &= np.asarray(mask) != 0
  if is_causal:
    visible &= np.asarray(masks.causal_mask(q_len, KV, alignment=alignment))
  return visible


MASK_KINDS = ("random", "float", "local", "strided", "causal", "query_padding")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(registry.ATTENTION_REGISTRY))
@hypothesis.settings(max_examples=5, deadline=None, database=None, derandomize=True)
@hypothesis.given(
  seed=st.integers(0, 2**31 - 1),
  kind=st.sampled_from(MASK_KINDS),
  query=st.integers(0, Q - 1),
)
def test_hidden_keys_and_values_never_reach_a_query(name, layout, seed, kind, query):
  q_len, mask_shape, _, _ = LAYOUTS[layout]
  query = query % q_len
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, q_len, H, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, KV, H, D)), jnp.float32) for _ in range(2))
  mask = None if mask_shape is None else _mask_values(kind, rng, mask_shape, q_len)
  hidden = ~_visible(mask, layout)[:, :, query, :]  # [B, H, KV]
  hidden_kv = jnp.asarray(np.swapaxes(hidden, 1, 2)[..., None])  # [B, KV, H, 1]
  moved_k = k + hidden_kv * jnp.asarray(rng.normal(scale=3.0, size=k.shape), jnp.float32)
  moved_v = v + hidden_kv * jnp.asarray(rng.normal(scale=3.0, size=v.shape), jnp.float32)
  cotangent = np.zeros((B, q_len, H, D), np.float32)
  cotangent[:, query] = rng.normal(size=(B, H, D))
  run = _output_and_gradients(name, layout)
  mask_arg = None if mask is None else jnp.asarray(mask)
  try:
    out, grads = run(q, k, v, mask_arg, jnp.asarray(cotangent))
  except ValueError as error:
    assert KEY_ONLY_REFUSAL in str(error) and not layout.startswith(("padding", "causal")), error
    return
  moved_out, moved_grads = run(q, moved_k, moved_v, mask_arg, jnp.asarray(cotangent))

  tolerance = 0.0 if name in EXACT else TOLERANCE
  np.testing.assert_allclose(moved_out[:, query], out[:, query], rtol=0, atol=tolerance)
  np.testing.assert_allclose(moved_grads[0], grads[0], rtol=0, atol=tolerance)
  for grad, moved in zip(grads[1:], moved_grads[1:]):
    np.testing.assert_allclose(
      np.where(hidden_kv, 0.0, moved), np.where(hidden_kv, 0.0, grad), rtol=0, atol=tolerance
    )
    np.testing.assert_allclose(np.where(hidden_kv, grad, 0.0), 0.0, rtol=0, atol=tolerance)
