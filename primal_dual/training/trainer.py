"""The training loop: `train_and_evaluate(config, workdir)` and `evaluate_workdir(workdir, ...)`.

Usable from the command line (`train.py`, `eval.py`) and from a notebook::

  from primal_dual.training import config_lib, trainer
  config = config_lib.training_defaults()
  config.task, config.num_train_steps = 'synthetic', 100
  final = trainer.train_and_evaluate(config, '/tmp/run')   # {'test/accuracy': ..., ...}

What one run does:

1. Fills the config's missing fields from `config_lib.training_defaults()` and freezes it; refuses
   a workdir that holds another experiment or that another live process uses (`workdir.py`).
2. Builds the task's data and model, a `('data', 'model')` mesh, the optimizer, and jits
   `train_step` / `eval_step` once with shardings (`sharding.py`).
3. Resumes from the newest checkpoint in `workdir/checkpoints` if there is one (state, data
   iterator position, evaluation tracker), else initialises from `config.seed`; only then writes
   `workdir/experiment.json` and `workdir/config.json`. A workdir that already finished is
   reported as such and left untouched.
4. Trains to `config.num_train_steps` (or `config.num_epochs` × steps per epoch), with logging,
   evaluation and checkpointing decided by `periodic.PeriodicActions` (all happen after the final
   step). A non-finite loss raises `errors.NonFiniteLossError` naming the step; no checkpoint is
   written from that point, so the last good one stays.
5. Returns the final metrics: `'{split}/{metric}'` of the last evaluation, `'train/{metric}'` of
   the last log, and from the evaluation tracker `'best/{split}_{metric}'` (best value of the
   selection metric over all evaluations: the optimistic "best test accuracy over epochs" of
   the UEA tables) and `'selected/{split}_{metric}'` (every split's metrics at the evaluation where
   `config.selection.split` was best: the clean protocol; ties go to the lower loss on that split,
   then to the later step), plus `'selected/step'` and the rule in words, `'selected/rule'`.

Per-step randomness is `fold_in(state.rng, state.step)`, so a resumed run reproduces an
uninterrupted one exactly.
"""

import contextlib
import dataclasses
import errno
import functools
import json
import math
import operator
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import flax
import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from primal_dual.data import pipeline
from primal_dual.models import parameter_count
from primal_dual.training import checkpointing
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import metrics_logging
from primal_dual.training import optim
from primal_dual.training import periodic
from primal_dual.training import sharding
from primal_dual.training import tasks as tasks_lib
from primal_dual.training import workdir as workdir_lib

