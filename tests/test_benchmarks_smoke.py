"""Smoke test of the benchmarks: tiny runs write well-formed JSON, Markdown and the plot.

Both benchmarks run as subprocesses, side by side (compiling is mostly single-threaded), with XLA's
backend optimisation off (``--xla_backend_optimization_level=0``): this test checks the outputs'
form, never their speed, and that flag halves the compile time that dominates tiny runs. No
assertion depends on a measured time.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package.
  sys.path.insert(0, str(REPO_ROOT))

from benchmarks import attention, common, train_throughput
from primal_dual import kernels, registry

# 2 heads of 8 channels (SH ratios 1 and 4: two ratio groups, not the four of 8 heads): the same
# rows, records and targets, and a quarter less compiling.
ATTENTION_ARGS = ["--quick", "--dtypes", "float32", "--heads", "2", "--head-dim", "8"]
TRAIN_ARGS = ["--quick", "--variants", "softmax", "--device-counts", "2"]
TRAIN_ARGS += ["--dtypes", "float32,bfloat16"]
OK_STATUSES = {"ok", "skipped_memory", "skipped_time", "skipped_buffer"}


def _subprocess_env() -> dict[str, str]:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
  return env


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
  """Runs both benchmarks with --quick into a temporary folder; returns their output folders."""
  root = tmp_path_factory.mktemp("benchmarks")
  folders = {"attention": root / "attention", "train_throughput": root / "train"}
  args = {"attention": ATTENTION_ARGS, "train_throughput": TRAIN_ARGS}
  processes = {
    name: subprocess.Popen(
      [sys.executable, "-m", f"benchmarks.{name}", *args[name], "--out-dir", str(folder)],
      cwd=REPO_ROOT,
      env=_subprocess_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for name, folder in folders.items()
  }
  for name, process in processes.items():
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, f"{name} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}"
  return folders


def _positive_finite(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


# --- attention -----------------------------------------------------------------------------------


def test_attention_writes_json_markdown_and_plot(outputs):
  folder = outputs["attention"]
  payload = json.loads((folder / "attention.json").read_text())
  assert set(payload) == {"metadata", "config", "roofline", "targets", "records"}
  for key in ("device_label", "device_kind", "jax_version", "cpu_model", "date_utc", "command"):
    assert payload["metadata"][key], key
  markdown = (folder / "attention.md").read_text()
  assert "## Targets" in markdown and "| softmax |" in markdown
  assert (folder / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_has_every_case_length_dtype_and_pass(outputs):
  payload = json.loads((outputs["attention"] / "attention.json").read_text())
  config = payload["config"]
  assert config["lengths"] == list(attention.QUICK_LENGTHS)
  assert config["dtypes"] == ["float32"]
  cases = attention.all_cases(config["heads"], config["sh_ratios"], config["hyla_block"])
  assert list(config["cases"]) == [c.name for c in cases]
  assert {c.variant for c in cases} == set(registry.ATTENTION_REGISTRY)
  expected = {
    (c.name, n, d, p)
    for c in cases
    for n in config["lengths"]
    for d in config["dtypes"]
    for p in attention.PASSES
  }
  seen = {(r["kernel"], r["length"], r["dtype"], r["pass"]) for r in payload["records"]}
  assert seen == expected


def test_attention_records_are_finite_and_positive(outputs):
  payload = json.loads((outputs["attention"] / "attention.json").read_text())
  for dtype_name, roofline in payload["roofline"].items():
    assert _positive_finite(roofline["flops_per_s"]), dtype_name
  for r in payload["records"]:
    assert r["status"] in OK_STATUSES, r
    for field in ("analytic_flops", "peak_bytes", "argument_bytes", "output_bytes"):
      assert _positive_finite(r[field]), (field, r)
    assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] >= 0, r
    assert r["xla_flops"] is None or r["xla_flops"] >= 0, r
    if r["status"] == "ok":
      for field in (
        "time_s",
        "achieved_flops_per_s",
        "fraction_of_roofline",
        "time_vs_softmax",
        "time_vs_reference",
      ):
        assert _positive_finite(r[field]), (field, r)
      assert r["time_iqr_s"] >= 0 and r["repeats"] >= 1, r


def test_attention_targets_have_ratios(outputs):
  payload = json.loads((outputs["attention"] / "attention.json").read_text())
  targets = {t["name"]: t for t in payload["targets"]}
  assert set(targets) == set(attention.TARGETS)
  excesses = 0
  for name, t in targets.items():
    if "excess_by_length" in t["details"]:
      # Time ratio minus FLOP ratio: below 0 where a variant beats its FLOP ratio (seen on the CPU).
      excesses += 1
      assert isinstance(t["measured"], float) and math.isfinite(t["measured"]), (name, t)
    else:
      assert _positive_finite(t["measured"]), (name, t)
    assert t["status"] in {"PASS", "MISS"}, (name, t)
    assert _positive_finite(t["target"]) and t["lengths"], (name, t)
  assert excesses == 4  # SH and BN+SH, with and without key padding


def test_attention_markdown_renders_again_from_its_json(outputs):
  folder = outputs["attention"]
  payload = json.loads((folder / "attention.json").read_text())
  assert attention.render_markdown(payload) == (folder / "attention.md").read_text()


def test_a_newly_registered_variant_is_benchmarked_without_edits():
  name = "benchmark_smoke_scaled_softmax"
  registry.register_attention(
    name,
    lambda **options: functools.partial(_scaled_softmax, **options),
    "softmax of queries scaled by a learned per-head factor (test only)",
    params={
      "query_scale": registry.KernelParam(
        shape=lambda num_heads, head_dim: (num_heads,), init=nn.initializers.ones_init()
      )
    },
  )
  try:
    cases = attention.all_cases(heads=2, sh_ratios=(1, 2), hyla_block=4)
    (case,) = [c for c in cases if c.variant == name]
    assert attention.parse_args(["--quick", "--variants", name]).variants == [name]
    assert name in train_throughput.selected_variants(None)
    limits = attention.RunLimits(repeats=1, budget_s=1.0, time_cap_s=1.0, memory_cap_bytes=2**30)
    shape = attention.Shape(batch=1, length=8, heads=2, head_dim=4)
    record = attention.measure(case, shape, "float32", "forward_backward", limits, None)
    assert record["status"] == "ok", record
    softmax_case = attention.variant_cases("softmax", 2, (1, 2), 4)[0]
    assert record["analytic_flops"] == 3 * attention.forward_flops(softmax_case, shape)
  finally:
    del registry.ATTENTION_REGISTRY[name]


def _scaled_softmax(query, key, value, bias=None, mask=None, *, query_scale, **flax_arguments):
  # [heads] → [1..., heads, 1]: explicit axes (no rank promotion) against [batch, q, heads, d].
  scale = jnp.reshape(query_scale.astype(query.dtype), (1,) * (query.ndim - 2) + (-1, 1))
  scaled = query * scale
  return kernels.softmax_attention(scaled, key, value, bias=bias, mask=mask, **flax_arguments)


# --- train_throughput ----------------------------------------------------------------------------


def test_train_throughput_writes_json_and_markdown(outputs):
  folder = outputs["train_throughput"]
  payload = json.loads((folder / "train_throughput.json").read_text())
  assert set(payload) == {"metadata", "config", "records"}
  records = payload["records"]
  assert {(r["model"], r["variant"], r["num_devices"], r["dtype"]) for r in records} == {
    (model, "softmax", 2, dtype)
    for model in ("uea", "listops")
    for dtype in ("float32", "bfloat16")
  }
  for r in records:
    assert r["status"] == "ok", r
    for field in ("time_s", "steps_per_s", "tokens_per_s", "compile_s", "num_params"):
      assert _positive_finite(r[field]), (field, r)
    assert math.isclose(r["tokens_per_s"], r["steps_per_s"] * r["tokens_per_step"])
  speedups = train_throughput.bfloat16_speedups(records)
  assert {(s["model"], s["num_devices"]) for s in speedups} == {("uea", 2), ("listops", 2)}
  for s in speedups:
    assert math.isclose(s["speedup"], s["float32_ms"] / s["bfloat16_ms"])
  markdown = (folder / "train_throughput.md").read_text()
  assert "## Steps per second" in markdown and "bfloat16 compute against float32" in markdown


# --- Pure helpers (no compilation) ---------------------------------------------------------------


def test_result_paths_keep_cpu_names_and_suffix_other_devices(tmp_path):
  assert common.result_path(tmp_path, "attention", "json", "cpu") == tmp_path / "attention.json"
  assert (
    common.result_path(tmp_path, "attention", "json", "gpu-h100")
    == tmp_path / "attention_gpu-h100.json"
  )


def test_timing_summary_and_budget():
  timing = common.summarize_samples([1.0, 2.0, 3.0, 4.0, 100.0])
  assert timing.median_s == 3.0 and timing.iqr_s == 2.0
  assert common.repeats_within_budget(10.0, repeats=5, budget_s=30.0) == 3
  assert common.repeats_within_budget(100.0, repeats=5, budget_s=30.0) == 1
  assert common.repeats_within_budget(0.001, repeats=5, budget_s=30.0) == 5


def test_device_count_env_replaces_the_count():
  env = train_throughput.device_count_env(
    8, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --foo=1"}
  )
  assert env["XLA_FLAGS"].split() == ["--foo=1", "--xla_force_host_platform_device_count=8"]


def test_scaled_head_flops_reduce_to_softmax_and_shrink_with_ratios():
  shape = attention.Shape(batch=2, length=64, heads=8, head_dim=16)
  (softmax_case, *_) = attention.variant_cases("softmax", 8, (1,) * 8, 8)
  (unpooled, *_) = attention.variant_cases("sh", 8, (1,) * 8, 8)
  softmax_flops = attention.forward_flops(softmax_case, shape)
  assert attention.forward_flops(unpooled, shape) == softmax_flops
  assert attention.default_sh_ratios(8) == (1, 1, 2, 2, 4, 4, 8, 8)
  (pooled, *_) = attention.variant_cases("sh", 8, attention.default_sh_ratios(8), 8)
  cost = attention.forward_flops(pooled, shape) / softmax_flops
  assert 0.45 < cost < 0.55  # (1/8)·Σ 1/r_h = 0.469, ceil(N / r) rounding up.


def test_targets_pass_miss_and_missing_data():
  def record(kernel, length, time_s, peak_bytes=100, dtype="bfloat16"):
    return {
      "kernel": kernel,
      "length": length,
      "dtype": dtype,
      "pass": "forward_backward",
      "time_s": time_s,
      "peak_bytes": peak_bytes,
      "status": "ok",
    }

  records = [
    record("softmax", 4096, 1.0),
    record(attention.FUSED_REFERENCE, 4096, 1.0),
    record("bn", 4096, 2.0),
    record("softmax", 4096, 5.0, dtype="float32"),  # Targets read bfloat16 when there is any.
  ]
  cases = attention.all_cases(heads=8, sh_ratios=attention.default_sh_ratios(8), hyla_block=128)
  targets = {t["name"]: t for t in attention.evaluate_targets(records, cases)}
  assert targets["softmax_vs_fused_reference"]["status"] == "PASS"
  assert targets["bn_vs_softmax"]["status"] == "MISS"
  assert targets["sh_time_vs_flop_ratio"]["status"] == "N/A"
  assert targets["peak_memory_linear"]["status"] == "PASS"
  assert targets["bn_sh_time_vs_flop_ratio"]["status"] == "N/A"
  assert targets["sh_peak_memory_linear"]["status"] == "N/A"
  # SH and BN+SH at their FLOP ratio (0.46875 + 0.1 allowed); SH memory linear from 4k to 32k.
  flops = {"softmax": 1.0, "sh": 0.46875, "bn_sh": 0.46875}
  more = [
    {**record(name, n, time_s, peak_bytes=peak), "analytic_flops": flops[name]}
    for name, n, time_s, peak in (
      ("softmax", 32768, 1.0, 100),
      ("sh", 4096, 0.5, 100),
      ("sh", 32768, 0.6, 1000),
      ("bn_sh", 32768, 0.7, 100),
    )
  ]
  records[0]["analytic_flops"] = 1.0
  targets = {t["name"]: t for t in attention.evaluate_targets(records + more, cases)}
  assert targets["sh_time_vs_flop_ratio"]["status"] == "MISS"  # 0.6 - 0.469 > 0.1 at 32k
  assert targets["sh_time_vs_flop_ratio"]["measured"] == pytest.approx(0.6 - 0.46875)
  assert targets["bn_sh_time_vs_flop_ratio"]["status"] == "MISS"
  assert targets["sh_peak_memory_linear"]["measured"] == pytest.approx(1000 / 100 / 8)
  assert targets["sh_peak_memory_linear"]["status"] == "PASS"  # 1.25 <= 1.25
  more[2]["peak_bytes"] = 1001
  targets = {t["name"]: t for t in attention.evaluate_targets(records + more, cases)}
  assert targets["sh_peak_memory_linear"]["status"] == "MISS"


def test_dense_cases_over_the_buffer_cap_are_not_compiled(monkeypatch):
  shape = attention.Shape(batch=1, length=32, heads=2, head_dim=8)
  dense = attention.Case(
    "softmax[implementation=reference]", "softmax", {"implementation": "reference"}
  )
  fn = attention.build_attention(dense, shape, jnp.float32)
  inputs = attention.make_inputs(shape, jnp.float32)
  # The [B, H, N, N] float32 logits are the largest buffer.
  assert attention.largest_buffer_bytes(fn, *inputs) == 1 * 2 * 32 * 32 * 4
  compiled = []
  monkeypatch.setattr(common, "compile_for", lambda *a: compiled.append(a) or 1 / 0)
  limits = attention.RunLimits(1, 1.0, 1.0, 2.0**40, buffer_cap_bytes=8191)
  record = attention.measure(dense, shape, "float32", "forward", limits, None)
  assert record["status"] == "skipped_buffer" and not compiled
  assert record["largest_buffer_bytes"] == 8192 and "peak_bytes" not in record
  assert "not compiled" in record["reason"]
  # At the cap it is compiled (here: the stub fails, reported as a compile error).
  limits = limits._replace(buffer_cap_bytes=8192)
  record = attention.measure(dense, shape, "float32", "forward", limits, None)
  assert compiled and record["status"] == "error" and record["reason"].startswith("compile")
  args = attention.parse_args(["--buffer-cap-gib", "0.5", "--lengths", "1024,32768"])
  assert args.buffer_cap_gib == 0.5 and args.lengths == [1024, 32768]


def test_small_models_benchmark_times_the_trainers_step(tmp_path):
  from benchmarks import small_models

  assert (
    small_models.main(
      [
        "--quick",
        "--models",
        "logic",
        "--variants",
        "linear_plain",
        "--steps-per-call",
        "2",
        "--replicas",
        "1,4",
        "--sweep",
        "lr_wd_seeds",
        "--repeats",
        "1",
        "--out-dir",
        str(tmp_path),
      ]
    )
    == 0
  )
  payload = json.loads((tmp_path / "small_models.json").read_text())
  row, pair = payload["rows"]
  assert (row["model"], row["variant"], row["steps_per_call"], row["replicas"], row["data"]) == (
    "logic",
    "linear_plain",
    2,
    1,
    "device",
  )
  assert pair["replicas"] == 4 and pair["sweep"] == "lr_wd_seeds" and pair["ms_per_step"] > 0
  assert row["ms_per_step"] > 0 and math.isclose(row["model_steps_per_s"], 1e3 / row["ms_per_step"])
  markdown = (tmp_path / "small_models.md").read_text()
  assert "| logic | linear_plain | 2 | 1 | single run | device |" in markdown


def test_small_models_replicas_of_the_paper_preset_keep_a_held_out_split_per_seed():
  """The paper presets draw the held-out split per seed; replicas of N seeds (on device batches)
  are one program with N data groups: the grid's own program."""
  from benchmarks import small_models

  for model in small_models.MODELS:
    program, _ = small_models.build(  # the data groups are set when the program is built
      small_models.Measurement(model, "linear_plain", 2, True, True, num_replicas=2),
      initialize=False,
    )
    assert program.data.num_groups == 2


