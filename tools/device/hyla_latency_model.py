"""A latency model of HYLA's GPU launches on an H100, before the next kernel (#52, item 1).

A model, not a measurement: each launch's time from counts, an H100 SXM's datasheet rates and two
fitted constants, set beside the four committed H100 measurements (bfloat16 forward + backward,
B 1, H 8, d 64; ``benchmarks/results/device_suite_gpu-h100.md``) and used to predict the staged
kernel design of :mod:`primal_dual.kernels.hyla.staged`.

Terms of one launch (each in seconds; the launch is their max, "overlapped", or their sum,
"serial"):

* tensor: matrix FLOPs / the dense bfloat16 rate of the SMs that have work;
* issue: warp instructions / (4 schedulers × SMs × clock);
* shared: shared-memory bytes × bank-conflict factor / (128 B per clock per SM × SMs × clock);
* barrier: waves × loop iterations × barriers per iteration × ``stage_cycles`` / clock, waves
  being the programs over (SMs × programs resident per SM): a barrier-separated stage is a
  latency chain that programs resident on one SM overlap but no program shortens.

The Triton launches take their counts from the SASS of ``benchmarks/results/gpu_compile.json``
(ptxas's, not re-run). The XLA blockwise path is a chain of small kernels run one tile after
another (``lax.map``/``lax.scan`` over (N/128)² tiles, batch 1): per tile step, its matrix
products' FLOPs and bytes (counted from the jaxpr of ``hyla.blockwise``'s tile functions) and a
fixed cost per kernel, ``kernel_s``, fitted.

  python -m tools.device.hyla_latency_model --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from benchmarks import common
from primal_dual.kernels.hyla import mosaic

LENGTHS = (4096, 8192, 32768)
HEADS, HEAD_DIM, BATCH = 8, 64, 1

# Measured on one H100 80GB HBM3 (device_suite_gpu-h100.md), ms, bf16 forward + backward.
MEASURED_MS = {
  "tensorcore": {4096: 34.1, 8192: 131.0},
  "blockwise": {4096: 50.8, 8192: 199.0, 32768: 3140.0},
  "cudnn": {4096: 0.559, 8192: 1.31, 32768: 16.4},
}
# The figures each fitted constant is fitted to; every other measured figure is held out.
FITTED_ON = {"tensorcore": 8192, "blockwise": 8192}


class Device(NamedTuple):
  """An H100 SXM5's rates (datasheet: NVIDIA H100 Tensor Core GPU datasheet and the Hopper
  tuning guide)."""

  sms: int = 132
  clock_hz: float = 1.98e9  # boost clock, as tools/device/gpu_compile.py
  tensor_flops: float = 989e12  # dense bfloat16 (wgmma; mma.sync reaches less: a lower bound)
  schedulers_per_sm: int = 4  # one warp instruction per clock each
  lanes_per_sm: int = 128  # 4 × 32: thread-level ALU operations per clock
  shared_bytes_per_clock: int = 128  # per SM: 32 banks × 4 B
  hbm_bytes_per_s: float = 3.35e12
  flops_per_hmma: int = 2 * 16 * 8 * 16  # mma.m16n8k16


H100 = Device()


# --- One launch -----------------------------------------------------------------------------------


def launch_terms(
  *,
  programs: int,
  iterations: float,
  warps: int,
  resident: int,
  per_warp_iteration: Mapping[str, float],
  stage_cycles: float,
  conflict_factor: float = 1.0,
  device: Device = H100,
) -> dict[str, float]:
  """The four terms (seconds) of a Triton launch from SASS counts per warp per loop iteration
  (``hmma``, ``instructions``, ``shared_load``, ``shared_matrix_load``, ``shared_store``,
  ``barrier``).

  Shared bytes: an ``LDS``/``STS`` moves 32 lanes × 4 B (one 128 B wavefront; SASS gives no
  widths, so 32-bit is assumed), an ``LDSM`` (ldmatrix .x4) 512 B.
  """
  warp_iterations = programs * iterations * warps
  sms = min(device.sms, programs)
  flops = warp_iterations * per_warp_iteration["hmma"] * device.flops_per_hmma
  shared = per_warp_iteration["shared_load"] + per_warp_iteration["shared_store"]
  shared_bytes = warp_iterations * (128 * shared + 512 * per_warp_iteration["shared_matrix_load"])
  waves = math.ceil(programs / (device.sms * resident))
  stages = max(per_warp_iteration["barrier"], 1)
  return {
    "tensor": flops / (device.tensor_flops * sms / device.sms),
    "issue": warp_iterations
    * per_warp_iteration["instructions"]
    / (device.schedulers_per_sm * sms * device.clock_hz),
    "shared": shared_bytes
    * conflict_factor
    / (device.shared_bytes_per_clock * sms * device.clock_hz),
    "barrier": waves * iterations * stages * stage_cycles / device.clock_hz,
  }


def combine(terms: Mapping[str, float]) -> dict[str, float]:
  """``overlapped`` (the largest term), ``serial`` (their sum) and the ``bound`` term."""
  return {
    "overlapped": max(terms.values()),
    "serial": sum(terms.values()),
    "bound": max(terms, key=terms.get),
  }


# --- The tensorcore kernels' four-launch form (the measured one) ---------------------------------

# The measured form: tile 16, value chunk 16, warps 4 (forward) / 8 (dq, dk, dv). Its forward and
# dv launches are records of gpu_compile.json as they are; its dq launch is the dq_dk record of the
# same setting (the dq_dk launch has the dq launch's loop; tools/device/README.md), and its dk
# launch the same counts with 109 barriers per iteration, as tools/device/README.md gives it (no
# SASS record of it is committed).
FOUR_LAUNCH_SETTING = {"block_size": 16, "value_chunk": 16, "launch_warps": [4, 8, 8]}
FOUR_LAUNCHES = (("forward", "forward", None), ("dq", "dq_dk", None), ("dk", "dq_dk", 109))
FOUR_LAUNCHES += (("dv", "dv", None),)


def four_launch_records(compile_report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """The four launches' SASS figures at N = 8192 from the compile report (``mlp_relu``,
  ``rms_head``, bfloat16, not causal)."""
  found = {}
  for r in compile_report["records"]:
    if (
      r.get("family") == "tensorcore"
      and r.get("value_network") == "mlp_relu"
      and r.get("normalization") == "rms_head"
      and not r.get("causal")
      and r.get("operands", "bf16") == "bf16"
      and all(r.get(k) == v for k, v in FOUR_LAUNCH_SETTING.items())
      and "sass_iteration" in r
    ):
      found.setdefault(r["kernel"], r)
  records = {}
  for name, kernel, barriers in FOUR_LAUNCHES:
    r = found[kernel]
    counts = dict(r["sass_iteration"])
    if barriers is not None:
      counts["barrier"] = barriers
    records[name] = {
      "programs_8k": r["launch"]["programs"],
      "warps": r["num_warps"],
      "resident": r["programs_per_sm"],
      "counts": counts,
      "source": f"gpu_compile.json {kernel}" + ("" if barriers is None else ", BAR from README"),
    }
  return records


def tensorcore_launches(records, length: int, stage_cycles: float) -> dict[str, dict[str, Any]]:
  """Terms of each launch at ``length``: programs scale with N (query or key tiles × value
  chunks), the loop runs over N / 16 tiles (the compile report's shape is N = 8192)."""
  out = {}
  for name, r in records.items():
    terms = launch_terms(
      programs=max(1, round(r["programs_8k"] * length / 8192)),
      iterations=length / 16,
      warps=r["warps"],
      resident=r["resident"],
      per_warp_iteration=r["counts"],
      stage_cycles=stage_cycles,
    )
    out[name] = {"terms_ms": _ms(terms), **_ms(combine(terms))}
  return out


# --- The blockwise XLA path -----------------------------------------------------------------------

BLOCKWISE_TILE = 128  # hyla[block_size=128], the measured row


def blockwise_step_counts(tile: int = BLOCKWISE_TILE) -> dict[str, dict[str, float]]:
  """Per tile step of the forward and the backward loop of ``hyla.blockwise`` (``rms_head``,
  ``mlp_relu``, bfloat16 inputs): matrix products, their FLOPs and the bytes of their operands and
  results (each product a kernel that reads its operands from and writes its result to memory;
  the elementwise work fuses into them), from the jaxpr of the tile functions."""
  import jax
  import jax.numpy as jnp

  from primal_dual.kernels.hyla import blockwise as hb

  cfg = hb.Config(HEAD_DIM**-0.5, "rms_head", "mlp_relu", tile, tile, tile, tile, None, None)
  x = jax.ShapeDtypeStruct((HEADS, tile, HEAD_DIM), jnp.bfloat16)
  dout = jax.ShapeDtypeStruct((HEADS, tile, HEAD_DIM), jnp.float32)
  valid = jax.ShapeDtypeStruct((1, 1, 1), jnp.bool_)

  def forward(q, k, v, valid):
    return hb.tile_output(hb.tile_state(q, k, v, None, valid, cfg), v, cfg)

  def backward(q, k, v, dout, valid):
    return hb.tile_gradients(hb.tile_state(q, k, v, None, valid, cfg), q, k, v, dout, valid, cfg)

  counts = {}
  cases = (("forward", forward, (x, x, x, valid)), ("backward", backward, (x, x, x, dout, valid)))
  for name, fn, args in cases:
    dots = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "dot_general"]
    flops = nbytes = 0
    for e in dots:
      (contract, _), _ = e.params["dimension_numbers"]
      lhs = e.invars[0].aval
      out = e.outvars[0].aval
      flops += 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract)
      nbytes += sum(
        math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in (*e.invars, *e.outvars)
      )
    counts[name] = {"products": len(dots), "flops": flops, "bytes": nbytes}
  return counts


