"""HYLA, hypernetwork linear attention (docs/maths.md §3.7): one public function,
:func:`hyla_attention`, over a table of implementations.

Modules: :mod:`.dense` (the formulas and the dense XLA path), :mod:`.blockwise` (the XLA tiles,
a recomputing custom VJP), :mod:`.tensorcore` (fused Triton kernels launched by jax-triton, the
``gpu-dev`` extra; the oracle of a planned Gluon kernel) and :mod:`.staged` (a pure-JAX emulation
of that kernel's tiling, issue #52: no implementation, imported by the latency model only) and
:mod:`.mosaic` (HYLA's forward pass as one Pallas Mosaic GPU kernel, a first stage: no backward
yet; ``'mosaic'`` below).

Implementations (:data:`IMPLEMENTATIONS`, name -> function, as in tokamax's ``api.py``):

* ``'xla'``: serves every call. ``block_size`` picks its path: ``'auto'`` (default) goes
  blockwise, with tiles of ``AUTO_BLOCK_SIZE``, when the call allows it (:func:`blockwise_blockers`)
  and there are at least ``AUTO_BLOCKWISE_MIN_PAIRS`` query-key pairs per example
  (``q_len·kv_len``: past it the dense ``[B, q_len, kv_len, D_v]`` tensor costs more time than the
  tiles, on CPU as measured), and dense otherwise (sRAVEN's and the fuzzy-logic task's short
  sequences stay dense); an int is blockwise with that tile (ValueError when the call does not
  allow it); None is dense. The blockwise path never stores ``u`` nor the scores (forward and
  backward memory linear in the length); it covers rms_head/none × every value network, masks,
  bias and causal, but not softmax normalisation, active dropout, or returned or sown weights.
* ``'tensorcore'``: :func:`.tensorcore.hyla_tensorcore_attention` (Triton's interpreter off GPU),
  the blockwise function with the kernels' own tile for ``block_size='auto'``; it refuses what
  the blockwise path refuses and ``block_size=None``.
* ``'mosaic'``: the forward pass by the Pallas Mosaic GPU kernel (:mod:`.mosaic`), the gradient
  by the blockwise path's recomputing backward on the same operands (the kernel has no backward
  yet): for evaluation and inference. NVIDIA GPUs only, bfloat16 operands, head size a multiple
  of 16, masks as lengths and ``is_causal`` only (:func:`mosaic_blockers`); not timed on a GPU yet.

``implementation='auto'`` (default) walks :data:`DEFAULT_ORDER` of ``jax.default_backend()`` and
takes the first implementation that serves the call (one that cannot raises :class:`Unsupported`
before any work); a name runs that implementation (ValueError for a call it cannot serve or an
unknown name). Every backend's order is ``('xla',)``: the tensorcore kernel is the faster one on an
H100 (131 against the blockwise 199 ms at 8k, bfloat16 fwd+bwd,
``benchmarks/results/device_suite_gpu-h100.md``) but its bfloat16 kernels are not yet shown right
on a GPU (``tensorcore.NATIVE_16BIT_ON_GPU``); a fused kernel goes first for ``'gpu'`` once a
committed H100 row shows it faster and right in bfloat16 at ≥ 1k tokens, citing that row here.
``tests/test_lowering.py`` lowers every implementation an order names for CUDA and TPU.
(The Pallas HYLA kernel was removed: Pallas's Triton backend is deprecated and it took 2,240 ms
at 8k on that H100, 17× the tensorcore kernel.)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import driver
from primal_dual.kernels.hyla import blockwise, dense
from primal_dual.kernels.hyla.dense import NORMALIZATIONS, RMS_EPS, VALUE_NETWORKS, hyla_scores

__all__ = [
  "AUTO_BLOCKWISE_MIN_PAIRS",
  "AUTO_BLOCK_SIZE",
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "NORMALIZATIONS",
  "RMS_EPS",
  "VALUE_NETWORKS",
  "Unsupported",
  "blockwise_blockers",
  "blockwise_tile",
  "default_order",
  "hyla_attention",
  "hyla_scores",
]

# block_size='auto': blockwise from this many query-key pairs per example, with this tile size.
AUTO_BLOCKWISE_MIN_PAIRS = 128 * 128
AUTO_BLOCK_SIZE = 64


class Unsupported(NotImplementedError):
  """Raised by an implementation, before any work, for a call it cannot serve (the reason as the
  message); ``implementation='auto'`` then tries the next one of the backend's order."""


