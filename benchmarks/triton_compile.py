"""What ptxas makes of a ``@triton.jit`` kernel for an H100 (sm_90a), on a machine without a GPU.

:func:`compile_figures` compiles one kernel (named by module and attribute) with given constexpr
constants and pointer dtypes through ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, in a
subprocess whose address space (``RLIMIT_AS``) and wall-clock time are capped (ptxas has taken
15 GiB on a bad kernel). The figures: registers, spill stores/loads and stack frame (the ptxas
Triton uses for sm_90a, ``-v``, on Triton's PTX), shared memory (Triton's metadata), and instruction counts of the
SASS (the wheel's ``cuobjdump -sass``): ``HGMMA`` (wgmma), ``HMMA`` (mma.sync, the tensor-core
products), ``FFMA`` (CUDA-core multiply-adds), local loads/stores — for the whole kernel and for
its main loop (the SASS from the target of the kernel's last backward branch to that branch: the
tile loop, with any loop nested in it).

Run as a script it records the fused Triton HYLA kernels (``primal_dual/kernels/
hyla_tensorcore.py``) at the issue's shape (bfloat16, H = 8, d = d_v = 64) over their settings::

  python -m benchmarks.triton_compile                 # benchmarks/results/hyla_tensorcore_compile.*
  python -m benchmarks.triton_compile --out-dir /tmp/tc --block-sizes 16
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCH = "sm_90a"
SHARED_MEMORY_LIMIT_BYTES = 227 * 1024  # an H100's shared memory per block
SASS_PATTERNS = {
  "hgmma": r"\bHGMMA\b",
  "hmma": r"\bHMMA\b",
  "ffma": r"\bFFMA\b",
  "local_ld_st": r"\b(?:LDL|STL)\b",
}


# --- In the capped subprocess --------------------------------------------------------------------


def _triton_tool(name: str) -> str:
  import triton

  return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def parse_ptxas(log: str) -> dict[str, int]:
  """Registers, spill bytes and stack frame of the entry function from ``ptxas -v`` output (a
  large kernel can keep device functions whose own figures follow)."""
  entry = log.split("Compiling entry function", 1)[-1].split("Compiling", 1)[0]
  figures = {}
  for key, pattern in {
    "registers": r"Used (\d+) registers",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
    "stack_frame_bytes": r"(\d+) bytes stack frame",
  }.items():
    found = re.search(pattern, entry)
    figures[key] = int(found.group(1)) if found else 0
  return figures


def main_loop(sass: str) -> str:
  """The SASS lines from the target of the last backward branch to that branch (the kernel's
  tile loop with its nested loops; empty when there is no loop)."""
  lines = sass.splitlines()
  address = {}
  for n, line in enumerate(lines):
    found = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
    if found:
      address[int(found.group(1), 16)] = n
  loop = ""
  for n, line in enumerate(lines):
    target = re.search(r"\bBRA\s+0x([0-9a-f]+)", line)
    if target:
      start = address.get(int(target.group(1), 16))
      if start is not None and start < n:
        loop = "\n".join(lines[start : n + 1])
  return loop


def count(text: str) -> dict[str, int]:
  return {name: len(re.findall(p, text)) for name, p in SASS_PATTERNS.items()}


def compile_worker(spec: Mapping[str, Any]) -> dict[str, Any]:
  """Compiles ``spec`` (see :func:`compile_figures`) and returns its figures. The address-space
  cap is set here, first, and holds for ptxas too (a child inherits it): the caller, often a
  multithreaded JAX process, then needs no ``preexec_fn`` (which forks)."""
  cap = int(spec["memory_cap_bytes"])
  resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import get_ptxas  # the one Triton uses for sm_90a
  from triton.compiler import ASTSource

  kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
  constants = spec["constants"]
  signature = {
    name: ("constexpr" if name in constants else spec["pointers"][name])
    for name in kernel.arg_names
  }
  source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
  compiled = triton.compile(
    source,
    target=GPUTarget("cuda", 90, 32),
    options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]},
  )
  with tempfile.TemporaryDirectory() as tmp:
    ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
    ptx.write_text(compiled.asm["ptx"])
    cubin.write_bytes(compiled.asm["cubin"])
    log = subprocess.run(
      [get_ptxas(90).path, f"-arch={ARCH}", "-v", str(ptx), "-o", str(Path(tmp) / "o.cubin")],
      capture_output=True,
      text=True,
    )
    if log.returncode != 0:
      raise RuntimeError(f"ptxas: {(log.stderr or log.stdout).strip()[:300]}")
    sass = subprocess.run(
      [_triton_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
  return {
    **parse_ptxas(log.stdout + log.stderr),
    "shared_bytes": int(compiled.metadata.shared),
    "sass": count(sass),
    "sass_loop": count(main_loop(sass)),
    "ptx_mma": len(re.findall(r"\b(?:mma|wgmma)\.", compiled.asm["ptx"])),
  }


# --- Caller side ---------------------------------------------------------------------------------


def compile_figures(
  module: str,
  kernel: str,
  constants: Mapping[str, Any],
  pointers: Mapping[str, str],
  *,
  num_warps: int = 4,
  num_stages: int = 2,
  memory_cap_gib: float = 6.0,
  timeout_s: float = 600.0,
) -> dict[str, Any]:
  """Figures of ``module.kernel`` compiled for sm_90a in a capped subprocess.

  Args:
    module, kernel: where the ``@triton.jit`` function lives (importable from the repository).
    constants: its constexpr arguments by name. pointers: Triton pointer types of the others
      (``{"q_ptr": "*bf16", ...}``).
    num_warps, num_stages: Triton's launch options.
    memory_cap_gib, timeout_s: the subprocess's address-space cap and wall-clock limit.

  Returns:
    ``{"status": "ok", registers, spill_store_bytes, spill_load_bytes, stack_frame_bytes,
    shared_bytes, sass: {hgmma, hmma, ffma, local_ld_st}, sass_loop: {...}, ptx_mma}``, or
    ``{"status": "failed" | "timeout", "reason": ...}`` (never raises for a bad compilation).
  """
  spec = dict(
    module=module,
    kernel=kernel,
    constants=dict(constants),
    pointers=dict(pointers),
    num_warps=num_warps,
    num_stages=num_stages,
    memory_cap_bytes=int(memory_cap_gib * 2**30),
  )
  command = [sys.executable, "-m", "benchmarks.triton_compile", "--worker", json.dumps(spec)]
  try:
    done = subprocess.run(
      command,
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
      timeout=timeout_s,
    )
  except subprocess.TimeoutExpired:
    return {"status": "timeout", "reason": f"over {timeout_s:.0f} s"}
  if done.returncode != 0:
    return {"status": "failed", "reason": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
  return {"status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}


def meets_targets(figures: Mapping[str, Any]) -> bool:
  """0 spill bytes, shared memory within an H100's block, matrix instructions in the loop."""
  return (
    figures.get("status") == "ok"
    and figures["spill_store_bytes"] == 0
    and figures["spill_load_bytes"] == 0
    and figures["shared_bytes"] <= SHARED_MEMORY_LIMIT_BYTES
    and figures["sass_loop"]["hmma"] + figures["sass_loop"]["hgmma"] > 0
  )


