"""What ptxas makes of the project's GPU kernels for an H100 (sm_90a), on a machine without a GPU.

Each GPU kernel the project ships (today the three Pallas HYLA kernels of
``primal_dual/kernels/hyla_pallas.py``: ``hyla_forward``, ``hyla_backward_dq``,
``hyla_backward_dkv``) is compiled for CUDA capability 9.0 (``sm_90a``) over its settings (value
network × normalisation at the default tile, and larger tiles):

1. the gradient of ``sum(hyla_pallas_attention(q, k, v))`` (bfloat16 ``[1, N, H, D]``) is lowered
   with ``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``: no GPU needed;
2. each Pallas-Triton custom call of the lowered module carries its kernel as Triton IR
   (``backend_config``: ``name``, ``ir``, ``num_warps``, ``num_stages``); the IR is printed as text;
3. a subprocess compiles that IR with the ``triton`` wheel (``pip install -e ".[gpu-dev]"``)
   for ``GPUTarget("cuda", 90, 32)``, its bundled ``ptxas -v`` giving registers, spills, stack
   frame and static shared memory; Triton's metadata gives the dynamic shared memory; the wheel's
   ``cuobjdump -sass`` gives the SASS, in which matrix instructions (``HGMMA``: wgmma, ``HMMA``:
   mma.sync) are counted beside ``FFMA`` and local-memory loads/stores (the PTX counts too).

ptxas can take tens of GiB on large tiles, so every compilation runs in its own process group
with its address space capped (``RLIMIT_AS``, ``--memory-cap-gib``) and a wall-clock limit
(``--timeout-s``); a capped, timed-out or failing compilation is recorded with ``status`` and
``reason``, never fatal. The target per kernel (what a kernel ``implementation='auto'`` picks
must meet) is 0 spill bytes and at most 227 KiB of shared memory per block.

  python -m benchmarks.gpu_compile                      # writes benchmarks/results/gpu_compile.*
  python -m benchmarks.gpu_compile --tiles 16 --value-networks mlp_relu --out-dir /tmp/gc
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCH = "sm_90a"
CAPABILITY = 90
# An H100's shared memory per block (227 KiB usable of its 228 KiB).
SHARED_MEMORY_LIMIT_BYTES = 227 * 1024
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"

# --- What is compiled ----------------------------------------------------------------------------


class Setting(NamedTuple):
  """One configuration of the Pallas HYLA kernels (each lowers to forward, dq and dk/dv)."""

  value_network: str
  normalization: str
  block_size: int


class Shape(NamedTuple):
  """q, k, v are bfloat16 ``[batch, length, heads, head_dim]``."""

  batch: int = 1
  length: int = 1024
  heads: int = 8
  head_dim: int = 64


def default_settings(
  value_networks: Sequence[str], normalizations: Sequence[str], tiles: Sequence[int]
) -> list[Setting]:
  """Every value network × normalisation at the first tile, then every value network at the other
  tiles with the first normalisation (the larger tiles are where ptxas spills or runs out)."""
  first_tile, *other_tiles = tiles
  settings = [Setting(v, n, first_tile) for v in value_networks for n in normalizations]
  settings += [Setting(v, normalizations[0], t) for t in other_tiles for v in value_networks]
  return settings


def lower_for_cuda(setting: Setting, shape: Shape):
  """The lowered gradient program of one setting, for CUDA, traced on this (GPU-less) machine."""
  import jax
  import jax.numpy as jnp

  from primal_dual.kernels import hyla_pallas

  def loss(q, k, v):
    out = hyla_pallas.hyla_pallas_attention(
      q,
      k,
      v,
      block_size=setting.block_size,
      normalization=setting.normalization,
      value_network=setting.value_network,
      interpret=False,
    )
    return jnp.sum(out.astype(jnp.float32))

  qkv = jax.ShapeDtypeStruct(tuple(shape), jnp.bfloat16)
  traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(qkv, qkv, qkv)
  return traced.lower(lowering_platforms=("cuda",))


class TritonKernel(NamedTuple):
  """One Pallas-Triton custom call: the kernel's name, its Triton IR (text) and launch settings."""

  name: str
  ir: str
  num_warps: int
  num_stages: int


def _walk(operation):
  for region in operation.regions:
    for block in region.blocks:
      for op in block.operations:
        yield op
        yield from _walk(op.operation)


