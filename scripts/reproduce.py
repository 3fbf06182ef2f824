"""`python scripts/reproduce.py STUDY [flags]`, the same as `primal-dual reproduce STUDY [flags]`.

The grids, their flags and the commands for each scale: `python scripts/reproduce.py STUDY --help`
(the code: `reproduce/<STUDY>.py`).
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Python puts this script's folder first on the path, where `import reproduce` would find this
# file instead of the studies' package: the repository root takes its place (it also serves a
# clone without the package installed).
SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [REPO_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != SCRIPT_DIR]

from primal_dual import commands
from primal_dual.commands import reproduce as reproduce_command

if __name__ == "__main__":
  sys.exit(commands.quiet_when_the_reader_leaves(lambda: reproduce_command.main(sys.argv[1:])))
