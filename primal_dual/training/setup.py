"""Everything built once from a config before a step runs: `resolve_config`, and
`build_program` (data, model, mesh, optimizer, shardings, jitted steps) with its `Program`, what
every replica shares.

Splits are built lazily (`LazySplits`): a program built for evaluation
(`build_program(config, for_training=False)`) never builds the training split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from primal_dual.data import generated
from primal_dual.data import pipeline
from primal_dual.training import checkpointing
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import optim
from primal_dual.training import sharding
from primal_dual.training import sweep
from primal_dual.training import task_registry
from primal_dual.training.steps import TrainState, eval_step, train_step, train_steps


def stack_records(records: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """Records (dicts of arrays) stacked along a new leading axis, key by key."""
  return {key: np.stack([np.asarray(r[key]) for r in records]) for key in records[0]}


def resolve_config(config: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
  """The effective config: `training_defaults()` overridden by `config`, frozen.

  Raises:
    errors.ConfigError: bad model sizes or dropout rates (`config_lib.validate`), or a field of
      earlier versions that is set (`config_lib.RETIRED_FIELDS`, e.g. `config.seeds`).
  """
  if isinstance(config, ml_collections.FrozenConfigDict):
    config = config.as_configdict()
  config = config_lib.without_retired_fields(config)
  config_lib.validate(config)
  config = config_lib.with_variant_options(config)
  return config_lib.freeze(config_lib.merge(config_lib.training_defaults(), config))


def _every_steps(config, name: str, steps_per_epoch: int) -> int:
  epochs = config.get(f"{name}_every_epochs", 0) or 0
  if epochs > 0:
    return max(1, round(epochs * steps_per_epoch))
  return config.get(f"{name}_every_steps", 0) or 0


def _as_tuple(value) -> tuple[str, ...]:
  if isinstance(value, str):
    return tuple(s.strip() for s in value.split(",") if s.strip())
  return tuple(value or ())


def _state_key(seed: int) -> jax.Array:
  """uint32 [2]: the train state's base key for ``seed``, as raw key data (``jax.random.key``'s),
  which checkpoints store as any array."""
  return jax.random.key_data(jax.random.key(seed))


class RunLength(NamedTuple):
  """How long the replicas train and when they act: `total_steps`, `steps_per_epoch`, and
  `periods`, each periodic action's period in steps (0: the final step only)."""

  total_steps: int
  steps_per_epoch: int
  periods: dict[str, int]


