"""The 'sraven' task: symbolic Raven matrices, compositional generalisation (docs/maths.md §4).

Data (``primal_dual.data.sraven``). Splits:

  * ``train``: in-distribution latents (rule multisets), ``data.num_train`` problems drawn from the
    training stream (``num_train_steps × batch_size`` by default, so no problem is seen twice);
  * ``validation``: in-distribution latents, its own stream: the model-selection split;
  * ``test``: in-distribution latents, a third stream: in-distribution accuracy;
  * ``ood``: the held-out latents (rule combinations never trained on): compositional accuracy.

Selection is on ``validation``, never on ``ood``: ``selected/ood_whole_panel_accuracy`` is the OOD
accuracy of the checkpoint with the best validation accuracy. ``best/ood_whole_panel_accuracy``
(the best OOD value over evaluations) is optimistic and must not be reported as the result.

Model: ``SequenceTransformer`` with ``num_outputs = V``; the logits of the last ``F`` positions
(the query tokens) predict the answer panel's ``F`` features.

Loss and metrics (``sraven_loss_and_metrics``), for logits ``[B, F, V]`` and targets ``[B, F]``:

  * ``loss``: cross-entropy averaged over the ``F`` features, then over real examples;
  * ``whole_panel_accuracy``: share of problems whose ``F`` argmaxes all equal the targets;
  * ``feature_accuracy``: share of correct features (the mean over ``F`` per problem, then over
    problems).

Training problems are generated on the fly (one jitted call per record: 0.27 ms on this 2-core
CPU) or, with ``data.materialize_train``, generated up front in batches of ``data.chunk_size``
(8192 problems in about 0.06 s) and stored compactly (tokens as int8): reading a record is then
14 µs. The stored problems are exactly those of the stream, so the two modes train on the same
data. (grain's own overhead, about 0.3 ms per record here, remains either way.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from primal_dual.data import generated
from primal_dual.data import sraven
from primal_dual.experiments import common
from primal_dual.experiments import grid
from primal_dual.models import SequenceTransformer
from primal_dual.training import tasks as tasks_lib

EVAL_SPLITS = ("validation", "test", "ood")
SELECTION_METRIC = "whole_panel_accuracy"
SEQUENCE_FIELDS = (
  "num_layers",
  "model_dim",
  "num_heads",
  "mlp_dim",
  "dropout_rate",
  "attention_dropout_rate",
  "qkv_features",
  "num_buckets",
  "max_distance",
  "position_buckets",
  "mlp_kernel_init",
)
# Fields of a record the training loop needs; the others (rules, latent ids, slot orders) serve
# analysis and are kept only in the evaluation splits.
TRAIN_FIELDS = ("inputs", "targets")


def example_weights(batch: Mapping[str, jax.Array], batch_size: int) -> jax.Array:
  """float32 ``[batch]``: 1 for real examples, 0 for the padding rows of an eval batch."""
  valid = batch.get("valid")
  if valid is None:
    return jnp.ones((batch_size,), jnp.float32)
  return valid.astype(jnp.float32)


def weighted_sum(values: jax.Array, weights: jax.Array) -> jax.Array:
  """``Σ_b w_b · values_b`` with padding rows (w = 0) dropped even if their values are NaN."""
  return jnp.where(weights > 0, values * weights, 0.0).sum()


def answer_logits(outputs: jax.Array, num_features: int) -> jax.Array:
  """The query positions' logits: ``outputs [B, T, V]`` → float32 ``[B, F, V]`` (last F rows)."""
  return outputs[:, -num_features:, :].astype(jnp.float32)


