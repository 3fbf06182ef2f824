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
* optionally `device_train_stream(config, metadata) -> DeviceTrainStream`, for generated tasks
  (used with `config.train_data_on_device`): `batch(indices uint32 [batch], arguments) -> batch`
  makes records `indices` of the run's train stream inside a jitted step, traceable in both;
  `arguments` (a pytree of NumPy arrays) is what the run of `config` passes it: its seed, its
  held-out split. Replicas of one program use the first replica's `batch` with each its own
  `arguments` (stacked `[R, ...]`), so `batch` may depend on `config` only through what every
  replica of a sweep shares (`sweep.SWEEPABLE` fields never shape it).

Registering a task::

  register_task(Task(name='uea', build_data=..., build_model=..., loss_and_metrics=
      classification_loss_and_metrics, eval_splits=('validation', 'test')))

A task named `<name>` lives in the module `primal_dual.tasks.<name>`, whose import registers it:
`get_task` imports that module by name the first time the name is asked for, so the trainer imports
only the data dependencies of the task it runs, names no task itself, and never imports the task
package statically (the tasks sit above the trainer in the package's layer order).
"""

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn
import jax
import ml_collections

from primal_dual.training import errors

Batch = Mapping[str, jax.Array]
Metrics = dict[str, tuple[jax.Array, jax.Array]]


class DeviceTrainStream(NamedTuple):
  """A run's train stream made on the device: `batch(indices, arguments) -> batch` (traceable)
  and this run's `arguments` (a pytree of NumPy arrays; see the module docstring)."""

  batch: Callable[[jax.Array, Any], Batch]
  arguments: Any


@dataclasses.dataclass(frozen=True)
class Task:
  """One trainable task; see the module docstring for the contract of each field."""

  name: str
  build_data: Callable[[ml_collections.ConfigDict], tuple[dict[str, Any], dict[str, Any]]]
  build_model: Callable[[ml_collections.ConfigDict, dict[str, Any]], nn.Module]
  loss_and_metrics: Callable[[jax.Array, Batch], tuple[jax.Array, Metrics]]
  eval_splits: tuple[str, ...] = ("validation", "test")
  selection_metric: str = "accuracy"
  selection_mode: str = "max"
  device_train_stream: (
    Callable[[ml_collections.ConfigDict, dict[str, Any]], DeviceTrainStream] | None
  ) = None


@dataclasses.dataclass(frozen=True)
class LazySplit:
  """A split built the first time the trainer reads it: `build() -> source`."""

  build: Callable[[], Any]


TASKS: dict[str, Task] = {}


def register_task(task: Task, *, overwrite: bool = False) -> Task:
  """Adds `task` to `TASKS` under `task.name`; returns it (usable at module level)."""
  if task.name in TASKS and not overwrite:
    raise ValueError(f"task {task.name!r} is already registered")
  TASKS[task.name] = task
  return task


TASK_PACKAGE = "primal_dual.tasks"


def task_names() -> list[str]:
  """The task modules of ``TASK_PACKAGE``, sorted (found on disk; only the package's docstring-only
  ``__init__`` is imported, by name). Modules whose name starts with ``_`` are what the tasks
  share, not tasks."""
  package = importlib.import_module(TASK_PACKAGE)
  return sorted(
    module.name
    for module in pkgutil.iter_modules(package.__path__)
    if not module.name.startswith("_")
  )


def get_task(name: str) -> Task:
  """The registered task `name`, importing its module `primal_dual.tasks.<name>` if needed.

  Raises:
    errors.UnknownNameError: no such task (the message lists the task modules found).
  """
  modules = task_names()
  if name not in TASKS and name in modules:
    importlib.import_module(f"{TASK_PACKAGE}.{name}")
  if name not in TASKS:
    known = ", ".join(sorted(set(TASKS) | set(modules)))
    raise errors.UnknownNameError(f"unknown task (config.task) {name!r}; known: {known}")
  return TASKS[name]
