"""Tests for primal_dual.training: optimizer, periodic actions, sharding, checkpoints, the trainer.

End-to-end runs use the registered 'synthetic' task with tiny shapes. Compilation dominates on a
2-core CPU, so this module points JAX's persistent compilation cache at a temporary folder: runs
that build the same programs (the uninterrupted, crashed and resumed runs) compile once.
"""

import contextlib
import dataclasses
import functools
import gc
import json
import math
import errno
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cli_helpers
import helpers
from jax.sharding import PartitionSpec

import primal_dual.tasks
from primal_dual.training import checkpointing
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import metrics_logging
from primal_dual.training import optim
from primal_dual.training import evaluation
from primal_dual.training import periodic
from primal_dual.training import selection
from primal_dual.training import setup
from primal_dual.training import sharding
from primal_dual.tasks import synthetic
from primal_dual.training import task_registry as tasks
from primal_dual.training import trainer
from primal_dual.training import workdir as workdir_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


compilation_cache_dir = pytest.fixture(scope="module", autouse=True)(
  helpers.fresh_compilation_cache
)
tiny_config = helpers.tiny_config


class Crash(Exception):
  """Stands in for a killed process."""


def batch_recorder(seen: list, crash_at: int | None = None):
  """A `shard_batch` that records each training batch's labels (and can crash on the n-th)."""
  original = sharding.shard_batch

  def record(batch, mesh):
    if "valid" not in batch:  # training batch (eval batches carry `valid`)
      if crash_at is not None and len(seen) + 1 == crash_at:
        raise Crash()
      seen.append(np.asarray(batch["label"]).tolist())
    return original(batch, mesh)

  return record


def restore_state(workdir, step, config=None):
  program = setup.build_program(setup.resolve_config(config or tiny_config()))
  with checkpointing.Checkpointer(
    os.path.join(workdir, checkpointing.CHECKPOINT_DIR), keep=None, async_save=False
  ) as checkpointer:
    state, meta = checkpointer.restore(step, program.restore_target())
  return program, jax.device_get(state), meta


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """One full 8-step run; returns (workdir, final metrics, training batches' labels in order)."""
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  seen = []
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, "shard_batch", batch_recorder(seen))
    final = trainer.train_and_evaluate(tiny_config(), workdir)
  return workdir, final, seen


# ------------------------------------------------------------------------------------------------
# Periodic actions.


def test_periodic_actions_exact_steps_and_final_step_always():
  actions = periodic.PeriodicActions(10, every={"log": 3, "eval": 5, "checkpoint": 0, "x": None})
  assert actions.steps("log") == [3, 6, 9, 10]
  assert actions.steps("eval") == [5, 10]
  assert actions.steps("checkpoint") == [10]
  assert actions.steps("x") == [10]
  assert actions.due(6) == {"log"}
  assert actions.due(7) == frozenset()
  assert actions.due(10) == {"log", "eval", "checkpoint", "x"}
  assert actions.steps("log", start=6) == [9, 10]


def test_periodic_actions_period_longer_than_run_and_bad_total():
  assert periodic.PeriodicActions(4, every={"eval": 100}).steps("eval") == [4]
  with pytest.raises(ValueError, match="total_steps"):
    periodic.PeriodicActions(0, every={})


# ------------------------------------------------------------------------------------------------
# Optimizer.


def _opt_config(**fields):
  opt = config_lib.training_defaults().optimizer
  opt.update(fields)
  return opt


PARAMS = {
  "dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones((3,))},
  "norm": {"scale": jnp.ones((3,))},
  "embedding": jnp.ones((4, 2)),
}


def test_weight_decay_mask_excludes_vectors():
  assert optim.weight_decay_mask(PARAMS) == {
    "dense": {"kernel": True, "bias": False},
    "norm": {"scale": False},
    "embedding": True,
  }


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
def test_every_optimizer_decays_only_matrices(name):
  # With zero gradients every direction is 0, so the update is the decoupled decay alone.
  tx, _ = optim.make_optimizer(_opt_config(name=name, lr=0.1, weight_decay=0.5), total_steps=10)
  grads = jax.tree.map(jnp.zeros_like, PARAMS)
  updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.05 * np.ones((2, 3)), rtol=1e-6)
  np.testing.assert_allclose(updates["embedding"], -0.05 * np.ones((4, 2)), rtol=1e-6)
  np.testing.assert_array_equal(updates["dense"]["bias"], np.zeros(3))
  np.testing.assert_array_equal(updates["norm"]["scale"], np.zeros(3))


def test_optimizers_differ_and_move_against_the_gradient():
  grads = jax.tree.map(lambda p: 0.1 * jnp.ones_like(p), PARAMS)
  first_updates = {}
  for name in optim.OPTIMIZERS:
    tx, _ = optim.make_optimizer(_opt_config(name=name, lr=0.1, momentum=0.0), total_steps=10)
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    first_updates[name] = float(updates["dense"]["kernel"][0, 0])
    assert first_updates[name] < 0
  np.testing.assert_allclose(first_updates["sgd"], -0.01, rtol=1e-6)  # lr · g
  np.testing.assert_allclose(first_updates["adamw"], -0.1, rtol=1e-4)  # lr · sign(g)


def test_gradient_clipping_by_global_norm():
  tx, _ = optim.make_optimizer(
    _opt_config(name="sgd", lr=1.0, momentum=0.0, grad_clip_norm=2.0), total_steps=10
  )
  grads = jax.tree.map(lambda p: 100.0 * jnp.ones_like(p), PARAMS)
  updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
  np.testing.assert_allclose(optax.tree.norm(updates), 2.0, rtol=1e-5)