def sraven_loss_and_metrics(
  outputs: jax.Array, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
  """Cross-entropy on the answer panel and exact-match metrics (see the module docstring).

  Args:
    outputs: float ``[B, T, V]``, the model's per-position logits.
    batch: ``targets`` int32 ``[B, F]`` and, for eval batches, ``valid`` bool ``[B]``.

  Returns:
    (mean loss over real examples, ``{name: (sum over real examples, their count)}``).
  """
  targets = batch["targets"]
  logits = answer_logits(outputs, targets.shape[-1])
  weights = example_weights(batch, targets.shape[0])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=-1)
  feature_correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [B, F]
  panel_correct = sraven.whole_panel_correct(logits, targets).astype(jnp.float32)
  count = weights.sum()
  loss_sum = weighted_sum(losses, weights)
  return loss_sum / jnp.maximum(count, 1.0), {
    "loss": (loss_sum, count),
    "whole_panel_accuracy": (weighted_sum(panel_correct, weights), count),
    "feature_accuracy": (weighted_sum(feature_correct.mean(axis=-1), weights), count),
  }


# ------------------------------------------------------------------------------------------------
# Compact pre-generated training problems.


def encode_tokens(inputs: np.ndarray) -> np.ndarray:
  """One-hot tokens ``float [..., T, V]`` → int8 ``[..., T]`` values, −1 for all-zero tokens."""
  inputs = np.asarray(inputs)
  return np.where(inputs.any(axis=-1), inputs.argmax(axis=-1), -1).astype(np.int8)


def decode_tokens(tokens: np.ndarray, num_values: int) -> np.ndarray:
  """Inverse of ``encode_tokens``: int ``[..., T]`` → float32 one-hot ``[..., T, V]``."""
  # Row V of eye(V + 1, V) is all zeros: index −1 wraps to it.
  return np.eye(num_values + 1, num_values, dtype=np.float32)[tokens]


