"""Attention as the dual of support vector regression, in JAX/Flax.

``primal_dual.kernels`` holds the attention functions (Flax ``attention_fn`` contract),
``primal_dual.layers`` the multi-head layer and the registry of variants, and ``primal_dual.nnx``
the same layer as a ``flax.nnx`` module (imported on first access, so that ``import primal_dual``
does not load ``flax.nnx``). Training, data and analysis modules need the ``[train]`` extra and
are imported on their own.
"""

__version__ = "0.1.0"  # The only place the version is written; pyproject.toml reads it.

from primal_dual import kernels, layers  # after __version__, which setuptools reads

__all__ = ["__version__", "kernels", "layers", "nnx"]


def __getattr__(name: str):
  """``primal_dual.nnx``, imported on first access (PEP 562)."""
  if name == "nnx":
    import importlib

    return importlib.import_module("primal_dual.nnx")
  raise AttributeError(f"module 'primal_dual' has no attribute {name!r}")
