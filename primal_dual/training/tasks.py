"""Task registry: what the trainer needs to know about a data set and its model.

A `Task` bundles four things:

* `build_data(config) -> (splits, metadata)`: `splits` maps split names ('train', 'validation',
  'test', ...) to random-access sources (`__len__`, `__getitem__` → dict of NumPy arrays, see
  docs/ARCHITECTURE.md "Data contract"), or to a `LazySplit` that builds one when first read (so
  evaluating a workdir never builds a large training split); `metadata` is a dict of facts the model needs
  (`num_classes`, `seq_len`, `num_features`, ...).
* `build_model(config, metadata) -> nn.Module`, a Linen module called as
  `model.apply(variables, batch['inputs'], mask=batch.get('mask'), train=bool, ...)`, with or
  without a `batch_stats` collection.
* `loss_and_metrics(outputs, batch) -> (loss, metrics)`: `loss` is the scalar float32 mean the
  gradient uses; `metrics` maps names to `(sum, count)` pairs of float32 scalars summed over the
  batch, so the trainer can add them up over batches and divide once. Eval batches carry a bool
  `valid` [batch] marking padding rows, which must get weight 0 (training batches have no
  padding and no `valid`).
* `eval_splits`: the splits evaluated periodically and at the end (those absent from `splits`
  are skipped), and the default model-selection metric (`selection_metric`, `selection_mode`).
* optionally `device_train_stream(config, metadata) -> batch_fn`, for generated tasks:
  `batch_fn(indices uint32 [batch], seed int32 []) -> batch` makes records `indices` of run
  `seed`'s train stream inside a jitted step (traceable in both; used with
  `config.train_data_on_device`).

Registering a task::

  register_task(Task(name='uea', build_data=..., build_model=..., loss_and_metrics=
      classification_loss_and_metrics, eval_splits=('validation', 'test')))

A task named `<name>` lives in the module `primal_dual.experiments.<name>`, whose import registers
it: `get_task` imports that module the first time the name is asked for, so the trainer imports
only the data dependencies of the task it runs, and names no task itself.
"""

import dataclasses
import importlib
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from primal_dual.training import errors

