"""HYLA's forward pass as one Pallas Mosaic GPU kernel (issue #52, item 2: a first stage).

Formulas: :mod:`.dense`. With heads ``h``, queries ``i``, keys ``j``, value columns ``e``::

  s_hij  = c q_hi·k_hj
  a_hij  = s_hij (mean_h s_hij² + 1e-6)^(-1/2)   (rms_head)  |  s_hij  (none)
  z_ije  = Σ_h a_hij v_jhe
  u_ije  = relu(z_ije) (mlp_relu)  |  z_ije (mlp_linear)
  out_hie = Σ_j a_hij u_ije                       (value_network='linear': Σ_j a_hij v_jhe)

**Why Mosaic GPU, not Gluon.** Both give explicit shared memory and layouts, which the ``tl.dot``
kernel of :mod:`.tensorcore` lacks. Mosaic GPU is JAX's maintained GPU route: JAX launches it
(no jax-triton, no torch), it lowers for CUDA on a machine without a GPU (tested), and JAX carries
a GPU interpreter for it that runs this module's own kernel code on the CPU
(:mod:`primal_dual.kernels.mosaic_interpreter` fills the gaps of jax 0.10.2's). Gluon has no
interpreter in Triton 3.9.0 (``gluon.jit`` makes a ``GluonJITFunction`` whatever
``TRITON_INTERPRET`` says), so a Gluon kernel could not be checked here before a GPU runs it. What
Mosaic GPU costs: no SASS on the CPU (its PTX is made by the CUDA plugin at compile time), so
registers and spills are known only on a GPU.

**The tiling (this stage).** One program (CTA, one warpgroup) per (example, 64 queries, ``e_tile``
value columns); it loops over the keys in blocks of 16:

1. ``S_h = q_h k_hᵀ`` per head by ``wgmma`` (m64 n16 k``D``; bfloat16 operands from shared memory,
   float32 accumulation). ``k`` comes in transposed (``[B, H, D, N]``, one XLA transpose outside
   the kernel) so that both operands are in their natural majorness.
2. the RMS across heads in registers (float32).
3. per key ``j`` (unrolled): the column ``a_h[:, j]`` of every head by a masked row sum (no trip
   through shared memory: the interpreter and the lowering both take it), ``z = Σ_h a_h[:, j] ⊗
   v_jh`` and ``out_h += a_h[:, j] ⊗ u`` as float32 outer-product updates on the CUDA cores. The
   value network's 2·H·e_tile FMAs per (query, key) pair are not on tensor cores in this stage:
   the issue's design moves them there with a shared-memory relayout; the latency model
   (``tools/device/hyla_latency_model.py``) prices both.

Masking: per-example key and query lengths and causality (both alignments) make a hidden pair's
score 0 under every head (so its ``a``, ``z`` and ``u`` are 0, as ``hyla_attention`` under the
equivalent mask), and the key blocks past an example's keys or a tile's last visible key are
skipped. Lengths that are not multiples of the tiles are zero-padded outside the kernel: a padded
key has ``s = 0`` under every head and adds exactly nothing; padded queries are dropped.

``hyla_attention(..., implementation='mosaic')`` runs it, with the blockwise path's gradient.
Not in this stage: the backward pass (``tools/device/README.md`` shows why none fits one CTA as
simply, and the latency model prices one with the coupled products on CUDA cores at 35–68×
cuDNN at 8k, its floor 6.5×: a backward needs them on tensor cores), general masks, bias,
pipelined loads (each key block is loaded, waited for and used), and bfloat16 stages of ``a`` and
``u`` (held in float32 here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels.hyla.dense import RMS_EPS
from primal_dual.kernels.hyla.staged import pad_to

Q_TILE = 64  # queries per program: one wgmma's M
K_TILE = 16  # keys per block: one bfloat16 wgmma's N (and K granularity)
NORMALIZATIONS = ("rms_head", "none")
VALUE_NETWORKS = ("mlp_relu", "mlp_linear", "linear")
F32 = jnp.float32


def _key_block(
  q_smem, kt_smem, v_smem, out, visible, *, heads, scale, normalization, value_network
):
  """Stages 1–3 of the module docstring for one block of ``K_TILE`` keys.

  Args:
    q_smem: ``[H, 64, D]`` bfloat16 (this program's queries). kt_smem: ``[H, D, 16]`` bfloat16.
    v_smem: ``[16, H, e_tile]`` bfloat16. out: a tuple of ``H`` float32 ``[64, e_tile]`` arrays.
    visible: bool ``[64, 16]`` (which query sees which key), or None (all).

  Returns:
    the updated ``out``.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  rows = plgpu.Layout.WGMMA.reduce(1)
  columns = plgpu.Layout.WGMMA.reduce(0)
  e_tile = v_smem.shape[-1]

  def scores(acc_ref, h):
    plgpu.wgmma(acc_ref, q_smem.at[h], kt_smem.at[h])
    return acc_ref[...]

  s = [
    pl.run_scoped(functools.partial(scores, h=h), plgpu.ACC((Q_TILE, K_TILE), F32)) * scale
    for h in range(heads)
  ]
  if visible is not None:  # a hidden pair's score is 0 under every head, so its a, z and u are 0
    s = [jnp.where(visible, x, 0.0) for x in s]
  if normalization == "rms_head":
    inverse_rms = jax.lax.rsqrt(sum(x * x for x in s) * (1.0 / heads) + RMS_EPS)
    s = [x * inverse_rms for x in s]
  key_index = plgpu.broadcasted_iota(jnp.int32, (Q_TILE, K_TILE), 1, layout=plgpu.Layout.WGMMA)
  shape = (Q_TILE, e_tile)
  for j in range(K_TILE):
    # a_h[:, j] as a vector over the queries: a masked row sum stays in registers.
    a_j = [jnp.sum(jnp.where(key_index == j, x, 0.0), axis=1) for x in s]
    a_j = [jax.lax.broadcast_in_dim(plgpu.layout_cast(c, rows), shape, [0]) for c in a_j]
    v_j = [
      jax.lax.broadcast_in_dim(plgpu.layout_cast(v_smem[j, h], columns).astype(F32), shape, [1])
      for h in range(heads)
    ]
    if value_network == "linear":
      out = tuple(o + a * v for o, a, v in zip(out, a_j, v_j))
      continue
    z = sum(a * v for a, v in zip(a_j, v_j))
    u = jnp.maximum(z, 0.0) if value_network == "mlp_relu" else z
    out = tuple(o + a * u for o, a in zip(out, a_j))
  return out


def _kernel(
  q_gmem,
  kt_gmem,
  v_gmem,
  bounds_gmem,
  out_gmem,
  q_smem,
  kt_smem,
  v_smem,
  out_smem,
  q_ready,
  block_ready,
  *,
  config,
):
  """One program: (example, query tile, value-column tile); loops over the key blocks."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  heads, key_blocks, e_tile = config["heads"], config["key_blocks"], config["e_tile"]
  example = jax.lax.axis_index("example")
  first_query = jax.lax.axis_index("query_tile") * Q_TILE
  queries = pl.ds(first_query, Q_TILE)
  columns = pl.ds(jax.lax.axis_index("value_tile") * e_tile, e_tile)
  for h in range(heads):
    plgpu.copy_gmem_to_smem(q_gmem.at[example, queries, h], q_smem.at[h], q_ready.at[0])
  plgpu.barrier_wait(q_ready.at[0])
  out = tuple(plgpu.layout_cast(jnp.zeros((Q_TILE, e_tile), F32), plgpu.Layout.WGMMA)
              for _ in range(heads))  # fmt: skip

  key_length, query_length = bounds_gmem[example, 0], bounds_gmem[example, 1]
  causal_offset = config["causal_offset"]
  wgmma = plgpu.Layout.WGMMA
  query_position = first_query + plgpu.broadcasted_iota(
    jnp.int32, (Q_TILE, K_TILE), 0, layout=wgmma
  )
  key_offset = plgpu.broadcasted_iota(jnp.int32, (Q_TILE, K_TILE), 1, layout=wgmma)
  # Blocks past the example's keys (and, causal, past the tile's last visible key) are skipped,
  # all of them for a tile past the example's queries.
  last_key = jnp.where(first_query < query_length, key_length, 0)
  if causal_offset is not None:
    last_key = jnp.minimum(last_key, first_query + Q_TILE + causal_offset)
  blocks = jnp.clip((last_key + K_TILE - 1) // K_TILE, 0, key_blocks)

  def body(block, out):
    keys = pl.ds(block * K_TILE, K_TILE)
    visible = None  # no lengths and no causality: every key of the block is visible
    if config["masked"]:
      key_position = block * K_TILE + key_offset
      visible = (key_position < key_length) & (query_position < query_length)
      if causal_offset is not None:
        visible = visible & (key_position <= query_position + causal_offset)
    for h in range(heads):
      plgpu.copy_gmem_to_smem(kt_gmem.at[example, h, :, keys], kt_smem.at[h], block_ready.at[0])
    plgpu.copy_gmem_to_smem(v_gmem.at[example, keys, :, columns], v_smem, block_ready.at[0])
    plgpu.barrier_wait(block_ready.at[0])
    return _key_block(
      q_smem,
      kt_smem,
      v_smem,
      out,
      visible,
      heads=heads,
      scale=config["scale"],
      normalization=config["normalization"],
      value_network=config["value_network"],
    )

  out = jax.lax.fori_loop(0, blocks, body, out)
  for h in range(heads):
    out_smem[h] = out[h]
  plgpu.commit_smem()
  for h in range(heads):
    plgpu.copy_smem_to_gmem(out_smem.at[h], out_gmem.at[example, queries, h, columns])
  plgpu.wait_smem_to_gmem(0)


def hyla_mosaic_forward(
  query,
  key,
  value,
  *,
  normalization: str = "rms_head",
  value_network: str = "mlp_relu",
  scale: float | None = None,
  key_lengths=None,
  query_lengths=None,
  is_causal: bool = False,
  causal_alignment: str = "top_left",
  e_tile: int | None = None,
  interpret=None,
):
  """HYLA's forward pass by the Mosaic GPU kernel (module docstring).

  Args:
    query: ``[B, q_len, H, D]``. key: ``[B, kv_len, H, D]``. value: ``[B, kv_len, H, d_v]``
      (Flax's layout); rounded to bfloat16 (the kernel's operands).
    normalization: ``'rms_head'`` or ``'none'``. value_network: ``'mlp_relu'``,
      ``'mlp_linear'`` or ``'linear'``.
    scale: multiplies ``qᵀk``; default ``1/√D``.
    key_lengths, query_lengths: int ``[B]`` or None: each example's valid keys and queries (a
      prefix); a hidden pair's score is 0 (as ``hyla_attention`` under the equivalent mask), a
      query past its length gets zeros. Key blocks past an example's keys are skipped.
    is_causal: key ``j`` visible to query ``i`` iff ``j <= i`` (``causal_alignment='top_left'``)
      or ``j <= i + kv_len - q_len`` (``'bottom_right'``); blocks past the last visible key skipped.
    e_tile: value columns per program (``d_v`` by default; a divisor of ``d_v``, a multiple of 8).
    interpret: None on a GPU; ``mosaic_interpreter.params()`` runs the kernel's code on the CPU.

  Returns:
    float32 ``[B, q_len, H, d_v]``.

  Raises:
    ValueError: an unsupported option or mismatched shapes (naming them).
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if normalization not in NORMALIZATIONS or value_network not in VALUE_NETWORKS:
    raise ValueError(
      f"hyla_mosaic_forward covers normalization in {NORMALIZATIONS} and value_network in "
      f"{VALUE_NETWORKS}; got {normalization!r}, {value_network!r}"
    )
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(f"expected 4-D [B, len, H, dim] operands; got q {query.shape}, "
                     f"k {key.shape}, v {value.shape}")  # fmt: skip
  batch, q_len, heads, d_qk = query.shape
  if key.shape[0] != batch or key.shape[2:] != (heads, d_qk) or value.shape[:3] != key.shape[:3]:
    raise ValueError(f"shapes do not match: q {query.shape}, k {key.shape}, v {value.shape}")
  d_v, kv_len = value.shape[-1], key.shape[1]
  offset = C.causal_offset(causal_alignment, q_len, kv_len)  # ValueError for an unknown name
  e_tile = d_v if e_tile is None else e_tile
  if d_qk % 16 or d_v % e_tile or e_tile % 8:
    raise ValueError(
      f"the kernel needs D a multiple of 16 and e_tile a multiple of 8 dividing d_v; got "
      f"q {query.shape}, v {value.shape}, e_tile {e_tile}"
    )
  scale = d_qk**-0.5 if scale is None else scale
  q = pad_to(query.astype(jnp.bfloat16), 1, Q_TILE)
  k = pad_to(key.astype(jnp.bfloat16), 1, K_TILE)
  v = pad_to(value.astype(jnp.bfloat16), 1, K_TILE)
  kt = jnp.transpose(k, (0, 2, 3, 1))  # [B, H, D, N]: the wgmma's B operand in its natural order
  # Per example (key length, query length); int32 [B, 2], read by each program.
  bounds = jnp.stack(
    [
      jnp.broadcast_to(jnp.asarray(kv_len if key_lengths is None else key_lengths), (batch,)),
      jnp.broadcast_to(jnp.asarray(q_len if query_lengths is None else query_lengths), (batch,)),
    ],
    axis=1,
  ).astype(jnp.int32)
  causal_offset = offset if is_causal else None
  q_tiles, key_blocks = q.shape[1] // Q_TILE, k.shape[1] // K_TILE
  # 32-byte swizzle: the key block's 16 bfloat16 columns are 32 bytes, and wgmma wants one swizzle
  # on both operands.
  transforms = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
  config = dict(
    heads=heads,
    key_blocks=key_blocks,
    e_tile=e_tile,
    scale=scale,
    normalization=normalization,
    value_network=value_network,
    causal_offset=causal_offset,
    # The padding to whole tiles needs no mask (its scores are 0); lengths and causality do.
    masked=is_causal or key_lengths is not None or query_lengths is not None,
  )
  call = plgpu.kernel(
    functools.partial(_kernel, config=config),
    out_type=jax.ShapeDtypeStruct((batch, q.shape[1], heads, d_v), F32),
    scratch_types=[
      plgpu.SMEM((heads, Q_TILE, d_qk), jnp.bfloat16, transforms=transforms),
      plgpu.SMEM((heads, d_qk, K_TILE), jnp.bfloat16, transforms=transforms),
      plgpu.SMEM((K_TILE, heads, e_tile), jnp.bfloat16),
      plgpu.SMEM((heads, Q_TILE, e_tile), F32),
      # The queries arrive by H copies; a key block by H + 1, its barrier reused every block.
      plgpu.Barrier(num_arrivals=heads, num_barriers=1),
      plgpu.Barrier(num_arrivals=heads + 1, num_barriers=1),
    ],
    grid=(batch, q_tiles, d_v // e_tile),
    grid_names=("example", "query_tile", "value_tile"),
    interpret=interpret,
  )
  return call(q, kt, v, bounds)[:, :q_len]
