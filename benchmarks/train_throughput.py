"""Training-step throughput of the UEA and ListOps models, per attention variant, on 1 and 8 devices.

What is timed is the trainer's own step, ``primal_dual.training.steps.train_step`` on a
``TrainState``, with the model, optimizer and loss the task builds from its packaged config
(``primal_dual/configs/<model>.py``, ``task.build_model``, ``optim.make_optimizer``,
``task.loss_and_metrics``): a change in any of them is what is measured. The batches are synthetic,
of the task's shapes. The step is jitted once (compile time reported apart) and warmed; its time is
the median of warm steps (``benchmarks.common``). Reported: steps/s, tokens/s (batch × sequence
length per second) and examples/s, with XLA's memory numbers and FLOP count of the compiled step.

Models (the configs' docstrings; docs/maths.md §4):

* ``uea``: ``configs/uea.py`` with ``dataset=JapaneseVowels``, the protocol's reference encoder
  (2 layers, d_model 512, 8 heads, BatchNorm, flattened read-out, RAdam 1e-3, batch 16), input
  ``[16, 29, 12]`` with lengths 7–29 (padding mask), 9 classes; SH ratios from the config.
* ``listops``: ``configs/listops.py`` (``jax_lra`` setting, ``full`` preset: 4 layers, d_model 512,
  8 heads, CLS read-out, batch 32), token ids ``[32, 2000]`` with lengths 500–2000.

Variants: every registered one (``primal_dual.registry``), with the options the config gives it.
``--quick`` uses the configs' ``runlocal`` models (ListOps: its ``tiny`` preset, 40 tokens).

Devices: the step is data-parallel over a ``Mesh`` of the first N devices (batch sharded with
``NamedSharding(mesh, P('data'))``, the state replicated). On CPU the N devices are virtual
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``), which must be set before JAX starts: by
default every device count runs in its own subprocess with that flag set. With ``--in-process``
the current process runs every requested count it has devices for (set ``XLA_FLAGS`` yourself).
Virtual CPU devices share the same cores, so 8 of them measure the cost of partitioning, not a
speed-up.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks import common
from primal_dual import configs, registry
from primal_dual.training import optim, steps
from primal_dual.training import task_registry

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The optimizer's schedule length: it shapes the learning rate, not the cost of a step.
SCHEDULE_STEPS = 10_000


class Setup(NamedTuple):
  """One benchmarked model.

  Attributes:
    config_arg: the packaged config's argument, before ``attention=<variant>``.
    metadata: ``config -> dict``, what ``task.build_model`` needs (``num_classes``, ...) and
      ``max_length``, the tokens per example.
    make_batch: ``(config, length, rng) -> dict`` of NumPy arrays, the task's training batch
      (data contract in docs/ARCHITECTURE.md) of ``config.batch_size`` examples.
  """

  config_arg: str
  metadata: Callable[[ml_collections.ConfigDict], dict[str, Any]]
  make_batch: Callable[[ml_collections.ConfigDict, int, np.random.Generator], dict[str, np.ndarray]]


def _lengths_and_mask(rng, batch_size: int, min_length: int, length: int):
  """Random lengths in ``[min_length, length]``: bool ``[batch, length]`` mask of valid steps."""
  lengths = rng.integers(min_length, length + 1, size=batch_size)
  return np.arange(length)[None, :] < lengths[:, None]


# --- UEA (JapaneseVowels: 12 channels, 9 classes, 7 to 29 steps) --------------------------------

UEA_METADATA = {"num_classes": 9, "max_length": 29}
UEA_CHANNELS, UEA_MIN_LENGTH = 12, 7


def uea_batch(config, length, rng):
  mask = _lengths_and_mask(rng, config.batch_size, UEA_MIN_LENGTH, length)
  inputs = rng.standard_normal((config.batch_size, length, UEA_CHANNELS)).astype(np.float32)
  return dict(
    inputs=inputs * mask[..., None],
    mask=mask,
    label=rng.integers(0, UEA_METADATA["num_classes"], size=config.batch_size).astype(np.int32),
  )


# --- ListOps -------------------------------------------------------------------------------------


def listops_batch(config, length, rng):
  from primal_dual.data import listops

  # Token ids past the padding and CLS ids (the model prepends its own CLS); lengths from a quarter
  # of the longest up, as the preset's (500 to 2000).
  mask = _lengths_and_mask(rng, config.batch_size, length // 4, length)
  tokens = rng.integers(listops.CLS_ID + 1, listops.VOCAB_SIZE, size=mask.shape)
  return dict(
    inputs=np.where(mask, tokens, listops.PAD_ID).astype(np.int32),
    mask=mask,
    label=rng.integers(0, listops.NUM_CLASSES, size=config.batch_size).astype(np.int32),
  )


def _listops_metadata(config):
  from primal_dual.tasks import listops

  return listops.listops_metadata(config)


MODELS: dict[str, Setup] = {
  "uea": Setup("dataset=JapaneseVowels", lambda config: UEA_METADATA, uea_batch),
  "listops": Setup("setting=jax_lra,preset=full", _listops_metadata, listops_batch),
}


# --- The training step ---------------------------------------------------------------------------


class Step(NamedTuple):
  """What the trainer's step of one model needs: the pure step, its initial state, a batch."""

  step: Callable  # (TrainState, batch) -> (TrainState, loss, metrics)
  state: steps.TrainState
  batch: dict[str, jax.Array]
  config: ml_collections.ConfigDict


