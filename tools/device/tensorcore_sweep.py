"""Each launch of the tensor-core HYLA kernels timed alone on a GPU, over a few clean settings.

``python -m tools.device.tensorcore_sweep --budget-s 150`` times, for the default setting of
``primal_dual/kernels/hyla/tensorcore.py``, the default of float32 operands (bfloat16 inputs
widened, as a GPU call runs them by default) and a handful of other tiles, value chunks and warps
(each one clean in the sm_90a compile report: no spills, shared memory within a block), the three
launches separately — ``forward``, ``dq_dk`` (dq, dk and a bias gradient), ``dv`` — and the whole
forward + backward (``jax.vjp``) of the default, at N = 8192, H = 8, d = d_v = 64, bfloat16, batch
1, no mask or bias, one row each. A row is compiled by its first call, then timed over five warm
calls after one warm-up (median and interquartile range); its TFLOP/s count the launch's
analytic FLOPs (:data:`LAUNCH_FLOPS`, the heads unpadded), beside the compile report's time
estimate for the same setting and launch (``--compile-report``). A first row checks the default
kernels on the device against the blockwise XLA path (:func:`agreement`).

The rows run in order (the check, the default setting, its forward + backward), each skipped
when its estimated cost (the slowest row of its launch so far, else a prior) exceeds the time
left in ``--budget-s``; a failing row is recorded and the sweep goes on; the reports
(``tensorcore_sweep_<label>.{json,md}`` in ``--out-dir``) are rewritten after every row — the
device suite's machinery (``benchmarks/device_suite.py``). ``--tiny`` runs every row at toy
sizes in Triton's interpreter (the CPU test).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, device_suite
from tools.device import gpu_compile

STEM = "tensorcore_sweep"
LAUNCHES = ("forward", "dq_dk", "dv")
WHOLE = "forward+backward"


class Sizes(NamedTuple):
  """The sweep's shape and repeats, and the agreement check's shape: on a GPU, or toy ones
  (``--tiny``, interpreted)."""

  shape: gpu_compile.Shape
  repeats: int
  check_shape: gpu_compile.Shape


FULL = Sizes(
  gpu_compile.Shape(batch=1, length=8192, heads=8, head_dim=64),
  repeats=5,
  check_shape=gpu_compile.Shape(batch=2, length=1000, heads=8, head_dim=64),
)
TINY = Sizes(
  gpu_compile.Shape(batch=1, length=32, heads=2, head_dim=16),
  repeats=1,
  check_shape=gpu_compile.Shape(batch=2, length=40, heads=3, head_dim=17),
)
CHECK = "agreement with blockwise"
# Largest |tensorcore - blockwise| / max |blockwise| of the output and each gradient the check
# accepts (float32 inputs and products on both paths: they differ by summation order only).
CHECK_TOLERANCE = 1e-3


def settings() -> list[gpu_compile.TensorcoreSetting]:
  """The default setting, the widened one, then the others (tile, value chunk, warps of
  forward/dq_dk/dv), each clean in the sm_90a compile report at N = 8192: the lease-1 tiles and
  warps (chunk 16, 8 warps in the backward), chunk 16 with the default warps, and 8 warps for dv
  or the forward."""
  default = gpu_compile.tensorcore_default_setting()
  widened = gpu_compile.tensorcore_default_setting("fp32")  # a GPU call's bfloat16 default
  others = ((16, 16, (4, 8, 8)), (16, 16, (4, 8, 4)), (16, 32, (4, 8, 8)), (16, 32, (8, 8, 4)))
  return [default, widened] + [
    default._replace(block_size=tile, value_chunk=chunk, launch_warps=warps)
    for tile, chunk, warps in others
  ]


def setting_name(setting: gpu_compile.TensorcoreSetting) -> str:
  warps = "/".join(map(str, setting.launch_warps))
  name = f"tile {setting.block_size} chunk {setting.value_chunk} warps {warps}"
  return f"{name} stages {setting.num_stages} {setting.operands}"


# Multiply-adds per (query, key) pair and head, in units of d = d_v (×2 for FLOPs): the forward's
# q·k, z and out (3); dq_dk recomputes s (1) and, per value chunk, z, da from u, du and da from dz
# (4), then dk and dq (2); dv recomputes s and z, then du and dv (4: its chunk's da products are
# unused, and the compiler drops them).
LAUNCH_FLOPS = {"forward": 3, "dq_dk": 7, "dv": 4}


def launch_flops(launch: str, shape: gpu_compile.Shape) -> float:
  """Analytic FLOPs of one launch (``forward``, ``dq_dk``, ``dv``), or of the three summed."""
  pairs = shape.batch * shape.length**2 * shape.heads
  per_pair = sum(LAUNCH_FLOPS.values()) if launch == WHOLE else LAUNCH_FLOPS[launch]
  return 2.0 * pairs * per_pair * shape.head_dim


def inputs(shape: gpu_compile.Shape, seed: int = 0, operands: str = "bf16"):
  """bfloat16 ``q, k, v`` (held as float32 for ``operands`` ``fp32``: a GPU call's widening)
  and float32 ``dout`` (``[B, N, H, d]``), and the no-bias, no-mask placeholders the kernels
  take."""
  from primal_dual.kernels.hyla import tensorcore as ht

  rng = np.random.default_rng(seed)
  held = ht.rounding_dtype(operands)
  q, k, v = (
    jnp.asarray(rng.normal(size=tuple(shape)), jnp.bfloat16).astype(held) for _ in range(3)
  )
  dout = jnp.asarray(rng.normal(size=tuple(shape)), jnp.float32)
  return q, k, v, jnp.zeros((1,), jnp.float32), jnp.zeros((1,), jnp.int8), dout


def _forward(cfg):
  from primal_dual.kernels.hyla import tensorcore as ht

  return lambda q, k, v, bias, mask, dout: ht.forward(q, k, v, bias, mask, cfg)


def _backward(launch: str, cfg):
  from primal_dual.kernels.hyla import tensorcore as ht

  return functools.partial(ht.backward_launch, launch, cfg=cfg)


def _forward_backward(cfg):
  """The layer's path: the forward, then both backward launches through ``jax.vjp``."""
  from primal_dual.kernels.hyla import tensorcore as ht

  attend = ht.make_tensorcore(cfg)

  def forward_backward(q, k, v, bias, mask, dout):
    out, vjp = jax.vjp(lambda *x: attend(*x, bias, mask), q, k, v)
    return out, vjp(dout)

  return forward_backward


# ``cfg -> (q, k, v, bias, mask, dout) -> outputs`` of each row's launch.
LAUNCH_FUNCTIONS = {
  "forward": _forward,
  "dq_dk": functools.partial(_backward, "dq_dk"),
  "dv": functools.partial(_backward, "dv"),
  WHOLE: _forward_backward,
}


def compile_estimates(path: str | Path, shape: gpu_compile.Shape) -> dict[tuple, float]:
  """``(setting, launch) -> estimate ms`` of the compile report's tensorcore kernels at ``shape``
  (its SASS time estimate); empty without a report at that shape."""
  path = Path(path)
  if not path.exists():
    return {}
  report = json.loads(path.read_text())
  if report["config"]["shapes"].get("tensorcore") != list(shape):
    return {}
  setting_type = gpu_compile.TensorcoreSetting
  return {
    (gpu_compile.setting_key(r, setting_type), r["kernel"]): r["estimate_ms"]
    for r in report["records"]
    if r["family"] == "tensorcore" and r.get("estimate_ms") is not None
  }


def estimate_of(estimates: dict[tuple, float], setting, launch: str) -> float | None:
  """A row's estimate: its launch's, or (forward + backward) the sum of the three launches'."""
  names = LAUNCHES if launch == WHOLE else (launch,)
  found = [estimates.get((tuple(setting), name)) for name in names]
  return None if None in found else sum(found)


def measure(
  setting, launch: str, sizes: Sizes, interpret: bool, estimate_ms: float | None = None
) -> dict[str, Any]:
  """One row: first-call (compile) seconds, warm time, TFLOP/s (and the compile report's
  estimate, where it has one)."""
  cfg = gpu_compile.tensorcore_config(setting, sizes.shape)._replace(interpret=interpret)
  fn = jax.jit(LAUNCH_FUNCTIONS[launch](cfg))
  args = inputs(sizes.shape, operands=setting.operands)
  first_call_s = common.time_call(fn, *args)
  timing = common.time_warm(fn, *args, repeats=sizes.repeats)
  return {
    "setting": setting._asdict(),
    "launch": launch,
    "first_call_s": first_call_s,
    "time_s": timing.median_s,
    "time_iqr_s": timing.iqr_s,
    "samples_s": timing.samples_s,
    "tflops": launch_flops(launch, sizes.shape) / timing.median_s / 1e12,
    "estimate_ms": estimate_ms,
  }


def agreement(shape: gpu_compile.Shape, interpret: bool) -> dict[str, Any]:
  """The default kernels' output and gradients (``vjp`` of a random cotangent) against the
  blockwise XLA path, float32 throughout, ragged tiles, a causal call; raises past
  ``CHECK_TOLERANCE``."""
  from primal_dual.kernels.hyla import blockwise as hb
  from primal_dual.kernels.hyla import tensorcore as ht

  rng = np.random.default_rng(1)
  q, k, v, dout = (jnp.asarray(rng.normal(size=tuple(shape)), jnp.float32) for _ in range(4))
  highest = jax.lax.Precision.HIGHEST
  paths = {
    "tensorcore": functools.partial(
      ht.hyla_tensorcore_attention, precision=highest, interpret=interpret
    ),
    "blockwise": functools.partial(hb.hyla_blockwise_attention, block_size=64, precision=highest),
  }
  errors = {}
  for causal in (False, True):

    def out_and_grads(path):
      attend = functools.partial(paths[path], is_causal=causal)
      out, vjp = jax.vjp(attend, q, k, v)
      return (out, *vjp(dout))

    got, want = (jax.jit(functools.partial(out_and_grads, path))() for path in paths)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
      scale = float(jnp.max(jnp.abs(b)))
      errors[f"{name}{' causal' if causal else ''}"] = float(jnp.max(jnp.abs(a - b))) / scale
  worst = max(errors, key=errors.get)
  if not errors[worst] <= CHECK_TOLERANCE:  # NaN fails too
    raise AssertionError(f"{worst}: relative error {errors[worst]:.3g} > {CHECK_TOLERANCE:g}")
  return {"relative_errors": errors, "max_relative_error": errors[worst]}


def build_rows(
  sizes: Sizes, interpret: bool, estimates: dict[tuple, float] | None = None
) -> list[device_suite.Row]:
  """The agreement check, the default setting's launches and its forward + backward, then the
  other settings' launches (each with its estimate from ``estimates``, where given)."""
  estimates = estimates or {}
  first, *others = settings()
  plan = [(first, launch) for launch in LAUNCHES] + [(first, WHOLE)]
  plan += [(setting, launch) for setting in others for launch in LAUNCHES]
  check = device_suite.Row(
    "tensorcore",
    f"{CHECK} {tuple(sizes.check_shape)}",
    "tensorcore/check",
    functools.partial(agreement, sizes.check_shape, interpret),
  )
  return [check] + [
    device_suite.Row(
      "tensorcore",
      f"{setting_name(setting)} {launch}",
      f"tensorcore/{launch}",
      functools.partial(
        measure, setting, launch, sizes, interpret, estimate_of(estimates, setting, launch)
      ),
    )
    for setting, launch in plan
  ]


COLUMNS = (
  common.Column("row", "row"),
  *common.timing_columns("time ms"),
  common.Column("TFLOP/s", "tflops", lambda v: f"{v:.3g}"),
  common.Column("first call s", "first_call_s", lambda v: f"{v:.3g}"),
  common.Column("estimate ms", "estimate_ms", lambda v: f"{v:.3g}"),
  common.Column("max rel. error", "max_relative_error", lambda v: f"{v:.2g}"),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)


def render_markdown(payload) -> str:
  config = payload["config"]
  return "\n".join(
    [
      *common.report_header("Tensor-core HYLA launches, each timed alone", payload["metadata"]),
      "",
      f"bfloat16 q, k, v of shape {tuple(config['shape'])} (`[batch, length, heads, head_dim]`), "
      "rms_head, mlp_relu, no mask or bias; float32 dout. Median of "
      f"{config['repeats']} warm calls after a compiling one; TFLOP/s of the analytic FLOPs "
      f"(per (query, key) pair and head: {LAUNCH_FLOPS} × 2·d); estimate: the sm_90a compile "
      "report's (`tools/device/gpu_compile.py`, a model of the SASS) at this shape, where it has "
      "the setting. The first row checks the "
      "default kernels' output and gradients against the blockwise XLA path (float32, with and "
      f"without causal; fails past {CHECK_TOLERANCE:g} of the largest value). "
      f"Budget {config['budget_s']:g} "
      f"s; {len(payload['records'])} of {config['rows']} rows written; "
      f"{payload['elapsed_s']:.0f} s elapsed.",
      "",
      common.render_markdown_table(COLUMNS, payload["records"]),
      "",
    ]
  )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m tools.device.tensorcore_sweep",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--budget-s", type=float, default=150.0, help="rows that do not fit: skipped")
  parser.add_argument(
    "--cache-dir", default=".jax_cache", help="JAX's persistent compile cache ('': none)"
  )
  parser.add_argument("--tiny", action="store_true", help="toy sizes, interpreted (the CPU test)")
  parser.add_argument(
    "--compile-report",
    default="benchmarks/results/gpu_compile.json",
    help="the sm_90a compile report whose time estimates the rows show beside their times",
  )
  common.add_output_arguments(parser)
  return parser.parse_args(argv)


