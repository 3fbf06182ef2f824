"""The staged HYLA emulation (issue #52 (a)) against the references, and the latency model (b) on
its committed constants (no timing)."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import hyla_ref

from tools.device import hyla_latency_model as hlm
from primal_dual.kernels import hyla
from primal_dual.kernels.hyla import mosaic
from primal_dual.kernels.hyla import staged as hs

BF16_UNIT_ROUNDOFF = 2.0**-8  # bfloat16: 8 significand bits, round to nearest
CASES = [(n, v) for n in hs.NORMALIZATIONS for v in hs.VALUE_NETWORKS]


def _inputs(seed, batch=2, q_len=70, kv_len=37, heads=4, d=8):
  """Ragged lengths: 70 queries are two 64-query programs, 37 keys three 16-key blocks."""
  rng = np.random.default_rng(seed)
  shapes = [(batch, q_len, heads, d), (batch, kv_len, heads, d), (batch, kv_len, heads, d)]
  return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _bf16(x):
  return np.asarray(np.asarray(x, np.float32).astype(jnp.bfloat16), np.float64)


def _stages64(q, k, v, normalization, value_network, round_stages):
  """Float64 ``(out, a, u)`` of HYLA with ``a`` and ``u`` rounded to bfloat16 or not."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
  if normalization == "rms_head":
    s = s / np.sqrt(np.mean(s**2, axis=1, keepdims=True) + hs.RMS_EPS)
  a = _bf16(s) if round_stages else s
  z = np.einsum("bhij,bjhe->bije", a, v)
  u = np.maximum(z, 0.0) if value_network == "mlp_relu" else z
  u = _bf16(u) if round_stages else u
  return np.einsum("bhij,bije->bihe", a, u), s, u, z


@pytest.mark.parametrize("normalization, value_network", CASES)
def test_float32_stages_match_the_float64_reference_and_hyla(normalization, value_network):
  q, k, v = _inputs(0)
  options = dict(normalization=normalization, value_network=value_network)
  ref, _ = hyla_ref(q, k, v, **options)
  staged = np.asarray(hs.hyla_staged(q, k, v, stage_dtype=jnp.float32, **options))
  dense = np.asarray(hyla.hyla_attention(q, k, v, block_size=None, **options))
  scale = np.abs(ref).max()
  assert staged.shape == ref.shape
  np.testing.assert_allclose(staged, ref, atol=1e-5 * scale, rtol=0)
  np.testing.assert_allclose(staged, dense, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("normalization, value_network", CASES)
def test_bfloat16_stages_round_where_the_kernel_does(normalization, value_network):
  """Against the float64 function with ``a`` and ``u`` rounded to bfloat16 (what the kernel
  computes up to float32 summation order): 1e-5; against the unrounded float64 reference: inside
  the first-order bound of the two roundings, 2u Σ_j |a_hij| (|u_ij| + Σ_g |a_gij v_gj|) with u =
  2⁻⁸, and outside float32's noise (the stages are rounded)."""
  q, k, v = (_bf16(x).astype(np.float32) for x in _inputs(1))
  options = dict(normalization=normalization, value_network=value_network)
  staged = np.asarray(hs.hyla_staged(q, k, v, **options))
  kernel_function, *_ = _stages64(q, k, v, normalization, value_network, round_stages=True)
  exact, a, u, _ = _stages64(q, k, v, normalization, value_network, round_stages=False)
  ref, _ = hyla_ref(q, k, v, **options)
  np.testing.assert_allclose(exact, ref, atol=1e-9 * np.abs(ref).max(), rtol=0)
  scale = np.abs(ref).max()
  np.testing.assert_allclose(staged, kernel_function, atol=1e-5 * scale, rtol=0)
  mixed = np.einsum("bhij,bjhe->bije", np.abs(a), np.abs(v.astype(np.float64)))
  bound = 2 * BF16_UNIT_ROUNDOFF * np.einsum("bhij,bije->bihe", np.abs(a), np.abs(u) + mixed)
  error = np.abs(staged - ref)
  assert np.all(error <= 1.01 * bound + 1e-5 * scale)
  assert error.max() > 1e-4 * scale


def test_bfloat16_stages_equal_hyla_attention_in_bfloat16():
  """The dense path rounds ``a`` and ``u`` at the same points; its output is bfloat16 too."""
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(2))
  staged = hs.hyla_staged(q, k, v).astype(jnp.bfloat16)
  dense = hyla.hyla_attention(q, k, v, block_size=None)
  assert dense.dtype == jnp.bfloat16
  assert np.mean(np.asarray(staged == dense)) >= 0.99


