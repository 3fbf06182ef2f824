"""Several optimizer steps per jitted call (config.steps_per_call) and training batches made on
the device (config.train_data_on_device), on the sRAVEN and logic tasks."""

import helpers
import jax
import ml_collections
import numpy as np
import pytest

from primal_dual.configs import logic as logic_configs
from primal_dual.configs import sraven as sraven_configs
from primal_dual.data import logic
from primal_dual.data import sraven
from primal_dual.tasks import logic as logic_task
from primal_dual.tasks import sraven as sraven_task
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import evaluation
from primal_dual.training import setup
from primal_dual.training import trainer

# A fresh persistent compilation cache for the module: each test trains the same config more than
# once (a reference, a crashed and a resumed run), and only the first compiles its programs.
compilation_cache_dir = pytest.fixture(scope="module", autouse=True)(
  helpers.fresh_compilation_cache
)


class Crash(Exception):
  pass


def _config(module=sraven_configs, **overrides):
  config = ml_collections.ConfigDict(module.get_config("runlocal").to_dict())
  config.update(
    dict(
      num_train_steps=8,
      log_every_steps=2,
      eval_every_steps=4,
      checkpoint_every_steps=4,
      async_checkpointing=False,
    )
  )
  return config_lib.with_fields(config, overrides)


def _train(config, workdir):
  final = trainer.train_and_evaluate(config, str(workdir))
  _, state = evaluation.restore_workdir(str(workdir))
  return final, jax.device_get(state.params)


def _assert_same_params(a, b, **tolerance):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tolerance), a, b)


@pytest.mark.parametrize("on_device", [False, True])
def test_k_steps_per_call_train_like_one_step_per_call(on_device, tmp_path):
  periods = dict(log_every_steps=4, train_data_on_device=on_device)
  _, one = _train(_config(steps_per_call=1, **periods), tmp_path / "k1")
  _, four = _train(_config(steps_per_call=4, **periods), tmp_path / "k4")
  # Same batches in the same order (the stream does not depend on K): same parameters.
  _assert_same_params(one, four, rtol=1e-6, atol=1e-7)


def test_a_run_killed_between_calls_resumes_bit_identically(tmp_path, monkeypatch):
  config = _config(steps_per_call=2, train_data_on_device=True, num_train_steps=12)
  reference_final, reference = _train(config, tmp_path / "reference")

  original, calls = setup.StepRunner.__call__, []

  def crash_on_fifth_call(self, *args):
    calls.append(args[1])
    if len(calls) == 5:  # steps 9-10; the last checkpoint is at step 8
      raise Crash()
    return original(self, *args)

  monkeypatch.setattr(setup.StepRunner, "__call__", crash_on_fifth_call)
  with pytest.raises(Crash):
    trainer.train_and_evaluate(config, str(tmp_path / "crashed"))
  monkeypatch.setattr(setup.StepRunner, "__call__", original)
  final, resumed = _train(config, tmp_path / "crashed")
  jax.tree.map(np.testing.assert_array_equal, reference, resumed)
  assert final["train/loss"] == reference_final["train/loss"]


def test_steps_per_call_must_divide_the_periods(tmp_path):
  with pytest.raises(errors.ConfigError, match=r"steps_per_call=3 must divide .*eval every 4"):
    trainer.train_and_evaluate(_config(steps_per_call=3, log_every_steps=3), str(tmp_path))
  assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
  "task, problems, split_names",
  [
    (sraven, sraven.SRavenConfig(num_features=3), ("validation", "test", "ood")),
    (logic, logic.LogicConfig(), ("validation", "test", "ood")),
  ],
)
def test_device_stream_equals_the_host_records_and_is_disjoint(task, problems, split_names):
  indices = np.array([0, 3, 64, 1000], np.uint32)
  on_device = jax.jit(task.split_stream(problems, "train"))(np.uint32(5), indices)
  on_host = task.generate_batch(problems, 5, indices, "train")
  for name, value in on_host.items():
    np.testing.assert_array_equal(np.asarray(on_device[name]), value)
  train_inputs = {
    np.asarray(x).tobytes()
    for x in task.generate_batch(problems, 5, np.arange(256), "train")["inputs"]
  }
  for split in split_names:
    other = task.generate_batch(problems, 5, np.arange(256), split)["inputs"]
    assert not train_inputs & {np.asarray(x).tobytes() for x in other}, split


