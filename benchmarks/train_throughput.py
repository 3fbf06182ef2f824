"""Training-step throughput of the reference models, per attention variant, on 1 and 8 devices.

A training step is forward, backward and optimizer update of the real model
(``primal_dual.models``), jitted once (compile time reported apart) and warmed; its time is the
median of warm steps (``benchmarks.common``). Reported: steps/s, tokens/s (batch × sequence length
per second) and examples/s, with XLA's memory numbers and FLOP count of the compiled step.

Models (docs/maths.md §4):

* ``uea``: the UEA reference encoder, ``EncoderClassifier`` with 2 layers, d_model 512, 8 heads,
  feed-forward 2048, dropout 0.1, learnable positions, BatchNorm instead of LayerNorm after each
  residual (post-norm) and a flattened, padding-masked read-out as in the UEA protocol
  (Zerveas et al.), RAdam lr 1e-3; JapaneseVowels-like input ``[16, 29, 12]`` (lengths 7–29, padded,
  9 classes). Variants: softmax, linear, bn, sh, bn_sh. SH (and BN+SH) use ratios
  ``(1, 1, 1, 1, 2, 2, 2, 2)``: these series have only 7–29 steps, so a ratio of 2 already leaves
  4–15 pooled keys per head; the ``(1, 1, 2, 2, 4, 4, 8, 8)`` pattern used for long sequences would
  leave a ratio-8 head 1–4 keys, too few to fit anything.
* ``sraven``: the sRAVEN reference ``SequenceTransformer`` (d 128, 16 heads of size 4, 4 layers,
  MLP 256, pre-LN, relative position bias), AdamW lr 1e-3 with warm-up 1000 and cosine decay to
  1e-4, weight decay 0.1 on non-vector parameters; input ``[128, 36, 8]``, loss on the last 4
  positions. Variants: softmax, linear, hyla, hyla_no_relu, hyla_no_norm.

Devices: the step is data-parallel over a ``Mesh`` of the first N devices (batch sharded with
``NamedSharding(mesh, P('data'))``, parameters and optimizer state replicated). On CPU the N devices
are virtual (``XLA_FLAGS=--xla_force_host_platform_device_count=N``), which must be set before JAX
starts: by default every device count runs in its own subprocess with that flag set. With
``--in-process`` the current process runs every requested count it has devices for (set
``XLA_FLAGS`` yourself). Virtual CPU devices share the same cores, so 8 of them measure the cost of
partitioning, not a speed-up.
"""

from __future__ import annotations

import argparse
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
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks import common
from primal_dual.models import EncoderClassifier, SequenceTransformer

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
UEA_SH_RATIOS = (1, 1, 1, 1, 2, 2, 2, 2)


class Setup(NamedTuple):
  """One benchmarked model.

  Attributes:
    build_model: ``(attention, attention_options) -> nn.Module``.
    make_batch: ``np.random.Generator -> dict`` of NumPy arrays (``inputs``, optionally ``mask``,
      and the labels the loss reads).
    loss: ``(logits, batch) -> scalar``.
    optimizer: ``() -> optax.GradientTransformation``.
    variants: variant name -> ``(registry name, options)``.
    batch_size, length: the batch's size and sequence length (tokens per example).
  """

  build_model: Callable[[str, Mapping[str, Any]], nn.Module]
  make_batch: Callable[[np.random.Generator], dict[str, np.ndarray]]
  loss: Callable[[jax.Array, Mapping[str, jax.Array]], jax.Array]
  optimizer: Callable[[], optax.GradientTransformation]
  variants: Mapping[str, tuple[str, Mapping[str, Any]]]
  batch_size: int
  length: int


# --- UEA -----------------------------------------------------------------------------------------