def test_the_replica_program_is_not_unrolled_per_replica():
  """The grid's training program for 4 replicas (2 lr × 2 weight decays, on device batches)
  lowers for CUDA to about as many ops as one replica's: the replica axis is vmapped, so a
  replica adds work to each kernel, not kernels (a per-replica loop would multiply them)."""
  from benchmarks import small_models

  def total(replicas):
    m = small_models.Measurement(
      "sraven", "hyla", 2, True, True, num_replicas=replicas, sweep="lr_wd_seeds"
    )
    return sum(small_models.lowered_op_counts(m).values())

  one, four = total(1), total(4)
  assert one > 100 and four < 1.3 * one, (one, four)


def test_hylas_fused_rows_where_they_compile_and_the_hyla_target_reads_the_fastest(monkeypatch):
  fused = ["hyla[implementation=tensorcore]"]
  names = [case.name for case in attention.variant_cases("hyla", 2, (1, 2), 4)]
  assert not set(fused) & set(names)  # on this CPU the fused kernels only interpret
  monkeypatch.setattr(attention, "FUSED_BACKENDS", (jax.default_backend(),))
  cases = attention.variant_cases("hyla", 2, (1, 2), 4)
  assert [case.name for case in cases] == [*names, *fused]
  # The tensor-core kernel (131 ms at 8k on an H100, against the blockwise path's 199).
  assert attention._blockwise_hyla(cases) == "hyla[implementation=tensorcore]"
  assert attention._blockwise_hyla(cases[:-1]) == "hyla[block_size=4]"
  # Pallas's HYLA kernel is gone: no row for it.
  assert attention.FUSED_IMPLEMENTATIONS == ("tensorcore",)