FINAL_METRICS_FILE = 'final_metrics.json'


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training (a pytree; checkpointed whole).

  Attributes:
    step: int32 [] completed steps.
    params: the model's 'params' collection (unboxed arrays).
    batch_stats: the 'batch_stats' collection, {} for models without one.
    opt_state: the optax state.
    rng: uint32 [2] base key; step s uses `fold_in(rng, s)` for dropout.
  """

  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array


def model_variables(params: Any, batch_stats: Any) -> dict[str, Any]:
  """The variables dict for `model.apply`, with 'batch_stats' only if the model has any."""
  variables = {'params': params}
  if batch_stats:
    variables['batch_stats'] = batch_stats
  return variables


def _apply_model(model: nn.Module, params, batch_stats, batch, **kwargs):
  return model.apply(
    model_variables(params, batch_stats), batch['inputs'], mask=batch.get('mask'), **kwargs
  )


def train_step(
  state: TrainState,
  batch: Mapping[str, jax.Array],
  *,
  model: nn.Module,
  tx: optax.GradientTransformation,
  loss_fn: Callable,
) -> tuple[TrainState, jax.Array, dict]:
  """One optimisation step (pure; jit it with the keyword arguments bound).

  Args:
    state: the current TrainState.
    batch: the global batch, dict of arrays with leading axis `batch_size`.
    model: the Linen model.
    tx: the optax transformation.
    loss_fn: `task.loss_and_metrics`.

  Returns:
    (new state, float32 [] loss, metrics dict of (sum, count) pairs incl. 'grad_norm').
  """
  dropout_rng = jax.random.fold_in(state.rng, state.step)

  def compute_loss(params):
    outputs, updates = _apply_model(
      model,
      params,
      state.batch_stats,
      batch,
      train=True,
      rngs={'dropout': dropout_rng},
      mutable=['batch_stats'],
    )
    loss, metrics = loss_fn(outputs, batch)
    return loss, (metrics, updates.get('batch_stats', state.batch_stats))

  (loss, (metrics, batch_stats)), grads = jax.value_and_grad(compute_loss, has_aux=True)(
    state.params
  )
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, grad_norm=(optax.tree.norm(grads), jnp.ones((), jnp.float32)))
  new_state = state.replace(
    step=state.step + 1, params=params, batch_stats=batch_stats, opt_state=opt_state
  )
  return new_state, loss, metrics


def train_steps(
  state: TrainState,
  batches: Mapping[str, jax.Array] | None,
  data_seed: jax.Array | None = None,
  *,
  num_steps: int,
  model: nn.Module,
  tx: optax.GradientTransformation,
  loss_fn: Callable,
  device_batch: Callable[..., Mapping[str, jax.Array]] | None = None,
  batch_size: int = 0,
  batch_sharding=None,
) -> tuple[TrainState, jax.Array, dict]:
  """`num_steps` calls of `train_step` in one program (`lax.scan`; pure, jit it).

  Args:
    state: the current TrainState.
    batches: dict of `[num_steps, batch_size, ...]` arrays, or None when `device_batch` makes
      each step's batch on the device.
    data_seed: int32 `[]`, the run's seed, which picks its stream of generated batches.
    num_steps: K, the scan length.
    model, tx, loss_fn: as for `train_step`.
    device_batch: `device_batch(indices uint32 [batch_size], data_seed) -> batch`; step s (the
      state's step before the update) trains on records `s·batch_size … s·batch_size + B − 1`
      of the task's train stream, so the data do not depend on K.
    batch_size: the global batch size (with `device_batch`).
    batch_sharding: where a generated batch lives (split over the mesh's `data` axis).

  Returns:
    (new state, float32 [num_steps] losses, metrics: (sum, count) pairs summed over the steps).
  """

  def one_step(state, batch):
    if device_batch is not None:
      indices = state.step.astype(jnp.uint32) * jnp.uint32(batch_size) + jnp.arange(
        batch_size, dtype=jnp.uint32
      )
      batch = device_batch(indices, data_seed)
      if batch_sharding is not None:
        batch = jax.lax.with_sharding_constraint(batch, batch_sharding)
    state, loss, metrics = train_step(state, batch, model=model, tx=tx, loss_fn=loss_fn)
    return state, (loss, metrics)

  state, (losses, metrics) = jax.lax.scan(one_step, state, batches, length=num_steps)
  return state, losses, jax.tree.map(lambda x: jnp.sum(x, axis=0), metrics)


def eval_step(
  state: TrainState, batch: Mapping[str, jax.Array], *, model: nn.Module, loss_fn: Callable
) -> dict:
  """Metric (sum, count) pairs of one padded eval batch (rows with `valid` False count 0)."""
  outputs = _apply_model(model, state.params, state.batch_stats, batch, train=False)
  _, metrics = loss_fn(outputs, batch)
  return metrics


def _stack(records: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {key: np.stack([np.asarray(r[key]) for r in records]) for key in records[0]}


# ------------------------------------------------------------------------------------------------
# Best / selected metric tracking.

_MODES: dict[str, Callable[[float, float], bool]] = {'max': operator.gt, 'min': operator.lt}


def _loss_rank(loss: float | None) -> float:
  """A loss for comparison: missing or non-finite losses rank as infinitely bad."""
  return loss if loss is not None and math.isfinite(loss) else math.inf


class EvalTracker:
  """Tracks the best value of one metric per split and the evaluation chosen on one split.

  `best/` keeps the earliest of tied values. The selected evaluation is the one with the best
  metric on the selection split; ties go to the lower loss on that split, then to the later step
  (`rule` states this). Non-finite metric values are ignored.

  Args:
    metric: metric name, e.g. 'accuracy'.
    mode: 'max' or 'min'.
    selection_split: the split whose metric chooses the 'selected' evaluation.
  """

  def __init__(self, metric: str, mode: str, selection_split: str):
    self.metric = metric
    self.mode = mode
    self._better = errors.lookup(_MODES, mode, 'selection mode (config.selection.mode)')
    self.selection_split = selection_split
    self.best: dict[str, float] = {}
    self.best_step: dict[str, int] = {}
    self.selected: dict[str, float] = {}
    self.selected_step: int | None = None

  @property
  def rule(self) -> str:
    """The selection rule in words (written to final_metrics.json as `selected/rule`)."""
    split = self.selection_split
    return f'{self.mode} {split} {self.metric}; ties: lower {split} loss, then later step'

  def update(self, step: int, results: Mapping[str, Mapping[str, float]]) -> bool:
    """Records one evaluation (split → metric → value); True if it became the selected one."""
    for split, metrics in results.items():
      value = metrics.get(self.metric)
      if value is None or not math.isfinite(value):
        continue
      if split not in self.best or self._better(value, self.best[split]):
        self.best[split], self.best_step[split] = value, step
    selection = results.get(self.selection_split, {})
    value = selection.get(self.metric)
    if value is None or not math.isfinite(value):
      return False
    if not self._beats_selected(value, selection.get('loss')):
      return False
    self.selected = {
      f'{split}_{name}': v for split, metrics in results.items() for name, v in metrics.items()
    }
    self.selected_step = step
    return True

  def _beats_selected(self, value: float, loss: float | None) -> bool:
    """Whether a later evaluation with selection metric `value` and loss `loss` replaces the
    selected one: a better metric, or an equal metric with a loss that is not higher."""
    current = self.selected.get(f'{self.selection_split}_{self.metric}')
    if current is None or self._better(value, current):
      return True
    if value != current:
      return False
    current_loss = self.selected.get(f'{self.selection_split}_loss')
    return _loss_rank(loss) <= _loss_rank(current_loss)  # equal losses: the later step wins

  def summary(self) -> dict[str, float]:
    """`best/{split}_{metric}`, `best/{split}_step`, `selected/{split}_{name}`, `selected/step`."""
    out = {}
    for split, value in self.best.items():
      out[f'best/{split}_{self.metric}'] = value
      out[f'best/{split}_step'] = self.best_step[split]
    if self.selected_step is not None:
      out.update({f'selected/{key}': value for key, value in self.selected.items()})
      out['selected/step'] = self.selected_step
    return out

  def state_dict(self) -> dict:
    return dict(
      best=self.best,
      best_step=self.best_step,
      selected=self.selected,
      selected_step=self.selected_step,
    )

  def load_state_dict(self, state: Mapping) -> None:
    self.best = dict(state.get('best', {}))
    self.best_step = {k: int(v) for k, v in state.get('best_step', {}).items()}
    self.selected = dict(state.get('selected', {}))
    self.selected_step = state.get('selected_step')


# ------------------------------------------------------------------------------------------------
# Set-up shared by training and evaluation.


def resolve_config(config: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
  """The effective config: `training_defaults()` overridden by `config`, frozen.

  Raises:
    errors.ConfigError: bad model sizes or dropout rates (`config_lib.validate`).
  """
  if isinstance(config, ml_collections.FrozenConfigDict):
    config = config.as_configdict()
  config_lib.validate(config)
  return config_lib.freeze(config_lib.merge(config_lib.training_defaults(), config))


def _every_steps(config, name: str, steps_per_epoch: int) -> int:
  epochs = config.get(f'{name}_every_epochs', 0) or 0
  if epochs > 0:
    return max(1, round(epochs * steps_per_epoch))
  return config.get(f'{name}_every_steps', 0) or 0


def _as_tuple(value) -> tuple[str, ...]:
  if isinstance(value, str):
    return tuple(s.strip() for s in value.split(',') if s.strip())
  return tuple(value or ())


@dataclasses.dataclass
class Experiment:
  """Everything built once from a config: data, model, mesh, optimizer, jitted steps."""

  config: ml_collections.FrozenConfigDict
  task: tasks_lib.Task
  splits: dict[str, Any]
  metadata: dict[str, Any]
  model: nn.Module
  mesh: jax.sharding.Mesh
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  total_steps: int
  steps_per_epoch: int
  local_batch_size: int
  eval_batch_size: int
  eval_splits: tuple[str, ...]
  state_shardings: TrainState
  abstract_state: TrainState
  init_state: Callable[[], TrainState]
  train_step: Callable
  eval_step: Callable
  action_periods: dict[str, int]
  run_steps: 'StepRunner'
  seeds: tuple[int, ...] | None  # replicas trained in one program (config.seeds), or None
  run_shardings: TrainState  # of the trained state: `state_shardings`, stacked for replicas

  def make_train_iterator(self):
    """A checkpointable grain iterator of this process's training batches (endless), or None
    when the batches are made on the device (`config.train_data_on_device`)."""
    if self.run_steps.device_data:
      return None
    loader = self.config.loader
    return pipeline.make_loader(
      self.splits['train'],
      batch_size=self.local_batch_size,
      seed=self.config.seed,
      shuffle=True,
      num_epochs=None,
      drop_remainder=True,
      shard_by_process=True,
      worker_count=loader.worker_count,
      read_options=grain.ReadOptions(
        num_threads=loader.num_threads, prefetch_buffer_size=loader.prefetch_buffer_size
      ),
      batch_reads=loader.get('batch_reads', False),
    )

  def eval_batches(self, split: str) -> Iterator[dict[str, np.ndarray]]:
    """This process's padded batches covering split `split` once (with `valid`)."""
    return pipeline.iterate_eval(self.splits[split], self.eval_batch_size // jax.process_count())

  def restore_target(self) -> TrainState:
    return checkpointing.abstract_with_shardings(self.abstract_state, self.state_shardings)


class StepRunner:
  """Runs the next `n` training steps and returns `(state, losses [n] or [], metrics)`.

  With one step per call and host batches this is one `train_step` call per step; otherwise one
  scanned program (`train_steps`) per call, compiled once per distinct `n` (the steps per call,
  and a shorter final call when they do not divide the run).
  """

  def __init__(
    self,
    single_step: Callable,
    compile_steps: Callable[[int], Callable],
    mesh,
    steps_per_call: int,
    device_data: bool,
    data_seed: jax.Array,
  ):
    self._single_step, self._compile_steps = single_step, compile_steps
    self._compiled: dict[int, Callable] = {}
    self.mesh, self.steps_per_call, self.device_data = mesh, steps_per_call, device_data
    self.data_seed = data_seed  # int32 [] (one run) or [replicas]

  def __call__(self, state: TrainState, num_steps: int, train_iterator):
    if self.steps_per_call == 1 and not self.device_data:
      return self._single_step(state, sharding.shard_batch(next(train_iterator), self.mesh))
    if num_steps not in self._compiled:
      self._compiled[num_steps] = self._compile_steps(num_steps)
    batches = None
    if not self.device_data:
      batches = sharding.shard_stacked_batch(
        _stack([next(train_iterator) for _ in range(num_steps)]), self.mesh
      )
    return self._compiled[num_steps](state, batches, self.data_seed)


def _replica_seeds(config) -> tuple[int, ...] | None:
  """`config.seeds` as a tuple of distinct ints, or None for an ordinary single run."""
  seeds = tuple(int(s) for s in (config.get('seeds') or ()))
  if not seeds:
    return None
  if len(set(seeds)) != len(seeds):
    raise errors.ConfigError(f'config.seeds must be distinct; got {seeds}')
  return seeds


def _action_periods(config, steps_per_epoch: int) -> dict[str, int]:
  """Period in steps of each periodic action (0: the final step only), checked against
  `config.steps_per_call`: actions happen between calls, so K must divide every period."""
  periods = {
    name: _every_steps(config, name, steps_per_epoch) for name in ('log', 'eval', 'checkpoint')
  }
  steps_per_call = config.get('steps_per_call', 1)
  if steps_per_call < 1:
    raise errors.ConfigError(f'config.steps_per_call must be >= 1, got {steps_per_call}')
  bad = {name: period for name, period in periods.items() if period > 0 and period % steps_per_call}
  if bad:
    listed = ', '.join(f'{name} every {period}' for name, period in sorted(bad.items()))
    raise errors.ConfigError(
      f'config.steps_per_call={steps_per_call} must divide every logging, evaluation and '
      f'checkpoint period (actions happen between calls); got {listed} steps'
    )
  return periods


def _check_batch_size(name: str, size: int, data_axis: int) -> None:
  processes = jax.process_count()
  if size < 1 or size % data_axis or size % processes:
    raise errors.ConfigError(
      f'config.{name}={size} must be a positive multiple of the mesh data axis ({data_axis}) '
      f'and of the process count ({processes})'
    )


def _training_length(config, train_size: int) -> tuple[int, int]:
  """(total_steps, steps_per_epoch) from num_train_steps or num_epochs."""
  steps_per_epoch = train_size // config.batch_size
  if steps_per_epoch < 1:
    raise errors.ConfigError(
      f'the train split has {train_size} examples, fewer than config.batch_size='
      f'{config.batch_size}; lower the batch size'
    )
  if config.num_train_steps > 0:
    return int(config.num_train_steps), steps_per_epoch
  if config.num_epochs > 0:
    return int(math.ceil(config.num_epochs * steps_per_epoch)), steps_per_epoch
  raise errors.ConfigError('set config.num_train_steps > 0 or config.num_epochs > 0')


def _in_mesh(fn: Callable, mesh) -> Callable:
  """Runs `fn` (tracing included) with `mesh` and the logical axis rules in context."""

  @functools.wraps(fn)
  def wrapped(*args):
    with sharding.mesh_context(mesh):
      return fn(*args)

  return wrapped


def _build_data(task: tasks_lib.Task, config) -> tuple[dict[str, Any], dict[str, Any]]:
  """`task.build_data(config)`, with data problems (missing or malformed files, bad data
  options: FileNotFoundError / ValueError) turned into one-line user errors."""
  try:
    return task.build_data(config)
  except errors.UserError:
    raise
  except FileNotFoundError as e:
    raise errors.DataNotFoundError(f'task {task.name!r}: {e}') from e
  except ValueError as e:
    raise errors.ConfigError(f'task {task.name!r} data: {e}') from e


def build_experiment(config: ml_collections.FrozenConfigDict) -> Experiment:
  """Builds data, model, mesh, optimizer, shardings and the jitted steps (nothing runs yet).

  Raises:
    errors.UserError: unknown task / optimizer / schedule, bad sizes, missing train split.
  """
  task = tasks_lib.get_task(config.task)
  splits, metadata = _build_data(task, config)
  if 'train' not in splits:
    raise errors.ConfigError(f'task {task.name!r} returned no train split (got {sorted(splits)})')
  mesh = sharding.make_mesh(config.mesh)
  data_axis = mesh.shape['data']
  eval_batch_size = config.eval_batch_size or config.batch_size
  _check_batch_size('batch_size', config.batch_size, data_axis)
  _check_batch_size('eval_batch_size', eval_batch_size, data_axis)
  total_steps, steps_per_epoch = _training_length(config, len(splits['train']))
  tx, schedule = optim.make_optimizer(config.optimizer, total_steps)
  model = task.build_model(config, metadata)

  example = _stack([splits['train'][0]])
  example_mask = example.get('mask')

  def init_variables(rng):
    return model.init(
      {'params': rng, 'dropout': rng}, example['inputs'], mask=example_mask, train=False
    )

  def create_state(rng):
    init_rng, state_rng = jax.random.split(rng)
    variables = nn.unbox(init_variables(init_rng))
    params = variables['params']
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      batch_stats=variables.get('batch_stats', {}),
      opt_state=tx.init(params),
      rng=state_rng,
    )

  root_rng = jax.random.PRNGKey(config.seed)
  with sharding.mesh_context(mesh):
    try:
      abstract_variables = jax.eval_shape(init_variables, root_rng)
    except ValueError as e:
      # The first trace of the model is where invalid model options surface (a head count that
      # does not divide the width, SH ratios of the wrong length, an unknown variant name...).
      raise errors.ConfigError(f'model config (config.model): {e}') from e
    abstract_state = jax.eval_shape(create_state, root_rng)
  variable_shardings = sharding.variable_shardings(abstract_variables, mesh)
  param_shardings = variable_shardings['params']
  sharding.check_divisible(abstract_state.params, param_shardings, mesh)
  replicated = sharding.replicated(mesh)
  state_shardings = TrainState(
    step=replicated,
    params=param_shardings,
    batch_stats=variable_shardings.get('batch_stats', {}),
    opt_state=sharding.shardings_following(
      abstract_state.opt_state, abstract_state.params, param_shardings, mesh
    ),
    rng=replicated,
  )

  batch_sharding = sharding.batch_sharding(mesh)
  seeds = _replica_seeds(config)
  # Replicas (config.seeds) stack their states on a leading axis, kept whole on every device.
  run_shardings = (
    state_shardings if seeds is None else sharding.with_leading_axis(state_shardings, mesh)
  )
  jit_init = jax.jit(create_state, out_shardings=state_shardings)
  jit_train = jax.jit(
    functools.partial(train_step, model=model, tx=tx, loss_fn=task.loss_and_metrics),
    in_shardings=(state_shardings, batch_sharding),
    out_shardings=(state_shardings, replicated, replicated),
    donate_argnums=(0,),
  )
  evaluate_one = functools.partial(eval_step, model=model, loss_fn=task.loss_and_metrics)
  jit_eval = jax.jit(
    evaluate_one if seeds is None else jax.vmap(evaluate_one, in_axes=(0, None)),
    in_shardings=(run_shardings, batch_sharding),
    out_shardings=replicated,
  )

  device_data = bool(config.get('train_data_on_device', False))
  if device_data and task.device_train_stream is None:
    raise errors.ConfigError(
      f'task {task.name!r} has no on-device train stream; set config.train_data_on_device=False'
    )
  if seeds is not None and not device_data:
    raise errors.ConfigError(
      'config.seeds trains its replicas in one program on batches made on '
      'the device; set config.train_data_on_device=True (sRAVEN, logic)'
    )
  device_batch = task.device_train_stream(config, metadata) if device_data else None

  def compile_steps(num_steps: int) -> Callable:
    steps = functools.partial(
      train_steps,
      num_steps=num_steps,
      model=model,
      tx=tx,
      loss_fn=task.loss_and_metrics,
      device_batch=device_batch,
      batch_size=config.batch_size,
      batch_sharding=batch_sharding,
    )
    if seeds is not None:
      steps = jax.vmap(steps, in_axes=(0, None, 0))
    scanned = jax.jit(
      steps,
      in_shardings=(
        run_shardings,
        None if device_data else sharding.stacked_batch_sharding(mesh),
        replicated,
      ),
      out_shardings=(run_shardings, replicated, replicated),
      donate_argnums=(0,),
    )
    return _in_mesh(scanned, mesh)

  data_seed = jnp.asarray(config.seed if seeds is None else seeds, jnp.int32)
  run_steps = StepRunner(
    _in_mesh(jit_train, mesh),
    compile_steps,
    mesh,
    int(config.get('steps_per_call', 1)),
    device_data,
    data_seed,
  )
  if seeds is None:
    init_state = lambda: jit_init(root_rng)  # pylint: disable=unnecessary-lambda-assignment
  else:
    jit_init_replicas = jax.jit(jax.vmap(create_state), out_shardings=run_shardings)
    replica_rngs = jnp.stack([jax.random.PRNGKey(seed) for seed in seeds])
    init_state = lambda: jit_init_replicas(replica_rngs)  # pylint: disable=unnecessary-lambda-assignment
  action_periods = _action_periods(config, steps_per_epoch)

  eval_splits = _as_tuple(config.eval_splits) or task.eval_splits
  unknown = [s for s in _as_tuple(config.eval_splits) if s not in splits]
  if unknown:
    raise errors.ConfigError(
      f'config.eval_splits names {unknown}, not splits of task {task.name!r} ({sorted(splits)})'
    )
  if config.selection.split not in splits:
    raise errors.ConfigError(
      f'config.selection.split={config.selection.split!r} is not a split of task {task.name!r} '
      f'({sorted(splits)})'
    )
  return Experiment(
    config=config,
    task=task,
    splits=splits,
    metadata=metadata,
    model=model,
    mesh=mesh,
    tx=tx,
    schedule=schedule,
    total_steps=total_steps,
    steps_per_epoch=steps_per_epoch,
    local_batch_size=config.batch_size // jax.process_count(),
    eval_batch_size=eval_batch_size,
    eval_splits=tuple(s for s in eval_splits if s in splits),
    state_shardings=state_shardings,
    abstract_state=abstract_state,
    init_state=_in_mesh(init_state, mesh),
    train_step=_in_mesh(jit_train, mesh),
    eval_step=_in_mesh(jit_eval, mesh),
    action_periods=action_periods,
    run_steps=run_steps,
    seeds=seeds,
    run_shardings=run_shardings,
  )


def _sum_metrics(
  metric_list: list[Mapping[str, tuple]], replicas: bool = False
) -> dict[str, tuple[Any, Any]]:
  """Adds up per-batch (sum, count) dicts on the host (one device-to-host transfer), in float64:
  Python floats for a single run, `[replicas]` arrays for replicas."""
  totals = {}
  for metrics in jax.device_get(metric_list):
    for name, (total, count) in metrics.items():
      total, count = (np.asarray(x, np.float64) for x in (total, count))
      if name in totals:
        total, count = totals[name][0] + total, totals[name][1] + count
      totals[name] = (total, count)
  if not replicas:
    totals = {name: (float(t), float(c)) for name, (t, c) in totals.items()}
  return totals


def _means(totals: Mapping[str, tuple[float, float]]) -> dict[str, float]:
  return {
    name: float(total) / float(count) if count else float('nan')
    for name, (total, count) in totals.items()
  }


def _reduce_metrics(metric_list: list[Mapping[str, tuple]]) -> dict[str, float]:
  """Σ sums / Σ counts over a list of per-batch (sum, count) dicts."""
  return _means(_sum_metrics(metric_list))


def _reduce_runs(metric_list: list[Mapping[str, tuple]], replicas: bool) -> list[dict[str, float]]:
  """`_reduce_metrics` per run: `[means]`, or one dict per replica."""
  totals = _sum_metrics(metric_list, replicas)
  if not replicas:
    return [_means(totals)]
  num = len(next(iter(totals.values()))[0]) if totals else 0
  return [_means({name: (t[i], c[i]) for name, (t, c) in totals.items()}) for i in range(num)]


def evaluate_runs(
  experiment: Experiment, state: TrainState, split_names: tuple[str, ...] | None = None
) -> list[dict[str, dict[str, float]]]:
  """`evaluate` of every run: `[results]`, or one per replica of a stacked state."""
  replicas = experiment.seeds is not None
  per_split = {}
  for split in split_names or experiment.eval_splits:
    if split not in experiment.splits:
      raise errors.ConfigError(f'unknown split {split!r}; the task has {sorted(experiment.splits)}')
    per_batch = [
      experiment.eval_step(state, sharding.shard_batch(batch, experiment.mesh))
      for batch in experiment.eval_batches(split)
    ]
    per_split[split] = _reduce_runs(per_batch, replicas)
  num_runs = len(experiment.seeds) if replicas else 1
  return [{split: runs[i] for split, runs in per_split.items()} for i in range(num_runs)]


def evaluate(
  experiment: Experiment, state: TrainState, split_names: tuple[str, ...] | None = None
) -> dict[str, dict[str, float]]:
  """Metrics of `state` on whole splits (every example exactly once).

  Returns:
    split → metric name → mean over the split's examples.
  """
  return evaluate_runs(experiment, state, split_names)[0]


def _flatten(results: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
  return {
    f'{split}/{name}': value
    for split, metrics in results.items()
    for name, value in metrics.items()
  }


def _check_finite(first_step: int, losses: jax.Array, last_checkpoint_step: int | None) -> None:
  """Raises for the first step with a non-finite loss; `losses` are those of steps
  `first_step, …` (`[]`, `[steps]`, or `[replicas, steps]`)."""
  values = np.asarray(jax.device_get(losses), np.float64)
  per_step = values.reshape(-1, values.shape[-1] if values.ndim else 1)  # [runs, steps]
  finite = np.isfinite(per_step)
  bad = np.flatnonzero(~finite.all(axis=0))
  if bad.size:
    column = per_step[:, bad[0]]
    raise errors.NonFiniteLossError(
      first_step + int(bad[0]), float(column[~finite[:, bad[0]]][0]), last_checkpoint_step
    )


def _make_tracker(config, task: tasks_lib.Task) -> EvalTracker:
  selection = config.selection
  return EvalTracker(
    metric=selection.metric or task.selection_metric,
    mode=selection.mode or task.selection_mode,
    selection_split=selection.split,
  )


def _write_json(path: str, payload: Mapping) -> None:
  if jax.process_index() != 0:
    return
  with open(path + '.tmp', 'w') as f:
    json.dump(payload, f, indent=2, sort_keys=True)
  os.replace(path + '.tmp', path)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (resuming from `workdir` if it holds checkpoints) and evaluates; see module doc.

  The workdir must hold the same experiment (`workdir.DEFINING_FIELDS`) or none, and no other
  live process may be using it (process 0 holds `workdir/.lock` while it runs).

  Args:
    config: a ConfigDict; fields missing from it take `config_lib.training_defaults()`.
    workdir: output folder (config.json, metrics.jsonl, tensorboard/, checkpoints/).

  Returns:
    The final metrics (also written to `workdir/final_metrics.json`); for a workdir that already
    finished, the metrics it stored then.

  Raises:
    errors.UserError: a config problem, missing data, a non-finite loss, another experiment's or
      a busy workdir, Ctrl-C (`errors.StoppedError`), a full disk (`errors.DiskFullError`).
  """
  config = resolve_config(config)
  workdir = os.path.abspath(workdir)
  workdir_lib.check_same_experiment(workdir, config)  # before writing anything, even the lock
  with _workdir_lock(workdir):
    # Checked again under the lock: a run may have claimed the workdir in between.
    workdir_lib.check_same_experiment(workdir, config)
    try:
      return _train_in_workdir(config, workdir)
    except Exception as e:  # pylint: disable=broad-except
      if _is_disk_full(e):
        raise errors.DiskFullError(workdir) from e
      raise


def _workdir_lock(workdir: str):
  """The workdir's lock on process 0; processes of one multi-process run share the workdir."""
  if jax.process_index() != 0:
    return contextlib.nullcontext()
  return workdir_lib.WorkdirLock(workdir)


def _is_disk_full(error: BaseException | None) -> bool:
  """Whether ENOSPC is anywhere in `error`'s chain (Orbax re-raises write errors wrapped)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
      return True
    error = error.__cause__ or error.__context__
  return False


def _read_final_metrics(workdir: str) -> dict | None:
  path = os.path.join(workdir, FINAL_METRICS_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


@dataclasses.dataclass
class _Run:
  """The files and bookkeeping of one trained model: the whole run, or one replica of
  `config.seeds` (then in `<workdir>/seed_<s>`, a workdir of its own that looks as if that seed
  had been trained alone)."""

  config: ml_collections.FrozenConfigDict
  workdir: str
  checkpointer: checkpointing.Checkpointer
  selected_checkpointer: checkpointing.Checkpointer | None = None
  tracker: EvalTracker | None = None
  writer: metrics_logging.MetricWriter | None = None
  last_train: dict[str, float] = dataclasses.field(default_factory=dict)
  last_eval: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
    for manager in (self.checkpointer, self.selected_checkpointer):
      if manager is not None:
        manager.close()


def replica_config(
  config: ml_collections.FrozenConfigDict, seed: int
) -> ml_collections.FrozenConfigDict:
  """The config of one replica of `config.seeds`: `config` with `seed` and no `seeds`."""
  return resolve_config(config_lib.merge(config.as_configdict(), {'seed': seed, 'seeds': ()}))


def _runs_of(config, workdir: str, seeds: tuple[int, ...] | None) -> list[_Run]:
  """One `_Run` for a single run; one per seed, in `<workdir>/seed_<s>`, for replicas."""
  if seeds is None:
    configs = [(config, workdir)]
  else:
    configs = [(replica_config(config, s), os.path.join(workdir, f'seed_{s}')) for s in seeds]
  runs = []
  for run_config, run_workdir in configs:
    workdir_lib.check_same_experiment(run_workdir, run_config)
    runs.append(
      _Run(
        run_config,
        run_workdir,
        checkpointing.Checkpointer(
          os.path.join(run_workdir, checkpointing.CHECKPOINT_DIR),
          keep=config.keep_checkpoints,
          async_save=config.async_checkpointing,
        ),
      )
    )
  return runs


def _common_start_step(runs: list[_Run]) -> int | None:
  """The newest checkpoint step every run has (replicas saved together; a kill during a save
  can leave one replica a checkpoint ahead), or None when a run has none."""
  steps = [set(run.checkpointer.all_steps()) for run in runs]
  common = set.intersection(*steps)
  if not common:
    if any(steps):
      raise errors.CheckpointNotFoundError(
        f'the replicas under {os.path.dirname(runs[0].workdir)} share no checkpoint step; '
        'delete their checkpoints/ folders to start again'
      )
    return None
  return max(common)


def _stack_states(states: list[TrainState], shardings: TrainState) -> TrainState:
  return jax.device_put(jax.tree.map(lambda *xs: jnp.stack(xs), *states), shardings)


def _replica(tree: Any, index: int | None) -> Any:
  """Replica `index` of a stacked pytree; the tree itself for a single run (`index` None)."""
  return tree if index is None else jax.tree.map(lambda x: x[index], tree)


def _train_in_workdir(config: ml_collections.FrozenConfigDict, workdir: str) -> dict[str, float]:
  """`train_and_evaluate` once the workdir is locked and known to hold this experiment."""
  experiment = build_experiment(config)
  num_parameters = parameter_count(experiment.abstract_state.params)
  if jax.process_index() == 0:
    print(
      f'model: {num_parameters:,} parameters ({config.task}, '
      f'attention={config.model.get("attention", "-")})',
      flush=True,
    )
  runs = _runs_of(config, workdir, experiment.seeds)
  try:
    return _train_runs(experiment, runs, num_parameters)
  finally:
    for run in runs:
      run.close()


def _train_runs(experiment: Experiment, runs: list[_Run], num_parameters: int) -> dict:
  """Restores or initialises every run, trains them together, writes their final metrics."""
  config = experiment.config
  start_step = _common_start_step(runs)
  finished = [_read_final_metrics(run.workdir) for run in runs]
  if (
    start_step is not None
    and start_step >= experiment.total_steps
    and all(f is not None for f in finished)
  ):
    if jax.process_index() == 0:
      print(
        f'workdir {os.path.commonpath([r.workdir for r in runs])} already finished at step '
        f'{start_step}; nothing to train, {FINAL_METRICS_FILE} left as it was',
        file=sys.stderr,
      )
    return _combined(runs, finished, experiment.seeds is not None)

  for run in runs:
    if config.keep_selected_checkpoint and config.selection.split in experiment.eval_splits:
      run.selected_checkpointer = checkpointing.Checkpointer(
        os.path.join(run.workdir, checkpointing.SELECTED_DIR),
        keep=1,
        async_save=config.async_checkpointing,
      )
    run.tracker = _make_tracker(config, experiment.task)
  train_iterator = experiment.make_train_iterator()

  if start_step is None:
    start_step, state = 0, experiment.init_state()
  else:
    states = []
    for run in runs:
      run_state, meta = run.checkpointer.restore(
        start_step, experiment.restore_target(), data_iterator=train_iterator
      )
      run.tracker.load_state_dict(meta.get('tracker', {}))
      states.append(run_state)
    state = (
      states[0] if experiment.seeds is None else _stack_states(states, experiment.run_shardings)
    )
  for run in runs:
    # Only now, with the checkpoint restored or the state initialised, is the config known to
    # fit the workdir's checkpoints: a failed restore leaves the previous config.json in place.
    if jax.process_index() == 0:
      os.makedirs(run.workdir, exist_ok=True)
      workdir_lib.write_definition(run.workdir, run.config)
      config_lib.write_config(run.config, run.workdir)
    # Whatever a crashed run wrote after its last checkpoint will be redone: drop it.
    metrics_logging.truncate_metrics_after(run.workdir, start_step)
    for manager in (run.checkpointer, run.selected_checkpointer):
      if manager is not None:
        manager.delete_after(start_step)
    run.writer = metrics_logging.MetricWriter(run.workdir)

  progress = metrics_logging.ProgressBar(
    experiment.total_steps, min(start_step, experiment.total_steps), enabled=config.progress_bar
  )
  try:
    finals = _train_loop(experiment, state, start_step, train_iterator, runs, progress)
  finally:
    progress.close()
  for run, final in zip(runs, finals):
    if run.tracker.selected_step is not None:
      final['selected/rule'] = run.tracker.rule
    final['model/num_parameters'] = num_parameters
    _write_json(os.path.join(run.workdir, FINAL_METRICS_FILE), final)
  return _combined(runs, finals, experiment.seeds is not None)


def _combined(runs: list[_Run], finals: list[dict], replicas: bool) -> dict:
  """A single run's final metrics, or every replica's under `seed_<s>/`."""
  if not replicas:
    return finals[0]
  return {
    f'{os.path.basename(run.workdir)}/{name}': value
    for run, final in zip(runs, finals)
    for name, value in final.items()
  }


_MAX_PENDING_METRICS = 500


class _StopRequest:
  """Turns the first Ctrl-C (SIGINT) during training into a request to stop between steps.

  A KeyboardInterrupt raised wherever the main thread happens to be (inside Orbax waiting for a
  checkpoint to finalise, inside grain) prints those libraries' tracebacks and can cut a save
  short; the training loop instead checks `requested` before each step. A second Ctrl-C
  interrupts at once. Outside the main thread (where signal handlers cannot be set) this does
  nothing and Ctrl-C raises KeyboardInterrupt as usual.
  """

  def __init__(self):
    self.requested = False
    self._installed = threading.current_thread() is threading.main_thread()
    if self._installed:
      self._previous = signal.signal(signal.SIGINT, self._request)

  def _restore_previous_handler(self) -> None:
    # None: the previous handler was not set from Python; Python's own raises KeyboardInterrupt.
    previous = self._previous if self._previous is not None else signal.default_int_handler
    signal.signal(signal.SIGINT, previous)

  def _request(self, signum, frame):  # pylint: disable=unused-argument
    self.requested = True
    self._restore_previous_handler()  # the next Ctrl-C interrupts at once

  def close(self) -> None:
    """Puts the previous SIGINT handler back."""
    if self._installed:
      self._restore_previous_handler()
      self._installed = False


def _train_loop(
  experiment: Experiment,
  state: TrainState,
  start_step: int,
  train_iterator,
  runs: list[_Run],
  progress: metrics_logging.ProgressBar,
) -> list[dict[str, float]]:
  """Trains from `start_step` to the end; returns each run's final metrics."""
  total_steps = experiment.total_steps
  actions = periodic.PeriodicActions(total_steps, every=experiment.action_periods)
  steps_per_call = experiment.run_steps.steps_per_call
  replicas = experiment.seeds is not None
  last_checkpoint_step = start_step or None
  pending_metrics: list = []
  unchecked = None  # (first step, losses) of the previous call, checked one call late (no stall).
  log_clock = (time.monotonic(), start_step)
  stop = _StopRequest()

  completed = start_step
  try:
    while completed < total_steps:
      if stop.requested:
        raise KeyboardInterrupt()
      num_steps = min(steps_per_call, total_steps - completed)
      state, losses, metrics = experiment.run_steps(state, num_steps, train_iterator)
      pending_metrics.append(metrics)
      if len(pending_metrics) >= _MAX_PENDING_METRICS:  # Long log periods: keep memory bounded.
        pending_metrics = [_sum_metrics(pending_metrics, replicas)]
      if unchecked is not None:
        _check_finite(*unchecked, last_checkpoint_step)
      unchecked = (completed + 1, losses)
      completed += num_steps
      step = completed
      due = actions.due(step)
      progress.update(num_steps)
      if not due:
        continue
      _check_finite(*unchecked, last_checkpoint_step)
      unchecked = None
      scalars = [{} for _ in runs]  # Everything a run logs at this step: one metrics.jsonl record.

      if 'log' in due:
        now = time.monotonic()
        per_run = _reduce_runs(pending_metrics, replicas)
        for run, reduced, out in zip(runs, per_run, scalars):
          run.last_train = {f'train/{k}': v for k, v in reduced.items()}
          run.last_train['train/learning_rate'] = float(experiment.schedule(step - 1))
          run.last_train['train/steps_per_second'] = (step - log_clock[1]) / max(
            now - log_clock[0], 1e-9
          )
          out.update(run.last_train)
        log_clock = (now, step)
        pending_metrics = []
        progress.update(0, loss=runs[0].last_train.get('train/loss', float('nan')))

      if 'eval' in due:
        for index, (run, results, out) in enumerate(
          zip(runs, evaluate_runs(experiment, state), scalars)
        ):
          run.last_eval = results
          improved = run.tracker.update(step, results)
          out.update({**_flatten(results), **run.tracker.summary()})
          if improved and run.selected_checkpointer is not None:
            run.selected_checkpointer.save(
              step,
              _replica(state, index if replicas else None),
              meta={'step': step, 'tracker': run.tracker.state_dict()},
            )

      if 'checkpoint' in due:
        for index, run in enumerate(runs):
          run.checkpointer.save(
            step,
            _replica(state, index if replicas else None),
            meta={'step': step, 'tracker': run.tracker.state_dict()},
            data_iterator=train_iterator,
          )
        last_checkpoint_step = step
      for run, out in zip(runs, scalars):
        run.writer.write_scalars(step, out)
  except KeyboardInterrupt:
    # Ctrl-C: the checkpoints already saved are complete (the caller waits for pending
    # asynchronous saves); say where a re-run resumes.
    raise errors.StoppedError(completed, last_checkpoint_step) from None
  finally:
    stop.close()

  if start_step >= total_steps:  # Already finished: report without training further.
    for run, results in zip(runs, evaluate_runs(experiment, state)):
      run.last_eval = results
  finals = []
  for run in runs:
    finals.append(
      {'step': total_steps, **run.last_train, **_flatten(run.last_eval), **run.tracker.summary()}
    )
    run.writer.flush()
  return finals


# ------------------------------------------------------------------------------------------------
# Evaluation of a finished (or running) workdir.


def _checkpoint_location(checkpoint: str | int) -> tuple[str, int | None]:
  """(checkpoint folder, step or None for the newest) of 'latest', 'selected' or a step number.

  Raises:
    errors.ConfigError: anything else.
  """
  name = str(checkpoint)
  if name == 'selected':
    return checkpointing.SELECTED_DIR, None
  if name == 'latest':
    return checkpointing.CHECKPOINT_DIR, None
  if name.isdigit():
    return checkpointing.CHECKPOINT_DIR, int(name)
  raise errors.ConfigError(f"checkpoint {name!r} is not 'latest', 'selected' or a step number")


def restore_workdir(workdir: str, checkpoint: str = 'latest') -> tuple[Experiment, TrainState]:
  """Rebuilds a workdir's experiment from its saved config and restores one checkpoint.

  Args:
    workdir: a `train_and_evaluate` workdir (needs config.json and checkpoints/).
    checkpoint: 'latest', 'selected' (the checkpoint chosen on the selection split) or a step.

  Returns:
    `(experiment, state)`: the Experiment of `build_experiment` and the restored TrainState.

  Raises:
    errors.CheckpointNotFoundError: no config.json or no such checkpoint.
    errors.ConfigError: `checkpoint` is neither 'latest', 'selected' nor a step number.
  """
  directory, step = _checkpoint_location(checkpoint)
  workdir = os.path.abspath(workdir)
  config = resolve_config(config_lib.read_config(workdir))
  experiment = build_experiment(config)
  with checkpointing.Checkpointer(
    os.path.join(workdir, directory), keep=None, async_save=False
  ) as checkpointer:
    state, _ = checkpointer.restore(step, experiment.restore_target())
  return experiment, state


def evaluate_workdir(
  workdir: str, splits: tuple[str, ...] | None = None, checkpoint: str = 'latest'
) -> dict[str, dict[str, float]]:
  """Restores a workdir's checkpoint and evaluates splits with its saved config.

  Args:
    workdir: a `train_and_evaluate` workdir (needs config.json and checkpoints/).
    splits: split names; None for the task's eval splits.
    checkpoint: 'latest', 'selected' (the checkpoint chosen on the selection split) or a step.

  Returns:
    `{'checkpoint': checkpoint, 'step': restored step, 'results': split → metric → value}`,
    also written to `workdir/eval.json`.

  Raises:
    errors.CheckpointNotFoundError: no config.json or no such checkpoint.
  """
  workdir = os.path.abspath(workdir)
  experiment, state = restore_workdir(workdir, checkpoint)
  results = evaluate(experiment, state, tuple(splits) if splits else None)
  report = {
    'checkpoint': str(checkpoint),
    'step': int(jax.device_get(state.step)),
    'results': results,
  }
  _write_json(os.path.join(workdir, 'eval.json'), report)
  return report