def test_schedules():
  warmup_cosine = optim.make_schedule(
    _opt_config(schedule="warmup_cosine", lr=1.0, warmup_steps=10, end_lr=0.1), 110
  )
  np.testing.assert_allclose(
    [warmup_cosine(0), warmup_cosine(5), warmup_cosine(10), warmup_cosine(60), warmup_cosine(110)],
    [0.0, 0.5, 1.0, 0.55, 0.1],
    atol=1e-6,
  )
  constant = optim.make_schedule(_opt_config(schedule="constant", lr=2.0, warmup_steps=4), 100)
  np.testing.assert_allclose(
    [constant(0), constant(2), constant(4), constant(99)], [0.0, 1.0, 2.0, 2.0], atol=1e-6
  )
  rsqrt = optim.make_schedule(
    _opt_config(schedule="rsqrt", lr=1.0, warmup_steps=4, end_lr=0.3), 100
  )
  np.testing.assert_allclose(
    [rsqrt(2), rsqrt(4), rsqrt(16), rsqrt(1000)], [0.5, 1.0, 0.5, 0.3], atol=1e-6
  )
  no_warmup = optim.make_schedule(_opt_config(schedule="constant", lr=3.0), 10)
  assert float(no_warmup(0)) == 3.0


def test_optimizer_config_errors():
  with pytest.raises(errors.UnknownNameError, match="known: adamw, radam, sgd"):
    optim.make_optimizer(_opt_config(name="adagrad"), 10)
  with pytest.raises(errors.UnknownNameError, match="rsqrt"):
    optim.make_optimizer(_opt_config(schedule="linear"), 10)
  with pytest.raises(errors.ConfigError, match="lr must be > 0"):
    optim.make_optimizer(_opt_config(lr=0.0), 10)


# ------------------------------------------------------------------------------------------------
# Sharding.


def test_mesh_shape_resolution_and_errors():
  assert sharding.mesh_shape({"data": -1, "model": 2}, 8) == (4, 2)
  assert sharding.mesh_shape({"data": 2, "model": -1}, 8) == (2, 4)
  assert sharding.mesh_shape({"data": 1, "model": 1}, 8, allow_subset=True) == (1, 1)
  for bad in (
    {"data": -1, "model": -1},
    {"data": 0, "model": 1},
    {"data": -1, "model": 3},
    {"data": 16, "model": 1},
    {"data": 2, "model": 2},
  ):
    with pytest.raises(errors.ConfigError, match="config.mesh"):
      sharding.mesh_shape(bad, 8)


def test_shard_batch_places_leading_axis_on_data():
  mesh = sharding.make_mesh({"data": 4, "model": 2})
  assert mesh.shape == {"data": 4, "model": 2} and mesh.size == 8
  batch = {
    "inputs": np.arange(8 * 3, dtype=np.float32).reshape(8, 3),
    "label": np.arange(8, dtype=np.int32),
  }
  placed = sharding.shard_batch(batch, mesh)
  assert placed["inputs"].shape == (8, 3)
  assert placed["inputs"].sharding.spec == PartitionSpec("data")
  np.testing.assert_array_equal(placed["label"], batch["label"])
  # 4 distinct row blocks, each replicated over the 2 `model` devices.
  assert {s.data.shape for s in placed["inputs"].addressable_shards} == {(2, 3)}


def test_state_shardings_follow_logical_axes():
  program = setup.build_program(setup.resolve_config(tiny_config()))
  shardings = program.state_shardings
  assert shardings.params["Dense_0"]["kernel"].spec == PartitionSpec(None, "model")  # embed, mlp
  assert shardings.params["Dense_1"]["kernel"].spec == PartitionSpec("model", None)  # mlp, classes
  assert shardings.params["BatchNorm_0"]["scale"].spec == PartitionSpec()  # unannotated
  assert shardings.batch_stats["BatchNorm_0"]["mean"].spec == PartitionSpec()
  # Adam's moments sit where their parameters sit; counters are replicated.
  opt_specs = [s.spec for s in jax.tree.leaves(shardings.opt_state)]
  assert opt_specs.count(PartitionSpec(None, "model")) == 2  # mu and nu of Dense_0/kernel
  assert PartitionSpec() in opt_specs


def test_sharded_train_step_matches_single_device():
  losses, params = {}, {}
  for mesh in ((1, 1), (4, 2)):
    config = tiny_config(**{"mesh.data": mesh[0], "mesh.model": mesh[1]})
    program = setup.build_program(setup.resolve_config(config))
    assert program.mesh.size == mesh[0] * mesh[1]
    state = program.init()
    batch = next(program.make_train_iterator())
    for _ in range(2):
      state, loss, _ = program.run_steps(state, 1, iter([batch]))
    losses[mesh], params[mesh] = float(loss[0]), jax.device_get(state.params)
  np.testing.assert_allclose(losses[(1, 1)], losses[(4, 2)], rtol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    params[(1, 1)],
    params[(4, 2)],
  )


def test_maybe_initialize_distributed_single_process_is_a_no_op(monkeypatch):
  for name in (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "TPU_WORKER_HOSTNAMES",
  ):
    monkeypatch.delenv(name, raising=False)
  assert sharding.maybe_initialize_distributed(config_lib.training_defaults()) is False
  assert not jax.distributed.is_initialized()


# ------------------------------------------------------------------------------------------------
# Trainer pieces.


def test_eval_tracker_best_and_selected():
  tracker = selection.EvalTracker("accuracy", "max", "validation")
  assert tracker.update(
    1, {"validation": {"accuracy": 0.5, "loss": 1.0}, "test": {"accuracy": 0.9}}
  )
  # A tie on accuracy with a higher validation loss does not replace the selection.
  assert not tracker.update(
    2, {"validation": {"accuracy": 0.5, "loss": 1.5}, "test": {"accuracy": 0.2}}
  )
  assert tracker.update(3, {"validation": {"accuracy": 0.7}, "test": {"accuracy": 0.6}})
  assert not tracker.update(
    4, {"validation": {"accuracy": float("nan")}, "test": {"accuracy": 0.1}}
  )
  summary = tracker.summary()
  assert summary["best/test_accuracy"] == 0.9 and summary["best/test_step"] == 1
  assert summary["selected/test_accuracy"] == 0.6 and summary["selected/step"] == 3
  restored = selection.EvalTracker("accuracy", "max", "validation")
  restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
  assert restored.summary() == summary
  low = selection.EvalTracker("loss", "min", "validation")
  low.update(1, {"validation": {"loss": 2.0}})
  low.update(2, {"validation": {"loss": 1.0}})
  assert low.summary()["best/validation_loss"] == 1.0
  with pytest.raises(errors.UnknownNameError):
    selection.EvalTracker("accuracy", "highest", "validation")


