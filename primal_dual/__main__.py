"""`python -m primal_dual train|eval|reproduce ...`: the `primal-dual` console command."""

import sys

from primal_dual.commands import main

if __name__ == "__main__":
  sys.exit(main())
