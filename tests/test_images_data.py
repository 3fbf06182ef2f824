"""Tests of the image data: digits sources, augmentation, preprocessing, TFDS access."""

import numpy as np
import pytest

from primal_dual.data import images


@pytest.fixture(scope="module")
def digits():
  return images.digits_sources(seed=0)


def _all_records(source):
  return np.stack([source[i]["image"] for i in range(len(source))]), np.array(
    [source[i]["label"] for i in range(len(source))]
  )


def test_digits_sizes_shapes_and_range(digits):
  assert set(digits) == {"train", "test"}
  assert len(digits["train"]) + len(digits["test"]) == 1797
  assert len(digits["test"]) == pytest.approx(0.2 * 1797, abs=10)
  record = digits["train"][0]
  assert record["image"].shape == (8, 8, 1) and record["image"].dtype == np.float32
  assert record["label"].dtype == np.int32 and record["label"].shape == ()
  for source in digits.values():
    image_array, labels = _all_records(source)
    assert image_array.min() == 0.0 and image_array.max() == 1.0
    assert set(labels.tolist()) == set(range(10))


def test_digits_split_is_a_stratified_partition(digits):
  from sklearn.datasets import load_digits

  full = load_digits()
  train_images, train_labels = _all_records(digits["train"])
  test_images, test_labels = _all_records(digits["test"])
  # Train and test together are exactly the data set (as a multiset of (image, label)).
  rows = lambda x, y: sorted(
    zip(map(bytes, (x.reshape(len(x), -1) * 16).astype(np.uint8)), y.tolist())
  )
  combined = rows(
    np.concatenate([train_images, test_images]), np.concatenate([train_labels, test_labels])
  )
  assert combined == rows(full.images / 16.0, full.target)
  # Each class is split in the requested proportion.
  test_counts = np.bincount(test_labels, minlength=10)
  class_counts = np.bincount(full.target, minlength=10)
  assert np.all(np.abs(test_counts - 0.2 * class_counts) <= 1)


def test_digits_split_is_seeded(digits):
  same = images.digits_sources(seed=0)
  other = images.digits_sources(seed=1)
  np.testing.assert_array_equal(same["test"].labels, digits["test"].labels)
  np.testing.assert_array_equal(same["test"].images, digits["test"].images)
  assert not np.array_equal(other["test"].images, digits["test"].images)


def test_digits_upscale_is_nearest_neighbour(digits):
  upscaled = images.digits_sources(upscale=2, seed=0)
  big, small = upscaled["train"][5]["image"], digits["train"][5]["image"]
  assert big.shape == (16, 16, 1)
  for dy in range(2):
    for dx in range(2):
      np.testing.assert_array_equal(big[dy::2, dx::2], small)


@pytest.mark.parametrize("kwargs", [dict(upscale=0), dict(upscale=1.5), dict(test_fraction=1.0)])
def test_digits_bad_arguments(kwargs):
  with pytest.raises(ValueError):
    images.digits_sources(**kwargs)


def test_random_flip_is_identity_or_exact_mirror():
  image = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)
  rng = np.random.default_rng(0)
  outcomes = set()
  for _ in range(20):
    flipped = images.random_flip(image, rng)
    assert flipped.shape == image.shape and flipped.dtype == image.dtype
    if np.array_equal(flipped, image):
      outcomes.add("same")
    else:
      np.testing.assert_array_equal(flipped, image[:, ::-1])
      np.testing.assert_array_equal(flipped[:, 0], image[:, -1])
      outcomes.add("mirror")
  assert outcomes == {"same", "mirror"}


def test_random_crop_with_padding_is_a_valid_shift():
  height, width, padding = 5, 6, 2
  image = np.arange(1, height * width * 2 + 1, dtype=np.uint8).reshape(height, width, 2)
  rng = np.random.default_rng(0)
  offsets = set()
  for _ in range(60):
    crop = images.random_crop_with_padding(image, rng, padding)
    assert crop.shape == image.shape and crop.dtype == image.dtype
    # Exactly one shift (dy, dx) with |dy|, |dx| <= padding explains the crop.
    matches = []
    for dy in range(-padding, padding + 1):
      for dx in range(-padding, padding + 1):
        shifted = np.zeros_like(image)
        dst_y, src_y = (
          slice(max(dy, 0), height + min(dy, 0)),
          slice(max(-dy, 0), height + min(-dy, 0)),
        )
        dst_x, src_x = (
          slice(max(dx, 0), width + min(dx, 0)),
          slice(max(-dx, 0), width + min(-dx, 0)),
        )
        shifted[dst_y, dst_x] = image[src_y, src_x]
        if np.array_equal(crop, shifted):
          matches.append((dy, dx))
    assert len(matches) == 1
    offsets.add(matches[0])
  # Extreme shifts occur: the whole padding range is used.
  assert {dy for dy, _ in offsets} == set(range(-padding, padding + 1))
  np.testing.assert_array_equal(images.random_crop_with_padding(image, rng, 0), image)


