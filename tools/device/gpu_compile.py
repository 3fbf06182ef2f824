"""What ptxas makes of the project's GPU kernels for an H100 (sm_90a), on a machine without a GPU.

Each family of GPU kernels is compiled for CUDA capability 9.0 (``sm_90a``) over its settings,
each kernel by the ``triton`` wheel (``pip install -e ".[gpu-dev]"``) for
``GPUTarget("cuda", 90, 32)``. One family today:

* ``tensorcore``: the three launches (``forward``, ``dq_dk``, ``dv``) of the fused Triton HYLA
  kernels of ``primal_dual/kernels/hyla/tensorcore.py`` (``implementation='tensorcore'``): each
  ``@triton.jit`` function compiled from its source with the constexpr constants of a call.

(The Pallas HYLA kernels, a second family, were removed with their kernel: Pallas's Triton backend
is deprecated and the kernel was 17× slower than the tensorcore one on an H100.)

For each kernel: registers, spill stores/loads, stack frame and static shared memory from the
``ptxas -v`` log of the compilation Triton itself runs (so the figures are those of the cubin it
produces), dynamic shared memory from Triton's metadata, and instruction counts of the SASS
(``cuobjdump -sass`` of that cubin): matrix instructions (``HGMMA``: wgmma, ``HMMA``: mma.sync)
beside ``FFMA`` and local-memory loads/stores (``LDL``/``STL``), over the whole kernel and over
its main loop (from the target of the last backward branch to that branch: the tile loop with the
loops nested in it); the PTX counts too.

ptxas can take tens of GiB on large tiles, so every compilation runs in its own process group with
its address space capped (``RLIMIT_AS``, ``--memory-cap-gib``) and a wall-clock limit
(``--timeout-s``); a capped, timed-out or failing compilation is recorded with ``status`` and
``reason``, never fatal. The targets per kernel: 0 spill bytes, at most 227 KiB of shared memory
per block, and the coupled products on the matrix units (more matrix instructions than ``FFMA`` in
the main loop). One report, rewritten after each setting, has a section per family.

Where a family knows its launches' grids (``tensorcore``), the report adds a time estimate per
launch at the family's shape (:func:`time_estimate`: a model of the SASS, not a measurement): the
SASS counts of one main-loop iteration (nested loops once per trip), the programs an SM holds at
once, and the larger of an issue bound and a latency bound (barrier-separated stages per iteration
× ``STAGE_CYCLES``, fitted to the one H100 measurement of these kernels).

  python -m tools.device.gpu_compile                      # writes benchmarks/results/gpu_compile.*
  python -m tools.device.gpu_compile --families tensorcore --tiles 16 --out-dir /tmp/gc
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
ARCH = "sm_90a"
CAPABILITY = 90
# An H100's shared memory per block (227 KiB usable of its 228 KiB).
SHARED_MEMORY_LIMIT_BYTES = 227 * 1024


class Shape(NamedTuple):
  """q, k, v are bfloat16 ``[batch, length, heads, head_dim]``."""

  batch: int = 1
  length: int = 1024
  heads: int = 8
  head_dim: int = 64


class CompileJob(NamedTuple):
  """One kernel to compile: its name, its source for the worker (``{"module", "function",
  "constants", "signature"}`` of a ``@triton.jit`` function) and Triton's launch options."""

  kernel: str
  source: dict
  num_warps: int
  num_stages: int
  launch: dict | None = None  # LaunchShape._asdict() where the family knows its grid


class LaunchShape(NamedTuple):
  """A launch's work at the family's shape: ``programs`` (the grid's size), ``iterations`` of the
  main loop per program, and the trips of each loop nested in it per iteration."""

  programs: int
  iterations: float
  inner_trips: int


# --- The fused Triton HYLA kernels (implementation='tensorcore') ----------------------------------

TENSORCORE_MODULE = "primal_dual.kernels.hyla.tensorcore"
# (function, extra constants, pointer types after q, k, v in argument order) of each launch.
TENSORCORE_LAUNCHES = {
  "forward": ("forward_kernel", {}, ("fp32", "i8", "fp32")),
  "dq_dk": ("dkv_kernel", {"WANT_DK": True}, ("fp32", "i8") + ("fp32",) * 5),
  "dv": ("dkv_kernel", {"WANT_DK": False}, ("fp32", "i8") + ("fp32",) * 5),
}


class TensorcoreSetting(NamedTuple):
  """One configuration of the fused Triton HYLA kernels (three launches each); ``launch_warps``:
  warps of the forward, dq_dk and dv launches; ``num_stages``: Triton's pipelining stages;
  ``operands``: the ``q, k, v`` pointers' type, ``bf16`` (bfloat16 inputs run natively) or
  ``fp32`` (bfloat16 inputs a GPU call widens, ``a`` and ``u`` rounded to bfloat16: float32
  inputs compile to the same products less two conversions)."""

  value_network: str
  normalization: str
  block_size: int
  value_chunk: int
  launch_warps: tuple[int, int, int]
  causal: bool = False
  num_stages: int = 2
  operands: str = "bf16"


def tensorcore_default_setting(operands: str = "bf16", causal: bool = False) -> TensorcoreSetting:
  """The default HYLA (rms_head, mlp_relu) at the kernels' default tuning for ``operands``."""
  from primal_dual.kernels.hyla import tensorcore as ht

  chunk, warps, stages = ht.default_tuning(ht.rounding_dtype(operands), causal)
  return TensorcoreSetting(
    "mlp_relu", "rms_head", ht.DEFAULT_BLOCK_SIZE, chunk, tuple(warps), causal, stages, operands
  )


