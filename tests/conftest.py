"""Test session set-up: 8 virtual CPU devices and quick hypothesis settings.

XLA_FLAGS must be set before JAX initialises its backends, hence at import time here.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
  "ci",
  max_examples=15,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
