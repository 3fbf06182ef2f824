"""One workdir holds one experiment: its definition (`experiment.json`) and a lock (`.lock`).

Definition. The config fields in `DEFINING_FIELDS` (task, data, model, optimizer, seed, batch
size, ...) decide what is trained; two configs that agree on them are the same experiment, however
long they run, how often they log, evaluate or checkpoint, and where their files go. The first run
of a workdir stores these fields in `experiment.json`; a later run whose fields differ is refused
(`check_same_experiment`) before it writes anything, naming the differing fields. Workdirs written
before `experiment.json` existed are judged by the definition read from their `config.json`.
The one exception is explicit: `config.resume_with_changed_optimizer` continues a checkpoint with
other `optimizer.*` values (e.g. a lower learning rate after a non-finite loss), and each such
change is appended to `experiment.json`'s `history` with the step it took effect at.

Lock. While a run trains, it holds an OS file lock (`filelock`) on `workdir/.lock`, whose content
`{"pid": ..., "host": ...}` names the holder. A second run on the same workdir is refused; a lock
file left by a process that is gone (killed, machine rebooted) holds no OS lock and is taken over.
"""

import errno
import json
import os
import socket
from typing import Any, Mapping

import filelock
import ml_collections

from primal_dual import atomic
from primal_dual.training import config_lib
from primal_dual.training import errors

EXPERIMENT_FILE = "experiment.json"
CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"

# Config fields (sections are taken whole) that define an experiment. Everything else (run length
# num_train_steps / num_epochs, *_every_*, eval_splits, keep_*, async_checkpointing, progress_bar,
# mesh, distributed, loader threads and workers) changes how a run is carried out or observed,
# not what it learns, and may differ between runs of one workdir.
DEFINING_FIELDS = (
  "task",
  "data",
  "model",
  "optimizer",
  "seed",
  "sweep",  # a sweep's workdir holds its replicas
  "batch_size",
  "loader.batch_reads",  # decides the order of the training examples
  "train_data_on_device",  # decides which generated examples a run trains on
  "selection",  # decides which checkpoint checkpoints_selected/ holds
)

# Fields inside DEFINING_FIELDS sections that only say where files are, not what they hold.
LOCATION_FIELDS = ("data.data_dir", "data.manual_dir")

_UNSET = "<unset>"


# ------------------------------------------------------------------------------------------------
# Experiment definition.


def _as_dict(config) -> dict:
  if isinstance(config, ml_collections.FrozenConfigDict):
    config = config.as_configdict()
  if isinstance(config, ml_collections.ConfigDict):
    return config.to_dict()
  return dict(config)


def definition(config) -> dict[str, Any]:
  """The experiment-defining fields of `config`, by dotted name.

  A section of `DEFINING_FIELDS` (e.g. 'model') contributes one entry per field
  ('model.attention'); a field that is itself a dict ('model.attention_options') is kept whole, so
  that `{}` and `{'ratios': ...}` differ.

  Args:
    config: a (frozen or not) ConfigDict or a plain dict, e.g. read from config.json.

  Returns:
    `{'model.attention': 'softmax', 'seed': 0, ...}` with JSON values (tuples become lists), so a
    definition read back from JSON compares equal to the one it was written from.
  """
  as_dict = _as_dict(config)
  flat = {}
  for field in DEFINING_FIELDS:
    value = as_dict
    for part in field.split("."):
      value = value.get(part, _UNSET) if isinstance(value, Mapping) else _UNSET
    if isinstance(value, Mapping):
      flat.update({f"{field}.{key}": item for key, item in value.items()})
    elif value is not _UNSET:  # a config of an earlier version may lack the field
      flat[field] = value
  for field in LOCATION_FIELDS:
    flat.pop(field, None)
  return json.loads(json.dumps(flat, default=str))


def differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """`"name stored != current"` for every stored field whose current value differs, sorted.

  Fields the stored definition does not name are not compared: the workdir's runs predate them
  (a field added to the code later, e.g. `loader.batch_reads`), so they ran with its default.
  Nor are `config_lib.RETIRED_FIELDS` stored empty (they meant nothing).
  """
  compared = {
    name: value for name, value in stored.items() if name not in config_lib.RETIRED_FIELDS or value
  }
  return [
    f"{name} {compared[name]!r} != {current.get(name, _UNSET)!r}"
    for name in sorted(compared)
    if compared[name] != current.get(name, _UNSET)
  ]


def _read_experiment(workdir: str) -> dict:
  """`experiment.json`, checked to hold a definition.

  Raises:
    errors.DamagedFileError: it does not (truncated, garbled).
  """
  path = os.path.join(workdir, EXPERIMENT_FILE)
  try:
    with open(path) as f:
      stored = json.load(f)
    if not isinstance(stored, dict) or not isinstance(stored.get("definition"), dict):
      raise ValueError("no 'definition' object")
  except ValueError as e:
    config_path = os.path.join(workdir, CONFIG_FILE)
    remedy = (
      f"delete it and re-run: it is written again from {CONFIG_FILE} (its record of optimizer "
      "changes is lost)"
      if os.path.exists(config_path)
      else "copy it again from the workdir this one was copied from"
    )
    raise errors.DamagedFileError(path, errors.describe(e), remedy) from None
  return stored


def stored_definition(workdir: str) -> dict[str, Any] | None:
  """The definition the workdir's runs so far had; None for a workdir without runs.

  Read from `experiment.json`, or for workdirs of earlier versions from `config.json`.

  Raises:
    errors.DamagedFileError: the file it reads is damaged.
  """
  if os.path.exists(os.path.join(workdir, EXPERIMENT_FILE)):
    return _read_experiment(workdir)["definition"]
  if os.path.exists(os.path.join(workdir, CONFIG_FILE)):
    return definition(config_lib.read_config(workdir))
  return None


# Optimizer fields that decide the structure of the saved optimizer state: a checkpoint cannot be
# continued with another value (`optimizer.grad_clip_norm` and `weight_decay` add a transformation
# to the chain only when > 0).
_STATE_SHAPING = {
  "optimizer.name": lambda value: value,
  "optimizer.grad_clip_norm": lambda value: value > 0,
  "optimizer.weight_decay": lambda value: value > 0,
}

CHANGED_OPTIMIZER_FLAG = "--config.resume_with_changed_optimizer=True"


def optimizer_changes(stored: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, list]:
  """`{name: [stored, current]}` of the `optimizer.*` fields that differ."""
  return {
    name: [stored[name], current.get(name, _UNSET)]
    for name in sorted(stored)
    if name.startswith("optimizer.") and stored[name] != current.get(name, _UNSET)
  }


def check_same_experiment(workdir: str, config) -> None:
  """Refuses a config that defines another experiment than the one `workdir` holds.

  With `config.resume_with_changed_optimizer`, differing `optimizer.*` fields are accepted
  (`write_definition` records them) unless they change the saved optimizer state's structure.

  Raises:
    errors.WorkdirError: the definitions differ; the message names every differing field, and
      the flag that continues with other optimizer settings when only those differ.
  """
  stored = stored_definition(workdir)
  if stored is None:
    return
  current = definition(config)
  diff = differences(stored, current)
  if not diff:
    return
  changes = optimizer_changes(stored, current)
  only_optimizer = len(changes) == len(diff)
  if only_optimizer and config.get("resume_with_changed_optimizer", False):
    shaping = [
      name
      for name, (old, new) in changes.items()
      if name in _STATE_SHAPING and _STATE_SHAPING[name](old) != _STATE_SHAPING[name](new)
    ]
    if not shaping:
      return
    raise errors.WorkdirError(
      f"workdir {workdir}: {', '.join(shaping)} cannot change for a saved run (the optimizer "
      "state has another structure); use a new --workdir"
    )
  hint = (
    f"; to continue its checkpoint with these optimizer settings, add {CHANGED_OPTIMIZER_FLAG}"
    if only_optimizer
    else "; use a new --workdir"
  )
  raise errors.WorkdirError(f"workdir {workdir} holds another experiment: {'; '.join(diff)}{hint}")