def tensorcore_settings() -> list[TensorcoreSetting]:
  """Every value network × normalisation at the default tuning (bfloat16); then other tiles,
  chunks and warps for the default HYLA (rms_head, mlp_relu), a causal call, and the float32
  operands' defaults (the default HYLA, causal or not)."""
  from primal_dual.kernels.hyla import tensorcore as ht

  default = tensorcore_default_setting()
  settings = [
    default._replace(value_network=v, normalization=n)
    for v in ht.VALUE_NETWORKS
    for n in ht.NORMALIZATIONS
  ]
  variants = ((16, 16, (4, 8, 8)), (16, 16, (4, 4, 4)), (16, 32, (4, 4, 8)), (16, 64, (8, 8, 8)))
  variants += ((32, 16, (4, 8, 8)), (32, 32, (8, 8, 8)), (64, 16, (8, 8, 8)))
  settings += [
    default._replace(block_size=t, value_chunk=c, launch_warps=w) for t, c, w in variants
  ]
  settings.append(tensorcore_default_setting(causal=True))
  return settings + [tensorcore_default_setting("fp32", causal) for causal in (False, True)]


def tensorcore_config(setting: TensorcoreSetting, shape: Shape):
  """The kernels' ``Config`` for ``shape`` inputs of bfloat16 values (as ``setting.operands``),
  no mask or bias."""
  from primal_dual.kernels.hyla import tensorcore as ht

  return ht.Config(
    batch=shape.batch,
    q_len=shape.length,
    kv_len=shape.length,
    heads=shape.heads,
    d_qk=shape.head_dim,
    d_v=shape.head_dim,
    scale=shape.head_dim**-0.5,
    normalization=setting.normalization,
    value_network=setting.value_network,
    block_size=setting.block_size,
    value_chunk=setting.value_chunk,
    causal_offset=0 if setting.causal else None,
    precision=None,
    value_rounding="bf16",
    bias_shape=None,
    mask_shape=None,
    num_warps=ht.LaunchWarps(*setting.launch_warps),
    num_stages=setting.num_stages,
    interpret=False,
  )


def tensorcore_constants(setting: TensorcoreSetting, shape: Shape) -> dict[str, Any]:
  """The kernels' constexpr constants for ``tensorcore_config``."""
  from primal_dual.kernels.hyla import tensorcore as ht

  return ht.kernel_constants(tensorcore_config(setting, shape))


