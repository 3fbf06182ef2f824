"""Model-steps per second of the HYLA paper's small models through the trainer's own step.

What is timed is ``setup.Program.run_steps`` (``primal_dual.training``): the exact program a
training run executes, K optimizer steps per jitted call (``config.steps_per_call``), N replicas
of one program (``config.sweep``, docs/training.md: ``--sweep seeds`` N seeds, ``--sweep
lr_wd_seeds`` 2 learning rates × 2 weight decays × N/4 seeds), with the training batches made on
the device (``config.train_data_on_device``) or, with ``--host-data``, read from the host loader
(N = 1 only). Each (model, variant, K, N) is compiled once, warmed with one call, then timed over
``--repeats`` calls (median); a model-step is one optimizer step of one model, so a call makes
K × N of them. The projection for a paper grid is ``runs × steps / (model-steps/s)`` of pure
training (N = 1 rows), evaluations excluded.

Models: the ``paper`` presets of ``primal_dual/configs/sraven.py`` (402,824 parameters, batch 128,
36 tokens) and ``primal_dual/configs/logic.py`` (151,265 parameters, batch 128, 32 tokens).
Variants: the paper's three by default (``PAPER_CODE_CPU_MS``), any registered one with
``--variants``. Reference anchors: the paper's own code on this project's 2-core CPU
(``PAPER_CODE_CPU_MS``, sRAVEN batch 128, median ms per step), shown beside the sRAVEN rows.

  python -m benchmarks.small_models --out-dir benchmarks/results            # CPU: K = 1, 10
  python -m benchmarks.small_models --steps-per-call 1,100 --replicas 1,3,9 \
      --device-label gpu-h100 --out-dir benchmarks/results                  # an accelerator
  python -m benchmarks.small_models --quick --models logic --variants softmax --steps-per-call 10 \
      --replicas 1,12,24 --sweep lr_wd_seeds --out-dir benchmarks/results --name small_models_sweep
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import itertools
import json
import re
import sys
import time
from typing import Any, NamedTuple, Sequence

import jax
import ml_collections

from benchmarks import common
from primal_dual.training import config_lib
from primal_dual.training import setup

MODELS = {"sraven": "primal_dual.configs.sraven", "logic": "primal_dual.configs.logic"}
# The paper's code on this project's CPU (sRAVEN, batch 128): median ms per training step of its
# three variants, which are also this benchmark's default variants.
PAPER_CODE_CPU_MS = {"softmax": 201.6, "linear_plain": 174.8, "hyla": 296.6}
PAPER_GRID_RUNS, PAPER_GRID_STEPS = 9, 156_250  # 3 variants × 3 seeds × 156,250 steps
# The swept values of `--sweep lr_wd_seeds` (× N/4 seeds): the HYLA paper's sRAVEN grid.
SWEEP_LEARNING_RATES, SWEEP_WEIGHT_DECAYS = (1e-3, 3e-4), (0.1, 0.3)
POINTS_PER_SEED = len(SWEEP_LEARNING_RATES) * len(SWEEP_WEIGHT_DECAYS)


def sweep_fields(kind: str, num_replicas: int) -> dict[str, tuple]:
  """`config.sweep` fields (dotted) of N replicas: N seeds, or 2 lr × 2 wd × N/4 seeds."""
  if num_replicas == 1:
    return {}
  if kind == "seeds":
    return {"sweep.seed": tuple(range(num_replicas))}
  if num_replicas % POINTS_PER_SEED:
    raise ValueError(
      f"--sweep lr_wd_seeds needs N divisible by {POINTS_PER_SEED}, got {num_replicas}"
    )
  return {
    "sweep.optimizer.lr": SWEEP_LEARNING_RATES,
    "sweep.optimizer.weight_decay": SWEEP_WEIGHT_DECAYS,
    "sweep.seed": tuple(range(num_replicas // POINTS_PER_SEED)),
  }


class Measurement(NamedTuple):
  """One timed program: ``model``'s ``paper`` preset with ``variant``, K steps per call, N
  replicas (a sweep of kind ``sweep``, see `sweep_fields`), batches made on the device or read
  from the host; ``quick``: the tiny ``runlocal`` model (smoke tests)."""

  model: str
  variant: str
  steps_per_call: int
  device_data: bool
  quick: bool = False
  num_replicas: int = 1
  sweep: str = "seeds"


def build(m: Measurement, initialize: bool = True):
  """The trainer's Program of ``m`` and an initial state (None unless ``initialize``)."""
  # The paper preset as the grid runs it: replicas of different seeds each draw their own
  # held-out split (`setup.ReplicaData`).
  arg = f"preset=paper,attention={m.variant}" + (",runlocal" if m.quick else "")
  config = importlib.import_module(MODELS[m.model]).get_config(arg)
  config = ml_collections.ConfigDict(config.to_dict())
  config.update(
    dict(
      steps_per_call=m.steps_per_call,
      train_data_on_device=m.device_data,
      log_every_steps=0,
      eval_every_steps=0,
      checkpoint_every_steps=0,
      progress_bar=False,
    )
  )
  config = config_lib.with_fields(config, sweep_fields(m.sweep, m.num_replicas))
  program = setup.build_program(setup.resolve_config(config))
  return program, program.init() if initialize else None


