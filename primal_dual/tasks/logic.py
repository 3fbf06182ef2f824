"""The 'logic' task: in-context regression of fuzzy-logic functions (docs/maths.md §4).

Data (``primal_dual.data.logic``). Splits:

  * ``train``: sequences of the train term sets (``data.num_train`` of them, default
    ``num_train_steps × batch_size``: no sequence repeats);
  * ``validation``: the same term sets, fresh sequences from their own stream: model selection;
  * ``test``: **held-out combinations**: term sets never trained on, made of seen conjunctions
    (what the HYLA paper calls OOD);
  * ``ood``: **held-out conjunctions**: term sets of held-out conjunctions (``data.ood_term_sets``:
    only held-out ones, as the paper's code, or any).

Every record gets ``task_variance`` float32 ``[]``: the exact variance of ``y`` for its task
(``logic.task_moments``), which the metric needs.

Model: ``SequenceTransformer`` with one output; the last position's output predicts the zeroed
``y`` of the query token.

Loss and metrics (``logic_loss_and_metrics``), for predictions ``p_b`` and targets ``y_b``:

  * ``loss`` / ``mse``: squared error ``(p_b − y_b)²`` averaged over real examples;
  * ``r2``: the pair ``(Σ_b (Var_b − (p_b − y_b)²), Σ_b Var_b)``. The trainer adds sums and counts
    over batches and divides once, so the value it reports is
    ``1 − Σ_b (p_b − y_b)² / Σ_b Var_b``: exactly ``logic.r_squared`` over the whole split;
  * ``r2_per_sequence``: the HYLA paper's R², ``mean_b (1 − (p_b − y_b)² / var_b)`` with ``var_b``
    the (population) variance of sequence b's ``seq_len`` targets, query included
    (``sequence_target_variance``); a sequence whose targets are all equal (variance 0, which
    continuous inputs make a null event) counts 0 instead of dividing by zero.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from primal_dual.data import logic
from primal_dual.tasks import _common as common
from primal_dual.models import SequenceTransformer
from primal_dual.training import task_registry

EVAL_SPLITS = ("validation", "test", "ood")
TRAIN_FIELDS = ("inputs", "target", "task_variance")


def sequence_target_variance(inputs: jax.Array, target: jax.Array) -> jax.Array:
  """float32 ``[B]``: variance of each sequence's targets, the zeroed query slot replaced by
  ``target``. ``inputs [B, T, n + 1]`` (``y`` in the last channel), ``target [B]``."""
  targets = jnp.concatenate(
    [inputs[:, :-1, -1].astype(jnp.float32), target.astype(jnp.float32)[:, None]], axis=1
  )
  return jnp.mean(jnp.square(targets - jnp.mean(targets, axis=1, keepdims=True)), axis=1)


def logic_loss_and_metrics(
  outputs: jax.Array, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
  """Squared error of the last position's prediction and R² as a (sum, count) pair.

  Args:
    outputs: float ``[B, T, 1]``, the model's per-position outputs.
    batch: ``inputs`` float32 ``[B, T, n + 1]``, ``target`` float32 ``[B]``, ``task_variance``
      float32 ``[B]`` and, for eval batches, ``valid`` bool ``[B]``.

  Returns:
    (mean squared error over real examples, ``{name: (sum, count)}``; see the module docstring).
  """
  predictions = outputs[:, -1, 0].astype(jnp.float32)
  targets = batch["target"].astype(jnp.float32)
  variance = batch["task_variance"].astype(jnp.float32)
  weights = common.example_weights(batch, targets.shape[0])
  squared_error = jnp.square(predictions - targets)
  count = weights.sum()
  sse = common.weighted_sum(squared_error, weights)
  sequence_variance = sequence_target_variance(batch["inputs"], targets)
  sequence_r2 = jnp.where(
    sequence_variance > 0,
    1.0 - squared_error / jnp.where(sequence_variance > 0, sequence_variance, 1.0),
    0.0,
  )
  return sse / jnp.maximum(count, 1.0), {
    "loss": (sse, count),
    "mse": (sse, count),
    "r2": (
      common.weighted_sum(variance - squared_error, weights),
      common.weighted_sum(variance, weights),
    ),
    "r2_per_sequence": (common.weighted_sum(sequence_r2, weights), count),
  }


def add_task_variance(batch: dict[str, np.ndarray], variances: np.ndarray) -> dict[str, np.ndarray]:
  """``batch`` with ``task_variance`` float32 looked up by ``task_id`` (any leading shape)."""
  return dict(batch, task_variance=variances[batch["task_id"]].astype(np.float32))


class LogicTaskSource:
  """Records of a split with ``task_variance`` added, optionally generated up front.

  With ``materialize`` the first ``size`` sequences of the stream are generated in batches of
  ``chunk_size`` and kept in memory (``4·(seq_len·(n+1) + 3)`` bytes each); reading a record is
  then a slice instead of a jitted call. Records equal ``LogicSource``'s either way (plus
  ``task_variance``), restricted to ``fields`` (None: all).
  """

  def __init__(
    self,
    config: logic.LogicConfig,
    split: str,
    seed: int,
    size: int,
    *,
    materialize: bool = False,
    chunk_size: int = 8192,
    fields: tuple[str, ...] | None = None,
  ):
    self._stream = logic.LogicSource(config, split, seed, size)  # validates the arguments
    self.config, self.split, self.seed, self.size = config, split, seed, int(size)
    self.fields = None if fields is None else tuple(fields)
    self.materialize = materialize
    self._variances = np.asarray(logic.task_moments(config)[1], np.float64)
    self._stored = None
    if materialize:
      chunks = [
        logic.generate_batch(
          config, seed, np.arange(start, min(start + chunk_size, self.size)), split
        )
        for start in range(0, self.size, chunk_size)
      ]
      self._stored = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}

  def __len__(self) -> int:
    return self.size

  def _select(self, record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    record = add_task_variance(record, self._variances)
    return record if self.fields is None else {name: record[name] for name in self.fields}

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.__getitems__([index])[0]

  def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
    indices = [int(i) for i in indices]
    if any(not 0 <= i < self.size for i in indices):
      raise IndexError(f"indices {indices} out of range for a source of size {self.size}.")
    if self._stored is not None:
      return [
        self._select({name: np.array(value[i]) for name, value in self._stored.items()})
        for i in indices
      ]
    return [self._select(record) for record in self._stream.__getitems__(indices)]

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Records ``indices`` stacked, ``{field: [len(indices), ...]}``, in one gather (or one
    generator call); what ``pipeline.make_loader(batch_reads=True)`` reads."""
    indices = np.asarray(indices, np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= self.size):
      raise IndexError(f"indices out of range for a source of size {self.size}.")
    if self._stored is not None:
      batch = {name: value[indices] for name, value in self._stored.items()}
    else:
      batch = logic.generate_batch(self.config, self.seed, indices, self.split)
      batch = {name: np.asarray(value) for name, value in batch.items()}
    return self._select(batch)

  def __repr__(self) -> str:
    # Stable across processes and restarts: grain checks it when restoring an iterator.
    return (
      f"LogicTaskSource(split={self.split!r}, seed={self.seed}, size={self.size}, "
      f"materialize={self.materialize}, fields={self.fields}, config={self.config})"
    )