def test_eval_tracker_breaks_ties_by_loss_then_later_step():
  tracker = selection.EvalTracker("accuracy", "max", "validation")

  def evaluation(accuracy, loss, test_accuracy):
    return {"validation": {"accuracy": accuracy, "loss": loss}, "test": {"accuracy": test_accuracy}}

  assert tracker.update(1, evaluation(0.5, 1.0, 0.1))
  assert tracker.update(2, evaluation(0.5, 0.8, 0.2))  # tie, lower loss
  assert not tracker.update(3, evaluation(0.5, 0.9, 0.3))  # tie, higher loss
  assert tracker.update(4, evaluation(0.5, 0.8, 0.4))  # tie, same loss: the later step
  assert not tracker.update(5, evaluation(0.4, 0.1, 0.5))  # lower accuracy, whatever the loss
  summary = tracker.summary()
  assert summary["selected/step"] == 4 and summary["selected/test_accuracy"] == 0.4
  assert summary["best/validation_step"] == 1  # best/ keeps the earliest of tied values
  assert tracker.rule == "max validation accuracy; ties: lower validation loss, then later step"
  # Without a loss the tie goes to the later step.
  no_loss = selection.EvalTracker("accuracy", "max", "validation")
  no_loss.update(1, {"validation": {"accuracy": 0.5}})
  assert no_loss.update(2, {"validation": {"accuracy": 0.5}})
  assert no_loss.summary()["selected/step"] == 2


def test_metric_sums_collapse_without_changing_the_mean():
  per_batch = [
    {"loss": (np.float32(3.0), np.float32(2.0))},
    {"loss": (np.float32(1.0), np.float32(2.0))},
  ]
  collapsed = [evaluation.sum_metrics(per_batch), {"loss": (2.0, 4.0)}]
  assert evaluation.reduce_metrics(per_batch) == {"loss": 1.0}
  assert evaluation.reduce_metrics(collapsed) == {"loss": 0.75}
  assert evaluation.reduce_metrics([]) == {}


def test_task_registry_and_lazy_registration(monkeypatch, tmp_path):
  assert tasks.get_task("synthetic") is tasks.TASKS["synthetic"]
  with pytest.raises(ValueError, match="already registered"):
    tasks.register_task(tasks.TASKS["synthetic"])
  # Only these two names exist here, whatever other test modules registered in this process.
  monkeypatch.setattr(tasks, "TASKS", {"synthetic": tasks.TASKS["synthetic"]})
  # A new task is one module in primal_dual.tasks (here a folder added to its path).
  package = primal_dual.tasks
  monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
  (tmp_path / "lazy_demo.py").write_text(
    "from primal_dual.tasks import synthetic\n"
    "from primal_dual.training import task_registry as tasks\n"
    'tasks.register_task(tasks.Task("lazy_demo", synthetic.build_data,\n'
    "    synthetic.build_model, synthetic._common.classification_loss_and_metrics))\n"
  )
  assert tasks.get_task("lazy_demo").name == "lazy_demo"
  known = "images, lazy_demo, listops, logic, sraven, synthetic, uea"
  with pytest.raises(errors.UnknownNameError, match=f"'missing'; known: {known}"):
    tasks.get_task("missing")


def test_data_problems_become_user_errors(monkeypatch):
  monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))

  def missing_folder(config):
    raise FileNotFoundError("/data/uea/Heartbeat not found; download the archive there")

  tasks.register_task(
    dataclasses.replace(tasks.TASKS["synthetic"], name="no_data", build_data=missing_folder)
  )
  with pytest.raises(errors.DataNotFoundError, match="'no_data': /data/uea/Heartbeat not found"):
    setup.build_program(setup.resolve_config(tiny_config(task="no_data")))
  with pytest.raises(errors.ConfigError, match="num_classes .* must be ≤ num_features"):
    setup.build_program(setup.resolve_config(tiny_config(**{"data.num_classes": 5})))


def test_synthetic_source_is_deterministic_and_labelled_by_its_rule():
  kwargs = dict(seed=0, seq_len=6, num_features=3, num_classes=3)
  source = synthetic.SyntheticSource(5, split_id=0, **kwargs)
  record = source[2]
  np.testing.assert_array_equal(record["inputs"], source[2]["inputs"])
  length = int(record["mask"].sum())
  assert record["mask"][:length].all() and not record["mask"][length:].any()
  assert not record["inputs"][length:].any()
  assert record["label"] == np.argmax(record["inputs"][:length].mean(0))
  other_split = synthetic.SyntheticSource(5, split_id=1, **kwargs)
  assert not np.array_equal(other_split[2]["inputs"], record["inputs"])
  with pytest.raises(IndexError):
    source[5]


def test_classification_metrics_ignore_padding_even_if_nan():
  logits = jnp.array([[2.0, 0.0], [0.0, 2.0], [jnp.nan, jnp.nan]])
  batch = {"label": jnp.array([0, 0, 1]), "valid": jnp.array([True, True, False])}
  loss, metrics = synthetic._common.classification_loss_and_metrics(logits, batch)
  expected = optax.softmax_cross_entropy_with_integer_labels(logits[:2], batch["label"][:2])
  np.testing.assert_allclose(loss, expected.mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["accuracy"], (1.0, 2.0))
  np.testing.assert_allclose(metrics["loss"][0], expected.sum(), rtol=1e-6)