# --- The fused HYLA kernels ---------------------------------------------------------------------

HYLA_MODULE = "primal_dual.kernels.hyla_tensorcore"
# (kernel, extra constants, pointer types in argument order) of each launch of the HYLA kernels.
HYLA_LAUNCHES = {
  "forward": ("_forward_kernel", {}, ("bf16", "bf16", "bf16", "fp32", "i8", "fp32")),
  "dq": ("_dq_kernel", {}, ("bf16", "bf16", "bf16", "fp32", "i8", "fp32", "fp32", "fp32")),
  "dk": ("_dkv_kernel", {"WANT_DK": True}, ("bf16",) * 3 + ("fp32", "i8") + ("fp32",) * 3),
  "dv": ("_dkv_kernel", {"WANT_DK": False}, ("bf16",) * 3 + ("fp32", "i8") + ("fp32",) * 3),
}


class Setting(NamedTuple):
  value_network: str
  normalization: str
  block_size: int
  value_chunk: int
  num_warps: int  # the forward's
  backward_num_warps: int
  causal: bool = False


def default_settings() -> list[Setting]:
  """Every value network × normalisation at the default tile, chunk and warps; then larger tiles,
  chunks and warps for the default HYLA (rms_head, mlp_relu), and a causal call."""
  from primal_dual.kernels import hyla_tensorcore as ht

  tile, chunk = ht.DEFAULT_BLOCK_SIZE, ht.DEFAULT_VALUE_CHUNK
  warps = (ht.DEFAULT_NUM_WARPS, ht.DEFAULT_BACKWARD_NUM_WARPS)
  settings = [
    Setting(v, n, tile, chunk, *warps) for v in ht.VALUE_NETWORKS for n in ht.NORMALIZATIONS
  ]
  settings += [
    Setting("mlp_relu", "rms_head", t, c, *w)
    for t, c, w in (
      (16, 16, (4, 4)),
      (16, 32, warps),
      (16, 64, warps),
      (32, 16, warps),
      (32, 16, (8, 8)),
      (64, 16, (8, 8)),
    )
  ]
  return settings + [Setting("mlp_relu", "rms_head", tile, chunk, *warps, causal=True)]


def hyla_constants(setting: Setting, length=8192, heads=8, head_dim=64) -> dict[str, Any]:
  """The kernels' constexpr constants for bfloat16 ``[1, length, heads, head_dim]`` inputs."""
  from primal_dual.kernels import hyla_tensorcore as ht

  cfg = ht.Config(
    batch=1,
    q_len=length,
    kv_len=length,
    heads=heads,
    d_qk=head_dim,
    d_v=head_dim,
    scale=head_dim**-0.5,
    normalization=setting.normalization,
    value_network=setting.value_network,
    block_size=setting.block_size,
    value_chunk=setting.value_chunk,
    causal_offset=0 if setting.causal else None,
    precision=None,
    bias_shape=None,
    mask_shape=None,
    num_warps=setting.num_warps,
    backward_num_warps=setting.backward_num_warps,
    interpret=False,
  )
  return ht._constants(cfg)


