"""Analyses of trained models: head redundancy, latent-code decoding, FLOPs, plots.

Analyses that run on a restored workdir are registered by name in ``ANALYSES`` as
``'module:function'`` strings, imported only when asked for (this package imports nothing heavy).
Every analysis has the signature::

  run(program, state, *, split: str, max_examples: int, out_dir: str | None) -> dict

where ``program`` is ``setup.build_program``'s Program, ``state`` the restored
TrainState, and the returned dict is JSON-able (``eval.py --analyses=...`` writes it into
``eval.json``; figures go to ``out_dir``). Example::

  from primal_dual import analysis
  from primal_dual.training import evaluation
  program, state = evaluation.restore_workdir('workdirs/jv', 'latest')
  analysis.run_analyses(['redundancy'], program, state, split='test', out_dir='workdirs/jv')
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

# Analysis name → 'module:function'.
ANALYSES: dict[str, str] = {
  "redundancy": "primal_dual.analysis.attention_maps:run_redundancy",
  "latent_code": "primal_dual.analysis.latent_code:run",
}


def register_analysis(name: str, target: str, *, overwrite: bool = False) -> None:
  """Adds ``name`` → ``'module:function'`` to ``ANALYSES``."""
  if name in ANALYSES and not overwrite:
    raise ValueError(f"analysis {name!r} is already registered; pass overwrite=True")
  if target.count(":") != 1:
    raise ValueError(f"analysis target must be 'module:function'; got {target!r}")
  ANALYSES[name] = target


def get_analysis(name: str) -> Callable[..., dict[str, Any]]:
  """The function registered as ``name``, imported now.

  Raises:
    errors.UnknownNameError (a ValueError): no such analysis; the message lists the known ones.
  """
  from primal_dual.training import errors

  module_name, function_name = errors.lookup(ANALYSES, name, "analysis (--analyses)").split(":")
  return getattr(importlib.import_module(module_name), function_name)


def run_analyses(
  names: Sequence[str],
  program,
  state,
  *,
  split: str | None = None,
  max_examples: int | None = None,
  out_dir: str | None = None,
) -> dict[str, dict[str, Any]]:
  """Runs the named analyses (all looked up first, so a typo fails before any work).

  ``split=None`` / ``max_examples=None`` leave each analysis its own default (redundancy: the
  test split, every example; latent_code: the OOD split, its own cap).
  """
  functions = {name: get_analysis(name) for name in names}
  options = {
    key: value
    for key, value in (("split", split), ("max_examples", max_examples))
    if value is not None
  }
  return {name: fn(program, state, out_dir=out_dir, **options) for name, fn in functions.items()}
