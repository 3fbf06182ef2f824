"""Orbax checkpoints of the whole training run: state, data-iterator position and metadata.

A checkpoint at step s (directory `workdir/checkpoints/<s>/`) holds three items:

  state   the TrainState pytree (params, batch_stats, opt_state, step, rng), `StandardSave`;
  data    the grain iterator position, one JSON file per process (`grain.checkpoint`);
  meta    JSON: step and the evaluation tracker (best / selected metrics so far).

Restoring all three and continuing gives bit-for-bit the run that was never interrupted: the
per-step dropout key is `fold_in(state.rng, state.step)` and the iterator resumes at the next
batch. The trainer decides *when* to save (`periodic.PeriodicActions`); this module only saves,
keeps the last K and restores.

A checkpoint that fails to restore (a truncated array file, a garbled JSON file, a missing item:
an interrupted copy of a workdir looks like this) is stood in for by the newest older one that
restores (`restore_newest_intact`); the failed one is then renamed `<step>.damaged`
(`Checkpointer.move_aside`), which Orbax no longer lists, and never deleted. Nothing is moved when
no checkpoint restores: the same failure on every one is more likely a program that does not fit
them than damage.
"""

import contextlib
import dataclasses
import gc
import json
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from primal_dual.training import errors

CHECKPOINT_DIR = "checkpoints"
SELECTED_DIR = "checkpoints_selected"
# Appended to the folder of a checkpoint that failed to restore; Orbax lists step folders only.
DAMAGED_SUFFIX = ".damaged"


def _grain_args():
  """grain's Orbax argument classes (registered with Orbax when grain is imported)."""
  import grain

  return grain.checkpoint.CheckpointSave, grain.checkpoint.CheckpointRestore