def _timed_call(program, state, steps_per_call: int, iterator):
  """``(state, seconds)`` of one ``run_steps`` call, waiting for its losses."""
  start = time.perf_counter()
  state, losses, _ = program.run_steps(state, steps_per_call, iterator)
  jax.block_until_ready(losses)
  return state, time.perf_counter() - start


def time_steps(m: Measurement, repeats: int) -> dict[str, Any]:
  """One row: the first call (compile included), then the median of ``repeats`` warm calls."""
  program, state = build(m)
  iterator = program.make_train_iterator()
  state, first_call_s = _timed_call(program, state, m.steps_per_call, iterator)
  samples = []
  for _ in range(repeats):
    state, seconds = _timed_call(program, state, m.steps_per_call, iterator)
    samples.append(seconds)
  timing = common.summarize_samples(samples)
  # One model-step: one optimizer step of one model (N replicas in one program make N per step).
  model_steps_per_call = m.steps_per_call * m.num_replicas
  ms_per_step = 1e3 * timing.median_s / model_steps_per_call
  row = dict(
    model=m.model,
    variant=m.variant,
    steps_per_call=m.steps_per_call,
    replicas=m.num_replicas,
    sweep=m.sweep if m.num_replicas > 1 else "single run",
    data="device" if m.device_data else "host",
    batch=program.config.batch_size,
    first_call_s=first_call_s,
    ms_per_step=ms_per_step,
    iqr_ms_per_step=1e3 * timing.iqr_s / model_steps_per_call,
    model_steps_per_s=1e3 / ms_per_step,
    repeats=repeats,
  )
  if m.model == "sraven" and m.variant in PAPER_CODE_CPU_MS and not m.quick:
    row["paper_code_cpu_ms"] = PAPER_CODE_CPU_MS[m.variant]
    row["speedup_vs_paper_code_cpu"] = PAPER_CODE_CPU_MS[m.variant] / ms_per_step
  return row


def traced_program(m: Measurement):
  """The K-step training program of ``m`` traced from abstract arguments (`trace_steps`)."""
  return trace_steps(build(m, initialize=False)[0], m.steps_per_call)


def trace_steps(program, steps_per_call: int):
  """``program``'s ``steps_per_call``-step training program traced from abstract arguments
  (``jax.stages.Traced``: ``.lower(lowering_platforms=...)`` for any platform,
  ``.lower().compile()`` for this machine's); nothing is initialised or run."""
  from primal_dual.training import sharding

  runner = program.run_steps
  abstract = functools.partial(
    jax.tree.map, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  )
  state = jax.eval_shape(program.init.__wrapped__)
  with sharding.mesh_context(program.mesh):
    return runner._compile(steps_per_call).__wrapped__.trace(
      state, None, abstract(runner.stream_arguments), abstract(runner.hyperparameters)
    )


def lowered_op_counts(m: Measurement, platform: str = "cuda") -> collections.Counter:
  """StableHLO op name → count in the K-step training program of ``m``, lowered for
  ``platform`` on this machine. Its total does not grow with the replicas unless something is
  unrolled per replica."""
  lowered = traced_program(m).lower(lowering_platforms=(platform,))
  return collections.Counter(re.findall(r"= \"?(stablehlo\.[a-z_]+)", lowered.as_text()))


