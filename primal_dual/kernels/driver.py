"""The one driver of every kernel: Flax's ``attention_fn`` arguments and what every kernel does
with them (validation, masks, head mapping, dropout, sowing, returned weights, output dtype).

A kernel module writes ``compute(call, *, option=default, ...)`` and decorates it with
:func:`attention_kernel`; the result is callable exactly as Flax calls an ``attention_fn``::

  kernel(query, key, value, bias=None, mask=None, *, broadcast_dropout=True, dropout_rng=None,
         dropout_rate=0.0, deterministic=True, dtype=None, precision=None, module=None,
         is_causal=False, causal_alignment='top_left', return_weights=False, **options)

and ``inspect.signature(kernel)`` lists every one of those parameters and the kernel's options.
``compute`` receives an :class:`AttentionCall` (the Flax arguments, validated) and typically
returns ``call.attend(weights_one_head)`` (one-head weights ``[q_len, kv_len]`` from
``q [q_len, d], k [kv_len, d], bias, mask``) or ``call.finish(out)`` of its own output.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import fused, masks

Array = jax.Array


@dataclasses.dataclass
class AttentionCall:
  """One kernel call: Flax's ``attention_fn`` arguments (this class declares them, once).

  Fields up to ``mask`` are positional in the generated signatures, the rest keyword-only; every
  kernel documents here what they mean and, in its own docstring, only where it departs.

  Attributes:
    query: ``[batch..., q_len, heads, d_qk]``.
    key: ``[batch..., kv_len, kv_heads, d_qk]``; ``kv_heads`` divides ``heads`` (grouped heads:
      query head ``h`` uses key/value head ``h // (heads // kv_heads)``).
    value: ``[batch..., kv_len, kv_heads, d_v]``.
    bias: additive logits bias broadcastable to ``[batch..., heads, q_len, kv_len]``.
    mask: any dtype, broadcastable like ``bias``; nonzero = may attend. Fully masked rows give
      zeros.
    broadcast_dropout, dropout_rng, dropout_rate, deterministic: dropout on the weights (Flax);
      ``broadcast_dropout`` shares one pattern across examples and heads.
    dtype: output dtype (default ``query.dtype``); statistics and weights are float32 regardless.
    precision: passed to the einsums.
    module: a Flax module to sow the weights into (``intermediates/attention_weights``).
    is_causal: add a causal mask, aligned by ``causal_alignment``.
    causal_alignment: ``'top_left'`` (default, as Flax: query ``i`` sees keys ``j <= i``) or
      ``'bottom_right'`` (``j <= i + kv_len - q_len``).
    return_weights: also return the float32 weights ``[batch..., heads, q_len, kv_len]``.
    query_seq_lengths, key_value_seq_lengths: int ``[batch...]`` or None, as
      ``jax.nn.dot_product_attention`` takes them: only the first ``query_seq_lengths[b]`` queries
      and ``key_value_seq_lengths[b]`` keys of example ``b`` are real (padded queries get zeros,
      padded keys are never seen). They are folded into ``mask`` here, so every kernel honours
      them; without a mask, the fused paths of softmax, Attention-BN and Attention-SH keep them
      as lengths, which cuDNN takes without a bias (``fused_masking``, ``lengths_only``).
    force_fp32_for_softmax: Flax's flag, accepted and without effect: the statistics and the
      softmax are float32 always.
    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: Flax's hooks for
      custom (e.g. quantised) einsums. Accepted so that Flax passes them, checked as Flax checks
      them (the two einsums together, neither with ``precision``/``einsum_dot_general``: the same
      ValueError messages), and refused with a ValueError when not None: the kernels' products
      are their own (fused or per-head), not Flax's two einsums.
    shapes: the validated sizes (:func:`_common.validate_qkv`).
    lengths_only: the call's mask comes from the lengths alone (no ``mask`` given).
  """

  query: Array
  key: Array
  value: Array
  bias: Array | None = None
  mask: Array | None = None
  _: dataclasses.KW_ONLY
  broadcast_dropout: bool = True
  dropout_rng: Any = None
  dropout_rate: float = 0.0
  deterministic: bool = True
  dtype: Any = None
  precision: Any = None
  module: Any = None
  is_causal: bool = False
  causal_alignment: str = "top_left"
  return_weights: bool = False
  query_seq_lengths: Any = None
  key_value_seq_lengths: Any = None
  force_fp32_for_softmax: bool = False
  einsum_dot_general: Any = None
  qk_attn_weights_einsum: Any = None
  attn_weights_value_einsum: Any = None
  shapes: C.QKVShapes = dataclasses.field(init=False)
  lengths_only: bool = dataclasses.field(init=False)

  def __post_init__(self):
    _check_flax_einsums(self)
    self.shapes = C.validate_qkv(self.query, self.key, self.value)
    lengths = (self.query_seq_lengths, self.key_value_seq_lengths)
    self.lengths_only = self.mask is None and any(x is not None for x in lengths)
    from_lengths = C.lengths_mask(*lengths, self.shapes)
    if from_lengths is not None and self.mask is not None:
      rank = max(jnp.ndim(self.mask), from_lengths.ndim)
      self.mask = masks.combine_masks(C.with_rank(jnp.asarray(self.mask), rank), from_lengths)
    elif from_lengths is not None:
      self.mask = from_lengths

  @property
  def out_dtype(self):
    """The output dtype: ``dtype``, or the query's."""
    return C.output_dtype(self.query, self.dtype)

  @property
  def compute_dtype(self):
    """The dtype of the fused product: the promoted dtype of query, key and value as given (a
    kernel's float32 intermediates, e.g. Attention-BN's normalised q and k, are rounded to it)."""
    return jnp.result_type(self.query, self.key, self.value)

  @property
  def dropout_active(self) -> bool:
    return C.dropout_on(self.dropout_rate, self.deterministic)

  def heads_major(self) -> tuple[Array, Array, Array]:
    """``q [B, H, q_len, d_qk]``, ``k [B, H, kv_len, d_qk]``, ``v [B, H, kv_len, d_v]`` with
    grouped key/value heads repeated to one per query head."""
    key, value = C.repeat_kv_heads(self.key, self.value, self.shapes)
    return tuple(C.to_heads_major(x) for x in (self.query, key, value))

  def mask_and_bias(self, *, with_causal: bool = True) -> tuple[Array | None, Array | None]:
    """``(mask, bias)`` as ``[B | 1, H | 1, q_len, kv_len]`` (bool mask, causal constraint
    included unless ``with_causal=False``), or None; axes the caller shares stay of size 1."""
    return C.prepare_mask_and_bias(
      self.mask,
      self.bias,
      self.shapes,
      self.is_causal and with_causal,
      self.causal_alignment,
    )

  def fused_masking(self) -> tuple[Array | None, Array | None, dict[str, Any]]:
    """How the fused product (``fused.attend``) takes the call's masking: ``(mask, bias,
    options)``, ``options`` the keywords ``is_causal``, ``key_lengths`` and ``query_lengths``
    (int32 ``[B]``) it then takes.

    Lengths alone (no ``mask`` given) stay lengths and a top-left causal constraint stays
    ``is_causal``: cuDNN takes both without a bias. Any other masking is one mask
    (``mask_and_bias``), the causal constraint included.
    """
    # jax.nn's is_causal is top-left; a bottom-right constraint can only be a mask.
    causal_apart = self.is_causal and self.causal_alignment == "top_left"
    if (self.is_causal and not causal_apart) or not (self.lengths_only or self.mask is None):
      return (*self.mask_and_bias(), {})
    bias = C.broadcast_logits_arg(self.bias, "bias", self.shapes)
    options = {"is_causal": causal_apart}
    if self.lengths_only:
      batch = self.shapes.batch_shape
      for name, lengths in (
        ("query_lengths", self.query_seq_lengths),
        ("key_lengths", self.key_value_seq_lengths),
      ):
        if lengths is not None:
          options[name] = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), batch).reshape(-1)
    return None, bias, options

  def dropout(self, weights: Array, dropout_rng=None) -> Array:
    """Flax dropout on ``weights [B, H, q_len, kv_len]`` (``dropout_rng`` overrides the call's)."""
    return C.apply_dropout(
      weights,
      dropout_rng=self.dropout_rng if dropout_rng is None else dropout_rng,
      dropout_rate=self.dropout_rate,
      broadcast_dropout=self.broadcast_dropout,
      deterministic=self.deterministic,
    )

  def takes_fused(self, implementation: str, *, softmax_kernel: bool = True) -> bool:
    """Whether the product goes to ``jax.nn.dot_product_attention`` (see ``kernels.fused``)."""
    return fused.use_fused(
      implementation,
      return_weights=self.return_weights,
      module=self.module,
      dropout_rate=self.dropout_rate,
      deterministic=self.deterministic,
      same_head_size=self.shapes.d_qk == self.shapes.d_v,
      softmax_kernel=softmax_kernel,
      precision=self.precision,
    )

  def refuse_weights(self, kernel: str) -> None:
    """Raises ValueError when a kernel that never forms the weights is asked for them or for
    dropout on them."""
    if self.dropout_active:
      raise ValueError(
        f"{kernel} never forms the attention weights, so attention dropout is not available; "
        f"got dropout_rate={self.dropout_rate} with deterministic=False"
      )
    if self.return_weights:
      raise ValueError(f"{kernel} never forms the attention weights; return_weights must be False")

  def weigh_values(self, one_head: Callable, *args, dropout_rng=None) -> tuple[Array, Array]:
    """Weights and output of every head: ``(out [B, H, q_len, d_v], weights [B, H, q_len, n])``.

    ``one_head(*args of one head) -> (weights [q_len, n] float32, values [n, d_v])`` is mapped
    with :func:`_common.map_heads`; the weights are dropped out, then contracted with the values.
    """
    weights, values = C.map_heads(one_head, *args)
    dropped = self.dropout(weights, dropout_rng)
    out = C.map_heads(lambda w, v: C.contract_values(w, v, self.precision), dropped, values)
    return out, weights

  def attend(self, weights_one_head: Callable) -> Any:
    """The whole call for a kernel defined by its one-head weights.

    ``weights_one_head(q [q_len, d], k [kv_len, d], bias, mask) -> float32 [q_len, kv_len]``
    (``bias``/``mask`` ``[q_len, kv_len]`` or None).
    """
    q, k, v = self.heads_major()
    mask, bias = self.mask_and_bias()

    def one_head(q, k, v, bias, mask):
      return weights_one_head(q, k, bias, mask), v

    return self.finish(*self.weigh_values(one_head, q, k, v, bias, mask))

  def finish(self, out: Array, weights: Any = None) -> Any:
    """``out [B, H, q_len, d_v]`` as ``[batch..., q_len, heads, d_v]`` in the output dtype;
    weights (an array or a tuple of them) sown and returned as the call asks."""
    return C.finish(
      out,
      weights,
      shapes=self.shapes,
      dtype=self.out_dtype,
      module=self.module,
      return_weights=self.return_weights,
    )


