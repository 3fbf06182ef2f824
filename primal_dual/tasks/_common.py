"""What the task modules share: the losses and example weights, model keyword arguments read from
``config.model``, the registration of classification and generated-sequence tasks, and the size of
generated train streams."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Mapping, TypeVar

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from primal_dual.data import generated
from primal_dual.training import sweep, task_registry

DataclassT = TypeVar("DataclassT")
Batch = Mapping[str, jax.Array]
Metrics = dict[str, tuple[jax.Array, jax.Array]]

# ------------------------------------------------------------------------------------------------
# Losses and example weights.


def example_weights(batch: Batch, batch_size: int) -> jax.Array:
  """float32 ``[batch]``: 1 for real examples, 0 for the padding rows of an eval batch (``valid``
  False); training batches carry no ``valid`` and weigh 1 throughout."""
  valid = batch.get("valid")
  if valid is None:
    return jnp.ones((batch_size,), jnp.float32)
  return valid.astype(jnp.float32)


def weighted_sum(values: jax.Array, weights: jax.Array) -> jax.Array:
  """``Σ_b w_b · values_b`` over ``[batch]``, padding rows (w = 0) dropped even where their values
  are NaN (``where``, not a product: NaN · 0 is NaN)."""
  return jnp.where(weights > 0, values * weights, 0.0).sum()


def classification_loss_and_metrics(logits: jax.Array, batch: Batch) -> tuple[jax.Array, Metrics]:
  """Softmax cross-entropy and accuracy for ``logits`` [batch, classes] and ``batch['label']``
  int [batch].

  Returns:
    (mean loss over real examples, ``{'loss': (sum, count), 'accuracy': (sum, count)}``).
  """
  logits = logits.astype(jnp.float32)
  labels = batch["label"]
  weights = example_weights(batch, labels.shape[0])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  count = weights.sum()
  loss_sum = weighted_sum(losses, weights)
  return loss_sum / jnp.maximum(count, 1.0), {
    "loss": (loss_sum, count),
    "accuracy": (weighted_sum(correct, weights), count),
  }


# ------------------------------------------------------------------------------------------------
# Model arguments from a config.

# The EncoderClassifier fields a config's model sets (UEA, ListOps).
ENCODER_FIELDS = (
  "num_layers",
  "model_dim",
  "num_heads",
  "mlp_dim",
  "positional",
  "pre_norm",
  "norm",
  "pooling",
  "dropout_rate",
  "attention_dropout_rate",
)
# The SequenceTransformer fields a config's model sets (sRAVEN, fuzzy logic).
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


def plain(value: Any) -> Any:
  """ConfigDicts → dicts and lists → tuples, so options are hashable and JSON-like."""
  if isinstance(value, (ml_collections.ConfigDict, Mapping)):
    return {k: plain(v) for k, v in dict(value).items()}
  if isinstance(value, (list, tuple)):
    return tuple(plain(v) for v in value)
  return value


def config_dataclass(
  cls: type[DataclassT], values: ml_collections.ConfigDict, **replacements: Any
) -> DataclassT:
  """The dataclass ``cls`` from the entries of ``values`` named as its fields, as ``plain`` values
  (lists made tuples, so the result stays hashable), with ``replacements`` in place of some."""
  fields = {field.name: plain(values[field.name]) for field in dataclasses.fields(cls)}
  return cls(**{**fields, **replacements})


def replica_seeds(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """The distinct seeds of the replicas a config trains in one program, whether a value list
  (``config.sweep.seed``) or the listed points (``config.sweep.points``) set them; empty for a
  single run."""
  replicas = sweep.replicas_of(config)
  if len(replicas) == 1 and not replicas[0].values:
    return ()
  return tuple(dict.fromkeys(replica.config.seed for replica in replicas))


def run_family(cls: type[DataclassT], config: ml_collections.ConfigDict) -> DataclassT:
  """A generated task's problem family: ``config.data`` as the dataclass ``cls``, its held-out
  split seed resolved for this run (``generated.run_split_seed``: ``SPLIT_SEED_OF_RUN`` is the
  run's seed; refused for a sweep's config of several seeds, whose replicas' data come from
  their own configs)."""
  split_seed = generated.run_split_seed(config.data.split_seed, config.seed, replica_seeds(config))
  return config_dataclass(cls, config.data, split_seed=split_seed)


def generated_train_stream(
  streams: generated.GeneratedTask,
  family: Any,
  config: ml_collections.ConfigDict,
  fields: tuple[str, ...],
  finish: Callable[[dict], dict] = lambda records: records,
) -> task_registry.DeviceTrainStream:
  """The device train stream of a generated task's run: records of the ``train`` split of
  ``family`` (the run's problem family), ``finish``-ed (fields added from the records) and cut to
  ``fields``. The run's stream seed (``generated.replica_stream_seed`` of ``data.stream_seed``
  and ``config.seed``) and the split's ids are its arguments, so replicas of other seeds and
  held-out splits run the same function."""
  seed = generated.replica_stream_seed(config.data.get("stream_seed", 0), config.seed)
  arguments = streams.stream_arguments(family, "train", np.asarray(seed))
  stream = streams.pooled_stream(family, "train")

  def batch(indices, arguments):
    records = finish(stream(arguments, indices))
    return {name: records[name] for name in fields}

  return task_registry.DeviceTrainStream(batch, arguments)


def attention_kwargs(model_config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``attention`` name and ``attention_options`` dict of a model config."""
  return {
    "attention": model_config.attention,
    "attention_options": plain(model_config.get("attention_options", {}) or {}),
  }


