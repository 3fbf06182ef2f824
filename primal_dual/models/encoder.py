"""Transformer encoder classifier for sequences: UEA time series (continuous) and ListOps (tokens)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from primal_dual.kernels.masks import padding_mask
from primal_dual.models.blocks import (
  AttentionFields,
  Dropout,
  EncoderBlock,
  PositionEmbedding,
  apply_norm,
  make_norm,
)


def _pool_cls(x, mask):
  del mask
  return x[:, 0]


def _pool_mean(x, mask):
  # Summed in float32: a bfloat16 sum over hundreds of steps (or its count) would round.
  if mask is None:
    return x.mean(axis=1, dtype=jnp.float32).astype(x.dtype)
  weights = mask[..., None].astype(jnp.float32)
  total = (x * weights).sum(axis=1, dtype=jnp.float32)
  return (total / jnp.maximum(weights.sum(axis=1), 1.0)).astype(x.dtype)


def _pool_flatten(x, mask):
  if mask is not None:
    x = x * mask[..., None].astype(x.dtype)
  return x.reshape((x.shape[0], -1))


POOLINGS = {"cls": _pool_cls, "mean": _pool_mean, "flatten": _pool_flatten}


class EncoderClassifier(AttentionFields):
  """Encoder-only transformer classifier.

  ``inputs`` is ``float [batch, length, channels]`` (``input_kind='dense'``) or
  ``int [batch, length]`` token ids (``input_kind='embed'``); ``mask [batch, length]`` marks real
  steps. Returns logits ``[batch, num_classes]``.

  Attributes:
    num_classes, num_layers, model_dim, num_heads, mlp_dim: sizes.
    input_kind: 'dense' or 'embed' (needs ``vocab_size``).
    positional: 'learned' or 'sinusoidal'.
    pre_norm: pre-LN (True) or post-LN. norm: 'layer' or 'batch' (mask-aware BatchNorm).
    pooling: 'cls' (prepends a learned CLS token), 'mean' (over valid steps) or 'flatten'.
    attention, attention_options: kernel by registry name (``primal_dual.layers``).
    dropout_rate, attention_dropout_rate: dropout.
    dtype, param_dtype: compute and parameter dtypes (``AttentionFields``); logits are float32.
    padding_as_lengths: every ``mask`` row is a prefix (padding at the end, as the UEA and ListOps
      data build it), so attention takes it as ``key_value_seq_lengths`` (its count of real
      steps), which cuDNN serves without a bias ``[batch, 1, length, length]``; False: as a
      padding mask, right for any pattern.
  """

  num_classes: int
  num_layers: int = 2
  model_dim: int = 64
  num_heads: int = 4
  mlp_dim: int = 128
  input_kind: str = "dense"
  vocab_size: int | None = None
  positional: str = "learned"
  pre_norm: bool = True
  norm: str = "layer"
  pooling: str = "mean"
  padding_as_lengths: bool = False
  dropout_rate: float = dataclasses.field(default=0.1, kw_only=True)  # the others' is 0

  def _embed_inputs(self, inputs):
    if self.input_kind == "dense":
      if inputs.ndim != 3:
        raise ValueError(
          f"input_kind='dense' expects inputs [batch, length, channels]; got shape {inputs.shape}"
        )
      return nn.Dense(
        self.model_dim, dtype=self.dtype, param_dtype=self.param_dtype, name="input_projection"
      )(inputs)
    if self.input_kind == "embed":
      if self.vocab_size is None or inputs.ndim != 2:
        raise ValueError(
          f"input_kind='embed' needs vocab_size and inputs [batch, length]; got "
          f"vocab_size={self.vocab_size}, shape {inputs.shape}"
        )
      return nn.Embed(
        self.vocab_size,
        self.model_dim,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        name="token_embedding",
      )(inputs)
    raise ValueError(f"unknown input_kind {self.input_kind!r}; use 'dense' or 'embed'")

  @nn.compact
  def __call__(self, inputs, mask=None, *, train: bool = False, sow_weights: bool = False):
    if self.pooling not in POOLINGS:
      raise ValueError(f"unknown pooling {self.pooling!r}; choose one of {sorted(POOLINGS)}")
    x = self._embed_inputs(inputs)
    x = PositionEmbedding(self.positional, self.param_dtype, name="positions")(x)
    prefix = 0
    if self.pooling == "cls":
      # Not zeros: a zero CLS has zero queries, and HYLA's normalised scores then vanish for it.
      cls = self.param(
        "cls", nn.initializers.normal(0.02), (1, 1, self.model_dim), self.param_dtype
      )
      x = jnp.concatenate(
        [jnp.broadcast_to(cls, (x.shape[0], 1, self.model_dim)).astype(x.dtype), x], axis=1
      )
      if mask is not None:
        mask = jnp.concatenate([jnp.ones((mask.shape[0], 1), bool), mask], axis=1)
      prefix = 1
    x = Dropout(self.dropout_rate)(x, deterministic=not train)
    attention_mask = key_lengths = None
    if mask is not None and self.padding_as_lengths:
      key_lengths = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    elif mask is not None:
      attention_mask = padding_mask(mask)
    for i in range(self.num_layers):
      x = EncoderBlock(
        num_heads=self.num_heads,
        mlp_dim=self.mlp_dim,
        attention_context={"num_prefix_tokens": prefix},
        norm=self.norm,
        pre_norm=self.pre_norm,
        name=f"block_{i}",
        **self.attention_fields(),
      )(
        x,
        mask=attention_mask,
        key_lengths=key_lengths,
        token_mask=mask,
        train=train,
        sow_weights=sow_weights,
      )
    if self.pre_norm:
      x = apply_norm(make_norm(self.norm, self.dtype, self.param_dtype), x, mask, train)
    x = POOLINGS[self.pooling](x, mask)
    x = Dropout(self.dropout_rate)(x, deterministic=not train)
    classifier = nn.Dense(
      self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="classifier"
    )
    return classifier(x).astype(jnp.float32)