def test_normalize_and_to_float():
  image = np.full((2, 2, 3), 255, dtype=np.uint8)
  mean, std = (0.5, 0.25, 0.0), (0.5, 0.25, 2.0)
  out = images.normalize(image, mean, std)
  assert out.dtype == np.float32
  np.testing.assert_allclose(out[0, 0], [1.0, 3.0, 0.5])
  float_image = np.random.default_rng(0).random((3, 3, 3)).astype(np.float32)
  np.testing.assert_allclose(
    images.normalize(float_image, mean, std) * std + mean, float_image, rtol=1e-6
  )


def test_resize_and_center_crop():
  image = np.zeros((40, 60, 3), dtype=np.uint8)
  image[:, 30:] = 200  # right half bright: the centre column of the crop is at the boundary
  out = images.resize_and_center_crop(image, size=16)
  assert out.shape == (16, 16, 3) and out.dtype == np.uint8
  assert out[:, 0].max() < 50 and out[:, -1].min() > 150
  float_out = images.resize_and_center_crop(
    image.astype(np.float32) / 255, size=8, crop_fraction=1.0
  )
  assert float_out.shape == (8, 8, 3) and float_out.dtype == np.float32


def test_random_resized_crop_shape_and_content():
  image = np.full((30, 50, 3), 77, dtype=np.uint8)
  rng = np.random.default_rng(0)
  for _ in range(5):
    out = images.random_resized_crop(image, rng, size=12)
    assert out.shape == (12, 12, 3) and out.dtype == np.uint8
    assert np.all(out == 77)


def test_make_preprocess_digits_and_cifar10(digits):
  record = digits["train"][3]
  train_fn = images.make_preprocess("digits", train=True)
  eval_fn = images.make_preprocess("digits", train=False)
  out = train_fn(record, np.random.default_rng(0))
  assert set(out) == {"inputs", "label"}
  assert out["inputs"].shape == (8, 8, 1) and out["inputs"].dtype == np.float32
  assert out["label"] == record["label"] and out["label"].dtype == np.int32
  evaluated = eval_fn(record)
  np.testing.assert_allclose(evaluated["inputs"] * 0.3760 + 0.3053, record["image"], atol=1e-6)
  with pytest.raises(ValueError, match="rng"):
    train_fn(record)

  cifar_record = {"image": np.full((32, 32, 3), 128, np.uint8), "label": np.int64(7)}
  out = images.make_preprocess("cifar10", train=True)(cifar_record, np.random.default_rng(1))
  assert out["inputs"].shape == (32, 32, 3) and out["inputs"].dtype == np.float32
  assert out["label"] == 7 and out["label"].dtype == np.int32

  imagenet_record = {"image": np.zeros((50, 70, 3), np.uint8), "label": np.int64(999)}
  for train in (True, False):
    out = images.make_preprocess("imagenet2012", train=train, image_size=24)(
      imagenet_record, np.random.default_rng(2)
    )
    assert out["inputs"].shape == (24, 24, 3)


def test_dataset_info():
  assert images.dataset_info("digits")["image_shape"] == (8, 8, 1)
  assert images.dataset_info("cifar10")["num_classes"] == 10
  assert images.dataset_info("cifar10")["image_shape"] == (32, 32, 3)
  assert images.dataset_info("imagenet2012")["num_classes"] == 1000
  assert images.dataset_info("imagenet2012")["splits"] == ("train", "validation")
  with pytest.raises(ValueError, match="cifar10"):
    images.dataset_info("mnist")


@pytest.mark.parametrize(
  "name, expected",
  [
    ("cifar10", "tfds build cifar10 --file_format=array_record"),
    ("imagenet2012", "downloads/manual"),
  ],
)
def test_missing_tfds_data_set_says_how_to_prepare(tmp_path, name, expected):
  with pytest.raises(FileNotFoundError) as error:
    images.tfds_image_sources(name, data_dir=tmp_path)
  assert expected in str(error.value)
  assert str(tmp_path) in str(error.value)


def test_prepared_tfds_data_set_is_read(tmp_path):
  import tensorflow_datasets as tfds

  # Tensor (not Image) features: encoding images needs TensorFlow, reading does not.
  class PrimalDualTinyImagesForTest(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {
            "image": tfds.features.Tensor(shape=(4, 4, 3), dtype=np.uint8),
            "label": tfds.features.ClassLabel(num_classes=3),
          }
        ),
      )

    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": self._generate_examples(5), "test": self._generate_examples(2)}

    def _generate_examples(self, count):
      for i in range(count):
        yield i, {"image": np.full((4, 4, 3), i, np.uint8), "label": i % 3}

  PrimalDualTinyImagesForTest(data_dir=tmp_path, file_format="array_record").download_and_prepare()
  sources = images.tfds_image_sources(
    "primal_dual_tiny_images_for_test", data_dir=tmp_path, splits=("train", "test")
  )
  assert {split: len(source) for split, source in sources.items()} == {"train": 5, "test": 2}
  values = sorted(int(sources["train"][i]["image"][0, 0, 0]) for i in range(5))
  assert values == list(range(5))
  with pytest.raises(ValueError, match="splits"):
    images.tfds_image_sources("primal_dual_tiny_images_for_test", data_dir=tmp_path)
  with pytest.raises(ValueError, match="validation"):
    images.tfds_image_sources(
      "primal_dual_tiny_images_for_test", data_dir=tmp_path, splits=("validation",)
    )
