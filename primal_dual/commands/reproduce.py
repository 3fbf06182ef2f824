"""`primal-dual reproduce TASK [flags]`: a task's paper-reproduction grid, the same as
`python scripts/reproduce.py TASK [flags]`; `primal-dual reproduce TASK --help` lists its flags.

Each grid lives in its task module `primal_dual/experiments/<TASK>.py` (`REPRODUCTION`; its
`--help` gives the commands and what they cost). Every grid takes `--root`, `--results`, `--jobs`,
`--quick`, `--dry_run` and `--report_only`, plus its task's own flags; it trains every unfinished
run under `--root` and writes its results (JSON, Markdown, figures) relative to the current folder.
"""

import importlib
import sys

from primal_dual import experiments


def usage() -> str:
  return (
    f"usage: primal-dual reproduce {{{','.join(experiments.task_names())}}} [flags]\n\n{__doc__}"
  )


def main(argv: list[str]) -> int:
  """Runs the grid of task `argv[0]` with the flags `argv[1:]`; returns its exit status."""
  if not argv or argv[0] in ('-h', '--help'):
    print(usage(), file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  task, args = argv[0], argv[1:]
  tasks = experiments.task_names()
  if task not in tasks:
    print(
      f"error: unknown reproduction {task!r}; choose one of {', '.join(tasks)}", file=sys.stderr
    )
    return 2
  module = importlib.import_module(f'{experiments.__name__}.{task}')
  reproduction = getattr(module, 'REPRODUCTION', None)
  if reproduction is None:
    print(f"error: task {task!r} has no reproduction grid (REPRODUCTION)", file=sys.stderr)
    return 2
  from primal_dual.experiments import grid  # pylint: disable=g-import-not-at-top

  return grid.reproduce(reproduction, args)
