"""The fused path of the softmax family: ``jax.nn.dot_product_attention``.

Softmax, Attention-BN (softmax kernel), Attention-SH and BN+SH all end in the same product,

  out_hi = Σ_j softmax_j(scale · q̃_hi·k̃_hj + bias_hij) ṽ_hj      (masked keys excluded)

on their own queries, keys and values (BN: normalised q and k; SH: each ratio group's pooled keys
and values). When a call needs neither the weights back (``return_weights``, sowing) nor dropout
on them, that product goes to ``jax.nn.dot_product_attention``, with ``implementation='cudnn'``
(fused flash attention) on NVIDIA GPUs where the dtype (bfloat16 or float16) and head size (≤ 128,
the same for keys and values) allow, and XLA's implementation elsewhere. cuDNN's other conditions
are met by padding, sliced off afterwards: head sizes to a multiple of 8 (zeros, which leave q·k
unchanged) and lengths to even ones (in training with a bias, which a mask becomes and jax 0.10.2
assumes of every call: a key masked or past the key lengths, a query row sliced off). On a jax
whose cuDNN batching rules mishandle operands the vmap does not batch (before ``VMAP_SAFE_JAX``),
a call's mask is made full-size and batched with the queries, and its lengths batched, so the
replicas of a sweep (``jax.vmap``), which share a batch's mask, lower and compute right, at the
memory of one bias ``[B, H, q_len, kv_len]`` in the compute dtype. Otherwise, or with
``implementation='reference'``, the kernels take their own path (``_common`` + one-head maths);
the two agree within the dtype's rounding (tests). Rows with no visible key give zeros on both
paths (XLA's implementation alone would average every value there).

Padding given as lengths (``query_seq_lengths``, ``key_value_seq_lengths``, no mask) stays lengths
to cuDNN, which takes them as its own padding mask: no bias ``[B, 1, T, S]`` is made and the padded
blocks are skipped. Softmax and Attention-BN pass them per example (``attend``'s
``query_lengths``/``key_lengths [B]``); Attention-SH sends all its ratio groups in one call, heads
folded into the batch and each row's pooled length as its key length (``key_lengths [B, H]``).
A mask given alone (no bias, no lengths) to a cuDNN call is looked at inside the program, since
its values are data: when it is a padding mask (each example's visible queries and visible keys
are prefixes, what ``nn.make_attention_mask`` of two padding vectors gives), a ``lax.cond`` sends
the lengths it implies to cuDNN; any other mask goes as a bias. Both calls are in the program and
one runs (under a ``vmap`` whose replicas have different masks both run, as a select). The models
whose padding is a suffix by construction (the UEA and ListOps encoders) give it as lengths.

Two rules of the fused path, exactly:

* **Precision.** ``jax.nn.dot_product_attention`` takes no ``precision``. A call with a
  ``precision`` other than None or ``DEFAULT`` (``'highest'``, ``Precision.HIGH``, a tuple of
  them, an algorithm preset) therefore takes the reference path under ``'auto'``, whose einsums
  pass it on, and is refused (ValueError) under ``'fused'``.
* **Dtype.** The product runs in the promoted dtype of the call's query, key and value as given
  (``jnp.result_type``): q, k and v are cast to it. float32 inputs are never rounded; bfloat16
  inputs run in bfloat16 (which is what lets cuDNN take them), so Attention-BN's float32
  normalised q̂, k̂ are rounded to bfloat16 there (the reference path keeps them float32); a
  float32 query with bfloat16 keys and values runs in float32.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from primal_dual.kernels import _common


IMPLEMENTATIONS = ("auto", "fused", "reference")
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_SIZE, _CUDNN_HEAD_MULTIPLE = 128, 8
# The first jax whose cuDNN attention batching rules take operands without the vmap axis (a mask
# or bias shared by a sweep's replicas, lengths jax makes itself): jax-ml/jax#39451. Up to 0.11.0
# they crash (`cannot reshape array`) or pair each replica's queries with the wrong bias rows.
VMAP_SAFE_JAX = (0, 11, 1)
_log = logging.getLogger(__name__)


def use_fused(
  implementation: str,
  *,
  return_weights: bool,
  module,
  dropout_rate: float,
  deterministic: bool,
  same_head_size: bool = True,
  softmax_kernel: bool = True,
  precision=None,
) -> bool:
  """Whether a call takes the fused path.

  Raises:
    ValueError: unknown ``implementation``, or ``'fused'`` for a call only the reference path can
      serve (weights returned or sown, dropout on the weights, key and value head sizes differ,
      a kernel other than softmax).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
  if implementation == "reference":
    return False
  blockers = [
    reason
    for reason, present in (
      ("return_weights=True", return_weights),
      ("sowing weights (module given)", module is not None),
      ("dropout on the weights", _common.dropout_on(dropout_rate, deterministic)),
      ("key and value head sizes differ", not same_head_size),
      ("kernel is not softmax", not softmax_kernel),
      (
        f"precision={precision!r} (jax.nn.dot_product_attention takes none)",
        not is_default_precision(precision),
      ),
    )
    if present
  ]
  if blockers and implementation == "fused":
    raise ValueError(
      f"implementation='fused' cannot serve this call ({', '.join(blockers)}); "
      "use implementation='auto' or 'reference'"
    )
  return not blockers