def blockwise_blockers(call: driver.AttentionCall, normalization: str) -> list[str]:
  """What keeps a ``hyla_attention`` call off the tiled paths (empty: it can run blockwise).

  Softmax normalises over keys (it would need running statistics), dropout and returned or sown
  weights need the whole ``[H, q_len, kv_len]`` weights.
  """
  return [
    reason
    for reason, present in (
      (f"normalization={normalization!r}", normalization not in blockwise.NORMALIZATIONS),
      ("dropout on the weights", call.dropout_active),
      ("sowing weights (module given)", call.module is not None),
      ("return_weights=True", call.return_weights),
    )
    if present
  ]


def blockwise_tile(call: driver.AttentionCall, normalization: str, block_size) -> int | None:
  """The tile size of the blockwise path for ``block_size`` (see the module docstring), or None
  for the dense path.

  Raises:
    ValueError: ``block_size`` not ``'auto'``, None or a positive int; an int for a call the
      blockwise path cannot serve.
  """
  if block_size is None:
    return None
  blockers = blockwise_blockers(call, normalization)
  if block_size == "auto":
    pairs = call.shapes.q_len * call.shapes.kv_len
    return AUTO_BLOCK_SIZE if pairs >= AUTO_BLOCKWISE_MIN_PAIRS and not blockers else None
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f"block_size must be 'auto', a positive int or None; got {block_size!r}")
  if blockers:
    raise ValueError(
      f"block_size={block_size} runs blockwise, which cannot serve this call "
      f"({', '.join(blockers)}); use block_size='auto' or None"
    )
  return block_size


def _tiled(attend: Callable, call: driver.AttentionCall, tile: int | None, **options):
  """``attend`` (a tiled entry point: blockwise or tensorcore) on ``call``; ``tile`` None: the
  kernel's default tile."""
  return attend(
    call.query,
    call.key,
    call.value,
    call.bias,
    call.mask,
    **({} if tile is None else {"block_size": tile}),
    is_causal=call.is_causal,
    causal_alignment=call.causal_alignment,
    dtype=call.dtype,
    precision=call.precision,
    **options,
  )


# --- The implementations: (call, *, normalization, value_network, query_chunk_size, scale,
# block_size) -> output, options already validated; Unsupported for a call they cannot serve. ---


def xla_attention(call, *, normalization, value_network, query_chunk_size, scale, block_size):
  """The XLA paths: blockwise (:func:`.blockwise.hyla_blockwise_attention`) or dense
  (:func:`.dense.dense_attention`), as :func:`blockwise_tile` picks; serves every call."""
  tile = blockwise_tile(call, normalization, block_size)
  if tile is None:
    return dense.dense_attention(
      call,
      normalization=normalization,
      value_network=value_network,
      query_chunk_size=query_chunk_size,
      scale=scale,
    )
  return _tiled(
    blockwise.hyla_blockwise_attention,
    call,
    tile,
    normalization=normalization,
    value_network=value_network,
    scale=scale,
  )


def tensorcore_attention(
  call, *, normalization, value_network, query_chunk_size, scale, block_size
):
  """:func:`.tensorcore.hyla_tensorcore_attention`, the module imported on first use (it needs
  Triton, the ``gpu-dev`` extra); ``query_chunk_size`` does not apply to tiles."""
  del query_chunk_size
  reasons = blockwise_blockers(call, normalization)
  if block_size is None:
    reasons.append("block_size=None asks for the dense path")
  if reasons:
    raise Unsupported(", ".join(reasons))
  tile = None if block_size == "auto" else blockwise_tile(call, normalization, block_size)
  from primal_dual.kernels.hyla import tensorcore

  return _tiled(
    tensorcore.hyla_tensorcore_attention,
    call,
    tile,
    normalization=normalization,
    value_network=value_network,
    scale=scale,
  )


