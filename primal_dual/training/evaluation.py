"""Evaluation: metrics of a state on whole splits (`evaluate`, `evaluate_runs`), the host-side
reduction of per-batch `(sum, count)` metrics, and the evaluation of a saved workdir
(`restore_workdir`, `evaluate_workdir`), which never builds the training split."""

import functools
import os
import sys
from typing import Mapping, TypedDict

import jax
import numpy as np

from primal_dual import atomic
from primal_dual.training import checkpointing
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import steps
from primal_dual.training import workdir as workdir_lib
from primal_dual.training.setup import Program, build_program, resolve_config
from primal_dual.training.steps import TrainState

EVAL_FILE = "eval.json"
# A run training in the workdir deletes its older checkpoints as it saves new ones, so a reader
# may list a step that is gone a moment later: it reads the folder again, this many times at most.
RESTORE_ATTEMPTS = 5


def sum_metrics(metric_list: list[Mapping[str, tuple]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Adds up per-batch (sum, count) dicts on the host (one device-to-host transfer), in float64:
  `[R]` arrays, one entry per replica (a single run's `[]` metrics count as `[1]`:
  `setup.ReplicaAxis`)."""
  totals = {}
  for metrics in jax.device_get(metric_list):
    for name, (total, count) in metrics.items():
      total, count = (np.atleast_1d(np.asarray(x, np.float64)) for x in (total, count))
      if name in totals:
        total, count = totals[name][0] + total, totals[name][1] + count
      totals[name] = (total, count)
  return totals


def split_means(totals: Mapping[str, tuple[float, float]]) -> dict[str, float]:
  """Σ sums / Σ counts of each metric (NaN where nothing was counted)."""
  return {
    name: float(total) / float(count) if count else float("nan")
    for name, (total, count) in totals.items()
  }


def reduce_runs(metric_list: list[Mapping[str, tuple]]) -> list[dict[str, float]]:
  """Σ sums / Σ counts of per-batch (sum, count) pairs `[R]`: one dict per replica."""
  totals = sum_metrics(metric_list)
  num = len(next(iter(totals.values()))[0]) if totals else 0
  return [split_means({name: (t[i], c[i]) for name, (t, c) in totals.items()}) for i in range(num)]


def reduce_metrics(metric_list: list[Mapping[str, tuple]]) -> dict[str, float]:
  """`reduce_runs` of one replica's per-batch (sum, count) dicts ({} for none)."""
  (means,) = reduce_runs(metric_list) or [{}]
  return means


def evaluate_runs(
  program: Program, state: TrainState, split_names: tuple[str, ...] | None = None
) -> list[dict[str, dict[str, float]]]:
  """`evaluate` of every replica of the trained state (`Program.replica_axis`): one result
  each."""
  per_split = {}
  for split in split_names or program.eval_splits:
    if split not in program.splits:
      raise errors.ConfigError(f"unknown split {split!r}; the task has {sorted(program.splits)}")
    per_batch = [
      program.eval_step(state, program.place_eval_batch(batch))
      for batch in program.eval_batches(split)
    ]
    per_split[split] = reduce_runs(per_batch)
  return [
    {split: runs[i] for split, runs in per_split.items()} for i in range(len(program.replicas))
  ]


def evaluate(
  program: Program, state: TrainState, split_names: tuple[str, ...] | None = None
) -> dict[str, dict[str, float]]:
  """Metrics of `state` on whole splits (every example exactly once).

  Args:
    program: a single run's (one replica).
    state: its state, unstacked (as restored from a checkpoint).

  Returns:
    split → metric name → mean over the split's examples.
  """
  return evaluate_runs(program, program.stack_replicas([state]), split_names)[0]


def reported_metrics(program: Program) -> frozenset[str]:
  """The metric names an evaluation of `program` reports (per split), found by tracing the
  eval step on one batch of the first evaluation split (nothing is compiled or run)."""
  splits = program.eval_splits or (program.config.selection.split,)
  batch = next(iter(program.eval_batches(splits[0], group=0)))
  evaluate_one = functools.partial(
    steps.eval_step, model=program.model, loss_fn=program.task.loss_and_metrics
  )
  return frozenset(jax.eval_shape(evaluate_one, program.abstract_state, batch))


def flatten_results(results: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
  """split → metric → value as `{'split/metric': value}`."""
  return {
    f"{split}/{name}": value
    for split, metrics in results.items()
    for name, value in metrics.items()
  }


def _checkpoint_location(checkpoint: str | int) -> tuple[str, int | None]:
  """(checkpoint folder, step or None for the newest) of 'latest', 'selected' or a step number.

  Raises:
    errors.ConfigError: anything else.
  """
  name = str(checkpoint)
  if name == "selected":
    return checkpointing.SELECTED_DIR, None
  if name == "latest":
    return checkpointing.CHECKPOINT_DIR, None
  if name.isdigit():
    return checkpointing.CHECKPOINT_DIR, int(name)
  raise errors.ConfigError(f"checkpoint {name!r} is not 'latest', 'selected' or a step number")


def _refuse_sweep_workdir(workdir: str) -> None:
  """A sweep's workdir (`config.sweep`) holds one workdir per replica (`lr=0.001,seed=0/`, `seed=0/`, ...) and no
  config of its own: say which folders to evaluate instead of "config.json not found".

  Raises:
    errors.WorkdirError: `workdir` has no config.json but sub-workdirs that have one.
  """
  if os.path.exists(os.path.join(workdir, "config.json")) or not os.path.isdir(workdir):
    return
  replicas = sorted(
    name
    for name in os.listdir(workdir)
    if os.path.exists(os.path.join(workdir, name, "config.json"))
  )
  if replicas:
    raise errors.WorkdirError(
      f"workdir {workdir} holds one run per replica ({', '.join(replicas)}); evaluate one of "
      f"them, e.g. --workdir={os.path.join(workdir, replicas[0])}"
    )


def restore_workdir(workdir: str, checkpoint: str = "latest") -> tuple[Program, TrainState]:
  """Rebuilds a workdir's program from its saved config and restores one checkpoint.

  Args:
    workdir: a `train_and_evaluate` workdir (needs config.json and checkpoints/).
    checkpoint: 'latest', 'selected' (the checkpoint chosen on the selection split) or a step.

  Returns:
    `(program, state)`: the Program of `build_program` and the restored TrainState.

  A newer checkpoint that fails to restore ('latest') is reported in one line and moved aside
  unless a run holds the workdir; the newest intact one is restored instead.

  Raises:
    errors.CheckpointNotFoundError: no config.json or no such checkpoint.
    errors.ConfigError: `checkpoint` is neither 'latest', 'selected' nor a step number.
    errors.DamagedCheckpointError: the checkpoint (for 'latest': every one) fails to restore.
    errors.DamagedFileError: config.json is damaged.
    errors.WorkdirError: `workdir` holds a sweep's sub-workdirs instead (one per replica).
  """
  directory, step = _checkpoint_location(checkpoint)
  workdir = os.path.abspath(workdir)
  _refuse_sweep_workdir(workdir)
  config = resolve_config(config_lib.read_config(workdir))
  program = build_program(config, for_training=False)
  folder = os.path.join(workdir, directory)
  for _ in range(RESTORE_ATTEMPTS):
    try:
      return program, _restore_read_only(folder, step, program)
    except FileNotFoundError as error:  # a step deleted between listing and reading it
      vanished = error
  raise errors.CheckpointNotFoundError(
    f"the checkpoints in {folder} were deleted while being read {RESTORE_ATTEMPTS} times (a run "
    "training there keeps only its newest): evaluate again, or pick --checkpoint=selected"
  ) from vanished


def _restore_read_only(folder: str, step: int | None, program: Program) -> TrainState:
  """Restores checkpoint `step` of `folder`, or for None the newest that restores: each newer
  one that fails is reported in one line and moved aside (`_move_aside`).

  Raises:
    errors.CheckpointNotFoundError: no checkpoint (at `step`).
    errors.DamagedCheckpointError: it (for None: every one) fails to restore.
    FileNotFoundError: a checkpoint vanished while it was read.
  """
  target = program.restore_target()
  # Read-only: the workdir may be training right now, and its unfinished saves must stay.
  with checkpointing.Checkpointer(
    folder, keep=None, async_save=False, read_only=True
  ) as checkpointer:
    steps = checkpointer.all_steps()
    if (step is None and not steps) or (step is not None and step not in steps):
      checkpointer.restore(step, target)  # raises CheckpointNotFoundError, naming the steps
    if step is not None:
      others = ", ".join(str(s) for s in sorted(steps) if s != step)
      what_to_do = "evaluate another: --checkpoint=latest" + (
        f" or a step of {others}" if others else ""
      )
    elif os.path.basename(folder) == checkpointing.SELECTED_DIR:
      what_to_do = (
        "evaluate --checkpoint=latest, or copy the workdir again if it is an interrupted copy"
      )
    else:
      what_to_do = "copy the workdir again if it is an interrupted copy"
    restored_step, (state,), failed = checkpointing.restore_newest_intact(
      [checkpointer],
      steps if step is None else [step],
      lambda checkpointer, step: checkpointer.restore(step, target)[0],
      what_to_do,
    )
  _move_aside(folder, failed, restored_step)
  return state


def _move_aside(folder: str, failed: list, restored_step: int) -> None:
  """Reports each checkpoint of `failed` (`checkpointing.Unrestorable`) in one line and moves it
  aside (`checkpointing.move_step_aside`) when no run holds the workdir, as a training run would;
  a workdir in use or read-only keeps it (on process 0, which alone writes)."""
  if not failed or jax.process_index() != 0:
    return
  workdir = os.path.dirname(folder)
  lock = workdir_lib.WorkdirLock(workdir)
  try:
    lock.acquire()  # no run may list or delete checkpoints while one is moved
  except errors.WorkdirError:
    writable = os.access(workdir, os.W_OK)
    kept = "in use by a training run" if writable else "read-only"
    moves = {
      unrestorable.step: f"left it in place (the workdir is {kept})" for unrestorable in failed
    }
  else:
    try:
      moves = {
        unrestorable.step: _move_step_aside(folder, unrestorable.step) for unrestorable in failed
      }
    finally:
      lock.release()
  for unrestorable in failed:
    print(
      f"warning: checkpoint step {unrestorable.step} in {folder} cannot be restored "
      f"({unrestorable.cause}); {moves[unrestorable.step]}; evaluating step {restored_step}, "
      "the newest intact one",
      file=sys.stderr,
      flush=True,
    )


def _move_step_aside(folder: str, step: int) -> str:
  """`checkpointing.move_step_aside`, said in words for `_move_aside`'s line."""
  try:
    return f"moved it to {checkpointing.move_step_aside(folder, step)}"
  except OSError as e:
    return f"left it in place (renaming it failed: {e.strerror})"


class EvalReport(TypedDict):
  """A workdir's evaluation (`evaluate_workdir`), as `<workdir>/eval.json` holds it
  (`primal-dual eval --analyses` adds `analyses`)."""

  checkpoint: str  # as asked: 'latest', 'selected' or a step
  step: int  # the step of the checkpoint restored
  results: dict[str, dict[str, float]]  # split → metric → value


def evaluate_workdir(
  workdir: str, splits: tuple[str, ...] | None = None, checkpoint: str = "latest"
) -> EvalReport:
  """Restores a workdir's checkpoint and evaluates splits with its saved config.

  Args:
    workdir: a `train_and_evaluate` workdir (needs config.json and checkpoints/).
    splits: split names; None for the task's eval splits.
    checkpoint: 'latest', 'selected' (the checkpoint chosen on the selection split) or a step.

  Returns:
    An `EvalReport`, `{'checkpoint': checkpoint, 'step': restored step, 'results': split →
    metric → value}`, also written to `workdir/eval.json`.

  Raises:
    errors.CheckpointNotFoundError: no config.json or no such checkpoint.
  """
  workdir = os.path.abspath(workdir)
  program, state = restore_workdir(workdir, checkpoint)
  results = evaluate(program, state, tuple(splits) if splits else None)
  report = EvalReport(
    checkpoint=str(checkpoint), step=int(jax.device_get(state.step)), results=results
  )
  if jax.process_index() == 0:
    write_eval_report(workdir, report)
  return report


def write_eval_report(workdir: str, report: dict) -> str:
  """Writes ``report`` to ``<workdir>/eval.json``; returns the path.

  Raises:
    errors.ReportNotSavedError: the file could not be written (read-only workdir, full disk); it
      carries ``report``, so that the metrics computed are still shown.
  """
  path = os.path.join(os.path.abspath(workdir), EVAL_FILE)
  try:
    return atomic.write_json(path, report)
  except OSError as e:
    raise errors.ReportNotSavedError(path, e, report) from e