def model_kwargs(model_config: ml_collections.ConfigDict, names: tuple[str, ...]) -> dict[str, Any]:
  """The fields ``names`` of ``model_config`` that are set, as plain Python values."""
  return {name: plain(model_config[name]) for name in names if name in model_config}


# The dtype fields of every model (``config.model.dtype`` / ``param_dtype``, names such as
# ``'bfloat16'``; ``config_lib.MODEL_DTYPES``).
DTYPE_FIELDS = ("dtype", "param_dtype")


def dtype_kwargs(model_config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The dtype fields of ``model_config`` that are set, as ``jnp.dtype``s (a config of an earlier
  version has none: the model's float32 defaults)."""
  return {name: jnp.dtype(model_config[name]) for name in DTYPE_FIELDS if name in model_config}


def model_arguments(
  model_config: ml_collections.ConfigDict, names: tuple[str, ...]
) -> dict[str, Any]:
  """``model_kwargs``, ``attention_kwargs`` and ``dtype_kwargs`` together: what a model class
  takes from a config."""
  return {
    **model_kwargs(model_config, names),
    **attention_kwargs(model_config),
    **dtype_kwargs(model_config),
  }


def stream_train_size(config: ml_collections.ConfigDict, task: str) -> int:
  """``data.num_train``, or ``num_train_steps × batch_size`` (no record seen twice) if ≤ 0."""
  if config.data.get("num_train", 0) > 0:
    return int(config.data.num_train)
  if config.num_train_steps <= 0:
    raise ValueError(
      f"set data.num_train > 0 or num_train_steps > 0 to size the {task} train stream"
    )
  return int(config.num_train_steps * config.batch_size)


# ------------------------------------------------------------------------------------------------
# Registration.


def register_classification_task(
  name: str,
  build_data: Callable[[ml_collections.ConfigDict], tuple[dict, dict]],
  build_model: Callable[[ml_collections.ConfigDict, Any], Any],
) -> task_registry.Task:
  """Registers a task of labelled examples scored by cross-entropy and accuracy."""
  return task_registry.register_task(
    task_registry.Task(
      name=name,
      build_data=build_data,
      build_model=build_model,
      loss_and_metrics=classification_loss_and_metrics,
      eval_splits=("validation", "test"),
    )
  )


def register_sequence_task(
  module_name: str, loss_and_metrics: Callable[..., Any], selection_metric: str
) -> task_registry.Task:
  """Registers the generated sequence task of module ``module_name`` (sraven.py or logic.py,
  named by its ``__name__``) from its ``build_data``, ``build_model``, ``EVAL_SPLITS`` and
  ``device_train_stream``; the checkpoint kept is the one of the largest ``selection_metric``."""
  module = sys.modules[module_name]
  return task_registry.register_task(
    task_registry.Task(
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
