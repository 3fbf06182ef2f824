"""The 'images' task: configs, augmented and evaluation sources, the missing-data message, model
summaries, and the reproduction script end to end on digits (2 runs)."""

import json
import os

import numpy as np
import pytest

from primal_dual.data import images as images_data
from reproduce import grid
from primal_dual.data import images as image_data
from primal_dual.tasks import images as images_task
from reproduce import images as images_study
from primal_dual.models import VIT_PRESETS
from primal_dual.training import errors
from primal_dual.training import trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(REPO, "primal_dual", "configs", "images.py")
# Data set → (image side, patch size, default ViT preset).
EXPECTED = {
  "digits": (16, 4, "micro"),
  "cifar10": (32, 4, "tiny"),
  "imagenet2012": (224, 16, "tiny"),
}


def load(arg):
  return grid.load_config(CONFIG_FILE, arg)


@pytest.fixture(scope="module")
def digits_raw():
  return images_data.digits_sources(upscale=2, seed=0)


@pytest.mark.parametrize("dataset", sorted(EXPECTED))
@pytest.mark.parametrize("model", ["", "micro", "tiny", "small"])
@pytest.mark.parametrize("attention", ["softmax", "bn_sh"])
def test_config_builds_for_dataset_model_and_attention(dataset, model, attention):
  config = load(f"dataset={dataset},model={model},attention={attention},seed=2")
  side, patch, default_model = EXPECTED[dataset]
  preset = VIT_PRESETS[model or default_model]
  assert config.task == "images" and config.seed == 2 and config.data.dataset == dataset
  assert {k: config.model[k] for k in preset} == preset
  assert config.model.patch_size == patch
  metadata = images_task.images_metadata(config)
  assert metadata["image_shape"][:2] == (side, side)
  steps_per_epoch = image_data.train_size(dataset) // config.batch_size
  assert config.num_train_steps == config.data.augment_repeats * steps_per_epoch
  assert config.optimizer.schedule == "warmup_cosine" and config.optimizer.weight_decay == 0.05
  if attention == "bn_sh":
    ratios = tuple(config.model.attention_options.ratios)
    grid_side = side // patch
    assert len(ratios) == preset["num_heads"] and ratios[0] == 1
    assert max(ratios) <= max(1, grid_side // 2)  # every head keeps at least a 2×2 grid


def test_imagenet_config_is_the_deit_recipe():
  config = load("dataset=imagenet2012,model=tiny")
  steps_per_epoch = 1_281_167 // 1024
  assert config.batch_size == 1024
  assert np.isclose(config.optimizer.lr, 5e-4 * 1024 / 512)
  assert config.optimizer.warmup_steps == 5 * steps_per_epoch
  assert config.num_train_steps == 300 * steps_per_epoch
  assert config.selection.split == "validation"
  assert images_task.images_metadata(config)["eval_split"] == "validation"


def test_config_errors_say_what_to_do():
  for arg, message in (
    ("dataset=mnist", "unknown image data set"),
    ("model=huge", "unknown ViT preset"),
    ("attention=nope", "unknown attention"),
    ("epochs=0", "epochs"),
  ):
    with pytest.raises(ValueError, match=message):
      load(arg)


def test_digits_train_size_matches_the_split(digits_raw):
  assert image_data.train_size("digits") == len(digits_raw["train"])
  assert len(digits_raw["train"]) + len(digits_raw["test"]) == image_data.DIGITS_SIZE


def test_augmented_source_is_a_pure_function_of_the_index(digits_raw):
  base = digits_raw["train"]
  preprocess = images_data.make_preprocess("digits", train=True, upscale=2)
  source = images_task.AugmentedSource(base, preprocess, seed=5, repeats=3, description="d")
  again = images_task.AugmentedSource(base, preprocess, seed=5, repeats=3, description="d")
  other_seed = images_task.AugmentedSource(base, preprocess, seed=6, repeats=3, description="d")
  n = len(base)
  assert len(source) == 3 * n and "repeats=3" in repr(source) and repr(source) == repr(again)
  indices = [0, 7, n + 7, 2 * n + 7, 3 * n - 1]
  records = source.__getitems__(indices)
  for index, record in zip(indices, records):
    np.testing.assert_array_equal(record["inputs"], again[index]["inputs"])
    assert record["inputs"].shape == (16, 16, 1) and record["inputs"].dtype == np.float32
    assert int(record["label"]) == int(base[index % n]["label"])
  # The passes over the same image differ (random shifts), as do different seeds.
  shifts = [records[1]["inputs"], records[2]["inputs"], records[3]["inputs"]]
  assert any(not np.array_equal(shifts[0], s) for s in shifts[1:])
  assert any(not np.array_equal(source[i]["inputs"], other_seed[i]["inputs"]) for i in range(8))
  with pytest.raises(IndexError):
    source[3 * n]


def test_build_data_splits_and_evaluation_records():
  config = load("dataset=digits,runlocal")
  splits, metadata = images_task.build_data(config)
  assert sorted(splits) == ["test", "train"] and metadata["num_classes"] == 10
  evaluation = images_data.make_preprocess("digits", train=False, upscale=2)
  raw = images_data.digits_sources(upscale=2, seed=0)["test"]
  np.testing.assert_array_equal(splits["test"][3]["inputs"], evaluation(raw[3])["inputs"])
  assert len(splits["train"]) == image_data.train_size("digits")  # runlocal: one pass


def test_missing_cifar10_says_how_to_prepare(tmp_path):
  config = load(f"dataset=cifar10,runlocal,data_dir={tmp_path}")
  with pytest.raises(errors.DataNotFoundError, match="tfds build cifar10"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))


