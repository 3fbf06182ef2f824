"""JAX's Mosaic GPU interpreter for the project's Mosaic GPU kernels off GPU: the one place that
fills its gaps.

JAX runs a Pallas Mosaic GPU kernel's own code on the CPU when ``interpret=`` is given an
``InterpretGPUParams`` (simulated shared memory, barriers and TMA copies; ``wgmma`` by NumPy). On
jax 0.10.2 two things the project's kernels use are missing there, and :func:`params` adds them,
process-wide and idempotently:

* ``plgpu.layout_cast`` has no CPU rule. A register layout decides where a value lives on a GPU,
  not what it is, so off GPU it is the identity;
* refs indexed by a loop's index (``ref.at[pl.ds(block * 16, 16)]``) are refused ("Dynamic
  indexing not supported in GPU interpret mode"), although the interpreter's callbacks see the
  index as a concrete number and read the right range. The refusal is lifted; the other
  transforms it checks are still refused.

Both reach into internals (``jax._src.pallas.mosaic_gpu``), so they were checked on the jax
versions of :data:`CHECKED_JAX_VERSIONS` only; under another one :func:`params` warns.
"""

from __future__ import annotations

import functools
import warnings

import jax

# The jax releases whose Mosaic GPU interpreter these additions were checked on (the Mosaic HYLA
# kernel's tests pass under them).
CHECKED_JAX_VERSIONS = ("0.10.2",)


@functools.cache
def _fill_gaps() -> None:
  from jax._src.state import indexing
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  from jax.interpreters import mlir

  mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")

  def validate_transforms(transforms):
    for transform in transforms:
      if not isinstance(transform, indexing.NDIndexer):
        raise ValueError(f"Unsupported transform: {transform}")

  gpu_callbacks._validate_transforms = validate_transforms


def params():
  """The ``interpret=`` argument that runs a Mosaic GPU kernel on the CPU (gaps filled)."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  if jax.__version__ not in CHECKED_JAX_VERSIONS:
    warnings.warn(
      f"primal_dual.kernels.mosaic_interpreter was checked on jax {CHECKED_JAX_VERSIONS}, "
      f"not {jax.__version__}",
      stacklevel=2,
    )
  _fill_gaps()
  return InterpretGPUParams()
