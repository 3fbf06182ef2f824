"""What happens around a training run: resuming after a crash (TensorBoard, the resume line),
evaluating a workdir while it trains, changing the optimizer of a stopped run, and model
selection settings that cannot work."""

import json
import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest

import helpers
from primal_dual.training import checkpointing
from primal_dual.training import errors
from primal_dual.training import evaluation
from primal_dual.training import metrics_logging
from primal_dual.training import selection
from primal_dual.training import setup
from primal_dual.training import sharding
from primal_dual.training import task_registry as tasks
from primal_dual.training import trainer
from primal_dual.training import workdir as workdir_lib

tiny_config = helpers.tiny_config


class Crash(Exception):
  """Stands in for a killed process."""


def crash_on_training_batch(number: int):
  """A `shard_batch` that raises `Crash` on the `number`-th training batch."""
  original, count = sharding.shard_batch, [0]

  def shard(batch, mesh):
    if "valid" not in batch:  # training batch (eval batches carry `valid`)
      count[0] += 1
      if count[0] == number:
        raise Crash()
    return original(batch, mesh)

  return shard


def crash_then_resume(workdir: str, config) -> dict:
  """Trains `config` in `workdir`, crashing on training batch 7 (the last checkpoint is step 4,
  steps 2, 4, 6 are logged), then resumes to the end; returns the final metrics."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, "shard_batch", crash_on_training_batch(7))
    with pytest.raises(Crash):
      trainer.train_and_evaluate(config, workdir)
  return trainer.train_and_evaluate(config, workdir)


def tensorboard_steps(workdir: str, tag: str) -> list[int]:
  """The steps of `tag` as TensorBoard's own loader shows them."""
  from tensorboard.backend.event_processing import event_accumulator

  accumulator = event_accumulator.EventAccumulator(
    os.path.join(workdir, metrics_logging.TENSORBOARD_DIR), size_guidance={"scalars": 0}
  )
  accumulator.Reload()
  return [event.step for event in accumulator.Scalars(tag)]


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path, capsys):
  workdir = str(tmp_path)
  crash_then_resume(workdir, tiny_config())
  assert tensorboard_steps(workdir, "train/loss") == [2, 4, 6, 8]
  assert [r["step"] for r in metrics_logging.read_metrics(workdir)] == [2, 4, 6, 8]
  out = capsys.readouterr().out
  assert out.count("resuming from step 4 ") == 1


def test_a_new_run_says_nothing_about_resuming(tmp_path, capsys):
  trainer.train_and_evaluate(tiny_config(num_train_steps=2), str(tmp_path))
  assert "resuming" not in capsys.readouterr().out
  assert np.isfinite(metrics_logging.read_metrics(str(tmp_path))[-1]["train/loss"])


# ------------------------------------------------------------------------------------------------
# Evaluating a workdir that is training.


def test_evaluation_leaves_unfinished_checkpoints_alone(tmp_path):
  """An unfinished save (a `*.orbax-checkpoint-tmp*` folder) may belong to a run training right
  now: evaluation (and any read-only restore) neither removes it nor writes checkpoints."""
  workdir = str(tmp_path)
  trainer.train_and_evaluate(tiny_config(num_train_steps=4), workdir)
  checkpoints = os.path.join(workdir, checkpointing.CHECKPOINT_DIR)
  in_flight = os.path.join(checkpoints, "8.orbax-checkpoint-tmp-1700000000")
  os.makedirs(os.path.join(in_flight, "state"))
  before = sorted(os.listdir(checkpoints))
  report = evaluation.evaluate_workdir(workdir)
  assert report["step"] == 4
  assert sorted(os.listdir(checkpoints)) == before
  assert os.path.isdir(os.path.join(in_flight, "state"))
  with checkpointing.Checkpointer(checkpoints, read_only=True) as checkpointer:
    with pytest.raises(RuntimeError, match="read-only"):
      checkpointer.delete_after(0)
  assert sorted(os.listdir(checkpoints)) == before


def _final_params(workdir: str, config):
  program = setup.build_program(setup.resolve_config(config), for_training=False)
  with checkpointing.Checkpointer(
    os.path.join(workdir, checkpointing.CHECKPOINT_DIR), read_only=True
  ) as checkpointer:
    state, _ = checkpointer.restore(None, program.restore_target())
  return jax.device_get(state.params)


