"""The training loop: `train_and_evaluate(config, workdir)`.

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

A sweep (`config.sweep`, `config.seeds`; `sweep.py`, docs/training.md) trains its replicas as one
program, each as the run above in its own sub-workdir `workdir/<replica name>`, and returns every
replica's final metrics under `'<replica name>/'`. A single run is the one-replica case: the
replica axis is then absent (`setup.ReplicaAxis`), so its program is that of earlier versions.

Per-step randomness is `fold_in(state.rng, state.step)`, so a resumed run reproduces an
uninterrupted one exactly.

The pieces live in their own modules: `steps` (the pure train/eval steps), `setup` (config
resolution, `build_experiment`), `selection` (`EvalTracker`), `evaluation` (metrics over whole
splits, `evaluate_workdir`); this module is the loop and the workdir's bookkeeping.
"""

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time

import jax
import ml_collections
import numpy as np

from primal_dual import atomic
from primal_dual.models import parameter_count
from primal_dual.training import checkpointing
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import evaluation
from primal_dual.training import metrics_logging
from primal_dual.training import periodic
from primal_dual.training import selection
from primal_dual.training import workdir as workdir_lib
from primal_dual.training.setup import Experiment, build_experiment, resolve_config
from primal_dual.training.steps import TrainState

FINAL_METRICS_FILE = "final_metrics.json"


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
    except Exception as e:
      if errors.is_disk_full(e):
        raise errors.DiskFullError(workdir) from e
      raise


def _workdir_lock(workdir: str):
  """The workdir's lock on process 0; processes of one multi-process run share the workdir."""
  if jax.process_index() != 0:
    return contextlib.nullcontext()
  return workdir_lib.WorkdirLock(workdir)