def run(args, rows=None, budget=None, log=print) -> dict[str, Path]:
  """Runs the sweep (``rows``: those of ``args`` by default) and writes its reports."""
  if args.cache_dir:
    device_suite.enable_compilation_cache(args.cache_dir)
  budget = device_suite.Budget(args.budget_s) if budget is None else budget
  sizes = TINY if args.tiny else FULL
  label = args.device_label or device_suite.device_label()
  from primal_dual.kernels.hyla import tensorcore as ht

  interpret = ht.interpret_off_gpu()
  estimates = compile_estimates(args.compile_report, sizes.shape)
  rows = build_rows(sizes, interpret, estimates) if rows is None else list(rows)
  config = dict(
    budget_s=args.budget_s, shape=list(sizes.shape), repeats=sizes.repeats, rows=len(rows)
  )
  metadata = common.run_metadata(label)
  paths: dict[str, Path] = {}

  def write(records):
    payload = dict(
      metadata=metadata,
      config=config,
      elapsed_s=budget.total_s - budget.left_s(),
      records=records,
    )
    paths.update(common.write_reports(args.out_dir, STEM, label, payload, render_markdown))

  if not device_suite.run_suite(rows, budget, write, log):
    write([])
  return paths


def main(argv: Sequence[str] | None = None) -> None:
  paths = run(parse_args(argv))
  print("wrote", *map(str, paths.values()))


if __name__ == "__main__":
  main(sys.argv[1:])