def test_epochs_convert_to_steps_and_periods():
  config = tiny_config(num_train_steps=-1, num_epochs=3, eval_every_epochs=1)
  program = setup.build_program(setup.resolve_config(config))
  assert program.length.steps_per_epoch == 64 // 8
  assert program.total_steps == 24
  assert program.length.periods["eval"] == 8


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"task": "nope"}, "unknown task .*'nope'; known: .*synthetic"),
    ({"batch_size": 6}, "batch_size=6 must be a positive multiple"),
    ({"num_train_steps": -1}, "num_train_steps > 0 or config.num_epochs"),
    ({"batch_size": 128}, "fewer than config.batch_size"),
    ({"optimizer.name": "adamax"}, "unknown optimizer"),
    ({"eval_splits": ("train", "dev")}, "names \\['dev'\\]"),
    ({"model.hidden": 7}, r"parameter \['Dense_0'\]\['bias'\] of shape \(7,\) .* size 2"),
  ],
)
def test_config_problems_raise_user_errors(overrides, message, tmp_path):
  with pytest.raises(errors.UserError, match=message):
    trainer.train_and_evaluate(tiny_config(**overrides), str(tmp_path))


def test_metric_writer_jsonl_and_truncate(tmp_path):
  workdir = str(tmp_path)
  with metrics_logging.MetricWriter(workdir, tensorboard=False) as writer:
    for step in (1, 2, 3):
      writer.write_scalars(step, {"train/loss": np.float32(step), "nan": float("nan")})
  records = metrics_logging.read_metrics(workdir)
  assert [r["step"] for r in records] == [1, 2, 3]
  assert records[1] == {"step": 2, "train/loss": 2.0, "nan": None}
  metrics_logging.truncate_metrics_after(workdir, 2)
  assert [r["step"] for r in metrics_logging.read_metrics(workdir)] == [1, 2]
  table = metrics_logging.format_table({"test": {"accuracy": 0.5, "loss": 1.25}})
  assert table.splitlines() == ["split  accuracy  loss", "test   0.5000    1.2500"]


def test_latest_and_selected_checkpointers_use_separate_barriers(tmp_path):
  """Both save the same step at once in a multi-process run; a shared Orbax barrier name
  ("async_write_complete.<step>") made test_multiprocess hang about half the time."""
  prefixes = []
  for name in (checkpointing.CHECKPOINT_DIR, checkpointing.SELECTED_DIR):
    with checkpointing.Checkpointer(str(tmp_path / name)) as checkpointer:
      options = checkpointer._manager._options
      prefixes.append(options.multiprocessing_options.barrier_sync_key_prefix)
  assert prefixes == [checkpointing.CHECKPOINT_DIR, checkpointing.SELECTED_DIR]


def test_checkpointer_keeps_last_k_and_deletes_later_steps(tmp_path):
  state = {"w": jnp.arange(3.0), "empty": {}}
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  with checkpointing.Checkpointer(str(tmp_path), keep=2, async_save=False) as checkpointer:
    for step in (1, 2, 3):
      checkpointer.save(step, jax.tree.map(lambda x: x * step, state), meta={"step": step})
    assert checkpointer.all_steps() == [2, 3] and checkpointer.latest_step() == 3
    restored, meta = checkpointer.restore(2, target)
    np.testing.assert_array_equal(restored["w"], [0.0, 2.0, 4.0])
    assert meta == {"step": 2}
    checkpointer.delete_after(2)
    assert checkpointer.all_steps() == [2]
    with pytest.raises(errors.CheckpointNotFoundError, match="step 3"):
      checkpointer.restore(3, target)


# ------------------------------------------------------------------------------------------------
# End to end.


def _read_tensorboard_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
  """Scalars from tensorboardX event files (TFRecord framing: len, crc, data, crc)."""
  from tensorboardX.proto import event_pb2

  scalars = {}
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset : offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_end_to_end_writes_checkpoints_metrics_and_tensorboard(uninterrupted):
  workdir, final, seen = uninterrupted
  assert len(seen) == 8
  assert final["step"] == 8
  for key in (
    "train/loss",
    "validation/accuracy",
    "test/accuracy",
    "test/loss",
    "best/test_accuracy",
    "selected/test_accuracy",
    "selected/step",
  ):
    assert math.isfinite(final[key]), key
  assert final["selected/step"] in (4, 8)
  assert final["best/test_accuracy"] >= final["test/accuracy"]

  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
  assert steps == [4, 8]
  assert os.listdir(os.path.join(workdir, checkpointing.SELECTED_DIR)) == [
    str(final["selected/step"])
  ]
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  assert saved["model"] == {
    "hidden": 8,
    "dropout_rate": 0.1,
    "use_batch_norm": True,
    "dtype": "float32",  # defaults filled in (config_lib.MODEL_DTYPES)
    "param_dtype": "float32",
  }
  assert saved["optimizer"]["name"] == "adamw"  # defaults filled in

  records = metrics_logging.read_metrics(workdir)
  assert [r["step"] for r in records] == [2, 4, 6, 8]  # one record per logged step
  assert {"train/loss", "train/learning_rate", "validation/accuracy", "best/test_accuracy"} <= set(
    records[1]
  )
  assert records[-1]["test/accuracy"] == pytest.approx(final["test/accuracy"])

  scalars = _read_tensorboard_scalars(os.path.join(workdir, "tensorboard"))
  assert [step for step, _ in scalars["train/loss"]] == [2, 4, 6, 8]
  assert scalars["test/accuracy"][-1][1] == pytest.approx(final["test/accuracy"])


def test_evaluation_counts_each_example_once(uninterrupted):
  workdir, final, _ = uninterrupted
  program, state, _ = restore_state(workdir, 8)
  records = [program.splits["test"][i] for i in range(len(program.splits["test"]))]
  batch = {k: np.stack([r[k] for r in records]) for k in records[0]}
  apply = jax.jit(functools.partial(program.model.apply, train=False))
  logits = apply(
    {"params": state.params, "batch_stats": state.batch_stats}, batch["inputs"], mask=batch["mask"]
  )
  accuracy = np.mean(np.argmax(logits, -1) == batch["label"])
  loss = np.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]))
  np.testing.assert_allclose(final["test/accuracy"], accuracy, rtol=1e-6)
  np.testing.assert_allclose(final["test/loss"], loss, rtol=1e-5)


