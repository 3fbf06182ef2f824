"""The 'images' task: DeiT/ViT-style image classification (docs/maths.md §4).

Config fields read:
  ``config.data``: ``dataset`` ('digits' | 'cifar10' | 'imagenet2012'), ``data_dir`` (TFDS folder
    for cifar10 / imagenet2012; '' means TFDS's default), ``upscale`` (digits: integer upscaling of
    the 8×8 images), ``image_size`` (imagenet2012: crop side, 0 means 224), ``test_fraction`` and
    ``split_seed`` (digits: the stratified train/test split), ``augment_repeats`` (see below).
  ``config.model``: ``patch_size`` and the ``ViT`` sizes (``model_dim``, ``num_layers``,
    ``num_heads``, ``mlp_dim``; ``primal_dual.models.VIT_PRESETS``), ``dropout_rate``,
    ``attention_dropout_rate``, ``attention``, ``attention_options``. Attention-SH pools 2-D over
    the patch grid with the CLS token unpooled (the model passes ``grid_shape``).

Splits: 'train' and the data set's evaluation split under its TFDS name: 'test' for digits and
cifar10, 'validation' for imagenet2012 (ImageNet's labelled validation set, on which ImageNet
accuracy is reported). Missing TFDS data ends the run with one message saying how to prepare it
(``tfds_image_sources`` raises FileNotFoundError, which the trainer reports as a
``DataNotFoundError``).

Training-time augmentation. The trainer feeds the task's train source straight to its loader with
no per-example transform, so augmentation happens inside the train source: ``AugmentedSource``
holds ``augment_repeats`` passes over the training images; record ``i`` is image ``i mod N``
transformed (``primal_dual.data.images.make_preprocess(train=True)``) with the NumPy generator
seeded by ``(config.seed, i)``. Every pass therefore sees a different augmentation of each image,
the result is a pure function of the index (reproducible, and exact on resume: the loader's
checkpointed position is all that is needed), and the loader's shuffle runs over all passes at once
(each image appears exactly ``augment_repeats`` times in ``augment_repeats · N`` draws, not once
per ``N``). Configs set ``augment_repeats`` to the number of epochs and count training length and
periods in steps of real epochs (``primal_dual.data.images.train_size``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import ml_collections
import numpy as np

from primal_dual.data import images
from primal_dual.tasks import _common as common
from primal_dual.models import ViT
from primal_dual.training import config_lib
from primal_dual.training import errors

VIT_FIELDS = (
  "patch_size",
  "model_dim",
  "num_layers",
  "num_heads",
  "mlp_dim",
  "dropout_rate",
  "attention_dropout_rate",
)
# ------------------------------------------------------------------------------------------------
# Sources.


def _read_many(source: Any, indices: Sequence[int]) -> list[Any]:
  if hasattr(source, "__getitems__"):
    return list(source.__getitems__([int(i) for i in indices]))
  return [source[int(i)] for i in indices]


class PreprocessedSource:
  """Evaluation records: ``preprocess(base[i])`` (deterministic).

  Records: ``{'inputs': float32 [H, W, C], 'label': int32 []}``.
  """

  def __init__(self, base: Any, preprocess: Callable[..., dict], description: str):
    self._base = base
    self._preprocess = preprocess
    self._description = description

  def __len__(self) -> int:
    return len(self._base)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self._preprocess(self._base[int(index)])

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
    return [self._preprocess(record) for record in _read_many(self._base, indices)]

  def __repr__(self) -> str:  # stable: grain compares it when restoring an iterator
    return f"PreprocessedSource({self._description}, len={len(self)})"


class AugmentedSource:
  """``repeats`` randomly augmented passes over ``base`` (module docstring).

  Record ``i`` is ``preprocess(base[i mod N], rng)`` with ``rng = default_rng([seed, i])``:
  ``{'inputs': float32 [H, W, C], 'label': int32 []}``.
  """

  def __init__(
    self, base: Any, preprocess: Callable[..., dict], *, seed: int, repeats: int, description: str
  ):
    if repeats < 1:
      raise ValueError(f"augment_repeats must be >= 1, got {repeats}")
    self._base = base
    self._preprocess = preprocess
    self._seed = int(seed)
    self._repeats = int(repeats)
    self._description = description

  def __len__(self) -> int:
    return self._repeats * len(self._base)

  def _augment(self, index: int, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return self._preprocess(record, np.random.default_rng([self._seed, index]))

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(index)
    return self._augment(index, self._base[index % len(self._base)])

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
    indices = [int(i) for i in indices]
    records = _read_many(self._base, [i % len(self._base) for i in indices])
    return [self._augment(i, record) for i, record in zip(indices, records)]

  def __repr__(self) -> str:
    return (
      f"AugmentedSource({self._description}, repeats={self._repeats}, seed={self._seed}, "
      f"len={len(self)})"
    )


def _digits_raw(data: ml_collections.ConfigDict) -> dict[str, Any]:
  return images.digits_sources(
    upscale=int(data.get("upscale", 1)),
    seed=int(data.get("split_seed", 0)),
    test_fraction=float(data.get("test_fraction", 0.2)),
  )


def _tfds_raw(data: ml_collections.ConfigDict) -> dict[str, Any]:
  return images.tfds_image_sources(data.dataset, data_dir=data.get("data_dir") or None)


# Data set → loader of its raw sources ({split: source of {'image', 'label'}}).
RAW_SOURCES: dict[str, Callable[[ml_collections.ConfigDict], dict[str, Any]]] = {
  "digits": _digits_raw,
  "cifar10": _tfds_raw,
  "imagenet2012": _tfds_raw,
}


def images_metadata(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``num_classes``, ``image_shape`` (H, W, C) and ``eval_split`` from the config alone."""
  dataset = config.data.dataset
  config_lib.choice(RAW_SOURCES, dataset, "image data set")
  info = images.dataset_info(dataset)
  side = images.input_side(
    dataset, upscale=config.data.get("upscale", 1), image_size=config.data.get("image_size", 0)
  )
  return {
    "num_classes": info["num_classes"],
    "image_shape": (side, side, info["image_shape"][2]),
    "eval_split": info["splits"][1],
  }


def build_data(config: ml_collections.ConfigDict):
  """``({'train', <eval split>} → source, metadata)``; see the module docstring."""
  metadata = images_metadata(config)
  data = config.data
  dataset = data.dataset
  train_split, eval_split = images.dataset_info(dataset)["splits"]
  raw = RAW_SOURCES[dataset](data)
  side = metadata["image_shape"][0]
  upscale = int(data.get("upscale", 1))
  train = AugmentedSource(
    raw[train_split],
    images.make_preprocess(dataset, train=True, image_size=side, upscale=upscale),
    seed=config.seed,
    repeats=int(data.get("augment_repeats", 1)),
    description=f"{dataset}:{train_split}",
  )
  evaluation = PreprocessedSource(
    raw[eval_split],
    images.make_preprocess(dataset, train=False, image_size=side, upscale=upscale),
    description=f"{dataset}:{eval_split}",
  )
  return {"train": train, eval_split: evaluation}, metadata


def build_model(config: ml_collections.ConfigDict, metadata: Mapping[str, Any]) -> ViT:
  side = metadata["image_shape"][0]
  patch = config.model.patch_size
  if side % patch:
    raise errors.ConfigError(
      f"image side {side} of {config.data.dataset!r} is not divisible by "
      f"config.model.patch_size={patch}; pick a patch size dividing it"
    )
  return ViT(
    num_classes=metadata["num_classes"], **common.model_arguments(config.model, VIT_FIELDS)
  )


TASK = common.register_classification_task("images", build_data, build_model)