def uea_setup(quick: bool) -> Setup:
  sizes = (
    dict(num_layers=1, model_dim=32, mlp_dim=64, batch=8, length=12)
    if quick
    else dict(num_layers=2, model_dim=512, mlp_dim=2048, batch=16, length=29)
  )
  channels, classes, min_length = 12, 9, min(7, sizes["length"])

  def build_model(attention, options):
    return EncoderClassifier(
      num_classes=classes,
      num_layers=sizes["num_layers"],
      model_dim=sizes["model_dim"],
      num_heads=8,
      mlp_dim=sizes["mlp_dim"],
      norm="batch",
      pre_norm=False,
      pooling="flatten",
      positional="learned",
      dropout_rate=0.1,
      attention=attention,
      attention_options=options,
    )

  def make_batch(rng):
    lengths = rng.integers(min_length, sizes["length"] + 1, size=sizes["batch"])
    mask = np.arange(sizes["length"])[None, :] < lengths[:, None]
    inputs = rng.standard_normal((sizes["batch"], sizes["length"], channels)).astype(np.float32)
    return dict(
      inputs=inputs * mask[..., None],
      mask=mask,
      label=rng.integers(0, classes, size=sizes["batch"]).astype(np.int32),
    )

  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  variants = {
    "softmax": ("softmax", {}),
    "linear": ("linear", {}),
    "bn": ("bn", {}),
    "sh": ("sh", {"ratios": UEA_SH_RATIOS}),
    "bn_sh": ("bn_sh", {"ratios": UEA_SH_RATIOS}),
  }
  return Setup(
    build_model,
    make_batch,
    loss,
    lambda: optax.radam(1e-3),
    variants,
    sizes["batch"],
    sizes["length"],
  )


# --- sRAVEN --------------------------------------------------------------------------------------


