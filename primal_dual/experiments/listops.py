"""The 'listops' task: Long Range Arena ListOps (docs/maths.md §4), and a model summary (size, FLOPs).

Config fields read:
  ``config.data``: ``preset`` ('full' | 'short' | 'tiny', see ``primal_dual.data.listops.PRESETS``),
    ``seed`` (generator seed; 0 is the registered TFDS config), ``data_dir`` (TFDS folder; ''
    means TFDS's default). The data set is generated and prepared with TFDS on first use
    (``primal_dual.data.builders.listops_sources``): 'full' takes about half a minute, 'short' a
    few seconds; later runs read the prepared array_record files.
  ``config.model``: the ``EncoderClassifier`` fields of ``ENCODER_FIELDS`` plus ``attention`` and
    ``attention_options``. Inputs are token ids (``input_kind='embed'``, vocabulary
    ``listops.VOCAB_SIZE``) padded with ``PAD_ID`` to the preset's ``max_length``; the padding
    mask reaches every attention variant, the BN statistics and the SH pooling. ``pooling`` is
    'cls' (the model prepends its own learned CLS token, which Attention-SH keeps unpooled) or
    'mean' (over valid tokens).

Splits: 'train', 'validation', 'test' (96k/2k/2k for 'full'). Reported numbers: ``test/accuracy``
(the last step's test accuracy, LRA's protocol) and ``selected/test_accuracy`` (test accuracy of
the evaluation with the best validation accuracy, the clean protocol).

:func:`model_summary` gives a config's parameter count and its analytic attention FLOPs per
example (``primal_dual.analysis.flops``: the products inside every layer's attention kernel at the
padded length the model really computes on, CLS included; multiply-add = 2 FLOPs; projections,
exponentials, BN statistics and SH pooling left out).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections

from primal_dual.analysis import flops
from primal_dual.data import listops
from primal_dual.experiments.common import attention_kwargs, model_kwargs
from primal_dual.models import EncoderClassifier, parameter_count
from primal_dual.training import errors
from primal_dual.training import tasks as tasks_lib

ENCODER_FIELDS = (
  "num_layers",
  "model_dim",
  "num_heads",
  "mlp_dim",
  "positional",
  "pre_norm",
  "norm",
  "pooling",
  "dropout_rate",
  "attention_dropout_rate",
)
POOLINGS = ("cls", "mean")
SPLITS = ("train", "validation", "test")


def listops_metadata(config: ml_collections.ConfigDict) -> dict[str, int]:
  """Facts the model needs, from the config alone (no data is read)."""
  preset = config.data.preset
  if preset not in listops.PRESETS:
    raise ValueError(f"unknown ListOps preset {preset!r}; choose one of {sorted(listops.PRESETS)}")
  return {
    "num_classes": listops.NUM_CLASSES,
    "vocab_size": listops.VOCAB_SIZE,
    "max_length": listops.PRESETS[preset]["max_length"],
  }


def build_data(config: ml_collections.ConfigDict):
  """``({'train', 'validation', 'test'} → source, metadata)``; records as in the data contract."""
  from primal_dual.data import builders  # pylint: disable=g-import-not-at-top (imports TFDS)

  metadata = listops_metadata(config)
  data = config.data
  sources = builders.listops_sources(
    data.preset, seed=data.get("seed", 0), data_dir=data.get("data_dir") or None, splits=SPLITS
  )
  return dict(sources), metadata


def build_model(
  config: ml_collections.ConfigDict, metadata: Mapping[str, Any]
) -> EncoderClassifier:
  pooling = config.model.get("pooling", "cls")
  if pooling not in POOLINGS:
    raise errors.ConfigError(f"ListOps config.model.pooling={pooling!r}; use one of {POOLINGS}")
  return EncoderClassifier(
    num_classes=metadata["num_classes"],
    input_kind="embed",
    vocab_size=metadata["vocab_size"],
    **model_kwargs(config.model, ENCODER_FIELDS),
    **attention_kwargs(config.model),
  )


TASK = tasks_lib.register_task(
  tasks_lib.Task(
    name="listops",
    build_data=build_data,
    build_model=build_model,
    loss_and_metrics=tasks_lib.classification_loss_and_metrics,
    eval_splits=("validation", "test"),
  )
)


def count_parameters(model, *example_args, **example_kwargs) -> int:
  """Number of trainable parameters of a Linen model (shapes only; nothing is computed)."""

  def init(rng):
    return model.init({"params": rng, "dropout": rng}, *example_args, **example_kwargs)

  return parameter_count(jax.eval_shape(init, jax.random.PRNGKey(0))["params"])


def model_summary(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Size and attention cost of a ListOps config (no data is read).

  Returns:
    ``{'parameters': int, 'attention_flops': float (one example, forward, all layers),
    'attention_flops_relative': float (to softmax attention), 'sequence_length': int (padded,
    CLS included)}``.
  """
  metadata = listops_metadata(config)
  model = build_model(config, metadata)
  length = metadata["max_length"]
  tokens = jnp.zeros((1, length), jnp.int32)
  parameters = count_parameters(model, tokens, mask=jnp.ones((1, length), bool), train=False)
  prefix = 1 if config.model.pooling == "cls" else 0
  cost = flops.attention_flops(config.model, seq_len=length, num_prefix_tokens=prefix)
  return {
    "parameters": parameters,
    "attention_flops": cost["total"],
    "attention_flops_relative": cost["relative_to_softmax"],
    "sequence_length": length + prefix,
  }
