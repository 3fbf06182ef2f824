"""The 'synthetic' task: a learnable toy problem for tests, benchmarks and smoke runs.

Each example is a variable-length sequence ``inputs`` float32 [seq_len, num_features] of standard
normal values (zero past its length), ``mask`` bool [seq_len], and ``label`` = the argmax over the
first ``num_classes`` channels of the mean over valid positions. A masked mean-pool plus linear
read-out solves it exactly, so loss falls within a few dozen steps. ``config.data`` (all optional):
``num_train``, ``num_eval``, ``seq_len``, ``num_features``, ``num_classes``, ``seed``;
``config.model``: ``hidden``, ``dropout_rate``, ``use_batch_norm``.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from primal_dual.models import blocks
from primal_dual.tasks import _common
from primal_dual.training import errors

SYNTHETIC_SPLITS = {"train": 0, "validation": 1, "test": 2}


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class SyntheticSource:
  """Random-access source of synthetic sequences, deterministic in (seed, split, index).

  Attributes:
    size: number of records.
    seed: data seed.
    split_id: distinct per split so that splits never share examples' random streams.
    seq_len, num_features, num_classes: shapes (num_classes ≤ num_features).
  """

  size: int
  _: dataclasses.KW_ONLY
  seed: int
  split_id: int
  seq_len: int
  num_features: int
  num_classes: int

  def __post_init__(self):
    if self.num_classes > self.num_features:
      raise errors.ConfigError(
        f"synthetic task: num_classes ({self.num_classes}) must be ≤ num_features "
        f"({self.num_features})"
      )

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self.size:
      raise IndexError(index)
    rng = np.random.default_rng([self.seed, self.split_id, index])
    length = int(rng.integers(max(1, self.seq_len // 2), self.seq_len + 1))
    mask = np.arange(self.seq_len) < length
    inputs = rng.standard_normal((self.seq_len, self.num_features)).astype(np.float32)
    inputs *= mask[:, None]
    label = np.argmax(inputs[:length, : self.num_classes].mean(axis=0))
    return {"inputs": inputs, "mask": mask, "label": np.int32(label)}

  def __repr__(self) -> str:
    # Stable and short: grain compares it when restoring an iterator.
    return f"SyntheticSource(size={self.size}, split_id={self.split_id}, seed={self.seed})"


def _synthetic_data_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
  data = config.get("data") or {}
  defaults = dict(num_train=256, num_eval=64, seq_len=8, num_features=4, num_classes=4, seed=0)
  return {key: data.get(key, value) for key, value in defaults.items()}


def build_data(config: ml_collections.ConfigDict):
  """Splits train / validation / test of `SyntheticSource` from `config.data` (all optional)."""
  options = _synthetic_data_config(config)
  shapes = {k: options[k] for k in ("seq_len", "num_features", "num_classes")}
  sizes = {
    "train": options["num_train"],
    "validation": options["num_eval"],
    "test": options["num_eval"],
  }
  splits = {
    name: SyntheticSource(sizes[name], seed=options["seed"], split_id=split_id, **shapes)
    for name, split_id in SYNTHETIC_SPLITS.items()
  }
  return splits, dict(shapes)


class SyntheticClassifier(nn.Module):
  """Per-position MLP, masked mean-pool, dropout, linear read-out.

  Kernels carry logical axis names (`embed`, `mlp`, `classes`) so the `model` mesh axis splits
  the hidden layer, exercising tensor-parallel placement in tests.

  Attributes:
    hidden: hidden width (divisible by the `model` mesh size).
    num_classes: number of logits.
    dropout_rate: dropout on the pooled features.
    use_batch_norm: add a BatchNorm (over valid positions) so the model has `batch_stats`.
    dtype, param_dtype: compute and parameter dtypes (`config.model.dtype` / `param_dtype`);
      logits are float32.
  """

  hidden: int = 16
  num_classes: int = 4
  dropout_rate: float = 0.0
  use_batch_norm: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(
    self, inputs: jax.Array, mask: jax.Array | None = None, train: bool = False
  ) -> jax.Array:
    """inputs float32 [batch, seq, features], mask bool [batch, seq] → logits [batch, classes]."""
    if mask is None:
      mask = jnp.ones(inputs.shape[:2], bool)
    partitioned = nn.with_logical_partitioning
    x = nn.Dense(
      self.hidden,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=partitioned(nn.initializers.lecun_normal(), ("embed", "mlp")),
      bias_init=partitioned(nn.initializers.zeros_init(), ("mlp",)),
    )(inputs)
    x = nn.gelu(x)
    if self.use_batch_norm:
      x = nn.BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
      )(x, mask=mask[..., None])
    # Pooled in float32 (a low-precision sum would round), then back to the compute dtype.
    weights = mask.astype(jnp.float32)[..., None]
    total = (x * weights).sum(axis=1, dtype=jnp.float32)
    pooled = (total / jnp.maximum(weights.sum(axis=1), 1.0)).astype(x.dtype)
    pooled = blocks.Dropout(self.dropout_rate)(pooled, deterministic=not train)
    return nn.Dense(
      self.num_classes,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=partitioned(nn.initializers.lecun_normal(), ("mlp", "classes")),
      bias_init=partitioned(nn.initializers.zeros_init(), ("classes",)),
    )(pooled).astype(jnp.float32)


def build_model(config: ml_collections.ConfigDict, metadata: dict) -> nn.Module:
  model = config.get("model") or {}
  return SyntheticClassifier(
    hidden=model.get("hidden", 16),
    num_classes=metadata["num_classes"],
    dropout_rate=model.get("dropout_rate", 0.0),
    use_batch_norm=model.get("use_batch_norm", False),
    **_common.dtype_kwargs(model),
  )


TASK = _common.register_classification_task("synthetic", build_data, build_model)
