"""Triton's interpreter for the project's Triton kernels off GPU: the one place that patches it.

The fused HYLA kernels (:mod:`primal_dual.kernels.hyla.tensorcore`) run off GPU in Triton's
interpreter (``triton.runtime.interpreter``), which runs a ``@triton.jit`` function's own source
with NumPy for the maths and torch tensors as buffers: that is how the test-suite checks them on a
CPU, and how the device tooling checks its probes (``tools/device/``). Two things are patched here
while a kernel runs, and nowhere else in the repository:

* the ``@triton.jit`` functions a kernel calls (its module's helpers, those of other modules
  given, Triton's standard library such as ``tl.zeros``) are swapped for interpreted ones, because
  the interpreter resolves calls through module globals. Setting ``TRITON_INTERPRET=1`` before
  importing Triton does the same for the whole process, but would stop it compiling for a GPU;
* two bfloat16 faults of the interpreter, which holds bfloat16 as uint16 bit patterns, are mended
  so that it computes what the GPU does (:func:`bfloat16_mended`).

Both reach into the interpreter's internals (``interpreter_builder.create_dot``,
``create_fp_trunc``, ``TensorHandle``), so they were checked on the Triton versions of
:data:`CHECKED_TRITON_VERSIONS` only (hence the ``gpu-dev`` extra's exact pin); under another one
:func:`interpreted` warns. Needs the ``gpu-dev`` extra (triton, torch).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings

import numpy as np

# The Triton releases whose interpreter these patches were checked on (the tensorcore kernels'
# tests and the probes' interpreter checks pass under them).
CHECKED_TRITON_VERSIONS = ("3.9.0",)

_LOCK = threading.Lock()  # one interpreted kernel at a time: the patches are process-wide


def unchecked_version() -> str | None:
  """The installed Triton's version when it is not one of :data:`CHECKED_TRITON_VERSIONS`."""
  import triton

  version = triton.__version__
  return None if version in CHECKED_TRITON_VERSIONS else version


def to_torch(x: np.ndarray):
  """A torch tensor sharing ``x``'s memory (bfloat16 through an int16 view): the interpreter's
  buffers, so that a kernel's stores land in ``x``."""
  import ml_dtypes
  import torch

  if x.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
  return torch.from_numpy(np.ascontiguousarray(x))


@contextlib.contextmanager
def bfloat16_mended():
  """Two bfloat16 faults of Triton 3.9's interpreter mended while active: ``tl.dot`` multiplies
  the bit patterns as integers (its bfloat16 operands are widened to float32 first, exactly), and
  ``x.to(tl.bfloat16)`` truncates float32 (rounded to nearest even instead, as the GPU's
  ``fptrunc`` does)."""
  import ml_dtypes
  import triton.language as tl
  from triton.runtime import interpreter

  builder = interpreter.interpreter_builder
  dot, truncate = builder.create_dot, builder.create_fp_trunc

  def widened(x):
    return builder.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x

  def rounded(src, dst_type):
    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
      return truncate(src, dst_type)
    bits = src.data.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return interpreter.TensorHandle(bits, tl.bfloat16)

  builder.create_dot = lambda a, b, *rest: dot(widened(a), widened(b), *rest)
  builder.create_fp_trunc = rounded
  try:
    yield
  finally:
    del builder.create_dot, builder.create_fp_trunc  # back to the class's methods


@contextlib.contextmanager
def interpreted(*namespaces: dict):
  """Every ``@triton.jit`` function of the module ``namespaces`` given (``vars(module)`` or a
  module's ``globals()``) and of Triton's standard library swapped for an interpreted one, and
  bfloat16 mended (:func:`bfloat16_mended`), while active; one such block at a time."""
  import triton
  import triton.experimental.gluon.language  # noqa: F401 (imported by the interpreter; needs

  # the compiled library in place when it first loads)
  from triton.runtime.interpreter import InterpretedFunction

  version = unchecked_version()
  if version is not None:
    warnings.warn(
      f"Triton {version}'s interpreter runs with patches checked on Triton "
      f"{', '.join(CHECKED_TRITON_VERSIONS)} only (primal_dual/kernels/triton_interpreter.py)",
      stacklevel=3,
    )
  namespaces = [*namespaces] + [
    vars(m) for name, m in list(sys.modules.items()) if name.startswith("triton.language")
  ]
  saved = [
    (ns, {n: f for n, f in ns.items() if isinstance(f, triton.runtime.JITFunction)})
    for ns in namespaces
  ]
  with _LOCK:
    for ns, compiled in saved:
      ns.update({n: InterpretedFunction(f.fn) for n, f in compiled.items()})
    try:
      with bfloat16_mended():
        yield
    finally:
      for ns, compiled in saved:
        ns.update(compiled)


def run(kernel, grid, args, constants: dict, *namespaces: dict) -> None:
  """``kernel[grid](*args, **constants)`` in the interpreter (torch tensors as buffers), the
  helpers of ``kernel``'s own module and of ``namespaces`` interpreted (:func:`interpreted`)."""
  from triton.runtime.interpreter import InterpretedFunction

  with interpreted(kernel.fn.__globals__, *namespaces):
    InterpretedFunction(kernel.fn)[grid](*args, **constants)


def launch(kernel, grid, out_shapes, constants: dict, *inputs) -> tuple[np.ndarray, ...]:
  """``kernel(*inputs, *outputs)`` over ``grid`` in the interpreter, NumPy in and out; the
  outputs (shapes and dtypes of ``out_shapes``) start as zeros."""
  outs = [np.zeros(s.shape, s.dtype) for s in out_shapes]
  args = [to_torch(np.array(x)) for x in inputs] + [to_torch(o) for o in outs]
  run(kernel, grid, args, constants)
  return tuple(outs)
