"""Errors a user can cause, reported by `train.py` / `eval.py` as one line.

Everything a user can fix (a bad config value, a missing data folder, a run that diverged, a
workdir without a checkpoint) raises a subclass of `UserError`. The command-line entry points catch
`UserError`, print `error: <message>` and exit with status 2; any other exception is a bug and
keeps its traceback.
"""


class UserError(ValueError):
  """A problem the user can fix; the message says what to do."""


class ConfigError(UserError):
  """A config value is missing, unknown or out of range."""


class UnknownNameError(ConfigError):
  """A registry lookup (task, optimizer, schedule, ...) got a name it does not know."""


class DataNotFoundError(UserError):
  """A data folder or file the task needs is not there."""


class CheckpointNotFoundError(UserError):
  """A workdir holds no checkpoint (or not the requested one)."""


class NonFiniteLossError(UserError):
  """The training loss became NaN or infinite; the run stopped.

  Attributes:
    step: the 1-based training step whose loss was not finite.
  """

  def __init__(self, step: int, loss: float, last_checkpoint_step: int | None = None):
    if last_checkpoint_step is None:
      what_next = (
        "no checkpoint was saved. Check the inputs for NaN, or start again in a new --workdir "
        "with a lower optimizer.lr or an optimizer.grad_clip_norm."
      )
    else:
      what_next = (
        f"the last good checkpoint (step {last_checkpoint_step}) is kept. Check the inputs for "
        "NaN, or continue from that checkpoint with a lower optimizer.lr or another "
        "optimizer.grad_clip_norm by re-running with --config.resume_with_changed_optimizer=True "
        "(turning clipping on or off needs a new --workdir)."
      )
    super().__init__(
      f"training loss became non-finite ({loss}) at step {step}; the run stopped and {what_next}"
    )
    self.step = step
    self.loss = loss


def lookup(registry: dict, name: str, what: str):
  """Returns `registry[name]` or raises `UnknownNameError` listing the known names.

  Args:
    registry: a name → value dict.
    name: the requested name.
    what: what the names denote, for the message (e.g. 'task', 'optimizer').
  """
  try:
    return registry[name]
  except (KeyError, TypeError):
    known = ", ".join(sorted(registry))
    raise UnknownNameError(f"unknown {what} {name!r}; known: {known}") from None


class WorkdirError(UserError):
  """The workdir cannot be used: another experiment's, in use by another process, not writable."""


class StoppedError(UserError):
  """The user stopped training (Ctrl-C); the message says where and how to resume.

  Attributes:
    step: the last completed training step.
    last_checkpoint_step: the step of the newest checkpoint, None if none was saved.
  """

  def __init__(self, step: int, last_checkpoint_step: int | None):
    kept = (
      "no checkpoint was saved yet, so a re-run of the same command starts again from step 0"
      if last_checkpoint_step is None
      else f"last checkpoint step {last_checkpoint_step}; re-run the same command to resume"
    )
    super().__init__(f"stopped at step {step}; {kept}")
    self.step = step
    self.last_checkpoint_step = last_checkpoint_step


class PreemptedError(StoppedError):
  """SIGTERM (a pre-empted VM, SLURM, `docker stop`) stopped training after the call in flight;
  a checkpoint of the step reached was saved (none at step 0, where there is nothing to keep).
  The commands exit with their own status for it (`cli.EXIT_PREEMPTED`)."""

  def __init__(self, step: int, last_checkpoint_step: int | None):
    UserError.__init__(
      self,
      f"stopped by SIGTERM at step {step}; "
      + (
        "nothing to save yet, so a re-run of the same command starts again from step 0"
        if last_checkpoint_step is None
        else f"checkpoint saved at step {last_checkpoint_step}; re-run the same command to resume"
      ),
    )
    self.step = step
    self.last_checkpoint_step = last_checkpoint_step


class DamagedFileError(UserError):
  """A file of a workdir cannot be read: truncated or garbled (an interrupted copy, a full disk
  at the time it was written). The message names the file and what to do.

  Attributes:
    path: the damaged file.
  """

  def __init__(self, path: str, cause: str, what_to_do: str):
    super().__init__(f"{path} is damaged ({cause}); {what_to_do}")
    self.path = path


def read_json_object(path: str, what_to_do: str) -> dict:
  """The JSON object in ``path``.

  Raises:
    DamagedFileError: the file is not a JSON object (truncated, garbled), with ``what_to_do``.
  """
  import json

  try:
    with open(path) as f:
      value = json.load(f)
    if not isinstance(value, dict):
      raise ValueError(f"a JSON {type(value).__name__}, not an object")
  except ValueError as e:
    raise DamagedFileError(path, describe(e), what_to_do) from None
  return value


class DamagedCheckpointError(UserError):
  """A checkpoint cannot be restored, and no older one can stand in for it."""


def describe(error: BaseException, limit: int = 300) -> str:
  """``error`` in one short line for a message about a damaged file.

  A JSON error says where; tensorstore's (under Orbax) keeps its status code and its layers from
  the innermost one that names a file (the outer ones name drivers, and its spec is a page of
  JSON); anything else is ``Type: message``. At most ``limit`` characters.
  """
  import json
  import re

  if isinstance(error, json.JSONDecodeError):
    text = f"not valid JSON: {error}"
  elif isinstance(error, KeyError) and error.args:
    text = str(error.args[0])
  else:
    text = re.split(r" \[(?:tensorstore_spec|source locations)", str(error))[0]
    code, _, rest = text.partition(": ")
    if re.fullmatch(r"[A-Z]+(_[A-Z]+)*", code) and rest.startswith("Error "):
      layers = rest.removeprefix("Error ").split(": Error ")
      named = [index for index, layer in enumerate(layers) if 'file "' in layer] or [0]
      text = f"{code}: Error " + ": Error ".join(layers[named[-1] :])
    else:
      text = f"{type(error).__name__}: {text}" if text else type(error).__name__
  text = " ".join(text.split())
  return text if len(text) <= limit else text[: limit - 1] + "…"


