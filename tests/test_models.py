"""Models: shapes, options, padding, parameter counts, relative position buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from primal_dual.models import VIT_PRESETS, EncoderClassifier, SequenceTransformer, ViT
from primal_dual.models.sequence import relative_position_buckets


def _count(variables):
  return sum(x.size for x in jax.tree.leaves(variables["params"]))


@pytest.mark.parametrize(
  "pooling,norm,pre_norm",
  [("mean", "layer", True), ("cls", "batch", False), ("flatten", "batch", True)],
)
def test_encoder_classifier_dense(pooling, norm, pre_norm):
  model = EncoderClassifier(
    num_classes=3,
    **helpers.tiny_model_sizes(),
    pooling=pooling,
    norm=norm,
    pre_norm=pre_norm,
    attention="sh",
    attention_options={"ratios": (1, 2)},
  )
  x = jax.random.normal(jax.random.key(0), (2, 5, 3))
  mask = jnp.array([[True] * 5, [True] * 3 + [False] * 2])
  variables = model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x, mask)
  logits, state = model.apply(
    variables, x, mask, train=True, rngs={"dropout": jax.random.key(3)}, mutable=["batch_stats"]
  )
  assert logits.shape == (2, 3) and logits.dtype == jnp.float32
  assert ("batch_stats" in state) == (norm == "batch")
  # Padded steps must not influence the prediction of the padded example in evaluation.
  x_changed = x.at[1, 3:].set(100.0)
  eval_vars = {**variables, **state}
  np.testing.assert_allclose(
    model.apply(eval_vars, x, mask)[1], model.apply(eval_vars, x_changed, mask)[1], atol=1e-5
  )


def test_encoder_classifier_tokens_and_errors():
  model = EncoderClassifier(
    num_classes=10,
    **helpers.tiny_model_sizes(),
    input_kind="embed",
    vocab_size=17,
    pooling="cls",
    positional="sinusoidal",
  )
  tokens = jnp.array([[2, 7, 8, 6, 0], [3, 9, 6, 0, 0]])
  variables = model.init(jax.random.key(0), tokens, tokens > 0)
  assert model.apply(variables, tokens, tokens > 0).shape == (2, 10)
  with pytest.raises(ValueError, match="unknown pooling"):
    EncoderClassifier(num_classes=2, pooling="max").init(jax.random.key(0), jnp.zeros((1, 4, 2)))
  with pytest.raises(ValueError, match="expects inputs \\[batch, length, channels\\]"):
    EncoderClassifier(num_classes=2).init(jax.random.key(0), jnp.zeros((4, 2)))


def test_sequence_transformer_parameter_count_is_variant_free():
  x = jax.random.normal(jax.random.key(0), (2, 9, 8))
  counts = {}
  for name in ("softmax", "linear", "hyla", "hyla_no_relu", "hyla_no_norm"):
    model = SequenceTransformer(
      num_outputs=8, num_layers=1, model_dim=16, num_heads=4, mlp_dim=16, attention=name
    )
    variables = model.init(jax.random.key(1), x)
    assert model.apply(variables, x).shape == (2, 9, 8)
    counts[name] = _count(variables)
  assert len(set(counts.values())) == 1, counts


def test_relative_buckets_distinguish_earlier_and_later_keys():
  buckets = relative_position_buckets(36, num_buckets=32, max_distance=64)
  assert buckets.shape == (36, 36)
  assert (np.diag(buckets) == buckets[0, 0]).all()
  for d in (1, 2, 5, 20):
    assert buckets[10, 10 + d] != buckets[10 + d, 10]  # later vs earlier at the same distance
  assert buckets.min() >= 0 and buckets.max() < 32


@pytest.mark.parametrize("preset,expected", [("tiny", 5_717_416), ("small", 22_050_664)])
def test_vit_presets_have_deit_parameter_counts(preset, expected):
  # DeiT-Ti / DeiT-S at 224×224, patch 16, 1000 classes (Touvron et al. 2021, Table 1).
  model = ViT(num_classes=1000, patch_size=16, **VIT_PRESETS[preset])
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3))))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == expected


def test_vit_scaled_heads_pool_over_the_patch_grid():
  model = ViT(
    num_classes=4,
    patch_size=2,
    **helpers.tiny_model_sizes(mlp_dim=8),
    attention="sh",
    attention_options={"ratios": (1, 2)},
  )
  images = jax.random.uniform(jax.random.key(0), (2, 8, 8, 1))
  variables = model.init(jax.random.key(1), images)
  logits, state = model.apply(variables, images, sow_weights=True, mutable=["intermediates"])
  assert logits.shape == (2, 4)
  (weights,) = state["intermediates"]["block_0"]["attention"]["attention_weights"]
  widths = sorted(w.shape[-1] for w in weights)
  assert widths == [1 + 4, 1 + 16]  # CLS + 2×2 pooled grid, CLS + 4×4 grid