# Compute dtypes (``config.model.dtype``) and the config-string flag that selects each; the
# parameters stay float32 (the configs' ``bf16`` shorthand).
DTYPE_FLAGS = {"float32": "", "bfloat16": ",bf16"}


def build_step(model_name: str, variant: str, quick: bool, dtype: str = "float32") -> Step:
  """The task's model, optimizer and loss from its config (compute ``dtype``), bound into
  ``steps.train_step``."""
  setup = MODELS[model_name]
  arg = f"{setup.config_arg},attention={variant}" + (",runlocal" if quick else "")
  arg += DTYPE_FLAGS[dtype]
  config = configs.load(model_name, arg)
  task = task_registry.get_task(config.task)
  metadata = setup.metadata(config)
  model = task.build_model(config, metadata)
  tx, _ = optim.make_optimizer(config.optimizer, SCHEDULE_STEPS)
  rng = np.random.default_rng(0)
  batch = jax.tree.map(jnp.asarray, setup.make_batch(config, metadata["max_length"], rng))
  init_rng, state_rng = jax.random.split(jax.random.key(0))
  variables = nn.unbox(
    jax.jit(lambda rng: model.init(rng, batch["inputs"], mask=batch.get("mask"), train=False))(
      init_rng
    )
  )
  state = steps.TrainState(
    step=jnp.zeros((), jnp.int32),
    params=variables["params"],
    batch_stats=variables.get("batch_stats", {}),
    opt_state=tx.init(variables["params"]),
    rng=jax.random.key_data(state_rng),  # the TrainState contract: uint32 [2]
  )
  step = functools.partial(steps.train_step, model=model, tx=tx, loss_fn=task.loss_and_metrics)
  return Step(step, state, batch, config)


def data_parallel(built: Step, mesh: Mesh):
  """Places the state (replicated) and the batch (split on ``data``); returns the jitted step."""
  replicated = NamedSharding(mesh, P())
  split = NamedSharding(mesh, P("data"))
  state_sharding = jax.tree.map(lambda _: replicated, built.state)
  batch_sharding = jax.tree.map(lambda _: split, built.batch)
  jitted = jax.jit(
    built.step,
    in_shardings=(state_sharding, batch_sharding),
    out_shardings=(state_sharding, replicated, replicated),
  )
  placed = (
    jax.device_put(built.state, state_sharding),
    jax.device_put(built.batch, batch_sharding),
  )
  return jitted, placed


def _count_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


