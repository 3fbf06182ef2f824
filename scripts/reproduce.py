"""`python scripts/reproduce.py TASK [flags]`, the same as `primal-dual reproduce TASK [flags]`.

The grids, their flags and the commands for each scale: `python scripts/reproduce.py TASK --help`
(the code: `reproduce/<TASK>.py`).
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # a clone without the package installed
  sys.path.insert(0, REPO_ROOT)

from primal_dual.commands import reproduce  # noqa: E402

if __name__ == "__main__":
  sys.exit(reproduce.main(sys.argv[1:]))
