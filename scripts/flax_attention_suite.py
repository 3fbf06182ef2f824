"""Runs Flax's own attention tests with a primal_dual kernel as Flax's attention function.

Usage (Flax's test files are not part of this repository; take them from a Flax checkout of the
installed version)::

  python scripts/flax_attention_suite.py FLAX_CHECKOUT/tests/linen/linen_attention_test.py \
      FLAX_CHECKOUT/tests/nnx/nn/attention_test.py [--kernel softmax_attention] [pytest args]

Before the tests are collected, ``flax.linen.dot_product_attention`` and
``flax.nnx.dot_product_attention`` become the kernel, and so does the default ``attention_fn`` of
``flax.linen.MultiHeadDotProductAttention`` (and its subclasses) and of
``flax.nnx.MultiHeadAttention``: every test that uses Flax's default attention runs ours. Prints
pytest's summary, i.e. how many of Flax's tests pass with the kernel.
"""

from __future__ import annotations

import argparse
import inspect
import sys


def _with_subclasses(cls) -> list[type]:
  """``cls`` and every subclass of it (the Linen aliases MultiHeadAttention, SelfAttention)."""
  found = [cls]
  for sub in cls.__subclasses__():
    found += _with_subclasses(sub)
  return found


def _set_linen_default(cls, kernel) -> None:
  """The default ``attention_fn`` of a Linen dataclass: its generated __init__ keeps its defaults
  positionally."""
  init = inspect.unwrap(cls.__init__)
  names = [
    name
    for name, parameter in inspect.signature(init).parameters.items()
    if parameter.default is not inspect.Parameter.empty
  ]
  defaults = list(init.__defaults__)
  defaults[names.index("attention_fn")] = kernel
  init.__defaults__ = tuple(defaults)
  cls.__dataclass_fields__["attention_fn"].default = kernel


def install(kernel) -> None:
  """Makes ``kernel`` Flax's attention function, in functions and module defaults."""
  import flax.linen as nn
  import flax.linen.attention as linen_attention
  import flax.nnx as nnx
  import flax.nnx.nn.attention as nnx_attention

  for module in (nn, linen_attention, nnx, nnx_attention):
    module.dot_product_attention = kernel
  for cls in _with_subclasses(nn.MultiHeadDotProductAttention):
    _set_linen_default(cls, kernel)
  nnx_init = nnx.MultiHeadAttention.__init__
  nnx_init.__kwdefaults__ = {**nnx_init.__kwdefaults__, "attention_fn": kernel}


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("test_files", nargs="+")
  parser.add_argument("--kernel", default="softmax_attention", help="a primal_dual.kernels name")
  args, pytest_args = parser.parse_known_args(argv)
  import pytest

  from primal_dual import kernels

  install(getattr(kernels, args.kernel))
  return pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args, *args.test_files])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