# Filled in by a timed step; None in a skipped or failed record.
RESULT_FIELDS = (
  "time_s",
  "time_iqr_s",
  "steps_per_s",
  "tokens_per_s",
  "examples_per_s",
  "compile_s",
  "num_params",
)


def _timed_step(built: Step, num_devices: int, repeats: int, warmup: int) -> dict[str, Any]:
  """Compiles the step on the first ``num_devices`` devices and times warm steps."""
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
  jitted, args = data_parallel(built, mesh)
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  compile_s = time.perf_counter() - start
  timing = common.time_warm(compiled, *args, repeats=repeats, warmup=warmup)
  return {
    **common.compiled_stats(compiled)._asdict(),
    "time_s": timing.median_s,
    "time_iqr_s": timing.iqr_s,
    "repeats": len(timing.samples_s),
    "compile_s": compile_s,
    "num_params": _count_params(built.state.params),
  }


def measure(
  model_name: str,
  variant: str,
  num_devices: int,
  *,
  quick: bool,
  repeats: int,
  warmup: int,
  dtype: str = "float32",
) -> dict[str, Any]:
  """One record: the trainer's step of ``model_name`` with ``variant`` in compute ``dtype`` on
  ``num_devices``."""
  record: dict[str, Any] = {
    "model": model_name,
    "variant": variant,
    "attention": variant,
    "dtype": dtype,
    "num_devices": num_devices,
    "device_kind": jax.devices()[0].device_kind,
    **dict.fromkeys(RESULT_FIELDS),
    "repeats": 0,
    "status": "ok",
    "reason": "",
  }
  try:
    built = build_step(model_name, variant, quick, dtype)
    batch_size, length = built.batch["inputs"].shape[:2]
    record.update(
      attention_options=built.config.model.attention_options.to_dict(),
      batch=batch_size,
      length=length,
      tokens_per_step=batch_size * length,
    )
    if len(jax.devices()) < num_devices:
      reason = f"{num_devices} devices asked, {len(jax.devices())} available"
      return {**record, "status": "skipped", "reason": reason}
    if batch_size % num_devices:
      reason = f"batch {batch_size} not divisible by {num_devices} devices"
      return {**record, "status": "skipped", "reason": reason}
    record.update(_timed_step(built, num_devices, repeats, warmup))
  except Exception as error:  # A variant that fails is reported, not fatal.
    return {**record, "status": "error", "reason": f"{type(error).__name__}: {error}"[:400]}
  return {
    **record,
    "steps_per_s": 1.0 / record["time_s"],
    "tokens_per_s": record["tokens_per_step"] / record["time_s"],
    "examples_per_s": record["batch"] / record["time_s"],
  }


def selected_variants(wanted: Sequence[str] | None) -> list[str]:
  """Every registered variant, or those of ``wanted``."""
  names = list(registry.ATTENTION_REGISTRY)
  return names if wanted is None else [v for v in names if v in wanted]


def run_in_process(args, log=print) -> list[dict[str, Any]]:
  """Every (device count, model, variant) record this process has devices for."""
  records = []
  for num_devices in args.device_counts:
    for model_name in args.models:
      for variant in selected_variants(args.variants):
        for dtype in args.dtypes:
          record = measure(
            model_name,
            variant,
            num_devices,
            quick=args.quick,
            repeats=args.repeats,
            warmup=args.warmup,
            dtype=dtype,
          )
          log(_progress_line(record))
          records.append(record)
  return records


def _progress_line(r) -> str:
  speed = (
    "-"
    if r["steps_per_s"] is None
    else (f"{r['steps_per_s']:8.2f} steps/s {r['tokens_per_s']:10.0f} tokens/s")
  )
  return (
    f"{r['model']:7s} {r['variant']:20s} {r.get('dtype', 'float32'):8s} "
    f"devices={r['num_devices']} {speed} "
    f"{r['status']} {r['reason']}"
  )


# --- One subprocess per device count -------------------------------------------------------------