def test_key_padded_rows_pass_lengths_and_feed_the_padded_sh_targets():
  cases = attention.all_cases(2, (1, 2), 4, ["softmax", "sh"])
  padded = [c for c in cases if c.key_padding]
  assert [c.name for c in padded] == [
    "fused_reference[key_padding]",
    "softmax[key_padding]",
    "sh[key_padding]",
  ]
  shape = attention.Shape(batch=2, length=16, heads=2, head_dim=4)
  q, k, v = attention.make_inputs(shape, jnp.float32)
  keep = attention.valid_key_length(16)
  assert keep == 14
  for case in padded:  # jitted, as the benchmark runs them (eagerly: ~180 tiny compilations)
    out = jax.jit(attention.build_attention(case, shape, jnp.float32))(q, k, v)
    plain = jax.jit(attention.build_attention(case._replace(key_padding=False), shape, jnp.float32))
    # Only the kept keys count: the padded row equals the plain call on the first 14 keys.
    assert jnp.allclose(out, plain(q, k[:, :keep], v[:, :keep]), rtol=1e-5, atol=1e-6)
    assert not jnp.allclose(out, plain(q, k, v))
  records = []
  for name, time_s, flops in [
    ("softmax", 1.0, 10.0),
    ("sh", 0.6, 5.0),
    ("softmax[key_padding]", 1.0, 10.0),
    ("sh[key_padding]", 0.9, 5.0),
  ]:
    records.append(
      {
        "kernel": name,
        "length": 4096,
        "dtype": "bfloat16",
        "pass": attention.TARGET_PASS,
        "time_s": time_s,
        "analytic_flops": flops,
      }
    )
  index = attention.RecordIndex(records)
  assert attention.target_sh_vs_flop_ratio(index, cases)["measured"] == pytest.approx(0.1)
  assert attention.target_sh_padded_vs_flop_ratio(index, cases)["measured"] == pytest.approx(0.4)


