"""Models built from ``primal_dual.layers.MultiHeadAttention``, and their parameter count."""

import flax.linen as nn
import jax
import numpy as np

from primal_dual.models.encoder import EncoderClassifier
from primal_dual.models.sequence import SequenceTransformer
from primal_dual.models.vit import VIT_PRESETS, ViT

__all__ = [
  "EncoderClassifier",
  "SequenceTransformer",
  "ViT",
  "VIT_PRESETS",
  "model_parameter_count",
  "parameter_count",
]


def parameter_count(params) -> int:
  """Number of scalars in a parameter tree (arrays or ShapeDtypeStructs, boxed or not)."""
  return int(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nn.unbox(params))))


def model_parameter_count(model: nn.Module, *example_args, **example_kwargs) -> int:
  """Trainable parameters of a Linen ``model`` initialised on the example arguments (shapes only:
  ``jax.eval_shape``, nothing is computed)."""

  def init(rng):
    return model.init({"params": rng, "dropout": rng}, *example_args, **example_kwargs)

  return parameter_count(jax.eval_shape(init, jax.random.key(0))["params"])
