"""How many operations a program has once lowered for a device, counted on this CPU.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` builds the CUDA program without a
GPU (as ``tests/test_lowering.py`` does): with ``jax.default_backend()`` reported as ``gpu`` (and
cuDNN's version check answered), every ``implementation='auto'`` in the library chooses its GPU
path, cuDNN's fused attention included. Nothing is compiled or run; the arguments are abstract.

An *op* is one operation of the lowered StableHLO module, in every function and nested region
(a reduction's or scatter's body included), except the structure around them: ``func.func`` and
the terminators ``func.return`` and ``stablehlo.return``. Constants count. XLA later fuses many ops
into one kernel, so this is a proxy for a program's launch overhead, not a launch count; gathers
and scatters are counted apart (on a GPU a bfloat16 scatter-add is atomics).

``python -m tools.device.lowered_ops`` prints the counts of the forward + backward (``jax.grad`` of
``sum(out)`` in float32 with respect to q, k and v) of softmax, SH and BN+SH, bfloat16, batch 1,
N 4096, 8 heads, head dim 64, ratios ``(1, 1, 2, 2, 4, 4, 8, 8)`` (tools/device/README.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp

# Lowering platform -> what jax.default_backend() says on such a device.
BACKENDS = {"cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
# A cuDNN release the fused attention accepts (the CPU has none to report).
STUB_CUDNN_VERSION = 90800
# Operations that only give a program its structure.
STRUCTURE = frozenset({"func.func", "func.return", "stablehlo.return"})
DEFAULT_VARIANTS = ("softmax", "sh", "bn_sh")
DEFAULT_RATIOS = (1, 1, 2, 2, 4, 4, 8, 8)


class OpCount(NamedTuple):
  """The ops of one lowered program (see the module docstring).

  Attributes:
    total: every op but ``STRUCTURE``.
    gathers: ``stablehlo.gather`` and ``stablehlo.dynamic_gather``.
    scatters: ``stablehlo.scatter``.
    custom_calls: ``stablehlo.custom_call`` (cuDNN's attention, ...).
    constants: ``stablehlo.constant``.
    by_name: op name -> count, every op but ``STRUCTURE``.
  """

  total: int
  gathers: int
  scatters: int
  custom_calls: int
  constants: int
  by_name: dict[str, int]


def _operations(operation) -> Iterator[Any]:
  for region in operation.regions:
    for block in region.blocks:
      for op in block.operations:
        yield op.operation
        yield from _operations(op.operation)


def count_ops(lowered) -> OpCount:
  """The :class:`OpCount` of a ``jax.stages.Lowered`` program."""
  module = lowered.compiler_ir("stablehlo")
  names = collections.Counter(op.name for op in _operations(module.operation))
  names = collections.Counter({name: n for name, n in names.items() if name not in STRUCTURE})
  return OpCount(
    total=sum(names.values()),
    gathers=names["stablehlo.gather"] + names["stablehlo.dynamic_gather"],
    scatters=names["stablehlo.scatter"],
    custom_calls=names["stablehlo.custom_call"],
    constants=names["stablehlo.constant"],
    by_name=dict(names.most_common()),
  )


@contextlib.contextmanager
def reported_backend(platform: str) -> Iterator[None]:
  """Within the block ``jax.default_backend()`` reports ``platform``'s backend and cuDNN's version
  check reports a release with fused attention; JAX's caches are cleared on entry and exit (a trace
  cached under one backend carries that backend's choices)."""
  from jax._src.cudnn import fused_attention_stablehlo  # its version check asks the CUDA libraries

  saved = jax.default_backend, fused_attention_stablehlo.check_cudnn_version
  jax.clear_caches()
  jax.default_backend = lambda: BACKENDS[platform]
  fused_attention_stablehlo.check_cudnn_version = lambda: STUB_CUDNN_VERSION
  try:
    yield
  finally:
    jax.default_backend, fused_attention_stablehlo.check_cudnn_version = saved
    jax.clear_caches()


def lower_for(fn: Callable, args: Sequence[Any], platform: str = "cuda"):
  """``jax.jit(fn)`` traced on ``args`` (arrays or ``jax.ShapeDtypeStruct``) and lowered for
  ``platform`` as that device's backend would choose (:func:`reported_backend`)."""
  with reported_backend(platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))


