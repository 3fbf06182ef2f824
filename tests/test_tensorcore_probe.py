"""The tensor-core kernels' device probe (tools/device/tensorcore_probe.py), run by Triton's
interpreter on the CPU: every pattern right here, so that a wrong row on a GPU is the compiler's."""

import json

import numpy as np
import gpu_dev
import pytest

gpu_dev.require()  # triton and torch: skipped, saying so, without them

from tools.device import tensorcore_probe as probe  # noqa: E402


def test_every_pattern_and_operand_dtype_is_right_in_the_interpreter(tmp_path):
  out = tmp_path / "probe.json"
  assert probe.main(["--interpret", f"--out={out}"]) == 0
  written = json.loads(out.read_text())
  rows = written["rows"]
  assert written["environment"]["triton"]
  expected = {(name, ops) for name, (_, operands) in probe.PATTERNS.items() for ops in operands}
  assert {(r["pattern"], r["operands"]) for r in rows} == expected
  wrong = [r for r in rows if not r["ok"]]
  assert not wrong, wrong
  assert all(r["relative_error"] < 1e-6 for r in rows)  # exact products; float32 sums


def test_a_wrong_or_raising_pattern_is_a_row_that_is_not_ok(monkeypatch):
  def wrong(launch, operands, warps, rng):
    ref = rng.normal(size=(4, 4))
    return ref * 1.1, ref

  def raising(launch, operands, warps, rng):
    raise RuntimeError("PassManager::run failed")

  patterns = {"wrong": (wrong, ("bf16",)), "raising": (raising, ("fp32",))}
  monkeypatch.setattr(probe, "PATTERNS", patterns)
  rows = probe.probe(interpret=True, warps=(4,), log=lambda line: None)
  assert [(r.pattern, r.ok) for r in rows] == [("wrong", False), ("raising", False)]
  assert rows[0].relative_error == pytest.approx(0.1)
  assert rows[1].relative_error is None and "PassManager" in rows[1].error


def test_rounding_matches_the_dtypes():
  x = np.array([1.0 + 2.0**-9, 1.0 + 2.0**-12, 1.0 + 2.0**-30])
  assert list(probe.rounded(x, "bf16")) == [1.0, 1.0, 1.0]
  assert list(probe.rounded(x, "fp16")) == [1.0 + 2.0**-9, 1.0, 1.0]
  assert list(probe.rounded(x, "ieee")) == [1.0 + 2.0**-9, 1.0 + 2.0**-12, 1.0]
