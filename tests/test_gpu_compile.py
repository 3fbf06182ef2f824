"""The sm_90a compile report: reading ptxas and the disassembly (canned outputs), the capped
subprocess, the Triton IR taken from a CUDA lowering on this CPU, and, where the ``triton`` wheel
is installed (``make install-gpu-dev``), one real compilation of a tiny kernel."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package.
  sys.path.insert(0, str(REPO_ROOT))

from benchmarks import gpu_compile

# What the triton wheel's ptxas printed for a Pallas HYLA forward kernel (sm_90a).
PTXAS_LOG = """\
ptxas-blackwell info    : 11 bytes gmem
ptxas-blackwell info    : Compiling entry function 'hyla_forward' for 'sm_90a'
ptxas-blackwell info    : Function properties for hyla_forward
    5968 bytes stack frame, 9400 bytes spill stores, 11512 bytes spill loads
ptxas-blackwell info    : Used 32 registers, used 1 barriers, 5968 bytes cumulative stack size
ptxas-blackwell info    : Compile time = 1605.645 ms
"""
# An older ptxas's line with static shared and local memory.
OLDER_PTXAS_LOG = """\
ptxas info    : Function properties for k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, 1024 bytes smem, 16 bytes lmem, 400 bytes cmem[0]
"""
SASS = """\
        /*0270*/                   STL [R1+0x4], R29 ;                   /* 0x0000041d01007387 */
        /*0280*/                   LDL R3, [R1+0x4] ;                    /* 0x0000041d01007387 */
        /*1120*/                   HMMA.16816.F32.BF16 R12, R24.reuse, R12, RZ ;  /* 0x0 */
        /*1190*/                   HMMA.16816.F32.BF16 R12, R24, R16, RZ ;        /* 0x0 */
        /*11a0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ; /* 0x0 */
        /*11b0*/                   FFMA R3, R4, R5, R3 ;                          /* 0x0 */
        /*11c0*/                   FFMA.FTZ R3, R4, R5, R3 ;                      /* 0x0 */
        /*11d0*/                   FMUL R3, R4, R5 ;                              /* 0x0 */
"""
PTX = """\
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %r1 }, { %r2 }, { %r3 }, { %r1 };
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 { %f1 }, %rd1, %rd2, 1, 1, 1, 0, 0;
\tfma.rn.f32 %f1, %f2, %f3, %f4;
\tfma.rn.ftz.f32 %f1, %f2, %f3, %f4;
\tadd.f32 %f1, %f2, %f3;
"""


def test_parse_ptxas_log():
  assert gpu_compile.parse_ptxas_log(PTXAS_LOG) == {
    "registers": 32,
    "stack_frame_bytes": 5968,
    "spill_store_bytes": 9400,
    "spill_load_bytes": 11512,
    "static_shared_bytes": 0,
    "local_bytes": 5968,  # the stack frame is the local memory
  }
  older = gpu_compile.parse_ptxas_log(OLDER_PTXAS_LOG)
  assert (older["registers"], older["static_shared_bytes"], older["local_bytes"]) == (168, 1024, 16)
  assert older["spill_store_bytes"] == older["spill_load_bytes"] == 0


def test_parse_ptxas_log_refuses_a_log_without_registers():
  with pytest.raises(ValueError, match="no 'Used N registers'"):
    gpu_compile.parse_ptxas_log("ptxas fatal   : Ptx assembly aborted due to errors")


def test_instruction_counts():
  sass = gpu_compile.count_instructions(SASS, gpu_compile.SASS_INSTRUCTIONS)
  assert sass == dict(hgmma=1, hmma=2, ffma=2, fmul=1, fadd=0, local_load=1, local_store=1)
  ptx = gpu_compile.count_instructions(PTX, gpu_compile.PTX_INSTRUCTIONS)
  assert ptx == dict(wgmma=1, mma=1, fma_f32=2)


def test_kernel_numbers_and_target():
  spilling = gpu_compile.kernel_numbers(PTXAS_LOG, 51200, SASS, PTX)
  assert spilling["shared_bytes"] == 51200 and spilling["matrix_instructions"] == 3
  assert not spilling["meets_target"]  # spills
  clean = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 1024, SASS, PTX)
  assert clean["shared_bytes"] == 2048 and clean["meets_target"]
  too_much_shared = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 227 * 1024, SASS, PTX)
  assert not too_much_shared["meets_target"]


def test_run_capped_kills_on_timeout():
  start = time.perf_counter()
  code, _, _ = gpu_compile.run_capped([sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
  assert code is None
  assert time.perf_counter() - start < 30


TINY = gpu_compile.Shape(batch=1, length=32, heads=2, head_dim=16)
SETTING = gpu_compile.Setting("mlp_relu", "rms_head", 16)


@pytest.fixture(scope="module")
def tiny_kernels():
  return gpu_compile.triton_kernels(gpu_compile.lower_for_cuda(SETTING, TINY))


def test_triton_ir_of_the_cuda_lowering(tiny_kernels):
  assert [k.name for k in tiny_kernels] == ["hyla_forward", "hyla_backward_dq", "hyla_backward_dkv"]
  for kernel in tiny_kernels:
    assert f"tt.func public @{kernel.name}" in kernel.ir
    assert kernel.num_warps > 0 and kernel.num_stages > 0


@pytest.mark.skipif(
  importlib.util.find_spec("triton") is None,
  reason="the triton wheel is not installed (make install-gpu-dev)",
)
def test_real_compile_of_a_tiny_kernel(tiny_kernels, tmp_path):
  record = gpu_compile.compile_kernel(tiny_kernels[0], tmp_path, memory_cap_gib=6, timeout_s=600)
  assert record["status"] == "ok", record
  assert record["registers"] > 0 and record["shared_bytes"] > 0
  assert record["matrix_instructions"] > 0  # the q·k products run on the tensor cores
  assert record["ptxas_version"].startswith("Build cuda_")


def test_report_renders_measured_and_failed_kernels():
  settings = [
    gpu_compile.Setting("mlp_relu", "rms_head", 16),
    gpu_compile.Setting("linear", "none", 64),
  ]
  ok = {
    **settings[0]._asdict(),
    "kernel": "hyla_forward",
    "num_warps": 4,
    "status": "ok",
    "reason": "",
    **gpu_compile.kernel_numbers(PTXAS_LOG, 51200, SASS, PTX),
  }
  capped = {**settings[1]._asdict(), "kernel": "hyla_forward", "status": "timeout"}
  capped["reason"] = "over 420 s (killed)"
  payload = {
    "metadata": {"command": "python -m benchmarks.gpu_compile"},
    "config": {"shape": [1, 1024, 8, 64], "memory_cap_gib": 6, "timeout_s": 420},
    "records": [ok, capped],
  }
  payload["config"]["settings"] = [s._asdict() for s in settings * 2]
  markdown = gpu_compile.render_markdown(payload)
  assert "Settings compiled: 2 of 4" in markdown and "0 of 2 kernels" in markdown
  assert (
    "| hyla_forward | mlp_relu | rms_head | 16 | 4 | 32 | 9400 | 11512 | 5968 | 50.0 | 3 |"
    in (markdown)
  )
  assert "over 420 s (killed)" in markdown
