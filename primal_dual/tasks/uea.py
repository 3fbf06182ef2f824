"""The 'uea' task: UEA multivariate time-series classification (docs/maths.md §4).

Config fields read (``config.data``): ``dataset`` (archive name), ``protocol`` ('best_test' or
'clean'), ``data_dir``, ``manual_dir``, ``validation_fraction``, ``split_seed``.

Protocols:
  * ``best_test`` — train on all of TRAIN, evaluate TEST after every epoch; the reported number is
    ``best/test_accuracy``, the best test accuracy over epochs (what the published tables use;
    optimistic, since the test set picks the epoch).
  * ``clean`` — carve a stratified validation split from TRAIN, train on the rest (``train_fit``),
    and report ``selected/test_accuracy``: the test accuracy of the checkpoint with the best
    validation accuracy.
"""

from __future__ import annotations


import ml_collections

from primal_dual.data import builders
from primal_dual.tasks import _common as common
from primal_dual.models import EncoderClassifier
from primal_dual.training import config_lib

PROTOCOL_SPLITS = {
  "best_test": {"train": "train", "test": "test"},
  "clean": {"train": "train_fit", "validation": "validation", "test": "test"},
}


def build_data(config: ml_collections.ConfigDict):
  data = config.data
  names = config_lib.choice(PROTOCOL_SPLITS, data.protocol, "UEA protocol")
  sources = builders.uea_sources(
    data.dataset,
    data_dir=data.get("data_dir") or None,
    manual_dir=data.get("manual_dir") or None,
    splits=tuple(names.values()),
    validation_fraction=data.get("validation_fraction", 0.2),
    split_seed=data.get("split_seed", 0),
  )
  info = builders.uea_info(
    data.dataset, data_dir=data.get("data_dir") or None, manual_dir=data.get("manual_dir") or None
  )
  splits = {split: sources[source_split] for split, source_split in names.items()}
  metadata = {
    "num_classes": info["num_classes"],
    "num_channels": info["num_channels"],
    "max_length": info["max_length"],
  }
  return splits, metadata


def build_model(config: ml_collections.ConfigDict, metadata: dict) -> EncoderClassifier:
  return EncoderClassifier(
    num_classes=metadata["num_classes"],
    input_kind="dense",
    padding_as_lengths=True,  # the data pad each series' end
    **common.model_arguments(config.model, common.ENCODER_FIELDS),
  )


TASK = common.register_classification_task("uea", build_data, build_model)