def abstract_with_shardings(abstract_tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying shardings: the restore target that places arrays directly."""
  return jax.tree.map(
    lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
    abstract_tree,
    shardings,
  )


@contextlib.contextmanager
def _absl_verbosity(level: int) -> Iterator[None]:
  """absl's logging verbosity set to ``level`` inside the block, restored after it."""
  previous = absl_logging.get_verbosity()
  absl_logging.set_verbosity(level)
  try:
    yield
  finally:
    absl_logging.set_verbosity(previous)


class Checkpointer:
  """Saves and restores (state, data iterator, meta) under `directory`.

  Args:
    directory: where step folders go (made absolute; created if missing).
    keep: how many of the most recent checkpoints to keep (None: all).
    async_save: write in a background thread. Arrays are copied to host memory before `save`
      returns, so the caller may donate or overwrite the state right away.
    read_only: only restore (evaluation, analysis): nothing is created, saved or deleted. In
      particular the unfinished (`*.orbax-checkpoint-tmp*`) folders are left alone: they may be
      the saves of a run that is training in this workdir right now. Only the trainer, which holds
      the workdir's lock, removes those its crashed predecessors left.
  """

  def __init__(
    self,
    directory: str,
    *,
    keep: int | None = 3,
    async_save: bool = True,
    read_only: bool = False,
  ):
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    writable = not read_only
    options = ocp.CheckpointManagerOptions(
      create=writable,
      read_only=read_only,
      save_interval_steps=1 if writable else 0,
      enable_async_checkpointing=async_save,
      preservation_policy=ocp.checkpoint_managers.LatestN(n=keep) if writable else None,
      cleanup_tmp_directories=writable,
      # Orbax names its cross-process barriers by step alone ("async_write_complete.<step>"), so
      # two managers saving the same step at once (the latest and the selected checkpoint) would
      # join the same barrier and hang a multi-process run; the folder name keeps them apart.
      multiprocessing_options=ocp.options.MultiprocessingOptions(
        barrier_sync_key_prefix=os.path.basename(self.directory)
      ),
    )
    # Orbax warns on every read-only manager; evaluation opens one on purpose, and the commands'
    # one-line errors must stay one line.
    with _absl_verbosity(absl_logging.ERROR if read_only else absl_logging.get_verbosity()):
      self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data", "meta")
      )

  def latest_step(self) -> int | None:
    """Step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(
    self, step: int, state: Any, *, meta: dict, data_iterator: Iterator | None = None
  ) -> None:
    """Saves a checkpoint at `step` (all processes must call this together).

    Args:
      step: the completed training step.
      state: the TrainState pytree.
      meta: JSON-serialisable dict (e.g. the evaluation tracker).
      data_iterator: a grain iterator (`get_state`/`set_state`), or None to skip the data item.
    """
    self._check_writable()
    items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    if data_iterator is not None:
      grain_save, _ = _grain_args()
      items["data"] = grain_save(data_iterator)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(
    self, step: int | None, abstract_state: Any, *, data_iterator: Iterator | None = None
  ) -> tuple[Any, dict]:
    """Restores a checkpoint; sets `data_iterator`'s position in place when given.

    Args:
      step: which step (None: the latest).
      abstract_state: the TrainState as ShapeDtypeStructs with shardings
        (`abstract_with_shardings`); arrays come back with those shardings.
      data_iterator: the freshly built training iterator to move to the saved position.

    Returns:
      (state, meta).

    Raises:
      errors.CheckpointNotFoundError: no checkpoint (at `step`) in the directory.
    """
    if step is None:
      step = self.latest_step()
    if step is None or step not in self.all_steps():
      saved = ", ".join(map(str, sorted(self.all_steps())))
      raise errors.CheckpointNotFoundError(
        f"no checkpoint{'' if step is None else f' at step {step}'} in {self.directory}"
        + (f"; its checkpoints: steps {saved}" if saved else "")
      )
    items = dict(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
    if data_iterator is not None:
      _, grain_restore = _grain_args()
      items["data"] = grain_restore(data_iterator)
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    return restored["state"], dict(restored["meta"])

  def step_path(self, step: int) -> str:
    """The folder of the checkpoint at `step`."""
    return os.path.join(self.directory, str(step))

  def move_aside(self, step: int) -> str:
    """Renames the checkpoint at `step` to `<step>.damaged` (`.damaged.2`, ... when taken), where
    Orbax no longer lists it; returns the new path. Process 0 renames (the folder is shared);
    every process then lists the folder again."""
    self._check_writable()
    target = move_step_aside(self.directory, step)
    _sync_processes(f"moved aside {self.directory} {step}")  # others list after the rename
    self._manager.reload()
    return target

  def delete_after(self, step: int) -> None:
    """Deletes checkpoints later than `step` (left by a run that crashed and is now resumed)."""
    self._check_writable()
    for later in [s for s in self.all_steps() if s > step]:
      self._manager.delete(later)

  def _check_writable(self) -> None:
    if self.read_only:
      raise RuntimeError(f"checkpoints in {self.directory} were opened read-only")

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves (raising a failed one's error), then closes the manager."""
    try:
      self._manager.wait_until_finished()
    finally:
      self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def move_step_aside(directory: str, step: int) -> str:
  """Renames `directory/<step>` to `directory/<step>.damaged` (`.damaged.2`, ... when that is
  taken) on process 0; returns the new path (what it would be, on other processes)."""
  source = os.path.join(directory, str(step))
  target, number = source + DAMAGED_SUFFIX, 1
  while os.path.exists(target):
    number += 1
    target = f"{source}{DAMAGED_SUFFIX}.{number}"
  if jax.process_index() == 0:
    os.rename(source, target)
  return target


