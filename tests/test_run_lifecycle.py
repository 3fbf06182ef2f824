"""What happens around a training run: resuming after a crash (TensorBoard, the resume line),
evaluating a workdir while it trains, changing the optimizer of a stopped run, and model
selection settings that cannot work."""

import os

import numpy as np
import pytest

import helpers
from primal_dual.training import metrics_logging
from primal_dual.training import sharding
from primal_dual.training import trainer

tiny_config = helpers.tiny_config


class Crash(Exception):
  """Stands in for a killed process."""


def crash_on_training_batch(number: int):
  """A `shard_batch` that raises `Crash` on the `number`-th training batch."""
  original, count = sharding.shard_batch, [0]

  def shard(batch, mesh):
    if 'valid' not in batch:  # training batch (eval batches carry `valid`)
      count[0] += 1
      if count[0] == number:
        raise Crash()
    return original(batch, mesh)

  return shard


def crash_then_resume(workdir: str, config) -> dict:
  """Trains `config` in `workdir`, crashing on training batch 7 (the last checkpoint is step 4,
  steps 2, 4, 6 are logged), then resumes to the end; returns the final metrics."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, 'shard_batch', crash_on_training_batch(7))
    with pytest.raises(Crash):
      trainer.train_and_evaluate(config, workdir)
  return trainer.train_and_evaluate(config, workdir)


def tensorboard_steps(workdir: str, tag: str) -> list[int]:
  """The steps of `tag` as TensorBoard's own loader shows them."""
  from tensorboard.backend.event_processing import event_accumulator

  accumulator = event_accumulator.EventAccumulator(
    os.path.join(workdir, metrics_logging.TENSORBOARD_DIR), size_guidance={'scalars': 0}
  )
  accumulator.Reload()
  return [event.step for event in accumulator.Scalars(tag)]


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path, capsys):
  workdir = str(tmp_path)
  crash_then_resume(workdir, tiny_config())
  assert tensorboard_steps(workdir, 'train/loss') == [2, 4, 6, 8]
  assert [r['step'] for r in metrics_logging.read_metrics(workdir)] == [2, 4, 6, 8]
  out = capsys.readouterr().out
  assert out.count('resuming from step 4 ') == 1


def test_a_new_run_says_nothing_about_resuming(tmp_path, capsys):
  trainer.train_and_evaluate(tiny_config(num_train_steps=2), str(tmp_path))
  assert 'resuming' not in capsys.readouterr().out
  assert np.isfinite(metrics_logging.read_metrics(str(tmp_path))[-1]['train/loss'])
