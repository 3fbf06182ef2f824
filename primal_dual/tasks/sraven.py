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

Training problems are generated on the fly (one jitted call per record), on the device inside the
training step (``config.train_data_on_device``), or, with ``data.materialize_train``, up front in
batches of ``data.chunk_size`` and stored compactly (tokens as int8), so that reading a record is a
slice. The stored problems are exactly those of the stream, so every mode trains on the same data.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from primal_dual.data import sraven
from primal_dual.tasks import _common as common
from primal_dual.models import SequenceTransformer
from primal_dual.training import task_registry

EVAL_SPLITS = ("validation", "test", "ood")
SELECTION_METRIC = "whole_panel_accuracy"
# Fields of a record the training loop needs; the others (rules, latent ids, slot orders) serve
# analysis and are kept only in the evaluation splits.
TRAIN_FIELDS = ("inputs", "targets")


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
  weights = common.example_weights(batch, targets.shape[0])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=-1)
  feature_correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [B, F]
  panel_correct = sraven.whole_panel_correct(logits, targets).astype(jnp.float32)
  count = weights.sum()
  loss_sum = common.weighted_sum(losses, weights)
  return loss_sum / jnp.maximum(count, 1.0), {
    "loss": (loss_sum, count),
    "whole_panel_accuracy": (common.weighted_sum(panel_correct, weights), count),
    "feature_accuracy": (common.weighted_sum(feature_correct.mean(axis=-1), weights), count),
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
  """The problem family named by ``config.data`` as it stands (split seed unresolved)."""
  return common.config_dataclass(sraven.SRavenConfig, data)


def problem_family(config: ml_collections.ConfigDict) -> sraven.SRavenConfig:
  """The run's problem family: ``config.data`` with its held-out split seed resolved
  (``common.run_family``)."""
  return common.run_family(sraven.SRavenConfig, config)


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
  problems = problem_family(config)
  seed = data.get("stream_seed", 0)
  # Batches made on the device never read the host's train split: nothing to store up front.
  materialize = bool(data.get("materialize_train", True)) and not config.get(
    "train_data_on_device", False
  )
  train = functools.partial(TRAIN_SOURCES[materialize], problems, seed, train_size(config), data)
  splits = {"train": task_registry.LazySplit(train)}  # built only when training reads it
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
) -> task_registry.DeviceTrainStream:
  """The run's train stream made on the device (``TRAIN_FIELDS``; ``common.generated_train_stream``)."""
  return common.generated_train_stream(sraven.STREAMS, metadata["problems"], config, TRAIN_FIELDS)


def build_model(config: ml_collections.ConfigDict, metadata: dict) -> SequenceTransformer:
  return SequenceTransformer(
    num_outputs=metadata["num_values"],
    **common.model_arguments(config.model, common.SEQUENCE_FIELDS),
  )


TASK = common.register_sequence_task(__name__, sraven_loss_and_metrics, SELECTION_METRIC)
