"""tools/device/hyla_chain_probe.py: the chained-products HYLA forward (a design probe, not a
library path) computes HYLA, run as its own source in Triton's interpreter, so that its compile
report (benchmarks/results/hyla_chain_probe.md) measures a kernel that is right."""

import ml_dtypes
import numpy as np
import gpu_dev
import pytest

gpu_dev.require()  # triton and torch: skipped, saying so, without them

from tools.device import hyla_chain_probe as probe  # noqa: E402
from numpy_reference import hyla_ref  # noqa: E402


@pytest.mark.parametrize("value_network,chunk", [("mlp_relu", 16), ("mlp_linear", 32)])
def test_chained_forward_matches_the_float64_reference(value_network, chunk):
  rng = np.random.default_rng(7)
  q, k = (rng.normal(size=(1, 32, 8, 16)).astype(np.float32) for _ in range(2))
  v = rng.normal(size=(1, 32, 8, 32)).astype(np.float32)
  got = probe.run_interpreted(q, k, v, chunk, relu=value_network == "mlp_relu")
  # The kernel reads bfloat16 inputs and multiplies bfloat16 operands with float32 sums.
  rounded = [x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (q, k, v)]
  want, _ = hyla_ref(*rounded, value_network=value_network)
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 2e-2 * scale
  # A wrong group structure (e.g. B1 without its δ(j, j′)) is off by the size of the output.
  assert np.abs(got - want).mean() <= 2e-3 * scale


def test_lengths_not_a_multiple_of_the_tile_are_refused():
  x = np.zeros((1, 24, 8, 16), np.float32)
  with pytest.raises(ValueError, match="length 24 and value_dim 16 need multiples of 16 and 16"):
    probe.run_interpreted(x, x, x, 16, relu=True)