@dataclasses.dataclass
class Program:
  """What every replica shares on the device, built once from a config (`build_program`).

  The trained state holds every replica (`replicas`: a sweep's, or the single run as one) in the
  layout of `replica_axis` (`[R, ...]`, kept whole on every device: `run_shardings`); data, model,
  mesh and the compiled steps are shared. What each replica owns on the host (its workdir, files,
  tracker) is `runs.Runs`'.

  Attributes:
    init: the initial state of every replica, stacked (`TrainState` in `replica_axis`'s layout).
    run_steps: the next K steps of every replica (`StepRunner`).
    eval_step: `(state, batch) -> per-replica (sum, count) metrics` of one padded batch.
    state_shardings, abstract_state: of one replica's state (as checkpointed).
  """

  config: ml_collections.FrozenConfigDict
  task: task_registry.Task
  data: "ReplicaData"  # each replica's splits and metadata
  model: nn.Module
  mesh: jax.sharding.Mesh
  replicas: tuple[sweep.Replica, ...]  # trained in one program; one for a single run
  replica_axis: "ReplicaAxis"
  optimizer: optim.ReplicaOptimizer  # every replica's optimizer numbers and schedule
  length: RunLength
  eval_splits: tuple[str, ...]
  abstract_state: TrainState
  state_shardings: TrainState
  init: Callable[[], TrainState]
  run_steps: "StepRunner"
  eval_step: Callable

  @property
  def total_steps(self) -> int:
    return self.length.total_steps

  @property
  def splits(self) -> LazySplits:
    """The first replica's splits (every replica's, unless their held-out splits differ:
    `ReplicaData`)."""
    return self.data.splits[0]

  @property
  def metadata(self) -> dict[str, Any]:
    """The first replica's data metadata (what the model is built from; shared)."""
    return self.data.metadata[0]

  @property
  def eval_batch_size(self) -> int:
    return self.config.eval_batch_size or self.config.batch_size

  @property
  def run_shardings(self) -> TrainState:
    """Shardings of the stacked state."""
    return self.replica_axis.shardings(self.state_shardings, self.mesh)

  def stack_replicas(self, states: list[TrainState]) -> TrainState:
    """One state per replica (as restored) → the trained state, placed for training."""
    return jax.device_put(self.replica_axis.stack(states), self.run_shardings)

  def replica_state(self, state: TrainState, index: int) -> TrainState:
    """Replica `index` of the trained state: the state of that run alone (as checkpointed)."""
    return self.replica_axis.index(state, index)

  def make_train_iterator(self):
    """A checkpointable grain iterator of this process's training batches (endless), or None
    when the batches are made on the device (`config.train_data_on_device`)."""
    if self.run_steps.device_data:
      return None
    loader = self.config.loader
    return pipeline.make_loader(
      self.splits["train"],
      batch_size=self.config.batch_size // jax.process_count(),
      seed=self.config.seed,
      shuffle=True,
      num_epochs=None,
      drop_remainder=True,
      shard_by_process=True,
      worker_count=loader.worker_count,
      read_options=grain.ReadOptions(
        num_threads=loader.num_threads, prefetch_buffer_size=loader.prefetch_buffer_size
      ),
      batch_reads=loader.get("batch_reads", False),
    )

  def eval_batches(self, split: str, group: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """This process's padded batches covering split `split` once (with `valid`), as `eval_step`
    takes them: `[B, ...]`, or `[G, B, ...]` (every data group's batch) when the replicas' data
    differ (`ReplicaData`); `[B, ...]` of one group's split if `group` is given."""
    return self.data.eval_batches(split, self.eval_batch_size // jax.process_count(), group)

  def place_eval_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """A host batch of `eval_batches` on the mesh, its batch axis split over `data`."""
    if self.data.num_groups == 1:
      return sharding.shard_batch(batch, self.mesh)
    return sharding.shard_stacked_batch(batch, self.mesh)

  def restore_target(self) -> TrainState:
    """One replica's state as a checkpoint restores it (abstract, with its shardings)."""
    return checkpointing.abstract_with_shardings(self.abstract_state, self.state_shardings)


@dataclasses.dataclass(frozen=True)
class ReplicaAxis:
  """The replica axis of everything that differs between replicas: states, data seeds, optimizer
  numbers, and the steps' losses and metrics.

  R > 1 replicas stack on a leading axis `[R, ...]` and the steps are vmapped over it. One
  replica (a single run) has no such axis: its arrays and its program are exactly those of a
  run without replicas (a size-1 axis, vmapped or squeezed inside the program, compiles to
  other kernels and extra copies: about 7% slower per step on a small CPU model). Only this
  class knows the difference; the trainer goes through it.
  """

  size: int

  @property
  def _stacked(self) -> bool:
    return self.size > 1

  def map(self, fn: Callable, in_axes: tuple) -> Callable:
    """`fn` over the replica axis of the arguments whose `in_axes` entry is 0 (None: shared) and
    of every output."""
    return jax.vmap(fn, in_axes=in_axes) if self._stacked else fn

  def stack(self, trees: list[Any]) -> Any:
    """One tree per replica → the trees in this layout (`[R, ...]` leaves for R > 1), by one
    program (as `index`)."""
    return _stack(trees) if self._stacked else trees[0]

  def from_host(self, tree: Any) -> Any:
    """A host tree of `[R, ...]` arrays in this layout."""
    return tree if self._stacked else jax.tree.map(lambda x: x[0], tree)

  def index(self, tree: Any, index: int) -> Any:
    """Replica `index` of a tree in this layout. By one program whatever the index, compiled once
    per tree structure and shapes (each leaf sliced eagerly compiles a program per leaf shape
    and index)."""
    return _replica(tree, np.int32(index)) if self._stacked else tree

  def shardings(self, shardings: Any, mesh) -> Any:
    """Shardings of one replica's tree → of the tree in this layout (the axis kept whole)."""
    return sharding.with_leading_axis(shardings, mesh) if self._stacked else shardings


@jax.jit
def _stack(trees: list[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@jax.jit
def _replica(tree: Any, index) -> Any:
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), tree)


def _replica_step(
  state, batch, hyperparameters, *, optimizer: optim.ReplicaOptimizer, model: nn.Module, **step
):
  """`train_step` of one replica with its `hyperparameters` (`[]` each: its optimizer's and its
  model's numbers): losses `[1]` (K = 1)."""
  tx = optimizer.transformation(hyperparameters)
  model = sweep.replica_model(model, hyperparameters)
  state, loss, metrics = train_step(state, batch, model=model, tx=tx, **step)
  return state, loss[None], metrics


def _replica_steps(
  state,
  batches,
  stream_arguments,
  hyperparameters,
  *,
  optimizer: optim.ReplicaOptimizer,
  model: nn.Module,
  **steps,
):
  """`train_steps` of one replica with its `hyperparameters` (`[]` each: its optimizer's and its
  model's numbers) and its `stream_arguments` (of its generated batches)."""
  tx = optimizer.transformation(hyperparameters)
  model = sweep.replica_model(model, hyperparameters)
  return train_steps(state, batches, stream_arguments, model=model, tx=tx, **steps)


class StepRunner:
  """Runs the next `n` training steps of every replica: `(state, losses [R, n], metrics)`, the
  metrics' (sum, count) pairs `[R]` each, summed over the steps (without the `R` axis for a
  single run: `ReplicaAxis`).

  With one step per call and host batches this is one step per call; otherwise one scanned
  program (`steps.train_steps`) per call, compiled once per distinct `n` (the steps per call, and
  a shorter final call when they do not divide the run). Either is mapped over the replicas
  (`ReplicaAxis.map`), which share the host batches.

  Args:
    single_step: `_replica_step` with everything but the state, batch and hyperparameters bound.
    scanned_steps: `_replica_steps` with everything but `num_steps` and the arrays bound.
    mesh: the device mesh.
    run_shardings: of the stacked state.
    replica_axis: the layout of the state and of every per-replica argument.
    hyperparameters: `[R]` arrays of the replicas' numbers (`ReplicaOptimizer.hyperparameters`
      and `sweep.model_numbers`), which go to every call.
    steps_per_call: K.
    stream_arguments: `[R, ...]` leaves: each replica's arguments of its generated train stream
      (`task_registry.DeviceTrainStream`; its seeds, unused, with host batches).
  """

  def __init__(
    self,
    single_step: Callable,
    scanned_steps: Callable,
    mesh,
    *,
    run_shardings: TrainState,
    replica_axis: ReplicaAxis,
    hyperparameters: Mapping[str, np.ndarray],
    steps_per_call: int,
    stream_arguments: Any,
  ):
    self._single_step, self._scanned_steps = single_step, scanned_steps
    self._compiled: dict[int, Callable] = {}
    self.mesh, self.steps_per_call = mesh, steps_per_call
    self._run_shardings, self._replica_axis = run_shardings, replica_axis
    # Placed once: host arrays would be transferred again by every call.
    replicated = sharding.replicated(mesh)
    self.stream_arguments = jax.device_put(replica_axis.from_host(stream_arguments), replicated)
    self.hyperparameters = jax.device_put(replica_axis.from_host(hyperparameters), replicated)
    self.device_data = scanned_steps.keywords.get("device_batch") is not None
    self._step_per_call = steps_per_call == 1 and not self.device_data

  def _compile(self, num_steps: int) -> Callable:
    replicated = sharding.replicated(self.mesh)
    if self._step_per_call:
      step = self._replica_axis.map(self._single_step, (0, None, 0))
      in_shardings = (self._run_shardings, sharding.batch_sharding(self.mesh), replicated)
    else:
      step = self._replica_axis.map(
        functools.partial(self._scanned_steps, num_steps=num_steps), (0, None, 0, 0)
      )
      batches = None if self.device_data else sharding.stacked_batch_sharding(self.mesh)
      in_shardings = (self._run_shardings, batches, replicated, replicated)
    program = jax.jit(
      step,
      in_shardings=in_shardings,
      out_shardings=(self._run_shardings, replicated, replicated),
      donate_argnums=(0,),
    )
    return _in_mesh(program, self.mesh)

  def __call__(self, state: TrainState, num_steps: int, train_iterator):
    if num_steps not in self._compiled:
      self._compiled[num_steps] = self._compile(num_steps)
    program = self._compiled[num_steps]
    if self._step_per_call:
      batch = sharding.shard_batch(next(train_iterator), self.mesh)
      return program(state, batch, self.hyperparameters)
    batches = None
    if not self.device_data:
      batches = sharding.shard_stacked_batch(
        stack_records([next(train_iterator) for _ in range(num_steps)]), self.mesh
      )
    return program(state, batches, self.stream_arguments, self.hyperparameters)


def _action_periods(config, steps_per_epoch: int) -> dict[str, int]:
  """Period in steps of each periodic action (0: the final step only), checked against
  `config.steps_per_call`: actions happen between calls, so K must divide every period."""
  periods = {
    name: _every_steps(config, name, steps_per_epoch) for name in ("log", "eval", "checkpoint")
  }
  steps_per_call = config.get("steps_per_call", 1)
  if steps_per_call < 1:
    raise errors.ConfigError(f"config.steps_per_call must be >= 1, got {steps_per_call}")
  bad = {name: period for name, period in periods.items() if period > 0 and period % steps_per_call}
  if bad:
    listed = ", ".join(f"{name} every {period}" for name, period in sorted(bad.items()))
    raise errors.ConfigError(
      f"config.steps_per_call={steps_per_call} must divide every logging, evaluation and "
      f"checkpoint period (actions happen between calls); got {listed} steps"
    )
  return periods


def _check_batch_size(name: str, size: int, data_axis: int) -> None:
  processes = jax.process_count()
  if size < 1 or size % data_axis or size % processes:
    raise errors.ConfigError(
      f"config.{name}={size} must be a positive multiple of the mesh data axis ({data_axis}) "
      f"and of the process count ({processes})"
    )


def _training_length(config, train_size: int) -> tuple[int, int]:
  """(total_steps, steps_per_epoch) from num_train_steps or num_epochs."""
  steps_per_epoch = train_size // config.batch_size
  if steps_per_epoch < 1:
    raise errors.ConfigError(
      f"the train split has {train_size} examples, fewer than config.batch_size="
      f"{config.batch_size}; lower the batch size"
    )
  if config.num_train_steps > 0:
    return int(config.num_train_steps), steps_per_epoch
  if config.num_epochs > 0:
    return int(math.ceil(config.num_epochs * steps_per_epoch)), steps_per_epoch
  raise errors.ConfigError("set config.num_train_steps > 0 or config.num_epochs > 0")


def _in_mesh(fn: Callable, mesh) -> Callable:
  """Runs `fn` (tracing included) with `mesh` and the logical axis rules in context."""

  @functools.wraps(fn)
  def wrapped(*args):
    with sharding.mesh_context(mesh):
      return fn(*args)

  return wrapped


class LazySplits(Mapping[str, Any]):
  """Split name → source, each built the first time it is read.

  A task's `build_data` may give a split as a source or as a `tasks.LazySplit` (a zero-argument
  builder); names, membership and iteration never build anything, so evaluating a workdir never
  generates the training split.
  """

  def __init__(self, splits: Mapping[str, Any]):
    self._given = dict(splits)
    self._built: dict[str, Any] = {}

  def __getitem__(self, name: str) -> Any:
    if name not in self._built:
      given = self._given[name]
      self._built[name] = given.build() if isinstance(given, task_registry.LazySplit) else given
    return self._built[name]

  def __contains__(self, name: object) -> bool:
    return name in self._given  # Mapping's default would read (and so build) the split

  def __iter__(self) -> Iterator[str]:
    return iter(self._given)

  def __len__(self) -> int:
    return len(self._given)

  def is_built(self, name: str) -> bool:
    return name in self._built


@dataclasses.dataclass(frozen=True)
class ReplicaData:
  """The data of a program's replicas: one `(splits, metadata)` per distinct data (a *group*), and
  each replica's group.

  Replicas share their data unless it depends on their seed: a held-out split drawn per seed
  (`data.split_seed = SPLIT_SEED_OF_RUN`, the HYLA paper's rule) gives one group per seed, each
  built from a replica's own config, exactly as that replica's run alone builds it. Evaluation
  batches then stack every group's batch, `[G, B, ...]`, and the evaluation step gives each
  replica its group's; generated training batches take each replica's own stream arguments
  (`task_registry.DeviceTrainStream`). Nothing is stored per group beyond its sources: generated
  evaluation splits are made batch by batch, so G groups hold G batches at a time.

  Attributes:
    splits, metadata: per group.
    group_of_replica: int32 `[R]`.
  """

  splits: tuple[LazySplits, ...]
  metadata: tuple[dict[str, Any], ...]
  group_of_replica: np.ndarray

  @property
  def num_groups(self) -> int:
    return len(self.splits)

  def replica_metadata(self, index: int) -> dict[str, Any]:
    return self.metadata[int(self.group_of_replica[index])]

  def eval_batches(
    self, split: str, batch_size: int, group: int | None = None
  ) -> Iterator[dict[str, np.ndarray]]:
    """Padded batches of `batch_size` covering `split` once: `[B, ...]` for one group (or of
    group `group`), else `[G, B, ...]` (the groups' splits have one size, so their batches pair
    up)."""
    groups = self.splits if group is None else (self.splits[group],)
    batches = [pipeline.iterate_eval(splits[split], batch_size) for splits in groups]
    if len(batches) == 1:
      return batches[0]
    return (stack_records(group_batches) for group_batches in zip(*batches, strict=True))


def _data_group_key(config) -> int | None:
  """What a replica's data depends on besides the config every replica shares (`config.data` is
  not sweepable): the split seed it resolves to (`generated.run_split_seed`: its own seed where
  the held-out split is drawn per seed); None for a task without one."""
  split_seed = (config.get("data") or {}).get("split_seed")
  return None if split_seed is None else generated.run_split_seed(split_seed, config.seed)


def _replica_data(
  task: task_registry.Task, config, replicas: tuple[sweep.Replica, ...]
) -> ReplicaData:
  """The data of every replica: `task.build_data` once per group (the config itself when every
  replica shares its data, as for a single run), see `ReplicaData`."""
  keys = [_data_group_key(replica.config) for replica in replicas]
  distinct = list(dict.fromkeys(keys))
  if len(distinct) == 1:
    built = [_build_data(task, config)]
  else:
    built = [_build_data(task, replicas[keys.index(key)].config) for key in distinct]
  return ReplicaData(
    splits=tuple(splits for splits, _ in built),
    metadata=tuple(metadata for _, metadata in built),
    group_of_replica=np.asarray([distinct.index(key) for key in keys], np.int32),
  )


def _build_data(task: task_registry.Task, config) -> tuple[LazySplits, dict[str, Any]]:
  """`task.build_data(config)`, with data problems (missing or malformed files, bad data
  options: FileNotFoundError / ValueError) turned into one-line user errors."""
  try:
    splits, metadata = task.build_data(config)
  except errors.UserError:
    raise
  except FileNotFoundError as e:
    raise errors.DataNotFoundError(f"task {task.name!r}: {e}") from e
  except ValueError as e:
    raise errors.ConfigError(f"task {task.name!r} data: {e}") from e
  if "train" not in splits:
    raise errors.ConfigError(f"task {task.name!r} returned no train split (got {sorted(splits)})")
  return LazySplits(splits), metadata


@dataclasses.dataclass(frozen=True)
class _Initializer:
  """Initial variables and TrainState of `model` from a key, traced on one example batch."""

  model: nn.Module
  tx: optax.GradientTransformation
  example: Mapping[str, np.ndarray]

  def variables(self, rng: jax.Array) -> dict[str, Any]:
    return self.model.init(
      {"params": rng, "dropout": rng},
      self.example["inputs"],
      mask=self.example.get("mask"),
      train=False,
    )

  def state(self, rng: jax.Array) -> TrainState:
    init_rng, state_rng = jax.random.split(rng)
    variables = nn.unbox(self.variables(init_rng))
    params = variables["params"]
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      batch_stats=variables.get("batch_stats", {}),
      opt_state=self.tx.init(params),
      rng=state_rng,
    )


def _abstract_state(initializer: _Initializer, root_rng, mesh) -> tuple[Any, TrainState]:
  """Shapes of the variables and of the TrainState, without computing them."""
  with sharding.mesh_context(mesh):
    try:
      abstract_variables = jax.eval_shape(initializer.variables, root_rng)
    except ValueError as e:
      # The first trace of the model is where invalid model options surface (a head count that
      # does not divide the width, SH ratios of the wrong length, an unknown variant name...).
      raise errors.ConfigError(f"model config (config.model): {e}") from e
    return abstract_variables, jax.eval_shape(initializer.state, root_rng)


def _state_shardings(abstract_variables, abstract_state: TrainState, mesh) -> TrainState:
  """Where each leaf of the TrainState lives: parameters by their logical axes, the optimizer
  state following its parameters, step and key replicated."""
  variable_shardings = sharding.variable_shardings(abstract_variables, mesh)
  param_shardings = variable_shardings["params"]
  sharding.check_divisible(abstract_state.params, param_shardings, mesh)
  replicated = sharding.replicated(mesh)
  return TrainState(
    step=replicated,
    params=param_shardings,
    batch_stats=variable_shardings.get("batch_stats", {}),
    opt_state=sharding.shardings_following(
      abstract_state.opt_state, abstract_state.params, param_shardings, mesh
    ),
    rng=replicated,
  )


def _device_stream(
  task: task_registry.Task, config, data: ReplicaData, replicas: tuple[sweep.Replica, ...]
) -> tuple[Callable | None, Any]:
  """`(batch function, stream arguments [R, ...])` of the task's on-device train stream when
  `config.train_data_on_device`, each replica's arguments from its own config and data; else
  `(None, [R] seeds)` (host batches, which the replicas share: they must share their seed, which
  orders the examples)."""
  seeds = np.asarray([replica.config.seed for replica in replicas], np.int32)
  if not config.get("train_data_on_device", False):
    if len(set(seeds.tolist())) > 1:
      raise errors.ConfigError(
        "replicas of different seeds (config.sweep.seed) train in one program on "
        "batches made on the device; set config.train_data_on_device=True (sRAVEN, logic)"
      )
    return None, seeds
  if task.device_train_stream is None:
    raise errors.ConfigError(
      f"task {task.name!r} has no on-device train stream; set config.train_data_on_device=False"
    )
  streams = [
    task.device_train_stream(replica.config, data.replica_metadata(index))
    for index, replica in enumerate(replicas)
  ]
  return streams[0].batch, jax.tree.map(
    lambda *values: np.stack(values), *[stream.arguments for stream in streams]
  )


def _eval_splits(config, task: task_registry.Task, splits: LazySplits) -> tuple[str, ...]:
  """The splits evaluated periodically: `config.eval_splits` or the task's, those that exist."""
  unknown = [s for s in _as_tuple(config.eval_splits) if s not in splits]
  if unknown:
    raise errors.ConfigError(
      f"config.eval_splits names {unknown}, not splits of task {task.name!r} ({sorted(splits)})"
    )
  if config.selection.split not in splits:
    raise errors.ConfigError(
      f"config.selection.split={config.selection.split!r} is not a split of task {task.name!r} "
      f"({sorted(splits)})"
    )
  eval_splits = _as_tuple(config.eval_splits) or task.eval_splits
  return tuple(s for s in eval_splits if s in splits)


def _check_batch_sizes(config, mesh) -> None:
  data_axis = mesh.shape["data"]
  _check_batch_size("batch_size", config.batch_size, data_axis)
  _check_batch_size("eval_batch_size", config.eval_batch_size or config.batch_size, data_axis)


def _run_length(config, splits: LazySplits, for_training: bool) -> RunLength:
  """The run's length and action periods. For evaluation alone the training split is never read:
  `num_train_steps` alone (0 for an epoch-based run) and no periods (epoch-based ones would be
  computed from 0 steps per epoch)."""
  if not for_training:
    return RunLength(max(int(config.num_train_steps), 0), 0, {})
  total_steps, steps_per_epoch = _training_length(config, len(splits["train"]))
  return RunLength(total_steps, steps_per_epoch, _action_periods(config, steps_per_epoch))


def _step_runner(
  config,
  task,
  data: ReplicaData,
  model,
  optimizer,
  mesh,
  replicas,
  replica_axis,
  *,
  run_shardings,
  for_training: bool,
) -> StepRunner:
  """The K-step program of every replica (`StepRunner`), with the task's on-device stream when
  the batches are made on the device."""
  if for_training:
    device_batch, stream_arguments = _device_stream(task, config, data, replicas)
  else:
    device_batch, stream_arguments = None, np.zeros(len(replicas), np.int32)
  model_numbers = sweep.model_numbers(config, replicas, model)
  scanned_steps = functools.partial(
    _replica_steps,
    optimizer=optimizer,
    model=model,
    loss_fn=task.loss_and_metrics,
    device_batch=device_batch,
    batch_size=config.batch_size,
    batch_sharding=sharding.batch_sharding(mesh),
  )
  single_step = functools.partial(
    _replica_step, optimizer=optimizer, model=model, loss_fn=task.loss_and_metrics
  )
  return StepRunner(
    single_step,
    scanned_steps,
    mesh,
    run_shardings=run_shardings,
    replica_axis=replica_axis,
    hyperparameters={**optimizer.hyperparameters, **model_numbers},
    steps_per_call=int(config.get("steps_per_call", 1)),
    stream_arguments=stream_arguments,
  )


def _replicated_eval_step(model, task, mesh, replica_axis, run_shardings, data) -> Callable:
  """`steps.eval_step` of every replica, jitted: on one shared batch, or, when the replicas' data
  differ (`ReplicaData`), each on its group's batch of `[G, B, ...]`."""
  evaluate_one = functools.partial(eval_step, model=model, loss_fn=task.loss_and_metrics)
  if data.num_groups == 1:
    evaluate, batch_sharding = replica_axis.map(evaluate_one, (0, None)), sharding.batch_sharding
  else:
    group_of_replica = np.asarray(data.group_of_replica)

    def evaluate(state, batches):
      per_replica = jax.tree.map(lambda x: x[group_of_replica], batches)  # [R, B, ...]
      return jax.vmap(evaluate_one)(state, per_replica)

    batch_sharding = sharding.stacked_batch_sharding
  jitted = jax.jit(
    evaluate,
    in_shardings=(run_shardings, batch_sharding(mesh)),
    out_shardings=sharding.replicated(mesh),
  )
  return _in_mesh(jitted, mesh)


def _replicated_init(initializer, replicas, mesh, replica_axis, run_shardings) -> Callable:
  """A zero-argument function: every replica's initial state from its own seed, stacked."""
  init = jax.jit(replica_axis.map(initializer.state, (0,)), out_shardings=run_shardings)
  keys = replica_axis.stack([_state_key(replica.config.seed) for replica in replicas])
  return _in_mesh(functools.partial(init, keys), mesh)


def build_program(config: ml_collections.FrozenConfigDict, *, for_training: bool = True) -> Program:
  """Builds data, model, mesh, optimizer, shardings and the jitted steps (nothing runs yet).

  Args:
    config: a resolved config (`resolve_config`).
    for_training: False builds a program for evaluation only: the training split is never
      built (the model is traced on the first evaluation split's first record), and its length
      is `RunLength` of `config.num_train_steps` alone, without action periods.

  Raises:
    errors.UserError: unknown task / optimizer / schedule, bad sizes, missing train split.
  """
  task = task_registry.get_task(config.task)
  replicas = sweep.replicas_of(config)
  data = _replica_data(task, config, replicas)
  splits, metadata = data.splits[0], data.metadata[0]
  mesh = sharding.make_mesh(config.mesh)
  _check_batch_sizes(config, mesh)
  eval_splits = _eval_splits(config, task, splits)
  length = _run_length(config, splits, for_training)
  optimizer = optim.make_replica_optimizer(
    [replica.config.optimizer for replica in replicas], max(length.total_steps, 1)
  )
  # The chain's structure (not its numbers) decides the initial optimizer state.
  tx, _ = optim.make_optimizer(optimizer.structure, max(length.total_steps, 1))
  model = task.build_model(config, metadata)
  example_split = "train" if for_training else (eval_splits or tuple(splits))[0]
  initializer = _Initializer(model, tx, stack_records([splits[example_split][0]]))
  abstract_variables, abstract_state = _abstract_state(
    initializer, _state_key(replicas[0].config.seed), mesh
  )
  state_shardings = _state_shardings(abstract_variables, abstract_state, mesh)
  replica_axis = ReplicaAxis(len(replicas))
  run_shardings = replica_axis.shardings(state_shardings, mesh)
  return Program(
    config=config,
    task=task,
    data=data,
    model=model,
    mesh=mesh,
    replicas=replicas,
    replica_axis=replica_axis,
    optimizer=optimizer,
    length=length,
    eval_splits=eval_splits,
    abstract_state=abstract_state,
    state_shardings=state_shardings,
    init=_replicated_init(initializer, replicas, mesh, replica_axis, run_shardings),
    run_steps=_step_runner(
      config,
      task,
      data,
      model,
      optimizer,
      mesh,
      replicas,
      replica_axis,
      run_shardings=run_shardings,
      for_training=for_training,
    ),
    eval_step=_replicated_eval_step(model, task, mesh, replica_axis, run_shardings, data),
  )