def mosaic_blockers(call: driver.AttentionCall, normalization: str) -> list[str]:
  """What keeps a call off the Mosaic GPU forward kernel (empty: it serves the call)."""
  reasons = blockwise_blockers(call, normalization)
  if jax.default_backend() != "gpu":
    reasons.append("it runs on NVIDIA GPUs (off GPU, JAX's interpreter runs it in the tests)")
  if call.bias is not None:
    reasons.append("a bias")
  if call.mask is not None and not call.lengths_only:
    reasons.append("a mask (lengths and is_causal are served)")
  if call.query.dtype != jnp.bfloat16 or call.key.dtype != jnp.bfloat16:
    reasons.append("operands other than bfloat16 (the kernel's)")
  if call.shapes.d_qk % 16:
    reasons.append(f"a head size {call.shapes.d_qk} that is not a multiple of 16")
  return reasons


def mosaic_attention(call, *, normalization, value_network, query_chunk_size, scale, block_size):
  """The forward pass by the Mosaic GPU kernel (:mod:`.mosaic`), its gradient by the blockwise
  path's recomputing backward (the kernel has no backward yet): fast where only the forward runs
  (evaluation, inference). ``query_chunk_size`` and ``block_size`` do not apply."""
  del query_chunk_size, block_size
  reasons = mosaic_blockers(call, normalization)
  if reasons:
    raise Unsupported(", ".join(reasons))
  return mosaic_forward_blockwise_backward(
    call.query,
    call.key,
    call.value,
    call.key_value_seq_lengths,
    call.query_seq_lengths,
    is_causal=call.is_causal,
    causal_alignment=call.causal_alignment,
    normalization=normalization,
    value_network=value_network,
    scale=scale,
  ).astype(call.dtype)


def mosaic_forward_blockwise_backward(
  query, key, value, key_lengths=None, query_lengths=None, *, interpret=None, **options
):
  """``[batch..., q_len, H, d_v]`` float32 by :func:`.mosaic.hyla_mosaic_forward` (batch axes
  flattened), differentiable in q, k and v through :func:`.blockwise.hyla_blockwise_attention`
  on the same bfloat16 operands and masks. ``options``: ``is_causal``, ``causal_alignment``,
  ``normalization``, ``value_network``, ``scale``; ``interpret`` as the kernel's."""
  from primal_dual.kernels.hyla import mosaic

  batch_shape = query.shape[:-3]
  key_lengths, query_lengths = (
    None if x is None else jnp.broadcast_to(jnp.asarray(x), batch_shape)
    for x in (key_lengths, query_lengths)
  )

  def forward(q, k, v):
    flat = (x.reshape(-1, *x.shape[-3:]) for x in (q, k, v))
    lengths = {
      name: None if x is None else x.reshape(-1)
      for name, x in (("key_lengths", key_lengths), ("query_lengths", query_lengths))
    }
    out = mosaic.hyla_mosaic_forward(*flat, **lengths, **options, interpret=interpret)
    return out.reshape(*batch_shape, *out.shape[1:])

  def reference(q, k, v):
    mask = C.lengths_mask(query_lengths, key_lengths, C.validate_qkv(q, k, v))
    return blockwise.hyla_blockwise_attention(
      q, k, v, None, mask, block_size=AUTO_BLOCK_SIZE, dtype=jnp.float32, **options
    )

  @jax.custom_vjp
  def attend(q, k, v):
    return forward(q, k, v)

  def attend_forward(q, k, v):
    return forward(q, k, v), (q, k, v)

  def attend_backward(operands, cotangent):
    return jax.vjp(reference, *operands)[1](cotangent)

  attend.defvjp(attend_forward, attend_backward)
  return attend(query, key, value)


IMPLEMENTATIONS: dict[str, Callable] = {
  "xla": xla_attention,
  "tensorcore": tensorcore_attention,
  "mosaic": mosaic_attention,
}

# What implementation='auto' tries, first to last, per jax.default_backend() (module docstring);
# a backend not listed gets FALLBACK_ORDER.
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("xla",),
  "gpu": ("xla",),
  "tpu": ("xla",),
}
FALLBACK_ORDER = ("xla",)


def default_order(backend: str | None = None) -> tuple[str, ...]:
  """The implementations ``'auto'`` tries on ``backend`` (default: ``jax.default_backend()``)."""
  return DEFAULT_ORDER.get(jax.default_backend() if backend is None else backend, FALLBACK_ORDER)