def is_default_precision(precision) -> bool:
  """Whether ``precision`` asks for nothing beyond the backend default (None or ``DEFAULT``,
  alone or in a tuple)."""
  values = precision if isinstance(precision, (tuple, list)) else (precision,)
  for value in values:
    if value is None:
      continue
    try:
      if jax.lax.Precision(value) != jax.lax.Precision.DEFAULT:
        return False
    except (ValueError, TypeError):  # an algorithm preset or an unknown name: not the default
      return False
  return True


def backend_implementation(query: jax.Array, *, head_size: int, masked: bool = False) -> str:
  """``'cudnn'`` where cuDNN's fused attention takes the call (see module docstring), else
  ``'xla'``. ``masked`` (a mask or bias with the call) no longer decides: ``attend`` meets
  cuDNN's conditions for masked calls."""
  del masked
  if (
    jax.default_backend() == "gpu"
    and query.dtype in _CUDNN_DTYPES
    and head_size <= _CUDNN_MAX_HEAD_SIZE
  ):
    return "cudnn"
  return "xla"


_workaround_logged = False


def _log_vmap_workaround() -> None:
  """One log line per process: on this jax, masked cuDNN calls carry full-size masks."""
  global _workaround_logged
  if not _workaround_logged:
    _workaround_logged = True
    _log.info(
      "jax %s: masked cuDNN attention calls get a full-size mask batched with the queries, so "
      "that vmap (a sweep's replicas) batches them right; jax >= %s passes them as given",
      jax.__version__,
      ".".join(map(str, VMAP_SAFE_JAX)),
    )


def _pad_axis(x: jax.Array, axis: int, amount: int, fill=0) -> jax.Array:
  """``x`` with ``amount`` entries of ``fill`` appended along ``axis``."""
  if not amount:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, amount)
  return jnp.pad(x, widths, constant_values=fill)


def _cudnn_operands(q, k, v, bias, mask, lengths: dict) -> tuple:
  """Length-major ``q [N, T, H, d]``, ``k``/``v [N, S, H, d]``, ``bias``/``mask [N | 1, H | 1, T,
  S]`` (or None) and ``lengths`` (``query_seq_lengths`` and/or ``key_value_seq_lengths``, int32
  ``[N]``, or empty) as cuDNN takes them (module docstring): head size padded to a multiple of 8;
  T and S padded to even (the padded key masked or beyond the key lengths, the padded query row
  seeing the real keys or beyond the query lengths); a mask or bias of full lengths, the bias in
  the compute dtype; lengths both given once one is; on a jax older than ``VMAP_SAFE_JAX``, the
  mask full-size and the lengths batched with ``q``. The caller slices the output back to
  ``[:, :T, :, :d_v]``."""
  q, k, v = (_pad_axis(x, 3, -q.shape[-1] % _CUDNN_HEAD_MULTIPLE) for x in (q, k, v))
  # jax's check of a training call takes every call for one with a bias (jax 0.10.2 at least),
  # and cuDNN takes a bias in training with even lengths only.
  t, s = q.shape[1], k.shape[1]
  pad_t, pad_s = t % 2, s % 2
  q, k, v = _pad_axis(q, 1, pad_t), _pad_axis(k, 1, pad_s), _pad_axis(v, 1, pad_s)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (*mask.shape[:2], t, s))
    mask = _pad_axis(_pad_axis(mask, 2, pad_t, True), 3, pad_s, False)
  elif pad_s and not lengths:
    lengths = {"key_value_seq_lengths": jnp.full((q.shape[0],), s, jnp.int32)}
  if bias is not None:
    bias = jnp.broadcast_to(bias, (*bias.shape[:2], t, s))
    bias = _pad_axis(_pad_axis(bias, 2, pad_t), 3, pad_s).astype(q.dtype)
  if lengths:
    # Both given explicitly: jax would make the missing one itself, outside any vmap (see
    # VMAP_SAFE_JAX).
    full = {"query_seq_lengths": t, "key_value_seq_lengths": s}
    lengths = {
      name: lengths[name] if name in lengths else jnp.full((q.shape[0],), size, jnp.int32)
      for name, size in full.items()
    }
  if jax.__version_info__ >= VMAP_SAFE_JAX or (bias is None and mask is None and not lengths):
    return q, k, v, bias, mask, lengths
  _log_vmap_workaround()
  # True everywhere, but computed from q: under vmap it carries q's batch axis, and so does
  # every operand combined with it (the old batching rules assume they all do).
  tied = jnp.logical_or(jax.lax.stop_gradient(q[:, :1, :1, :1]) != 0, True)  # [N, 1, 1, 1]
  if bias is not None or mask is not None:
    mask = tied if mask is None else mask
    mask = jnp.broadcast_to(mask, (q.shape[0], q.shape[2], q.shape[1], k.shape[1])) & tied
  ones = tied.reshape(-1).astype(jnp.int32)  # [N]: a product is cheaper to lower than a where
  lengths = {name: x * ones for name, x in lengths.items()}
  return q, k, v, bias, mask, lengths


