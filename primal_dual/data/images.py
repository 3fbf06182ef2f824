"""Image-classification data: an offline set (scikit-learn digits) and the TFDS catalogue.

Sources are random-access (``__len__``, ``__getitem__``) per split. Raw records are
``{'image': [H, W, C], 'label': int []}`` (float32 in [0, 1] for digits, uint8 for TFDS);
``make_preprocess`` turns them into the model records of the data contract,
``{'inputs': float32 [H, W, C], 'label': int32 []}``.

All preprocessing is NumPy (plus PIL for resizing) and works as a grain transform:
``dataset.map(fn)`` for deterministic ones, ``dataset.random_map(fn)`` for the ones that
take ``(record, rng)``.

Per-data-set normalisation (channel mean / std of [0, 1] pixel values):

- digits: 0.3053 / 0.3760, over all 1797 images (a fixed pixel scale, label-free);
- cifar10: (0.4914, 0.4822, 0.4465) / (0.2470, 0.2435, 0.2616), over the training set;
- imagenet2012: (0.485, 0.456, 0.406) / (0.229, 0.224, 0.225), the usual training-set values.

Augmentation follows common practice: digits get a random shift of up to one original
pixel (no flips: digits are not mirror symmetric); cifar10 gets a 4-pixel zero-padded
random crop and a horizontal flip; imagenet2012 gets an Inception-style random resized
crop and a flip for training, and a resize to 256/224 of the crop size plus a central
crop for evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from PIL import Image

from primal_dual.data.sources import ArraySource


DIGITS_SIZE = 1797  # images in scikit-learn's digits
DEFAULT_IMAGENET_SIZE = 224
# Training-split sizes of the TFDS data sets (digits: see train_size).
TFDS_TRAIN_SIZES = {"cifar10": 50_000, "imagenet2012": 1_281_167}


def train_size(dataset: str, test_fraction: float = 0.2) -> int:
  """Images in the train split, without reading the data (configs convert epochs to steps).

  digits: ``1797 − ceil(test_fraction · 1797)`` (scikit-learn's ``train_test_split`` rounding).
  """
  if dataset == "digits":
    return DIGITS_SIZE - math.ceil(test_fraction * DIGITS_SIZE)
  if dataset not in TFDS_TRAIN_SIZES:
    raise ValueError(
      f"unknown image data set {dataset!r}; choose one of {sorted(['digits', *TFDS_TRAIN_SIZES])}"
    )
  return TFDS_TRAIN_SIZES[dataset]


@dataclasses.dataclass(frozen=True)
class _ImageDataset:
  """Static facts about one image data set.

  Attributes:
    num_classes: number of labels.
    image_shape: ``(H, W, C)`` of the model input (digits: at ``upscale=1``).
    mean, std: per-channel normalisation of [0, 1] pixel values.
    splits: (training split, evaluation split) names.
    preparation: how to prepare it for TFDS, or None when it ships with a package.
  """

  num_classes: int
  image_shape: tuple[int, int, int]
  mean: tuple[float, ...]
  std: tuple[float, ...]
  splits: tuple[str, str]
  preparation: str | None = None


_CIFAR10_PREPARATION = (
  "On a machine with TensorFlow and internet access run\n"
  "  pip install tensorflow tensorflow-datasets\n"
  "  tfds build cifar10 --file_format=array_record --data_dir=DATA_DIR\n"
  "then copy DATA_DIR here and pass data_dir=DATA_DIR (or set TFDS_DATA_DIR)."
)

_IMAGENET_PREPARATION = (
  "Register at https://image-net.org/download-images, put ILSVRC2012_img_train.tar and "
  "ILSVRC2012_img_val.tar into DATA_DIR/downloads/manual, and on a machine with TensorFlow run\n"
  "  pip install tensorflow tensorflow-datasets\n"
  "  tfds build imagenet2012 --file_format=array_record --data_dir=DATA_DIR\n"
  "then pass data_dir=DATA_DIR (or set TFDS_DATA_DIR)."
)

_DATASETS: dict[str, _ImageDataset] = {
  "digits": _ImageDataset(
    num_classes=10, image_shape=(8, 8, 1), mean=(0.3053,), std=(0.3760,), splits=("train", "test")
  ),
  "cifar10": _ImageDataset(
    num_classes=10,
    image_shape=(32, 32, 3),
    mean=(0.4914, 0.4822, 0.4465),
    std=(0.2470, 0.2435, 0.2616),
    splits=("train", "test"),
    preparation=_CIFAR10_PREPARATION,
  ),
  "imagenet2012": _ImageDataset(
    num_classes=1000,
    image_shape=(224, 224, 3),
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
    splits=("train", "validation"),
    preparation=_IMAGENET_PREPARATION,
  ),
}


def _lookup(name: str) -> _ImageDataset:
  if name not in _DATASETS:
    raise ValueError(f"Unknown image data set {name!r}; choose one of {sorted(_DATASETS)}.")
  return _DATASETS[name]


def dataset_info(name: str) -> dict[str, Any]:
  """Facts a model and a pipeline need about an image data set.

  Args:
    name: 'digits', 'cifar10' or 'imagenet2012'.

  Returns:
    ``dict(num_classes, image_shape, mean, std, splits)``; ``image_shape`` is the model
    input ``(H, W, C)`` (digits: 8x8 at ``upscale=1``, multiply by the upscale factor;
    imagenet2012: after ``resize_and_center_crop`` / ``random_resized_crop`` to 224).
  """
  info = _lookup(name)
  return dict(
    num_classes=info.num_classes,
    image_shape=info.image_shape,
    mean=info.mean,
    std=info.std,
    splits=info.splits,
  )


# --------------------------------------------------------------------------- sources


def input_side(dataset: str, *, upscale: int = 1, image_size: int = 0) -> int:
  """Side of the model's square input images: digits' 8 pixels times ``upscale``, cifar10's 32,
  imagenet2012's crop ``image_size`` (0: ``DEFAULT_IMAGENET_SIZE``)."""
  if dataset == "imagenet2012":
    return int(image_size or DEFAULT_IMAGENET_SIZE)
  side = dataset_info(dataset)["image_shape"][0]
  return side * int(upscale) if dataset == "digits" else side


def digits_sources(
  *, upscale: int = 1, seed: int = 0, test_fraction: float = 0.2
) -> dict[str, ArraySource]:
  """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), offline.

  The split is stratified by label and determined by ``seed``; records within a split are
  in the data set's original order (shuffling is the loader's job).

  Args:
    upscale: integer nearest-neighbour upscaling, e.g. 2 gives 16x16 images, so 4x4
      patches make a 4x4 patch grid.
    seed: seed of the train/test split.
    test_fraction: fraction of each class put in 'test', in (0, 1).

  Returns:
    ``{'train': source, 'test': source}``; records ``{'image': float32 [8u, 8u, 1] in
    [0, 1], 'label': int32 []}``.
  """
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  if not isinstance(upscale, (int, np.integer)) or upscale < 1:
    raise ValueError(f"upscale must be a positive integer, got {upscale!r}.")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}.")
  digits = load_digits()
  # Pixel values are integers 0..16.
  images = (digits.images.astype(np.float32) / 16.0)[..., None]
  images = np.repeat(np.repeat(images, upscale, axis=1), upscale, axis=2)
  labels = digits.target.astype(np.int32)
  train_index, test_index = train_test_split(
    np.arange(len(labels)), test_size=test_fraction, stratify=labels, random_state=seed
  )
  return {
    split: ArraySource(images[np.sort(index)], labels[np.sort(index)])
    for split, index in (("train", train_index), ("test", test_index))
  }


