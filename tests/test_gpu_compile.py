"""The sm_90a compile report: reading ptxas and the disassembly (canned outputs), the capped
subprocess, the launches of the tensorcore kernels, the report, and, where the ``triton`` wheel is
installed (``make install-gpu-dev``), one real compilation of a tiny launch. The tensorcore
kernels' own compilation targets are checked in ``test_kernels_hyla_tensorcore.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gpu_dev
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package.
  sys.path.insert(0, str(REPO_ROOT))

from tools.device import gpu_compile

# What the triton wheel's ptxas printed for a HYLA forward kernel (sm_90a).
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
# A kernel that kept a device function: only the entry function's figures are the kernel's.
DEVICE_FUNCTION_LOG = """\
ptxas info    : 11 bytes gmem
ptxas info    : Function properties for a_device_function
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_dq_kernel' for 'sm_90a'
ptxas info    : Function properties for _dq_kernel
    520 bytes stack frame, 828 bytes spill stores, 540 bytes spill loads
ptxas info    : Used 200 registers, used 1 barriers
ptxas info    : Function properties for another_device_function
    900 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 255 registers
"""
# A loop (the backward branch at 0x40 to 0x20) between code before and after it.
LOOP_SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R3, R4, R5 ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   FFMA R2, R3, R4, R5 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   STL [R1], R2 ;
        /*0060*/                   FFMA R2, R3, R4, R5 ;
        /*0070*/                   EXIT ;
        /*0080*/                   BRA 0x80;
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


def test_parse_ptxas_log_reads_the_entry_function():
  numbers = gpu_compile.parse_ptxas_log(DEVICE_FUNCTION_LOG)
  assert numbers["registers"] == 200
  assert (numbers["spill_store_bytes"], numbers["spill_load_bytes"]) == (828, 540)
  assert numbers["stack_frame_bytes"] == numbers["local_bytes"] == 520


def test_parse_ptxas_log_refuses_a_log_without_registers():
  with pytest.raises(ValueError, match="no 'Used N registers'"):
    gpu_compile.parse_ptxas_log("ptxas fatal   : Ptx assembly aborted due to errors")


def test_instruction_counts():
  sass = gpu_compile.count_instructions(SASS, gpu_compile.SASS_INSTRUCTIONS)
  assert {k: sass[k] for k in ("hgmma", "hmma", "ffma", "fmul", "fadd")} == dict(
    hgmma=1, hmma=2, ffma=2, fmul=1, fadd=0
  )
  assert (sass["local_load"], sass["local_store"], sass["instructions"]) == (1, 1, 8)
  assert sass["shared_load"] == sass["barrier"] == sass["atomic"] == 0
  reduction = "        /*0010*/  REDG.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R5 ;"
  assert gpu_compile.count_instructions(reduction, gpu_compile.SASS_INSTRUCTIONS)["atomic"] == 1
  ptx = gpu_compile.count_instructions(PTX, gpu_compile.PTX_INSTRUCTIONS)
  assert ptx == dict(wgmma=1, mma=1, fma_f32=2)


def test_main_loop_is_from_a_backward_branchs_target_to_the_branch():
  loop = gpu_compile.count_instructions(gpu_compile.main_loop(LOOP_SASS), {"ffma": r"\bFFMA\b"})
  assert loop == {"ffma": 1}
  assert "HMMA" in gpu_compile.main_loop(LOOP_SASS) and "STL" not in gpu_compile.main_loop(
    LOOP_SASS
  )
  forward_only = LOOP_SASS.replace("@P0 BRA 0x20", "@P0 BRA 0x60")
  assert gpu_compile.main_loop(forward_only) == ""  # a forward branch is no loop


# A main loop (0x10 to 0x90) with a loop nested in it (0x30 to 0x60), and the trap after EXIT.
NESTED_SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   LDSM.16.M88.4 R8, [R3] ;
        /*0040*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0050*/                   STS [R3], R4 ;
        /*0060*/               @P1 BRA 0x30 ;
        /*0070*/                   LDS R5, [R3] ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/               @P0 BRA 0x10 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
"""


def test_one_iteration_counts_the_nested_loop_its_trips():
  assert gpu_compile.loop_spans(NESTED_SASS) == [(3, 6), (1, 9)]
  once = gpu_compile.iteration_counts(NESTED_SASS, inner_trips=1)
  assert (once["instructions"], once["hmma"], once["barrier"], once["global_load"]) == (9, 1, 2, 1)
  four = gpu_compile.iteration_counts(NESTED_SASS, inner_trips=4)
  assert (four["instructions"], four["hmma"], four["shared_matrix_load"]) == (9 + 3 * 4, 4, 4)
  assert (four["shared_store"], four["shared_load"], four["barrier"]) == (4, 1, 2)
  assert gpu_compile.iteration_counts(SASS, 4)["instructions"] == 8  # no loop: the whole kernel


