"""Helpers shared by the test modules: the tiny synthetic config, random attention inputs, and a fresh
persistent compilation cache per module."""

import jax
import jax.numpy as jnp
import numpy as np
import ml_collections
import pytest
from jax.experimental.compilation_cache import compilation_cache

from primal_dual.training import config_lib


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  """8 steps of the synthetic task on a (data=4, model=2) mesh of the 8 virtual CPU devices."""
  config = config_lib.training_defaults()
  config.task = "synthetic"
  config.update(num_train_steps=8, batch_size=8, eval_batch_size=16, progress_bar=False)
  config.update(log_every_steps=2, eval_every_steps=4, checkpoint_every_steps=4)
  config.mesh.data = -1
  config.mesh.model = 2
  config.optimizer.update(
    lr=0.05, schedule="warmup_cosine", warmup_steps=2, weight_decay=0.01, grad_clip_norm=1.0
  )
  config.model = ml_collections.ConfigDict(dict(hidden=8, dropout_rate=0.1, use_batch_norm=True))
  # 20 eval examples with eval batches of 16: the second batch is 12 rows of padding.
  config.data = ml_collections.ConfigDict(
    dict(num_train=64, num_eval=20, seq_len=6, num_features=3, num_classes=3)
  )
  return config_lib.with_fields(config, overrides)


_CACHE_OPTIONS = (
  "jax_compilation_cache_dir",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_persistent_cache_min_entry_size_bytes",
)


def fresh_compilation_cache(tmp_path_factory):
  """Fixture body: a fresh persistent compilation cache for one module, restored afterwards (a
  later run of the same program reuses the first one's compilation). Use as
  ``compilation_cache_dir = pytest.fixture(scope='module', autouse=True)(fresh_compilation_cache)``.
  """
  saved = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  compilation_cache.reset_cache()
  yield
  for name, value in saved.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


def subprocess_compilation_cache(tmp_path_factory):
  """Fixture body: one persistent compilation cache, through the environment, for every process
  the module starts (a program one command compiled is loaded by the next). Use as
  ``compilation_cache = pytest.fixture(scope='module', autouse=True)(subprocess_compilation_cache)``.
  """
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_cache")))
    patch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    patch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    yield


def random_qkv(rng, batch_shape, q_len, kv_len, heads, d=3, d_v=2, dtype=np.float32):
  """NumPy ``query [batch..., q_len, heads, d]``, ``key``/``value [batch..., kv_len, heads, d|d_v]``
  drawn from ``rng`` (a ``numpy.random.Generator``)."""

  def draw(length, features):
    return rng.normal(size=(*batch_shape, length, heads, features)).astype(dtype)

  return draw(q_len, d), draw(kv_len, d), draw(kv_len, d_v)


def padding_mask(rng, batch_shape, kv_len, min_valid=1):
  """Key padding ``[batch..., 1, 1, kv_len]`` with a random number of valid keys per example."""
  lengths = rng.integers(min_valid, kv_len + 1, size=batch_shape)
  return (np.arange(kv_len) < lengths[..., None])[..., None, None, :]


def tiny_model_sizes(**overrides) -> dict:
  """Sizes of a 1-layer model of width 8 with 2 heads (``overrides`` replace any of them)."""
  return dict(dict(num_layers=1, model_dim=8, num_heads=2, mlp_dim=16), **overrides)


def assert_sampler_follows_key_derivation(sample, stream_id, index, batch):
  """``sample(key)`` (jitted), with ``key = fold_in(fold_in(key(0), stream_id), index)`` as the
  generated-data modules document, equals row ``index`` of ``batch`` (generated with seed 0)."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), stream_id), index)
  record = jax.jit(sample)(key)
  for name, value in batch.items():
    np.testing.assert_array_equal(np.asarray(record[name]), value[index])


def assert_close(actual, expected, tol=2e-5, floor=0.05):
  """Relative to each element and to the largest magnitude (float32 sums in another order).

  The magnitude floor (default 0.05; with unit-normal inputs, gradients are O(1)) covers
  gradients that cancel to almost nothing: with one head, rms_head gives a ≈ sign(s) and
  da/ds = r·ε/(s² + ε), computed in float32 as the difference of two O(r) terms by both kernels
  (each is then ~1e-7 away from a float64 finite difference, on gradients of ~1e-5); callers pass
  the magnitude of the terms a gradient sums when it is larger.
  """
  expected = np.asarray(expected, np.float32)
  np.testing.assert_allclose(
    np.asarray(actual, np.float32),
    expected,
    rtol=tol,
    atol=tol * max(np.abs(expected).max(), floor),
  )


def loss_and_grads(attention, q, k, v, bias, mask, **options):
  """``(out, grads of Σ sin(out) w.r.t. q, k, v[, bias])``, jitted."""
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)

  def loss(q, k, v, bias):
    out = attention(q, k, v, bias, mask, **options)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

  grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, bias)
  return out, grads


def without_timing(metrics: dict) -> dict:
  """A metrics record without its wall-clock rates (``*steps_per_second*``): no two runs share
  them, so runs that must agree are compared on the rest."""
  return {k: v for k, v in metrics.items() if "steps_per_second" not in k}


def records_without_timing(workdir) -> list[dict]:
  """The records of ``workdir``'s metrics.jsonl, each ``without_timing``."""
  from primal_dual.training import metrics_logging

  return [without_timing(r) for r in metrics_logging.read_metrics(str(workdir))]


def dot_product_attention_keywords(monkeypatch) -> list[dict]:
  """From now on every ``jax.nn.dot_product_attention`` call runs as before and appends its
  keyword arguments to the returned list (what the kernels decide: mask, bias, lengths,
  implementation)."""
  calls = []
  original = jax.nn.dot_product_attention

  def recording(*args, **kwargs):
    calls.append(kwargs)
    return original(*args, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  return calls


def run_cudnn_operands_on_xla(monkeypatch) -> None:
  """From now on ``fused.attend`` prepares cuDNN's operands (as on a GPU), which then run through
  XLA's implementation: the CPU has no cuDNN."""
  from primal_dual.kernels import fused

  monkeypatch.setattr(fused, "backend_implementation", lambda query, **_: "cudnn")
  original = jax.nn.dot_product_attention

  def xla(*args, implementation=None, **kwargs):
    assert implementation == "cudnn"
    return original(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", xla)
