"""What bounds a small model's training step on a GPU: its memory traffic, predicted on the CPU.

The sRAVEN paper model (4 layers, width 128, 16 heads of width 4, 36 tokens, batch 128) does
about 12 GFLOP per optimizer step, a few milliseconds of a GPU's float32 peak at most; its
attention matrices, though, are ``[B, H, T, T]`` = 2.65M numbers (10.6 MB in float32) per layer,
four times a layer's token activations, and every elementwise pass over them (bias, masking,
normalisation, dropout, their backward) is a trip through memory. So the step is bound by bytes,
not FLOPs, and more replicas of one program stop helping once they fill the memory system.

This benchmark states that bound before a GPU measures it. For each variant it compiles the
trainer's own one-step program (``small_models.traced_program``, K = 1) for this machine's CPU and
reads XLA's cost analysis: FLOPs and bytes accessed per model-step, and the bytes written by the
program's top-level instructions, split into attention-matrix-shaped outputs (two axes of the
sequence length) and the rest. The floor on a device is ``bytes / bandwidth`` (datasheet
bandwidths, labelled reference); beside it, the measured ms per model-step of the device suite's
replica rows (``benchmarks/results/device_suite_*.json``), the most replicas measured.

Caveat, stated in the report: XLA:CPU fuses differently from XLA:GPU (fewer, smaller fusions), so
its bytes are an estimate of the GPU program's, not a measurement; the ratio measured / floor says
how close the two are.

  python -m benchmarks.step_traffic --out-dir benchmarks/results          # paper models, CPU
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from benchmarks import common, small_models

# Datasheet memory bandwidths (bytes/s), reference numbers: H100 SXM5 80 GB HBM3, H200 141 GB HBM3e.
BANDWIDTH = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12}
DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
# A top-level HLO instruction: `%name = f32[128,16,36,36]{3,2,1,0} fusion(...)`.
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\][^ ]* (\S+?)\(")
_NOT_WRITTEN = {"parameter", "get-tuple-element", "bitcast", "constant", "tuple"}


def written_bytes(hlo_text: str, seq_len: int) -> dict[str, int]:
  """Bytes written by the top-level instructions of an optimized HLO module (those of its
  non-fused computations), split into ``attention_matrix`` (an output with two axes of length
  ``seq_len``) and ``other``. Fused computations' inner instructions write nothing to memory."""
  split = collections.Counter({"attention_matrix": 0, "other": 0})
  fused = False
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():  # a computation header (or its closing brace)
      fused = line.startswith(("%fused", "fused", "%region", "region")) or "_computation" in line
      continue
    match = _INSTRUCTION.match(line)
    if fused or not match or match.group(3) in _NOT_WRITTEN:
      continue
    dtype, dims, _ = match.groups()
    if dtype not in DTYPE_BYTES or not dims:
      continue
    shape = [int(d) for d in dims.split(",")]
    kind = "attention_matrix" if shape.count(seq_len) >= 2 else "other"
    split[kind] += DTYPE_BYTES[dtype] * math.prod(shape)
  return dict(split)


def traffic_row(m: small_models.Measurement) -> dict[str, Any]:
  """XLA:CPU's cost analysis of ``m``'s compiled one-step program, per model-step."""
  program, _ = small_models.build(m, initialize=False)
  compiled = small_models.trace_steps(program, m.steps_per_call).lower().compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  per_model_step = m.steps_per_call * m.num_replicas
  written = written_bytes(compiled.as_text(), _sequence_length(program))
  return dict(
    model=m.model,
    variant=m.variant,
    replicas=m.num_replicas,
    gflop=cost["flops"] / per_model_step / 1e9,
    gb_accessed=cost["bytes accessed"] / per_model_step / 1e9,
    gb_written_attention_matrix=written["attention_matrix"] / per_model_step / 1e9,
    gb_written_other=written["other"] / per_model_step / 1e9,
  )


def _sequence_length(program) -> int:
  """The model's token count, from one training batch's shape ``[B, T, ...]``."""
  stream = program.task.device_train_stream(program.config, program.metadata)
  batch = jax.eval_shape(
    lambda: stream.batch(jnp.arange(2, dtype=jnp.uint32), arguments=stream.arguments)
  )
  return int(batch["inputs"].shape[1])