def tfds_image_sources(
  name: str, *, data_dir: str | os.PathLike | None = None, splits: Sequence[str] | None = None
) -> dict[str, Any]:
  """Random-access TFDS sources of a data set prepared in array_record format.

  Needs no TensorFlow to read. Records are TFDS's, e.g. cifar10's ``{'id': bytes,
  'image': uint8 [32, 32, 3], 'label': int64 []}``; imagenet2012's images have varying size.

  Args:
    name: TFDS name, e.g. 'cifar10' or 'imagenet2012' (any prepared TFDS data set works
      when ``splits`` is given).
    data_dir: TFDS data directory; None means TFDS's default (``TFDS_DATA_DIR`` or
      ``~/tensorflow_datasets``).
    splits: split names; defaults to (train, evaluation) split of ``dataset_info(name)``.

  Returns:
    ``{split: tfds ArrayRecordDataSource}``.

  Raises:
    FileNotFoundError: the data set is not prepared there (in a random-access format);
      the message says how to prepare it.
  """
  import tensorflow_datasets as tfds  # slow import

  known = _DATASETS.get(name)
  if name == "digits":
    raise ValueError("'digits' ships with scikit-learn: use digits_sources(), not TFDS.")
  if splits is None:
    if known is None:
      raise ValueError(
        f"Pass splits= for TFDS data set {name!r} (defaults exist for "
        f"{sorted(n for n, d in _DATASETS.items() if d.preparation)})."
      )
    splits = known.splits
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as error:
    raise ValueError(f"{name!r} is not in the TFDS catalogue: {error}") from None

  preparation = (
    known.preparation
    if known is not None
    else (
      f"On a machine with TensorFlow run: tfds build {name} --file_format=array_record "
      "--data_dir=DATA_DIR, then pass data_dir=DATA_DIR."
    )
  )
  if not builder.is_prepared():
    raise FileNotFoundError(
      f"TFDS data set {name!r} is not prepared in {builder.data_dir}.\n{preparation}"
    )
  random_access = tfds.core.file_adapters.FileFormat.with_random_access()
  if builder.info.file_format not in random_access:
    raise FileNotFoundError(
      f"TFDS data set {name!r} in {builder.data_dir} is in {builder.info.file_format.value} format, "
      f"which has no random access; prepare it again with --file_format=array_record.\n{preparation}"
    )
  missing = [split for split in splits if split not in builder.info.splits]
  if missing:
    raise ValueError(f"Splits {missing} not in {name!r}; available: {sorted(builder.info.splits)}.")
  return {split: builder.as_data_source(split=split) for split in splits}