def test_programs_per_sm_take_the_scarcest_resource():
  # 238 registers round to 240 a thread (7680 a warp): 8 warps fit once in 64 Ki registers.
  assert gpu_compile.programs_per_sm(238, 72 * 1024, num_warps=8) == 1
  assert gpu_compile.programs_per_sm(127, 32 * 1024, num_warps=4) == 4  # registers again
  assert gpu_compile.programs_per_sm(32, 100 * 1024, num_warps=4) == 2  # shared memory
  assert gpu_compile.programs_per_sm(16, 0, num_warps=1) == 32  # the block limit


def test_time_estimate_is_the_larger_of_issue_and_latency():
  launch = gpu_compile.LaunchShape(programs=264, iterations=10, inner_trips=1)
  per_iteration = {"instructions": 1000, "barrier": 2}
  device = gpu_compile.H100
  estimate = gpu_compile.time_estimate(per_iteration, launch, 127, 0, num_warps=4)
  assert (estimate["programs_per_sm"], estimate["waves"]) == (4, 1)
  issue_s = 264 * 10 * 4 * 1000 / (132 * 4 * device.clock_hz)
  assert estimate["issue_ms"] == pytest.approx(1e3 * issue_s)
  latency_s = 10 * 2 * gpu_compile.STAGE_CYCLES / device.clock_hz
  assert estimate["latency_ms"] == pytest.approx(1e3 * latency_s)
  assert estimate["estimate_ms"] == pytest.approx(1e3 * max(issue_s, latency_s))
  barrier_bound = gpu_compile.time_estimate({**per_iteration, "barrier": 200}, launch, 127, 0, 4)
  assert barrier_bound["bound"] == "latency" and barrier_bound["estimate_ms"] == pytest.approx(
    100 * estimate["latency_ms"]
  )


def test_kernel_numbers_with_a_launch_estimate_its_time():
  launch = gpu_compile.LaunchShape(programs=1000, iterations=64, inner_trips=4)
  numbers = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 0, NESTED_SASS, "", 8, launch)
  assert numbers["sass_iteration"] == gpu_compile.iteration_counts(NESTED_SASS, 4)
  assert numbers["launch"] == launch._asdict() and numbers["estimate_ms"] > 0
  assert "estimate_ms" not in gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 0, NESTED_SASS, "")


def test_kernel_numbers_and_targets():
  spilling = gpu_compile.kernel_numbers(PTXAS_LOG, 51200, SASS, PTX)
  assert spilling["shared_bytes"] == 51200 and spilling["matrix_instructions"] == 3
  assert not spilling["meets_targets"] and not spilling["targets"]["no_spills"]
  clean = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 1024, SASS, PTX)
  assert clean["shared_bytes"] == 2048 and clean["meets_targets"]
  too_much_shared = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 227 * 1024, SASS, PTX)
  assert not too_much_shared["meets_targets"] and not too_much_shared["targets"]["shared_fits"]


def test_targets_read_the_main_loop():
  # In the loop: 1 HMMA, 1 FFMA (not more matrix instructions); in the whole kernel 1 against 3.
  looped = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 0, LOOP_SASS, "")
  assert looped["loop_matrix_instructions"] == 1 and looped["sass_loop"]["ffma"] == 1
  assert looped["sass"]["ffma"] == 3 and looped["sass"]["local_store"] == 1
  assert not looped["targets"]["matrix_in_loop"] and not looped["meets_targets"]
  two_mma = LOOP_SASS.replace(
    "FFMA R2, R3, R4, R5 ;\n        /*0040*/", "HMMA.16816 R2 ;\n        /*0040*/"
  )
  on_matrix_units = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 0, two_mma, "")
  assert on_matrix_units["loop_matrix_instructions"] == 2 and on_matrix_units["meets_targets"]


