"""`python scripts/reproduce_sraven.py [flags]`, the same as `primal-dual reproduce sraven [flags]`.

The grid, its flags and the commands for each scale: primal_dual/experiments/reproduce/sraven.py.
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # a clone without the package installed
  sys.path.insert(0, REPO_ROOT)

from primal_dual.experiments.reproduce.sraven import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