def test_evaluating_while_training_leaves_the_run_as_it_would_have_been(tmp_path):
  config = tiny_config(num_train_steps=12, checkpoint_every_steps=1, async_checkpointing=True)
  reference = trainer.train_and_evaluate(config, str(tmp_path / "reference"))
  workdir = str(tmp_path / "watched")
  outcome = {}

  def train():
    try:
      outcome["final"] = trainer.train_and_evaluate(config, workdir)
    except BaseException as e:
      outcome["error"] = e

  thread = threading.Thread(target=train)
  thread.start()
  evaluations = 0
  while thread.is_alive():
    try:
      evaluation.evaluate_workdir(workdir, splits=("test",))
      evaluations += 1
    except errors.CheckpointNotFoundError:
      time.sleep(0.05)  # no config.json or no checkpoint yet
  thread.join()
  assert "error" not in outcome, outcome.get("error")
  assert evaluations > 0

  assert helpers.without_timing(outcome["final"]) == helpers.without_timing(reference)
  jax.tree.map(
    np.testing.assert_array_equal,
    _final_params(str(tmp_path / "reference"), config),
    _final_params(workdir, config),
  )


def test_evaluating_a_sweep_workdir_names_its_replica_folders(tmp_path):
  """The layouts sweeps leave: a workdir per replica (`seed=<s>`, `lr=...,seed=...`), and none
  at the top."""
  workdir = str(tmp_path)
  trainer.train_and_evaluate(tiny_config(num_train_steps=2), os.path.join(workdir, "seed=0"))
  shutil.copytree(os.path.join(workdir, "seed=0"), os.path.join(workdir, "seed=3"))
  with pytest.raises(errors.WorkdirError) as info:
    evaluation.evaluate_workdir(workdir)
  assert str(info.value) == (
    f"workdir {workdir} holds one run per replica (seed=0, seed=3); evaluate one of them, "
    f"e.g. --workdir={workdir}/seed=0"
  )
  sweep_root = os.path.join(workdir, "sweep")
  for replica in ("lr=0.1,seed=0", "lr=0.2,seed=0"):
    shutil.copytree(os.path.join(workdir, "seed=0"), os.path.join(sweep_root, replica))
  with pytest.raises(errors.WorkdirError, match=r"one run per replica \(lr=0.1,seed=0, lr=0.2"):
    evaluation.evaluate_workdir(sweep_root)
  assert evaluation.evaluate_workdir(os.path.join(workdir, "seed=3"))["step"] == 2


# ------------------------------------------------------------------------------------------------
# Model selection settings.


def test_selection_on_the_loss_selects_the_lowest_loss(tmp_path):
  config = tiny_config(**{"selection.metric": "loss"})
  task = tasks.get_task("synthetic")
  assert selection.make_tracker(setup.resolve_config(config), task).mode == "min"
  final = trainer.train_and_evaluate(config, str(tmp_path))
  losses = {
    r["step"]: r["validation/loss"]
    for r in metrics_logging.read_metrics(str(tmp_path))
    if "validation/loss" in r
  }
  assert len(set(losses.values())) > 1  # otherwise any rule would pick the same value
  assert final["selected/validation_loss"] == min(losses.values())
  assert final["selected/step"] == min(losses, key=losses.get)
  assert final["selected/rule"].startswith("min validation loss")


def test_a_selection_metric_the_task_lacks_is_refused_before_anything_is_written(tmp_path):
  workdir = str(tmp_path / "run")
  with pytest.raises(errors.ConfigError, match=r"'f1' is not a metric .* reports accuracy, loss$"):
    trainer.train_and_evaluate(tiny_config(**{"selection.metric": "f1"}), workdir)
  assert os.listdir(workdir) == []


# ------------------------------------------------------------------------------------------------
# Continuing with changed optimizer settings.


