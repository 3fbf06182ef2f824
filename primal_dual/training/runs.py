"""What each replica owns on the host: `Runs`, the files and bookkeeping of the models one
`setup.Program` trains.

Each replica is a run in a workdir of its own that looks as if that setting had been trained
alone: `<workdir>/<replica name>` for a sweep's replicas (`sweep.replica_name`), the workdir itself
for a single run, the one-replica case. A run's workdir holds `experiment.json`, `config.json`,
`metrics.jsonl`, `tensorboard/`, `checkpoints/` (and `checkpoints_selected/`) and, once it has
finished, `final_metrics.json`.

`Runs` goes through a training in this order: `finished` (a workdir that already finished is left
as it was), `open` (restore or initialise, write the definitions, drop what a crashed run wrote
after its checkpoint, open the writers), then at the steps `periodic.PeriodicActions` says:
`add_train_metrics` after each call, `log`, `evaluated`, `checkpoint` and `write`, and at the end
`finish`; `close` always (`Runs` is a context manager).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import ml_collections

from primal_dual import atomic
from primal_dual.training import checkpointing
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import evaluation
from primal_dual.training import metrics_logging
from primal_dual.training import selection
from primal_dual.training import workdir as workdir_lib
from primal_dual.training.setup import Program
from primal_dual.training.steps import TrainState

FINAL_METRICS_FILE = "final_metrics.json"

# Calls whose training metrics wait for the next log; more are summed on the host at once (long
# log periods: memory stays bounded).
_MAX_PENDING_METRICS = 500


@dataclasses.dataclass
class _Run:
  """One replica's files and bookkeeping."""

  config: ml_collections.FrozenConfigDict
  workdir: str
  checkpointer: checkpointing.Checkpointer
  tracker: selection.EvalTracker
  selected_checkpointer: checkpointing.Checkpointer | None = None
  writer: metrics_logging.MetricWriter | None = None
  last_train: dict[str, float] = dataclasses.field(default_factory=dict)
  last_eval: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  record: dict[str, float] = dataclasses.field(default_factory=dict)  # this step's scalars

  def checkpoint_meta(self, step: int) -> dict:
    return {"step": step, "tracker": self.tracker.state_dict()}

  def close(self) -> None:
    """Closes the writer and both checkpoint managers, each even if another fails."""
    parts = (self.writer, self.checkpointer, self.selected_checkpointer)
    errors.close_all([part.close for part in parts if part is not None])


