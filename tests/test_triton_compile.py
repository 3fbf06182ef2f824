"""The parsing of benchmarks/triton_compile.py (ptxas -v logs, SASS loops), on fixed text."""

from benchmarks import triton_compile as tc

PTXAS_LOG = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_dq_kernel' for 'sm_90a'
ptxas info    : Function properties for _dq_kernel
    520 bytes stack frame, 828 bytes spill stores, 540 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Function properties for a_device_function
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers
"""

SASS = """        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R3, R4, R5 ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   FFMA R2, R3, R4, R5 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   STL [R1], R2 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
"""


def test_parse_ptxas_reads_the_entry_function():
  assert tc.parse_ptxas(PTXAS_LOG) == {
    "registers": 255,
    "spill_store_bytes": 828,
    "spill_load_bytes": 540,
    "stack_frame_bytes": 520,
  }


def test_main_loop_counts_the_instructions_between_a_backward_branch_and_its_target():
  loop = tc.main_loop(SASS)
  assert tc.count(loop) == {"hgmma": 0, "hmma": 1, "ffma": 1, "local_ld_st": 0}
  assert tc.count(SASS) == {"hgmma": 0, "hmma": 1, "ffma": 2, "local_ld_st": 1}
  assert tc.main_loop(SASS.replace("@P0 BRA 0x20", "@P0 BRA 0x60")) == ""  # forward: no loop


def test_targets_need_no_spills_shared_memory_within_a_block_and_matrix_units_in_the_loop():
  loop = {"hgmma": 0, "hmma": 4, "ffma": 1, "local_ld_st": 0}
  clean = dict(
    status="ok", spill_store_bytes=0, spill_load_bytes=0, shared_bytes=1024, sass_loop=loop
  )
  assert tc.meets_targets(clean)
  assert not tc.meets_targets({**clean, "spill_load_bytes": 4})
  assert not tc.meets_targets({**clean, "shared_bytes": tc.SHARED_MEMORY_LIMIT_BYTES + 1})
  assert not tc.meets_targets({**clean, "sass_loop": {**loop, "hmma": 0}})
  assert not tc.meets_targets({"status": "timeout", "reason": "over 600 s"})