def launch_figures(setting: Setting, launch: str, memory_cap_gib=6.0, timeout_s=600.0) -> dict:
  """:func:`compile_figures` of one launch (a key of ``HYLA_LAUNCHES``) of the HYLA kernels."""
  from primal_dual.kernels import hyla_tensorcore as ht

  constants = hyla_constants(setting)
  kernel, extra, pointer_types = HYLA_LAUNCHES[launch]
  names = [n for n in getattr(ht, kernel).arg_names if n not in constants and n not in extra]
  return compile_figures(
    HYLA_MODULE,
    kernel,
    {**constants, **extra},
    {n: "*" + t for n, t in zip(names, pointer_types)},
    num_warps=setting.num_warps if launch == "forward" else setting.backward_num_warps,
    memory_cap_gib=memory_cap_gib,
    timeout_s=timeout_s,
  )


def hyla_records(settings: Sequence[Setting], memory_cap_gib: float, timeout_s: float, log=print):
  """One record per (setting, launch): the setting, the launch and its figures."""
  records = []
  for setting in settings:
    for launch in HYLA_LAUNCHES:
      figures = launch_figures(setting, launch, memory_cap_gib, timeout_s)
      record = {**setting._asdict(), "launch": launch, **figures}
      record["meets_targets"] = meets_targets(figures)
      log(json.dumps(record))
      records.append(record)
  return records


def render_markdown(payload: Mapping[str, Any]) -> str:
  """The records as a Markdown table (rendered from the JSON as written)."""
  lines = [
    "# Fused Triton HYLA kernels compiled for sm_90a (no GPU)",
    "",
    payload["description"],
    "",
    "| value network | norm | tile | chunk | warps fwd/bwd | causal | kernel | regs | spills (st/ld B) "
    "| shared KiB | HMMA loop / all | HGMMA | FFMA loop / all | targets |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in payload["records"]:
    head = (
      f"| {r['value_network']} | {r['normalization']} | {r['block_size']} | "
      f"{r['value_chunk']} | {r['num_warps']}/{r['backward_num_warps']} | {r['causal']} | "
      f"{r['launch']} |"
    )
    if r["status"] != "ok":
      lines.append(f"{head} {r['status']}: {r['reason']} |||||| no |")
      continue
    lines.append(
      f"{head} {r['registers']} | {r['spill_store_bytes']}/{r['spill_load_bytes']} | "
      f"{r['shared_bytes'] / 1024:.0f} | {r['sass_loop']['hmma']} / {r['sass']['hmma']} | "
      f"{r['sass']['hgmma']} | {r['sass_loop']['ffma']} / {r['sass']['ffma']} | "
      f"{'yes' if r['meets_targets'] else 'no'} |"
    )
  return "\n".join(lines) + "\n"


DESCRIPTION = (
  "Each launch of `primal_dual/kernels/hyla_tensorcore.py` compiled by `triton.compile` for "
  "`GPUTarget('cuda', 90, 32)` (sm_90a) on a CPU (triton 3.9.0): bfloat16 q, k, v "
  "`[1, 8192, 8, 64]`, no mask or bias; the 8 heads batch the per-head products and are padded "
  "to 16 for the head-coupled ones. Registers and spills from the `ptxas -v` Triton uses for "
  "sm_90a; shared memory from Triton's metadata; SASS instruction counts (`cuobjdump -sass`, "
  "per warp) in the main tile loop (`loop`, nested loops included) and in the whole kernel "
  "(`all`). HMMA: mma.sync tensor-core instructions; HGMMA: wgmma; FFMA: CUDA-core float "
  "multiply-adds. Targets: 0 spill bytes, shared memory <= 227 KiB, matrix instructions in the "
  "loop. No GPU ran these kernels: times are unmeasured. Command: "
  "`python -m benchmarks.triton_compile` (each compilation in a subprocess capped at 6 GiB)."
)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
  parser.add_argument("--memory-cap-gib", type=float, default=6.0)
  parser.add_argument("--timeout-s", type=float, default=600.0)
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(compile_worker(json.loads(args.worker))))
    return
  records = hyla_records(default_settings(), args.memory_cap_gib, args.timeout_s)
  payload = {"description": DESCRIPTION, "records": records}
  args.out_dir.mkdir(parents=True, exist_ok=True)
  (args.out_dir / "hyla_tensorcore_compile.json").write_text(json.dumps(payload, indent=1) + "\n")
  (args.out_dir / "hyla_tensorcore_compile.md").write_text(render_markdown(payload))


if __name__ == "__main__":
  main()