def _read_final_metrics(workdir: str) -> dict | None:
  path = os.path.join(workdir, FINAL_METRICS_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _is_main_process() -> bool:
  return jax.process_index() == 0


class Runs:
  """The runs of `program`'s replicas under `workdir`, in the order of `program.replicas`.

  Raises (on construction):
    errors.WorkdirError: a replica's workdir holds another experiment.
  """

  def __init__(self, program: Program, workdir: str):
    self.program, self.workdir = program, workdir
    config = program.config
    self._runs: list[_Run] = []
    for replica in program.replicas:
      run_workdir = os.path.normpath(os.path.join(workdir, replica.name))
      workdir_lib.check_same_experiment(run_workdir, replica.config)
      checkpointer = checkpointing.Checkpointer(
        os.path.join(run_workdir, checkpointing.CHECKPOINT_DIR),
        keep=config.keep_checkpoints,
        async_save=config.async_checkpointing,
      )
      tracker = selection.make_tracker(config, program.task)
      self._runs.append(_Run(replica.config, run_workdir, checkpointer, tracker))
    self.last_checkpoint_step: int | None = None
    self._pending_metrics: list = []
    self._log_clock = (time.monotonic(), 0)  # (time, step) of the last log

  # ----------------------------------------------------------------------------------------------
  # Before training.

  def _start_step(self) -> int | None:
    """The newest checkpoint step every run has (replicas saved together; a kill during a save
    can leave one replica a checkpoint ahead), or None when a run has none."""
    steps = [set(run.checkpointer.all_steps()) for run in self._runs]
    common = set.intersection(*steps)
    if not common:
      if any(steps):
        raise errors.CheckpointNotFoundError(
          f"the replicas under {os.path.dirname(self._runs[0].workdir)} share no checkpoint "
          "step; delete their checkpoints/ folders to start again"
        )
      return None
    return max(common)

  def finished(self) -> dict | None:
    """Every replica's stored final metrics (`combined`) when every run has finished, else None;
    a finished workdir is left as it was."""
    start_step = self._start_step()
    finals = [_read_final_metrics(run.workdir) for run in self._runs]
    if start_step is None or start_step < self.program.total_steps or None in finals:
      return None
    if _is_main_process():
      print(
        f"workdir {self.workdir} already finished at step "
        f"{start_step}; nothing to train, {FINAL_METRICS_FILE} left as it was",
        file=sys.stderr,
      )
    return self.combined(finals)

  def open(self, train_iterator) -> tuple[TrainState, int]:
    """Restores every run from the newest checkpoint they share (state, iterator position,
    tracker), or initialises them; then writes their definitions and configs, drops what a
    crashed run wrote after the checkpoint and opens the writers.

    Returns:
      `(state, start_step)`: the trained state of every replica and the step it is at.
    """
    program, config = self.program, self.program.config
    start_step = self._start_step()
    if config.keep_selected_checkpoint and config.selection.split in program.eval_splits:
      for run in self._runs:
        run.selected_checkpointer = checkpointing.Checkpointer(
          os.path.join(run.workdir, checkpointing.SELECTED_DIR),
          keep=1,
          async_save=config.async_checkpointing,
        )
    if start_step is None:
      start_step, state = 0, program.init()
    else:
      state = self._restore(start_step, train_iterator)
    if _is_main_process() and all(run.workdir != self.workdir for run in self._runs):
      # The sweep's own definition, so that the workdir refuses another sweep (a single run's
      # workdir is its replica's, written below).
      workdir_lib.write_definition(self.workdir, config, start_step)
    for run in self._runs:
      _prepare_workdir(run, start_step)
    self.last_checkpoint_step = start_step or None
    self._log_clock = (time.monotonic(), start_step)
    return state, start_step

  def _restore(self, step: int, train_iterator) -> TrainState:
    states = []
    for run in self._runs:
      state, meta = run.checkpointer.restore(
        step, self.program.restore_target(), data_iterator=train_iterator
      )
      run.tracker.load_state_dict(meta.get("tracker", {}))
      states.append(state)
    if _is_main_process():
      checkpoints = os.path.join(self._runs[0].workdir, checkpointing.CHECKPOINT_DIR)
      print(f"resuming from step {step} (checkpoint in {checkpoints})", flush=True)
    return self.program.stack_replicas(states)

  # ----------------------------------------------------------------------------------------------
  # During training.

  def add_train_metrics(self, metrics) -> None:
    """Keeps one call's training metrics (per-replica (sum, count) pairs) for the next log."""
    self._pending_metrics.append(metrics)
    if len(self._pending_metrics) >= _MAX_PENDING_METRICS:
      self._pending_metrics = [evaluation.sum_metrics(self._pending_metrics)]

  def log(self, step: int) -> None:
    """Each replica's training metrics since the last log, learning rate and speed."""
    now = time.monotonic()
    steps_per_second = (step - self._log_clock[1]) / max(now - self._log_clock[0], 1e-9)
    per_run = evaluation.reduce_runs(self._pending_metrics)
    for run, schedule, reduced in zip(self._runs, self.program.optimizer.schedules, per_run):
      run.last_train = {f"train/{name}": value for name, value in reduced.items()}
      run.last_train["train/learning_rate"] = float(schedule(step - 1))
      run.last_train["train/steps_per_second"] = steps_per_second
      run.record.update(run.last_train)
    self._log_clock = (now, step)
    self._pending_metrics = []

  @property
  def train_loss(self) -> float:
    """The first replica's last logged training loss (for the progress bar)."""
    return self._runs[0].last_train.get("train/loss", float("nan"))

  def evaluated(self, step: int, results: list[dict], state: TrainState) -> None:
    """Records each replica's evaluation `results` at `step`: its tracker, and the selected
    checkpoint when the evaluation is the best so far."""
    for index, (run, result) in enumerate(zip(self._runs, results)):
      run.last_eval = result
      improved = run.tracker.update(step, result)
      run.record.update({**evaluation.flatten_results(result), **run.tracker.summary()})
      if improved and run.selected_checkpointer is not None:
        run.selected_checkpointer.save(
          step, self.program.replica_state(state, index), meta=run.checkpoint_meta(step)
        )

  def checkpoint(self, step: int, state: TrainState, train_iterator) -> None:
    """Saves each replica's state, tracker and the data iterator's position."""
    for index, run in enumerate(self._runs):
      run.checkpointer.save(
        step,
        self.program.replica_state(state, index),
        meta=run.checkpoint_meta(step),
        data_iterator=train_iterator,
      )
    self.last_checkpoint_step = step

  def write(self, step: int) -> None:
    """Writes what each replica logged at `step` as one record (metrics.jsonl, TensorBoard)."""
    for run in self._runs:
      run.writer.write_scalars(step, run.record)
      run.record = {}

  # ----------------------------------------------------------------------------------------------
  # After training.

  def finish(self, num_parameters: int, results: list[dict] | None = None) -> dict:
    """Writes each replica's final metrics (`final_metrics.json`) and returns them `combined`.

    Args:
      num_parameters: the model's parameter count.
      results: an evaluation of every replica in place of the last one (a run whose checkpoint
        was already at the end reports without training).
    """
    finals = []
    for index, run in enumerate(self._runs):
      if results is not None:
        run.last_eval = results[index]
      run.writer.flush()
      final = {
        "step": self.program.total_steps,
        **run.last_train,
        **evaluation.flatten_results(run.last_eval),
        **run.tracker.summary(),
      }
      if run.tracker.selected_step is not None:
        final["selected/rule"] = run.tracker.rule
      final["model/num_parameters"] = num_parameters
      if _is_main_process():
        atomic.write_json(os.path.join(run.workdir, FINAL_METRICS_FILE), final)
      finals.append(final)
    return self.combined(finals)

  def combined(self, finals: list[dict]) -> dict:
    """Every replica's final metrics under `<replica name>/`; a single run's (no name) as is."""
    return {
      "/".join(filter(None, (replica.name, name))): value
      for replica, final in zip(self.program.replicas, finals)
      for name, value in final.items()
    }

  def close(self, pending: BaseException | None = None) -> None:
    """Closes every run's files, each even if another fails (`errors.close_all`: a checkpoint
    manager re-raises its failed background save, which must not hide `pending`, the error
    already ending the run)."""
    errors.close_all([run.close for run in self._runs], pending=pending)

  def __enter__(self) -> "Runs":
    return self

  def __exit__(self, exc_type, exc, traceback) -> None:
    self.close(pending=exc)


def _prepare_workdir(run: _Run, start_step: int) -> None:
  """Writes the run's definition and config, drops what a crashed run wrote after `start_step`
  (it will be redone) and opens its writer."""
  # Only now, with the checkpoint restored or the state initialised, is the config known to
  # fit the workdir's checkpoints: a failed restore leaves the previous config.json in place.
  if _is_main_process():
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
  metrics_logging.truncate_metrics_after(run.workdir, start_step)
  for manager in (run.checkpointer, run.selected_checkpointer):
    if manager is not None:
      manager.delete_after(start_step)
  # TensorBoard hides what the crashed run logged after the checkpoint (written again).
  run.writer = metrics_logging.MetricWriter(
    run.workdir, purge_step=start_step + 1 if start_step else None
  )
