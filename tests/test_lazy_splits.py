"""Splits are built when first read: training builds the training split once, and evaluating a
workdir (restore_workdir / evaluate_workdir / eval.py) never builds it."""

import dataclasses

import pytest

from helpers import tiny_config
from primal_dual.training import evaluation
from primal_dual.training import setup
from primal_dual.tasks import synthetic
from primal_dual.training import task_registry as tasks
from primal_dual.training import trainer

BUILDS: dict[str, int] = {}


def _counted(split: str, source):
  def build():
    BUILDS[split] = BUILDS.get(split, 0) + 1
    return source

  return tasks.LazySplit(build)


def _lazy_synthetic_data(config):
  splits, metadata = synthetic.build_data(config)
  return {name: _counted(name, source) for name, source in splits.items()}, metadata


@pytest.fixture(scope="module")
def lazy_task():
  task = dataclasses.replace(
    tasks.TASKS["synthetic"], name="lazy_synthetic", build_data=_lazy_synthetic_data
  )
  tasks.register_task(task, overwrite=True)
  yield task
  del tasks.TASKS["lazy_synthetic"]


def test_lazy_splits_build_once_and_only_when_read(lazy_task):
  BUILDS.clear()
  splits = setup.LazySplits(lazy_task.build_data(tiny_config())[0])
  assert sorted(splits) == ["test", "train", "validation"] and "test" in splits
  assert BUILDS == {}
  first = splits["test"]
  assert splits["test"] is first and BUILDS == {"test": 1}
  assert splits.is_built("test") and not splits.is_built("train")


def test_evaluating_a_workdir_never_builds_the_training_split(lazy_task, tmp_path):
  BUILDS.clear()
  config = tiny_config(task=lazy_task.name, eval_every_steps=0, checkpoint_every_steps=0)
  final = trainer.train_and_evaluate(config, str(tmp_path))
  assert BUILDS["train"] == 1

  BUILDS.clear()
  report = evaluation.evaluate_workdir(str(tmp_path), ("test",))
  assert "train" not in BUILDS and BUILDS["test"] == 1
  assert report["results"]["test"]["accuracy"] == pytest.approx(final["test/accuracy"])

  BUILDS.clear()
  program, _ = evaluation.restore_workdir(str(tmp_path), "latest")
  assert "train" not in BUILDS and not program.splits.is_built("train")
  assert program.total_steps == config.num_train_steps


def test_evaluating_an_epoch_based_run_with_steps_per_call(tmp_path):
  """Evaluation computes no action periods: epoch-based ones would come out as 1 step (no
  training split, so 0 steps per epoch), which steps_per_call=2 would refuse."""
  config = tiny_config(steps_per_call=2, eval_every_steps=0, eval_every_epochs=1)
  final = trainer.train_and_evaluate(config, str(tmp_path))
  report = evaluation.evaluate_workdir(str(tmp_path), ("test",))
  assert report["results"]["test"]["accuracy"] == pytest.approx(final["test/accuracy"])