def test_written_bytes_splits_attention_matrices_from_the_rest_and_skips_fused_bodies():
  from benchmarks import step_traffic

  hlo = "\n".join(
    [
      "%fused_computation (p: f32[2,3,5,5]) -> f32[2,3,5,5] {",
      "  %inner = f32[2,3,5,5]{3,2,1,0} multiply(%p, %p)",  # inside a fusion: not written
      "}",
      "ENTRY %main (a: f32[2,3,5,5]) -> f32[2,5,4] {",
      "  %a = f32[2,3,5,5]{3,2,1,0} parameter(0)",
      "  %f = f32[2,3,5,5]{3,2,1,0} fusion(%a), kind=kLoop, calls=%fused_computation",
      "  %m = pred[2,3,5,5]{3,2,1,0} compare(%f, %f), direction=GT",
      "  %g = f32[2,5,4]{2,1,0} dot(%f, %f)",
      "  %b = f32[2,5,4]{2,1,0} bitcast(%g)",
      "  ROOT %r = f32[2,5,4]{2,1,0} add(%g, %g)",
      "}",
    ]
  )
  split = step_traffic.written_bytes(hlo, seq_len=5)
  assert split == {"attention_matrix": 150 * 4 + 150, "other": 2 * 40 * 4}


def test_step_traffic_reports_the_programs_cost_and_compares_with_measured_rows(tmp_path):
  """One replica's one-step program has FLOPs and bytes, attention matrices among what it
  writes; the floor beside a measured row is its bytes over the device's bandwidth."""
  from benchmarks import small_models, step_traffic

  row = step_traffic.traffic_row(small_models.Measurement("sraven", "softmax", 1, True, True))
  assert row["gflop"] > 0 and row["gb_accessed"] > 0
  assert row["gb_written_attention_matrix"] > 0 and row["gb_written_other"] > 0
  device = "NVIDIA H200"
  measured = dict(model="sraven", variant="softmax", replicas=24, steps_per_call=100)
  measured.update(device=device, ms_per_step=2.0, source="x.json")
  [compared] = step_traffic.compare([row], [measured])
  floor_ms = row["gb_accessed"] * 1e9 / step_traffic.BANDWIDTH[device] * 1e3
  assert compared["floor_ms"] == pytest.approx(floor_ms)
  assert compared["measured_over_floor"] == pytest.approx(2.0 / floor_ms)
  assert step_traffic.compare([row], [dict(measured, device="unknown chip")]) == []
