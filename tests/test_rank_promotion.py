"""The test session raises on implicit rank promotion, here and in the commands it starts."""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest


def test_rank_promotion_raises_in_tests():
  with pytest.raises(ValueError, match="rank_promotion"):
    jnp.ones((2, 3)) + jnp.ones((3,))
  assert (jnp.ones((2, 3)) + jnp.ones((1, 3))).shape == (2, 3)  # same rank: fine


def test_rank_promotion_raises_in_subprocesses():
  code = "import jax; print(jax.config.jax_numpy_rank_promotion)"
  out = subprocess.run(
    [sys.executable, "-c", code], env=os.environ, capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == "raise"