def _read_final_metrics(workdir: str) -> dict | None:
  path = os.path.join(workdir, FINAL_METRICS_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


@dataclasses.dataclass
class _Run:
  """The files and bookkeeping of one trained model, a replica: the whole run, or one replica of
  a sweep (then in `<workdir>/<replica name>`, a workdir of its own that looks as if that setting
  had been trained alone)."""

  config: ml_collections.FrozenConfigDict
  workdir: str
  checkpointer: checkpointing.Checkpointer
  selected_checkpointer: checkpointing.Checkpointer | None = None
  tracker: selection.EvalTracker | None = None
  writer: metrics_logging.MetricWriter | None = None
  last_train: dict[str, float] = dataclasses.field(default_factory=dict)
  last_eval: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

  def close(self) -> None:
    """Closes the writer and both checkpoint managers, each even if another fails."""
    parts = (self.writer, self.checkpointer, self.selected_checkpointer)
    errors.close_all([part.close for part in parts if part is not None])


def _runs_of(experiment: Experiment, workdir: str) -> list[_Run]:
  """One `_Run` per replica, in `<workdir>/<replica name>` (a single run: the workdir itself)."""
  runs = []
  for replica in experiment.replicas:
    run_workdir = os.path.normpath(os.path.join(workdir, replica.name))
    workdir_lib.check_same_experiment(run_workdir, replica.config)
    runs.append(
      _Run(
        replica.config,
        run_workdir,
        checkpointing.Checkpointer(
          os.path.join(run_workdir, checkpointing.CHECKPOINT_DIR),
          keep=experiment.config.keep_checkpoints,
          async_save=experiment.config.async_checkpointing,
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
        f"the replicas under {os.path.dirname(runs[0].workdir)} share no checkpoint step; "
        "delete their checkpoints/ folders to start again"
      )
    return None
  return max(common)


def _train_in_workdir(config: ml_collections.FrozenConfigDict, workdir: str) -> dict[str, float]:
  """`train_and_evaluate` once the workdir is locked and known to hold this experiment."""
  experiment = build_experiment(config)
  num_parameters = parameter_count(experiment.abstract_state.params)
  if jax.process_index() == 0:
    print(
      f"model: {num_parameters:,} parameters ({config.task}, "
      f"attention={config.model.get('attention', '-')})",
      flush=True,
    )
  # Checked before anything is written: a selection metric the task does not report would
  # silently leave out every best/ and selected/ number.
  selection.selection_metric_and_mode(
    config, experiment.task, evaluation.reported_metrics(experiment)
  )
  runs = _runs_of(experiment, workdir)
  closers = [run.close for run in runs]
  try:
    final = _train_runs(experiment, workdir, runs, num_parameters)
  except BaseException as e:
    errors.close_all(closers, pending=e)  # a failed save re-raised on closing hides e
    raise
  errors.close_all(closers)
  return final


def _train_runs(
  experiment: Experiment, workdir: str, runs: list[_Run], num_parameters: int
) -> dict:
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
        f"workdir {workdir} already finished at step "
        f"{start_step}; nothing to train, {FINAL_METRICS_FILE} left as it was",
        file=sys.stderr,
      )
    return _combined(experiment, finished)

  for run in runs:
    if config.keep_selected_checkpoint and config.selection.split in experiment.eval_splits:
      run.selected_checkpointer = checkpointing.Checkpointer(
        os.path.join(run.workdir, checkpointing.SELECTED_DIR),
        keep=1,
        async_save=config.async_checkpointing,
      )
    run.tracker = selection.make_tracker(config, experiment.task)
  train_iterator = experiment.make_train_iterator()

  if start_step is None:
    start_step, state = 0, experiment.init_replicas()
  else:
    states = []
    for run in runs:
      run_state, meta = run.checkpointer.restore(
        start_step, experiment.restore_target(), data_iterator=train_iterator
      )
      run.tracker.load_state_dict(meta.get("tracker", {}))
      states.append(run_state)
    state = experiment.stack_replicas(states)
    if jax.process_index() == 0:
      print(
        f"resuming from step {start_step} (checkpoint in "
        f"{os.path.join(runs[0].workdir, checkpointing.CHECKPOINT_DIR)})",
        flush=True,
      )
  if jax.process_index() == 0 and all(run.workdir != workdir for run in runs):
    # The sweep's own definition, so that the workdir refuses another sweep (a single run's
    # workdir is its replica's, written below).
    workdir_lib.write_definition(workdir, config, start_step)
  for run in runs:
    # Only now, with the checkpoint restored or the state initialised, is the config known to
    # fit the workdir's checkpoints: a failed restore leaves the previous config.json in place.
    if jax.process_index() == 0:
      os.makedirs(run.workdir, exist_ok=True)
      changes = workdir_lib.write_definition(run.workdir, run.config, start_step)
      if changes:
        described = "; ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changes.items())
        print(
          f"continuing {run.workdir} from step {start_step} with changed optimizer settings: "
          f"{described} (recorded in {workdir_lib.EXPERIMENT_FILE})",
          flush=True,
        )
      config_lib.write_config(run.config, run.workdir)
    # Whatever a crashed run wrote after its last checkpoint will be redone: drop it.
    metrics_logging.truncate_metrics_after(run.workdir, start_step)
    for manager in (run.checkpointer, run.selected_checkpointer):
      if manager is not None:
        manager.delete_after(start_step)
    # TensorBoard hides what the crashed run logged after the checkpoint (written again).
    run.writer = metrics_logging.MetricWriter(
      run.workdir, purge_step=start_step + 1 if start_step else None
    )

  progress = metrics_logging.ProgressBar(
    experiment.total_steps, min(start_step, experiment.total_steps), enabled=config.progress_bar
  )
  try:
    finals = _train_loop(experiment, state, start_step, train_iterator, runs, progress)
  finally:
    progress.close()
  for run, final in zip(runs, finals):
    if run.tracker.selected_step is not None:
      final["selected/rule"] = run.tracker.rule
    final["model/num_parameters"] = num_parameters
    if jax.process_index() == 0:
      atomic.write_json(os.path.join(run.workdir, FINAL_METRICS_FILE), final)
  return _combined(experiment, finals)


def _combined(experiment: Experiment, finals: list[dict]) -> dict:
  """Every replica's final metrics under `<replica name>/`; a single run's (no name) as they are."""
  return {
    "/".join(filter(None, (replica.name, name))): value
    for replica, final in zip(experiment.replicas, finals)
    for name, value in final.items()
  }


def _check_finite(first_step: int, losses: jax.Array, last_checkpoint_step: int | None) -> None:
  """Raises for the first step with a non-finite loss; `losses` `[replicas, steps]` (`[steps]` for
  a single run) are those of steps `first_step, …`."""
  per_step = np.atleast_2d(np.asarray(jax.device_get(losses), np.float64))
  finite = np.isfinite(per_step)
  bad = np.flatnonzero(~finite.all(axis=0))
  if bad.size:
    column = per_step[:, bad[0]]
    raise errors.NonFiniteLossError(
      first_step + int(bad[0]), float(column[~finite[:, bad[0]]][0]), last_checkpoint_step
    )


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

  def _request(self, signum, frame):
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
        pending_metrics = [evaluation.sum_metrics(pending_metrics, replicas=True)]
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

      if "log" in due:
        now = time.monotonic()
        per_run = evaluation.reduce_runs(pending_metrics)
        schedules = experiment.optimizer.schedules
        for run, schedule, reduced, out in zip(runs, schedules, per_run, scalars):
          run.last_train = {f"train/{k}": v for k, v in reduced.items()}
          run.last_train["train/learning_rate"] = float(schedule(step - 1))
          run.last_train["train/steps_per_second"] = (step - log_clock[1]) / max(
            now - log_clock[0], 1e-9
          )
          out.update(run.last_train)
        log_clock = (now, step)
        pending_metrics = []
        progress.update(0, loss=runs[0].last_train.get("train/loss", float("nan")))

      if "eval" in due:
        for index, (run, results, out) in enumerate(
          zip(runs, evaluation.evaluate_runs(experiment, state), scalars)
        ):
          run.last_eval = results
          improved = run.tracker.update(step, results)
          out.update({**evaluation.flatten_results(results), **run.tracker.summary()})
          if improved and run.selected_checkpointer is not None:
            run.selected_checkpointer.save(
              step,
              experiment.replica_state(state, index),
              meta={"step": step, "tracker": run.tracker.state_dict()},
            )

      if "checkpoint" in due:
        for index, run in enumerate(runs):
          run.checkpointer.save(
            step,
            experiment.replica_state(state, index),
            meta={"step": step, "tracker": run.tracker.state_dict()},
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
    for run, results in zip(runs, evaluation.evaluate_runs(experiment, state)):
      run.last_eval = results
  finals = []
  for run in runs:
    finals.append(
      {
        "step": total_steps,
        **run.last_train,
        **evaluation.flatten_results(run.last_eval),
        **run.tracker.summary(),
      }
    )
    run.writer.flush()
  return finals