# --------------------------------------------------------------------------- preprocessing


def to_float(image: np.ndarray) -> np.ndarray:
  """uint8 ``[H, W, C]`` -> float32 in [0, 1]; float images are cast to float32 unchanged."""
  if image.dtype == np.uint8:
    return image.astype(np.float32) / 255.0
  return image.astype(np.float32)


def normalize(image: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
  """Per-channel standardisation ``(image - mean) / std``.

  Args:
    image: ``[H, W, C]`` pixel values in [0, 1] (uint8 is converted with ``to_float``).
    mean, std: ``[C]`` (or scalars).

  Returns:
    float32 ``[H, W, C]``.
  """
  mean = np.asarray(mean, dtype=np.float32)
  std = np.asarray(std, dtype=np.float32)
  return (to_float(image) - mean) / std


def random_flip(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Mirrors ``[H, W, C]`` left-right with probability 1/2 (same shape and dtype)."""
  return np.ascontiguousarray(image[:, ::-1]) if rng.random() < 0.5 else image


def random_crop_with_padding(
  image: np.ndarray, rng: np.random.Generator, padding: int
) -> np.ndarray:
  """Zero-pads ``padding`` pixels on every side, then crops back to the original size.

  Applied before ``normalize``, so the padding is black, as in the usual CIFAR recipe.

  Args:
    image: ``[H, W, C]``.
    rng: NumPy generator.
    padding: pixels of padding (0 returns the image unchanged).

  Returns:
    ``[H, W, C]``, same dtype: the image shifted by (dy, dx) in [-padding, padding]^2.
  """
  if padding < 0:
    raise ValueError(f"padding must be >= 0, got {padding}.")
  height, width = image.shape[:2]
  padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
  top, left = rng.integers(0, 2 * padding + 1, size=2)
  return padded[top : top + height, left : left + width]


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """Bicubic resize of ``[H, W, C]`` to ``[height, width, C]`` with PIL, dtype kept."""
  if image.dtype == np.uint8:
    channels = [
      Image.fromarray(image[..., c]).resize((width, height), Image.BICUBIC)
      for c in range(image.shape[-1])
    ]
    return np.stack([np.asarray(c) for c in channels], axis=-1)
  # Float images go through PIL's 32-bit float mode, one channel at a time.
  channels = [
    Image.fromarray(image[..., c].astype(np.float32), mode="F").resize(
      (width, height), Image.BICUBIC
    )
    for c in range(image.shape[-1])
  ]
  return np.stack([np.asarray(c) for c in channels], axis=-1).astype(image.dtype)


def resize_and_center_crop(
  image: np.ndarray, size: int, crop_fraction: float = 0.875
) -> np.ndarray:
  """Evaluation transform of ImageNet models: resize, then a central square crop.

  The shorter side is resized to ``round(size / crop_fraction)`` (256 for 224), keeping
  the aspect ratio, and the central ``size x size`` window is returned.

  Args:
    image: ``[H, W, C]`` uint8 or float.
    size: output side.
    crop_fraction: crop side over resized shorter side, in (0, 1].

  Returns:
    ``[size, size, C]``, dtype of ``image``.
  """
  if not 0.0 < crop_fraction <= 1.0:
    raise ValueError(f"crop_fraction must lie in (0, 1], got {crop_fraction}.")
  height, width = image.shape[:2]
  shorter = int(round(size / crop_fraction))
  scale = shorter / min(height, width)
  new_height, new_width = (
    max(size, int(round(height * scale))),
    max(size, int(round(width * scale))),
  )
  resized = _resize(image, new_height, new_width)
  top, left = (new_height - size) // 2, (new_width - size) // 2
  return resized[top : top + size, left : left + size]


def random_resized_crop(
  image: np.ndarray,
  rng: np.random.Generator,
  size: int,
  scale: tuple[float, float] = (0.08, 1.0),
  ratio: tuple[float, float] = (3 / 4, 4 / 3),
  attempts: int = 10,
) -> np.ndarray:
  """Inception-style training crop: a random area / aspect-ratio window, resized.

  Tries ``attempts`` windows with area fraction in ``scale`` and log-uniform aspect ratio
  in ``ratio``; if none fits, falls back to ``resize_and_center_crop(image, size, 1.0)``.

  Args:
    image: ``[H, W, C]`` uint8 or float.
    rng: NumPy generator.
    size: output side.

  Returns:
    ``[size, size, C]``, dtype of ``image``.
  """
  height, width = image.shape[:2]
  for _ in range(attempts):
    area = height * width * rng.uniform(*scale)
    aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1])))
    crop_width = int(round(np.sqrt(area * aspect)))
    crop_height = int(round(np.sqrt(area / aspect)))
    if 0 < crop_width <= width and 0 < crop_height <= height:
      top = rng.integers(0, height - crop_height + 1)
      left = rng.integers(0, width - crop_width + 1)
      return _resize(image[top : top + crop_height, left : left + crop_width], size, size)
  return resize_and_center_crop(image, size, crop_fraction=1.0)


# --------------------------------------------------------------------------- per-data-set recipes

Transform = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def _digits_train(upscale: int, image_size: int) -> list[Transform]:
  del image_size
  return [lambda image, rng: random_crop_with_padding(image, rng, padding=upscale)]


def _cifar10_train(upscale: int, image_size: int) -> list[Transform]:
  del upscale, image_size
  return [lambda image, rng: random_crop_with_padding(image, rng, padding=4), random_flip]


def _imagenet_train(upscale: int, image_size: int) -> list[Transform]:
  del upscale
  return [lambda image, rng: random_resized_crop(image, rng, image_size), random_flip]


def _no_resize(upscale: int, image_size: int) -> list[Transform]:
  del upscale, image_size
  return []


def _imagenet_eval(upscale: int, image_size: int) -> list[Transform]:
  del upscale
  return [lambda image, rng: resize_and_center_crop(image, image_size)]


# (train recipe, eval recipe); each maps (upscale, image_size) to a list of transforms that
# run on the raw image before `to_float` and `normalize`.
_RECIPES: dict[
  str, tuple[Callable[[int, int], list[Transform]], Callable[[int, int], list[Transform]]]
] = {
  "digits": (_digits_train, _no_resize),
  "cifar10": (_cifar10_train, _no_resize),
  "imagenet2012": (_imagenet_train, _imagenet_eval),
}


def _preprocess(
  record: Mapping[str, Any],
  rng: np.random.Generator | None,
  *,
  transforms: list[Transform],
  mean: Sequence[float],
  std: Sequence[float],
) -> dict[str, np.ndarray]:
  image = record["image"]
  for transform in transforms:
    image = transform(image, rng)
  return {
    "inputs": normalize(image, mean, std),
    "label": np.asarray(record["label"], dtype=np.int32),
  }


def make_preprocess(
  name: str, *, train: bool, image_size: int | None = None, upscale: int = 1
) -> Callable[..., dict[str, np.ndarray]]:
  """Raw record -> model record, as a grain transform.

  Args:
    name: 'digits', 'cifar10' or 'imagenet2012'.
    train: use the training augmentation (then call the result with an rng, e.g. through
      ``grain.MapDataset.random_map``); evaluation transforms are deterministic.
    image_size: output side for imagenet2012 (default 224); unused otherwise.
    upscale: the ``digits_sources`` upscale factor (digits shift by one original pixel).

  Returns:
    ``fn(record, rng=None) -> {'inputs': float32 [H, W, C], 'label': int32 []}``.
  """
  info = _lookup(name)
  train_recipe, eval_recipe = _RECIPES[name]
  recipe = train_recipe if train else eval_recipe
  image_size = info.image_shape[0] if image_size is None else image_size
  transforms = recipe(upscale, image_size)
  preprocess = functools.partial(_preprocess, transforms=transforms, mean=info.mean, std=info.std)

  def apply(
    record: Mapping[str, Any], rng: np.random.Generator | None = None
  ) -> dict[str, np.ndarray]:
    if train and rng is None:
      raise ValueError("Training preprocessing is random: pass an rng (use grain's random_map).")
    return preprocess(record, rng)

  return apply
