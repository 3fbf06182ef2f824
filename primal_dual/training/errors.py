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
    kept = (
      "no checkpoint was saved"
      if last_checkpoint_step is None
      else f"the last good checkpoint (step {last_checkpoint_step}) is kept"
    )
    super().__init__(
      f"training loss became non-finite ({loss}) at step {step}; the run stopped and {kept}. "
      "Check the inputs for NaN, or continue from that checkpoint with a lower optimizer.lr or "
      "another optimizer.grad_clip_norm by re-running with "
      "--config.resume_with_changed_optimizer=True (turning clipping on or off needs a new "
      "--workdir)."
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
      "no checkpoint was saved yet"
      if last_checkpoint_step is None
      else f"last checkpoint step {last_checkpoint_step}"
    )
    super().__init__(f"stopped at step {step}; {kept}; re-run the same command to resume")
    self.step = step
    self.last_checkpoint_step = last_checkpoint_step


def is_disk_full(error: BaseException | None) -> bool:
  """Whether an ``OSError`` ENOSPC (no space left on the disk) is anywhere in ``error``'s
  cause/context chain (libraries re-raise write errors wrapped)."""
  import errno

  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
      return True
    error = error.__cause__ or error.__context__
  return False


class DiskFullError(UserError):
  """Writing into the workdir failed because its disk is full."""

  def __init__(self, folder: str):
    super().__init__(
      f"no space left on the disk of {folder}; free space there and re-run the "
      "same command to resume"
    )
