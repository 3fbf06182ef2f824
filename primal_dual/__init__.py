"""Attention as the dual of support vector regression, in JAX/Flax.

``primal_dual.kernels`` holds the attention functions (Flax ``attention_fn`` contract),
``primal_dual.layers`` the multi-head layer and the registry of variants, and ``primal_dual.nnx``
the same layer as a ``flax.nnx`` module. Each is imported on first access, so that ``import
primal_dual`` loads neither jax nor flax: a command that stops at a user error before it needs them
(a config file not found) answers in 0.1 s rather than 2.3 s. Training,
data and analysis modules need the ``[train]`` extra and are imported on their own.
"""

__version__ = "0.1.0"  # The only place the version is written; pyproject.toml reads it.

_SUBMODULES = ("kernels", "layers", "nnx")
__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str):
  """The submodules, imported on first access (PEP 562)."""
  if name in _SUBMODULES:
    import importlib

    return importlib.import_module(f"primal_dual.{name}")
  raise AttributeError(f"module 'primal_dual' has no attribute {name!r}")