def _lengths_by_row(key_lengths, query_lengths, batch: int, heads: int) -> tuple:
  """``(key_lengths, query_lengths, per_head)``: int32 lengths of the rows ``attend`` sends, ``[B]``
  (one row per example) or, with per-head key lengths, ``[B·H]`` (one row per example and head;
  ``per_head`` True). Either may be None.

  Raises:
    ValueError: ``key_lengths`` neither ``[B]`` nor ``[B, H]``, or ``query_lengths`` not ``[B]``.
  """
  if key_lengths is not None:
    # Lengths known when tracing (NumPy) stay NumPy: rows they leave with no key are then known.
    key_lengths = (np if isinstance(key_lengths, np.ndarray) else jnp).asarray(
      key_lengths, jnp.int32
    )
    if key_lengths.shape not in ((batch,), (batch, heads)):
      raise ValueError(
        f"key_lengths must be int [B] or [B, H] = [{batch}] or [{batch}, {heads}]; got shape "
        f"{tuple(key_lengths.shape)}"
      )
  if query_lengths is not None:
    query_lengths = jnp.asarray(query_lengths, jnp.int32)
    if query_lengths.shape != (batch,):
      raise ValueError(
        f"query_lengths must be int [B] = [{batch}]; got shape {tuple(query_lengths.shape)}"
      )
  per_head = key_lengths is not None and key_lengths.ndim == 2
  if per_head:
    key_lengths = key_lengths.reshape(-1)
    if query_lengths is not None:  # each example's query length on each of its head rows
      query_lengths = jnp.repeat(query_lengths, heads)
  return key_lengths, query_lengths, per_head


def _rows_seeing_a_key(mask, key_lengths, query_lengths, q_len: int):
  """bool, broadcasting to the output ``[N, q_len, H, 1]`` of ``jax.nn.dot_product_attention``'s
  rows: the query rows with a visible key (True), or None when every row has one. ``mask`` ``[N |
  1, H | 1, q_len | 1, S]`` or None; ``key_lengths``/``query_lengths`` int ``[N]`` or None. XLA's
  implementation averages every value in the other rows; the kernels give them 0."""
  rows = []
  if mask is not None:
    rows.append(_swap_heads_and_length(jnp.any(mask, axis=-1, keepdims=True)))
  if key_lengths is not None and not (isinstance(key_lengths, np.ndarray) and key_lengths.all()):
    rows.append((key_lengths > 0)[:, None, None, None])
  if query_lengths is not None:
    rows.append((jnp.arange(q_len)[None, :] < query_lengths[:, None])[:, :, None, None])
  if not rows:
    return None
  seen = rows[0]
  for row in rows[1:]:
    seen = seen & row
  return seen


