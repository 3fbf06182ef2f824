"""One workdir holds one experiment: its definition (`experiment.json`) and a lock (`.lock`).

Definition. The config fields in `DEFINING_FIELDS` (task, data, model, optimizer, seed, batch
size, ...) decide what is trained; two configs that agree on them are the same experiment, however
long they run, how often they log, evaluate or checkpoint, and where their files go. The first run
of a workdir stores these fields in `experiment.json`; a later run whose fields differ is refused
(`check_same_experiment`) before it writes anything, naming the differing fields. Workdirs written
before `experiment.json` existed are judged by the definition read from their `config.json`.

Lock. While a run trains, `workdir/.lock` holds `{"pid": ..., "host": ...}`, created with O_EXCL
so only one process can hold it. A second run on the same workdir is refused; a lock left by a
process that is no longer alive on this host (killed, machine rebooted) is taken over.
"""

import errno
import json
import os
import socket
import time
from typing import Any, Mapping

import ml_collections

from primal_dual import atomic
from primal_dual.training import errors

EXPERIMENT_FILE = 'experiment.json'
CONFIG_FILE = 'config.json'
LOCK_FILE = '.lock'

# Config fields (sections are taken whole) that define an experiment. Everything else (run length
# num_train_steps / num_epochs, *_every_*, eval_splits, keep_*, async_checkpointing, progress_bar,
# mesh, distributed, loader threads and workers) changes how a run is carried out or observed,
# not what it learns, and may differ between runs of one workdir.
DEFINING_FIELDS = (
  'task',
  'data',
  'model',
  'optimizer',
  'seed',
  'seeds',
  'sweep',  # a sweep's workdir holds its replicas
  'batch_size',
  'loader.batch_reads',  # decides the order of the training examples
  'train_data_on_device',  # decides which generated examples a run trains on
  'selection',  # decides which checkpoint checkpoints_selected/ holds
)

# Fields inside DEFINING_FIELDS sections that only say where files are, not what they hold.
LOCATION_FIELDS = ('data.data_dir', 'data.manual_dir')

_UNSET = '<unset>'


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
    for part in field.split('.'):
      value = value.get(part, _UNSET) if isinstance(value, Mapping) else _UNSET
    if isinstance(value, Mapping):
      flat.update({f'{field}.{key}': item for key, item in value.items()})
    elif value is not _UNSET:  # a config of an earlier version may lack the field
      flat[field] = value
  for field in LOCATION_FIELDS:
    flat.pop(field, None)
  return json.loads(json.dumps(flat, default=str))


def differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """`"name stored != current"` for every stored field whose current value differs, sorted.

  Fields the stored definition does not name are not compared: the workdir's runs predate them
  (a field added to the code later, e.g. `loader.batch_reads`), so they ran with its default.
  """
  return [
    f'{name} {stored[name]!r} != {current.get(name, _UNSET)!r}'
    for name in sorted(stored)
    if stored[name] != current.get(name, _UNSET)
  ]


def stored_definition(workdir: str) -> dict[str, Any] | None:
  """The definition the workdir's runs so far had; None for a workdir without runs.

  Read from `experiment.json`, or for workdirs of earlier versions from `config.json`.
  """
  experiment_path = os.path.join(workdir, EXPERIMENT_FILE)
  if os.path.exists(experiment_path):
    with open(experiment_path) as f:
      return json.load(f)['definition']
  config_path = os.path.join(workdir, CONFIG_FILE)
  if os.path.exists(config_path):
    with open(config_path) as f:
      return definition(json.load(f))
  return None


def check_same_experiment(workdir: str, config) -> None:
  """Refuses a config that defines another experiment than the one `workdir` holds.

  Raises:
    errors.WorkdirError: the definitions differ; the message names every differing field.
  """
  stored = stored_definition(workdir)
  if stored is None:
    return
  diff = differences(stored, definition(config))
  if diff:
    raise errors.WorkdirError(
      f'workdir {workdir} holds another experiment: {"; ".join(diff)}; use a new --workdir'
    )


def write_definition(workdir: str, config) -> None:
  """Writes `experiment.json` (atomically): the defining fields and their list."""
  path = os.path.join(workdir, EXPERIMENT_FILE)
  atomic.write_json(path, {'fields': list(DEFINING_FIELDS), 'definition': definition(config)})


# ------------------------------------------------------------------------------------------------
# Lock.


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)  # signal 0: only checks that the process exists
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, owned by someone else
  return True


def _read_holder(path: str) -> dict | None:
  """The lock file's {'pid', 'host'}, or None if it is gone or unreadable."""
  try:
    with open(path) as f:
      holder = json.load(f)
  except (OSError, ValueError):
    return None
  return holder if isinstance(holder, dict) else None


# A lock file is created empty and then written; one that stays unreadable this long was left by
# a process killed in between.
_UNREADABLE_LOCK_GRACE_S = 10.0


def _is_stale(path: str, holder: dict | None) -> bool:
  """Whether the lock at `path` (content `holder`) was left by a process that is gone.

  Only a process on this host can be checked; a lock from another host is never stale.
  """
  if holder is None:
    try:
      return time.time() - os.path.getmtime(path) > _UNREADABLE_LOCK_GRACE_S
    except OSError:
      return True  # removed meanwhile
  pid = holder.get('pid')
  if not isinstance(pid, int) or pid <= 0:
    return True  # not a lock this module wrote
  return holder.get('host') == socket.gethostname() and not _pid_alive(pid)


class WorkdirLock:
  """Exclusive use of a workdir by one process; a context manager.

  Args:
    workdir: the folder to lock (created if missing).
  """

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._held = False

  def acquire(self) -> None:
    """Takes the lock, taking over a stale one.

    Raises:
      errors.WorkdirError: another live process holds the lock, or the workdir cannot be made or
        written.
    """
    make_workdir(self.workdir)
    for _ in range(2):  # the second try follows the removal of a stale lock
      if self._try_create():
        self._held = True
        return
      holder = _read_holder(self.path)
      if not _is_stale(self.path, holder):
        raise errors.WorkdirError(self._in_use_message(holder))
      # Another process taking over the same stale lock at this moment fails its retry.
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
    raise errors.WorkdirError(self._in_use_message(_read_holder(self.path)))

  def _try_create(self) -> bool:
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    except OSError as e:
      raise errors.WorkdirError(f'cannot write to workdir {self.workdir}: {e.strerror}') from e
    with os.fdopen(fd, 'w') as f:
      json.dump({'pid': os.getpid(), 'host': socket.gethostname()}, f)
    return True

  def _in_use_message(self, holder: dict | None) -> str:
    who = f'process {holder.get("pid")} on {holder.get("host")}' if holder else 'another process'
    return (
      f'workdir {self.workdir} is in use by {who}; wait for it to finish or use another '
      f'--workdir (if that process is gone, delete {self.path})'
    )

  def release(self) -> None:
    """Removes the lock file if this process holds it."""
    if not self._held:
      return
    self._held = False
    holder = _read_holder(self.path)
    if holder and holder.get('pid') == os.getpid() and holder.get('host') == socket.gethostname():
      os.remove(self.path)

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
      f'workdir {workdir} is a file, not a folder; choose another --workdir'
    )
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    reason = 'not a folder' if e.errno in (errno.ENOTDIR, errno.EEXIST) else e.strerror
    raise errors.WorkdirError(f'cannot create workdir {workdir}: {reason}') from e
  if not os.access(workdir, os.W_OK):
    raise errors.WorkdirError(f'workdir {workdir} is read-only; choose another --workdir')