def test_a_run_continues_with_a_changed_learning_rate_only_when_asked(tmp_path, capsys):
  workdir = str(tmp_path)
  trainer.train_and_evaluate(tiny_config(num_train_steps=4), workdir)
  lower = {"num_train_steps": 8, "optimizer.lr": 0.01, "optimizer.schedule": "constant"}
  with pytest.raises(errors.WorkdirError) as info:
    trainer.train_and_evaluate(tiny_config(**lower), workdir)
  message = str(info.value)
  assert "\n" not in message
  assert "optimizer.lr 0.05 != 0.01; optimizer.schedule 'warmup_cosine' != 'constant'" in message
  assert message.endswith("add --config.resume_with_changed_optimizer=True")

  capsys.readouterr()
  final = trainer.train_and_evaluate(
    tiny_config(**lower, resume_with_changed_optimizer=True), workdir
  )
  assert final["step"] == 8 and final["train/learning_rate"] == pytest.approx(0.01)
  assert capsys.readouterr().out.count("with changed optimizer settings: optimizer.lr 0.05") == 1
  with open(os.path.join(workdir, "experiment.json")) as f:
    stored = json.load(f)
  assert stored["definition"]["optimizer.lr"] == 0.01
  assert stored["history"] == [
    {
      "step": 4,
      "changed": {
        "optimizer.lr": [0.05, 0.01],
        "optimizer.schedule": ["warmup_cosine", "constant"],
      },
    }
  ]
  learning_rates = {
    r["step"]: r["train/learning_rate"] for r in metrics_logging.read_metrics(workdir)
  }
  assert learning_rates[6] == pytest.approx(0.01) and learning_rates[2] != pytest.approx(0.01)


def test_changes_that_reshape_the_optimizer_state_are_refused_even_when_asked(tmp_path):
  workdir = str(tmp_path)
  trainer.train_and_evaluate(tiny_config(num_train_steps=4), workdir)
  with pytest.raises(errors.WorkdirError, match=r"optimizer.grad_clip_norm cannot change"):
    trainer.train_and_evaluate(
      tiny_config(
        num_train_steps=8, resume_with_changed_optimizer=True, **{"optimizer.grad_clip_norm": 0.0}
      ),
      workdir,
    )
  # Another clipping norm keeps the state's structure.
  final = trainer.train_and_evaluate(
    tiny_config(
      num_train_steps=8, resume_with_changed_optimizer=True, **{"optimizer.grad_clip_norm": 0.5}
    ),
    workdir,
  )
  assert final["step"] == 8


def test_the_non_finite_loss_advice_names_a_flag_the_workdir_accepts(tmp_path):
  """The parameters a diverging run checkpoints are often past saving already; what matters here
  is that the advice names the flag and that the workdir accepts a lower learning rate with it."""
  workdir = str(tmp_path)
  diverging = {
    "optimizer.lr": 1e30,
    "checkpoint_every_steps": 1,
    "log_every_steps": 0,
    "eval_every_steps": 0,
    "model.use_batch_norm": False,
  }
  with pytest.raises(errors.NonFiniteLossError) as info:
    trainer.train_and_evaluate(tiny_config(**diverging), workdir)
  assert "--config.resume_with_changed_optimizer=True" in str(info.value)
  calmer = dict(diverging, **{"optimizer.lr": 1e-3})
  with pytest.raises(errors.WorkdirError, match="resume_with_changed_optimizer=True$"):
    workdir_lib.check_same_experiment(workdir, setup.resolve_config(tiny_config(**calmer)))
  workdir_lib.check_same_experiment(
    workdir, setup.resolve_config(tiny_config(**calmer, resume_with_changed_optimizer=True))
  )


def test_a_checkpoint_deleted_while_read_is_read_again(tmp_path, monkeypatch):
  """A run training in the workdir deletes its older checkpoints as it saves: a reader that
  listed one just before it went reads the folder again (the race the test above can hit)."""
  workdir = str(tmp_path)
  trainer.train_and_evaluate(tiny_config(num_train_steps=2), workdir)
  real = evaluation._restore_read_only
  calls = []

  def vanishing_once(folder, step, program):
    calls.append(step)
    if len(calls) == 1:
      raise FileNotFoundError(os.path.join(folder, "1"))
    return real(folder, step, program)

  monkeypatch.setattr(evaluation, "_restore_read_only", vanishing_once)
  _, state = evaluation.restore_workdir(workdir)
  assert int(state.step) == 2 and len(calls) == 2

  def always_vanishing(folder, step, program):
    raise FileNotFoundError(os.path.join(folder, "1"))

  monkeypatch.setattr(evaluation, "_restore_read_only", always_vanishing)
  with pytest.raises(errors.CheckpointNotFoundError) as info:
    evaluation.restore_workdir(workdir)
  assert "\n" not in str(info.value) and str(info.value).endswith("--checkpoint=selected")