class MaterializedSRavenSource:
  """The first ``size`` problems of a split's stream, generated up front and stored compactly.

  Record ``i`` equals ``SRavenSource(config, split, seed, size)[i]`` restricted to ``fields``.
  Memory: ``9F + F`` bytes per problem (int8 tokens and targets), 40 MB for 10⁶ problems with F = 4.

  Args:
    config: the problem family.
    split: a split of ``sraven.SPLITS``.
    seed: stream seed.
    size: number of problems.
    chunk_size: problems per jitted generator call.
    fields: record fields returned, a subset of ``TRAIN_FIELDS`` (``inputs``, ``targets``).
  """

  def __init__(
    self,
    config: sraven.SRavenConfig,
    split: str,
    seed: int,
    size: int,
    *,
    chunk_size: int = 8192,
    fields: tuple[str, ...] = TRAIN_FIELDS,
  ):
    sraven.SRavenSource(config, split, seed, size)  # validates the arguments
    if not set(fields) <= set(TRAIN_FIELDS):
      raise ValueError(f"MaterializedSRavenSource stores only {TRAIN_FIELDS}; got fields={fields}")
    if config.num_values > np.iinfo(np.int8).max:
      raise ValueError(
        f"MaterializedSRavenSource stores values as int8 (at most 127); "
        f"num_values={config.num_values}: set data.materialize_train=False"
      )
    self.config, self.split, self.seed, self.size = config, split, seed, int(size)
    self.fields = tuple(fields)
    tokens, targets = [], []
    for start in range(0, self.size, chunk_size):
      batch = sraven.generate_batch(
        config, seed, np.arange(start, min(start + chunk_size, self.size)), split
      )
      tokens.append(encode_tokens(batch["inputs"]))
      targets.append(batch["targets"].astype(np.int8))
    self._tokens = np.concatenate(tokens)
    self._targets = np.concatenate(targets)

  def __len__(self) -> int:
    return self.size

  def _record(self, index: int) -> dict[str, np.ndarray]:
    record = {
      "inputs": decode_tokens(self._tokens[index], self.config.num_values),
      "targets": self._targets[index].astype(np.int32),
    }
    return {name: record[name] for name in self.fields}

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self.size:
      raise IndexError(f"index {index} out of range for a source of size {self.size}.")
    return self._record(index)

  def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
    return [self[i] for i in indices]

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Records ``indices`` stacked (``{field: [len(indices), ...]}``) in one gather; what
    ``pipeline.make_loader(batch_reads=True)`` reads."""
    indices = np.asarray(indices, np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= self.size):
      raise IndexError(f"indices out of range for a source of size {self.size}.")
    batch = {
      "inputs": decode_tokens(self._tokens[indices], self.config.num_values),
      "targets": self._targets[indices].astype(np.int32),
    }
    return {name: batch[name] for name in self.fields}

  def __repr__(self) -> str:
    # Stable across processes and restarts: grain checks it when restoring an iterator.
    return (
      f"MaterializedSRavenSource(split={self.split!r}, seed={self.seed}, size={self.size}, "
      f"fields={self.fields}, config={self.config})"
    )


class FieldsSource:
  """A source whose records keep only ``fields`` (training batches need no analysis fields)."""

  def __init__(self, source: Any, fields: tuple[str, ...]):
    self.source, self.fields = source, tuple(fields)

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    record = self.source[index]
    return {name: record[name] for name in self.fields}

  def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
    return [{name: r[name] for name in self.fields} for r in self.source.__getitems__(indices)]

  def __repr__(self) -> str:
    return f"FieldsSource({self.source!r}, fields={self.fields})"


# ------------------------------------------------------------------------------------------------
# Task definition.


def sraven_config(data: ml_collections.ConfigDict) -> sraven.SRavenConfig:
  """The problem family named by ``config.data``."""
  return common.config_dataclass(sraven.SRavenConfig, data)


def train_size(config: ml_collections.ConfigDict) -> int:
  """``data.num_train``, or ``num_train_steps × batch_size`` (each problem seen once) if ≤ 0."""
  return common.stream_train_size(config, "sRAVEN")


TrainSourceBuilder = Callable[[sraven.SRavenConfig, int, int, ml_collections.ConfigDict], Any]

TRAIN_SOURCES: dict[bool, TrainSourceBuilder] = {
  True: lambda problems, seed, size, data: MaterializedSRavenSource(
    problems, "train", seed, size, chunk_size=data.get("chunk_size", 8192)
  ),
  False: lambda problems, seed, size, data: FieldsSource(
    sraven.SRavenSource(problems, "train", seed, size), TRAIN_FIELDS
  ),
}


def build_data(config: ml_collections.ConfigDict):
  """Splits train / validation / test / ood and the metadata the model needs."""
  data = config.data
  problems = sraven_config(data)
  seed = data.get("stream_seed", 0)
  # Batches made on the device never read the host's train split: nothing to store up front.
  materialize = bool(data.get("materialize_train", True)) and not config.get(
    "train_data_on_device", False
  )
  train = functools.partial(TRAIN_SOURCES[materialize], problems, seed, train_size(config), data)
  splits = {"train": tasks_lib.LazySplit(train)}  # built only when training reads it
  for split in EVAL_SPLITS:
    size = data.get(f"num_{split}", 0)
    if size > 0:
      splits[split] = sraven.SRavenSource(problems, split, seed, size)
  metadata = {
    "num_features": problems.num_features,
    "num_values": problems.num_values,
    "num_tokens": problems.num_tokens,
    "num_rules": problems.num_rules,
    "rules": problems.rules,
    "problems": problems,
  }
  return splits, metadata


def device_train_stream(
  config: ml_collections.ConfigDict, metadata: dict
) -> Callable[[jax.Array, jax.Array], dict[str, jax.Array]]:
  """``(indices uint32 [B], seed int []) -> {'inputs', 'targets'}`` of run ``seed``'s train
  stream, made on the device."""
  stream = sraven.split_stream(metadata["problems"], "train")
  stream_seed = config.data.get("stream_seed", 0)

  def batch(indices, seed):
    records = stream(generated.replica_stream_seed(stream_seed, seed), indices)
    return {name: records[name] for name in TRAIN_FIELDS}

  return batch


def build_model(config: ml_collections.ConfigDict, metadata: dict) -> SequenceTransformer:
  return SequenceTransformer(
    num_outputs=metadata["num_values"], **common.model_arguments(config.model, SEQUENCE_FIELDS)
  )


def register_sequence_task(
  module_name: str, loss_and_metrics: Callable[..., Any], selection_metric: str
) -> tasks_lib.Task:
  """Registers the generated sequence task of module ``module_name`` (this one or logic.py, named
  by its ``__name__``) from its ``build_data``, ``build_model``, ``EVAL_SPLITS`` and
  ``device_train_stream``; the checkpoint kept is the one of the largest ``selection_metric``."""
  module = sys.modules[module_name]
  return tasks_lib.register_task(
    tasks_lib.Task(
      name=module_name.rpartition(".")[2],
      build_data=module.build_data,
      build_model=module.build_model,
      loss_and_metrics=loss_and_metrics,
      eval_splits=module.EVAL_SPLITS,
      selection_metric=selection_metric,
      selection_mode="max",
      device_train_stream=module.device_train_stream,
    )
  )


TASK = register_sequence_task(__name__, sraven_loss_and_metrics, SELECTION_METRIC)


# ------------------------------------------------------------------------------------------------
# The reproduction grid (``primal-dual reproduce sraven``). The fuzzy-logic grid (logic.py) uses
# its plan, flags, per-run facts and report pieces.


def sequence_grid_commands(
  task: str, *, cpu: str, paper: str, resume: str, smoke_note: str = ""
) -> str:
  """The commands part of a sequence grid's ``--help`` (this module's and logic.py's): the CPU
  preset, the paper's setup and a smoke test, each under its comment (``cpu``, ``paper``, and
  ``smoke_note`` closing the smoke test's), then the ``resume`` paragraph."""

  def comment(text: str) -> str:
    return "\n".join(f"  # {line}" for line in text.splitlines())

  return f"""Commands (from the repository root; ``primal-dual reproduce {task}`` where the package is
installed)::

{comment(cpu)}
  .venv/bin/python scripts/reproduce.py {task}

{comment(paper)}
  python scripts/reproduce.py {task} --preset=paper --root=workdirs/{task}_paper

  # Smoke test: 2 tiny runs (softmax and hyla, runlocal){smoke_note}.
  .venv/bin/python scripts/reproduce.py {task} --quick --root=/tmp/{task}_quick \\
      --results=/tmp/{task}_quick/{task}.json

{resume}
"""