def test_patch_size_must_divide_the_image():
  config = load("dataset=digits,runlocal")
  with config.unlocked():
    config.model.patch_size = 5
  with pytest.raises(errors.ConfigError, match="patch_size"):
    images_task.build_model(config, images_task.images_metadata(config))


def test_model_summary_parameters_and_flops():
  summaries = {
    a: images_study.model_summary(load(f"dataset=digits,attention={a}"))
    for a in ("softmax", "bn", "sh")
  }
  assert summaries["softmax"]["sequence_length"] == 1 + 4 * 4  # CLS + 4×4 patches
  assert len({s["parameters"] for s in summaries.values()}) == 1  # no variant adds parameters
  assert summaries["sh"]["attention_flops"] < summaries["softmax"]["attention_flops"]
  assert summaries["bn"]["attention_flops"] == summaries["softmax"]["attention_flops"]
  # 2 heads at ratio 1 and 2 at ratio 2 on the 4×4 grid: 17 keys and 1 + 2×2 keys.
  assert np.isclose(summaries["sh"]["attention_flops_relative"], (17 + 17 + 5 + 5) / (4 * 17))
  tiny = images_study.model_summary(load("dataset=imagenet2012,model=tiny"))
  assert 5.0e6 < tiny["parameters"] < 6.0e6  # DeiT-tiny has 5.7M parameters
  assert tiny["sequence_length"] == 1 + 14 * 14


@pytest.mark.slow
def test_reproduce_quick_trains_evaluates_and_reports(tmp_path):
  results = tmp_path / "out" / "images.json"
  assert (
    grid.reproduce(
      images_study.REPRODUCTION, ["--quick", f"--root={tmp_path / 'runs'}", f"--results={results}"]
    )
    == 0
  )
  records = json.loads(results.read_text())
  assert [r["attention"] for r in records] == ["softmax", "sh"]
  for record in records:
    images_study.validate_record(record)
    metrics = record["metrics"]
    assert metrics["step"] == 4 and record["dataset"] == "digits"
    assert 0.0 <= metrics["test/accuracy"] <= 1.0
    assert record["test_accuracy"] == metrics["test/accuracy"]
  assert records[1]["attention_flops"] < records[0]["attention_flops"]
  markdown = results.with_suffix(".md").read_text()
  assert "| softmax |" in markdown and "| sh |" in markdown
  assert "DeiT-tiny on ImageNet" in markdown and "imagenet2012" in markdown
