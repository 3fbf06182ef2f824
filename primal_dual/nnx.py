"""The multi-head attention layer of ``primal_dual.layers`` as a ``flax.nnx`` module.

:class:`MultiHeadAttention` takes the same registry names and options as the Linen layer and
holds the same parameters under the same names and shapes: ``query``/``key``/``value``
(``kernel [in, heads, head_dim]``, ``bias [heads, head_dim]``), ``out`` (``kernel [heads,
head_dim, out]``, ``bias [out]``) and the learned kernel parameters the variant's registry entry
declares (e.g. ``log_temperature [heads]``), as attributes of the same name. A checkpoint moves
between the two with :func:`linen_params` and :func:`load_linen_params`.

Example::

  from flax import nnx
  from primal_dual.nnx import MultiHeadAttention
  layer = MultiHeadAttention(num_heads=8, in_features=64, attention='sh',
                             attention_options={'ratios': (1, 1, 2, 2, 4, 4, 8, 8)},
                             rngs=nnx.Rngs(0))
  y = layer(x)  # x: [batch..., length, 64]
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from primal_dual import _attend, _decode
from primal_dual.registry import lookup, make_attention_fn

__all__ = ["MultiHeadAttention", "linen_params", "load_linen_params"]

# Logical axis names of the Linen layer's parameters, kept as ``out_sharding`` metadata without
# eager sharding (``nnx.get_partition_spec`` reads them; map them to mesh axes with your rules).
_QKV_AXES = ("embed", "heads", "kv")
_OUT_AXES = ("heads", "kv", "embed")


class MultiHeadAttention(nnx.Module):
  """Multi-head attention whose kernel is any registered variant (NNX).

  Args:
    num_heads: number of heads H.
    num_kv_heads: key/value heads (default H); fewer than H, dividing it, gives grouped heads
      (GQA; 1 is MQA): ``key``/``value`` kernels ``[in_kv, num_kv_heads, head_dim]``. HYLA
      refuses grouped heads.
    in_features: width of the query input (and of the key/value inputs unless
      ``in_kv_features``).
    qkv_features: total width of q/k/v (default ``in_features``); divisible by H.
    out_features: output width (default ``in_features``).
    in_kv_features: width of the key/value inputs (default ``in_features``).
    attention: registry name of the kernel (``primal_dual.registry.ATTENTION_REGISTRY``).
    attention_options: the kernel's options (SH: ``{'ratios': (...)}``).
    attention_context: input facts passed to kernels that declare them (``grid_shape``,
      ``num_prefix_tokens``).
    dropout_rate: dropout on the attention weights.
    broadcast_dropout: share the dropout pattern across batch and heads.
    deterministic: default for ``__call__``'s ``deterministic`` (None: True, dropout off).
    is_causal: query ``i`` attends to keys ``j <= i`` only (top-left, as Flax and
      ``jax.nn.dot_product_attention``), on top of ``mask``; ``__call__``'s ``is_causal``
      overrides it for one call.
    decode: default for ``__call__``'s ``decode``: one position per call through the key/value
      cache made by :meth:`init_cache`.
    dtype, param_dtype, precision, kernel_init, bias_init, use_bias: as in Flax.
    rngs: ``params`` initialises the parameters; ``dropout`` (kept, forked) drives dropout.

  Raises:
    ValueError: unknown variant, options the factory rejects, or ``qkv_features`` not divisible
      by ``num_heads``.
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    *,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    attention: str = "softmax",
    attention_options: Mapping[str, Any] | None = None,
    attention_context: Mapping[str, Any] | None = None,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    deterministic: bool | None = None,
    is_causal: bool = False,
    decode: bool = False,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: Callable = nn.initializers.lecun_normal(),
    bias_init: Callable = nn.initializers.zeros_init(),
    use_bias: bool = True,
    rngs: nnx.Rngs,
  ):
    qkv_features = in_features if qkv_features is None else qkv_features
    self.num_heads = num_heads
    self.head_dim = _attend.head_dim(qkv_features, num_heads)
    self.num_kv_heads = _attend.kv_heads(num_heads, num_kv_heads)
    self.in_features = in_features
    self.out_features = in_features if out_features is None else out_features
    self.attention = attention
    # Stored as sorted item tuples: static and hashable for nnx.jit.
    self.attention_options = _frozen(attention_options)
    self.attention_context = _frozen(attention_context)
    # Unknown names and options the factory rejects fail here; the kernel checks the rest (e.g.
    # one SH ratio per head) on the first call, as in the Linen layer.
    make_attention_fn(attention, attention_options, attention_context)
    self.dropout_rate = dropout_rate
    self.broadcast_dropout = broadcast_dropout
    self.deterministic = deterministic
    self.is_causal = is_causal
    self.decode = decode
    self.dtype = dtype
    self.precision = precision

    linear = dict(
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      use_bias=use_bias,
      kernel_init=kernel_init,
      bias_init=bias_init,
      rngs=rngs,
    )
    heads = (num_heads, self.head_dim)
    kv_heads = (self.num_kv_heads, self.head_dim)
    kv_in = in_features if in_kv_features is None else in_kv_features
    self.query = _projection(in_features, heads, -1, _QKV_AXES, **linear)
    self.key = _projection(kv_in, kv_heads, -1, _QKV_AXES, **linear)
    self.value = _projection(kv_in, kv_heads, -1, _QKV_AXES, **linear)
    self.out = _projection(heads, self.out_features, (-2, -1), _OUT_AXES, **linear)
    self.kernel_param_names = self._create_kernel_params(rngs, param_dtype)
    self.rngs = rngs.dropout.fork() if dropout_rate > 0.0 else None
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)

  def _create_kernel_params(self, rngs: nnx.Rngs, param_dtype: Any) -> tuple[str, ...]:
    """Creates the registry entry's learned kernel parameters as attributes of their own name
    (shape ``spec.shape(num_heads, head_dim)``); returns the names."""
    declared = lookup(self.attention).params
    for name, spec in declared.items():
      if hasattr(self, name):
        raise ValueError(
          f"attention variant {self.attention!r} declares a kernel parameter "
          f"{name!r}, which is already an attribute of the NNX layer"
        )
      value = spec.init(rngs.params(), spec.shape(self.num_heads, self.head_dim), param_dtype)
      axes = None if spec.logical_axes is None else tuple(spec.logical_axes)
      setattr(self, name, nnx.Param(value, **_sharding(axes)))
    return tuple(declared)

  def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
    """Empties the decoding cache for inputs ``[batch..., max_length, in_features]``: keys and
    values ``[batch..., max_length, num_kv_heads, head_dim]`` of ``dtype``, index 0."""
    shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

  def _decode_step(self, key: jax.Array, value: jax.Array, mask: jax.Array | None):
    """Writes one position's ``key``/``value [batch..., 1, heads, d]`` into the cache; returns the
    cached ``[batch..., max_length, heads, d]`` and the mask of the keys seen so far."""
    if self.cached_key is None:
      raise ValueError("decoding needs a cache: call init_cache(input_shape) first")
    _decode.check_step_shape(self.cached_key[...], key)
    index = self.cache_index[...]
    keys = _decode.write_step(self.cached_key[...], key, index)
    values = _decode.write_step(self.cached_value[...], value, index)
    self.cached_key[...] = keys
    self.cached_value[...] = values
    self.cache_index[...] = index + 1
    *batch_shape, max_length, _, _ = keys.shape
    return keys, values, _decode.seen_keys_mask(mask, index, max_length, tuple(batch_shape))

  def _dropout_rng(self, deterministic: bool, rngs) -> jax.Array | None:
    """A fresh dropout key when dropout is on, from ``rngs`` (call) or the kept stream."""
    if deterministic or self.dropout_rate == 0.0:
      return None
    stream = self.rngs if rngs is None else rngs
    if isinstance(stream, nnx.Rngs):
      stream = stream.dropout
    if stream is None:
      raise ValueError("dropout needs an rng stream: pass rngs=nnx.Rngs(dropout=...)")
    return stream()

  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: jax.Array | None = None,
    inputs_v: jax.Array | None = None,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    deterministic: bool | None = None,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    sow_weights: bool = False,
    decode: bool | None = None,
    is_causal: bool | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
  ) -> jax.Array:
    """Attends from ``inputs_q [batch..., q_len, in]`` to ``inputs_k/inputs_v [batch..., kv_len,
    in_kv]``.

    Args:
      inputs_q: queries' inputs. inputs_k: keys' inputs (default ``inputs_q``).
      inputs_v: values' inputs (default ``inputs_k``).
      mask: any dtype, nonzero = may attend, broadcastable to ``[batch..., heads, q_len,
        kv_len]`` (when decoding: ``kv_len`` = the cache's ``max_length``).
      bias: additive logits bias, same broadcast shape.
      deterministic: disables dropout (default: the attribute, else True).
      rngs: dropout stream for this call (default: the one kept at construction).
      sow_weights: sow the attention weights as ``nnx.Intermediate`` ``attention_weights``.
      decode: one position ``[batch..., 1, in]`` through the cache (default: the attribute).
        Refused (ValueError) for variants whose decoded rows would differ from the full causal
        pass (Attention-SH, BN+SH: ``registry.AttentionVariant.decodes``).
      is_causal: this call only, as in ``flax.nnx.MultiHeadAttention``: query ``i`` attends to
        keys ``j <= i`` (default: the attribute). Ignored while decoding, where the cache's mask
        is causal already.
      query_seq_lengths, key_value_seq_lengths: int ``[batch...]``, as
        ``jax.nn.dot_product_attention``: only each example's first queries and keys are real
        (the same as a padding mask; softmax, BN, SH and BN+SH keep them as lengths on cuDNN).

    Returns:
      ``[batch..., q_len, out_features]``.
    """
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    decoding = self.decode if decode is None else decode
    if decoding:
      key, value, mask = self._decode_step(key, value, mask)
    if deterministic is None:
      deterministic = True if self.deterministic is None else self.deterministic
    dropout_rng = self._dropout_rng(deterministic, rngs)
    kernel_params = {name: getattr(self, name)[...] for name in self.kernel_param_names}
    x = _attend.attend(
      self,
      query,
      key,
      value,
      mask,
      bias,
      dropout_rng,
      sow_weights,
      decoding,
      kernel_params,
      is_causal=is_causal,
      seq_lengths={
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
      },
    )
    return self.out(x)