def _sync_processes(name: str) -> None:
  """A barrier across processes; nothing with one process."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def true_on_any_process(flags: Sequence[bool]) -> list[bool]:
  """Each of `flags` OR-ed over every process (the same answer everywhere); with one process,
  `flags` themselves, at no cost."""
  flags = [bool(flag) for flag in flags]
  if jax.process_count() == 1:
    return flags
  from jax.experimental import multihost_utils

  gathered = multihost_utils.process_allgather(np.asarray(flags, np.int32).reshape(-1))
  return [bool(flag) for flag in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0)]


# JSON files of a checkpoint folder, read when a restore fails with a JSON error (which does not
# say which file it was reading). Orbax only logs a garbled _CHECKPOINT_METADATA, hence last.
_JSON_FILES = ("meta/metadata", "state/_METADATA", "state/_sharding")


def _unreadable_json_file(step_path: str) -> str | None:
  """The first JSON file of the checkpoint folder `step_path` that does not parse, or None."""
  data = os.path.join(step_path, "data")
  data_files = sorted(os.listdir(data)) if os.path.isdir(data) else []
  candidates = [
    *_JSON_FILES,
    *(f"data/{name}" for name in data_files if name.endswith(".json")),
    "_CHECKPOINT_METADATA",
  ]
  for name in candidates:
    path = os.path.join(step_path, name)
    try:
      with open(path) as f:
        json.load(f)
    except ValueError:
      return path
    except OSError:
      continue
  return None


def describe_restore_error(error: BaseException, step_path: str) -> str:
  """Why restoring the checkpoint in `step_path` failed, in one short line (`errors.describe`);
  a JSON error names the file."""
  cause = errors.describe(error)
  if isinstance(error, json.JSONDecodeError):
    path = _unreadable_json_file(step_path)
    if path is not None:
      cause = f"{os.path.relpath(path, step_path)}: {cause}"
  return cause


def _forget_abandoned_reads() -> None:
  """Collects the read tasks a failed restore abandoned, without their reports
  (`errors.not_an_abandoned_checkpoint_read`): now, while the interpreter is whole, and not one
  traceback each later or at exit."""
  logger = logging.getLogger("asyncio")
  installed = errors.not_an_abandoned_checkpoint_read in logger.filters  # by the commands
  logger.addFilter(errors.not_an_abandoned_checkpoint_read)
  try:
    gc.collect()
  finally:
    if not installed:
      logger.removeFilter(errors.not_an_abandoned_checkpoint_read)


@dataclasses.dataclass(frozen=True)
class Unrestorable:
  """A checkpoint that failed to restore.

  Attributes:
    index: which of the checkpointers given to `restore_newest_intact` holds it.
    directory: that checkpointer's folder.
    step: the checkpoint's step.
    cause: why, in one line (another process's failure: only that it failed there).
  """

  index: int
  directory: str
  step: int
  cause: str


def restore_newest_intact(
  checkpointers: Sequence[Checkpointer],
  steps: Sequence[int],
  restore: Callable[[Checkpointer, int], Any],
  what_to_do: str,
) -> tuple[int, list, list[Unrestorable]]:
  """Restores the newest of `steps` whose checkpoint every checkpointer restores, on every
  process (all of them stand in for a damaged one together).

  Args:
    checkpointers: one per run (a sweep's replicas), restored at the same step.
    steps: the candidate steps, each held by every checkpointer.
    restore: `restore(checkpointer, step)` restores one checkpoint and returns it; an exception
      means that checkpoint cannot be restored.
    what_to_do: the end of the message when none restores.

  Returns:
    `(step, what restore returned for each checkpointer, the checkpoints at newer steps that
    failed)`; the caller decides whether to move those aside (`Checkpointer.move_aside`).

  Raises:
    errors.DamagedCheckpointError: no step restores (nothing is moved).
    FileNotFoundError: a step folder vanished while it was read (a run training in the folder
      deletes its older checkpoints): list the folder again and retry.
  """
  failed: list[Unrestorable] = []
  for step in sorted(steps, reverse=True):
    restored, causes = [], []
    for checkpointer in checkpointers:
      try:
        restored.append(restore(checkpointer, step))
        causes.append(None)
      except Exception as error:  # noqa: BLE001 - any failure to read it: the next step stands in
        path = checkpointer.step_path(step)
        if not os.path.isdir(path):
          raise FileNotFoundError(f"checkpoint {path} vanished while it was read") from error
        restored.append(None)
        causes.append(describe_restore_error(error, path))
    if any(causes):
      _forget_abandoned_reads()
    anywhere = true_on_any_process([cause is not None for cause in causes])
    if not any(anywhere):
      return step, restored, failed
    failed.extend(
      Unrestorable(index, checkpointer.directory, step, cause or "it failed on another process")
      for index, (checkpointer, cause, bad) in enumerate(zip(checkpointers, causes, anywhere))
      if bad
    )
  newest = failed[0]
  if len(steps) == 1:
    raise errors.DamagedCheckpointError(
      f"checkpoint step {newest.step} in {newest.directory} cannot be restored "
      f"({newest.cause}); {what_to_do}"
    )
  listed = ", ".join(str(step) for step in sorted(steps))
  raise errors.DamagedCheckpointError(
    f"no checkpoint in {newest.directory} can be restored (steps {listed}; step {newest.step}: "
    f"{newest.cause}); {what_to_do}"
  )
