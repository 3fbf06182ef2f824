"""Attention as the dual of support vector regression, in JAX/Flax.

``primal_dual.kernels`` holds the attention functions (Flax ``attention_fn`` contract) and
``primal_dual.layers`` the multi-head layer and the registry of variants. Training, data and
analysis modules need the ``[train]`` extra and are imported on their own.
"""

__version__ = "0.1.0"  # The only place the version is written; pyproject.toml reads it.

from primal_dual import kernels, layers  # noqa: E402  (after __version__, which setuptools reads)

__all__ = ["__version__", "kernels", "layers"]