def task_family(config: ml_collections.ConfigDict) -> logic.LogicConfig:
  """The run's task family: ``config.data`` with its held-out split seed resolved
  (``common.run_family``)."""
  return common.run_family(logic.LogicConfig, config)


def train_size(config: ml_collections.ConfigDict) -> int:
  """``data.num_train``, or ``num_train_steps × batch_size`` (each sequence seen once) if ≤ 0."""
  return common.stream_train_size(config, "logic")


def build_data(config: ml_collections.ConfigDict):
  """Splits train / validation / test / ood and the metadata the model needs."""
  data = config.data
  tasks = task_family(config)
  seed = data.get("stream_seed", 0)
  train = functools.partial(
    LogicTaskSource,
    tasks,
    "train",
    seed,
    train_size(config),
    # Batches made on the device never read the host's train split: nothing to store up front.
    materialize=(
      bool(data.get("materialize_train")) and not config.get("train_data_on_device", False)
    ),
    chunk_size=data.get("chunk_size", 8192),
    fields=TRAIN_FIELDS,
  )
  splits = {"train": task_registry.LazySplit(train)}  # built only when training reads it
  for split in EVAL_SPLITS:
    size = data.get(f"num_{split}", 0)
    if size > 0:
      splits[split] = LogicTaskSource(tasks, split, seed, size)
  metadata = {"num_variables": tasks.num_variables, "seq_len": tasks.seq_len, "tasks": tasks}
  return splits, metadata


def device_train_stream(
  config: ml_collections.ConfigDict, metadata: dict
) -> task_registry.DeviceTrainStream:
  """The run's train stream made on the device (``TRAIN_FIELDS``, each record's task variance
  looked up from its task id; ``common.generated_train_stream``)."""
  tasks = metadata["tasks"]
  # Per task id, whatever the split seed: the same table serves every replica.
  variances = np.asarray(logic.task_moments(tasks)[1], np.float32)

  def with_variance(records):
    return dict(records, task_variance=jnp.asarray(variances)[records["task_id"]])

  return common.generated_train_stream(logic.STREAMS, tasks, config, TRAIN_FIELDS, with_variance)


def build_model(config: ml_collections.ConfigDict, metadata: dict) -> SequenceTransformer:
  del metadata
  return SequenceTransformer(
    num_outputs=1, **common.model_arguments(config.model, common.SEQUENCE_FIELDS)
  )


TASK = common.register_sequence_task(__name__, logic_loss_and_metrics, "r2")