# How tensorstore (under Orbax) says ENOSPC: a `ValueError("RESOURCE_EXHAUSTED: ... No space left
# on device [os_error_code='28'] ...")`, not an OSError.
_DISK_FULL_TEXTS = ("No space left on device", "os_error_code='28'")


def says_disk_full(text: str) -> bool:
  """Whether ``text`` (an error message, a log line) reports a full disk."""
  return any(marker in text for marker in _DISK_FULL_TEXTS)


def is_disk_full(error: BaseException | None) -> bool:
  """Whether a full disk (an ``OSError`` ENOSPC, or tensorstore's ``ValueError`` saying
  ``No space left on device``) is anywhere in ``error``'s cause/context chain (libraries re-raise
  write errors wrapped)."""
  import errno

  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
      return True
    if isinstance(error, ValueError) and says_disk_full(str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


def _not_about_a_full_disk(record) -> bool:
  """A `logging` filter: False for a record reporting a full disk (its message or exception)."""
  error = record.exc_info[1] if record.exc_info else None
  return not (is_disk_full(error) or says_disk_full(record.getMessage()))


def _is_callback_into_closed_loop(unraisable) -> bool:
  """Whether an exception for `sys.unraisablehook` is tensorstore calling back into an asyncio
  loop Orbax has closed (its traceback starts at `call_soon_threadsafe`)."""
  traceback = unraisable.exc_traceback
  return (
    unraisable.exc_type is RuntimeError
    and str(unraisable.exc_value) == "Event loop is closed"
    and traceback is not None
    and traceback.tb_frame.f_code.co_name == "call_soon_threadsafe"
  )


def hide_disk_full_logs() -> None:
  """Hides libraries' reports of a full disk, which the command states in one line
  (`DiskFullError`). Orbax logs each failed background write with its traceback (hundreds of
  lines); the writes it then abandons finish on event loops it has closed, and tensorstore
  reports each `RuntimeError: Event loop is closed` through `sys.unraisablehook`. Idempotent."""
  import sys

  from absl import logging as absl_logging

  handler = absl_logging.get_absl_handler()
  if _not_about_a_full_disk not in handler.filters:
    handler.addFilter(_not_about_a_full_disk)
  if getattr(sys.unraisablehook, "hides_closed_loop_callbacks", False):
    return
  shown = sys.unraisablehook

  def unraisablehook(unraisable):
    if not _is_callback_into_closed_loop(unraisable):
      shown(unraisable)

  unraisablehook.hides_closed_loop_callbacks = True
  sys.unraisablehook = unraisablehook


def not_an_abandoned_checkpoint_read(record) -> bool:
  """A `logging` filter for the `asyncio` logger: False for its report of an Orbax read whose
  failure nobody retrieved. Orbax reads a checkpoint's arrays in concurrent tasks and raises the
  first failure; each other failed task, and each tensorstore future behind one, is reported, with
  its traceback, when it is collected, or at exit (where formatting it fails again: `ImportError:
  sys.meta_path is None`). The damaged checkpoint is reported in one line instead
  (`checkpointing`)."""
  message = record.getMessage()
  if not message.startswith(("Task exception was never retrieved", "Future exception was never")):
    return True
  error = record.exc_info[1] if record.exc_info else None
  traceback = record.exc_info[2] if record.exc_info else None
  if traceback is None:
    # A tensorstore future fails in C++: no Python frame, only tensorstore's spec in its message.
    return not (isinstance(error, ValueError) and "tensorstore_spec" in str(error))
  while traceback is not None:  # frame by frame: nothing imported, it may run at exit
    if "/orbax/checkpoint/" in traceback.tb_frame.f_code.co_filename:
      return False
    traceback = traceback.tb_next
  return True


def hide_abandoned_checkpoint_reads() -> None:
  """Installs `not_an_abandoned_checkpoint_read` on the `asyncio` logger. Idempotent."""
  import logging

  logger = logging.getLogger("asyncio")
  if not_an_abandoned_checkpoint_read not in logger.filters:
    logger.addFilter(not_an_abandoned_checkpoint_read)


def close_all(closers, pending: BaseException | None = None) -> None:
  """Calls every ``closer()``, even after one fails; then raises the first failure, unless
  ``pending`` (the error already ending the run) says more: a checkpoint manager re-raises its
  failed background save when closed, which would hide why the run stopped. A full disk found
  on closing is raised over any ``pending`` error but another full disk.

  Args:
    closers: callables without arguments (e.g. each run's ``close``).
    pending: the exception propagating while closing, or None.
  """
  failure = None
  for close in closers:
    try:
      close()
    except Exception as e:  # noqa: BLE001 - every closer runs; the first failure is re-raised
      failure = failure or e
  if failure is None:
    return
  if pending is None or (is_disk_full(failure) and not is_disk_full(pending)):
    raise failure


class DiskFullError(UserError):
  """Writing into the workdir failed because its disk is full."""

  def __init__(self, folder: str):
    super().__init__(
      f"no space left on the disk of {folder}; free space there and re-run the "
      "same command to resume"
    )


class ReportNotSavedError(UserError):
  """A result was computed but its file could not be written (a read-only workdir, a full disk).

  Attributes:
    report: what was to be written, for the command to print before its one-line error.
  """

  def __init__(self, path: str, error: OSError, report):
    super().__init__(
      f"could not write {path}: {error.strerror or error}; the results printed above were not "
      "saved (make the folder writable, or copy the workdir somewhere writable, and re-run)"
    )
    self.report = report