def projection(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Pure-training wall time of the paper sRAVEN grid at each K, runs one after the other."""
  out = []
  for k in sorted({r["steps_per_call"] for r in rows}):
    per_variant = {
      r["variant"]: r["ms_per_step"]
      for r in rows
      if r["model"] == "sraven" and r["steps_per_call"] == k and r["replicas"] == 1
    }
    if set(per_variant) >= set(PAPER_CODE_CPU_MS):
      seconds = (
        sum(per_variant[v] for v in PAPER_CODE_CPU_MS)
        / 1e3
        * PAPER_GRID_STEPS
        * (PAPER_GRID_RUNS // len(PAPER_CODE_CPU_MS))
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
  *common.plain_columns("model", "variant"),
  common.Column("K", "steps_per_call"),
  common.Column("N replicas", "replicas"),
  common.Column("sweep", "sweep"),
  common.Column("data", "data"),
  common.Column("ms / model-step", "ms_per_step", lambda v: f"{v:.1f}"),
  common.Column("model-steps/s", "model_steps_per_s", lambda v: f"{v:.1f}"),
  common.Column("paper's code, CPU (ms, reference)", "paper_code_cpu_ms", lambda v: f"{v:.1f}"),
  common.Column("speed-up vs paper's code", "speedup_vs_paper_code_cpu", lambda v: f"{v:.2f}×"),
]


def baseline_ratios(rows, baseline) -> list[dict[str, Any]]:
  """Single-run rows against the same rows of a `--baseline` report (this benchmark's JSON from
  another version of the code; earlier versions name the replica count ``seeds``)."""
  before = {
    (r["model"], r["variant"], r["steps_per_call"], r["data"]): r["model_steps_per_s"]
    for r in baseline["rows"]
    if r.get("replicas", r.get("seeds")) == 1
  }
  out = []
  for r in rows:
    key = (r["model"], r["variant"], r["steps_per_call"], r["data"])
    if r["replicas"] == 1 and key in before:
      out.append(
        dict(
          zip(("model", "variant", "steps_per_call", "data"), key),
          before=before[key],
          now=r["model_steps_per_s"],
          ratio=r["model_steps_per_s"] / before[key],
        )
      )
  return out


def render_markdown(payload) -> str:
  keys = [key for key in common.REPORT_METADATA_KEYS if key != "flax_version"]
  lines = [
    *common.report_header(
      "Small models: the trainer's own step, K steps per call", payload["metadata"], keys
    ),
    "",
    common.render_markdown_table(COLUMNS, payload["rows"]),
    "",
  ]
  for p in payload["paper_grid_projection"]:
    lines.append(
      f"Paper sRAVEN grid (9 runs × 156,250 steps, one after the other, training only)"
      f" at K = {p['steps_per_call']}: {p['grid_minutes']:.0f} min, "
      f"{p['aggregate_model_steps_per_s']:.0f} model-steps/s."
    )
  if payload.get("baseline"):
    lines.append(f"Single runs against `{payload['baseline']['command']}` (the code before):")
    lines.append("")
    for b in payload["baseline"]["ratios"]:
      lines.append(
        f"- {b['model']} {b['variant']} K={b['steps_per_call']} {b['data']}: "
        f"{b['now']:.1f} model-steps/s now, {b['before']:.1f} before: ratio {b['ratio']:.2f}"
      )
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", type=common.comma_list(choices=MODELS), default=list(MODELS))
  common.add_variants_argument(parser, default=list(PAPER_CODE_CPU_MS))
  parser.add_argument("--steps-per-call", type=common.comma_list(int), default=[1, 10])
  parser.add_argument(
    "--replicas",
    "--seeds-per-program",
    dest="replicas",
    type=common.comma_list(int),
    default=[1],
    help="comma list of N: replicas trained as one program (up to 24 and beyond)",
  )
  parser.add_argument(
    "--sweep",
    choices=("seeds", "lr_wd_seeds"),
    default="seeds",
    help="what the N replicas sweep: N seeds, or 2 learning rates × 2 weight decays × N/4 seeds",
  )
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--host-data", action="store_true")
  parser.add_argument("--quick", action="store_true", help="tiny runlocal models (smoke test)")
  parser.add_argument("--name", default="small_models", help="stem of the result files")
  parser.add_argument(
    "--baseline",
    default=None,
    help="this benchmark's JSON from another version of the code: single-run ratios to it",
  )
  common.add_output_arguments(parser)
  args = parser.parse_args(argv)
  label = args.device_label or common.default_device_label()
  rows = []
  for model, variant, k, n in itertools.product(
    args.models, args.variants, args.steps_per_call, args.replicas
  ):
    measurement = Measurement(model, variant, k, not args.host_data, args.quick, n, args.sweep)
    rows.append(time_steps(measurement, args.repeats))
    print(f"{model} {variant} K={k} N={n}: {rows[-1]['ms_per_step']:.1f} ms/model-step", flush=True)
  payload = dict(
    metadata=common.run_metadata(label, argv),
    rows=rows,
    paper_grid_projection=[] if args.quick else projection(rows),
  )
  if args.baseline:
    with open(args.baseline) as f:
      baseline = json.load(f)
    payload["baseline"] = dict(
      command=baseline["metadata"].get("command", args.baseline),
      ratios=baseline_ratios(rows, baseline),
    )
  paths = common.write_reports(args.out_dir, args.name, label, payload, render_markdown)
  print(f"wrote {paths['json']} and {paths['markdown']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
