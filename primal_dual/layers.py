"""Multi-head attention with any kernel of the primal-dual family, chosen by name.

``MultiHeadAttention`` has the parameters of Flax's ``MultiHeadDotProductAttention`` (``query``,
``key``, ``value``, ``out``, same shapes), so checkpoints move between the two; only the kernel
differs. Kernels come from one public registry, ``primal_dual.registry.ATTENTION_REGISTRY``
(re-exported here): a name maps to an entry whose factory gives an ``attention_fn`` (Flax's
contract, see ``primal_dual.kernels``) and which may declare learned kernel parameters, created
here under the attention module. Add a variant with :func:`register_attention`.

Example::

  layer = MultiHeadAttention(num_heads=8, attention='sh',
                             attention_options={'ratios': (1, 1, 2, 2, 4, 4, 8, 8)})
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from primal_dual import _attend, _decode
from primal_dual.kernels import dropout_on
from primal_dual.registry import (
  ATTENTION_REGISTRY,
  AttentionVariant,
  KernelParam,
  lookup,
  make_attention_fn,
  register_attention,
)

__all__ = [
  "ATTENTION_REGISTRY",
  "AttentionVariant",
  "KernelParam",
  "MultiHeadAttention",
  "make_attention_fn",
  "register_attention",
]


# The layer's attributes that every projection takes as they are.
_PROJECTION_SETTINGS = ("dtype", "param_dtype", "precision", "use_bias", "kernel_init", "bias_init")


class _Projection(nn.Module):
  """``DenseGeneral`` with logically partitioned parameters of Flax's exact shapes.

  Contracts the last ``contract_dims`` input axes into ``features``: kernel
  ``[*contracted, *features]``, bias ``[*features]``. Flax's ``DenseGeneral`` initialises its kernel
  through a flattened 2-D shape, which cannot carry 3-D logical axis names, so the kernel is made at
  its real shape here; the initializer sees the contracted axes as fan-in, like Flax's.
  """

  features: tuple[int, ...]
  contract_dims: int
  logical_axes: tuple[str, ...]
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  use_bias: bool = True
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x):
    contracted = x.shape[x.ndim - self.contract_dims :]
    kernel_shape = (*contracted, *self.features)
    n_in = len(contracted)

    def init(rng, shape, dtype):
      # Flatten to [fan_in, fan_out] so variance scaling matches Flax's DenseGeneral.
      flat = self.kernel_init(rng, (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))), dtype)
      return jnp.reshape(flat, shape)

    kernel = self.param(
      "kernel",
      nn.with_logical_partitioning(init, self.logical_axes),
      kernel_shape,
      self.param_dtype,
    )
    bias = None
    if self.use_bias:
      bias = self.param(
        "bias",
        nn.with_logical_partitioning(self.bias_init, self.logical_axes[n_in:]),
        self.features,
        self.param_dtype,
      )
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    in_axes = tuple(range(x.ndim - n_in, x.ndim))
    y = jax.lax.dot_general(
      x, kernel, ((in_axes, tuple(range(n_in))), ((), ())), precision=self.precision
    )
    if bias is not None:
      y = y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)  # no rank promotion
    return y


class MultiHeadAttention(nn.Module):
  """Multi-head attention whose kernel is any registered variant.

  Parameters match ``flax.linen.MultiHeadDotProductAttention``: ``query``/``key``/``value`` kernels
  ``[in_features, heads, head_dim]``, ``out`` kernel ``[heads, head_dim, out_features]``, annotated
  with the logical axes ``('embed', 'heads', 'kv')`` and ``('heads', 'kv', 'embed')``.

  Attributes:
    num_heads: number of heads H.
    num_kv_heads: key/value heads (default H); fewer than H, dividing it, gives grouped heads
      (GQA; 1 is MQA): the ``key``/``value`` kernels are ``[in_features, num_kv_heads, head_dim]``.
      HYLA refuses grouped heads.
    qkv_features: total width of q/k/v (default: the query input width); divisible by H.
    out_features: output width (default: the query input width).
    attention: registry name of the kernel.
    attention_options: the kernel's options.
    attention_context: input facts passed to kernels that declare them (``grid_shape``,
      ``num_prefix_tokens``).
    dropout_rate: dropout on the attention weights.
    broadcast_dropout: share the dropout pattern across batch and heads.
    deterministic: default for ``__call__``'s ``deterministic``.
    is_causal: query ``i`` attends to keys ``j <= i`` only (top-left, as Flax and
      ``jax.nn.dot_product_attention``), on top of ``mask``.
    dtype, param_dtype, precision: as in Flax.
    use_bias: biases on the projections.
    decode: autoregressive decoding with a key/value cache (collection ``cache``: ``cached_key``,
      ``cached_value``, ``cache_index``), as ``flax.linen.MultiHeadDotProductAttention``: ``init``
      on the full-length input sizes the cache, then each ``apply(..., mutable=['cache'])`` feeds
      one position ``[batch..., 1, in]``, which attends to the positions fed so far and gives
      the row of the full causal pass. Refused (ValueError) for Attention-SH and BN+SH, whose
      decoded rows would differ (``registry.AttentionVariant.decodes``, ``primal_dual._decode``).
  """

  num_heads: int
  num_kv_heads: int | None = None
  qkv_features: int | None = None
  out_features: int | None = None
  attention: str = "softmax"
  attention_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  attention_context: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  dropout_rate: float = 0.0
  broadcast_dropout: bool = True
  deterministic: bool | None = None
  is_causal: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  use_bias: bool = True
  decode: bool = False

  def _decode_step(self, key: jax.Array, value: jax.Array, mask: jax.Array | None):
    """Writes one position's ``key``/``value [batch..., 1, heads, d]`` into the cache; returns the
    cached keys and values ``[batch..., max_length, heads, d]`` and the mask of the keys seen so
    far. The first call (``init``) only creates the cache at the input's shape."""
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:
      return key, value, mask
    _decode.check_step_shape(cached_key.value, key)
    i = index.value
    cached_key.value = _decode.write_step(cached_key.value, key, i)
    cached_value.value = _decode.write_step(cached_value.value, value, i)
    index.value = i + 1
    *batch_shape, max_length, _, _ = cached_key.value.shape
    mask = _decode.seen_keys_mask(mask, i, max_length, tuple(batch_shape))
    return cached_key.value, cached_value.value, mask

  def _kernel_params(self, head_dim: int) -> dict[str, jax.Array]:
    """The learned parameters the variant's registry entry declares, by keyword name."""
    declared = lookup(self.attention).params
    created = {}
    for name, spec in declared.items():
      init = spec.init
      if spec.logical_axes is not None:
        init = nn.with_logical_partitioning(init, spec.logical_axes)
      created[name] = self.param(name, init, spec.shape(self.num_heads, head_dim), self.param_dtype)
    return created

  @nn.compact
  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: jax.Array | None = None,
    inputs_v: jax.Array | None = None,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    deterministic: bool | None = None,
    dropout_rng: jax.Array | None = None,
    sow_weights: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
  ) -> jax.Array:
    """Attends from ``inputs_q [batch..., q_len, in]`` to ``inputs_k/inputs_v [batch..., kv_len, in]``.

    Args:
      inputs_q: queries' inputs. inputs_k: keys' inputs (default ``inputs_q``).
      inputs_v: values' inputs (default ``inputs_k``).
      mask: any dtype, broadcastable to ``[batch..., heads, q_len, kv_len]``; nonzero = may attend.
      bias: additive logits bias, same broadcast shape (e.g. a relative position bias).
      deterministic: disables dropout (default: the attribute, else True).
      dropout_rng: explicit dropout key (default: the module's ``dropout`` rng stream).
      sow_weights: sow the attention weights into ``intermediates``.
      query_seq_lengths, key_value_seq_lengths: int ``[batch...]``, as
        ``jax.nn.dot_product_attention``: only each example's first queries and keys are real
        (the same as a padding mask; softmax, BN, SH and BN+SH keep them as lengths on cuDNN).

    Returns:
      ``[batch..., q_len, out_features]``.
    """
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    head_dim = _attend.head_dim(qkv_features, self.num_heads)
    kv_heads = _attend.kv_heads(self.num_heads, self.num_kv_heads)
    dense_kwargs = {name: getattr(self, name) for name in _PROJECTION_SETTINGS}

    def projection(name, heads):
      return _Projection(
        features=(heads, head_dim),
        contract_dims=1,
        logical_axes=("embed", "heads", "kv"),
        name=name,
        **dense_kwargs,
      )

    query = projection("query", self.num_heads)(inputs_q)
    key = projection("key", kv_heads)(inputs_k)
    value = projection("value", kv_heads)(inputs_v)
    if self.decode:
      key, value, mask = self._decode_step(key, value, mask)

    if deterministic is None:
      deterministic = True if self.deterministic is None else self.deterministic
    if not dropout_on(self.dropout_rate, deterministic):
      dropout_rng = None
    elif dropout_rng is None:
      dropout_rng = self.make_rng("dropout")
    kernel_params = self._kernel_params(head_dim)
    x = _attend.attend(
      self,
      query,
      key,
      value,
      mask,
      bias,
      dropout_rng,
      sow_weights,
      self.decode,
      kernel_params,
      seq_lengths={
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
      },
    )
    return _Projection(
      features=(features,),
      contract_dims=2,
      logical_axes=("heads", "kv", "embed"),
      name="out",
      **dense_kwargs,
    )(x)
