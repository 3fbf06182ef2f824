"""Test session set-up: 8 virtual CPU devices, no implicit rank promotion, quick hypothesis
settings.

XLA_FLAGS must be set before JAX initialises its backends, hence at import time here. Rank
promotion (implicit broadcasting between arrays of different rank, a common source of silent
shape bugs) raises in every test, and, through the environment, in the commands tests start.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_rank_promotion", os.environ["JAX_NUMPY_RANK_PROMOTION"])

settings.register_profile(
  "ci",
  max_examples=15,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