def _check_flax_einsums(call: AttentionCall) -> None:
  """Flax's checks of its einsum hooks (same messages), then a refusal of any hook given."""
  qk, wv = call.qk_attn_weights_einsum, call.attn_weights_value_einsum
  if (qk is None) != (wv is None):
    raise ValueError(
      "qk_attn_weights_einsum and attn_weights_value_einsum must be specified together."
    )
  if (call.precision is not None or call.einsum_dot_general is not None) and qk is not None:
    raise ValueError(
      "precision/einsum_dot_general and qk_attn_weights_einsum/attn_weights_value_einsum are "
      "mutually exclusive. Please specify only one of them."
    )
  given = [
    name
    for name in ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum")
    if getattr(call, name) is not None
  ]
  if given:
    raise ValueError(
      f"primal_dual kernels do not take Flax's custom einsum hooks; got {', '.join(given)} "
      "(leave them None)"
    )


def _call_parameters() -> tuple[inspect.Parameter, ...]:
  parameters = []
  for field in dataclasses.fields(AttentionCall):
    if not field.init:
      continue
    kind = (
      inspect.Parameter.KEYWORD_ONLY if field.kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
    )
    default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
    parameters.append(inspect.Parameter(field.name, kind, default=default))
  return tuple(parameters)


CALL_PARAMETERS = _call_parameters()


def attention_kernel(compute: Callable[..., Any]) -> Callable[..., Any]:
  """Turns ``compute(call, *, **options)`` into a Flax ``attention_fn`` of the same name and
  docstring whose signature is Flax's arguments followed by ``compute``'s keyword options."""
  options = tuple(inspect.signature(compute).parameters.values())[1:]
  signature = inspect.Signature([*CALL_PARAMETERS, *options])
  call_names = [p.name for p in CALL_PARAMETERS]

  def attention_fn(*args, **kwargs):
    arguments = signature.bind(*args, **kwargs).arguments
    call = AttentionCall(**{name: arguments.pop(name) for name in call_names if name in arguments})
    return compute(call, **arguments)

  attention_fn.__signature__ = signature
  for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
    setattr(attention_fn, attribute, getattr(compute, attribute))
  return attention_fn
