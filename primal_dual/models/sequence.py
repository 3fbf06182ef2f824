"""Non-causal pre-LN transformer with per-head relative position bias (sRAVEN, fuzzy logic)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from primal_dual.models.blocks import EncoderBlock


def relative_position_buckets(length: int, num_buckets: int = 32,
                              max_distance: int = 64) -> np.ndarray:
  """Bidirectional T5-style buckets ``int32 [length, length]`` of ``key − query`` offsets.

  Half the buckets hold keys after the query, half keys before it, so earlier and later keys at
  the same distance get different biases; small offsets get a bucket each, larger ones share
  logarithmically wider buckets up to ``max_distance``.
  """
  relative = np.arange(length)[None, :] - np.arange(length)[:, None]
  half = num_buckets // 2
  bucket = (relative > 0).astype(np.int32) * half
  distance = np.abs(relative)
  exact = half // 2
  log_ratio = np.log(np.maximum(distance, 1) / exact) / np.log(max_distance / exact)
  large = exact + (log_ratio * (half - exact)).astype(np.int32)
  large = np.minimum(large, half - 1)
  return (bucket + np.where(distance < exact, distance, large)).astype(np.int32)


class RelativePositionBias(nn.Module):
  """A learned bias ``[1, heads, length, length]`` from a table ``[num_buckets, heads]``."""
  num_heads: int
  num_buckets: int = 32
  max_distance: int = 64

  @nn.compact
  def __call__(self, length: int):
    table = self.param("table", nn.with_logical_partitioning(
        nn.initializers.normal(0.02), (None, "heads")), (self.num_buckets, self.num_heads))
    buckets = relative_position_buckets(length, self.num_buckets, self.max_distance)
    return jnp.transpose(table[buckets], (2, 0, 1))[None]


class SequenceTransformer(nn.Module):
  """Per-position transformer: ``inputs float [batch, length, in]`` → ``[batch, length, num_outputs]``.

  Input ``Dense``, ``num_layers`` pre-LN encoder blocks without a causal mask, each with its own
  per-head relative position bias, a final LayerNorm and a per-position ``Dense`` read-out. The
  parameter count does not depend on the attention variant.
  """
  num_outputs: int
  num_layers: int = 4
  model_dim: int = 128
  num_heads: int = 16
  mlp_dim: int = 256
  attention: str = "softmax"
  attention_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  dropout_rate: float = 0.0
  num_buckets: int = 32
  max_distance: int = 64
  dtype: Any = None

  @nn.compact
  def __call__(self, inputs, mask=None, *, train: bool = False, sow_weights: bool = False):
    if inputs.ndim != 3:
      raise ValueError(f"SequenceTransformer expects inputs [batch, length, features]; got shape "
                       f"{inputs.shape}")
    length = inputs.shape[1]
    x = nn.Dense(self.model_dim, dtype=self.dtype, name="input_projection")(inputs)
    for i in range(self.num_layers):
      bias = RelativePositionBias(self.num_heads, self.num_buckets, self.max_distance,
                                  name=f"relative_bias_{i}")(length)
      x = EncoderBlock(num_heads=self.num_heads, mlp_dim=self.mlp_dim, attention=self.attention,
                       attention_options=self.attention_options, pre_norm=True,
                       dropout_rate=self.dropout_rate, dtype=self.dtype,
                       name=f"block_{i}")(x, bias=bias, train=train, sow_weights=sow_weights)
    x = nn.LayerNorm(dtype=self.dtype, name="final_norm")(x)
    return nn.Dense(self.num_outputs, dtype=self.dtype, name="readout")(x).astype(jnp.float32)
