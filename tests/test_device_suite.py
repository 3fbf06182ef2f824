"""The device suite on the CPU at toy sizes: a report after every row, failing rows recorded, the
budget honoured; and the attention benchmark keeping cases whose kernel fails to build.

No assertion depends on a measured time (the budget test runs on a fake clock).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package.
  sys.path.insert(0, str(REPO_ROOT))

from benchmarks import attention, call_cost, device_suite
from primal_dual import registry


def _args(tmp_path, *extra):
  return device_suite.parse_args(
    ["--tiny", "--out-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), *extra]
  )


def _read(tmp_path):
  return json.loads((tmp_path / "device_suite.json").read_text())


def test_report_after_every_row_and_failures_recorded(tmp_path):
  args = _args(tmp_path, "--variants", "softmax", "--lengths", "16", "--sections", "attention")
  real = device_suite.build_rows(args, device_suite.sizes_of(args))
  assert [r.name for r in real] == [
    "fused_reference N=16",
    "softmax N=16",
    "fused_reference[key_padding] N=16",
    "softmax[key_padding] N=16",
    "softmax[implementation=reference] N=16",
  ]
  seen = []

  def probe():  # what the JSON holds when the next row starts
    seen.append([r["row"] for r in _read(tmp_path)["records"]])
    return {"seen": len(seen[-1])}

  def broken():
    raise RuntimeError("kernel exploded")

  rows = [
    real[0],
    device_suite.Row("attention", "probe 1", "probe", probe),
    device_suite.Row("attention", "broken", "probe", broken),
    device_suite.Row("attention", "probe 2", "probe", probe),
    *real[1:],
  ]
  device_suite.run(args, rows, log=lambda line: None)
  assert seen == [["fused_reference N=16"], ["fused_reference N=16", "probe 1", "broken"]]
  payload = _read(tmp_path)
  by_row = {r["row"]: r for r in payload["records"]}
  assert list(by_row) == [row.name for row in rows]
  assert by_row["broken"]["status"] == "failed"
  assert "RuntimeError: kernel exploded" in by_row["broken"]["reason"]
  for name in ("fused_reference N=16", "softmax N=16", "softmax[implementation=reference] N=16"):
    assert by_row[name]["status"] == "ok", by_row[name]
    assert by_row[name]["time_s"] > 0
  assert by_row["softmax N=16"]["time_vs_reference"] > 0
  assert {t["name"] for t in payload["attention_targets"]} == set(attention.TARGETS)
  markdown = (tmp_path / "device_suite.md").read_text()
  assert "kernel exploded" in markdown and "## Attention targets" in markdown
  assert any((tmp_path / "cache").iterdir())  # the persistent compilation cache was written


class FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_budget_skips_rows_that_do_not_fit(tmp_path):
  clock = FakeClock()
  budget = device_suite.Budget(100.0, clock)

  def takes(seconds):
    def measure():
      clock.now += seconds
      return {}

    return measure

  rows = [
    device_suite.Row("attention", "a", "g", takes(30)),  # prior 10 s: runs, takes 30
    device_suite.Row("attention", "b", "g", takes(30)),  # estimate 30, 70 left: runs
    device_suite.Row("attention", "c", "g", takes(30)),  # estimate 30, 40 left: runs
    device_suite.Row("attention", "d", "g", takes(1)),  # estimate 30, 10 left: skipped
    device_suite.Row("attention", "e", "h", takes(6)),  # new group, prior 10 s, 10 left: runs
    device_suite.Row("attention", "f", "h", takes(1)),  # estimate 6 (measured), 4 left: skipped
  ]
  device_suite.run(_args(tmp_path), rows, budget, log=lambda line: None)
  records = _read(tmp_path)["records"]
  assert [r["status"] for r in records] == ["ok", "ok", "ok", "skipped", "ok", "skipped"]
  assert records[3]["reason"].startswith("budget: estimated 30.0 s, 10.0 s left")
  assert records[5]["reason"].startswith("budget")


@pytest.mark.slow
def test_command_line_small_models_and_step_breakdown(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
  command = [sys.executable, "-m", "benchmarks.device_suite", "--tiny", "--out-dir", str(tmp_path)]
  command += ["--cache-dir", str(tmp_path / "cache"), "--sections", "small_models,step_breakdown"]
  command += ["--models", "logic", "--model-variants", "softmax", "--replicas", "1"]
  done = subprocess.run(
    command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert done.returncode == 0, done.stderr[-4000:]
  records = _read(tmp_path)["records"]
  assert [r["row"] for r in records] == ["logic softmax K=2 N=1", "sraven softmax step parts"]
  assert all(r["status"] == "ok" for r in records), records
  assert records[0]["model_steps_per_s"] > 0
  parts = ("data_ms", "forward_ms", "forward_backward_update_ms", "trainer_step_ms")
  assert all(records[1][part] > 0 for part in parts)
  assert records[1]["evaluation_s"] > 0


def test_device_label_names_the_chip(monkeypatch):
  class Device:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

  monkeypatch.setattr(device_suite.jax, "devices", lambda: [Device()])
  assert device_suite.device_label() == "gpu-h100"


# --- benchmarks.attention: a case whose kernel fails to build is kept and recorded -------------


def _failing_factory(error):
  def make_attention_fn(name, options):
    def attention_fn(query, key, value, implementation="auto"):
      raise error

    return attention_fn

  return make_attention_fn


def test_attention_probe_keeps_a_case_that_fails_to_build(monkeypatch):
  monkeypatch.setattr(registry, "make_attention_fn", _failing_factory(RuntimeError("no GPU")))
  assert attention._serves("softmax", {}, heads=2)
  monkeypatch.setattr(registry, "make_attention_fn", _failing_factory(ValueError("refused")))
  assert not attention._serves("softmax", {}, heads=2)


def test_attention_measure_records_a_build_failure(monkeypatch):
  def broken(name, options):
    raise RuntimeError("cannot build")

  monkeypatch.setattr(registry, "make_attention_fn", broken)
  case = attention.Case("softmax", "softmax", {})
  limits = attention.RunLimits(1, 1.0, 1.0, 2**30)
  record = attention.measure(
    case, attention.Shape(1, 8, 2, 4), "float32", "forward", limits, previous=None
  )
  assert record["status"] == "error"
  assert record["reason"].startswith("build: RuntimeError: cannot build")


# --- The call-cost rows: one forward + backward per program against several in one ---------------


def test_call_cost_splits_a_program_from_its_calls():
  assert call_cost.split_cost(1.0, 4.5, 8) == {"per_call_s": 0.5, "fixed_s": 0.5}
  with pytest.raises(ValueError, match="calls must be at least 2"):
    call_cost.split_cost(1.0, 1.0, 1)
  # Each call of the program reads its own inputs.
  xs = [jnp.arange(3.0) + i for i in range(4)]
  outs = call_cost.repeated(lambda q, k, v: q * k + v, 4)(*(jnp.stack(xs),) * 3)
  for out, x in zip(outs, xs):
    np.testing.assert_array_equal(out, x * x + x)


def test_call_cost_rows_of_softmax_sh_and_bn_sh(tmp_path):
  args = _args(tmp_path, "--sections", "call_cost", "--lengths", "16")
  rows = device_suite.build_rows(args, device_suite.sizes_of(args))
  calls = call_cost.DEFAULT_CALLS
  assert [r.name for r in rows] == [f"{v} N=16 1 vs {calls} calls" for v in call_cost.VARIANTS]
  device_suite.run(args, rows, log=lambda line: None)
  records = _read(tmp_path)["records"]
  assert [r["status"] for r in records] == ["ok"] * 3, records
  for record in records:
    assert record["calls"] == calls and record["length"] == 16
    assert record["one_call_s"] > 0 and record["calls_s"] > 0
    assert record["per_call_s"] + record["fixed_s"] == pytest.approx(record["one_call_s"])
  assert "## A call's fixed cost" in (tmp_path / "device_suite.md").read_text()


def test_hyla_mosaic_rows_run_the_kernel_and_carry_the_prediction(tmp_path, monkeypatch):
  full = device_suite.hyla_mosaic_rows(device_suite.FULL)
  assert [r.name for r in full][:2] == [
    "hyla mosaic forward N=4096 e_tile=64",
    "hyla mosaic forward N=4096 e_tile=32",
  ]
  assert len(full) == 2 * len(device_suite.FULL.lengths)
  args = _args(tmp_path, "--sections", "hyla_mosaic", "--lengths", "16")
  # At the latency model's shape (H 8, d 64) the prediction is attached: the model's shape set to
  # the toy one here, so that the interpreted kernel stays small.
  from tools.device import hyla_latency_model

  monkeypatch.setattr(hyla_latency_model, "HEADS", device_suite.TINY.heads)
  monkeypatch.setattr(hyla_latency_model, "HEAD_DIM", 16)
  device_suite.run(args, log=lambda line: None)
  records = _read(tmp_path)["records"]
  assert [r["status"] for r in records] == ["ok"] * 2, records
  assert [r["e_tile"] for r in records] == [16, 8]
  for record in records:
    assert record["time_ms"] > 0 and record["predicted_ms"] > 0
    assert record["predicted_over_measured"] == pytest.approx(
      record["predicted_ms"] / record["time_ms"]
    )
  assert "## HYLA's Mosaic GPU forward kernel" in (tmp_path / "device_suite.md").read_text()