def test_key_block_update_stage_shapes_and_dtypes():
  q, k, v = (np.zeros((3, n, 4, 8), np.float32) for n in (hs.Q_TILE, hs.K_TILE, hs.K_TILE))
  acc = np.zeros((3, hs.Q_TILE, 8, 4), np.float32)
  options = dict(scale=1.0, normalization="rms_head", value_network="mlp_relu")
  acc, a, u = hs.key_block_update(acc, q, k, v, stage_dtype=jnp.bfloat16, **options)
  assert acc.shape == (3, 64, 8, 4) and a.shape == (3, 16, 64, 4) and u.shape == (3, 16, 64, 8)


def test_unsupported_options_raise():
  q, k, v = _inputs(3)
  with pytest.raises(ValueError, match="covers"):
    hs.hyla_staged(q, k, v, normalization="softmax")


# --- The latency model ------------------------------------------------------------------------

COMPILE_REPORT = Path(__file__).parent.parent / "benchmarks/results/gpu_compile.json"


@pytest.fixture(scope="module")
def payload():
  return hlm.build_payload(json.loads(COMPILE_REPORT.read_text()))


def test_the_model_reproduces_the_measured_h100_figures_within_30_percent(payload):
  measured = [r for r in payload["rows"] if r["measured_ms"] is not None]
  assert {(r["kernel"], r["length"]) for r in measured} >= {
    ("tensorcore", 4096),
    ("tensorcore", 8192),
    ("blockwise", 4096),
    ("blockwise", 8192),
  }
  for r in measured:
    assert 0.7 <= r["ratio"] <= 1.3, r
  assert sum(r["held_out"] for r in measured) == 3  # one fitted figure per family
  assert 300 < payload["fitted"]["stage_cycles"] < 600  # the README's 440, refitted


def test_the_totals_grow_as_the_square_of_the_length(payload):
  total = {(r["kernel"], r["length"]): r["predicted_ms"] for r in payload["rows"]}
  for kernel in ("tensorcore", "blockwise"):
    assert total[(kernel, 32768)] / total[(kernel, 8192)] == pytest.approx(16, rel=0.05)
    assert total[(kernel, 8192)] / total[(kernel, 4096)] == pytest.approx(4, rel=0.05)
  # The staged design: N / 64 programs fill 132 SMs only from N = 8448, so below it each
  # doubling of N doubles the busy SMs instead of the time (2×, not 4×).
  assert total[("staged", 8192)] / total[("staged", 4096)] == pytest.approx(2, rel=0.05)
  assert total[("staged", 32768)] / total[("staged", 8192)] == pytest.approx(16, rel=0.05)


def test_the_staged_counts_follow_the_tiling():
  design = hlm.STAGED
  assert design.macs == 8 * 64 + 16 * 64 + 64 * 8  # S, z (heads padded to K 16), out
  assert design.q_tile == hs.Q_TILE and design.k_tile == hs.K_TILE


def test_the_report_renders_from_its_json(payload, tmp_path):
  paths = hlm.common.write_reports(tmp_path, "hyla_latency_model", "cpu", payload, hlm.render)
  text = paths["markdown"].read_text()
  assert text == hlm.render(json.loads(paths["json"].read_text()))
  assert "| tensorcore | 8192 |" in text and "| staged | 32768 |" in text