GRID_COMMANDS = r"""
Runs the grid (``primal_dual/configs/sraven.py``, one workdir per run under ``--root``):
the preset's main variants × seeds 0, 1, 2 and its ablations × seed 0 (``GRID_VARIANTS``: for
``cpu`` softmax, linear, hyla and hyla_no_relu, hyla_no_norm; for ``paper`` the paper's baselines
softmax, linear_plain, hyla and the other Table A1 rows). The fuzzy-logic grid uses the same plan.
For every run it records

* in-distribution (``test``) and OOD (``ood``, held-out rule combinations) whole-panel accuracy of
  the checkpoint selected on ``validation`` (never on OOD), plus the last evaluation's values;
* the learning curve (every evaluation in the run's ``metrics.jsonl``);
* latent-code decoding accuracy (``primal_dual/analysis/latent_code.py``, on the OOD split, at
  the selected checkpoint; cached in the workdir as ``latent_code.json``);
* training speed: the median of the logged ``train/steps_per_second`` after the first log period
  (which includes compilation), and the wall time of the run;

and writes ``--results`` (default results/sraven.json, one record per run), the same path with
``.md`` (mean ± std over seeds, HYLA's step time relative to softmax's, the GPU command for the
reference scale) and with ``_curves.png``.

""" + sequence_grid_commands(
  "sraven",
  cpu="""CPU preset: 11 runs of 12k steps. At the speeds measured on this 2-core CPU under a load
average of 6-8 (primal_dual/configs/sraven.py): softmax ~12 min, HYLA and its ablations
~35 min per run; linear ~20 min (estimated from its step time, 76 ms vs softmax's 42 ms): ~4.5 h in all.""",
  paper="""The paper's setup (primal_dual/configs/sraven.py `paper`, 156,250 steps of batch 128): an
accelerator.""",
  smoke_note=", seconds each",
  resume="""Re-running the same command resumes: finished runs are not trained again, an interrupted one
continues from its last checkpoint, and cached analyses are reused.""",
)
CONFIG_FILE = "sraven"  # a packaged config (primal_dual/configs/sraven.py)
# Preset → (main variants, run at every seed; ablations, run at seed 0). The paper preset runs
# the paper's baselines (its linear attention is `linear_plain`) and the other Table A1 rows.
GRID_VARIANTS = {
  "cpu": (("softmax", "linear", "hyla"), ("hyla_no_relu", "hyla_no_norm")),
  "paper": (
    ("softmax", "linear_plain", "hyla"),
    ("hyla_linear_value", "hyla_no_norm", "hyla_no_relu", "hyla_no_relu_no_norm", "hyla_softmax"),
  ),
}
SEEDS = (0, 1, 2)
QUICK_VARIANTS = ("softmax", "hyla")
LATENT_CACHE = "latent_code.json"
REFERENCE_COMMAND = (
  "python scripts/reproduce.py sraven --preset=paper "
  "--root=workdirs/sraven_paper --results=results/paper/sraven.json"
)
REFERENCE_SINGLE_RUN = (
  "python train.py --config=primal_dual/configs/sraven.py:preset=paper,"
  "attention=hyla,seed=0 --workdir=workdirs/sraven_paper_hyla"
)


