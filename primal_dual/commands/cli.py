"""What the commands (`primal-dual train|eval`, `train.py`, `eval.py`) share: every problem a user
can fix is one line, exit status 2; training stopped by SIGTERM (pre-emption) is one line too,
with its own status, 75 (`EXIT_PREEMPTED`), after saving a checkpoint.

Flag parsing (absl, and ml_collections' `--config` file with its `--config.<field>` overrides)
raises a variety of exceptions with multi-line messages or tracebacks; `parse_flags` turns each
into one line `error: ...`. Only ml_collections and absl are imported here, so that these errors
come back before JAX is loaded.
"""

import difflib
import os
import sys
import traceback
from typing import Callable, NoReturn

from absl import app
from absl import flags
from absl import logging

from primal_dual.training import config_lib
from primal_dual.training import errors

EXIT_USER_ERROR = 2
# Training stopped by SIGTERM after saving a checkpoint of the step reached: re-running the same
# command resumes. 75 is sysexits.h's EX_TEMPFAIL ("try again later"); a process killed by the
# signal itself (a second SIGTERM, or one outside the training loop) ends with 143 as usual.
EXIT_PREEMPTED = 75

# What absl and ml_collections raise while parsing flags or loading a config file.
_FLAG_ERRORS = (
  flags.Error,
  KeyError,
  AttributeError,
  OSError,
  ValueError,
  TypeError,
  ImportError,
  SyntaxError,
)


def run_command(main: Callable[[list[str]], int], argv: list[str] | None = None) -> NoReturn:
  """absl's `app.run` of a command's `main` (`primal_dual/commands/`) with `parse_flags`; exits
  with main's return value, or quietly when the reader of its output has left
  (`python train.py --help | head -1`)."""
  from primal_dual import commands

  sys.exit(commands.quiet_when_the_reader_leaves(lambda: _run_absl(main, argv)))


def _run_absl(main: Callable[[list[str]], int], argv: list[str] | None) -> NoReturn:
  app.run(main, argv=argv, flags_parser=parse_flags)
  raise AssertionError("app.run returned")  # it exits


def show_in_help(module_name: str) -> None:
  """absl's `--help` lists the flags of the main module (`sys.argv[0]`) only; the commands define
  theirs in `module_name` (`primal_dual/commands/`), so they are listed for the main module too."""
  for flag in flags.FLAGS.get_flags_for_module(module_name):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def not_a_save_wait_warning(record) -> bool:
  """A `logging` filter: False for Orbax's warning that a save waited for the previous one (the
  progress bar's steps/s already shows the pace; on a loaded machine the warning also came out
  beside a stopped run's one-line error)."""
  return not record.getMessage().startswith("Waiting for previous save to complete")


def start_main(argv: list[str]) -> None:
  """The common start of the commands' `main`: no stray positional arguments, and Orbax's
  per-save INFO logs and its save-wait warnings hidden unless `--verbosity` was given, and
  libraries' logs of a full disk and of a damaged checkpoint's reads hidden (the command reports
  each in one line)."""
  if len(argv) > 1:
    fail(
      f"unexpected arguments: {' '.join(argv[1:])}; give every flag as --name=value "
      f"(`{argv[0]} --help` lists them)"
    )
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
    handler = logging.get_absl_handler()
    if not_a_save_wait_warning not in handler.filters:
      handler.addFilter(not_a_save_wait_warning)
  errors.hide_disk_full_logs()
  errors.hide_abandoned_checkpoint_reads()


def report(message: str) -> int:
  """Prints `error: <message>` as one line on stderr; returns the exit status for it, 2."""
  print(f"error: {one_line(message)}", file=sys.stderr)
  return EXIT_USER_ERROR


def report_and_exit_now(message: str) -> NoReturn:
  """`report`, then ends the process at once: after a full disk nothing more can be written, and
  libraries' exit-time writes (TensorBoard's last flush, Orbax's abandoned saves) would each
  print a traceback under the one line."""
  status = report(message)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def fail(message: str) -> NoReturn:
  """`report`, then exits (for flag parsing, which has no exit status to return)."""
  sys.exit(report(message))


def one_line(message: str) -> str:
  """`message` with its line breaks and runs of spaces folded into single spaces."""
  return " ".join(str(message).split())


def user_error_in_chain(error: BaseException | None) -> errors.UserError | None:
  """The innermost `UserError` in `error`'s cause/context chain (config files raise them while
  ml_collections loads them, and ml_collections wraps them), or None."""
  found, seen = None, set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, errors.UserError):
      found = error
    error = error.__cause__ or error.__context__
  return found


def _config_file_and_arg(spec: str) -> tuple[str, str | None]:
  """'uea.py:dataset=X' → ('uea.py', 'dataset=X')."""
  path, has_arg, arg = spec.partition(":")
  return path, (arg if has_arg else None)