def test_evaluate_workdir_and_eval_cli(uninterrupted, capsys):
  workdir, final, _ = uninterrupted
  report = evaluation.evaluate_workdir(workdir, ("test", "validation"))
  assert report["step"] == 8
  assert report["results"]["test"]["accuracy"] == pytest.approx(final["test/accuracy"])
  selected = evaluation.evaluate_workdir(workdir, ("validation", "test"), checkpoint="selected")
  assert selected["step"] == final["selected/step"]
  assert selected["results"]["test"]["accuracy"] == pytest.approx(final["selected/test_accuracy"])

  from absl import flags

  with cli_helpers.loaded_script("eval.py") as eval_cli:
    flags.FLAGS(["eval.py", f"--workdir={workdir}", "--splits=test"])
    assert eval_cli.main(["eval.py"]) == 0
  printed = capsys.readouterr().out
  assert "checkpoint: latest (step 8)" in printed
  assert f"{final['test/accuracy']:.4f}" in printed
  with open(os.path.join(workdir, "eval.json")) as f:
    assert json.load(f)["results"]["test"]["accuracy"] == pytest.approx(final["test/accuracy"])
  with pytest.raises(errors.CheckpointNotFoundError):
    evaluation.evaluate_workdir(workdir, checkpoint="5")


def test_resume_after_crash_matches_uninterrupted_run(uninterrupted, tmp_path):
  reference_dir, reference_final, reference_batches = uninterrupted
  workdir = str(tmp_path / "crashed")
  seen = []
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, "shard_batch", batch_recorder(seen, crash_at=7))
    with pytest.raises(Crash):
      trainer.train_and_evaluate(tiny_config(), workdir)
  assert seen == reference_batches[:6]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4"]
  assert [r["step"] for r in metrics_logging.read_metrics(workdir)] == [2, 4, 6]

  resumed = []
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, "shard_batch", batch_recorder(resumed))
    final = trainer.train_and_evaluate(tiny_config(), workdir)
  assert resumed == reference_batches[4:]  # the data order continues where the checkpoint was

  assert helpers.without_timing(final) == helpers.without_timing(reference_final)
  assert helpers.records_without_timing(workdir) == helpers.records_without_timing(reference_dir)

  _, expected, _ = restore_state(reference_dir, 8)
  _, actual, meta = restore_state(workdir, 8)
  assert meta["step"] == 8
  jax.tree.map(np.testing.assert_array_equal, expected, actual)

  # A finished workdir is not trained further: calling again returns its final metrics and
  # leaves final_metrics.json as it was.
  final_path = os.path.join(workdir, "final_metrics.json")
  with open(final_path, "rb") as f:
    written = f.read()
  again = trainer.train_and_evaluate(tiny_config(), workdir)
  assert again["test/accuracy"] == final["test/accuracy"]
  assert again == json.loads(written)
  with open(final_path, "rb") as f:
    assert f.read() == written


def test_a_run_killed_once_its_checkpoint_is_saved_resumes_with_every_record(
  uninterrupted, tmp_path
):
  """Lease 5 stopped a program just after a checkpoint's save: the checkpoint completed, the
  step's record (its evaluation) had not been written, and a resume starts after that step. The
  record is now written before the checkpoint."""
  reference_dir, reference_final, _ = uninterrupted
  workdir = str(tmp_path / "killed")
  save = checkpointing.Checkpointer.save

  def save_then_die(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if os.path.basename(self.directory) == checkpointing.CHECKPOINT_DIR:
      self.wait()  # the save completes; the process dies before anything else
      raise Crash()

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpointing.Checkpointer, "save", save_then_die)
    with pytest.raises(Crash):
      trainer.train_and_evaluate(tiny_config(), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4"]
  trainer.train_and_evaluate(tiny_config(), workdir)

  assert helpers.records_without_timing(workdir) == helpers.records_without_timing(reference_dir)


def test_batch_reads_train_and_resume_exactly(tmp_path):
  """config.loader.batch_reads: the fast input path trains, and a crashed run resumes onto the
  same batches and parameters as an uninterrupted one."""
  config = tiny_config(**{"loader.batch_reads": True})
  reference, crashed = str(tmp_path / "reference"), str(tmp_path / "crashed")
  reference_batches, seen, resumed = [], [], []
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, "shard_batch", batch_recorder(reference_batches))
    reference_final = trainer.train_and_evaluate(config, reference)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, "shard_batch", batch_recorder(seen, crash_at=7))
    with pytest.raises(Crash):
      trainer.train_and_evaluate(config, crashed)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, "shard_batch", batch_recorder(resumed))
    final = trainer.train_and_evaluate(config, crashed)
  assert len(reference_batches) == 8 and seen == reference_batches[:6]
  assert resumed == reference_batches[4:]
  assert final["test/accuracy"] == reference_final["test/accuracy"]
  _, expected, _ = restore_state(reference, 8, config)
  _, actual, _ = restore_state(crashed, 8, config)
  jax.tree.map(np.testing.assert_array_equal, expected, actual)


