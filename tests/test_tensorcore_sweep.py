"""The tensorcore sweep on the CPU: every launch of every setting run at toy sizes in Triton's
interpreter, one report row each, and the budget honoured. No assertion depends on a measured
time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import gpu_dev
import pytest

gpu_dev.require()  # triton and torch: skipped, saying so, without them

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package.
  sys.path.insert(0, str(REPO_ROOT))

from tools.device import gpu_compile, tensorcore_sweep  # noqa: E402
from primal_dual.kernels.hyla import tensorcore as ht  # noqa: E402


def _run(tmp_path, *extra):
  args = tensorcore_sweep.parse_args(
    # No persistent compilation cache: JAX keeps the first one a process enables.
    ["--tiny", "--out-dir", str(tmp_path), "--cache-dir", ""]
    + ["--compile-report", str(tmp_path / "no_report.json"), *extra]
  )
  tensorcore_sweep.run(args, log=lambda line: None)
  return json.loads((tmp_path / "tensorcore_sweep.json").read_text())


def test_settings_start_with_the_default_and_stay_few():
  settings = tensorcore_sweep.settings()
  default, widened = settings[:2]
  for setting, dtype in ((default, jnp.bfloat16), (widened, jnp.float32)):
    tuning = ht.default_tuning(dtype, is_causal=False)
    assert (setting.block_size, setting.value_chunk) == (ht.DEFAULT_BLOCK_SIZE, tuning.value_chunk)
    assert (setting.launch_warps, setting.num_stages) == (
      tuple(tuning.num_warps),
      tuning.num_stages,
    )
  assert (default.operands, widened.operands) == ("bf16", "fp32")
  assert len(set(settings)) == len(settings) <= 2 + 8


def test_every_launch_of_every_setting_is_timed_in_one_report(tmp_path):
  payload = _run(tmp_path)
  records = payload["records"]
  settings = tensorcore_sweep.settings()
  assert len(records) == payload["config"]["rows"] == 1 + 3 * len(settings) + 1
  assert all(r["status"] == "ok" for r in records), [r["reason"] for r in records]
  check, timed = records[0], records[1:]
  assert check["row"].startswith(tensorcore_sweep.CHECK) and len(check["relative_errors"]) == 8
  assert check["max_relative_error"] <= tensorcore_sweep.CHECK_TOLERANCE
  default = tensorcore_sweep.setting_name(settings[0])
  assert [r["row"] for r in timed[:4]] == [
    f"{default} {launch}" for launch in ("forward", "dq_dk", "dv", "forward+backward")
  ]
  assert all(r["time_s"] > 0 and r["tflops"] > 0 for r in timed)
  assert timed[5]["setting"]["value_chunk"] == settings[1].value_chunk
  markdown = (tmp_path / "tensorcore_sweep.md").read_text()
  assert f"| {default} dq_dk |" in markdown and "(1, 32, 2, 16)" in markdown


def test_the_agreement_check_fails_past_its_tolerance(monkeypatch):
  monkeypatch.setattr(tensorcore_sweep, "CHECK_TOLERANCE", 0.0)
  shape = gpu_compile.Shape(batch=1, length=17, heads=2, head_dim=4)
  with pytest.raises(AssertionError, match="relative error"):
    tensorcore_sweep.agreement(shape, interpret=True)


def test_rows_over_the_budget_are_skipped_and_reported(tmp_path):
  records = _run(tmp_path, "--budget-s", "0")["records"]
  assert {r["status"] for r in records} == {"skipped"}
  assert records[0]["reason"].startswith("budget: estimated")


def test_forward_and_backward_flops_sum_the_launches():
  shape = gpu_compile.Shape(batch=1, length=8192, heads=8, head_dim=64)
  whole = tensorcore_sweep.launch_flops(tensorcore_sweep.WHOLE, shape)
  assert whole == sum(tensorcore_sweep.launch_flops(n, shape) for n in tensorcore_sweep.LAUNCHES)
  assert whole == 2 * 8192**2 * 8 * 64 * 14


def test_rows_carry_the_compile_reports_estimate(tmp_path):
  setting, other = tensorcore_sweep.settings()[:2]
  shape = tensorcore_sweep.FULL.shape
  records = [
    {"family": "tensorcore", **setting._asdict(), "kernel": kernel, "estimate_ms": ms}
    for kernel, ms in (("forward", 1.0), ("dq_dk", 2.0), ("dv", 3.0))
  ]
  path = tmp_path / "gpu_compile.json"
  path.write_text(
    json.dumps({"config": {"shapes": {"tensorcore": list(shape)}}, "records": records})
  )
  estimates = tensorcore_sweep.compile_estimates(path, shape)
  assert tensorcore_sweep.estimate_of(estimates, setting, "dq_dk") == 2.0
  assert tensorcore_sweep.estimate_of(estimates, setting, tensorcore_sweep.WHOLE) == 6.0
  assert tensorcore_sweep.estimate_of(estimates, other, "dv") is None
  assert tensorcore_sweep.compile_estimates(path, tensorcore_sweep.TINY.shape) == {}
  assert tensorcore_sweep.compile_estimates(tmp_path / "absent.json", shape) == {}
