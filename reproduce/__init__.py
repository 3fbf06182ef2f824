"""The paper studies, beside the library (as big_vision keeps its projects outside the core): one
module per study (``uea``, ``listops``, ``images``, ``sraven``, ``logic``), each declaring its grid of
training runs, record schema, Markdown report, reference numbers and figures as a ``Reproduction``
(``grid.py``, the small grid library they share; ``hyla_paper.py``, what the HYLA paper's two
studies share). Run one with ``primal-dual reproduce <study>`` or ``python scripts/reproduce.py
<study>`` from a clone of the repository.
"""

import pkgutil

# The modules here that are not studies: what the studies share, the lease tool, and the
# three tools that run, check and report the HYLA paper's own code.
SHARED_MODULES = (
  "grid",
  "hyla_paper",
  "lease",
  "official_parity",
  "official_report",
  "official_sraven",
)


def study_names() -> list[str]:
  """The study modules of this package, sorted (found on disk; nothing is imported)."""
  return sorted(
    module.name
    for module in pkgutil.iter_modules(__path__)
    if not module.name.startswith("_") and module.name not in SHARED_MODULES
  )
