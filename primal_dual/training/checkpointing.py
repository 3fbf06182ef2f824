"""Orbax checkpoints of the whole training run: state, data-iterator position and metadata.

A checkpoint at step s (directory `workdir/checkpoints/<s>/`) holds three items:

  state   the TrainState pytree (params, batch_stats, opt_state, step, rng), `StandardSave`;
  data    the grain iterator position, one JSON file per process (`grain.checkpoint`);
  meta    JSON: step and the evaluation tracker (best / selected metrics so far).

Restoring all three and continuing gives bit-for-bit the run that was never interrupted: the
per-step dropout key is `fold_in(state.rng, state.step)` and the iterator resumes at the next
batch. The trainer decides *when* to save (`periodic.PeriodicActions`); this module only saves,
keeps the last K and restores.
"""

import contextlib
import os
from typing import Any, Iterator

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from primal_dual.training import errors

CHECKPOINT_DIR = "checkpoints"
SELECTED_DIR = "checkpoints_selected"


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
