"""Model-steps per second of the HYLA paper's small models through the trainer's own step.

What is timed is ``Experiment.run_steps`` of ``primal_dual.training.trainer``: the exact program a
training run executes, K optimizer steps per jitted call (``config.steps_per_call``), N seeds as
replicas of one program (``config.seeds``), with the training batches made on the device
(``config.train_data_on_device``) or, with ``--host-data``, read from the host loader (N = 1
only). Each (model, variant, K, N) is compiled once, warmed with one call, then timed over
``--repeats`` calls (median); a model-step is one optimizer step of one model, so a call makes
K × N of them. The projection for a paper grid is ``runs × steps / (model-steps/s)`` of pure
training (N = 1 rows), evaluations excluded.

Models: the ``paper`` presets of ``primal_dual/configs/sraven.py`` (402,824 parameters, batch 128,
36 tokens) and ``primal_dual/configs/logic.py`` (151,265 parameters, batch 128, 32 tokens).
Reference anchors (the paper's own code on this project's 2-core CPU, sRAVEN batch 128, median ms
per step): softmax 201.6, linear attention 174.8, HYLA 296.6.

  python -m benchmarks.small_models --out-dir benchmarks/results            # CPU: K = 1, 10
  python -m benchmarks.small_models --steps-per-call 1,100 --seeds-per-program 1,3,9 \
      --device-label gpu-h100 --out-dir benchmarks/results                  # an accelerator
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Any, Sequence

import jax
import ml_collections

from benchmarks import common
from primal_dual.training import trainer

MODELS = {"sraven": "primal_dual.configs.sraven", "logic": "primal_dual.configs.logic"}
VARIANTS = ("softmax", "linear_plain", "hyla")
# The paper's code on this project's CPU (sRAVEN, batch 128): median ms per training step.
PAPER_CODE_CPU_MS = {"softmax": 201.6, "linear_plain": 174.8, "hyla": 296.6}
PAPER_GRID_RUNS, PAPER_GRID_STEPS = 9, 156_250  # 3 variants × 3 seeds × 156,250 steps


def build(
  model: str,
  variant: str,
  steps_per_call: int,
  device_data: bool,
  quick: bool = False,
  num_seeds: int = 1,
):
  """The trainer's Experiment of the model's ``paper`` preset (``quick``: its tiny ``runlocal``
  version, for smoke tests), and an initial state."""
  arg = f"preset=paper,attention={variant}" + (",runlocal" if quick else "")
  config = importlib.import_module(MODELS[model]).get_config(arg)
  config = ml_collections.ConfigDict(config.to_dict())
  config.update(
    dict(
      steps_per_call=steps_per_call,
      train_data_on_device=device_data,
      log_every_steps=0,
      eval_every_steps=0,
      checkpoint_every_steps=0,
      progress_bar=False,
      seeds=tuple(range(num_seeds)) if num_seeds > 1 else (),
    )
  )
  experiment = trainer.build_experiment(trainer.resolve_config(config))
  return experiment, experiment.init_state()


def time_steps(
  model: str,
  variant: str,
  steps_per_call: int,
  device_data: bool,
  repeats: int,
  quick: bool = False,
  num_seeds: int = 1,
) -> dict[str, Any]:
  experiment, state = build(model, variant, steps_per_call, device_data, quick, num_seeds)
  iterator = experiment.make_train_iterator()
  start = time.perf_counter()
  state, losses, _ = experiment.run_steps(state, steps_per_call, iterator)
  jax.block_until_ready(losses)
  first_call_s = time.perf_counter() - start
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, losses, _ = experiment.run_steps(state, steps_per_call, iterator)
    jax.block_until_ready(losses)
    samples.append(time.perf_counter() - start)
  timing = common.summarize_samples(samples)
  # One model-step: one optimizer step of one model (N seeds in one program make N per step).
  ms_per_step = 1e3 * timing.median_s / (steps_per_call * num_seeds)
  row = dict(
    model=model,
    variant=variant,
    steps_per_call=steps_per_call,
    seeds=num_seeds,
    data="device" if device_data else "host",
    batch=experiment.config.batch_size,
    first_call_s=first_call_s,
    ms_per_step=ms_per_step,
    iqr_ms_per_step=1e3 * timing.iqr_s / (steps_per_call * num_seeds),
    model_steps_per_s=1e3 / ms_per_step,
    repeats=repeats,
  )
  if model == "sraven" and variant in PAPER_CODE_CPU_MS and not quick:
    row["paper_code_cpu_ms"] = PAPER_CODE_CPU_MS[variant]
    row["speedup_vs_paper_code_cpu"] = PAPER_CODE_CPU_MS[variant] / ms_per_step
  return row


def projection(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Pure-training wall time of the paper sRAVEN grid at each K, runs one after the other."""
  out = []
  for k in sorted({r["steps_per_call"] for r in rows}):
    per_variant = {
      r["variant"]: r["ms_per_step"]
      for r in rows
      if r["model"] == "sraven" and r["steps_per_call"] == k and r["seeds"] == 1
    }
    if set(per_variant) >= set(VARIANTS):
      seconds = (
        sum(per_variant[v] for v in VARIANTS)
        / 1e3
        * PAPER_GRID_STEPS
        * (PAPER_GRID_RUNS // len(VARIANTS))
      )
      out.append(
        dict(
          steps_per_call=k,
          grid_minutes=seconds / 60,
          aggregate_model_steps_per_s=PAPER_GRID_RUNS * PAPER_GRID_STEPS / seconds,
        )
      )
  return out


COLUMNS = [
  common.Column("model", "model"),
  common.Column("variant", "variant"),
  common.Column("K", "steps_per_call"),
  common.Column("N seeds", "seeds"),
  common.Column("data", "data"),
  common.Column("ms / model-step", "ms_per_step", lambda v: f"{v:.1f}"),
  common.Column("model-steps/s", "model_steps_per_s", lambda v: f"{v:.1f}"),
  common.Column("paper's code, CPU (ms, reference)", "paper_code_cpu_ms", lambda v: f"{v:.1f}"),
  common.Column("speed-up vs paper's code", "speedup_vs_paper_code_cpu", lambda v: f"{v:.2f}×"),
]


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default="sraven,logic")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--steps-per-call", default="1,10")
  parser.add_argument(
    "--seeds-per-program",
    default="1",
    help="comma list of N: seeds trained as replicas of one program",
  )
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--host-data", action="store_true")
  parser.add_argument("--quick", action="store_true", help="tiny runlocal models (smoke test)")
  parser.add_argument("--device-label", default=None)
  parser.add_argument("--out-dir", default="benchmarks/results")
  args = parser.parse_args(argv)
  label = args.device_label or common.default_device_label()
  rows = []
  for model in args.models.split(","):
    for variant in args.variants.split(","):
      for k in (int(x) for x in args.steps_per_call.split(",")):
        for n in (int(x) for x in args.seeds_per_program.split(",")):
          rows.append(
            time_steps(model, variant, k, not args.host_data, args.repeats, args.quick, n)
          )
          print(
            f"{model} {variant} K={k} N={n}: {rows[-1]['ms_per_step']:.1f} ms/model-step",
            flush=True,
          )
  payload = dict(
    metadata=common.run_metadata(label, argv),
    rows=rows,
    paper_grid_projection=[] if args.quick else projection(rows),
  )
  json_path = common.write_json(
    common.result_path(args.out_dir, "small_models", "json", label), payload
  )
  lines = [
    "# Small models: the trainer's own step, K steps per call\n",
    common.render_metadata(
      payload["metadata"],
      (
        "device_label",
        "device_kind",
        "cpu_model",
        "cpu_count",
        "jax_version",
        "date_utc",
        "command",
      ),
    ),
    "",
    common.render_markdown_table(COLUMNS, rows),
    "",
  ]
  for p in payload["paper_grid_projection"]:
    lines.append(
      f"Paper sRAVEN grid (9 runs × 156,250 steps, one after the other, training only)"
      f" at K = {p['steps_per_call']}: {p['grid_minutes']:.0f} min, "
      f"{p['aggregate_model_steps_per_s']:.0f} model-steps/s."
    )
  md_path = common.result_path(args.out_dir, "small_models", "md", label)
  md_path.write_text("\n".join(lines) + "\n")
  print(f"wrote {json_path} and {md_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