def grid_plan(quick: bool, preset: str = "cpu") -> list[tuple[str, int]]:
  """(attention, seed) pairs: main variants × 3 seeds, then the ablations × seed 0."""
  if quick:
    return [(attention, 0) for attention in QUICK_VARIANTS]
  main, ablations = GRID_VARIANTS[preset]
  return [(attention, seed) for seed in SEEDS for attention in main] + [
    (attention, 0) for attention in ablations
  ]


def build_runs(
  config_file: str,
  task: str,
  preset: str,
  quick: bool,
  steps: int,
  steps_per_call: int = 1,
  seeds_together: bool = False,
) -> list[grid.GridRun]:
  """The grid's ``GridRun``s; ``quick`` uses the configs' ``runlocal``.

  One run per (attention, seed); with ``seeds_together``, one run per attention trains its seeds
  as replicas in one program (batches made on the device). ``steps_per_call > 1`` (or
  ``seeds_together``) trains on device-made batches, that many steps per jitted call.
  """
  label = "quick" if quick else preset
  overrides = (
    {"train_data_on_device": True, "steps_per_call": steps_per_call}
    if steps_per_call > 1 or seeds_together
    else {}
  )
  seeds_by_variant: dict[str, list[int]] = {}
  for attention, seed in grid_plan(quick, preset):
    seeds_by_variant.setdefault(attention, []).append(seed)
  runs = []
  for attention, seeds in seeds_by_variant.items():
    groups = [tuple(seeds)] if seeds_together and len(seeds) > 1 else [(s,) for s in seeds]
    for group in groups:
      config_arg = grid.config_argument(
        dict(preset=preset, attention=attention, seed=group[0]), dict(steps=steps), runlocal=quick
      )
      together = len(group) > 1
      runs.append(
        grid.GridRun(
          name=f"{task}_{label}_{attention}_s{'-'.join(map(str, group))}",
          config_file=config_file,
          config_arg=config_arg,
          tags=dict(attention=attention, preset=label, **({} if together else {"seed": group[0]})),
          overrides=overrides,
          replica_seeds=group if together else (),
        )
      )
  return runs


