"""Evaluate a training workdir: `python eval.py --workdir=<dir> [--splits=test,validation]
[--checkpoint=latest|selected|<step>] [--analyses=redundancy]`, the same as `primal-dual eval`.

The command itself (flags, analyses, eval.json) is `primal_dual/commands/evaluate.py`.
"""

from primal_dual.commands import evaluate as _command
from primal_dual.commands import cli

_command.define_flags()
main = _command.main

if __name__ == "__main__":
  cli.run_command(main)