def tensorcore_launch_shape(setting: TensorcoreSetting, shape: Shape, launch: str) -> LaunchShape:
  """The work of one launch: its grid (from the kernel module), its main loop's trips (forward
  loops over key tiles, dq_dk and dv over query tiles; causal: the band's mean) and the value
  chunks the dq_dk loop nests in each trip."""
  from primal_dual.kernels.hyla import tensorcore as ht

  cfg = tensorcore_config(setting, shape)
  grid = ht.launch_grids(cfg)[launch]
  tiles = -(-shape.length // setting.block_size)
  chunks = -(-shape.head_dim // setting.value_chunk)
  return LaunchShape(
    programs=math.prod(grid),
    iterations=(tiles + 1) / 2 if setting.causal else tiles,
    inner_trips=chunks if launch == "dq_dk" else 1,
  )


def tensorcore_job(setting: TensorcoreSetting, shape: Shape, launch: str) -> CompileJob:
  """The job of one launch (a key of ``TENSORCORE_LAUNCHES``)."""
  from primal_dual.kernels.hyla import tensorcore as ht

  function, extra, other_pointers = TENSORCORE_LAUNCHES[launch]
  pointer_types = (setting.operands,) * 3 + other_pointers
  constants = {**tensorcore_constants(setting, shape), **extra}
  pointers = [n for n in getattr(ht, function).arg_names if n not in constants]
  signature = {n: "*" + t for n, t in zip(pointers, pointer_types, strict=True)}
  source = dict(
    module=TENSORCORE_MODULE, function=function, constants=constants, signature=signature
  )
  warps = getattr(tensorcore_config(setting, shape).num_warps, launch)
  shape_of_launch = tensorcore_launch_shape(setting, shape, launch)._asdict()
  return CompileJob(launch, source, warps, setting.num_stages, shape_of_launch)


def tensorcore_jobs(setting: TensorcoreSetting, shape: Shape, workdir: Path) -> list[CompileJob]:
  """The four launches of ``setting``, compiled from the module's source (nothing in ``workdir``)."""
  del workdir
  return [tensorcore_job(setting, shape, launch) for launch in TENSORCORE_LAUNCHES]


class Family(NamedTuple):
  """A family of kernels: its settings, the jobs of one setting, and how the report shows it."""

  title: str
  setting_type: type
  settings: Callable[[], list]
  jobs: Callable[[Any, Shape, Path], list[CompileJob]]
  shape: Shape
  how: str  # the report's line on how the kernels were obtained


FAMILIES = {
  "tensorcore": Family(
    "tensorcore HYLA (`primal_dual/kernels/hyla/tensorcore.py`)",
    TensorcoreSetting,
    tensorcore_settings,
    tensorcore_jobs,
    Shape(length=8192),  # the length of the HYLA speed target (constexpr in these kernels)
    "each launch's `@triton.jit` function compiled with the constants of a call without mask or "
    "bias; the heads batch the per-head products and are padded to 16 for the coupled ones; "
    "`operands` fp32: the inputs widened to float32",
  ),
}


# --- Reading ptxas and the disassembly -----------------------------------------------------------

PTXAS_FIELDS = {
  "registers": r"Used (\d+) registers",
  "stack_frame_bytes": r"(\d+) bytes stack frame",
  "spill_store_bytes": r"(\d+) bytes spill stores",
  "spill_load_bytes": r"(\d+) bytes spill loads",
  "static_shared_bytes": r"(\d+) bytes smem",
  "local_bytes": r"(\d+) bytes lmem",
}

# Mnemonics counted in the SASS (cuobjdump -sass) and the PTX, one instruction a line.
SASS_INSTRUCTIONS = {
  "hgmma": r"\bHGMMA\.",  # warpgroup matrix multiply (wgmma), sm_90
  "hmma": r"\bHMMA\.",  # warp matrix multiply (mma.sync)
  "ffma": r"\bFFMA\b",
  "fmul": r"\bFMUL\b",
  "fadd": r"\bFADD\b",
  "local_load": r"\bLDL\b",
  "local_store": r"\bSTL\b",
  # Shared memory: layout conversions, transposes and dot operands go through it.
  "shared_load": r"\bLDS\b",
  "shared_matrix_load": r"\bLDSM\b",  # ldmatrix: dot operands
  "shared_store": r"\bSTS\b",
  "barrier": r"\bBAR\b",  # bar.sync: every warp of the program waits
  "shuffle": r"\bSHFL\b",
  "global_load": r"\bLDG\b",
  "async_copy": r"\bLDGSTS\b",  # cp.async, global to shared (software-pipelined loads)
  "global_store": r"\bSTG\b",
  "atomic": r"\b(?:RED|REDG|ATOM|ATOMG)\b",  # REDG: sm_90 global reductions
  "instructions": r"^\s*/\*[0-9a-f]{4,}\*/\s+\S",  # every instruction
}
PTX_INSTRUCTIONS = {
  "wgmma": r"\bwgmma\.mma_async\.",
  "mma": r"\bmma\.sync\.",
  "fma_f32": r"\bfma\.rn(?:\.ftz)?\.f32\b",
}


def entry_function_log(log: str) -> str:
  """The part of a ``ptxas -v`` log about the entry function: from its ``Function properties``
  line to the next function's (a kernel may keep device functions with figures of their own);
  the whole log where it names no entry function."""
  entry = re.search(r"Compiling entry function '([^']+)'", log)
  if entry is None:
    return log
  name = re.escape(entry.group(1))
  start = re.search(rf"Function properties for {name}\s*$", log, re.MULTILINE)
  section = log[start.start() if start else entry.start() :]
  following = re.search(r"Function properties for ", section[len("Function properties") :])
  return section[: following.start() + len("Function properties")] if following else section


def parse_ptxas_log(log: str) -> dict[str, int]:
  """The entry function's ``ptxas -v`` numbers; a field ptxas did not print is 0.

  ``local_bytes`` (lmem) is the stack frame where ptxas reports it apart from ``lmem``.
  """
  section = entry_function_log(log)
  if not re.search(PTXAS_FIELDS["registers"], section):
    raise ValueError(f"no 'Used N registers' line in the ptxas log:\n{log[:2000]}")
  numbers = {}
  for field, pattern in PTXAS_FIELDS.items():
    found = re.search(pattern, section)
    numbers[field] = int(found.group(1)) if found else 0
  numbers["local_bytes"] = max(numbers["local_bytes"], numbers["stack_frame_bytes"])
  return numbers


def loop_spans(sass: str) -> list[tuple[int, int]]:
  """``(first, last)`` line numbers of each loop of the SASS, in the order of their branches: from
  a backward branch's target to the branch (a branch to itself, the trap after ``EXIT``, is
  none)."""
  lines = sass.splitlines()
  line_at = {}
  for n, line in enumerate(lines):
    found = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
    if found:
      line_at[int(found.group(1), 16)] = n
  spans = []
  for n, line in enumerate(lines):
    target = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", line)
    start = line_at.get(int(target.group(1), 16)) if target else None
    if start is not None and start < n:
      spans.append((start, n))
  return spans


def main_loop(sass: str) -> str:
  """The SASS lines from the target of the last backward branch to that branch (the kernel's
  tile loop with its nested loops; empty when there is no loop)."""
  spans = loop_spans(sass)
  if not spans:
    return ""
  start, end = spans[-1]
  return "\n".join(sass.splitlines()[start : end + 1])


def iteration_counts(sass: str, inner_trips: int) -> dict[str, int]:
  """Instruction counts (``SASS_INSTRUCTIONS``) of one iteration of the main loop (the widest):
  its lines once and those of each loop nested in it (first level) ``inner_trips`` times; the
  whole kernel where it has no loop."""
  spans = loop_spans(sass)
  if not spans:
    return count_instructions(sass, SASS_INSTRUCTIONS)
  lines = sass.splitlines()

  def counts(span):
    return count_instructions("\n".join(lines[span[0] : span[1] + 1]), SASS_INSTRUCTIONS)

  def inside(inner, outer):
    return inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1]

  outer = max(spans, key=lambda span: span[1] - span[0])
  nested = [span for span in spans if inside(span, outer)]
  first_level = [span for span in nested if not any(inside(span, other) for other in nested)]
  total = counts(outer)
  for span in first_level:
    for name, n in counts(span).items():
      total[name] += (inner_trips - 1) * n
  return total


def count_instructions(text: str, patterns: Mapping[str, str]) -> dict[str, int]:
  """How many lines of ``text`` hold each pattern's instruction."""
  compiled = {name: re.compile(pattern) for name, pattern in patterns.items()}
  counts = dict.fromkeys(patterns, 0)
  for line in text.splitlines():
    for name, pattern in compiled.items():
      if pattern.search(line):
        counts[name] += 1
  return counts


def matrix_instructions(counts: Mapping[str, int]) -> int:
  return counts["hgmma"] + counts["hmma"]


# --- A time estimate from the SASS (an H100 SXM's figures; a model, not a measurement) -----------


class Device(NamedTuple):
  """What the estimate takes of a GPU."""

  sms: int = 132
  schedulers_per_sm: int = 4  # each issues about one warp instruction per cycle
  clock_hz: float = 1.98e9  # boost clock
  registers_per_sm: int = 65536
  register_unit: int = 256  # registers are allocated to a warp in these units
  shared_bytes_per_sm: int = 228 * 1024
  shared_reserved_bytes: int = 1024  # per resident program
  warps_per_sm: int = 64
  programs_per_sm: int = 32


H100 = Device()
# Cycles one barrier-separated stage of a loop iteration takes from start to end when nothing else
# hides it (a shared-memory round trip, the matrix instructions and loads that wait on it): the
# model's one free constant, fitted to the one GPU measurement of the tensorcore kernels: 131 ms
# forward + backward at N = 8192 on an H100 (benchmarks/results/device_suite_gpu-h100.md) for an
# earlier form of them (four launches: forward, dq, dk, dv; tile 16, value chunk 16, warps 4 / 8),
# whose SASS gives 10.0 + 50.5 + 49.6 + 21.8 = 132 ms at this constant (and 33 ms at N = 4096,
# where the H100 measured 34.1).
STAGE_CYCLES = 440


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int, device=H100) -> int:
  """Programs (thread blocks) an SM holds at once: the least its registers, shared memory, warp
  and block limits allow; at least 1 (a program beyond a block's shared memory would not launch
  at all: the targets flag it)."""
  per_warp = -(-registers * 32 // device.register_unit) * device.register_unit
  by_registers = device.registers_per_sm // (per_warp * num_warps)
  by_shared = device.shared_bytes_per_sm // (shared_bytes + device.shared_reserved_bytes)
  by_warps = device.warps_per_sm // num_warps
  return max(1, min(by_registers, by_shared, by_warps, device.programs_per_sm))


def time_estimate(
  per_iteration: Mapping[str, float],
  launch: LaunchShape,
  registers: int,
  shared_bytes: int,
  num_warps: int,
  device=H100,
) -> dict[str, Any]:
  """An estimate of one launch's time from its SASS counts per main-loop iteration, as the larger
  of two bounds:

  * issue: every warp instruction of every iteration of every program, at one per cycle per
    scheduler on all SMs (perfect overlap; the loop's instructions only);
  * latency: the programs run in waves of ``programs_per_sm`` per SM, and each iteration of a
    program is a chain of ``barrier`` stages of ``STAGE_CYCLES`` that the programs resident on
    an SM overlap but no program shortens.
  """
  resident = programs_per_sm(registers, shared_bytes, num_warps, device)
  waves = -(-launch.programs // (device.sms * resident))
  warp_instructions = launch.programs * launch.iterations * num_warps
  warp_instructions *= per_iteration["instructions"]
  issue_s = warp_instructions / (device.sms * device.schedulers_per_sm * device.clock_hz)
  stages = max(per_iteration["barrier"], 1)
  latency_s = waves * launch.iterations * stages * STAGE_CYCLES / device.clock_hz
  return {
    "programs_per_sm": resident,
    "waves": waves,
    "issue_ms": 1e3 * issue_s,
    "latency_ms": 1e3 * latency_s,
    "estimate_ms": 1e3 * max(issue_s, latency_s),
    "bound": "latency" if latency_s > issue_s else "issue",
  }


# A matrix product's first operand in Triton's GPU IR: its shape, element type and layout.
_DOT_FIRST_OPERAND = re.compile(
  r"tt\.dot [^:]*: tensor<(?P<shape>[0-9x]+)x(?P<dtype>bf16|f16), "
  r"#ttg\.dot_op<\{opIdx = 0, [^}]*kWidth = (?P<k_width>\d+)\}>"
)


def dot_operand_widths(ttgir: str) -> list[dict[str, int | bool]]:
  """Each 16-bit matrix product of a kernel's TTGIR: its contraction length ``k``, the operands'
  ``k_width`` (consecutive K values a thread holds) and whether it ``fits``: at most ``k / 4``, as
  an ``mma.m16n8k16`` gives each thread 4 of a row's 16 K values per instruction. Triton 3.6 and
  3.7 chose ``k_width`` 8 for ``k`` = 16 when an operand was converted in registers, and such
  products computed wrong values on an H100 (lease 7; fixed upstream by bounding ``k_width`` with
  ``k``, triton-lang/triton#11691; Triton 3.8 and 3.9 choose 4)."""
  widths = []
  for match in _DOT_FIRST_OPERAND.finditer(ttgir):
    k, k_width = int(match["shape"].split("x")[-1]), int(match["k_width"])
    widths.append({"k": k, "k_width": k_width, "fits": k_width <= k // 4})
  return widths


def kernel_numbers(
  ptxas_log: str,
  dynamic_shared_bytes: int,
  sass: str,
  ptx: str,
  num_warps: int | None = None,
  launch: LaunchShape | None = None,
  ttgir: str = "",
) -> dict:
  """One kernel's record fields from what its compilation produced (pure: testable anywhere);
  with the ``launch``'s shape, the counts of one main-loop iteration (``sass_iteration``) and the
  time estimate (:func:`time_estimate`).

  The targets: no spill bytes, shared memory within an H100's block, and more matrix instructions
  than FFMAs in the main loop (the whole kernel where it has no loop), i.e. the products that
  couple the heads run on the matrix units rather than as multiply-adds; with the kernel's
  ``ttgir``, also every 16-bit product's operand width within its contraction
  (:func:`dot_operand_widths`).
  """
  numbers = parse_ptxas_log(ptxas_log)
  sass_counts = count_instructions(sass, SASS_INSTRUCTIONS)
  loop_counts = count_instructions(main_loop(sass) or sass, SASS_INSTRUCTIONS)
  shared = numbers["static_shared_bytes"] + dynamic_shared_bytes
  spills = numbers["spill_store_bytes"] + numbers["spill_load_bytes"]
  targets = {
    "no_spills": spills == 0,
    "shared_fits": shared <= SHARED_MEMORY_LIMIT_BYTES,
    "matrix_in_loop": matrix_instructions(loop_counts) > loop_counts["ffma"],
  }
  operand_widths = {}
  if ttgir:
    operand_widths = {"dot_operands": dot_operand_widths(ttgir)}
    targets["operand_widths_fit"] = all(w["fits"] for w in operand_widths["dot_operands"])
  return {
    **numbers,
    "dynamic_shared_bytes": dynamic_shared_bytes,
    "shared_bytes": shared,
    "matrix_instructions": matrix_instructions(sass_counts),
    "loop_matrix_instructions": matrix_instructions(loop_counts),
    "sass": sass_counts,
    "sass_loop": loop_counts,
    "ptx": count_instructions(ptx, PTX_INSTRUCTIONS),
    **operand_widths,
    "targets": targets,
    "meets_targets": all(targets.values()),
    **_launch_estimate(numbers["registers"], shared, sass, num_warps, launch),
  }


def _launch_estimate(registers, shared_bytes, sass, num_warps, launch) -> dict[str, Any]:
  if launch is None or num_warps is None:
    return {}
  per_iteration = iteration_counts(sass, launch.inner_trips)
  estimate = time_estimate(per_iteration, launch, registers, shared_bytes, num_warps)
  return {"launch": launch._asdict(), "sass_iteration": per_iteration, **estimate}


# --- One compilation, in a capped subprocess -----------------------------------------------------


def _triton_bin(tool: str) -> str:
  import triton

  return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def _triton_source(source: Mapping[str, Any]):
  """What ``triton.compile`` takes for a job's source: an ``ASTSource``."""
  from triton.compiler import ASTSource

  function = getattr(importlib.import_module(source["module"]), source["function"])
  constants = source["constants"]
  signature = {
    name: "constexpr" if name in constants else source["signature"][name]
    for name in function.arg_names
  }
  return ASTSource(fn=function, signature=signature, constexprs=constants)


def compile_worker(job: CompileJob) -> dict[str, Any]:
  """Compiles one job for sm_90a with the triton wheel; the raw outputs as a dict."""
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # jaxlib's Triton fuses too
  os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton's own ptxas -v, printed, captured below
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia import compiler as nvidia_compiler

  log = io.StringIO()
  with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
    os.environ["TRITON_CACHE_DIR"] = cache  # a cached kernel would skip ptxas and its log
    kernel = triton.compile(
      _triton_source(job.source),
      target=GPUTarget("cuda", CAPABILITY, 32),
      options=dict(num_warps=job.num_warps, num_stages=job.num_stages),
    )
  with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
    cubin.write(kernel.asm["cubin"])
    cubin.flush()
    sass = subprocess.run(
      [_triton_bin("cuobjdump"), "-sass", cubin.name], capture_output=True, text=True, check=True
    ).stdout
  return {
    "ptxas_log": log.getvalue(),
    "dynamic_shared_bytes": int(kernel.metadata.shared),
    "sass": sass,
    "ptx": kernel.asm["ptx"],
    "ttgir": kernel.asm["ttgir"],
    "triton_version": triton.__version__,
    "ptxas_version": nvidia_compiler.get_ptxas_version(CAPABILITY).strip().splitlines()[-1],
  }


def run_capped(command: Sequence[str], timeout_s: float):
  """``(returncode, stdout, stderr)`` of ``command`` in its own process group, killed (with the
  ptxas it started) after ``timeout_s``, when returncode is None."""
  process = subprocess.Popen(
    command,
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,
  )
  try:
    stdout, stderr = process.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)  # the worker and its ptxas
    stdout, stderr = process.communicate()
    return None, stdout, stderr
  finally:  # this process stopped (a signal, an interrupt): no ptxas left running on its own
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
  return process.returncode, stdout, stderr


def exit_on_sigterm() -> None:
  """A terminated run (``timeout``, ``kill``) unwinds, so that run_capped kills its compilation."""
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def compile_kernel(job: CompileJob, workdir: Path, memory_cap_gib: float, timeout_s: float):
  """The record fields of one kernel: status ``ok`` with its numbers, else ``timeout``/``failed``
  with the reason."""
  spec_path = workdir / f"{job.kernel}.job.json"
  out_path = workdir / f"{job.kernel}.out.json"
  out_path.unlink(missing_ok=True)
  spec_path.write_text(json.dumps({"job": job._asdict(), "out_path": str(out_path)}))
  cap = str(int(memory_cap_gib * 2**30))
  command = [sys.executable, "-m", "tools.device.gpu_compile", "--worker", str(spec_path), cap]
  code, _, stderr = run_capped(command, timeout_s)
  if code is None:
    return {"status": "timeout", "reason": f"over {timeout_s:g} s (killed)"}
  if code != 0 or not out_path.exists():
    tail = " ".join(stderr.strip().splitlines()[-3:])[-400:]
    return {
      "status": "failed",
      "reason": f"exit {code} under a {memory_cap_gib:g} GiB address-space cap: {tail}",
    }
  raw = json.loads(out_path.read_text())
  try:
    launch = None if job.launch is None else LaunchShape(**job.launch)
    numbers = kernel_numbers(
      raw["ptxas_log"],
      raw["dynamic_shared_bytes"],
      raw["sass"],
      raw["ptx"],
      job.num_warps,
      launch,
      raw["ttgir"],
    )
  except ValueError as error:
    return {"status": "failed", "reason": str(error)[:400]}
  versions = {key: raw[key] for key in ("triton_version", "ptxas_version")}
  return {"status": "ok", "reason": "", **numbers, **versions}


def worker_main(spec_path: str, memory_cap_bytes: str) -> None:
  """The subprocess of :func:`compile_kernel`: caps its address space, compiles, writes JSON."""
  # Set before triton loads, so that the ptxas it starts inherits the cap.
  resource.setrlimit(resource.RLIMIT_AS, (int(memory_cap_bytes), int(memory_cap_bytes)))
  spec = json.loads(Path(spec_path).read_text())
  raw = compile_worker(CompileJob(**spec["job"]))
  Path(spec["out_path"]).write_text(json.dumps(raw))


# --- The report ----------------------------------------------------------------------------------


def setting_records(family_name: str, setting, shape: Shape, memory_cap_gib, timeout_s, log=print):
  """One record per kernel of ``setting`` (or one ``failed`` record if it yields no job)."""
  base = {"family": family_name, **setting._asdict(), "arch": ARCH}
  records = []
  with tempfile.TemporaryDirectory() as tmp:
    try:
      jobs = FAMILIES[family_name].jobs(setting, shape, Path(tmp))
    except Exception as error:  # a setting that does not lower is reported, not fatal
      return [{**base, "kernel": "(lowering)", "status": "failed", "reason": repr(error)[:400]}]
    for job in jobs:
      fields = compile_kernel(job, Path(tmp), memory_cap_gib, timeout_s)
      record = {**base, "kernel": job.kernel, "num_warps": job.num_warps, **fields}
      record["num_stages"] = job.num_stages
      log(_progress_line(record))
      records.append(record)
  return records


def _progress_line(r) -> str:
  head = f"{r['family']:10s} {r['kernel']:18s} {r['value_network']:10s} {r['normalization']:8s} "
  head += f"tile {r['block_size']:3d}"
  if r["status"] != "ok":
    return f"{head} {r['status']}: {r['reason']}"
  return (
    f"{head} regs {r['registers']:3d} spill {r['spill_store_bytes']}/{r['spill_load_bytes']} B "
    f"smem {r['shared_bytes']} B mma loop/all {r['loop_matrix_instructions']}/"
    f"{r['matrix_instructions']} ffma loop/all {r['sass_loop']['ffma']}/{r['sass']['ffma']}"
  )


def _kib(value) -> str:
  return f"{value / 1024:.1f}"


def _check(value) -> str:
  return "yes" if value else "**no**"


def _setting_columns(setting_type: type):
  from benchmarks import common

  headers = {
    "block_size": "tile",
    "value_chunk": "chunk",
    "launch_warps": "warps fwd/dq_dk/dv",
    "num_stages": "stages",
  }
  formats = {"launch_warps": lambda warps: "/".join(map(str, warps))}
  return tuple(
    common.Column(headers.get(f, f), f, formats.get(f, str)) for f in setting_type._fields
  )


def _columns(setting_type: type):
  from benchmarks import common

  return (
    common.Column("kernel", "kernel"),
    *_setting_columns(setting_type),
    common.Column("warps", "num_warps"),  # the kernel's own launch
    common.Column("registers", "registers"),
    common.Column("spill st/ld B", "spills"),
    common.Column("local B", "local_bytes"),
    common.Column("shared KiB", "shared_bytes", _kib),
    common.Column("MMA loop/all", "mma"),
    common.Column("FFMA loop/all", "ffma"),
    common.Column("LDL/STL", "local_accesses"),
    common.Column("targets", "meets_targets", _check),
    common.Column("status", "status"),
    common.Column("reason", "reason"),
  )


def _table_row(record) -> dict:
  row = dict(record)
  if record["status"] == "ok":
    sass, loop = record["sass"], record["sass_loop"]
    row["spills"] = f"{record['spill_store_bytes']}/{record['spill_load_bytes']}"
    row["mma"] = f"{record['loop_matrix_instructions']}/{record['matrix_instructions']}"
    row["ffma"] = f"{loop['ffma']}/{sass['ffma']}"
    row["local_accesses"] = f"{sass['local_load']}/{sass['local_store']}"
  return row


def setting_key(record: Mapping, setting_type: type) -> tuple:
  """The setting a record belongs to, hashable (JSON gives its tuples back as lists)."""
  return tuple(
    tuple(record[f]) if isinstance(record[f], list) else record[f] for f in setting_type._fields
  )


def _estimate_columns(setting_type: type):
  from benchmarks import common

  def ms(value):
    return f"{value:.1f}"

  return (
    common.Column("kernel", "kernel"),
    *_setting_columns(setting_type),
    common.Column("warps", "num_warps"),
    common.Column("registers", "registers"),
    common.Column("programs", "programs"),
    common.Column("per SM", "programs_per_sm"),
    common.Column("waves", "waves"),
    common.Column("iterations", "iterations"),
    common.Column("instr/it", "it_instructions"),
    common.Column("HMMA/it", "it_hmma"),
    common.Column("FP32/it", "it_fp32"),
    common.Column("LDS+LDSM/it", "it_shared_loads"),
    common.Column("STS/it", "it_shared_stores"),
    common.Column("BAR/it", "it_barriers"),
    common.Column("LDG+LDGSTS/it", "it_global_loads"),
    common.Column("issue ms", "issue_ms", ms),
    common.Column("latency ms", "latency_ms", ms),
    common.Column("estimate ms", "estimate_ms", ms),
  )


def _estimate_row(record) -> dict:
  it = record["sass_iteration"]
  return {
    **record,
    "programs": record["launch"]["programs"],
    "iterations": f"{record['launch']['iterations']:g}",
    "it_instructions": it["instructions"],
    "it_hmma": it["hmma"] + it["hgmma"],
    "it_fp32": it["ffma"] + it["fmul"] + it["fadd"],
    "it_shared_loads": it["shared_load"] + it["shared_matrix_load"],
    "it_shared_stores": it["shared_store"],
    "it_barriers": it["barrier"],
    "it_global_loads": it["global_load"] + it["async_copy"],
  }


def estimate_section(setting_type: type, records: Sequence[Mapping]) -> list[str]:
  """The time estimate's table (records that carry one) and the sum per setting."""
  from benchmarks import common

  estimated = [r for r in records if r["status"] == "ok" and "estimate_ms" in r]
  if not estimated:
    return []
  totals: dict[tuple, float] = {}
  missing: set[tuple] = set()
  for r in estimated:
    key = setting_key(r, setting_type)
    totals[key] = totals.get(key, 0.0) + r["estimate_ms"]
    if not r["meets_targets"]:
      missing.add(key)
  sums = [
    f"- {', '.join(f'{f}={v}' for f, v in zip(setting_type._fields, key))}: **{total:.1f} ms**"
    + (" (a kernel misses the targets: not a time it could run in)" if key in missing else "")
    for key, total in totals.items()
  ]
  return [
    "### Where the time goes: an estimate from the SASS (a model, not a measurement)",
    "",
    "Per launch at this shape: the grid's programs, how many an SM holds at once (registers, "
    "shared memory, warps), the waves they take on 132 SMs, the main loop's iterations per "
    "program, and the SASS counts per warp of one iteration (the loops nested in it counted "
    "once per trip; FP32: FFMA+FMUL+FADD). Issue ms: every warp instruction at one per cycle "
    f"per scheduler, 4 schedulers on each of {H100.sms} SMs at {H100.clock_hz / 1e9:g} GHz "
    "(perfect overlap, a lower bound). Latency ms: waves × iterations × barriers per iteration × "
    f"{STAGE_CYCLES} cycles, each barrier-separated stage a chain the resident programs overlap "
    f"but none shortens; {STAGE_CYCLES} cycles is the model's one free constant, fitted to the one "
    "GPU measurement of these kernels (131 ms forward + backward at N = 8192 on an H100, "
    "`benchmarks/results/device_suite_gpu-h100.md`, for an earlier form of them with a separate "
    "dq launch, value chunk 16 and warps 4 / 8, whose SASS gives 132 ms here; 33 ms at N = 4096, "
    "where the H100 measured 34.1). Estimate: the larger of the two. Not modelled: spills, atomic "
    "adds, and shared memory beyond a block (such a kernel would not launch; a sum that includes "
    "a kernel missing the targets says so). A latency-bound kernel gains from fewer barrier "
    "stages per unit of work or more programs resident per SM, not from fewer instructions.",
    "",
    common.render_markdown_table(
      _estimate_columns(setting_type), [_estimate_row(r) for r in estimated]
    ),
    "",
    "Estimated sum of the launches per setting:",
    "",
    *sums,
    "",
  ]


def _family_section(name: str, config: Mapping, records: Sequence[Mapping]) -> list[str]:
  from benchmarks import common

  family = FAMILIES[name]
  mine = [r for r in records if r["family"] == name]
  settings_done = {setting_key(r, family.setting_type) for r in mine}
  passing = sum(1 for r in mine if r.get("meets_targets"))
  return [
    f"## {family.title}",
    "",
    f"bfloat16 q, k, v of shape {tuple(config['shapes'][name])} "
    f"(`[batch, length, heads, head_dim]`): {family.how}.",
    "",
    f"Settings compiled: {len(settings_done)} of {len(config['settings'][name])}. "
    f"Targets met: {passing} of {len(mine)} kernels.",
    "",
    common.render_markdown_table(_columns(family.setting_type), [_table_row(r) for r in mine]),
    "",
    *estimate_section(family.setting_type, mine),
  ]


def render_markdown(payload) -> str:
  from benchmarks import common

  config = payload["config"]
  lines = [
    *common.report_header(
      f"GPU kernels compiled for {ARCH} (no GPU used)",
      payload["metadata"],
      ("cpu_model", "jax_version", "triton_version", "ptxas_version", "date_utc", "command"),
    ),
    "",
    f"Each kernel compiled by the triton wheel for `{ARCH}`: registers, spills (stores/loads, "
    "bytes per thread), local memory and static shared memory from the `ptxas -v` of Triton's own "
    "compilation, dynamic shared memory from Triton; instruction counts per warp from "
    "`cuobjdump -sass` of that cubin, in the main loop (from the target of the last backward "
    "branch to it) and the whole kernel (MMA: HGMMA (wgmma) + HMMA (mma.sync); FFMA: CUDA-core "
    "multiply-adds; LDL/STL: local loads/stores). Targets: 0 spill bytes, ≤ 227 KiB shared "
    "memory, more matrix instructions than FFMAs in the main loop (the coupled products on the "
    f"matrix units). Each compilation capped at {config['memory_cap_gib']:g} GiB of address "
    f"space and {config['timeout_s']:g} s. No GPU ran these kernels: times are unmeasured. The "
    "report is rewritten after each setting, so a cut run shows the settings it finished.",
    "",
  ]
  for name in config["families"]:
    lines += _family_section(name, config, payload["records"])
  return "\n".join(lines)


def run(args, log=print) -> dict[str, Path]:
  from benchmarks import common

  plan = {name: select_settings(FAMILIES[name].settings(), args) for name in args.families}
  shapes = {name: family_shape(FAMILIES[name], args) for name in args.families}
  metadata = common.run_metadata("cpu")
  config = dict(
    arch=ARCH,
    families=list(args.families),
    shapes={name: list(shape) for name, shape in shapes.items()},
    dtype="bfloat16",
    memory_cap_gib=args.memory_cap_gib,
    timeout_s=args.timeout_s,
    settings={name: [s._asdict() for s in settings] for name, settings in plan.items()},
  )
  records: list[dict[str, Any]] = []
  paths = {}
  for name, settings in plan.items():
    for setting in settings:  # the reports rewritten after each setting: a cut run keeps its rows
      records += setting_records(
        name, setting, shapes[name], args.memory_cap_gib, args.timeout_s, log
      )
      for key in ("triton_version", "ptxas_version"):
        metadata[key] = next((r[key] for r in records if r.get(key)), None)
      payload = dict(metadata=metadata, config=config, records=records)
      paths = common.write_reports(args.out_dir, args.name, "cpu", payload, render_markdown)
  return paths


def select_settings(settings: Sequence, args) -> list:
  """The settings whose value network, normalisation and tile the command line keeps (all by
  default)."""
  return [
    s
    for s in settings
    if (args.value_networks is None or s.value_network in args.value_networks)
    and (args.normalizations is None or s.normalization in args.normalizations)
    and (args.tiles is None or s.block_size in args.tiles)
  ]


def family_shape(family: Family, args) -> Shape:
  """The family's shape, with any dimension the command line gives."""
  given = {f: getattr(args, f) for f in Shape._fields if getattr(args, f) is not None}
  return family.shape._replace(**given)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  from benchmarks import common
  from primal_dual.kernels.hyla import blockwise

  parser = argparse.ArgumentParser(
    prog="python -m tools.device.gpu_compile",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--families",
    type=common.comma_list(choices=FAMILIES),
    default=list(FAMILIES),
    help="kernel families, compiled in this order",
  )
  keep = "keep only the settings with these (default: every setting of the family)"
  parser.add_argument(
    "--value-networks", type=common.comma_list(choices=blockwise.VALUE_NETWORKS), help=keep
  )
  parser.add_argument(
    "--normalizations", type=common.comma_list(choices=blockwise.NORMALIZATIONS), help=keep
  )
  parser.add_argument("--tiles", type=common.comma_list(int), help=keep)
  for field in Shape._fields:
    parser.add_argument(f"--{field.replace('_', '-')}", type=int, help="default: the family's")
  parser.add_argument("--memory-cap-gib", type=float, default=6.0)
  parser.add_argument("--timeout-s", type=float, default=420.0)
  parser.add_argument("--out-dir", default="benchmarks/results")
  parser.add_argument("--name", default="gpu_compile", help="stem of the result files")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["--worker"]:  # one capped compilation (compile_kernel)
    worker_main(*argv[1:3])
    return
  exit_on_sigterm()
  paths = run(parse_args(argv))
  print("wrote", *map(str, paths.values()))


if __name__ == "__main__":
  main()