def write_definition(workdir: str, config, step: int = 0) -> dict[str, list]:
  """Writes `experiment.json` (atomically): the defining fields, their list, and the `history`
  of accepted optimizer changes, with this run's appended when it continues at `step` with other
  optimizer settings (`check_same_experiment` accepted them).

  Returns:
    This run's changes, `{name: [old, new]}` (empty when there are none).
  """
  path = os.path.join(workdir, EXPERIMENT_FILE)
  history = []
  if os.path.exists(path):
    history = _read_experiment(workdir).get("history", [])
  stored, current = stored_definition(workdir), definition(config)
  changes = {} if stored is None else optimizer_changes(stored, current)
  if changes:
    history.append({"step": step, "changed": changes})
  payload = {"fields": list(DEFINING_FIELDS), "definition": current}
  if history:
    payload["history"] = history
  atomic.write_json(path, payload)
  return changes


# ------------------------------------------------------------------------------------------------
# Lock.


def _read_holder(path: str) -> dict | None:
  """The lock file's {'pid', 'host'}, or None if it is gone, empty or unreadable."""
  try:
    with open(path) as f:
      holder = json.load(f)
  except (OSError, ValueError):
    return None
  return holder if isinstance(holder, dict) else None


def _write_holder(fd: int) -> None:
  """Writes who holds the lock into the lock file (for the message a second run gets)."""
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)


class WorkdirLock:
  """Exclusive use of a workdir by one process; a context manager.

  The lock is an OS file lock (`filelock`) on `workdir/.lock`: the OS drops it when its process
  ends, however it ends, so a lock file left by a killed run never blocks the next one, and a
  reused PID never looks like a live holder. The file's content (pid, host) only names the
  holder in the message a second run gets.

  Args:
    workdir: the folder to lock (created if missing).
  """

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._lock = filelock.FileLock(self.path, timeout=0, on_acquired=_write_holder)

  def acquire(self) -> None:
    """Takes the lock (at once or not at all).

    Raises:
      errors.WorkdirError: another live process holds the lock, or the workdir cannot be made or
        written.
    """
    make_workdir(self.workdir)
    try:
      self._lock.acquire()
    except filelock.Timeout:
      raise errors.WorkdirError(self._in_use_message(_read_holder(self.path))) from None
    except OSError as e:
      raise errors.WorkdirError(f"cannot write to workdir {self.workdir}: {e.strerror}") from e

  def _in_use_message(self, holder: dict | None) -> str:
    who = f"process {holder.get('pid')} on {holder.get('host')}" if holder else "another process"
    return (
      f"workdir {self.workdir} is in use by {who}; wait for it to finish or use another --workdir"
    )

  def release(self) -> None:
    """Removes the lock file and releases the lock, if this process holds it."""
    if not self._lock.is_locked:
      return
    # Removed while still locked: a process that opened the file meanwhile finds it unlinked once
    # it gets the lock and tries again (filelock checks), so two holders never coexist.
    try:
      os.remove(self.path)
    except FileNotFoundError:
      pass
    self._lock.release()

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc_info):
    self.release()


def make_workdir(workdir: str) -> None:
  """Creates `workdir` (and parents), as a one-line user error when that is impossible.

  Raises:
    errors.WorkdirError: the path is a file, or a parent is not writable.
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.WorkdirError(
      f"workdir {workdir} is a file, not a folder; choose another --workdir"
    )
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    reason = "not a folder" if e.errno in (errno.ENOTDIR, errno.EEXIST) else e.strerror
    raise errors.WorkdirError(f"cannot create workdir {workdir}: {reason}") from e
  if not os.access(workdir, os.W_OK):
    raise errors.WorkdirError(f"workdir {workdir} is read-only; choose another --workdir")
