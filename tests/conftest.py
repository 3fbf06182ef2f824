"""Test session set-up: 8 virtual CPU devices, no implicit rank promotion, hypothesis profiles.

Hypothesis profiles (``HYPOTHESIS_PROFILE``): ``ci``, the default, is derandomized, so every run
tries the same examples and a clean CI run cannot fail on a case it has never met; ``soak``
(``make test-soak``) runs only the property tests, each at ``SOAK_FACTOR`` times its examples,
freshly drawn, and prints a failure's reproduction blob.

Tiers: ``make test`` runs everything; ``make test-fast`` (``-m "not slow"``) leaves out the tests
marked ``slow``, by hand (end-to-end runs) or here at collection: every test whose time in
``tests/durations.json`` (setup + call + teardown, measured by ``make test-durations``, which
passes ``--record-durations``) is ``FAST_TIER_MAX_S`` or more. A test missing from the file (a new
one) stays in the fast tier until the file is measured again.

XLA_FLAGS must be set before JAX initialises its backends, hence at import time here. Rank
promotion (implicit broadcasting between arrays of different rank, a common source of silent
shape bugs) raises in every test, and, through the environment, in the commands tests start.
"""

import collections
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

import hypothesis
import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_rank_promotion", os.environ["JAX_NUMPY_RANK_PROMOTION"])

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
SOAK_FACTOR = 50
_QUIET = dict(
  deadline=None,
  print_blob=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# derandomize: the examples are a function of the test's source, so no run draws new ones (and
# the example database, which could replay one machine's failures on another, is off).
settings.register_profile("ci", max_examples=15, derandomize=True, database=None, **_QUIET)
settings.register_profile("soak", max_examples=15, derandomize=False, **_QUIET)
settings.load_profile(PROFILE)


def _property_test(item):
  """The @given function behind a collected item, or None."""
  test = getattr(item, "obj", None)
  test = getattr(test, "__func__", test)  # a method's function
  return test if hypothesis.is_hypothesis_test(test) else None


DURATIONS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
# A test measured this long or longer (seconds, tests/durations.json) is in the slow tier.
FAST_TIER_MAX_S = 1.0


def pytest_addoption(parser):
  parser.addoption(
    "--record-durations",
    default=None,
    metavar="PATH",
    help="write every test's seconds (setup + call + teardown) as JSON to PATH",
  )


def measured_durations(path: str = DURATIONS_PATH) -> dict[str, float]:
  """Test node id -> seconds, as ``--record-durations`` wrote them ({} without the file)."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)["seconds"]


_recorded: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
  """Adds each phase's time to its test (under xdist, on the controller, which sees them all)."""
  _recorded[report.nodeid] += report.duration


def pytest_sessionfinish(session):
  path = session.config.getoption("--record-durations")
  if path and _recorded and not hasattr(session.config, "workerinput"):  # the controller only
    total = sum(_recorded.values())
    with open(path, "w") as f:
      json.dump(
        {
          "what": "seconds per test, setup + call + teardown (tests/conftest.py)",
          "total_seconds": round(total, 1),
          "seconds": {k: round(v, 3) for k, v in sorted(_recorded.items())},
        },
        f,
        indent=0,
      )
      f.write("\n")


def _mark_slow_by_duration(items):
  seconds = measured_durations()
  for item in items:
    measured = seconds.get(item.nodeid, 0.0)
    if measured >= FAST_TIER_MAX_S:
      reason = f"{measured:.1f} s in tests/durations.json (fast tier: under {FAST_TIER_MAX_S} s)"
      item.add_marker(pytest.mark.slow(reason=reason))


def pytest_collection_modifyitems(config, items):
  """Marks the tests measured slow (tiers, above). Soak profile: keep the property tests only,
  each at SOAK_FACTOR× its own max_examples and random (a test's explicit settings, derandomize
  included, would otherwise win)."""
  _mark_slow_by_duration(items)
  if PROFILE != "soak":
    return
  tests = {id(test): test for test in map(_property_test, items) if test is not None}
  for test in tests.values():  # once per function: parametrized items share one
    # Where @given keeps the test's settings (no public way to scale them after decoration).
    own = test._hypothesis_internal_use_settings
    test._hypothesis_internal_use_settings = settings(
      own, max_examples=own.max_examples * SOAK_FACTOR, derandomize=False
    )
  config.hook.pytest_deselected(items=[item for item in items if _property_test(item) is None])
  items[:] = [item for item in items if _property_test(item) is not None]