def attention_forward_backward(
  variant: str, ratios: Sequence[int] = DEFAULT_RATIOS, **options: Any
) -> Callable:
  """``(q, k, v) -> (dq, dk, dv)`` of ``sum(out)`` (float32) for a registry variant with the
  options a model gives it (SH and BN+SH: ``ratios``), ``options`` on top."""
  from primal_dual import registry

  def loss(q, k, v):
    heads = q.shape[-2]
    fn = registry.make_attention_fn(
      variant, {**registry.model_options(variant, heads, ratios=tuple(ratios)), **options}
    )
    return jnp.sum(fn(q, k, v).astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def attention_op_counts(
  variants: Sequence[str] = DEFAULT_VARIANTS,
  *,
  length: int = 4096,
  heads: int = 8,
  head_dim: int = 64,
  ratios: Sequence[int] = DEFAULT_RATIOS,
  dtype=jnp.bfloat16,
  platform: str = "cuda",
  vmap_safe_jax: bool = False,
) -> dict[str, OpCount]:
  """Variant -> :class:`OpCount` of its forward + backward lowered for ``platform``, q, k, v
  ``[1, length, heads, head_dim]``.

  ``vmap_safe_jax``: lower as the library does on a jax at or after ``fused.VMAP_SAFE_JAX``
  (whatever this one is): without the operands it ties to the queries' vmap axis for older
  jax's cuDNN batching rules (``fused._cudnn_operands``). Only the library's own branch is
  emulated; jax's lowering of the rest is this jax's.
  """
  from primal_dual.kernels import fused

  qkv = jax.ShapeDtypeStruct((1, length, heads, head_dim), dtype)
  saved = fused.VMAP_SAFE_JAX
  if vmap_safe_jax:
    fused.VMAP_SAFE_JAX = (0, 0, 0)
  try:
    return {
      name: count_ops(lower_for(attention_forward_backward(name, ratios), (qkv,) * 3, platform))
      for name in variants
    }
  finally:
    fused.VMAP_SAFE_JAX = saved


def render(counts: dict[str, OpCount]) -> str:
  """A Markdown table of ``counts``."""
  lines = [
    "| variant | ops | ops but constants | gathers | scatters | custom calls |",
    "|---|---|---|---|---|---|",
  ]
  for name, c in counts.items():
    cells = (name, c.total, c.total - c.constants, c.gathers, c.scatters, c.custom_calls)
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m tools.device.lowered_ops", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
  parser.add_argument("--length", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--ratios", default=",".join(map(str, DEFAULT_RATIOS)))
  parser.add_argument("--platform", default="cuda", choices=sorted(BACKENDS))
  parser.add_argument("--by-name", action="store_true", help="also each op name's count")
  parser.add_argument(
    "--vmap-safe-jax",
    action="store_true",
    help="lower as on a jax >= fused.VMAP_SAFE_JAX (no vmap workaround for older cuDNN rules)",
  )
  args = parser.parse_args(argv)
  counts = attention_op_counts(
    [v for v in args.variants.split(",") if v],
    length=args.length,
    heads=args.heads,
    head_dim=args.head_dim,
    ratios=tuple(int(r) for r in args.ratios.split(",")),
    platform=args.platform,
    vmap_safe_jax=args.vmap_safe_jax,
  )
  print(render(counts))
  if args.by_name:
    for name, c in counts.items():
      print(f"\n{name}: {c.by_name}")


if __name__ == "__main__":
  main(sys.argv[1:])
