"""The ``[gpu-dev]`` extra (triton, torch; jax-triton on a GPU) in the tests.

A test of the Triton kernels or of the device tooling that needs the extra calls :func:`require`
(at module level for a whole file) and, where it is missing, is skipped with :data:`REASON`,
never silently; nothing else in the suite needs it. ``make test`` installs it, so the interpreter
tests always run there. Triton's interpreter is patched in one place,
``primal_dual/kernels/triton_interpreter.py``, which names the Triton versions it was checked on.
"""

import os
import sys

import pytest

REASON = "{} needs {} of the [gpu-dev] extra (triton, torch), not installed: make install-gpu-dev"


def require(*modules: str) -> None:
  """Skips the calling test (or module) unless ``modules`` (default: triton and torch) import;
  the reason names the calling file, as pytest's summary gives this file's line."""
  caller = os.path.basename(sys._getframe(1).f_code.co_filename)
  for module in modules or ("triton", "torch"):
    pytest.importorskip(module, reason=REASON.format(caller, module))
