"""Non-causal pre-LN transformer with per-head relative position bias (sRAVEN, fuzzy logic)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from primal_dual.models.blocks import AttentionFields, EncoderBlock


def relative_position_buckets(
  length: int, num_buckets: int = 32, max_distance: int = 64
) -> np.ndarray:
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


def unidirectional_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
  """T5 buckets with ``bidirectional=False``: ``int32 [length, length]``, query × key.

  The bucket depends on ``n = max(query − key, 0)`` only, so every key at or after the query
  shares bucket 0. ``n < num_buckets // 2`` gets its own bucket; larger ``n`` share logarithmic
  buckets up to ``max_distance`` (computed in float32, as T5 and the HYLA paper's code do).
  """
  backwards = np.maximum(np.arange(length)[:, None] - np.arange(length)[None, :], 0)
  exact = num_buckets // 2
  ratio = backwards.astype(np.float32) / np.float32(exact) + np.finfo(np.float32).eps
  log_scaled = (
    np.log(ratio) / np.float32(np.log(max_distance / exact)) * np.float32(num_buckets - exact)
  )
  large = np.minimum(exact + log_scaled.astype(np.int32), num_buckets - 1)
  return np.where(backwards < exact, backwards, large).astype(np.int32)


class PositionBucketScheme(NamedTuple):
  """How relative offsets become learned biases.

  Attributes:
    buckets: ``buckets(length, num_buckets, max_distance) -> int32 [length, length]``.
    heads_first: the table is ``[heads, buckets]`` (else ``[buckets, heads]``).
    init: the table's initialiser.
  """

  buckets: Callable[[int, int, int], np.ndarray]
  heads_first: bool
  init: Callable


POSITION_BUCKET_SCHEMES: dict[str, PositionBucketScheme] = {
  # The HYLA paper's (T5 bidirectional=False, Flax's default_embed_init).
  "unidirectional": PositionBucketScheme(
    unidirectional_position_buckets, True, nn.linear.default_embed_init
  ),
  # This library's extension: earlier and later keys get different biases.
  "bidirectional": PositionBucketScheme(
    relative_position_buckets, False, nn.initializers.normal(0.02)
  ),
}


class RelativePositionBias(nn.Module):
  """A learned bias ``[1, heads, length, length]`` from a per-head table of ``num_buckets``
  stored in ``param_dtype``; the bias has the table's dtype."""

  num_heads: int
  num_buckets: int = 32
  max_distance: int = 64
  scheme: str = "bidirectional"
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, length: int):
    if self.scheme not in POSITION_BUCKET_SCHEMES:
      raise ValueError(
        f"unknown position bucket scheme {self.scheme!r}; choose one of "
        f"{sorted(POSITION_BUCKET_SCHEMES)}"
      )
    scheme = POSITION_BUCKET_SCHEMES[self.scheme]
    shape, axes = (self.num_buckets, self.num_heads), (None, "heads")
    if scheme.heads_first:
      shape, axes = shape[::-1], axes[::-1]
    table = self.param(
      "table", nn.with_logical_partitioning(scheme.init, axes), shape, self.param_dtype
    )
    if scheme.heads_first:
      table = table.T
    buckets = scheme.buckets(length, self.num_buckets, self.max_distance)
    return jnp.transpose(table[buckets], (2, 0, 1))[None]


class SequenceTransformer(AttentionFields):
  """Per-position transformer: ``inputs float [batch, length, in]`` → ``[batch, length, num_outputs]``.

  Input ``Dense``, ``num_layers`` pre-LN encoder blocks without a causal mask, each with its own
  per-head relative position bias, a final LayerNorm and a per-position ``Dense`` read-out. The
  parameter count does not depend on the attention variant (unless its registry entry declares
  kernel parameters).

  Attributes beyond the sizes: ``qkv_features`` (total q/k/v width, default ``model_dim``; the
  HYLA paper sets it apart), ``position_buckets`` (a key of ``POSITION_BUCKET_SCHEMES``),
  ``attention_dropout_rate`` (on the attention weights, training only), ``mlp_kernel_init``,
  ``dtype`` / ``param_dtype`` (compute and parameters, ``AttentionFields``; outputs are float32).
  """

  num_outputs: int
  num_layers: int = 4
  model_dim: int = 128
  num_heads: int = 16
  mlp_dim: int = 256
  qkv_features: int | None = None
  num_buckets: int = 32
  max_distance: int = 64
  position_buckets: str = "bidirectional"
  mlp_kernel_init: str = "xavier_uniform"

  @nn.compact
  def __call__(self, inputs, mask=None, *, train: bool = False, sow_weights: bool = False):
    if inputs.ndim != 3:
      raise ValueError(
        f"SequenceTransformer expects inputs [batch, length, features]; got shape {inputs.shape}"
      )
    length = inputs.shape[1]
    x = nn.Dense(
      self.model_dim, dtype=self.dtype, param_dtype=self.param_dtype, name="input_projection"
    )(inputs)
    for i in range(self.num_layers):
      bias = RelativePositionBias(
        self.num_heads,
        self.num_buckets,
        self.max_distance,
        self.position_buckets,
        self.param_dtype,
        name=f"relative_bias_{i}",
      )(length)
      x = EncoderBlock(
        num_heads=self.num_heads,
        mlp_dim=self.mlp_dim,
        qkv_features=self.qkv_features,
        mlp_kernel_init=self.mlp_kernel_init,
        pre_norm=True,
        name=f"block_{i}",
        **self.attention_fields(),
      )(x, bias=bias, train=train, sow_weights=sow_weights)
    x = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="final_norm")(x)
    readout = nn.Dense(
      self.num_outputs, dtype=self.dtype, param_dtype=self.param_dtype, name="readout"
    )
    return readout(x).astype(jnp.float32)
