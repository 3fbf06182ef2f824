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