@driver.attention_kernel
def hyla_attention(
  call: driver.AttentionCall,
  *,
  normalization: str = "rms_head",
  value_network: str = "mlp_relu",
  query_chunk_size: int | None = None,
  scale: float | None = None,
  block_size: int | str | None = "auto",
  implementation: str = "auto",
):
  """HYLA attention (docs/maths.md §3.7; formulas in :mod:`.dense`).

  Scale: the value network sums over keys without dividing by their number (the scores are
  normalised across heads, not over keys), so the output grows about as √kv_len for unit-variance
  inputs: its RMS is 5.6, 12.1, 22.2 and 43.4 at 16, 64, 256 and 1024 keys (4 heads, d 16,
  standard normal q, k, v), while softmax's falls. The models follow it with a residual and a
  normalisation layer; a standalone use may rescale.

  Args:
    query, key, value, bias, mask and Flax's other ``attention_fn`` arguments: see
      :class:`driver.AttentionCall`.
    key, value: as many heads as the query (no grouped heads); d_v is shared by all heads (the
      value network sums over heads).
    bias, mask: on the scores ``s``; masked scores are 0, so a fully masked query gets a zero
      output (with finite gradients).
    broadcast_dropout, dropout_rng, dropout_rate, deterministic: applied once to the normalised
      scores ``a``; the dropped ``a`` is used both in the value network and in the read-out.
    module, return_weights: sow / return ``a`` (before dropout) as the weights.
    normalization: ``'rms_head'`` (default; ``s / √(mean_h s² + 1e-6)`` across heads),
      ``'softmax'`` (standard masked softmax over keys, per head) or ``'none'`` (``a = s``).
    value_network: ``'mlp_relu'`` (default), ``'mlp_linear'`` (no relu) or ``'linear'``
      (``Σ_j a_hij v_hj``).
    query_chunk_size: if set, the dense path runs the value network over query blocks of this
      size (same result, ``[B, c, kv_len, d_v]`` peak memory for ``u``); q_len need not be a
      multiple of it.
    scale: score scale, default ``1/√d_qk``.
    block_size: ``'auto'`` (default), an int tile or None (dense): see ``'xla'`` in the module
      docstring. Dense and blockwise agree to float rounding; the blockwise path holds no
      ``[q_len, kv_len]``-sized tensor in the forward or backward pass.
    implementation: ``'auto'`` (default: the first of the backend's :data:`DEFAULT_ORDER` that
      serves the call) or a key of :data:`IMPLEMENTATIONS` (``'xla'``, ``'tensorcore'``).

  Returns:
    ``[batch..., q_len, heads, d_v]`` in ``dtype`` (and ``a`` if requested).

  Raises:
    ValueError: bad shapes (naming them), grouped key/value heads (fewer than the query heads),
      unknown ``normalization``/``value_network``/``implementation`` (naming the known ones), a
      ``query_chunk_size`` below 1, a bad ``block_size`` or an int one for a call only the dense
      path serves, a named implementation that cannot serve the call.
  """
  # Flax's value layout [..., kv_len, heads, d_v] gives every head the same d_v, which the
  # head sum of the value network needs; validate_qkv rejects any other head split of value.
  C.refuse_grouped_heads(
    call.shapes,
    "hyla_attention",
    "its value network sums the values over heads with per-head weights",
  )
  C.lookup(NORMALIZATIONS, normalization, "normalization")
  C.lookup(VALUE_NETWORKS, value_network, "value_network")
  if query_chunk_size is not None and (
    not isinstance(query_chunk_size, int) or query_chunk_size < 1
  ):
    raise ValueError(f"query_chunk_size must be a positive int or None; got {query_chunk_size!r}")
  if implementation != "auto" and implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be 'auto' or one of {sorted(IMPLEMENTATIONS)}; got "
      f"implementation={implementation!r}"
    )
  options = dict(
    normalization=normalization,
    value_network=value_network,
    query_chunk_size=query_chunk_size,
    scale=scale,
    block_size=block_size,
  )
  names = default_order() if implementation == "auto" else (implementation,)
  refusals = []
  for name in names:
    try:
      return IMPLEMENTATIONS[name](call, **options)
    except Unsupported as refusal:
      refusals.append(f"implementation={name!r} cannot serve this call ({refusal})")
  hint = "; use implementation='auto' or 'xla'" if implementation != "auto" else ""
  raise ValueError("; ".join(refusals) + hint)