def measured_rows(result_dir: Path) -> list[dict[str, Any]]:
  """Per (device, model, variant): the device suite's row with the most replicas (ok rows)."""
  best: dict[tuple, dict[str, Any]] = {}
  for path in sorted(result_dir.glob("device_suite_*.json")):
    report = json.loads(path.read_text())
    device = report["metadata"].get("device_kind", "")
    for r in report["records"]:
      if r.get("section") != "small_models" or r.get("status") != "ok":
        continue
      key = (device, r["model"], r["variant"])
      if key not in best or r["replicas"] > best[key]["replicas"]:
        best[key] = dict(r, device=device, source=path.name)
  return list(best.values())


def compare(traffic: Sequence[Mapping], measured: Sequence[Mapping]) -> list[dict[str, Any]]:
  """Floor beside measurement for every measured row whose device has a known bandwidth."""
  by_variant = {(t["model"], t["variant"]): t for t in traffic}
  out = []
  for r in measured:
    t = by_variant.get((r["model"], r["variant"]))
    if t is None or r["device"] not in BANDWIDTH:
      continue
    floor_ms = t["gb_accessed"] * 1e9 / BANDWIDTH[r["device"]] * 1e3
    out.append(
      dict(
        device=r["device"],
        model=r["model"],
        variant=r["variant"],
        replicas=r["replicas"],
        steps_per_call=r["steps_per_call"],
        floor_ms=floor_ms,
        measured_ms=r["ms_per_step"],
        measured_over_floor=r["ms_per_step"] / floor_ms,
        source=r["source"],
      )
    )
  return out


TRAFFIC_COLUMNS = [
  *common.plain_columns("model", "variant"),
  common.Column("GFLOP / model-step", "gflop", lambda v: f"{v:.2f}"),
  common.Column("GB accessed / model-step", "gb_accessed", lambda v: f"{v:.2f}"),
  common.Column("GB written, attention matrices", "gb_written_attention_matrix", "{:.3f}".format),
  common.Column("GB written, other", "gb_written_other", lambda v: f"{v:.3f}"),
]
COMPARE_COLUMNS = [
  *common.plain_columns("device", "model", "variant"),
  common.Column("N replicas", "replicas"),
  common.Column("K", "steps_per_call"),
  common.Column("floor ms / model-step (predicted)", "floor_ms", lambda v: f"{v:.3f}"),
  common.Column("measured ms / model-step", "measured_ms", lambda v: f"{v:.3f}"),
  common.Column("measured / floor", "measured_over_floor", lambda v: f"{v:.2f}"),
  common.Column("measured in", "source"),
]


def render_markdown(payload) -> str:
  lines = [
    *common.report_header(
      "What bounds a small model's training step: XLA's traffic per model-step",
      payload["metadata"],
      [k for k in common.REPORT_METADATA_KEYS if k != "flax_version"],
    ),
    "",
    "XLA:CPU's cost analysis of the trainer's one-step program (K = 1, one replica), per "
    "model-step; bytes written counted over the program's top-level instructions. "
    "XLA:GPU fuses more, so these bytes estimate the GPU program's traffic (an upper bound "
    "where GPU fusions merge passes).",
    "",
    common.render_markdown_table(TRAFFIC_COLUMNS, payload["traffic"]),
    "",
    "Floor = bytes accessed / the device's datasheet bandwidth (reference: "
    + ", ".join(f"{name} {bw / 1e12:.2f} TB/s" for name, bw in BANDWIDTH.items())
    + "); measured: the device suite's row with the most replicas.",
    "",
    common.render_markdown_table(COMPARE_COLUMNS, payload["comparison"]),
    "",
  ]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--models", type=common.comma_list(choices=small_models.MODELS), default=["sraven"]
  )
  common.add_variants_argument(parser, default=list(small_models.PAPER_CODE_CPU_MS))
  parser.add_argument("--quick", action="store_true", help="tiny runlocal models (smoke test)")
  parser.add_argument(
    "--measured-dir", default="benchmarks/results", help="where the device suite's JSONs are"
  )
  common.add_output_arguments(parser)
  args = parser.parse_args(argv)
  traffic = []
  for model in args.models:
    for variant in args.variants:
      m = small_models.Measurement(model, variant, 1, True, args.quick)
      traffic.append(traffic_row(m))
      print(f"{model} {variant}: {traffic[-1]['gb_accessed']:.2f} GB/model-step", flush=True)
  payload = dict(
    metadata=common.run_metadata(args.device_label or common.default_device_label(), argv),
    traffic=traffic,
    comparison=compare(traffic, measured_rows(Path(args.measured_dir))),
  )
  paths = common.write_reports(args.out_dir, "step_traffic", "cpu", payload, render_markdown)
  print(f"wrote {paths['json']} and {paths['markdown']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
