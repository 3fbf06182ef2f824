"""A call's fixed cost apart from its per-length cost: one forward + backward per program against
several in one program.

For an attention case at one length, two programs are compiled: ``one`` runs the forward +
backward (``benchmarks.attention.forward_backward_pass``) once, ``many`` runs it ``calls`` times
on ``calls`` different inputs (so XLA can merge nothing), unrolled in one ``jax.jit``. Both are
timed as every benchmark here times (median of warm calls, ``benchmarks.common.time_warm``). Then

* ``per_call_s = (time(many) − time(one)) / (calls − 1)``: what one more call costs inside a
  program, its kernels and their launches: the per-length cost, and whatever fixed work each call
  repeats (small kernels whose time does not depend on the length);
* ``fixed_s = time(one) − per_call_s``: what a program pays once whatever it runs (dispatch,
  argument handling, the first launch), which a program of K steps (the trainer's) amortises.

The device suite (``benchmarks.device_suite``, section ``call_cost``) runs this for softmax, SH and
BN+SH at its first length.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp

from benchmarks import attention, common

DEFAULT_CALLS = 8
VARIANTS = ("softmax", "sh", "bn_sh")


def repeated(fn: Callable, calls: int) -> Callable:
  """``(qs, ks, vs) -> [fn(qs[i], ks[i], vs[i]) for i < calls]``, inputs stacked on a leading
  axis of size ``calls``: the calls unrolled in one program."""

  def run(qs, ks, vs):
    return [fn(qs[i], ks[i], vs[i]) for i in range(calls)]

  return run


def split_cost(one_s: float, many_s: float, calls: int) -> dict[str, float]:
  """``per_call_s`` and ``fixed_s`` from the times of one call and of ``calls`` calls in one
  program (module docstring)."""
  if calls < 2:
    raise ValueError(f"calls must be at least 2 to tell a call from a program; got {calls}")
  per_call = (many_s - one_s) / (calls - 1)
  return {"per_call_s": per_call, "fixed_s": one_s - per_call}


def measure(
  case: attention.Case,
  shape: attention.Shape,
  dtype_name: str = "bfloat16",
  *,
  calls: int = DEFAULT_CALLS,
  repeats: int = 3,
) -> dict[str, Any]:
  """One record: the times of one and of ``calls`` forward + backward calls in one program, and
  their split (:func:`split_cost`). Raises what building, compiling or running raises."""
  dtype = attention.DTYPES[dtype_name]
  step = attention.forward_backward_pass(attention.build_attention(case, shape, dtype))
  inputs = [attention.make_inputs(shape, dtype, seed=i) for i in range(calls)]
  stacked = tuple(jnp.stack(xs) for xs in zip(*inputs))
  times = {}
  for count in (1, calls):
    args = tuple(x[:count] for x in stacked)
    compiled = common.compile_for(repeated(step, count), *args)
    times[count] = common.time_warm(compiled, *args, repeats=repeats).median_s
  return {
    "kernel": case.name,
    "variant": case.variant,
    "length": shape.length,
    "heads": shape.heads,
    "head_dim": shape.head_dim,
    "dtype": dtype_name,
    "calls": calls,
    "one_call_s": times[1],
    "calls_s": times[calls],
    **split_cost(times[1], times[calls], calls),
  }
