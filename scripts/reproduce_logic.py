"""`python scripts/reproduce_logic.py [flags]`, the same as `primal-dual reproduce logic [flags]`.

The grid, its flags and the commands for each scale: primal_dual/experiments/reproduce/logic.py.
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # a clone without the package installed
  sys.path.insert(0, REPO_ROOT)

from primal_dual.experiments.reproduce.logic import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