def _frozen(mapping: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
  return tuple(sorted(dict(mapping or {}).items()))


def _projection(in_features, out_features, axis, logical_axes, **kwargs) -> nnx.LinearGeneral:
  """``nnx.LinearGeneral`` with the Linen layer's shapes and logical axis names: kernel
  ``[*in, *out]`` (``logical_axes``), bias ``[*out]`` (the output part of ``logical_axes``)."""
  n_out = 1 if isinstance(out_features, int) else len(out_features)
  return nnx.LinearGeneral(
    in_features,
    out_features,
    axis=axis,
    kernel_metadata=_sharding(logical_axes),
    bias_metadata=_sharding(logical_axes[-n_out:]),
    **kwargs,
  )


def _sharding(logical_axes: tuple[str | None, ...] | None) -> dict[str, Any]:
  """Variable metadata recording logical axis names (none when None), never sharding eagerly."""
  return {} if logical_axes is None else {"out_sharding": logical_axes, "eager_sharding": False}


def linen_params(module: MultiHeadAttention) -> dict[str, Any]:
  """The layer's parameters as the Linen layer's ``params`` collection (nested dict of arrays):
  ``primal_dual.layers.MultiHeadAttention(...).apply({'params': linen_params(m)}, x)``."""
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def load_linen_params(module: MultiHeadAttention, params: Mapping[str, Any]) -> None:
  """Sets the layer's parameters from the Linen layer's ``params`` (or its whole variables dict
  ``{'params': ...}``; logical-partitioning boxes are unboxed).

  Raises:
    ValueError: ``params`` lacks a parameter of the layer, has one it lacks, or a shape differs.
  """
  params = nn.meta.unbox(params)
  if set(params) == {"params"}:
    params = params["params"]
  flat_new = _flatten(params)
  state = nnx.state(module, nnx.Param)
  flat_own = _flatten(nnx.to_pure_dict(state))
  if set(flat_new) != set(flat_own):
    raise ValueError(
      f"parameter names differ: missing {sorted(set(flat_own) - set(flat_new))}, "
      f"unexpected {sorted(set(flat_new) - set(flat_own))}"
    )
  for path, value in flat_new.items():
    if jnp.shape(value) != jnp.shape(flat_own[path]):
      raise ValueError(
        f"parameter {path}: shape {jnp.shape(value)}, the layer has {jnp.shape(flat_own[path])}"
      )
  nnx.replace_by_pure_dict(state, params)
  nnx.update(module, state)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{'a/b': leaf}`` of a nested mapping."""
  flat = {}
  for name, value in tree.items():
    path = f"{prefix}{name}"
    if isinstance(value, Mapping):
      flat.update(_flatten(value, path + "/"))
    else:
      flat[path] = value
  return flat