def sequence_grid_runs(task: str, args: argparse.Namespace) -> list[grid.GridRun]:
  """``build_runs`` of the task's packaged config with the flags of ``add_sequence_grid_arguments``."""
  return build_runs(
    task, task, args.preset, args.quick, args.steps, args.steps_per_call, args.seeds_together
  )


# The flags of the sRAVEN and fuzzy-logic grids: flag → add_argument options.
SEQUENCE_GRID_FLAGS: dict[str, dict[str, Any]] = {
  "--preset": dict(choices=("cpu", "paper"), default="cpu"),
  "--steps": dict(type=int, default=-1, help="override the preset's steps"),
  "--steps_per_call": dict(
    type=int,
    default=1,
    help="optimizer steps per jitted call (> 1: batches made on the device); "
    "must divide the preset's log/eval/checkpoint periods (e.g. 125)",
  ),
  "--seeds_together": dict(
    action="store_true", help="train each variant's seeds as replicas of one program (config.seeds)"
  ),
}


# ------------------------------------------------------------------------------------------------
# Per-run facts read from the workdir (shared with the fuzzy-logic grid).


def read_jsonl(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def learning_curve(workdir: str, names: Sequence[str]) -> dict[str, list]:
  """``{'step': [...], name: [...]}`` from every evaluation record of ``metrics.jsonl``."""
  records = [
    r
    for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if all(r.get(name) is not None for name in names)
  ]
  curve = {"step": [int(r["step"]) for r in records]}
  curve.update({name: [float(r[name]) for r in records] for name in names})
  return curve


def median_steps_per_second(workdir: str) -> float | None:
  """Median logged training speed, leaving out the first log period (it includes compilation)."""
  speeds = [
    r["train/steps_per_second"]
    for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if r.get("train/steps_per_second") is not None
  ]
  if not speeds:
    return None
  return float(np.median(speeds[1:] if len(speeds) > 1 else speeds))


def cached_latent_code(
  workdir: str, metrics: Mapping[str, Any], max_examples: int
) -> dict[str, Any]:
  """The latent-code analysis of the selected checkpoint, cached in ``latent_code.json``."""
  key = [metrics.get("step"), metrics.get("selected/step"), max_examples]
  return grid.cached(
    os.path.join(workdir, LATENT_CACHE), key, lambda: _latent_code(workdir, max_examples)
  )


def _latent_code(workdir: str, max_examples: int) -> dict[str, Any]:
  from primal_dual.analysis import latent_code  # pylint: disable=g-import-not-at-top

  from primal_dual.training import evaluation  # pylint: disable=g-import-not-at-top

  # Built for evaluation: the (lazy) train split is never generated.
  experiment, state = evaluation.restore_workdir(workdir, "selected")
  return latent_code.run(experiment, state, split="ood", max_examples=max_examples, out_dir=workdir)


class CurveFigure(NamedTuple):
  """A grid's learning-curves figure: its title, y axis, and the titles of the panels of the
  first ``CURVE_METRICS`` (one panel each)."""

  title: str
  ylabel: str
  panel_titles: tuple[str, ...]


CURVE_METRICS = (
  "test/whole_panel_accuracy",
  "ood/whole_panel_accuracy",
  "validation/whole_panel_accuracy",
)
CURVE_FIGURE = CurveFigure(
  title="sRAVEN learning curves",
  ylabel="whole-panel accuracy",
  panel_titles=("in-distribution (test)", "held-out rule combinations (ood)"),
)


def progress_fields(workdir: str, curve_metrics: Sequence[str]) -> dict[str, Any]:
  """A run's learning curve of ``curve_metrics`` and its median training speed (shared with
  logic.py's records)."""
  return {
    "curve": learning_curve(workdir, curve_metrics),
    "steps_per_second": median_steps_per_second(workdir),
  }


def record_fn(
  run: grid.GridRun, metrics: Mapping[str, Any], workdir: str, args: argparse.Namespace
) -> dict[str, Any]:
  """A record's task fields: accuracies, curve, latent decoding and speed of a run."""
  del run
  latent = cached_latent_code(workdir, metrics, args.max_examples)
  return {
    "id_whole_panel": float(metrics["selected/test_whole_panel_accuracy"]),
    "ood_whole_panel": float(metrics["selected/ood_whole_panel_accuracy"]),
    "id_feature": float(metrics["selected/test_feature_accuracy"]),
    "ood_feature": float(metrics["selected/ood_feature_accuracy"]),
    "selected_step": int(metrics["selected/step"]),
    "final_id_whole_panel": float(metrics["test/whole_panel_accuracy"]),
    "final_ood_whole_panel": float(metrics["ood/whole_panel_accuracy"]),
    **progress_fields(workdir, CURVE_METRICS),
    "latent_decoding": (latent.get("best_layer_accuracy") if latent.get("available") else None),
    "latent_decoding_chance": (
      latent["per_layer"][0]["chance"] if latent.get("available") else None
    ),
    "latent_code": latent,
  }


# ------------------------------------------------------------------------------------------------
# Report (shared with the fuzzy-logic grid).


def speed_ratio(
  records: Sequence[Mapping[str, Any]], numerator: str = "hyla", denominator: str = "softmax"
) -> float | None:
  """Step time of ``numerator`` over that of ``denominator`` (mean steps/s over their runs)."""

  def mean_speed(attention):
    speeds = [
      r["steps_per_second"]
      for r in records
      if r["attention"] == attention and r.get("steps_per_second")
    ]
    return float(np.mean(speeds)) if speeds else None

  slow, fast = mean_speed(numerator), mean_speed(denominator)
  if not slow or not fast:
    return None
  return fast / slow  # time per step ∝ 1 / speed


def speed_ratio_line(records: Sequence[Mapping[str, Any]]) -> str:
  """The report's sentence on HYLA's step time relative to softmax's."""
  ratio = speed_ratio(records)
  if not ratio:
    return "HYLA/softmax step-time ratio: not available (needs runs of both)."
  return (
    f"HYLA's training step takes {ratio:.2f}× the time of softmax attention's on the same model "
    "(mean logged steps/s over runs, compilation excluded)."
  )


def environment_line(command: str, records: Sequence[Mapping[str, Any]]) -> str:
  return (
    f"Measured by `{command}` on {grid.describe_hardware(records)}."
    + grid.shared_machine_note(command)
  )


def plot_curves(
  records: Sequence[Mapping[str, Any]],
  panels: Mapping[str, str],
  path: str,
  ylabel: str,
  title: str,
) -> str:
  """One panel per metric (title → curve key), one line per run, coloured by attention."""
  from primal_dual.analysis import plots  # pylint: disable=g-import-not-at-top

  plt = plots.pyplot()
  variants = list(dict.fromkeys(r["attention"] for r in records))
  colours = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
  figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
  for axis, (panel_title, key) in zip(axes[0], panels.items()):
    seen = set()
    for record in records:
      curve = record["curve"]
      label = None if record["attention"] in seen else record["attention"]
      seen.add(record["attention"])
      axis.plot(
        curve["step"], curve[key], color=colours[record["attention"]], alpha=0.8, label=label
      )
    axis.set_title(panel_title)
    axis.set_xlabel("training step")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=8)
  figure.suptitle(title)
  figure.tight_layout()
  return plots.save_figure(figure, path, dpi=100, tight_bbox=False)