def triton_kernels(lowered) -> list[TritonKernel]:
  """The Triton kernels a lowered CUDA program calls, in program order, IR printed as text."""
  from jax._src.lib.mlir import ir
  from jax._src.pallas.triton import lowering as triton_lowering

  module = lowered.compiler_ir("stablehlo")
  kernels = []
  for op in _walk(module.operation):
    if op.operation.name != "stablehlo.custom_call":
      continue
    if ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_CALL_TARGET:
      continue
    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    # The IR is MLIR bytecode of the Triton dialect: parse it where that dialect is registered.
    with triton_lowering._new_ir_context():
      text = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm()
    kernels.append(
      TritonKernel(
        name=ir.StringAttr(config["name"]).value,
        ir=text,
        num_warps=ir.IntegerAttr(config["num_warps"]).value,
        num_stages=ir.IntegerAttr(config["num_stages"]).value,
      )
    )
  return kernels


# --- Reading ptxas and the disassembly -----------------------------------------------------------

PTXAS_FIELDS = {
  "registers": r"Used (\d+) registers",
  "stack_frame_bytes": r"(\d+) bytes stack frame",
  "spill_store_bytes": r"(\d+) bytes spill stores",
  "spill_load_bytes": r"(\d+) bytes spill loads",
  "static_shared_bytes": r"(\d+) bytes smem",
  "local_bytes": r"(\d+) bytes lmem",
}

# Mnemonics counted in the SASS (cuobjdump -sass) and the PTX, one line per instruction.
SASS_INSTRUCTIONS = {
  "hgmma": r"\bHGMMA\.",  # warpgroup matrix multiply (wgmma), sm_90
  "hmma": r"\bHMMA\.",  # warp matrix multiply (mma.sync)
  "ffma": r"\bFFMA\b",
  "fmul": r"\bFMUL\b",
  "fadd": r"\bFADD\b",
  "local_load": r"\bLDL\b",
  "local_store": r"\bSTL\b",
}
PTX_INSTRUCTIONS = {
  "wgmma": r"\bwgmma\.mma_async\.",
  "mma": r"\bmma\.sync\.",
  "fma_f32": r"\bfma\.rn(?:\.ftz)?\.f32\b",
}


def parse_ptxas_log(log: str) -> dict[str, int]:
  """``ptxas -v`` numbers of a one-kernel log; a field ptxas did not print is 0.

  ``local_bytes`` (lmem) is the stack frame where ptxas reports it apart from ``lmem``.
  """
  if not re.search(PTXAS_FIELDS["registers"], log):
    raise ValueError(f"no 'Used N registers' line in the ptxas log:\n{log[:2000]}")
  numbers = {}
  for field, pattern in PTXAS_FIELDS.items():
    found = re.findall(pattern, log)
    numbers[field] = max(map(int, found)) if found else 0
  numbers["local_bytes"] = max(numbers["local_bytes"], numbers["stack_frame_bytes"])
  return numbers


def count_instructions(text: str, patterns: Mapping[str, str]) -> dict[str, int]:
  """How many lines of ``text`` hold each pattern's instruction."""
  compiled = {name: re.compile(pattern) for name, pattern in patterns.items()}
  counts = dict.fromkeys(patterns, 0)
  for line in text.splitlines():
    for name, pattern in compiled.items():
      if pattern.search(line):
        counts[name] += 1
  return counts


def kernel_numbers(ptxas_log: str, dynamic_shared_bytes: int, sass: str, ptx: str) -> dict:
  """One kernel's record fields from what its compilation produced (pure: testable anywhere)."""
  numbers = parse_ptxas_log(ptxas_log)
  sass_counts = count_instructions(sass, SASS_INSTRUCTIONS)
  ptx_counts = count_instructions(ptx, PTX_INSTRUCTIONS)
  shared = numbers["static_shared_bytes"] + dynamic_shared_bytes
  spills = numbers["spill_store_bytes"] + numbers["spill_load_bytes"]
  return {
    **numbers,
    "dynamic_shared_bytes": dynamic_shared_bytes,
    "shared_bytes": shared,
    "matrix_instructions": sass_counts["hgmma"] + sass_counts["hmma"],
    "sass": sass_counts,
    "ptx": ptx_counts,
    "meets_target": spills == 0 and shared <= SHARED_MEMORY_LIMIT_BYTES,
  }


# --- One compilation, in a capped subprocess -----------------------------------------------------