@pytest.mark.parametrize(
  "module, task", [(sraven_configs, sraven_task), (logic_configs, logic_task)]
)
def test_device_batches_have_the_train_fields_and_depend_on_the_seed(module, task):
  config = _config(module)
  splits, metadata = task.build_data(config)
  stream = task.device_train_stream(config, metadata)
  batch_fn = jax.jit(stream.batch)
  indices = np.arange(8, dtype=np.uint32)
  batch = batch_fn(indices, stream.arguments)
  assert set(batch) == set(task.TRAIN_FIELDS)
  assert batch["inputs"].shape == (8, *splits["train"].build()[0]["inputs"].shape)
  other_seed = task.device_train_stream(config_lib.with_fields(config, {"seed": 1}), metadata)
  other = batch_fn(indices, other_seed.arguments)
  assert not np.array_equal(np.asarray(batch["inputs"]), np.asarray(other["inputs"]))


def test_seeds_train_in_one_program_as_if_run_alone(tmp_path, monkeypatch):
  """config.sweep.seed: replicas in one vmapped program, each in <workdir>/seed=<s> exactly like a
  single run of that seed (to float tolerance), killed and resumed like one too."""
  # SGD: Adam's normalised updates turn last-bit differences of near-zero gradients (vmapped
  # reductions add in another order) into lr-sized ones; SGD keeps them at the float level.
  common = {
    "steps_per_call": 2,
    "train_data_on_device": True,
    "optimizer.name": "sgd",
    "optimizer.lr": 0.05,
  }
  final = trainer.train_and_evaluate(
    _config(**{"sweep.seed": (0, 3)}, **common), str(tmp_path / "both")
  )
  assert {k.split("/")[0] for k in final} == {"seed=0", "seed=3"}
  for seed in (3,):  # the second replica: its slices of every stacked array
    alone_final, alone = _train(_config(seed=seed, **common), tmp_path / f"alone_{seed}")
    replica_dir = tmp_path / "both" / f"seed={seed}"
    _, replica_state = evaluation.restore_workdir(str(replica_dir))
    _assert_same_params(jax.device_get(replica_state.params), alone, rtol=1e-4, atol=1e-5)
    for name, value in alone_final.items():
      if "steps_per_second" not in name and isinstance(value, float):
        np.testing.assert_allclose(final[f"seed={seed}/{name}"], value, rtol=1e-4, atol=1e-6)
    for got, want in zip(
      helpers.records_without_timing(replica_dir),
      helpers.records_without_timing(tmp_path / f"alone_{seed}"),
      strict=True,
    ):
      assert got.keys() == want.keys() and got["step"] == want["step"]
    assert (replica_dir / "config.json").read_text() == (
      tmp_path / f"alone_{seed}" / "config.json"
    ).read_text()

  # Killed after the step-4 checkpoint, resumed: the same replicas as the uninterrupted run.
  original, calls = setup.StepRunner.__call__, []

  def crash_on_third_call(self, *args):
    calls.append(1)
    if len(calls) == 3:
      raise Crash()
    return original(self, *args)

  monkeypatch.setattr(setup.StepRunner, "__call__", crash_on_third_call)
  with pytest.raises(Crash):
    trainer.train_and_evaluate(
      _config(**{"sweep.seed": (0, 3)}, **common), str(tmp_path / "crashed")
    )
  monkeypatch.setattr(setup.StepRunner, "__call__", original)
  trainer.train_and_evaluate(_config(**{"sweep.seed": (0, 3)}, **common), str(tmp_path / "crashed"))
  for seed in (0, 3):
    _, expected = evaluation.restore_workdir(str(tmp_path / "both" / f"seed={seed}"))
    _, resumed = evaluation.restore_workdir(str(tmp_path / "crashed" / f"seed={seed}"))
    jax.tree.map(
      np.testing.assert_array_equal, jax.device_get(expected.params), jax.device_get(resumed.params)
    )


def test_seeds_need_generated_batches(tmp_path):
  with pytest.raises(errors.ConfigError, match="train_data_on_device=True"):
    trainer.train_and_evaluate(_config(**{"sweep.seed": (0, 1)}), str(tmp_path))
