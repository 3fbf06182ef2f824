"""`python scripts/reproduce.py TASK [flags]`, the same as `primal-dual reproduce TASK [flags]`.

The grids, their flags and the commands for each scale: `python scripts/reproduce.py TASK --help`
(the code: `reproduce/<TASK>.py`).
"""

import os
import sys

SCRIPTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(SCRIPTS_DIR)
# This file's folder comes first in sys.path, where this file would stand for the clone's
# `reproduce` package of the same name; the clone's root goes first instead.
sys.path[:] = [REPO_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != SCRIPTS_DIR]

from primal_dual.commands import reproduce  # noqa: E402

if __name__ == "__main__":
  sys.exit(reproduce.main(sys.argv[1:]))
