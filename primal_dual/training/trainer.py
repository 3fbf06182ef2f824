"""The training loop: `train_and_evaluate(config, workdir)`.

Usable from the command line (`train.py`, `eval.py`) and from a notebook::

  from primal_dual.training import config_lib, trainer
  config = config_lib.training_defaults()
  config.task, config.num_train_steps = 'synthetic', 100
  final = trainer.train_and_evaluate(config, '/tmp/run')   # {'test/accuracy': ..., ...}

What one run does:

1. Fills the config's missing fields from `config_lib.training_defaults()` and freezes it; refuses
   a workdir that holds another experiment or that another live process uses (`workdir.py`).
2. Builds the `setup.Program` every replica shares: the task's data and model, a
   `('data', 'model')` mesh, the optimizer, and the jitted K-step and evaluation programs with
   their shardings (`sharding.py`); and the `runs.Runs`, what each replica owns on the host.
3. Resumes from the newest checkpoint in `workdir/checkpoints` if there is one (state, data
   iterator position, evaluation tracker; one that fails to restore is moved aside and the one
   before it used, `runs.Runs.open`), else initialises from `config.seed`; only then writes
   `workdir/experiment.json` and `workdir/config.json`. A workdir that already finished is
   reported as such and left untouched.
4. Trains to `config.num_train_steps` (or `config.num_epochs` × steps per epoch), with logging,
   evaluation and checkpointing decided by `periodic.PeriodicActions` (all happen after the final
   step). A non-finite loss raises `errors.NonFiniteLossError` naming the step; no checkpoint is
   written from that point, so the last good one stays. Ctrl-C (SIGINT) and SIGTERM stop it
   after the call in flight (`_StopRequest`): Ctrl-C raises `errors.StoppedError`; SIGTERM (a
   pre-empted VM, SLURM, `docker stop`) first saves a checkpoint of the step reached and raises
   `errors.PreemptedError`.
5. Returns the final metrics: `'{split}/{metric}'` of the last evaluation, `'train/{metric}'` of
   the last log, and from the evaluation tracker `'best/{split}_{metric}'` (best value of the
   selection metric over all evaluations: the optimistic "best test accuracy over epochs" of
   the UEA tables) and `'selected/{split}_{metric}'` (every split's metrics at the evaluation where
   `config.selection.split` was best: the clean protocol; ties go to the lower loss on that split,
   then to the later step), plus `'selected/step'` and the rule in words, `'selected/rule'`.

A sweep (`config.sweep`; `sweep.py`, docs/training.md) trains its replicas as one program, each
as the run above in its own sub-workdir `workdir/<replica name>`, and returns every replica's
final metrics under `'<replica name>/'`. A single run is the one-replica case: the replica axis
is then absent (`setup.ReplicaAxis`), so its program is that of earlier versions.

Per-step randomness is `fold_in(state.rng, state.step)`, so a resumed run reproduces an
uninterrupted one exactly.

The pieces live in their own modules: `steps` (the pure train/eval steps), `setup` (config
resolution, `build_program`), `runs` (each replica's files and bookkeeping), `selection`
(`EvalTracker`), `evaluation` (metrics over whole splits, `evaluate_workdir`); this module is the
loop.
"""

import contextlib
import itertools
import os
import signal
import threading
from typing import NoReturn

import jax
import ml_collections
import numpy as np

from primal_dual.models import parameter_count
from primal_dual.training import checkpointing
from primal_dual.training import errors
from primal_dual.training import evaluation
from primal_dual.training import metrics_logging
from primal_dual.training import periodic
from primal_dual.training import selection
from primal_dual.training import workdir as workdir_lib
from primal_dual.training.runs import FINAL_METRICS_FILE, Runs
from primal_dual.training.setup import Program, build_program, resolve_config
from primal_dual.training.steps import TrainState

__all__ = ["FINAL_METRICS_FILE", "train_and_evaluate"]


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
      a busy workdir, Ctrl-C (`errors.StoppedError`), SIGTERM (`errors.PreemptedError`, after
      saving a checkpoint), a damaged workdir file (`errors.DamagedFileError`) or no checkpoint
      that restores (`errors.DamagedCheckpointError`), a full disk (`errors.DiskFullError`).
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


def _train_in_workdir(config: ml_collections.FrozenConfigDict, workdir: str) -> dict[str, float]:
  """`train_and_evaluate` once the workdir is locked and known to hold this experiment."""
  program = build_program(config)
  num_parameters = parameter_count(program.abstract_state.params)
  if jax.process_index() == 0:
    print(
      f"model: {num_parameters:,} parameters ({config.task}, "
      f"attention={config.model.get('attention', '-')})",
      flush=True,
    )
  # Checked before anything is written: a selection metric the task does not report would
  # silently leave out every best/ and selected/ number.
  selection.selection_metric_and_mode(config, program.task, evaluation.reported_metrics(program))
  with Runs(program, workdir) as runs:  # closed even after an error, which it keeps
    finished = runs.finished()
    if finished is not None:
      return finished
    train_iterator = program.make_train_iterator()
    state, start_step = runs.open(train_iterator)
    total_steps = program.total_steps
    progress = metrics_logging.ProgressBar(
      total_steps, min(start_step, total_steps), enabled=config.progress_bar
    )
    try:
      state = _train_loop(program, runs, state, start_step, train_iterator, progress)
    finally:
      progress.close()
    # A checkpoint already at the end (the run stopped before its final metrics): report it.
    results = evaluation.evaluate_runs(program, state) if start_step >= total_steps else None
    return runs.finish(num_parameters, results)