Batch = Mapping[str, jax.Array]
Metrics = dict[str, tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Task:
  """One trainable task; see the module docstring for the contract of each field."""

  name: str
  build_data: Callable[[ml_collections.ConfigDict], tuple[dict[str, Any], dict[str, Any]]]
  build_model: Callable[[ml_collections.ConfigDict, dict[str, Any]], nn.Module]
  loss_and_metrics: Callable[[jax.Array, Batch], tuple[jax.Array, Metrics]]
  eval_splits: tuple[str, ...] = ('validation', 'test')
  selection_metric: str = 'accuracy'
  selection_mode: str = 'max'
  device_train_stream: (
    Callable[[ml_collections.ConfigDict, dict[str, Any]], Callable[[jax.Array, jax.Array], Batch]]
    | None
  ) = None


@dataclasses.dataclass(frozen=True)
class LazySplit:
  """A split built the first time the trainer reads it: `build() -> source`."""

  build: Callable[[], Any]


TASKS: dict[str, Task] = {}


def register_task(task: Task, *, overwrite: bool = False) -> Task:
  """Adds `task` to `TASKS` under `task.name`; returns it (usable at module level)."""
  if task.name in TASKS and not overwrite:
    raise ValueError(f'task {task.name!r} is already registered')
  TASKS[task.name] = task
  return task


def get_task(name: str) -> Task:
  """The registered task `name`, importing its module `primal_dual.experiments.<name>` if needed.

  Raises:
    errors.UnknownNameError: no such task (the message lists the task modules found).
  """
  from primal_dual import experiments  # pylint: disable=g-import-not-at-top

  modules = experiments.task_names()
  if name not in TASKS and name in modules:
    importlib.import_module(f'{experiments.__name__}.{name}')
  if name not in TASKS:
    known = ', '.join(sorted(set(TASKS) | set(modules)))
    raise errors.UnknownNameError(f'unknown task (config.task) {name!r}; known: {known}')
  return TASKS[name]


def _example_weights(batch: Batch, batch_size: int) -> jax.Array:
  """float32 [batch]: 1 for real examples, 0 for padding (`valid` False)."""
  valid = batch.get('valid')
  if valid is None:
    return jnp.ones((batch_size,), jnp.float32)
  return valid.astype(jnp.float32)


def classification_loss_and_metrics(logits: jax.Array, batch: Batch) -> tuple[jax.Array, Metrics]:
  """Softmax cross-entropy and accuracy for `logits` [batch, classes] and `batch['label']` [batch].

  Returns:
    (mean loss over real examples, {'loss': (sum, count), 'accuracy': (sum, count)}).
  """
  logits = logits.astype(jnp.float32)
  labels = batch['label']
  weights = _example_weights(batch, labels.shape[0])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  count = weights.sum()
  # `where`, not a product: a padding row's logits may be NaN, and NaN · 0 is NaN.
  loss_sum = jnp.where(weights > 0, losses * weights, 0.0).sum()
  return loss_sum / jnp.maximum(count, 1.0), {
    'loss': (loss_sum, count),
    'accuracy': (jnp.where(weights > 0, correct * weights, 0.0).sum(), count),
  }


# ------------------------------------------------------------------------------------------------
# The 'synthetic' task: a learnable toy problem for tests and smoke runs.
#
# Each example is a variable-length sequence `inputs` float32 [seq_len, num_features] of standard
# normal values (zero past its length), `mask` bool [seq_len], and `label` = the argmax over the
# first `num_classes` channels of the mean over valid positions. A masked mean-pool plus linear
# read-out solves it exactly, so loss falls within a few dozen steps.

SYNTHETIC_SPLITS = {'train': 0, 'validation': 1, 'test': 2}


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class SyntheticSource:
  """Random-access source of synthetic sequences, deterministic in (seed, split, index).

  Attributes:
    size: number of records.
    seed: data seed.
    split_id: distinct per split so that splits never share examples' random streams.
    seq_len, num_features, num_classes: shapes (num_classes ≤ num_features).
  """

  size: int
  _: dataclasses.KW_ONLY
  seed: int
  split_id: int
  seq_len: int
  num_features: int
  num_classes: int

  def __post_init__(self):
    if self.num_classes > self.num_features:
      raise errors.ConfigError(
        f'synthetic task: num_classes ({self.num_classes}) must be ≤ num_features '
        f'({self.num_features})'
      )

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self.size:
      raise IndexError(index)
    rng = np.random.default_rng([self.seed, self.split_id, index])
    length = int(rng.integers(max(1, self.seq_len // 2), self.seq_len + 1))
    mask = np.arange(self.seq_len) < length
    inputs = rng.standard_normal((self.seq_len, self.num_features)).astype(np.float32)
    inputs *= mask[:, None]
    label = np.argmax(inputs[:length, : self.num_classes].mean(axis=0))
    return {'inputs': inputs, 'mask': mask, 'label': np.int32(label)}

  def __repr__(self) -> str:
    # Stable and short: grain compares it when restoring an iterator.
    return f'SyntheticSource(size={self.size}, split_id={self.split_id}, seed={self.seed})'


def _synthetic_data_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
  data = config.get('data') or {}
  defaults = dict(num_train=256, num_eval=64, seq_len=8, num_features=4, num_classes=4, seed=0)
  return {key: data.get(key, value) for key, value in defaults.items()}


def build_synthetic_data(config: ml_collections.ConfigDict):
  """Splits train / validation / test of `SyntheticSource` from `config.data` (all optional)."""
  options = _synthetic_data_config(config)
  shapes = {k: options[k] for k in ('seq_len', 'num_features', 'num_classes')}
  sizes = {
    'train': options['num_train'],
    'validation': options['num_eval'],
    'test': options['num_eval'],
  }
  splits = {
    name: SyntheticSource(sizes[name], seed=options['seed'], split_id=split_id, **shapes)
    for name, split_id in SYNTHETIC_SPLITS.items()
  }
  return splits, dict(shapes)


class SyntheticClassifier(nn.Module):
  """Per-position MLP, masked mean-pool, dropout, linear read-out.

  Kernels carry logical axis names (`embed`, `mlp`, `classes`) so the `model` mesh axis splits
  the hidden layer, exercising tensor-parallel placement in tests.

  Attributes:
    hidden: hidden width (divisible by the `model` mesh size).
    num_classes: number of logits.
    dropout_rate: dropout on the pooled features.
    use_batch_norm: add a BatchNorm (over valid positions) so the model has `batch_stats`.
  """

  hidden: int = 16
  num_classes: int = 4
  dropout_rate: float = 0.0
  use_batch_norm: bool = False

  @nn.compact
  def __call__(
    self, inputs: jax.Array, mask: jax.Array | None = None, train: bool = False
  ) -> jax.Array:
    """inputs float32 [batch, seq, features], mask bool [batch, seq] → logits [batch, classes]."""
    if mask is None:
      mask = jnp.ones(inputs.shape[:2], bool)
    partitioned = nn.with_logical_partitioning
    x = nn.Dense(
      self.hidden,
      kernel_init=partitioned(nn.initializers.lecun_normal(), ('embed', 'mlp')),
      bias_init=partitioned(nn.initializers.zeros_init(), ('mlp',)),
    )(inputs)
    x = nn.gelu(x)
    if self.use_batch_norm:
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x, mask=mask[..., None])
    weights = mask.astype(x.dtype)[..., None]
    pooled = (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1.0)
    pooled = nn.Dropout(self.dropout_rate)(pooled, deterministic=not train)
    return nn.Dense(
      self.num_classes,
      kernel_init=partitioned(nn.initializers.lecun_normal(), ('mlp', 'classes')),
      bias_init=partitioned(nn.initializers.zeros_init(), ('classes',)),
    )(pooled)


def build_synthetic_model(config: ml_collections.ConfigDict, metadata: dict) -> nn.Module:
  model = config.get('model') or {}
  return SyntheticClassifier(
    hidden=model.get('hidden', 16),
    num_classes=metadata['num_classes'],
    dropout_rate=model.get('dropout_rate', 0.0),
    use_batch_norm=model.get('use_batch_norm', False),
  )


register_task(
  Task(
    name='synthetic',
    build_data=build_synthetic_data,
    build_model=build_synthetic_model,
    loss_and_metrics=classification_loss_and_metrics,
    eval_splits=('validation', 'test'),
  )
)