def test_run_capped_kills_on_timeout():
  start = time.perf_counter()
  code, _, _ = gpu_compile.run_capped([sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
  assert code is None
  assert time.perf_counter() - start < 30


TINY = gpu_compile.Shape(batch=1, length=32, heads=2, head_dim=16)


def test_default_settings():
  gpu_dev.require("triton")  # the settings come from the kernel module
  tensorcore = gpu_compile.tensorcore_settings()
  assert len(tensorcore) == 3 * 2 + 7 + 1 + 2 and sum(s.causal for s in tensorcore) == 2
  widened = [s for s in tensorcore if s.operands == "fp32"]
  assert widened == [gpu_compile.tensorcore_default_setting("fp32", c) for c in (False, True)]
  args = gpu_compile.parse_args(["--tiles", "32", "--normalizations", "rms_head"])
  kept = gpu_compile.select_settings(tensorcore, args)
  assert [(s.block_size, s.value_chunk) for s in kept] == [(32, 16), (32, 32)]
  assert args.families == ["tensorcore"]  # the one family, by default
  with pytest.raises(SystemExit):  # the Pallas family is gone
    gpu_compile.parse_args(["--families", "pallas"])


def test_tensorcore_jobs_name_every_pointer_and_constant():
  gpu_dev.require("triton")
  from primal_dual.kernels.hyla import tensorcore as ht

  setting = gpu_compile.tensorcore_settings()[0]
  jobs = gpu_compile.tensorcore_jobs(setting, TINY, Path("."))  # no file written for these
  assert [j.kernel for j in jobs] == ["forward", "dq_dk", "dv"]
  assert [j.num_warps for j in jobs] == list(setting.launch_warps)
  for job in jobs:
    function = getattr(ht, job.source["function"])
    named = set(job.source["signature"]) | set(job.source["constants"])
    assert named == set(function.arg_names), job.kernel
    assert all(t.startswith("*") for t in job.source["signature"].values())
  assert jobs[1].source["constants"]["WANT_DK"] and not jobs[2].source["constants"]["WANT_DK"]
  assert jobs[0].source["constants"]["Q_LEN"] == TINY.length
  tiles, chunks = TINY.length // setting.block_size, -(-TINY.head_dim // setting.value_chunk)
  assert [j.launch["programs"] for j in jobs] == [tiles * chunks, tiles, tiles * chunks]
  assert [j.launch["inner_trips"] for j in jobs] == [1, chunks, 1]
  assert {j.launch["iterations"] for j in jobs} == {tiles}


@pytest.fixture
def tiny_forward_job():
  """The forward launch of the default tensorcore setting at the tiny shape."""
  gpu_dev.require("triton")
  setting = gpu_compile.tensorcore_default_setting()
  return gpu_compile.tensorcore_job(setting, TINY, "forward")


def test_real_compile_of_a_tiny_kernel(tiny_forward_job, tmp_path):
  record = gpu_compile.compile_kernel(tiny_forward_job, tmp_path, memory_cap_gib=6, timeout_s=600)
  assert record["status"] == "ok", record
  assert record["registers"] > 0 and record["shared_bytes"] > 0
  assert record["matrix_instructions"] > 0  # the products run on the tensor cores
  assert record["ptxas_version"].startswith("Build cuda_")
  assert record["estimate_ms"] > 0  # the launch's grid is known: a time estimate


def test_a_compilation_over_the_memory_cap_is_a_failed_record(tiny_forward_job, tmp_path):
  """The launch that compiles above, under a 0.2 GiB address-space cap: recorded, not raised."""
  record = gpu_compile.compile_kernel(tiny_forward_job, tmp_path, memory_cap_gib=0.2, timeout_s=300)
  assert record["status"] == "failed", record
  assert "0.2 GiB address-space cap" in record["reason"]


def _record(family, setting, kernel, **fields):
  return {"family": family, **setting._asdict(), "kernel": kernel, "num_warps": 4, **fields}


def test_report_has_a_section_per_family_with_measured_and_failed_kernels():
  tensorcore = [
    gpu_compile.TensorcoreSetting("mlp_relu", "rms_head", 16, 16, (4, 8, 4)),
    gpu_compile.TensorcoreSetting("linear", "none", 16, 16, (4, 8, 4)),
    gpu_compile.TensorcoreSetting("linear", "none", 32, 16, (4, 8, 4)),
  ]
  numbers = gpu_compile.kernel_numbers(PTXAS_LOG, 51200, SASS, PTX)
  records = [
    _record("tensorcore", tensorcore[0], "forward", status="ok", reason="", **numbers),
    _record("tensorcore", tensorcore[1], "dq", status="timeout", reason="over 420 s (killed)"),
  ]
  payload = {
    "metadata": {"command": "python -m tools.device.gpu_compile"},
    "config": {
      "families": ["tensorcore"],
      "shapes": {"tensorcore": [1, 8192, 8, 64]},
      "memory_cap_gib": 6,
      "timeout_s": 420,
      "settings": {"tensorcore": [s._asdict() for s in tensorcore]},
    },
    "records": records,
  }
  markdown = gpu_compile.render_markdown(payload)
  assert gpu_compile.render_markdown(json.loads(json.dumps(payload))) == markdown
  assert markdown.count("\n## ") == 1 and "Pallas" not in markdown
  section = markdown.split("## tensorcore HYLA")[1]
  assert "(1, 8192, 8, 64)" in section
  assert "Settings compiled: 2 of 3. Targets met: 0 of 2 kernels." in section
  assert (
    "| forward | mlp_relu | rms_head | 16 | 16 | 4/8/4 | False | 2 | bf16 | 4 | 32 | 9400/11512 "
    "| 5968 | 50.0 | 3/3 |" in section
  )
  assert "| dq | linear | none | 16 | 16 | 4/8/4 | False | 2 | bf16 | 4 |" in section
  assert "over 420 s (killed)" in section


CALLER = """
import sys
from tools.device import gpu_compile
gpu_compile.exit_on_sigterm()
sleeper = "import os, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
gpu_compile.run_capped([sys.executable, "-c", "import sys;" + sleeper, sys.argv[1]], 120)
"""


def test_a_terminated_run_leaves_no_compilation_running(tmp_path):
  pid_file = tmp_path / "worker.pid"
  caller = subprocess.Popen([sys.executable, "-c", CALLER, str(pid_file)], cwd=REPO_ROOT)
  while not (pid_file.exists() and pid_file.read_text()):
    assert caller.poll() is None, "the caller ended before its worker started"
    time.sleep(0.1)
  caller.terminate()
  assert caller.wait(timeout=60) == 128 + signal.SIGTERM
  worker = int(pid_file.read_text())
  with pytest.raises(ProcessLookupError):
    for _ in range(100):  # the worker, killed, may take a moment to be reaped by init
      os.kill(worker, 0)
      time.sleep(0.1)


def test_estimate_section_sums_the_launches_of_each_setting():
  setting = gpu_compile.TensorcoreSetting("mlp_relu", "rms_head", 16, 16, (4, 8, 4))
  launch = gpu_compile.LaunchShape(programs=1000, iterations=64, inner_trips=4)
  numbers = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 0, NESTED_SASS, "", 8, launch)
  records = [
    _record("tensorcore", setting, kernel, status="ok", reason="", **numbers)
    for kernel in ("forward", "dq_dk")
  ]
  records.append(_record("tensorcore", setting, "dv", status="timeout", reason="over 420 s"))
  lines = "\n".join(gpu_compile.estimate_section(gpu_compile.TensorcoreSetting, records))
  assert (
    "| dq_dk | mlp_relu | rms_head | 16 | 16 | 4/8/4 | False | 2 | bf16 | 4 | 168 | 1000 |" in lines
  )
  assert f"**{2 * numbers['estimate_ms']:.1f} ms**" in lines
  assert gpu_compile.estimate_section(gpu_compile.TensorcoreSetting, records[2:]) == []
  as_written = json.loads(json.dumps(records))  # the report is rendered from its JSON: lists
  again = gpu_compile.estimate_section(gpu_compile.TensorcoreSetting, as_written)
  assert "\n".join(again) == lines


# Two products as Triton 3.6 writes them for the tensorcore forward (bfloat16, K = 16): the q·k
# product from shared memory (kWidth 2) and a head-coupled one converted in registers (kWidth 8).
TTGIR_DOTS = """
    %s = tt.dot %q, %k, %c, inputPrecision = tf32 : tensor<4x16x16xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * tensor<4x16x16xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<4x16x16xf32, #mma> loc(#loc1)
    %z = tt.dot %a, %v, %c2, inputPrecision = tf32 : tensor<16x16x16xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 8}>> * tensor<16x16x16xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 8}>> -> tensor<16x16x16xf32, #mma> loc(#loc2)
    %f = tt.dot %x, %y, %c3, inputPrecision = tf32 : tensor<16x16x8xf32, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 1}>> * tensor<16x8x16xf32, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 1}>> -> tensor<16x16x16xf32, #mma> loc(#loc3)
"""


def test_16bit_products_with_operands_wider_than_a_quarter_of_k_miss_a_target():
  """kWidth 8 at K = 16 (Triton 3.6/3.7): wrong values on an H100; 4 (Triton 3.8+) fits."""
  assert gpu_compile.dot_operand_widths(TTGIR_DOTS) == [
    {"k": 16, "k_width": 2, "fits": True},
    {"k": 16, "k_width": 8, "fits": False},
  ]
  wide = gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 1024, SASS, PTX, ttgir=TTGIR_DOTS)
  assert not wide["targets"]["operand_widths_fit"] and not wide["meets_targets"]
  fixed = TTGIR_DOTS.replace("kWidth = 8", "kWidth = 4")
  assert gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 1024, SASS, PTX, ttgir=fixed)["meets_targets"]
  assert (
    "operand_widths_fit"
    not in gpu_compile.kernel_numbers(OLDER_PTXAS_LOG, 1024, SASS, PTX)["targets"]
  )