def markdown_report(records: Sequence[Mapping[str, Any]], command: str) -> str:
  chance = whole_panel_chance(records[0]["config_file"], records[0]["config_arg"])
  columns = {
    "ID whole-panel %": grid.field("id_whole_panel"),
    "OOD whole-panel %": grid.field("ood_whole_panel"),
    "OOD feature %": grid.field("ood_feature"),
    "OOD last eval %": grid.field("final_ood_whole_panel"),
    "latent decoding %": grid.field("latent_decoding"),
    "decoding chance %": grid.field("latent_decoding_chance"),
    "steps/s": grid.field("steps_per_second"),
    "wall time (min)": grid.field("wall_time_s"),
  }
  scales = {"steps/s": 1.0, "wall time (min)": 1 / 60}
  presets = sorted({str(r["preset"]) for r in records})
  lines = [
    "# sRAVEN: compositional generalisation of HYLA, softmax and linear attention\n",
    environment_line(command, records) + f" Preset: {', '.join(presets)} "
    "(primal_dual/configs/sraven.py). Cells are mean ± std over seeds (n runs). Accuracies are "
    "those of the checkpoint selected on the "
    "in-distribution validation split: ID = the in-distribution test split, OOD = problems "
    "whose rule combination was held out of training. Whole-panel accuracy is the exact match "
    f"of every feature of the answer panel; chance is {100 * chance:.2f}%. Latent decoding: "
    "accuracy of a ridge decoder reading each feature's rule from the attention weights across "
    "heads (best layer, fitted on half of the OOD problems, scored on the other half; "
    "primal_dual/analysis/latent_code.py); its chance is the majority rule. Per-run records and "
    "learning curves: the .json of the same name; curves: the _curves.png next to it.\n",
    grid.summary_table(records, ("attention",), columns, scales),
    "\n" + speed_ratio_line(records) + "\n",
    "\n## Reference scale (accelerator)\n",
    "The HYLA paper's setup (F = 4, V = 8, 8 rules, shuffled slots; d 128, 16 heads of q/k/v "
    "width 64, 4 layers; 156,250 steps of batch 128) is the `paper` preset, meant for an "
    "accelerator:\n",
    f"```\n{REFERENCE_COMMAND}\n# or a single run:\n{REFERENCE_SINGLE_RUN}\n```\n",
    "\nPublished claim (reference, not measured here): HYLA ahead of softmax and linear "
    "attention on OOD whole-panel accuracy (Schug et al.).\n",
  ]
  return "\n".join(lines)


