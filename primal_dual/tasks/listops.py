"""The 'listops' task: Long Range Arena ListOps (docs/maths.md §4).

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

"""

from __future__ import annotations

from typing import Any, Mapping

import ml_collections

from primal_dual.data import listops
from primal_dual.tasks import _common as common
from primal_dual.models import EncoderClassifier
from primal_dual.training import config_lib
from primal_dual.training import errors

POOLINGS = ("cls", "mean")
SPLITS = ("train", "validation", "test")


def listops_metadata(config: ml_collections.ConfigDict) -> dict[str, int]:
  """Facts the model needs, from the config alone (no data is read)."""
  preset = config_lib.choice(listops.PRESETS, config.data.preset, "ListOps preset")
  return {
    "num_classes": listops.NUM_CLASSES,
    "vocab_size": listops.VOCAB_SIZE,
    "max_length": preset["max_length"],
  }


def build_data(config: ml_collections.ConfigDict):
  """``({'train', 'validation', 'test'} → source, metadata)``; records as in the data contract."""
  from primal_dual.data import builders  # imports TFDS

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
    padding_as_lengths=True,  # the data pad each expression's end
    **common.model_arguments(config.model, common.ENCODER_FIELDS),
  )


TASK = common.register_classification_task("listops", build_data, build_model)