def _triton_bin(tool: str) -> str:
  import triton

  return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def compile_worker(ir_path: str, num_warps: int, num_stages: int) -> dict[str, Any]:
  """Compiles one Triton IR file for sm_90a with the triton wheel; the raw outputs as a dict."""
  from triton.backends.nvidia import compiler as nvidia_compiler

  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # jaxlib's Triton fuses too
  os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v printed on stdout, captured below
  import triton
  from triton.backends.compiler import GPUTarget

  log = io.StringIO()
  with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
    os.environ["TRITON_CACHE_DIR"] = cache  # a cached kernel would skip ptxas and its log
    kernel = triton.compile(
      ir_path,
      target=GPUTarget("cuda", CAPABILITY, 32),
      options=dict(num_warps=num_warps, num_stages=num_stages),
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
  return process.returncode, stdout, stderr


def compile_kernel(kernel: TritonKernel, workdir: Path, memory_cap_gib: float, timeout_s: float):
  """The record fields of one kernel: status ``ok`` with its numbers, else ``timeout``/``failed``
  with the reason."""
  ir_path = workdir / f"{kernel.name}.ttir"
  out_path = workdir / f"{kernel.name}.json"
  ir_path.write_text(kernel.ir)
  command = [
    sys.executable,
    "-m",
    "benchmarks.gpu_compile",
    "--worker",
    str(ir_path),
    str(kernel.num_warps),
    str(kernel.num_stages),
    str(out_path),
    str(int(memory_cap_gib * 2**30)),
  ]
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
    numbers = kernel_numbers(raw["ptxas_log"], raw["dynamic_shared_bytes"], raw["sass"], raw["ptx"])
  except ValueError as error:
    return {"status": "failed", "reason": str(error)[:400]}
  versions = {key: raw[key] for key in ("triton_version", "ptxas_version")}
  return {"status": "ok", "reason": "", **numbers, **versions}


# --- The report ----------------------------------------------------------------------------------


def setting_records(setting: Setting, shape: Shape, memory_cap_gib, timeout_s, log=print):
  """One record per kernel of ``setting`` (or one ``failed`` record if it does not lower)."""
  base = {**setting._asdict(), "arch": ARCH}
  try:
    kernels = triton_kernels(lower_for_cuda(setting, shape))
  except Exception as error:  # a setting that does not lower is reported, not fatal
    return [{**base, "kernel": "(lowering)", "status": "failed", "reason": repr(error)[:400]}]
  records = []
  with tempfile.TemporaryDirectory() as tmp:
    for kernel in kernels:
      fields = compile_kernel(kernel, Path(tmp), memory_cap_gib, timeout_s)
      record = {
        **base,
        "kernel": kernel.name,
        "num_warps": kernel.num_warps,
        "num_stages": kernel.num_stages,
        **fields,
      }
      log(_progress_line(record))
      records.append(record)
  return records


def _progress_line(r) -> str:
  if r["status"] != "ok":
    return (
      f"{r['kernel']:18s} {r['value_network']:10s} {r['normalization']:8s} tile "
      f"{r['block_size']:3d} {r['status']}: {r['reason']}"
    )
  return (
    f"{r['kernel']:18s} {r['value_network']:10s} {r['normalization']:8s} tile "
    f"{r['block_size']:3d} regs {r['registers']:3d} spill {r['spill_store_bytes']}/"
    f"{r['spill_load_bytes']} B smem {r['shared_bytes']} B mma {r['matrix_instructions']} "
    f"ffma {r['sass']['ffma']}"
  )


def _kib(value) -> str:
  return f"{value / 1024:.1f}"


def _check(value) -> str:
  return "yes" if value else "**no**"


def _columns():
  from benchmarks import common

  return (
    *common.plain_columns("kernel", "value_network", "normalization"),
    common.Column("tile", "block_size"),
    common.Column("warps", "num_warps"),
    common.Column("registers", "registers"),
    common.Column("spill stores B", "spill_store_bytes"),
    common.Column("spill loads B", "spill_load_bytes"),
    common.Column("local B", "local_bytes"),
    common.Column("shared KiB", "shared_bytes", _kib),
    common.Column("HGMMA+HMMA", "matrix_instructions"),
    common.Column("FFMA", "ffma"),
    common.Column("LDL/STL", "local_accesses"),
    common.Column("0 spills, ≤ 227 KiB", "meets_target", _check),
    common.Column("status", "status"),
    common.Column("reason", "reason"),
  )


def _table_row(record) -> dict:
  sass = record.get("sass") or {}
  row = dict(record, ffma=sass.get("ffma"))
  if sass:
    row["local_accesses"] = f"{sass['local_load']}/{sass['local_store']}"
  return row


def _setting_key(record) -> tuple:
  return tuple(record[field] for field in Setting._fields)


def render_markdown(payload) -> str:
  from benchmarks import common

  config = payload["config"]
  records = payload["records"]
  passing = sum(1 for r in records if r.get("meets_target"))
  lines = [
    *common.report_header(
      f"GPU kernels compiled for {ARCH} (no GPU used)",
      payload["metadata"],
      ("cpu_model", "jax_version", "triton_version", "ptxas_version", "date_utc", "command"),
    ),
    "",
    f"Lowered for CUDA from bfloat16 q, k, v of shape {tuple(config['shape'])} "
    "(`[batch, length, heads, head_dim]`), gradient of the sum; each Pallas-Triton kernel compiled "
    f"by the triton wheel for `{ARCH}`, ptxas -v for registers, spills and static shared memory, "
    "Triton for the dynamic shared memory, `cuobjdump -sass` for the instruction counts "
    f"(HGMMA: wgmma, HMMA: mma.sync, LDL/STL: local loads/stores). Each compilation capped at "
    f"{config['memory_cap_gib']:g} GiB of address space and {config['timeout_s']:g} s.",
    "",
    f"Settings compiled: {len({_setting_key(r) for r in records})} of {len(config['settings'])} "
    "(the reports are rewritten after each, so a cut run shows the ones it finished). Target "
    f"(0 spill bytes and ≤ 227 KiB shared memory): {passing} of {len(records)} kernels.",
    "",
    common.render_markdown_table(_columns(), [_table_row(r) for r in records]),
    "",
  ]
  return "\n".join(lines)


def run(args, log=print) -> dict[str, Path]:
  from benchmarks import common

  shape = Shape(args.batch, args.length, args.heads, args.head_dim)
  settings = default_settings(args.value_networks, args.normalizations, args.tiles)
  metadata = common.run_metadata("cpu")
  config = dict(
    arch=ARCH,
    shape=list(shape),
    dtype="bfloat16",
    memory_cap_gib=args.memory_cap_gib,
    timeout_s=args.timeout_s,
    settings=[s._asdict() for s in settings],
  )
  records: list[dict[str, Any]] = []
  paths = {}
  for setting in settings:  # the reports rewritten after each setting: a cut run keeps its rows
    records += setting_records(setting, shape, args.memory_cap_gib, args.timeout_s, log)
    for key in ("triton_version", "ptxas_version"):
      metadata[key] = next((r[key] for r in records if r.get(key)), None)
    payload = dict(metadata=metadata, config=config, records=records)
    paths = common.write_reports(args.out_dir, args.name, "cpu", payload, render_markdown)
  return paths


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  from benchmarks import common
  from primal_dual.kernels import hyla_pallas

  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.gpu_compile",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--value-networks",
    type=common.comma_list(choices=hyla_pallas.VALUE_NETWORKS),
    default=list(hyla_pallas.VALUE_NETWORKS),
  )
  parser.add_argument(
    "--normalizations",
    type=common.comma_list(choices=hyla_pallas.NORMALIZATIONS),
    default=[n for n in hyla_pallas.NORMALIZATIONS if n != "softmax"],
  )
  parser.add_argument(
    "--tiles",
    type=common.comma_list(int),
    default=[hyla_pallas.DEFAULT_BLOCK_SIZE, 64],
    help="the first is the default tile (every setting), the others for each value network",
  )
  parser.add_argument("--batch", type=int, default=Shape._field_defaults["batch"])
  parser.add_argument("--length", type=int, default=Shape._field_defaults["length"])
  parser.add_argument("--heads", type=int, default=Shape._field_defaults["heads"])
  parser.add_argument("--head-dim", type=int, default=Shape._field_defaults["head_dim"])
  parser.add_argument("--memory-cap-gib", type=float, default=6.0)
  parser.add_argument("--timeout-s", type=float, default=420.0)
  parser.add_argument("--out-dir", default="benchmarks/results")
  parser.add_argument("--name", default="gpu_compile", help="stem of the result files")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["--worker"]:  # one capped compilation (compile_kernel)
    ir_path, num_warps, num_stages, out_path, memory_cap = argv[1:6]
    # Set here, before triton loads, so that the ptxas it starts inherits the cap.
    resource.setrlimit(resource.RLIMIT_AS, (int(memory_cap), int(memory_cap)))
    raw = compile_worker(ir_path, int(num_warps), int(num_stages))
    Path(out_path).write_text(json.dumps(raw))
    return
  paths = run(parse_args(argv))
  print("wrote", *map(str, paths.values()))


if __name__ == "__main__":
  main()