def attend(
  q,
  k,
  v,
  bias,
  mask,
  *,
  scale: float,
  is_causal: bool = False,
  dtype=None,
  key_lengths=None,
  query_lengths=None,
):
  """Softmax attention of heads-major arrays through ``jax.nn.dot_product_attention``.

  Args:
    q: ``[B, H, q_len, d]``; k: ``[B, H, kv_len, d]``; v: ``[B, H, kv_len, d]`` (same head size).
    bias: ``[B, H, q_len, kv_len]`` or None. mask: bool, the same shape, or None.
    scale: logits scale.
    is_causal: a top-left causal mask on top of ``mask`` (query i sees keys j ≤ i).
    dtype: the dtype the product runs in (q, k and v are cast to it); default ``v``'s. The
      kernels pass the call's promoted input dtype (module docstring, "Dtype").
    key_lengths: int ``[B]`` or ``[B, H]``, or None: example ``b`` (head ``h``) sees only its
      first ``key_lengths[b(, h)]`` keys. They go to ``jax.nn.dot_product_attention`` as
      ``key_value_seq_lengths``, which cuDNN takes without a mask (no bias is made of them);
      per-head lengths fold the heads into the batch (one row per example and head).
    query_lengths: int ``[B]`` or None: only example ``b``'s first ``query_lengths[b]`` queries
      are real (``query_seq_lengths``); the others give 0.

  Returns:
    ``[B, H, q_len, d]`` in ``dtype``; rows with no visible key (all masked, key length 0, or past
    the query length) are 0.

  Raises:
    ValueError: lengths of other shapes (``_lengths_by_row``).
  """
  dtype = v.dtype if dtype is None else dtype
  q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
  implementation = backend_implementation(q, head_size=q.shape[-1])
  batch, heads, q_len = q.shape[:3]
  head_size = v.shape[-1]
  key_lengths, query_lengths, per_head = _lengths_by_row(key_lengths, query_lengths, batch, heads)
  if per_head:
    # One row per (example, head), length-major as jax.nn.dot_product_attention takes it:
    # [B·H, L, 1, d] by one reshape; a mask or bias broadcast to match.
    q, k, v = (x.reshape((batch * heads, x.shape[2], 1, x.shape[3])) for x in (q, k, v))
    bias, mask = (
      None
      if x is None
      else jnp.broadcast_to(x, (batch, heads, *x.shape[2:])).reshape(
        (batch * heads, 1, *x.shape[2:])
      )
      for x in (bias, mask)
    )
  else:
    q, k, v = (_swap_heads_and_length(x) for x in (q, k, v))
  run = functools.partial(
    _dot_product_attention, scale=scale, is_causal=is_causal, implementation=implementation
  )
  mask_alone = mask is not None and bias is None and key_lengths is None and query_lengths is None
  if implementation == "cudnn" and mask_alone:  # a padding mask goes as its lengths
    implied_keys, implied_queries, is_padding = padding_lengths(mask, batch, q_len, k.shape[1])
    out = jax.lax.cond(
      is_padding,
      lambda q, k, v: run(q, k, v, None, None, implied_keys, implied_queries),
      lambda q, k, v: run(q, k, v, None, mask, None, None),
      q,
      k,
      v,
    )
  else:
    out = run(q, k, v, bias, mask, key_lengths, query_lengths)
  if per_head:
    return out.reshape((batch, heads, q_len, head_size))
  return _swap_heads_and_length(out)


def padding_lengths(mask, batch: int, q_len: int, kv_len: int) -> tuple:
  """``(key_lengths [B], query_lengths [B], is_padding [])``: the lengths a bool ``mask`` ``[B | 1,
  H | 1, q_len | 1, kv_len]`` implies (per example, how many keys some query sees and how many
  queries see some key), and whether the mask is exactly those prefixes under every head."""
  mask = jnp.broadcast_to(mask, (batch, mask.shape[1], q_len, kv_len))
  key_lengths = jnp.sum(jnp.any(mask, axis=(1, 2)), axis=-1, dtype=jnp.int32)
  query_lengths = jnp.sum(jnp.any(mask, axis=(1, 3)), axis=-1, dtype=jnp.int32)
  queries = jnp.arange(q_len)[None, :, None] < query_lengths[:, None, None]
  keys = jnp.arange(kv_len)[None, None, :] < key_lengths[:, None, None]
  return key_lengths, query_lengths, jnp.all(mask == (queries & keys)[:, None])


def _dot_product_attention(
  q, k, v, bias, mask, key_lengths, query_lengths, *, scale, is_causal, implementation
):
  """``attend``'s product once its rows are laid out length-major, ``q [N, q_len, H, d]``, ``k``/``v
  [N, kv_len, H, d]`` (a mask or bias ``[N | 1, H | 1, q_len, kv_len]``): ``[N, q_len, H, d_v]``
  (rows with no visible key 0)."""
  q_len, head_size = q.shape[1], v.shape[-1]
  seen = _rows_seeing_a_key(mask, key_lengths, query_lengths, q_len)
  lengths = {
    name: x
    for name, x in (("query_seq_lengths", query_lengths), ("key_value_seq_lengths", key_lengths))
    if x is not None
  }
  if implementation == "cudnn":
    q, k, v, bias, mask, lengths = _cudnn_operands(q, k, v, bias, mask, lengths)
  out = jax.nn.dot_product_attention(
    q,
    k,
    v,
    bias=bias,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    implementation=implementation,
    **lengths,
  )
  out = out[:, :q_len, :, :head_size]
  if seen is not None:
    out = jnp.where(seen, out, jnp.zeros((), out.dtype))
  return out


def _swap_heads_and_length(x):
  """``[N, H, L, d]`` <-> ``[N, L, H, d]``; a reshape where one of the two axes has size 1: no
  transpose in the program."""
  if 1 in x.shape[1:3]:
    return x.reshape(x.shape[0], x.shape[2], x.shape[1], x.shape[3])
  return jnp.swapaxes(x, 1, 2)
