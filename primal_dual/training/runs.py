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

A checkpoint that fails to restore is moved aside and the newest step every replica has intact
resumes (`checkpointing.restore_newest_intact`), in one line per damaged checkpoint; another
damaged file of a run's workdir (`final_metrics.json`, `metrics.jsonl`) is one
`errors.DamagedFileError` naming it and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np

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

# Checkpoint meta key of the training metrics summed since the last log: a run resumed from a
# checkpoint between two logs then logs the same means as one that never stopped.
_UNLOGGED_METRICS = "train_metrics_since_log"


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
  """The run's `final_metrics.json`, None if there is none.

  Raises:
    errors.DamagedFileError: it is not a JSON object.
  """
  path = os.path.join(workdir, FINAL_METRICS_FILE)
  if not os.path.exists(path):
    return None
  return errors.read_json_object(
    path,
    "delete it and re-run the same command: the final metrics are computed again from the "
    "last checkpoint",
  )


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

  def _common_steps(self) -> list[int]:
    """The checkpoint steps every run has (replicas saved together; a kill during a save can
    leave one replica a checkpoint ahead), oldest first; [] when a run has none."""
    steps = [set(run.checkpointer.all_steps()) for run in self._runs]
    common = set.intersection(*steps)
    if not common and any(steps):
      raise errors.CheckpointNotFoundError(
        f"the replicas under {os.path.dirname(self._runs[0].workdir)} share no checkpoint "
        "step; delete their checkpoints/ folders to start again"
      )
    return sorted(common)

  def finished(self) -> dict | None:
    """Every replica's stored final metrics (`combined`) when every run has finished, else None;
    a finished workdir is left as it was."""
    steps = self._common_steps()
    if not steps or steps[-1] < self.program.total_steps:
      return None
    start_step = steps[-1]
    finals = [_read_final_metrics(run.workdir) for run in self._runs]
    if None in finals:
      return None
    if _is_main_process():
      print(
        f"workdir {self.workdir} already finished at step "
        f"{start_step}; nothing to train, {FINAL_METRICS_FILE} left as it was",
        file=sys.stderr,
      )
    return self.combined(finals)

  def open(self, train_iterator) -> tuple[TrainState, int]:
    """Restores every run from the newest checkpoint they share intact (state, iterator
    position, tracker; a damaged newer one is moved aside), or initialises them; then writes
    their definitions and configs, drops what a crashed run wrote after the checkpoint and opens
    the writers.

    Returns:
      `(state, start_step)`: the trained state of every replica and the step it is at.

    Raises:
      errors.DamagedCheckpointError: no shared checkpoint restores.
      errors.DamagedFileError: a run's `metrics.jsonl` or `experiment.json` is damaged.
    """
    program, config = self.program, self.program.config
    steps = self._common_steps()
    if config.keep_selected_checkpoint and config.selection.split in program.eval_splits:
      for run in self._runs:
        run.selected_checkpointer = checkpointing.Checkpointer(
          os.path.join(run.workdir, checkpointing.SELECTED_DIR),
          keep=1,
          async_save=config.async_checkpointing,
        )
    if not steps:
      start_step, state = 0, program.init()
    else:
      start_step, state = self._restore(steps, train_iterator)
    if _is_main_process() and all(run.workdir != self.workdir for run in self._runs):
      # The sweep's own definition, so that the workdir refuses another sweep (a single run's
      # workdir is its replica's, written below).
      workdir_lib.write_definition(self.workdir, config, start_step)
    for run in self._runs:
      _prepare_workdir(run, start_step)
    self.last_checkpoint_step = start_step or None
    self._log_clock = (time.monotonic(), start_step)
    return state, start_step

  def _restore(self, steps: list[int], train_iterator) -> tuple[int, TrainState]:
    """Restores every run from the newest of `steps` they all restore (state, iterator position,
    tracker, training metrics not yet logged); each newer checkpoint that failed is moved aside
    and reported in one line. Returns `(step, stacked state)`.

    Raises:
      errors.DamagedCheckpointError: none of `steps` restores.
    """

    def restore(checkpointer, step):
      return checkpointer.restore(step, self.program.restore_target(), data_iterator=train_iterator)

    checkpointers = [run.checkpointer for run in self._runs]
    step, restored, failed = checkpointing.restore_newest_intact(
      checkpointers,
      steps,
      restore,
      what_to_do="copy the workdir again if it is an interrupted copy, or move the checkpoints/ "
      "folder aside to start again from step 0",
    )
    intact = "the newest intact one" if len(self._runs) == 1 else "the newest every replica has"
    for unrestorable in failed:
      moved = checkpointers[unrestorable.index].move_aside(unrestorable.step)
      if _is_main_process():
        print(
          f"warning: checkpoint step {unrestorable.step} in {unrestorable.directory} cannot be "
          f"restored ({unrestorable.cause}); moved it to {moved}; resuming from step {step}, "
          f"{intact}",
          file=sys.stderr,
          flush=True,
        )
    metas = [meta for _, meta in restored]
    for run, meta in zip(self._runs, metas):
      run.tracker.load_state_dict(meta.get("tracker", {}))
    if all(_UNLOGGED_METRICS in meta for meta in metas):
      self._pending_metrics = [_stacked_metric_sums([meta[_UNLOGGED_METRICS] for meta in metas])]
    if _is_main_process():
      checkpoints = os.path.join(self._runs[0].workdir, checkpointing.CHECKPOINT_DIR)
      print(f"resuming from step {step} (checkpoint in {checkpoints})", flush=True)
    return step, self.program.stack_replicas([state for state, _ in restored])

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
    """Saves each replica's state, tracker, training metrics not yet logged and the data
    iterator's position."""
    unlogged = None
    if self._pending_metrics:
      # Summed once on the host (float64, in call order, as `log` would): the resumed run adds
      # the next calls to the same sums.
      totals = evaluation.sum_metrics(self._pending_metrics)
      self._pending_metrics = [totals]
      unlogged = {name: (total.tolist(), count.tolist()) for name, (total, count) in totals.items()}
    for index, run in enumerate(self._runs):
      meta = run.checkpoint_meta(step)
      if unlogged is not None:
        meta[_UNLOGGED_METRICS] = {
          name: [total[index], count[index]] for name, (total, count) in unlogged.items()
        }
      run.checkpointer.save(
        step, self.program.replica_state(state, index), meta=meta, data_iterator=train_iterator
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


def _stacked_metric_sums(per_run: list[dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Each run's `{name: [sum, count]}` from its checkpoint → `{name: (sums [R], counts [R])}`,
  the form `evaluation.sum_metrics` adds up."""
  return {
    name: tuple(np.asarray([sums[name][part] for sums in per_run], np.float64) for part in (0, 1))
    for name in per_run[0]
  }


def _truncate_metrics_after(run: _Run, start_step: int) -> None:
  """`metrics_logging.truncate_metrics_after`, with a damaged `metrics.jsonl` reported as one
  error naming its first bad line."""
  try:
    metrics_logging.truncate_metrics_after(run.workdir, start_step)
  except ValueError:
    path = os.path.join(run.workdir, metrics_logging.METRICS_FILE)
    with open(path) as f:
      for number, line in enumerate(f, 1):
        try:
          if line.strip():
            json.loads(line)
        except ValueError as e:
          raise errors.DamagedFileError(
            path,
            f"line {number}: {errors.describe(e)}",
            "delete that line (or move the file aside) and re-run the same command; the "
            "checkpoints are intact",
          ) from None
    raise


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
  _truncate_metrics_after(run, start_step)
  for manager in (run.checkpointer, run.selected_checkpointer):
    if manager is not None:
      manager.delete_after(start_step)
  # TensorBoard hides what the crashed run logged after the checkpoint (written again).
  run.writer = metrics_logging.MetricWriter(
    run.workdir, purge_step=start_step + 1 if start_step else None
  )