@pytest.mark.parametrize("checkpoint_every", [1, 4])
def test_non_finite_loss_stops_naming_the_step(checkpoint_every, tmp_path):
  # Without BatchNorm: also covers checkpointing a model with no batch_stats ({}).
  config = tiny_config(
    **{
      "optimizer.lr": 1e30,
      "optimizer.grad_clip_norm": 0.0,
      "checkpoint_every_steps": checkpoint_every,
      "log_every_steps": 0,
      "eval_every_steps": 0,
      "model.use_batch_norm": False,
    }
  )
  workdir = str(tmp_path)
  with pytest.raises(errors.NonFiniteLossError) as info:
    trainer.train_and_evaluate(config, workdir)
  bad_step = info.value.step
  assert bad_step >= 2  # the first loss is computed from the initial parameters
  assert f"at step {bad_step};" in str(info.value)
  kept = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
  if checkpoint_every == 1:
    assert kept[-1] == bad_step - 1  # the last good state, never the non-finite one
    assert f"checkpoint (step {bad_step - 1}) is kept" in str(info.value)
    _, state, _ = restore_state(workdir, kept[-1], config)
    assert state.batch_stats == {}
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state.params))
  else:
    assert bad_step < 4 and kept == [] and "no checkpoint was saved" in str(info.value)
    assert "continue from that checkpoint" not in str(info.value)  # there is none


# ------------------------------------------------------------------------------------------------
# One workdir, one experiment, one process.


def test_workdir_stores_its_experiment_and_the_selection_rule(uninterrupted):
  workdir, final, _ = uninterrupted
  with open(os.path.join(workdir, workdir_lib.EXPERIMENT_FILE)) as f:
    stored = json.load(f)
  assert stored["fields"] == list(workdir_lib.DEFINING_FIELDS)
  assert stored["definition"]["model.hidden"] == 8
  assert stored["definition"]["optimizer.name"] == "adamw"
  assert "num_train_steps" not in stored["definition"]
  assert final["selected/rule"] == (
    "max validation accuracy; ties: lower validation loss, then later step"
  )
  with open(os.path.join(workdir, "final_metrics.json")) as f:
    assert json.load(f)["selected/rule"] == final["selected/rule"]
  assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))  # released at the end


def test_another_experiment_is_refused_before_anything_is_written(uninterrupted):
  workdir, _, _ = uninterrupted
  before = {name: os.path.getmtime(os.path.join(workdir, name)) for name in os.listdir(workdir)}
  other = tiny_config(seed=1, **{"model.hidden": 16, "num_train_steps": 100})
  with pytest.raises(errors.WorkdirError) as info:
    trainer.train_and_evaluate(other, workdir)
  assert str(info.value) == (
    f"workdir {workdir} holds another experiment: model.hidden 8 != 16; "
    "seed 0 != 1; use a new --workdir"
  )
  assert {
    name: os.path.getmtime(os.path.join(workdir, name)) for name in os.listdir(workdir)
  } == before


def test_run_length_cadence_and_paths_do_not_change_the_experiment(tmp_path):
  workdir = str(tmp_path)
  workdir_lib.write_definition(workdir, setup.resolve_config(tiny_config()))
  longer = tiny_config(
    num_train_steps=80,
    log_every_steps=7,
    eval_every_steps=9,
    checkpoint_every_steps=11,
    progress_bar=True,
    keep_checkpoints=1,
    **{"mesh.model": 1, "data.data_dir": "/elsewhere"},
  )
  workdir_lib.check_same_experiment(workdir, setup.resolve_config(longer))
  for field, value in [
    ("optimizer.lr", 0.5),
    ("batch_size", 16),
    ("task", "other"),
    ("data.num_train", 32),
    ("loader.batch_reads", True),
  ]:
    with pytest.raises(errors.WorkdirError, match=f"holds another experiment: {field} "):
      workdir_lib.check_same_experiment(
        workdir, setup.resolve_config(tiny_config(**{field: value}))
      )


def test_definition_keeps_option_dicts_whole_and_skips_fields_it_predates(tmp_path):
  stored = workdir_lib.definition(tiny_config(**{"model.attention_options": {}}))
  current = workdir_lib.definition(tiny_config(**{"model.attention_options": {"ratios": (1, 2)}}))
  assert workdir_lib.differences(stored, current) == [
    "model.attention_options {} != {'ratios': [1, 2]}"
  ]
  # A field the stored definition lacks (added to the code after the workdir's runs) is not
  # compared; one it names that the current config lacks is.
  older = {k: v for k, v in stored.items() if k != "loader.batch_reads"}
  assert workdir_lib.differences(older, stored) == []
  assert workdir_lib.differences(stored, older) == ["loader.batch_reads False != '<unset>'"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_workdir_of_an_earlier_version_is_judged_by_its_config_json(uninterrupted, tmp_path):
  """Workdirs written before experiment.json existed hold config.json alone; a mismatch is found
  from it, and a config that fits but cannot restore leaves that config.json unchanged."""
  reference, _, _ = uninterrupted
  workdir = str(tmp_path / "old")
  shutil.copytree(reference, workdir)
  os.remove(os.path.join(workdir, workdir_lib.EXPERIMENT_FILE))
  with pytest.raises(errors.WorkdirError, match=r"model.dropout_rate 0.1 != 0.3"):
    trainer.train_and_evaluate(tiny_config(**{"model.dropout_rate": 0.3}), workdir)
  # Without any config.json the shape mismatch surfaces in the restore: nothing is rewritten.
  os.remove(os.path.join(workdir, "config.json"))
  with pytest.raises(Exception):
    trainer.train_and_evaluate(tiny_config(num_train_steps=12, **{"model.hidden": 16}), workdir)
  gc.collect()  # Orbax's abandoned reads complain when collected: here, not in a later test.
  assert not os.path.exists(os.path.join(workdir, "config.json"))
  assert not os.path.exists(os.path.join(workdir, workdir_lib.EXPERIMENT_FILE))
  assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))


