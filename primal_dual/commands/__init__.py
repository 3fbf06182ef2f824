"""The `primal-dual` console command (pyproject.toml `[project.scripts]`)::

  primal-dual train --config=default:runlocal --workdir=/tmp/run   # the same as python train.py
  primal-dual eval --workdir=/tmp/run                               # the same as python eval.py
  primal-dual reproduce uea --dry_run                    # python scripts/reproduce.py uea --dry_run
  primal-dual list                     # the variants, the configs with their arguments, the studies

`primal-dual <command> --help` lists a command's flags. `train` and `eval` are absl programs
(`primal_dual/commands/train.py`, `evaluate.py`); `reproduce STUDY` runs the grid of
the clone's `reproduce/<STUDY>.py`. A problem the user can fix is one line
`error: ...` with exit status 2; output cut short by its reader (`primal-dual list | head -3`)
ends quietly with status 141, as a Unix tool's.
"""

import importlib
import os
import signal
import sys
from typing import Callable, NoReturn

PROG = "primal-dual"

# Command → module with `define_flags()` and an absl `main(argv)`.
ABSL_COMMANDS = {"train": "primal_dual.commands.train", "eval": "primal_dual.commands.evaluate"}
COMMANDS = (*ABSL_COMMANDS, "reproduce", "list")


# The top-level modules of the `[train]` extra (pyproject.toml) that train and eval import first.
TRAIN_EXTRA_MODULES = frozenset(
  {"absl", "ml_collections", "orbax", "optax", "grain", "tensorboardX"}
)
PIP_INSTALL_TRAIN_EXTRA = "pip install 'primal_dual[train]'"
INSTALL_TRAIN_EXTRA = f"install the train extra: {PIP_INSTALL_TRAIN_EXTRA}"


def missing_train_extra(error: ModuleNotFoundError) -> bool:
  """Whether `error` is the import of a module of the `[train]` extra."""
  return (error.name or "").partition(".")[0] in TRAIN_EXTRA_MODULES


def _run_absl_command(name: str, args: list[str]) -> NoReturn:
  """Runs `train` or `eval` as `python train.py`/`eval.py` would (absl exits with main's status);
  from a base install without the `[train]` extra, one line saying how to install it."""
  try:
    from primal_dual.commands import cli

    module = importlib.import_module(ABSL_COMMANDS[name])
  except ModuleNotFoundError as e:
    if not missing_train_extra(e):
      raise
    print(f"error: `{PROG} {name}` needs {e.name}; {INSTALL_TRAIN_EXTRA}", file=sys.stderr)
    sys.exit(2)
  sys.argv = [f"{PROG} {name}", *args]  # absl's --help names sys.argv[0] and prints __main__'s doc
  sys.modules["__main__"].__doc__ = module.__doc__
  module.define_flags()
  cli.run_command(module.main, sys.argv)


# The status of output cut short by its reader: what a shell reports for a Unix tool that
# SIGPIPE ended (Python ignores the signal and raises BrokenPipeError instead).
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def quiet_when_the_reader_leaves(run: Callable[[], int]) -> int:
  """`run()`'s status, or `EXIT_BROKEN_PIPE` with nothing printed when the reader of stdout has
  left (`primal-dual list | head -3`). A `SystemExit` (absl's commands exit) passes through."""
  try:
    try:
      return run()
    finally:
      sys.stdout.flush()  # what is still buffered fails here, not in the interpreter's exit
  except BrokenPipeError:
    # Python flushes stdout again at exit; point it at /dev/null so that nothing more is raised.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
  """`primal-dual COMMAND [flags]`; returns the exit status (train and eval exit themselves).

  Output cut short by its reader (`primal-dual reproduce uea --dry_run | head`) ends quietly."""
  return quiet_when_the_reader_leaves(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(__doc__, file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  name, args = argv[0], argv[1:]
  if name in ABSL_COMMANDS:
    _run_absl_command(name, args)  # exits
  if name == "reproduce":
    from primal_dual.commands import reproduce

    return reproduce.main(args)
  if name == "list":
    from primal_dual.commands import listing  # the base install's modules only

    return listing.main(args)
  print(
    f"error: unknown command {name!r}; choose one of {', '.join(COMMANDS)} (`{PROG} --help`)",
    file=sys.stderr,
  )
  return 2
