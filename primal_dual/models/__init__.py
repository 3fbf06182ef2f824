"""Models built from ``primal_dual.layers.MultiHeadAttention``, and their parameter count."""

import flax.linen as nn
import jax
import numpy as np

from primal_dual.models.encoder import EncoderClassifier
from primal_dual.models.sequence import SequenceTransformer
from primal_dual.models.vit import VIT_PRESETS, ViT

__all__ = ["EncoderClassifier", "SequenceTransformer", "ViT", "VIT_PRESETS", "parameter_count"]


def parameter_count(params) -> int:
  """Number of scalars in a parameter tree (arrays or ShapeDtypeStructs, boxed or not)."""
  return int(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nn.unbox(params))))