def _write_lock(workdir, pid, host):
  """A lock file as a killed run leaves it: content naming `pid`, but no OS lock held."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, workdir_lib.LOCK_FILE), "w") as f:
    json.dump({"pid": pid, "host": host}, f)


def _dead_pid() -> int:
  process = subprocess.Popen([sys.executable, "-c", "pass"])
  process.wait()
  return process.pid


@contextlib.contextmanager
def _lock_held_by_child(workdir):
  """Holds `workdir`'s lock in a child process for the duration; yields the child's pid."""
  code = (
    "import sys\n"
    "from primal_dual.training import workdir as w\n"
    f"lock = w.WorkdirLock({workdir!r}); lock.acquire()\n"
    'print("held", flush=True); sys.stdin.read()\n'
  )
  child = subprocess.Popen(
    [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
  )
  try:
    assert child.stdout.readline().strip() == "held"
    yield child.pid
  finally:
    child.stdin.close()
    child.wait()


def test_a_live_lock_refuses_a_second_run(tmp_path):
  workdir = str(tmp_path)
  host = socket.gethostname()
  with _lock_held_by_child(workdir) as pid:
    with pytest.raises(errors.WorkdirError) as info:
      trainer.train_and_evaluate(tiny_config(), workdir)
    assert str(info.value).startswith(f"workdir {workdir} is in use by process {pid} on {host}; ")
    assert sorted(os.listdir(workdir)) == [workdir_lib.LOCK_FILE]  # nothing else was written
  # The holder ended: its lock went with it.
  with workdir_lib.WorkdirLock(workdir):
    pass


def test_a_lock_file_naming_a_live_pid_without_a_lock_is_taken_over(tmp_path):
  """The pid a killed run left in its lock file may belong to a new, unrelated process."""
  workdir = str(tmp_path)
  _write_lock(workdir, os.getppid(), socket.gethostname())  # alive, but holds no lock
  with workdir_lib.WorkdirLock(workdir):
    with open(os.path.join(workdir, workdir_lib.LOCK_FILE)) as f:
      assert json.load(f)["pid"] == os.getpid()
  assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))


def test_a_stale_lock_is_taken_over_and_released_on_errors(tmp_path):
  workdir = str(tmp_path)
  path = os.path.join(workdir, workdir_lib.LOCK_FILE)
  _write_lock(workdir, _dead_pid(), socket.gethostname())
  with pytest.raises(RuntimeError):
    with workdir_lib.WorkdirLock(workdir):
      with open(path) as f:
        assert json.load(f) == {"pid": os.getpid(), "host": socket.gethostname()}
      with pytest.raises(errors.WorkdirError, match=f"in use by process {os.getpid()}"):
        workdir_lib.WorkdirLock(workdir).acquire()
      raise RuntimeError("the run failed")
  assert not os.path.exists(path)


def test_workdir_that_is_a_file_is_a_user_error(tmp_path):
  path = tmp_path / "file"
  path.write_text("")
  with pytest.raises(errors.WorkdirError, match="is a file, not a folder"):
    trainer.train_and_evaluate(tiny_config(), str(path))


def test_unwritable_workdirs_are_user_errors(tmp_path, monkeypatch):
  """Permissions cannot be tested for real as root (the test VM's user), so the OS answers are
  simulated: a parent that refuses the new folder, and an existing folder that is read-only."""

  def refuse(path, exist_ok=False):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

  with monkeypatch.context() as patch:
    patch.setattr(os, "makedirs", refuse)
    with pytest.raises(
      errors.WorkdirError, match="cannot create workdir .*/run: Permission denied"
    ):
      workdir_lib.make_workdir(str(tmp_path / "run"))
  monkeypatch.setattr(os, "access", lambda path, mode: False)
  with pytest.raises(errors.WorkdirError, match=f"workdir {tmp_path} is read-only"):
    trainer.train_and_evaluate(tiny_config(), str(tmp_path))


def _send_sigint():
  os.kill(os.getpid(), signal.SIGINT)


def _raise_keyboard_interrupt():
  raise KeyboardInterrupt()


@pytest.mark.parametrize(
  "interrupt, stopped_at",
  [
    (_send_sigint, 7),  # the first Ctrl-C asks the loop to stop before the next step
    (_raise_keyboard_interrupt, 6),  # the second one (KeyboardInterrupt) stops at once
  ],
)
def test_ctrl_c_stops_with_the_step_and_the_last_checkpoint(interrupt, stopped_at, tmp_path):
  workdir = str(tmp_path)
  original = sharding.shard_batch
  seen = []

  def interrupt_seventh_batch(batch, mesh):
    if "valid" not in batch:
      seen.append(1)
      if len(seen) == 7:
        interrupt()
    return original(batch, mesh)

  handler = signal.getsignal(signal.SIGINT)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sharding, "shard_batch", interrupt_seventh_batch)
    with pytest.raises(errors.StoppedError) as info:
      trainer.train_and_evaluate(tiny_config(), workdir)
  assert str(info.value) == (
    f"stopped at step {stopped_at}; last checkpoint step 4; re-run the same command to resume"
  )
  assert signal.getsignal(signal.SIGINT) is handler
  assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))


def _signal_in_dispatch(number: int, signum: int, events: list):
  """A `StepRunner.__call__` that records each dispatch in `events` and sends this process
  `signum` while dispatching the `number`-th call."""
  original = setup.StepRunner.__call__

  def dispatch(self, *args):
    events.append("dispatch")
    if events.count("dispatch") == number:
      os.kill(os.getpid(), signum)
    return original(self, *args)

  return dispatch


@pytest.mark.parametrize(
  "steps_per_call, stop_step",
  [
    (1, 7),  # between two logs: step 7's training metrics are saved with the checkpoint
    (2, 6),  # steps 7-8 were read ahead while the call ran: the iterator is put back first
  ],
)
def test_sigterm_saves_the_step_reached_and_the_resumed_run_equals_an_uninterrupted_one(
  steps_per_call, stop_step, tmp_path, monkeypatch
):
  """SIGTERM (a pre-empted VM, SLURM, `docker stop`) while the call ending at `stop_step` is
  dispatched: that call finishes, a checkpoint of the step is saved, and the re-run ends exactly
  where a run that was never stopped does."""
  config = tiny_config(steps_per_call=steps_per_call)
  reference, workdir = str(tmp_path / "reference"), str(tmp_path / "stopped")
  reference_final = trainer.train_and_evaluate(config, reference)
  handler = signal.getsignal(signal.SIGTERM)
  with monkeypatch.context() as patch:
    patch.setattr(
      setup.StepRunner,
      "__call__",
      _signal_in_dispatch(stop_step // steps_per_call, signal.SIGTERM, []),
    )
    with pytest.raises(errors.PreemptedError) as info:
      trainer.train_and_evaluate(config, workdir)
  assert str(info.value) == (
    f"stopped by SIGTERM at step {stop_step}; checkpoint saved at step {stop_step}; re-run the "
    "same command to resume"
  )
  assert signal.getsignal(signal.SIGTERM) is handler
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", str(stop_step)]
  assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))

  final = trainer.train_and_evaluate(config, workdir)
  assert helpers.without_timing(final) == helpers.without_timing(reference_final)
  assert helpers.records_without_timing(workdir) == helpers.records_without_timing(reference)
  _, expected, _ = restore_state(reference, 8, config)
  _, actual, _ = restore_state(workdir, 8, config)
  jax.tree.map(np.testing.assert_array_equal, expected, actual)


def test_a_stop_waits_for_the_call_in_flight_and_dispatches_no_other(tmp_path, monkeypatch):
  """One call is in flight at a time: the next is dispatched once the previous one's losses are
  checked, so a stop waits for at most one call of K steps. Ctrl-C while the third call is
  dispatched: it runs, and no fourth is dispatched."""
  config = tiny_config(
    num_train_steps=16,
    steps_per_call=2,
    log_every_steps=0,
    eval_every_steps=0,
    checkpoint_every_steps=0,
  )
  events = []
  check = trainer._check_finite
  monkeypatch.setattr(setup.StepRunner, "__call__", _signal_in_dispatch(3, signal.SIGINT, events))
  monkeypatch.setattr(
    trainer, "_check_finite", lambda *args: events.append("check") or check(*args)
  )
  with pytest.raises(errors.StoppedError, match="^stopped at step 6; no checkpoint was saved"):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert events == ["dispatch", "check"] * 3


def test_a_full_disk_is_one_error_naming_the_workdir(tmp_path, monkeypatch):
  workdir = str(tmp_path)

  def disk_full(self, step, scalars):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "metrics.jsonl")

  monkeypatch.setattr(metrics_logging.MetricWriter, "write_scalars", disk_full)
  with pytest.raises(errors.DiskFullError, match=f"no space left on the disk of {workdir}; "):
    trainer.train_and_evaluate(tiny_config(), workdir)
  assert not errors.is_disk_full(RuntimeError("wrapped"))
  wrapped = RuntimeError("orbax")
  wrapped.__cause__ = OSError(errno.ENOSPC, "full")
  assert errors.is_disk_full(wrapped)


TENSORSTORE_DISK_FULL = (
  'RESOURCE_EXHAUSTED: Error writing local file "checkpoints/4/_sharding": Failed to write 20532 '
  "bytes to file 14: No space left on device [os_error_code='28']"
)


def test_a_full_disk_under_tensorstore_is_one_error_even_when_closing_raises_it_again(
  tmp_path, monkeypatch
):
  """tensorstore says ENOSPC as a ValueError; the checkpoint manager raises its failed save
  again when closed, which must neither hide the full disk nor leave the other managers open."""
  workdir = str(tmp_path)
  closed = []
  original_close = checkpointing.Checkpointer.close

  def close_then_fail(self):
    original_close(self)
    closed.append(self.directory)
    _tensorstore_disk_full()

  monkeypatch.setattr(
    metrics_logging.MetricWriter, "write_scalars", lambda *a, **k: _tensorstore_disk_full()
  )
  monkeypatch.setattr(checkpointing.Checkpointer, "close", close_then_fail)
  with pytest.raises(errors.DiskFullError, match=f"no space left on the disk of {workdir}; "):
    trainer.train_and_evaluate(tiny_config(), workdir)
  assert len(closed) == 2  # the latest and the selected checkpoints' managers
  assert errors.is_disk_full(ValueError(TENSORSTORE_DISK_FULL))
  assert not errors.is_disk_full(ValueError("RESOURCE_EXHAUSTED: out of memory"))


def test_a_stop_before_the_first_checkpoint_does_not_promise_a_resume():
  message = str(errors.StoppedError(12, None))
  assert message == (
    "stopped at step 12; no checkpoint was saved yet, so a re-run of the same command starts "
    "again from step 0"
  )
  assert "resume" not in message


def test_closing_keeps_the_error_that_ended_the_run():
  def fails(message):
    def close():
      raise RuntimeError(message)

    return close

  calls = []
  stopped = errors.StoppedError(3, None)
  errors.close_all([fails("first"), lambda: calls.append(1)], pending=stopped)  # keeps `stopped`
  assert calls == [1]
  with pytest.raises(RuntimeError, match="first"):
    errors.close_all([fails("first"), fails("second")])
  with pytest.raises(ValueError, match="No space left"):  # a full disk says more than Ctrl-C
    errors.close_all([_tensorstore_disk_full], pending=stopped)


def _tensorstore_disk_full():
  raise ValueError(TENSORSTORE_DISK_FULL)


def test_train_cli_reports_user_errors_in_one_line(tmp_path):
  config_file = tmp_path / "config.py"
  config_file.write_text(
    "from primal_dual.training import config_lib\n"
    "def get_config(arg=None):\n"
    "  arg = config_lib.parse_arg(arg, steps=2)\n"
    "  config = config_lib.training_defaults()\n"
    "  config.num_train_steps = arg.steps\n"
    "  return config_lib.lock(config)\n"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  result = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO_ROOT, "train.py"),
      f"--config={config_file}:steps=3",
      "--config.task=nonexistent",
      f"--workdir={tmp_path / 'run'}",
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO_ROOT,
    timeout=120,
  )
  assert result.returncode == 2, result.stderr
  assert (
    result.stderr.strip()
    .splitlines()[-1]
    .startswith("error: unknown task (config.task) 'nonexistent'")
  )
  assert "Traceback" not in result.stderr