def device_count_env(num_devices: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
  """``base`` (default ``os.environ``) with XLA_FLAGS asking for ``num_devices`` host devices."""
  env = dict(os.environ if base is None else base)
  flags = re.sub(rf"{DEVICE_COUNT_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).split()
  env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={num_devices}"])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
  return env


def worker_command(args, num_devices: int, records_path: Path) -> list[str]:
  command = [
    sys.executable,
    "-m",
    "benchmarks.train_throughput",
    "--in-process",
    "--device-counts",
    str(num_devices),
    "--models",
    ",".join(args.models),
    "--repeats",
    str(args.repeats),
    "--warmup",
    str(args.warmup),
    "--dtypes",
    ",".join(args.dtypes),
    "--records-out",
    str(records_path),
  ]
  if args.variants is not None:
    command += ["--variants", ",".join(args.variants)]
  if args.quick:
    command.append("--quick")
  return command


def run_in_subprocesses(args, log=print) -> list[dict[str, Any]]:
  """Runs each device count in a fresh process (XLA_FLAGS must precede JAX's start)."""
  records = []
  with tempfile.TemporaryDirectory() as tmp:
    for num_devices in args.device_counts:
      path = Path(tmp) / f"records_{num_devices}.json"
      completed = subprocess.run(
        worker_command(args, num_devices, path),
        cwd=REPO_ROOT,
        env=device_count_env(num_devices),
        text=True,
        capture_output=True,
      )
      log(completed.stdout.rstrip())
      if completed.returncode != 0 or not path.exists():
        raise RuntimeError(
          f"worker for {num_devices} devices failed "
          f"(exit {completed.returncode}):\n{completed.stderr[-4000:]}"
        )
      records += json.loads(path.read_text())["records"]
  return records


# --- Reports -------------------------------------------------------------------------------------


DETAIL_COLUMNS = (
  *common.plain_columns("model", "variant", "dtype"),
  common.Column("devices", "num_devices"),
  common.Column("batch", "batch"),
  common.Column("tokens/step", "tokens_per_step"),
  *common.timing_columns("ms/step"),
  common.Column("steps/s", "steps_per_s", lambda v: f"{v:.3g}"),
  common.Column("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
  common.Column("compile s", "compile_s", lambda v: f"{v:.3g}"),
  common.Column("params", "num_params", lambda v: f"{v:,}"),
  common.Column("temp MiB", "temp_bytes", common.format_mib),
  common.Column("XLA GFLOP/step", "xla_flops", common.format_giga),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)


def _dtype(record) -> str:
  return record.get("dtype", "float32")  # reports before --dtypes measured float32 only


def steps_per_second_table(records, device_counts) -> str:
  """Rows: model/variant/dtype; columns: steps/s per device count."""
  by_key = {(r["model"], r["variant"], _dtype(r), r["num_devices"]): r for r in records}
  rows = []
  for model_name, variant, dtype in dict.fromkeys(
    (r["model"], r["variant"], _dtype(r)) for r in records
  ):
    row = {"model": model_name, "variant": variant, "dtype": dtype}
    for n in device_counts:
      r = by_key.get((model_name, variant, dtype, n))
      row[str(n)] = (
        None
        if r is None or r["steps_per_s"] is None
        else (f"{r['steps_per_s']:.3g} ({r['tokens_per_s']:,.0f} tok/s)")
      )
      if r is not None and r["status"] != "ok":
        row[str(n)] = r["status"]
    rows.append(row)
  columns = [*common.plain_columns("model", "variant", "dtype")] + [
    common.Column(f"{n} device(s): steps/s (tokens/s)", str(n)) for n in device_counts
  ]
  return common.render_markdown_table(columns, rows)


def bfloat16_speedups(records) -> list[dict[str, Any]]:
  """Per (model, variant, devices) measured in both dtypes: bfloat16 steps/s over float32's."""
  by_key = {
    (r["model"], r["variant"], r["num_devices"], _dtype(r)): r
    for r in records
    if r["steps_per_s"] is not None
  }
  return [
    dict(
      model=model_name,
      variant=variant,
      num_devices=n,
      float32_ms=1e3 / r["steps_per_s"],
      bfloat16_ms=1e3 / by_key[(model_name, variant, n, "bfloat16")]["steps_per_s"],
      speedup=by_key[(model_name, variant, n, "bfloat16")]["steps_per_s"] / r["steps_per_s"],
    )
    for (model_name, variant, n, dtype), r in by_key.items()
    if dtype == "float32" and (model_name, variant, n, "bfloat16") in by_key
  ]


SPEEDUP_COLUMNS = (
  *common.plain_columns("model", "variant"),
  common.Column("devices", "num_devices"),
  common.Column("float32 ms/step", "float32_ms", lambda v: f"{v:.3g}"),
  common.Column("bfloat16 ms/step", "bfloat16_ms", lambda v: f"{v:.3g}"),
  common.Column("bfloat16 speed-up", "speedup", common.format_ratio),
)


def render_markdown(payload) -> str:
  config = payload["config"]
  speedups = bfloat16_speedups(payload["records"])
  return "\n".join(
    [
      *common.report_header("Training-step throughput", payload["metadata"]),
      "",
      "Forward + backward + optimizer update of the real model, jitted once, median of "
      f"{config['repeats']} warm steps after {config['warmup']} warm-up steps. Data-parallel over "
      "the first N devices (virtual CPU devices share the same cores). Definitions: "
      "benchmarks/README.md.",
      "",
      "## Steps per second",
      "",
      steps_per_second_table(payload["records"], config["device_counts"]),
      "",
      *(
        [
          "## bfloat16 compute against float32 (float32 parameters)",
          "",
          common.render_markdown_table(SPEEDUP_COLUMNS, speedups),
          "",
        ]
        if speedups
        else []
      ),
      "## All records",
      "",
      common.render_markdown_table(DETAIL_COLUMNS, payload["records"]),
      "",
    ]
  )


# --- Command line --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.train_throughput",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--models", type=common.comma_list(choices=MODELS), default=list(MODELS))
  common.add_variants_argument(parser)
  parser.add_argument("--device-counts", type=common.comma_list(int), default=[1, 8])
  parser.add_argument(
    "--repeats", type=int, default=None, help="timed steps (default 10; 2 with --quick)"
  )
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
  parser.add_argument(
    "--dtypes",
    type=common.comma_list(choices=DTYPE_FLAGS),
    default=["float32"],
    help="compute dtypes (config.model.dtype; parameters float32), e.g. float32,bfloat16",
  )
  common.add_output_arguments(parser)
  parser.add_argument("--quick", action="store_true", help="tiny models and batches")
  parser.add_argument(
    "--in-process",
    action="store_true",
    help="run every device count in this process (XLA_FLAGS set by the caller)",
  )
  parser.add_argument("--records-out", default=None, help=argparse.SUPPRESS)  # worker output
  args = parser.parse_args(argv)
  if args.repeats is None:
    args.repeats = 2 if args.quick else 10
  return args


def run(args, log=print) -> dict[str, Path]:
  """Runs the benchmark and writes ``train_throughput[_label].json`` and ``.md``."""
  records = (run_in_process if args.in_process else run_in_subprocesses)(args, log)
  label = args.device_label or common.default_device_label()
  config = dict(
    models=list(args.models),
    variants=args.variants,
    device_counts=list(args.device_counts),
    dtypes=list(args.dtypes),
    repeats=args.repeats,
    warmup=args.warmup,
    quick=args.quick,
  )
  payload = dict(metadata=common.run_metadata(label), config=config, records=records)
  return common.write_reports(args.out_dir, "train_throughput", label, payload, render_markdown)


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  if args.records_out:  # Worker: records only, the parent writes the reports.
    common.write_json(args.records_out, {"records": run_in_process(args)})
    return
  paths = run(args)
  print("wrote", *map(str, paths.values()))


if __name__ == "__main__":
  main(sys.argv[1:])