def test_the_committed_report_is_current(payload):
  committed = Path(__file__).parent.parent / "benchmarks/results/hyla_latency_model.json"
  rows = json.loads(committed.read_text())["rows"]
  assert [r["predicted_ms"] for r in rows] == pytest.approx(
    [r["predicted_ms"] for r in payload["rows"]]
  )


def test_the_mosaic_forward_counts_follow_the_kernel():
  """One program's block: 64 × 16 pairs, (2H + 1)·e_tile CUDA-core operations per pair for the
  value network and 2·16 per head for the columns, four warps on four schedulers."""
  design = hlm.MosaicForward()
  assert (design.q_tile, design.k_tile) == (mosaic.Q_TILE, mosaic.K_TILE)
  row = hlm.mosaic_forward_prediction(8192, 32)
  ops = 64 * 16 * ((2 * 8 + 1) * 32 + 8 * 32)
  assert row["cycles_per_block"]["issue"] == pytest.approx(ops / 32 / 4)
  assert row["programs"] == 8192 // 64 * 2 and row["registers_for_accumulators"] == 128


def test_the_mosaic_forward_time_follows_its_waves(payload):
  rows = {(r["length"], r["e_tile"]): r for r in payload["mosaic_forward"]}
  # 64 programs at 4k (e_tile 64) half-fill 132 SMs; 128 and 256 programs are one and two waves.
  assert rows[(8192, 64)]["forward_ms"] / rows[(4096, 64)]["forward_ms"] == pytest.approx(2)
  assert rows[(8192, 32)]["waves"] == 2 and rows[(4096, 32)]["waves"] == 1
  committed = Path(__file__).parent.parent / "benchmarks/results/hyla_latency_model.json"
  assert json.loads(committed.read_text())["mosaic_forward"] == payload["mosaic_forward"]


def test_the_cuda_core_backward_counts_follow_its_formulas():
  """Per pair and program: the columns (2·16 per head), z, du and da (4H·e), u and dz (2e), ds
  (7 per head), and dk_dv's dv of its group (G·e); a program per 64 rows and head group."""
  for group in hlm.BACKWARD_HEAD_GROUPS:
    row = hlm.mosaic_backward_prediction(8192, group)
    recomputed = 8 * 32 + (4 * 8 + 2) * 64 + 8 * 7
    assert row["launches"]["dq"]["ops_per_pair"] == recomputed
    assert row["launches"]["dk_dv"]["ops_per_pair"] == recomputed + group * 64
    assert row["launches"]["dq"]["issue_cycles_per_block"] == pytest.approx(
      64 * 16 * recomputed / 32 / 4
    )
    assert row["programs_per_launch"] == 8192 // 64 * (8 // group)


def test_no_cuda_core_backward_reaches_five_times_cudnn_at_8k(payload):
  """The decision the model records: with the coupled products on CUDA cores the backward misses
  the issue's 5× at 8k in every head grouping and even at its floor (each pair's work once on
  every lane), and both groupings hold more accumulators than a thread has registers."""
  rows = {(r["length"], r["head_group"]): r for r in payload["mosaic_backward_on_cuda_cores"]}
  for group in hlm.BACKWARD_HEAD_GROUPS:
    row = rows[(8192, group)]
    assert row["vs_cudnn"] > row["floor_vs_cudnn"] > 5, row
    assert row["registers_for_accumulators"] > 255, row
  # Half the programs per launch with twice the heads each: half the time.
  assert rows[(8192, 2)]["backward_ms"] == pytest.approx(rows[(8192, 1)]["backward_ms"] / 2, 0.05)
  committed = Path(__file__).parent.parent / "benchmarks/results/hyla_latency_model.json"
  saved = json.loads(committed.read_text())["mosaic_backward_on_cuda_cores"]
  assert saved == payload["mosaic_backward_on_cuda_cores"]
