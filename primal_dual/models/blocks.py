"""Transformer building blocks shared by every model: normalisation, MLP, encoder block."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from primal_dual.kernels import dropout_on
from primal_dual.layers import MultiHeadAttention


class Dropout(nn.Module):
  """Flax's ``nn.Dropout`` (same key, same mask: a constant rate gives its result exactly) whose
  ``rate`` may also be a traced float32 ``[]``, which replicas of a sweep set apart inside one
  program (``kernels.dropout_on``). Named ``Dropout`` so that its scope names, and with them its
  keys, are those of ``nn.Dropout``."""

  rate: float | jax.Array

  def __call__(self, inputs: jax.Array, deterministic: bool) -> jax.Array:
    """``inputs`` of any shape: each entry zeroed with probability ``rate`` or scaled by
    ``1 / (1 - rate)``; unchanged when ``deterministic``."""
    if not dropout_on(self.rate, deterministic):
      return inputs
    keep = 1.0 - self.rate
    if not isinstance(keep, jax.Array) and keep == 0.0:
      return jnp.zeros_like(inputs)
    kept = jax.random.bernoulli(self.make_rng("dropout"), keep, inputs.shape)
    # A traced keep probability would promote low-precision inputs; a constant one does not.
    scale = keep.astype(inputs.dtype) if isinstance(keep, jax.Array) else keep
    return jax.lax.select(kept, inputs / scale, jnp.zeros_like(inputs))


class MaskedBatchNorm(nn.Module):
  """BatchNorm over batch and time that ignores padded positions (``mask`` False).

  Inputs ``[batch, length, features]``; ``mask [batch, length]`` or None. Running averages are
  updated in training (``train=True``) and used in evaluation, like the UEA reference protocol.
  Statistics and running averages are float32 whatever ``dtype`` (Flax's BatchNorm).
  """

  dtype: Any = None
  momentum: float = 0.9
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None, *, train: bool):
    bn_mask = None if mask is None else jnp.broadcast_to(mask[..., None], x.shape)
    return nn.BatchNorm(
      use_running_average=not train,
      momentum=self.momentum,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      axis_name=None,
    )(x, mask=bn_mask)


# One registry for the normalisation layers a block may use: name -> factory(dtype, param_dtype).
# Both compute their statistics in float32 whatever the dtype.
NORMS: dict[str, Callable[[Any, Any], nn.Module]] = {
  "layer": lambda dtype, param_dtype: nn.LayerNorm(dtype=dtype, param_dtype=param_dtype),
  "batch": lambda dtype, param_dtype: MaskedBatchNorm(dtype=dtype, param_dtype=param_dtype),
}


def make_norm(name: str, dtype, param_dtype=jnp.float32) -> nn.Module:
  if name not in NORMS:
    raise ValueError(f"unknown norm {name!r}; choose one of {sorted(NORMS)}")
  return NORMS[name](dtype, param_dtype)


def apply_norm(norm: nn.Module, x, mask, train: bool):
  if isinstance(norm, MaskedBatchNorm):
    return norm(x, mask, train=train)
  return norm(x)


# Kernel initialisers an MLP may use, by config name.
MLP_KERNEL_INITS: dict[str, Callable] = {
  "xavier_uniform": nn.initializers.xavier_uniform(),
  "lecun_normal": nn.initializers.lecun_normal(),  # Flax's Dense default
}


class MlpBlock(nn.Module):
  """``Dense(mlp_dim) → gelu (tanh form) → dropout → Dense(width) → dropout`` with logical axes.

  ``kernel_init`` names the kernels' initialiser in ``MLP_KERNEL_INITS`` (biases start at 0).
  """

  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Any = None
  kernel_init: str = "xavier_uniform"
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, *, train: bool):
    width = x.shape[-1]
    if self.kernel_init not in MLP_KERNEL_INITS:
      raise ValueError(
        f"unknown MLP kernel_init {self.kernel_init!r}; choose one of {sorted(MLP_KERNEL_INITS)}"
      )
    init = MLP_KERNEL_INITS[self.kernel_init]
    x = nn.Dense(
      self.mlp_dim,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
    )(x)
    x = nn.gelu(x)
    x = Dropout(self.dropout_rate)(x, deterministic=not train)
    x = nn.Dense(
      width,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
    )(x)
    return Dropout(self.dropout_rate)(x, deterministic=not train)


class AttentionFields(nn.Module):
  """Keyword-only fields of every model and of its ``EncoderBlock``: the attention kernel by
  registry name (``attention``, ``attention_options``), dropout on residual branches
  (``dropout_rate``) and on the attention weights (``attention_dropout_rate``), each a number or
  a traced ``[]`` (``Dropout``), the compute ``dtype`` (None: float32, from the parameters) and
  the parameters' ``param_dtype``, as Flax's layers (``config.model.dtype`` / ``param_dtype``)."""

  _: dataclasses.KW_ONLY
  attention: str = "softmax"
  attention_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def attention_fields(self) -> dict[str, Any]:
    """These fields' values, to hand on to an ``EncoderBlock``."""
    return {
      field.name: getattr(self, field.name)
      for field in dataclasses.fields(AttentionFields)
      if field.name not in ("parent", "name")  # Flax's own fields
    }


class EncoderBlock(AttentionFields):
  """Self-attention + MLP with residuals, pre-LN or post-LN.

  Attributes:
    num_heads, mlp_dim: sizes. attention / attention_options / attention_context: the kernel.
    norm: registry name in ``NORMS``. pre_norm: pre-LN (True) or post-LN (False).
    dropout_rate: on residual branches. attention_dropout_rate: on the attention weights.
    qkv_features: total q/k/v width of the attention (default: the model width).
    mlp_kernel_init: the MLP's kernel initialiser (``MLP_KERNEL_INITS``).
  """

  num_heads: int
  mlp_dim: int
  qkv_features: int | None = None
  mlp_kernel_init: str = "xavier_uniform"
  attention_context: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  norm: str = "layer"
  pre_norm: bool = True

  @nn.compact
  def __call__(
    self,
    x,
    *,
    mask=None,
    token_mask=None,
    bias=None,
    key_lengths=None,
    train: bool,
    sow_weights: bool = False,
  ):
    """x ``[batch, length, width]``; ``mask`` attention mask; ``token_mask [batch, length]``;
    ``key_lengths`` int ``[batch]``: each example attends to its first keys only (the attention's
    ``key_value_seq_lengths``)."""
    attention = MultiHeadAttention(
      num_heads=self.num_heads,
      qkv_features=self.qkv_features,
      attention=self.attention,
      attention_options=self.attention_options,
      attention_context=self.attention_context,
      dropout_rate=self.attention_dropout_rate,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name="attention",
    )
    norm1, norm2 = (make_norm(self.norm, self.dtype, self.param_dtype) for _ in range(2))

    def attend(y):
      y = attention(
        y,
        mask=mask,
        bias=bias,
        key_value_seq_lengths=key_lengths,
        deterministic=not train,
        sow_weights=sow_weights,
      )
      return Dropout(self.dropout_rate)(y, deterministic=not train)

    mlp = MlpBlock(
      self.mlp_dim,
      self.dropout_rate,
      self.dtype,
      self.mlp_kernel_init,
      param_dtype=self.param_dtype,
      name="mlp",
    )
    if self.pre_norm:
      x = x + attend(apply_norm(norm1, x, token_mask, train))
      return x + mlp(apply_norm(norm2, x, token_mask, train), train=train)
    x = apply_norm(norm1, x + attend(x), token_mask, train)
    return apply_norm(norm2, x + mlp(x, train=train), token_mask, train)


def sinusoidal_positions(length: int, width: int) -> jax.Array:
  """Fixed sinusoidal position table ``[length, width]`` (Vaswani et al.)."""
  position = jnp.arange(length)[:, None]
  div = jnp.exp(jnp.arange(0, width, 2) * (-jnp.log(10000.0) / width))[None, :]
  table = jnp.zeros((length, width))
  table = table.at[:, 0::2].set(jnp.sin(position * div))
  return table.at[:, 1::2].set(jnp.cos(position * div)[:, : width // 2])


class PositionEmbedding(nn.Module):
  """Adds learnable (``'learned'``, stored in ``param_dtype``) or fixed (``'sinusoidal'``)
  positions to ``[batch, L, width]``, in the input's dtype."""

  kind: str = "learned"
  param_dtype: Any = jnp.float32

  def _learned(self, length: int, width: int) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed"))
    return self.param("embedding", init, (length, width), self.param_dtype)

  def _sinusoidal(self, length: int, width: int) -> jax.Array:
    return sinusoidal_positions(length, width)

  @nn.compact
  def __call__(self, x):
    tables = {"learned": self._learned, "sinusoidal": self._sinusoidal}
    if self.kind not in tables:
      raise ValueError(f"unknown positional embedding {self.kind!r}; use 'learned' or 'sinusoidal'")
    table = tables[self.kind](*x.shape[-2:]).astype(x.dtype)
    return x + jnp.reshape(table, (1,) * (x.ndim - 2) + table.shape)  # explicit batch axes
