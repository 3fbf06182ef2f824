"""The tasks that pad (UEA, ListOps) give their padding to attention as lengths
(``EncoderClassifier.padding_as_lengths``), which cuDNN takes without a bias
(tests/test_lowering.py): the model computes what it computes with the padding mask, fully padded
rows (an evaluation batch's filler) included."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from primal_dual.models import EncoderClassifier
from primal_dual.tasks import listops, uea

# Real steps of each example: all, some, one, none (the filler rows of an evaluation batch).
LENGTHS = (6, 4, 1, 0)
SIZES = dict(num_classes=3, num_layers=2, model_dim=16, num_heads=2, mlp_dim=32, dropout_rate=0.0)


def _inputs():
  x = np.random.default_rng(0).standard_normal((len(LENGTHS), 6, 3), np.float32)
  return x, np.arange(6)[None, :] < np.array(LENGTHS)[:, None]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("attention", ["softmax", "bn", "sh", "bn_sh", "hyla"])
def test_padding_as_lengths_computes_what_the_padding_mask_does(attention, pooling):
  options = {"ratios": (1, 2)} if attention in ("sh", "bn_sh") else {}
  x, mask = _inputs()
  models = {
    as_lengths: EncoderClassifier(
      **SIZES,
      pooling=pooling,
      norm="batch",
      attention=attention,
      attention_options=options,
      padding_as_lengths=as_lengths,
    )
    for as_lengths in (False, True)
  }
  variables = models[False].init(jax.random.key(0), x, mask)

  def loss(params, as_lengths):
    logits, _ = models[as_lengths].apply(
      {**variables, "params": params}, x, mask, train=True, mutable=["batch_stats"]
    )
    return jnp.sum(jnp.sin(logits)), logits

  grad = jax.grad(loss, has_aux=True)
  (want_grads, want), (got_grads, got) = (grad(variables["params"], b) for b in (False, True))
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("task", [uea, listops])
def test_the_padding_tasks_give_their_padding_as_lengths(task):
  config = ml_collections.ConfigDict(
    {"model": {"pooling": "cls", "attention": "softmax"}, "data": {"preset": "tiny"}}
  )
  metadata = {"num_classes": 3, "vocab_size": 11}
  assert task.build_model(config, metadata).padding_as_lengths
