"""A padding mask given alone to a cuDNN call goes as the lengths it implies (``fused.attend``):
the test of a mask's values inside the program (``fused.padding_lengths``), and both branches of
the ``lax.cond`` equal the kernels' own path. The CPU has no cuDNN: the prepared operands run
through XLA's implementation (``helpers.run_cudnn_operands_on_xla``). Which cuDNN calls the
lowered program holds: ``tests/test_lowering.py``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from primal_dual import registry
from primal_dual.kernels import fused

B, T, H, D = 3, 10, 2, 8
QUERY_VALID = np.array([[1] * 10, [1] * 6 + [0] * 4, [0] * 10], bool)  # example 2: no query
KEY_VALID = np.array([[1] * 10, [1] * 7 + [0] * 3, [1] * 2 + [0] * 8], bool)


def _padding_mask(query_valid=QUERY_VALID, key_valid=KEY_VALID):
  """``[B, 1, T, T]``, as a Flax user makes it from two padding vectors."""
  return np.asarray(nn.make_attention_mask(query_valid, key_valid, dtype=bool))


def test_the_lengths_of_a_padding_mask_and_nothing_else():
  keys, queries, is_padding = fused.padding_lengths(_padding_mask(), B, T, T)
  np.testing.assert_array_equal(keys, [10, 7, 0])  # example 2's queries see nothing: no key seen
  np.testing.assert_array_equal(queries, [10, 6, 0])
  assert is_padding
  # Keys alone ([B, 1, 1, S]): every query of an example with a key sees it.
  keys, queries, is_padding = fused.padding_lengths(KEY_VALID[:, None, None, :], B, T, T)
  np.testing.assert_array_equal(keys, [10, 7, 2])
  np.testing.assert_array_equal(queries, [10, 10, 10])
  assert is_padding
  causal = np.tril(np.ones((T, T), bool))[None, None]
  assert not fused.padding_lengths(causal, B, T, T)[2]
  hole = KEY_VALID.copy()
  hole[0, 3] = False  # a hidden key before a visible one: not a suffix of padding
  assert not fused.padding_lengths(hole[:, None, None, :], B, T, T)[2]
  per_head = np.broadcast_to(_padding_mask(), (B, H, T, T)).copy()
  per_head[1, 1] = False  # one head of example 1 sees nothing: the heads differ
  assert not fused.padding_lengths(per_head, B, T, T)[2]


def _outputs_and_gradients(variant, mask):
  kernel = registry.make_attention_fn(variant, registry.model_options(variant, H))
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))

  def loss(q, k, v):
    out = kernel(q, k, v, mask=mask)
    return jnp.sum(out * jnp.cos(out)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


@pytest.mark.parametrize("variant", ["softmax", "bn"])
@pytest.mark.parametrize("kind", ["padding", "general"])
def test_both_branches_equal_the_kernels_own_path(variant, kind, monkeypatch):
  mask = _padding_mask()
  if kind == "general":  # the padding mask and a causal one: the mask branch
    mask = mask & np.tril(np.ones((T, T), bool))[None, None]
  expected = _outputs_and_gradients(variant, mask)
  helpers.run_cudnn_operands_on_xla(monkeypatch)
  got = _outputs_and_gradients(variant, mask)
  for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)
  assert not np.asarray(got[0])[2].any()  # example 2 has no query: its rows are zeros