def blockwise_kernels(products: int) -> int:
  """Kernels of one tile step: each product, one elementwise fusion beside it (converts, scale,
  normalisation, relu, accumulation) and the loop's own step (an assumption, not counted from
  XLA's GPU fusion, which needs the GPU compiler)."""
  return 2 * products + 1


def blockwise_launches(step_counts, length: int, kernel_s: float, device=H100):
  """Terms of the forward and backward loops at ``length`` (serial: one kernel after another)."""
  steps = (length // BLOCKWISE_TILE) ** 2
  out = {}
  for name, c in step_counts.items():
    terms = {
      "tensor": steps * c["flops"] / device.tensor_flops,
      "memory": steps * c["bytes"] / device.hbm_bytes_per_s,
      "kernels": steps * blockwise_kernels(c["products"]) * kernel_s,
    }
    combined = combine(terms)
    combined["overlapped"] = combined["serial"]  # the kernels run one after another
    out[name] = {"terms_ms": _ms(terms), **_ms(combined)}
  return out


# --- The staged design of hyla.staged (issue #52) -------------------------------------------------


class StagedDesign(NamedTuple):
  """Per (query, key) pair counts of the staged design's forward pass (hyla.staged's tiling)."""

  q_tile: int = 64
  k_tile: int = 16
  # Matrix MACs per pair: S = H·D; z = K (heads, 8, padded to mma's 16) × d_v; out = d_v × H.
  macs: int = HEADS * HEAD_DIM + 16 * HEAD_DIM + HEAD_DIM * HEADS
  # Shared bytes per pair the stages move without conflicts: A-stage written once and read twice
  # (H bf16 each), U-stage written and read once (d_v bf16 each).
  shared_floor_bytes: int = 3 * 2 * HEADS + 2 * 2 * HEAD_DIM
  shared_bytes: tuple[float, float] = (1000.0, 1300.0)  # the issue's relayout estimate, low/high
  alu_ops: float = 370.0  # thread-level operations per pair (the issue's estimate)
  barriers_per_block: int = 3  # A-stage written, U-stage written, both free again
  resident: int = 1  # a 64 × d_v × H float32 accumulator (128 KiB) fills half the register file
  backward_factor: float = 11 / 3  # backward work / forward work (FLOPs of the present launches)


STAGED = StagedDesign()


def staged_prediction(length: int, stage_cycles: float, design=STAGED, device=H100):
  """Forward and backward of the staged design at ``length`` (batch 1): one program per 64
  queries (all heads), so ``N / 64`` programs; the backward scaled by ``backward_factor``.
  ``low``: overlapped terms, the issue's lower shared bytes; ``high``: serial terms, its upper."""
  programs = BATCH * length // design.q_tile
  sms = min(device.sms, programs)
  waves = math.ceil(programs / (device.sms * design.resident))
  pairs_per_program = design.q_tile * length
  busy = waves * pairs_per_program  # pairs one busy SM works through
  out = {}
  for bound, shared in (("low", design.shared_bytes[0]), ("high", design.shared_bytes[1])):
    terms = {
      "tensor": busy * 2 * design.macs / (device.tensor_flops / device.sms),
      "issue": busy * design.alu_ops / (device.lanes_per_sm * device.clock_hz),
      "shared": busy * shared / (device.shared_bytes_per_clock * device.clock_hz),
      "barrier": waves
      * (length / design.k_tile)
      * design.barriers_per_block
      * stage_cycles
      / device.clock_hz,
    }
    combined = combine(terms)
    forward = combined["overlapped"] if bound == "low" else combined["serial"]
    out[bound] = {
      "terms_ms": _ms(terms),
      "forward_ms": 1e3 * forward,
      "total_ms": 1e3 * forward * (1 + design.backward_factor),
      "bound": combined["bound"],
    }
  out["programs"], out["busy_sms"], out["waves"] = programs, sms, waves
  return out


# --- The Mosaic GPU forward kernel of hyla.mosaic (its first stage) ------------------------------


class MosaicForward(NamedTuple):
  """Counts of :mod:`primal_dual.kernels.hyla.mosaic`'s forward kernel, read off its code: one
  warpgroup (4 warps) per program of 64 queries × ``e_tile`` value columns, key blocks of 16,
  each loaded and waited for before it is used (no pipelining)."""

  q_tile: int = mosaic.Q_TILE
  k_tile: int = mosaic.K_TILE
  e_tile: int = 32
  # Thread-level operations per (query, key) pair and program, on the CUDA cores: per value
  # column, H FMAs for z, one max for relu and H FMAs for out (2H + 1); per head, the column
  # a_h[:, j] by a masked row sum over the block's 16 keys (a select and an add per element).
  column_ops_per_head: int = 2 * 16
  # The TMA round trip of an unpipelined key block (L2 hit latency, an assumption: ~700 cycles).
  load_cycles: float = 700.0
  warps: int = 4


MOSAIC_TILES = (64, 32)  # e_tile: one program per query tile, or two (fills the SMs at 4k)


def _blocked_launch(
  *, programs, blocks, pairs, ops_per_pair, tensor_flops, warps, load_cycles, device
) -> dict[str, float]:
  """A Mosaic launch whose programs loop over ``blocks`` blocks of ``pairs`` (query, key) pairs,
  each block ``pairs × ops_per_pair`` CUDA-core operations on ``warps`` warps and
  ``tensor_flops`` of tensor work, then an unhidden load; programs in waves of one per SM.
  Returns ``waves``, the per-block ``issue`` and ``tensor`` cycles, and ``seconds``."""
  waves = math.ceil(programs / device.sms)
  issue = pairs * ops_per_pair / 32 / min(warps, device.schedulers_per_sm)
  tensor = tensor_flops / (device.tensor_flops / device.sms / device.clock_hz)
  seconds = waves * blocks * (max(issue, tensor) + load_cycles) / device.clock_hz
  return {"waves": waves, "issue": issue, "tensor": tensor, "seconds": seconds}


def mosaic_forward_prediction(length: int, e_tile: int, device=H100) -> dict[str, Any]:
  """The forward kernel's time at ``length`` (batch 1, H 8, d 64): per program, key blocks ×
  (the larger of its tensor and issue cycles per block + the block's load latency), programs in
  waves of one per SM (its float32 accumulators, H·e_tile/2 registers per thread, leave no room
  for a second program). Registers and spills are not modelled: no SASS of it exists on the CPU."""
  design = MosaicForward(e_tile=e_tile)
  # The kernel pads the queries to whole tiles and the keys to whole blocks.
  programs = BATCH * math.ceil(length / design.q_tile) * (HEAD_DIM // e_tile)
  pairs = design.q_tile * design.k_tile  # per program per block
  launch = _blocked_launch(
    programs=programs,
    blocks=math.ceil(length / design.k_tile),
    pairs=pairs,
    ops_per_pair=(2 * HEADS + 1) * e_tile + HEADS * design.column_ops_per_head,
    tensor_flops=pairs * 2 * HEADS * HEAD_DIM,
    warps=design.warps,
    load_cycles=design.load_cycles,
    device=device,
  )
  forward_s = launch["seconds"]
  return {
    "e_tile": e_tile,
    "programs": programs,
    "waves": launch["waves"],
    "registers_for_accumulators": HEADS * e_tile * design.q_tile // 128,
    "cycles_per_block": {
      "issue": launch["issue"],
      "tensor": launch["tensor"],
      "load": design.load_cycles,
    },
    "forward_ms": 1e3 * forward_s,
    "vs_cudnn_fwd_bwd": None
    if length not in MEASURED_MS["cudnn"]
    else 1e3 * forward_s / MEASURED_MS["cudnn"][length],
  }


# --- A Mosaic GPU backward with the coupled products on CUDA cores (priced, not written) --------


class MosaicBackwardOnCudaCores(NamedTuple):
  """A backward in the forward kernel's style, priced before it is written: two launches, ``dq``
  (a program per 64 queries, looping over blocks of 16 keys) and ``dk_dv`` (a program per 64
  keys, looping over blocks of 16 queries), each program accumulating the gradients of a group of
  ``head_group`` heads (all eight do not fit: ``tools/device/README.md``) and so recomputing per
  pair what every head's ``ds`` needs (the scores couple the heads through the RMS, the value
  network through ``z``). Thread-level operations per (query, key) pair and program, with ``e``
  the value columns (all of them: ``da`` sums over ``e``):

  * recomputed: the columns ``a_h[:, j]`` (2·16 per head, as the forward), ``z`` (H·e), ``u``
    (e), ``du = Σ_h a_h g_h`` (H·e), ``dz`` (e), ``da_h = g_h·u + dz·v_h`` (2·H·e), ``ds`` from
    ``da`` through the RMS (``ds_h = r da_h − r³/H s_h Σ da·s``: 7 per head);
  * ``dk_dv`` only: ``dv`` of the group's heads (``head_group``·e);
  * on tensor cores: the scores of every head, and ``dq`` (or ``dk``) of the group's heads.
  """

  q_tile: int = mosaic.Q_TILE
  k_tile: int = mosaic.K_TILE
  head_group: int = 2
  column_ops_per_head: int = 2 * 16
  ds_ops_per_head: int = 7
  load_cycles: float = 700.0
  warps: int = 4


BACKWARD_HEAD_GROUPS = (1, 2)


def mosaic_backward_prediction(length: int, head_group: int, device=H100) -> dict[str, Any]:
  """Both launches' time at ``length`` (batch 1, H 8, d 64) in the forward's model (per program,
  blocks × (max(issue, tensor) + load) cycles, one program per SM), and the floor of any
  CUDA-core backward: one launch that computes each pair's coupled work once (no recompute, no
  register limit), at the forward's rate per operation."""
  design = MosaicBackwardOnCudaCores(head_group=head_group)
  e = HEAD_DIM
  recomputed = (
    HEADS * design.column_ops_per_head + (4 * HEADS + 2) * e + HEADS * design.ds_ops_per_head
  )
  ops_per_pair = {"dq": recomputed, "dk_dv": recomputed + head_group * e}
  pairs = design.q_tile * design.k_tile
  programs = BATCH * math.ceil(length / design.q_tile) * (HEADS // head_group)
  launches = {}
  for name, ops in ops_per_pair.items():
    launch = _blocked_launch(
      programs=programs,
      blocks=math.ceil(length / design.k_tile),
      pairs=pairs,
      ops_per_pair=ops,
      # The scores of every head, then the group's dq (or dk) by one product per head.
      tensor_flops=pairs * 2 * (HEADS + head_group) * HEAD_DIM,
      warps=design.warps,
      load_cycles=design.load_cycles,
      device=device,
    )
    launches[name] = {
      "ops_per_pair": ops,
      "issue_cycles_per_block": launch["issue"],
      "ms": 1e3 * launch["seconds"],
    }
  # Floor: every pair's coupled work once, spread over every SM's lanes.
  once = recomputed - HEADS * design.column_ops_per_head + HEADS * e  # + dv, no re-extraction
  floor_s = BATCH * length * length * once / (device.lanes_per_sm * device.sms * device.clock_hz)
  backward_ms = sum(v["ms"] for v in launches.values())
  forward_ms = min(mosaic_forward_prediction(length, t)["forward_ms"] for t in MOSAIC_TILES)
  cudnn = MEASURED_MS["cudnn"].get(length)
  return {
    "head_group": head_group,
    "programs_per_launch": programs,
    "waves": launch["waves"],
    # dq (or dk, and dv) of the group's heads, f32 [64, G, 64] each, plus a block's s, a and da
    # of every head ([64, 16] f32 per head, three of them), per thread of the warpgroup.
    "registers_for_accumulators": (2 * head_group * HEAD_DIM + 3 * HEADS * design.k_tile)
    * design.q_tile
    // 128,
    "launches": launches,
    "backward_ms": backward_ms,
    "forward_backward_ms": forward_ms + backward_ms,
    "vs_cudnn": None if cudnn is None else (forward_ms + backward_ms) / cudnn,
    "floor_backward_ms": 1e3 * floor_s,
    "floor_vs_cudnn": None if cudnn is None else (forward_ms + 1e3 * floor_s) / cudnn,
  }


# --- Fitting and the report -----------------------------------------------------------------------


def _ms(values: Mapping[str, Any]) -> dict[str, Any]:
  return {k: (1e3 * v if isinstance(v, float) else v) for k, v in values.items()}


def tensorcore_total_ms(records, length: int, stage_cycles: float, form: str = "overlapped"):
  return sum(v[form] for v in tensorcore_launches(records, length, stage_cycles).values())


def fit_stage_cycles(records, target_ms: float, length: int) -> float:
  """The barrier stage's cycles that make the overlapped four-launch total ``target_ms``
  (bisection: the total grows with it)."""
  lo, hi = 1.0, 10_000.0
  for _ in range(100):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if tensorcore_total_ms(records, length, mid) < target_ms else (lo, mid)
  return (lo + hi) / 2


def fit_kernel_s(step_counts, target_ms: float, length: int) -> float:
  """The per-kernel cost that makes the blockwise total ``target_ms`` (the total is linear)."""
  without = blockwise_launches(step_counts, length, 0.0)
  with_one = blockwise_launches(step_counts, length, 1e-6)
  base = sum(v["serial"] for v in without.values())
  slope = sum(v["serial"] for v in with_one.values()) - base
  return 1e-6 * (target_ms - base) / slope


def build_payload(compile_report: Mapping[str, Any], lengths=LENGTHS) -> dict[str, Any]:
  """Every prediction beside the measurements, the fitted constants and the device's rates."""
  records = four_launch_records(compile_report)
  step_counts = blockwise_step_counts()
  stage_cycles = fit_stage_cycles(
    records, MEASURED_MS["tensorcore"][FITTED_ON["tensorcore"]], FITTED_ON["tensorcore"]
  )
  kernel_s = fit_kernel_s(
    step_counts, MEASURED_MS["blockwise"][FITTED_ON["blockwise"]], FITTED_ON["blockwise"]
  )
  rows, launches, mosaic_rows, backward_rows = [], [], [], []
  for length in lengths:
    for kernel, per_launch in (
      ("tensorcore", tensorcore_launches(records, length, stage_cycles)),
      ("blockwise", blockwise_launches(step_counts, length, kernel_s)),
    ):
      for name, v in per_launch.items():
        launches.append({"kernel": kernel, "launch": name, "length": length, **v})
      predicted = sum(v["overlapped"] for v in per_launch.values())
      serial = sum(v["serial"] for v in per_launch.values())
      rows.append(_row(kernel, length, predicted, serial))
    staged = staged_prediction(length, stage_cycles)
    rows.append(_row("staged", length, staged["low"]["total_ms"], staged["high"]["total_ms"]))
    launches.append({"kernel": "staged", "launch": "forward+backward", "length": length, **staged})
    mosaic_rows.extend(
      mosaic_forward_prediction(length, e) | {"length": length} for e in MOSAIC_TILES
    )
    backward_rows.extend(
      mosaic_backward_prediction(length, g) | {"length": length} for g in BACKWARD_HEAD_GROUPS
    )
  return {
    "device": H100._asdict(),
    "fitted": {
      "stage_cycles": stage_cycles,
      "stage_cycles_fitted_on": f"tensorcore N={FITTED_ON['tensorcore']}",
      "kernel_us": 1e6 * kernel_s,
      "kernel_us_fitted_on": f"blockwise N={FITTED_ON['blockwise']}",
    },
    "staged_design": STAGED._asdict(),
    "blockwise_step": step_counts,
    "four_launch_records": records,
    "rows": rows,
    "launches": launches,
    "mosaic_forward": mosaic_rows,
    "mosaic_backward_on_cuda_cores": backward_rows,
  }


def _row(kernel: str, length: int, predicted: float, other: float) -> dict[str, Any]:
  measured = MEASURED_MS.get(kernel, {}).get(length)
  cudnn = MEASURED_MS["cudnn"].get(length)
  return {
    "kernel": kernel,
    "length": length,
    "predicted_ms": predicted,  # overlapped terms (staged: its low end)
    "predicted_other_ms": other,  # serial terms (staged: its high end)
    "measured_ms": measured,
    "ratio": None if measured is None else predicted / measured,
    "held_out": None if measured is None else FITTED_ON.get(kernel) != length,
    "vs_cudnn": None if cudnn is None else predicted / cudnn,
  }


def render(payload: Mapping[str, Any]) -> str:
  """The Markdown report of a payload (as read back from its JSON)."""
  fitted = payload["fitted"]
  f = common.format_ratio
  columns = (
    common.Column("kernel", "kernel"),
    common.Column("N", "length"),
    common.Column("predicted ms (overlapped / staged low)", "predicted_ms", f),
    common.Column("serial ms (staged high)", "predicted_other_ms", f),
    common.Column("measured ms (H100)", "measured_ms", f),
    common.Column("predicted / measured", "ratio", f),
    common.Column("held out", "held_out"),
    common.Column("/ cuDNN", "vs_cudnn", f),
  )
  launch_rows = []
  for r in payload["launches"]:
    if r["kernel"] == "staged":
      for bound in ("low", "high"):
        row = {**r, **r[bound]["terms_ms"], "launch": f"forward ({bound})"}
        launch_rows.append({**row, "ms": r[bound]["forward_ms"], "bound": r[bound]["bound"]})
    else:
      launch_rows.append({**r, **r["terms_ms"], "ms": r["overlapped"]})
  launch_columns = (
    common.Column("kernel", "kernel"),
    common.Column("launch", "launch"),
    common.Column("N", "length"),
    *(common.Column(f"{t} ms", t, f) for t in ("tensor", "issue", "shared", "memory")),
    *(common.Column(f"{t} ms", t, f) for t in ("barrier", "kernels")),
    common.Column("ms", "ms", f),
    common.Column("bound", "bound"),
  )
  mosaic_columns = (
    common.Column("N", "length"),
    common.Column("e_tile", "e_tile"),
    common.Column("programs", "programs"),
    common.Column("accumulator registers", "registers_for_accumulators"),
    common.Column("forward ms (predicted)", "forward_ms", f),
    common.Column("forward / cuDNN fwd+bwd", "vs_cudnn_fwd_bwd", f),
  )
  backward_columns = (
    common.Column("N", "length"),
    common.Column("head group", "head_group"),
    common.Column("programs per launch", "programs_per_launch"),
    common.Column("accumulator registers", "registers_for_accumulators"),
    common.Column("dq ms", "dq_ms", f),
    common.Column("dk_dv ms", "dk_dv_ms", f),
    common.Column("fwd+bwd ms", "forward_backward_ms", f),
    common.Column("/ cuDNN", "vs_cudnn", f),
    common.Column("floor: bwd ms", "floor_backward_ms", f),
    common.Column("floor: fwd+bwd / cuDNN", "floor_vs_cudnn", f),
  )
  backward_rows = [
    {**r, **{f"{name}_ms": v["ms"] for name, v in r["launches"].items()}}
    for r in payload["mosaic_backward_on_cuda_cores"]
  ]
  return "\n".join(
    [
      "# HYLA latency model (H100, bf16, forward + backward, B 1, H 8, d 64)",
      "",
      "A model, not a measurement (`tools/device/hyla_latency_model.py`). Fitted: "
      f"{fitted['stage_cycles']:.0f} cycles per barrier stage "
      f"({fitted['stage_cycles_fitted_on']}), "
      f"{fitted['kernel_us']:.2f} µs per XLA kernel ({fitted['kernel_us_fitted_on']}); every other "
      "rate is the H100 SXM datasheet's. `held out`: a measurement no constant was fitted to.",
      "",
      common.render_markdown_table(columns, payload["rows"]),
      "",
      "## Terms per launch (the staged design: forward only; its total multiplies by "
      f"{1 + payload['staged_design']['backward_factor']:.3g})",
      "",
      common.render_markdown_table(launch_columns, launch_rows),
      "",
      "## The Mosaic GPU forward kernel (`hyla/mosaic.py`, first stage: forward only, coupled "
      "products on CUDA cores, no pipelining)",
      "",
      "Per program: key blocks × (max(issue, tensor) + load) cycles; one program per SM. "
      "`accumulator registers`: per thread, before anything else (255 is the limit).",
      "",
      common.render_markdown_table(mosaic_columns, payload["mosaic_forward"]),
      "",
      "## A Mosaic GPU backward with the coupled products on CUDA cores (priced, not written)",
      "",
      "Two launches (`dq`; `dk_dv`) in the forward's model, each program the gradients of a "
      "group of heads, recomputing per pair the coupled work every head's `ds` needs, with the "
      "forward's best `e_tile` added. `floor`: one launch doing each pair's coupled work once "
      "on every SM's lanes, no register limit (any CUDA-core backward is slower).",
      "",
      common.render_markdown_table(backward_columns, backward_rows),
      "",
    ]
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  common.add_output_arguments(parser)
  parser.add_argument("--compile-report", default="benchmarks/results/gpu_compile.json")
  args = parser.parse_args(argv)
  payload = build_payload(json.loads(Path(args.compile_report).read_text()))
  paths = common.write_reports(args.out_dir, "hyla_latency_model", "cpu", payload, render)
  print(Path(paths["markdown"]).read_text())


if __name__ == "__main__":
  main()
