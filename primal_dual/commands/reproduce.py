"""`primal-dual reproduce TASK [flags]`: a paper-reproduction grid, the same as
`python scripts/reproduce_<TASK>.py [flags]`; `primal-dual reproduce TASK --help` lists its flags.

Each grid lives in `primal_dual/experiments/reproduce/<TASK>.py` (its docstring gives the commands
and what they cost); it trains every unfinished run under `--root` and writes its results (JSON,
Markdown, figures) relative to the current folder, as the scripts do from a clone's root.
"""

import importlib
import sys

TASKS = ('uea', 'listops', 'images', 'sraven', 'logic')


def usage() -> str:
  return f"usage: primal-dual reproduce {{{','.join(TASKS)}}} [flags]\n\n{__doc__}"


def main(argv: list[str]) -> int:
  """Runs the grid `argv[0]` with the flags `argv[1:]`; returns its exit status."""
  if not argv or argv[0] in ('-h', '--help'):
    print(usage(), file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  task, args = argv[0], argv[1:]
  if task not in TASKS:
    print(
      f"error: unknown reproduction {task!r}; choose one of {', '.join(TASKS)}", file=sys.stderr
    )
    return 2
  module = importlib.import_module(f'primal_dual.experiments.reproduce.{task}')
  sys.argv = [f'primal-dual reproduce {task}', *args]  # argparse's prog (its usage and errors)
  return module.main(args)
