"""`primal-dual reproduce STUDY [flags]`: a paper study's grid of training runs, the same as
`python scripts/reproduce.py STUDY [flags]`; `primal-dual reproduce STUDY --help` lists its flags.

The grids live beside the package, in the repository's `reproduce/` folder (one module per study,
`REPRODUCTION`; its `--help` gives the commands and what they cost), so this command runs from a
clone: `pip install -e ".[train]"` in it, or run it from the clone's root. Every grid takes
`--root`, `--results`, `--jobs`, `--quick`, `--dry_run`, `--report_only` and `--finished_only`,
plus its study's own flags; it trains every unfinished run under `--root` and writes its results (JSON, Markdown,
figures) relative to the current folder.
"""

from __future__ import annotations

import importlib
import os
import sys

import primal_dual

STUDIES_PACKAGE = "reproduce"
NOT_IN_A_CLONE = (
  "error: the reproduction grids live in the repository's reproduce/ folder, which a pip install "
  "of the package does not carry; run this from a clone of primal_dual (pip install -e "
  "'.[train]' inside it, or run from its root)"
)


def _clone_roots() -> list[str]:
  """Folders that may hold ``reproduce/``: the clone an editable install points to, then the
  current folder."""
  package_parent = os.path.dirname(os.path.dirname(os.path.abspath(primal_dual.__file__)))
  return list(dict.fromkeys([package_parent, os.getcwd()]))


def find_studies():
  """The ``reproduce`` package of the clone this package runs from, or None outside a clone."""
  for root in _clone_roots():
    if os.path.isfile(os.path.join(root, STUDIES_PACKAGE, "grid.py")):
      if root not in sys.path:
        sys.path.insert(0, root)
      return importlib.import_module(STUDIES_PACKAGE)
  return None


def usage(studies) -> str:
  names = ",".join(studies.study_names()) if studies is not None else "STUDY"
  return f"usage: primal-dual reproduce {{{names}}} [flags]\n\n{__doc__}"


def main(argv: list[str]) -> int:
  """Runs the grid of study `argv[0]` with the flags `argv[1:]`; returns its exit status."""
  studies = find_studies()
  if not argv or argv[0] in ("-h", "--help"):
    print(usage(studies), file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  if studies is None:
    print(NOT_IN_A_CLONE, file=sys.stderr)
    return 2
  study, args = argv[0], argv[1:]
  names = studies.study_names()
  if study not in names:
    print(
      f"error: unknown reproduction {study!r}; choose one of {', '.join(names)}", file=sys.stderr
    )
    return 2
  module = importlib.import_module(f"{STUDIES_PACKAGE}.{study}")
  grid = importlib.import_module(f"{STUDIES_PACKAGE}.grid")
  return grid.reproduce(module.REPRODUCTION, args)