def _flag_values(argv: list[str], name: str) -> list[tuple[str, str]]:
  """(flag name, value) for every `--<name>...=value` / `--<name>... value` in argv."""
  found = []
  for index, item in enumerate(argv):
    if not item.startswith(f"--{name}"):
      continue
    flag, has_value, value = item[2:].partition("=")
    if not has_value and index + 1 < len(argv):
      value = argv[index + 1]
    found.append((flag, value))
  return found


def _load_config(spec: str):
  """Calls `get_config(arg)` of the config file or packaged name `spec` names, without
  overrides."""
  from primal_dual import configs

  return configs.load(*_config_file_and_arg(spec))


def unknown_field_message(config, field: str) -> str | None:
  """'unknown config field --config.a.b; did you mean --config.a.c?' if `field` (dotted, without
  'config.') is not in `config`, else None. The suggestion is difflib's closest name; a field of
  earlier versions names its successor (`config_lib.RETIRED_FIELDS`)."""
  if field in config_lib.RETIRED_FIELDS and field not in config:
    return config_lib.retired_field_message(field)
  node, parts = config, field.split(".")
  for depth, part in enumerate(parts):
    keys = list(node.keys()) if hasattr(node, "keys") else []
    if part in keys:
      node = node[part]
      continue
    message = f"unknown config field --config.{field}"
    close = difflib.get_close_matches(part, keys, n=1)
    if close:
      fixed = ".".join(parts[:depth] + close + parts[depth + 1 :])
      return f"{message}; did you mean --config.{fixed}?"
    return f"{message}; known at that level: {', '.join(sorted(keys)) or '(none)'}"
  return None


def _describe_config_override_error(argv: list[str], config_flag: str) -> str | None:
  """Names the unknown `--config.<field>` override in argv, or None if none is unknown."""
  specs = [value for flag, value in _flag_values(argv, config_flag) if flag == config_flag]
  if not specs:
    return None
  try:
    config = _load_config(specs[-1])
  except Exception:
    return None  # the file itself is the problem; reported from the original error
  for flag, _ in _flag_values(argv, f"{config_flag}."):
    message = unknown_field_message(config, flag[len(config_flag) + 1 :])
    if message:
      return message
  return None


def describe_flag_error(error: BaseException, argv: list[str], config_flag: str = "config") -> str:
  """One line saying what is wrong with the command line that raised `error` while parsing."""
  user_error = user_error_in_chain(error)
  if user_error is not None:
    return str(user_error)
  if isinstance(error, (KeyError, AttributeError)):
    described = _describe_config_override_error(argv, config_flag)
    if described:
      return described
  if isinstance(error, flags.Error):
    return str(error)
  # Anything else came from the code of a config file: say what and where, as a traceback would.
  frames = traceback.extract_tb(error.__traceback__)
  where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
  return f"loading the config failed{where}: {type(error).__name__}: {error}"


def resolve_config_specs(argv: list[str], config_flag: str = "config") -> list[str]:
  """argv with each `--<config_flag>=<file or packaged name>[:arg]` naming the config's file
  (`primal_dual.configs.resolve`: `--config=uea:dataset=X` works from any folder).

  Raises:
    ConfigError: an unknown short name or a missing file (one line, the packaged names listed).
  """
  from primal_dual import configs

  resolved, index = list(argv), 0
  while index < len(resolved):
    item = resolved[index]
    if item == f"--{config_flag}" and index + 1 < len(resolved):
      resolved[index + 1] = configs.resolve_spec(resolved[index + 1])
      index += 1
    elif item.startswith(f"--{config_flag}="):
      resolved[index] = f"--{config_flag}=" + configs.resolve_spec(item.partition("=")[2])
    index += 1
  return resolved


def _check_config_file(config_flag: str) -> None:
  """ml_collections reports a problem with a config file only when the config is first read;
  read it now so that the problem is reported with the flags'."""
  if config_flag not in flags.FLAGS or flags.FLAGS[config_flag].config_filename is None:
    return
  _ = flags.FLAGS[config_flag].value.keys()


def parse_flags(argv: list[str], config_flag: str = "config") -> list[str]:
  """absl's flag parsing for `app.run(main, flags_parser=parse_flags)`, with errors in one line.

  Returns:
    The arguments left after the flags (argv[0] first), as absl's own parser does.
  """
  try:
    argv = resolve_config_specs(argv, config_flag)
    remaining = flags.FLAGS(argv)
    _check_config_file(config_flag)
  except BrokenPipeError:  # absl's --help to a reader that left: not a flag error
    raise
  except _FLAG_ERRORS as e:  # UserError is a ValueError
    fail(describe_flag_error(e, argv, config_flag))
  except SystemExit as e:
    # absl prints the help asked for, then exits with status 1; asking for help is no failure.
    if e.code == 1 and HELP_FLAGS.intersection(argv[1:]):
      sys.exit(0)
    raise
  return remaining


# absl's help flags (`flags.HelpFlag` and its kin), which print and exit.
HELP_FLAGS = frozenset({"--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml"})
