"""Attention-SH and BN+SH lowered for CUDA on this CPU (``tools.device.lowered_ops``): no gather and
no scatter in any layout, and a small program at the benchmark's shape.

Head groups are static slices, window pooling is pad + reshape + reduction (a broadcast in the
backward), and BN+SH's statistics are reductions over every head at once; a gather there (``x[:,
heads]``, ``k[index]``) would come back as a bfloat16 scatter-add in the backward. Nothing is
compiled or run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package.
  sys.path.insert(0, str(REPO_ROOT))

from tools.device import lowered_ops
from primal_dual.kernels import scaled_head as sh

# Ops of the forward + backward at B 1, N 4096, 8 heads, head dim 64, bfloat16, ratios (1, 1, 2,
# 2, 4, 4, 8, 8), lowered for CUDA (tools/device/README.md), measured on jax 0.10.2: 59 and 187
# (softmax 25, Attention-BN 185), of which 11 are the operands tied to the queries' vmap axis for
# jax < 0.11.1 (fused.VMAP_SAFE_JAX); 48 and 176 without them. Every head is pooled by one product
# (scaled_head.pool_every_head_at_once) and reaches cuDNN by one reshape each way (fused.attend
# lays rows out length-major); before that, 71 and 199; before the one product, 142 and 270 (a
# reduction, a broadcast backward and a pad per ratio group), and 577 and 1208 with 21 gathers and
# 18 scatters each.
MAX_OPS = {"sh": 60, "bn_sh": 190}
MAX_OPS_VMAP_SAFE_JAX = {"sh": 50, "bn_sh": 180}


def test_the_counter_sees_gathers_and_scatters():
  x = jax.ShapeDtypeStruct((8, 4), jnp.bfloat16)

  def gathered(x):
    return jnp.sum(x[jnp.array([3, 1, 1])].astype(jnp.float32))

  counts = lowered_ops.count_ops(lowered_ops.lower_for(jax.value_and_grad(gathered), (x,)))
  assert counts.gathers >= 1 and counts.scatters >= 1, counts.by_name
  sliced = lowered_ops.count_ops(lowered_ops.lower_for(jax.grad(lambda x: jnp.sum(x[1:3])), (x,)))
  assert sliced.gathers == sliced.scatters == 0, sliced.by_name
  assert sliced.total == sum(sliced.by_name.values()) and "func.return" not in sliced.by_name


@pytest.mark.parametrize("vmap_safe_jax", [False, True])
def test_sh_and_bn_sh_at_the_benchmark_shape(vmap_safe_jax):
  counts = lowered_ops.attention_op_counts(("softmax", "sh", "bn_sh"), vmap_safe_jax=vmap_safe_jax)
  assert counts["softmax"].gathers == counts["softmax"].scatters == 0
  bounds = MAX_OPS_VMAP_SAFE_JAX if vmap_safe_jax else MAX_OPS
  for variant, bound in bounds.items():
    count = counts[variant]
    assert count.gathers == 0 and count.scatters == 0, (variant, count.by_name)
    # One cuDNN launch forward, one backward: every ratio group in one call; the pooling one
    # product forward and one backward.
    assert count.custom_calls == 2, (variant, count.by_name)
    assert count.by_name.get("stablehlo.dot_general") == 2, (variant, count.by_name)
    assert count.total <= bound, (variant, count.total, count.by_name)


B, N, H, D = 2, 24, 4, 8
# Every layout SH takes: masks, lengths, bias, grid and prefix tokens, pools, BN+SH's statistics,
# groups out of head order.
LAYOUTS = {
  "no mask": {},  # every head pooled by one product (24 keys: blocks of lcm(1, 2, 3, 3) = 6)
  "no mask, bn_sh": dict(batchnorm=True),
  "padding mask": dict(mask=True),
  "causal": dict(is_causal=True),
  "bias": dict(bias=True),
  "grid and prefix": dict(grid_shape=(4, 5), num_prefix_tokens=4, mask=True),
  "max pool": dict(pool="max", mask=True),
  "stride pool": dict(pool="stride", mask=True),
  "lengths": dict(lengths=True),
  "uneven windows, bn_sh": dict(batchnorm=True, ratios=(1, 5, 3, 3)),  # 24 keys: a partial window
  "bn_sh full statistics": dict(batchnorm=True, statistics="full", mask=True),
  "groups out of head order": dict(ratios=(2, 1, 3, 1), mask=True),
}
# Not here: BN+SH under a causal or query-dependent mask, whose per-query statistics are
# batchnorm.py's (its own indexing), after the same pooling as these layouts.


@pytest.mark.parametrize("implementation", ["auto", "reference"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_gather_or_scatter_in_any_layout(layout, implementation):
  options = dict(LAYOUTS[layout])
  mask, bias, lengths = (options.pop(name, False) for name in ("mask", "bias", "lengths"))
  ratios = options.pop("ratios", (1, 2, 3, 3))

  def loss(q, k, v, mask, bias):
    lengths_given = {"key_value_seq_lengths": jnp.array([N, N - 5])} if lengths else {}
    out = sh.scaled_head_attention(
      q, k, v, bias, mask, ratios=ratios, implementation=implementation, **lengths_given, **options
    )
    return jnp.sum(out.astype(jnp.float32))

  qkv = jax.ShapeDtypeStruct((B, N, H, D), jnp.bfloat16)
  args = (
    qkv,
    qkv,
    qkv,
    jax.ShapeDtypeStruct((B, 1, 1, N), jnp.bool_) if mask else None,
    jax.ShapeDtypeStruct((B, H, N, N), jnp.float32) if bias else None,
  )
  lowered = lowered_ops.lower_for(jax.grad(loss, argnums=(0, 1, 2)), args)
  count = lowered_ops.count_ops(lowered)
  assert count.gathers == 0 and count.scatters == 0, count.by_name