def _weight_decay_mask(params):
  """Decay matrices and kernels, not biases, scales or other vectors."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def sraven_optimizer() -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, 1e-3, warmup_steps=1000, decay_steps=156_000, end_value=1e-4
  )
  return optax.adamw(schedule, weight_decay=0.1, mask=_weight_decay_mask)


def sraven_setup(quick: bool) -> Setup:
  sizes = (
    dict(num_layers=1, model_dim=32, num_heads=4, mlp_dim=64, batch=8)
    if quick
    else dict(num_layers=4, model_dim=128, num_heads=16, mlp_dim=256, batch=128)
  )
  features, values, panels = 4, 8, 8
  length = panels * features + features  # 8 context panels, then F query tokens: 36.

  def build_model(attention, options):
    return SequenceTransformer(
      num_outputs=values,
      num_layers=sizes["num_layers"],
      model_dim=sizes["model_dim"],
      num_heads=sizes["num_heads"],
      mlp_dim=sizes["mlp_dim"],
      attention=attention,
      attention_options=options,
    )

  def make_batch(rng):
    tokens = rng.integers(0, values, size=(sizes["batch"], panels * features))
    context = np.eye(values, dtype=np.float32)[tokens]
    queries = np.zeros((sizes["batch"], features, values), np.float32)
    return dict(
      inputs=np.concatenate([context, queries], axis=1),
      targets=rng.integers(0, values, size=(sizes["batch"], features)).astype(np.int32),
    )

  def loss(logits, batch):
    answer_logits = logits[:, -features:]
    return optax.softmax_cross_entropy_with_integer_labels(answer_logits, batch["targets"]).mean()

  variants = {
    name: (name, {}) for name in ("softmax", "linear", "hyla", "hyla_no_relu", "hyla_no_norm")
  }
  return Setup(build_model, make_batch, loss, sraven_optimizer, variants, sizes["batch"], length)


MODELS: dict[str, Callable[[bool], Setup]] = {"uea": uea_setup, "sraven": sraven_setup}


# --- The training step ---------------------------------------------------------------------------


def init_state(setup: Setup, model: nn.Module, batch) -> dict[str, Any]:
  """``{'params', 'batch_stats', 'opt_state'}`` (``batch_stats`` empty for models without BN)."""
  variables = jax.jit(lambda rng: model.init(rng, batch["inputs"], batch.get("mask"), train=False))(
    jax.random.key(0)
  )
  params = variables["params"]
  return dict(
    params=params,
    batch_stats=variables.get("batch_stats", {}),
    opt_state=setup.optimizer().init(params),
  )


def make_train_step(setup: Setup, model: nn.Module) -> Callable:
  """``(state, batch, rng) -> (state, loss)``: forward, backward, optimizer update."""
  optimizer = setup.optimizer()

  def train_step(state, batch, rng):
    def loss_fn(params):
      variables = {"params": params, "batch_stats": state["batch_stats"]}
      logits, updates = model.apply(
        variables,
        batch["inputs"],
        batch.get("mask"),
        train=True,
        rngs={"dropout": rng},
        mutable=["batch_stats"],
      )
      return setup.loss(logits, batch), updates.get("batch_stats", state["batch_stats"])

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return dict(params=params, batch_stats=batch_stats, opt_state=opt_state), loss

  return train_step


def data_parallel(step: Callable, state, batch, rng, mesh: Mesh):
  """Places ``state`` (replicated) and ``batch`` (split on ``data``); returns the jitted step."""
  replicated = NamedSharding(mesh, P())
  split = NamedSharding(mesh, P("data"))
  state_sharding = jax.tree.map(lambda _: replicated, state)
  batch_sharding = jax.tree.map(lambda _: split, batch)
  jitted = jax.jit(
    step,
    in_shardings=(state_sharding, batch_sharding, replicated),
    out_shardings=(state_sharding, replicated),
  )
  placed = (
    jax.device_put(state, state_sharding),
    jax.device_put(batch, batch_sharding),
    jax.device_put(rng, replicated),
  )
  return jitted, placed


def _count_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


def measure(
  model_name: str, variant: str, num_devices: int, *, quick: bool, repeats: int, warmup: int
) -> dict[str, Any]:
  """One record: compile the step on ``num_devices`` devices and time warm steps."""
  setup = MODELS[model_name](quick)
  attention, options = setup.variants[variant]
  tokens = setup.batch_size * setup.length
  record: dict[str, Any] = dict(
    model=model_name,
    variant=variant,
    attention=attention,
    attention_options=dict(options),
    num_devices=num_devices,
    batch=setup.batch_size,
    length=setup.length,
    tokens_per_step=tokens,
    device_kind=jax.devices()[0].device_kind,
    time_s=None,
    time_iqr_s=None,
    repeats=0,
    steps_per_s=None,
    tokens_per_s=None,
    examples_per_s=None,
    compile_s=None,
    num_params=None,
    status="ok",
    reason="",
  )
  if len(jax.devices()) < num_devices:
    return {
      **record,
      "status": "skipped",
      "reason": f"{num_devices} devices asked, {len(jax.devices())} available",
    }
  if setup.batch_size % num_devices:
    return {
      **record,
      "status": "skipped",
      "reason": f"batch {setup.batch_size} not divisible by {num_devices} devices",
    }
  try:
    model = setup.build_model(attention, options)
    batch = jax.tree.map(jnp.asarray, setup.make_batch(np.random.default_rng(0)))
    state = init_state(setup, model, batch)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
    jitted, args = data_parallel(
      make_train_step(setup, model), state, batch, jax.random.key(1), mesh
    )
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - start
    timing = common.time_warm(compiled, *args, repeats=repeats, warmup=warmup)
  except Exception as error:  # A variant that fails is reported, not fatal.
    return {**record, "status": "error", "reason": f"{type(error).__name__}: {error}"[:400]}
  stats = common.compiled_stats(compiled)
  return {
    **record,
    **stats._asdict(),
    "time_s": timing.median_s,
    "time_iqr_s": timing.iqr_s,
    "repeats": len(timing.samples_s),
    "steps_per_s": 1.0 / timing.median_s,
    "tokens_per_s": tokens / timing.median_s,
    "examples_per_s": setup.batch_size / timing.median_s,
    "compile_s": compile_s,
    "num_params": _count_params(state["params"]),
  }


def selected_variants(model_name: str, wanted: Sequence[str] | None, quick: bool) -> list[str]:
  names = list(MODELS[model_name](quick).variants)
  return names if wanted is None else [v for v in names if v in wanted]


def run_in_process(args, log=print) -> list[dict[str, Any]]:
  """Every (device count, model, variant) record this process has devices for."""
  records = []
  for num_devices in args.device_counts:
    for model_name in args.models:
      for variant in selected_variants(model_name, args.variants, args.quick):
        record = measure(
          model_name,
          variant,
          num_devices,
          quick=args.quick,
          repeats=args.repeats,
          warmup=args.warmup,
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
    f"{r['model']:7s} {r['variant']:13s} devices={r['num_devices']} {speed} "
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
  common.Column("model", "model"),
  common.Column("variant", "variant"),
  common.Column("devices", "num_devices"),
  common.Column("batch", "batch"),
  common.Column("tokens/step", "tokens_per_step"),
  common.Column("ms/step", "time_s", common.format_ms),
  common.Column("IQR ms", "time_iqr_s", common.format_ms),
  common.Column("steps/s", "steps_per_s", lambda v: f"{v:.3g}"),
  common.Column("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
  common.Column("compile s", "compile_s", lambda v: f"{v:.3g}"),
  common.Column("params", "num_params", lambda v: f"{v:,}"),
  common.Column("temp MiB", "temp_bytes", common.format_mib),
  common.Column("XLA GFLOP/step", "xla_flops", common.format_giga),
  common.Column("status", "status"),
  common.Column("reason", "reason"),
)


def steps_per_second_table(records, device_counts) -> str:
  """Rows: model/variant; columns: steps/s per device count."""
  by_key = {(r["model"], r["variant"], r["num_devices"]): r for r in records}
  rows = []
  for model_name, variant in dict.fromkeys((r["model"], r["variant"]) for r in records):
    row = {"model": model_name, "variant": variant}
    for n in device_counts:
      r = by_key.get((model_name, variant, n))
      row[str(n)] = (
        None
        if r is None or r["steps_per_s"] is None
        else (f"{r['steps_per_s']:.3g} ({r['tokens_per_s']:,.0f} tok/s)")
      )
      if r is not None and r["status"] != "ok":
        row[str(n)] = r["status"]
    rows.append(row)
  columns = [common.Column("model", "model"), common.Column("variant", "variant")] + [
    common.Column(f"{n} device(s): steps/s (tokens/s)", str(n)) for n in device_counts
  ]
  return common.render_markdown_table(columns, rows)


def render_markdown(payload) -> str:
  config = payload["config"]
  return "\n".join(
    [
      "# Training-step throughput",
      "",
      common.render_metadata(
        payload["metadata"],
        (
          "device_label",
          "device_kind",
          "cpu_model",
          "cpu_count",
          "jax_version",
          "flax_version",
          "date_utc",
          "command",
        ),
      ),
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
      "## All records",
      "",
      common.render_markdown_table(DETAIL_COLUMNS, payload["records"]),
      "",
    ]
  )


# --- Command line --------------------------------------------------------------------------------


def _list(cast=str):
  return lambda text: [cast(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.train_throughput",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--models", type=_list(), default=list(MODELS))
  parser.add_argument(
    "--variants",
    type=_list(),
    default=None,
    help="keep only these variant names (default: every variant of each model)",
  )
  parser.add_argument("--device-counts", type=_list(int), default=[1, 8])
  parser.add_argument(
    "--repeats", type=int, default=None, help="timed steps (default 10; 2 with --quick)"
  )
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
  parser.add_argument("--out-dir", default="benchmarks/results")
  parser.add_argument(
    "--device-label",
    default=None,
    help="name in the file names and report (default: cpu, or platform-kind)",
  )
  parser.add_argument("--quick", action="store_true", help="tiny models and batches")
  parser.add_argument(
    "--in-process",
    action="store_true",
    help="run every device count in this process (XLA_FLAGS set by the caller)",
  )
  parser.add_argument("--records-out", default=None, help=argparse.SUPPRESS)  # worker output
  args = parser.parse_args(argv)
  unknown = sorted(set(args.models) - set(MODELS))
  if unknown:
    parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
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
    repeats=args.repeats,
    warmup=args.warmup,
    quick=args.quick,
    uea_sh_ratios=list(UEA_SH_RATIOS),
  )
  payload = dict(metadata=common.run_metadata(label), config=config, records=records)
  json_path = common.write_json(
    common.result_path(args.out_dir, "train_throughput", "json", label), payload
  )
  md_path = common.result_path(args.out_dir, "train_throughput", "md", label)
  md_path.write_text(render_markdown(payload))
  return {"json": json_path, "markdown": md_path}


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  if args.records_out:  # Worker: records only, the parent writes the reports.
    common.write_json(args.records_out, {"records": run_in_process(args)})
    return
  paths = run(args)
  print("wrote", *map(str, paths.values()))


if __name__ == "__main__":
  main(sys.argv[1:])