def _train_loop(
  program: Program,
  runs: Runs,
  state: TrainState,
  start_step: int,
  train_iterator,
  progress: metrics_logging.ProgressBar,
) -> TrainState:
  """Trains every replica from `start_step` to the end, K steps a call; logs, evaluates and
  checkpoints between calls when `periodic.PeriodicActions` says so. Returns the final state.

  One call is in flight at a time: the next is dispatched once the previous one's losses are
  checked, so a stop request (`_StopRequest`) waits for at most the call running when it came.
  The host still works while a call runs: it reads the next call's training examples then
  (`_ReadAhead`).
  """
  total_steps = program.total_steps
  steps_per_call = program.run_steps.steps_per_call
  actions = periodic.PeriodicActions(total_steps, every=program.length.periods)
  examples = _ReadAhead(train_iterator)
  completed = start_step
  stop = _StopRequest()
  try:
    while completed < total_steps:
      stopped_by = stop.agreed()
      if stopped_by is not None:
        _stop(stopped_by, completed, runs, state, examples, train_iterator)
      num_steps = min(steps_per_call, total_steps - completed)
      state, losses, metrics = program.run_steps(state, num_steps, examples.take())
      reached = completed + num_steps
      # A checkpoint saves the iterator's position: none is read past it before one.
      if reached < total_steps and not actions.is_due("checkpoint", reached):
        examples.read_ahead(min(steps_per_call, total_steps - reached), stop)
      _check_finite(completed + 1, losses, runs.last_checkpoint_step)  # waits for the call
      runs.add_train_metrics(metrics)
      completed = reached
      progress.update(num_steps)
      due = actions.due(completed)
      if "log" in due:
        runs.log(completed)
        progress.update(0, loss=runs.train_loss)
      if "eval" in due:
        runs.evaluated(completed, evaluation.evaluate_runs(program, state), state)
      if due:
        # The record first: a checkpoint at this step then implies its record is on disk (a run
        # killed during the save, as lease 5's was, resumes past a step it had not written).
        runs.write(completed)
      if "checkpoint" in due:
        runs.checkpoint(completed, state, train_iterator)
  except KeyboardInterrupt:
    # A second Ctrl-C: the checkpoints already saved are complete (closing the runs waits for
    # pending asynchronous saves); say where a re-run resumes.
    raise errors.StoppedError(completed, runs.last_checkpoint_step) from None
  finally:
    stop.close()
  return state


def _stop(
  signum: int, completed: int, runs: Runs, state: TrainState, examples, train_iterator
) -> NoReturn:
  """Ends training at `completed` for the signal every process agreed on: SIGTERM saves a
  checkpoint of that step first (its record is already written: records come before actions)."""
  if signum != signal.SIGTERM:
    raise errors.StoppedError(completed, runs.last_checkpoint_step)
  if completed > (runs.last_checkpoint_step or 0):
    examples.rewind()  # the checkpoint keeps the position after the last step trained
    runs.checkpoint(completed, state, train_iterator)
  # Closing the runs (on the way out) waits for the save.
  raise errors.PreemptedError(completed, runs.last_checkpoint_step)


class _ReadAhead:
  """The training iterator, with the next call's examples read while the current call runs.

  `take()` gives `run_steps` the examples read ahead, then the iterator; `rewind` puts the
  iterator back to where it was before a read-ahead that no call took (a stop before it). A stop
  request ends a read-ahead early (reading K batches can take as long as the call). None
  (batches made on the device) reads nothing.
  """

  def __init__(self, iterator):
    self._iterator = iterator
    self._examples: list = []
    self._position = None

  def read_ahead(self, num_steps: int, stop: "_StopRequest") -> None:
    if self._iterator is None:
      return
    self._position = self._iterator.get_state()
    for _ in range(num_steps):
      if stop.received:  # every process stops before the next call (`_StopRequest.agreed`)
        break
      self._examples.append(next(self._iterator))

  def take(self):
    """The training examples from the next on, for `run_steps`."""
    if self._iterator is None:
      return None
    examples, self._examples, self._position = self._examples, [], None
    return itertools.chain(examples, self._iterator)

  def rewind(self) -> None:
    if self._position is not None:
      self._iterator.set_state(self._position)
    self._examples, self._position = [], None


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


class _StopRequest:
  """Turns the first Ctrl-C (SIGINT) or SIGTERM during training into a request to stop between
  calls.

  A KeyboardInterrupt raised wherever the main thread happens to be (inside Orbax waiting for a
  checkpoint to finalise, inside grain) prints those libraries' tracebacks and can cut a save
  short; the training loop instead asks `agreed` before each call. A second signal of the same
  kind acts at once (Ctrl-C: KeyboardInterrupt; SIGTERM: the default, the process ends). Outside
  the main thread (where signal handlers cannot be set) this does nothing.
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.received: set[int] = set()
    self._previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._request)

  def _restore_previous_handler(self, signum: int) -> None:
    previous = self._previous.pop(signum, None)
    if previous is None:
      # Not set from Python (or a C library's, e.g. JAX's pre-emption notifier): Python's own.
      previous = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    signal.signal(signum, previous)

  def _request(self, signum, frame):
    self.received.add(signum)
    self._restore_previous_handler(signum)  # the next one acts at once

  def agreed(self) -> int | None:
    """SIGTERM if any process received it, else SIGINT if any received that, else None: the same
    answer on every process, so that all stop after the same call and save the same step. Several
    processes agree through one all-gather of a flag per call; one process asks nobody."""
    interrupted, terminated = checkpointing.true_on_any_process(
      [signum in self.received for signum in self.SIGNALS]
    )
    if terminated:
      return signal.SIGTERM
    return signal.SIGINT if interrupted else None

  def close(self) -> None:
    """Puts the previous handlers back."""
    for signum in list(self._previous):
      self._restore_previous_handler(signum)