def whole_panel_chance(config_file: str, config_arg: str) -> float:
  """``V^−F``: the whole-panel accuracy of guessing uniformly."""
  config = grid.load_config(config_file, config_arg)
  return float(config.data.num_values) ** -float(config.data.num_features)


def write_curves(
  records: Sequence[Mapping[str, Any]],
  args: argparse.Namespace,
  *,
  panels: Mapping[str, str],
  ylabel: str,
  title: str,
) -> list[str]:
  """The learning-curves figure, ``<--results without .json>_curves.png``."""
  path = os.path.splitext(args.results)[0] + "_curves.png"
  return [plot_curves(records, panels, path, ylabel, title)]


# The grid's own flags: flag → add_argument options.
FLAGS: dict[str, dict[str, Any]] = {
  **SEQUENCE_GRID_FLAGS,
  "--max_examples": dict(
    type=int, default=1024, help="OOD problems used by the latent-code analysis"
  ),
}


def sequence_reproduction(module_name: str, summary: str) -> grid.Reproduction:
  """The grid of a sequence task (this module's or logic.py's, named by ``module_name``): the
  shared plan and flags, and the learning-curves figure of the module's ``CURVE_FIGURE``."""
  task = module_name.rpartition(".")[2]
  module = sys.modules[module_name]
  figure = module.CURVE_FIGURE
  return grid.module_reproduction(
    module_name,
    task=task,
    summary=summary,
    quick="2 tiny runs (softmax, hyla; the configs' runlocal)",
    build_runs=functools.partial(sequence_grid_runs, task),
    write_figures=functools.partial(
      write_curves,
      panels=dict(zip(figure.panel_titles, module.CURVE_METRICS)),
      ylabel=figure.ylabel,
      title=figure.title,
    ),
  )


REPRODUCTION = sequence_reproduction(
  __name__, "sRAVEN: HYLA against softmax and linear attention on held-out rule combinations."
)
