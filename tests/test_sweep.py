"""A hyperparameter sweep trained as replicas of one program (`config.sweep`, training/sweep.py):
every replica is a run of its own, equal to that setting trained alone.

The synthetic task (host batches shared by the replicas, one step per call) and sRAVEN's runlocal
model (batches made on the device, two steps per call, seeds swept too), with tiny shapes.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import helpers
from primal_dual.configs import sraven as sraven_configs
from primal_dual.data import generated
from primal_dual.data import sraven as sraven_data
from primal_dual.kernels import _common as kernel_common
from primal_dual.models import blocks
from primal_dual.tasks import synthetic
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import evaluation
from primal_dual.training import optim
from primal_dual.training import setup
from primal_dual.training import sweep
from primal_dual.training import trainer

compilation_cache_dir = pytest.fixture(scope="module", autouse=True)(
  helpers.fresh_compilation_cache
)


class Crash(Exception):
  """Stands in for a killed process."""


def _synthetic(**overrides):
  # Four steps: the warm-up, the cosine and the weight decay all act; a checkpoint at step 2.
  return helpers.tiny_config(
    num_train_steps=4,
    checkpoint_every_steps=2,
    eval_every_steps=2,
    async_checkpointing=False,
    **overrides,
  )


SYNTHETIC_SWEEP = {
  "sweep.optimizer.lr": (0.05, 0.02),
  "sweep.optimizer.weight_decay": (0.01, 0.1),
  "sweep.optimizer.warmup_steps": (2, 0),
}


def _params(workdir):
  _, state = evaluation.restore_workdir(str(workdir))
  return jax.device_get(state.params)


def _assert_replica_is_the_run_alone(replica_dir, alone_dir, final, alone_final, name):
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6),
    _params(replica_dir),
    _params(alone_dir),
  )
  for metric, value in alone_final.items():
    if "steps_per_second" not in metric and isinstance(value, float):
      np.testing.assert_allclose(final[f"{name}/{metric}"], value, rtol=1e-4, atol=1e-6)
  for got, want in zip(
    helpers.records_without_timing(replica_dir),
    helpers.records_without_timing(alone_dir),
    strict=True,
  ):
    assert got.keys() == want.keys() and got["step"] == want["step"]
    for metric, value in want.items():
      np.testing.assert_allclose(got[metric], value, rtol=1e-4, atol=1e-6, err_msg=metric)
  # Its own config: that of the run alone, byte for byte (eval.py and the identity check read it).
  assert (replica_dir / "config.json").read_text() == (alone_dir / "config.json").read_text()
  for folder in ("checkpoints", "checkpoints_selected", "tensorboard"):
    assert (replica_dir / folder).is_dir(), folder


@pytest.fixture(scope="module")
def synthetic_sweep(tmp_path_factory):
  """The 8 replicas of SYNTHETIC_SWEEP trained in one program: (workdir, final metrics)."""
  workdir = tmp_path_factory.mktemp("sweep")
  final = trainer.train_and_evaluate(_synthetic(**SYNTHETIC_SWEEP), str(workdir))
  return workdir, final


def test_sweep_names_its_replicas_by_their_values(synthetic_sweep):
  workdir, final = synthetic_sweep
  names = sorted(p.name for p in workdir.iterdir() if p.is_dir())
  # Short names in the order of config_lib.SWEEPABLE: lr, warm-up, weight decay.
  assert names == sorted(
    f"lr={lr},warmup={w},wd={wd}" for lr in (0.05, 0.02) for wd in (0.01, 0.1) for w in (2, 0)
  )
  assert {k.split("/")[0] for k in final} == set(names)
  for name in names:
    stored = json.loads((workdir / name / "final_metrics.json").read_text())
    assert stored == {k.split("/", 1)[1]: v for k, v in final.items() if k.startswith(name + "/")}


@pytest.mark.parametrize(
  "values",
  [
    dict(lr=0.05, weight_decay=0.01, warmup_steps=2),  # the first replica
    dict(lr=0.02, weight_decay=0.1, warmup_steps=0),  # the last: every field at its other value
    dict(lr=0.02, weight_decay=0.01, warmup_steps=0),
  ],
)
def test_every_replica_equals_its_setting_trained_alone(synthetic_sweep, values, tmp_path):
  workdir, final = synthetic_sweep
  name = f"lr={values['lr']},warmup={values['warmup_steps']},wd={values['weight_decay']}"
  alone_config = _synthetic(**{f"optimizer.{k}": v for k, v in values.items()})
  alone_final = trainer.train_and_evaluate(alone_config, str(tmp_path))
  _assert_replica_is_the_run_alone(workdir / name, tmp_path, final, alone_final, name)


def test_a_killed_sweep_resumes_from_the_newest_step_all_replicas_share(
  synthetic_sweep, tmp_path, monkeypatch
):
  workdir, _ = synthetic_sweep
  config = _synthetic(**SYNTHETIC_SWEEP)
  original, calls = setup.StepRunner.__call__, []

  def crash_on_fourth_call(self, *args):
    calls.append(1)
    if len(calls) == 4:  # step 4; the last checkpoint is at step 2
      raise Crash()
    return original(self, *args)

  monkeypatch.setattr(setup.StepRunner, "__call__", crash_on_fourth_call)
  with pytest.raises(Crash):
    trainer.train_and_evaluate(config, str(tmp_path))
  monkeypatch.setattr(setup.StepRunner, "__call__", original)
  trainer.train_and_evaluate(config, str(tmp_path))
  for replica in sorted(p.name for p in workdir.iterdir() if p.is_dir()):
    jax.tree.map(
      np.testing.assert_array_equal, _params(workdir / replica), _params(tmp_path / replica)
    )
    assert helpers.records_without_timing(workdir / replica) == helpers.records_without_timing(
      tmp_path / replica
    )
  assert not (tmp_path / ".lock").exists()


def test_a_replica_a_checkpoint_ahead_resumes_with_the_others(synthetic_sweep, tmp_path):
  """A kill during a save can leave one replica a checkpoint ahead: all resume from the step
  every replica has, and train to the same end."""
  import shutil

  workdir, _ = synthetic_sweep
  config = _synthetic(**SYNTHETIC_SWEEP)
  shutil.copytree(workdir, tmp_path / "w")
  names = sorted(p.name for p in workdir.iterdir() if p.is_dir())
  for name in names[1:]:  # all but the first lose their step-4 checkpoint and final metrics
    shutil.rmtree(tmp_path / "w" / name / "checkpoints" / "4")
    os.remove(tmp_path / "w" / name / trainer.FINAL_METRICS_FILE)
  trainer.train_and_evaluate(config, str(tmp_path / "w"))
  for name in names:
    jax.tree.map(
      np.testing.assert_array_equal, _params(workdir / name), _params(tmp_path / "w" / name)
    )


def test_another_sweep_in_the_workdir_is_refused(synthetic_sweep):
  workdir, _ = synthetic_sweep
  other = _synthetic(**dict(SYNTHETIC_SWEEP, **{"sweep.optimizer.lr": (0.05, 0.03)}))
  with pytest.raises(errors.WorkdirError, match=r"sweep\.optimizer .* use a new --workdir"):
    trainer.train_and_evaluate(other, str(workdir))


def _sraven(**overrides):
  config = ml_collections.ConfigDict(sraven_configs.get_config("runlocal").to_dict())
  config.update(
    dict(
      num_train_steps=4,
      log_every_steps=2,
      eval_every_steps=4,
      checkpoint_every_steps=4,
      async_checkpointing=False,
      steps_per_call=2,
      train_data_on_device=True,
    )
  )
  # SGD: Adam's normalised updates turn last-bit differences of near-zero gradients (vmapped
  # reductions add in another order) into lr-sized ones; SGD keeps them at the float level.
  return config_lib.with_fields(config, {"optimizer.name": "sgd", **overrides})


def test_seeds_and_learning_rates_on_device_batches_equal_runs_alone(tmp_path):
  sweep_config = _sraven(**{"sweep.seed": (0, 3), "sweep.optimizer.lr": (0.05, 0.02)})
  final = trainer.train_and_evaluate(sweep_config, str(tmp_path / "sweep"))
  assert {k.split("/")[0] for k in final} == {
    "lr=0.05,seed=0",
    "lr=0.05,seed=3",
    "lr=0.02,seed=0",
    "lr=0.02,seed=3",
  }
  alone = tmp_path / "alone"
  alone_final = trainer.train_and_evaluate(_sraven(seed=3, **{"optimizer.lr": 0.02}), str(alone))
  name = "lr=0.02,seed=3"
  _assert_replica_is_the_run_alone(tmp_path / "sweep" / name, alone, final, alone_final, name)


def test_seeds_with_their_own_held_out_splits_are_replicas_of_one_program(tmp_path):
  """`held_out=per_seed` (the paper presets' rule): two seeds draw two held-out sets, and still
  train as replicas of one program; each replica, evaluated on its own splits, equals its setting
  trained alone."""
  per_seed = {"data.split_seed": generated.SPLIT_SEED_OF_RUN}
  sweep_config = _sraven(**per_seed, **{"sweep.seed": (0, 1), "sweep.optimizer.lr": (0.05, 0.02)})
  program = setup.build_program(setup.resolve_config(sweep_config))
  assert program.data.num_groups == 2
  np.testing.assert_array_equal(program.data.group_of_replica, [0, 1, 0, 1])  # lr × seed order
  held_out = [sraven_data.heldout_latent_ids(m["problems"]) for m in program.data.metadata]
  assert not np.array_equal(*held_out)
  # Every evaluation batch pairs the two groups' batches: [G, B, ...].
  batch = next(iter(program.eval_batches("ood")))
  assert batch["inputs"].shape[0] == 2
  assert not np.array_equal(batch["latent_id"][0], batch["latent_id"][1])
  final = trainer.train_and_evaluate(sweep_config, str(tmp_path / "sweep"))
  for index, (name, seed, lr) in enumerate(
    (("lr=0.05,seed=0", 0, 0.05), ("lr=0.02,seed=1", 1, 0.02))
  ):
    alone = tmp_path / f"alone{index}"
    alone_config = _sraven(**per_seed, seed=seed, **{"optimizer.lr": lr})
    alone_final = trainer.train_and_evaluate(alone_config, str(alone))
    _assert_replica_is_the_run_alone(tmp_path / "sweep" / name, alone, final, alone_final, name)


def test_dropout_points_on_device_batches_equal_runs_alone(tmp_path):
  """Listed points that set the dropout rates apart, at two seeds: each replica (its rates traced
  inside the program, 0 included) equals its setting trained alone (rates constants of the model).
  Four replicas, as in the seeds × learning rates sweep above: the same initialisation program."""
  points = ("attn_dropout=0.0,dropout=0.2", "lr=0.02,attn_dropout=0.3")
  sweep_config = _sraven(**{"sweep.points": points, "sweep.seed": (0, 3)})
  final = trainer.train_and_evaluate(sweep_config, str(tmp_path / "sweep"))
  base_lr = _sraven().optimizer.lr
  point_names = (
    f"lr={base_lr},dropout=0.2,attn_dropout=0.0",
    "lr=0.02,dropout=0.0,attn_dropout=0.3",
  )
  assert {k.split("/")[0] for k in final} == {
    f"{point},seed={seed}" for point in point_names for seed in (0, 3)
  }
  # The first point at the first seed, the second at the second: slices of both stacked axes.
  alone_values = {
    f"{point_names[0]},seed=0": dict(attention_dropout_rate=0.0, dropout_rate=0.2, seed=0),
    f"{point_names[1]},seed=3": dict(attention_dropout_rate=0.3, dropout_rate=0.0, lr=0.02, seed=3),
  }
  for index, (name, values) in enumerate(alone_values.items()):
    lr, seed = values.pop("lr", base_lr), values.pop("seed")
    fields = {f"model.{k}": v for k, v in values.items()}
    alone = tmp_path / f"alone{index}"
    alone_config = _sraven(**fields, seed=seed, **{"optimizer.lr": lr})
    alone_final = trainer.train_and_evaluate(alone_config, str(alone))
    _assert_replica_is_the_run_alone(tmp_path / "sweep" / name, alone, final, alone_final, name)


def test_points_are_exactly_the_listed_replicas():
  config = setup.resolve_config(
    _synthetic(
      **{
        "sweep.points": ("lr=0.001,wd=0.1,dropout=0", "wd=0.3,warmup=3", "lr=3e-4,dropout=0.2"),
        "sweep.seed": (0, 1),
      }
    )
  )
  replicas = sweep.replicas_of(config)
  # Every point at every seed (points first); a field a point leaves out keeps the config's
  # value (lr 0.05, warm-up 2, weight decay 0.01, dropout 0.1); names in SWEEPABLE order.
  assert [r.name for r in replicas] == [
    f"lr={lr},warmup={w},wd={wd},dropout={d},seed={s}"
    for lr, w, wd, d in ((0.001, 2, 0.1, 0.0), (0.05, 3, 0.3, 0.1), (0.0003, 2, 0.01, 0.2))
    for s in (0, 1)
  ]
  third = replicas[4].config
  assert (third.optimizer.lr, third.model.dropout_rate, third.seed, tuple(third.sweep.points)) == (
    3e-4,
    0.2,
    0,
    (),
  )
  assert type(replicas[2].config.optimizer.warmup_steps) is int
  # Seeds alone as points are named by the same rule.
  seeds = sweep.replicas_of(setup.resolve_config(_synthetic(**{"sweep.points": ("seed=4",)})))
  assert [r.name for r in seeds] == ["seed=4"]


def test_only_the_dropout_rates_that_differ_are_traced():
  model = synthetic.SyntheticClassifier(num_classes=2, hidden=4, dropout_rate=0.1)

  def numbers(**overrides):
    config = setup.resolve_config(_synthetic(**overrides))
    return sweep.model_numbers(config, sweep.replicas_of(config), model)

  assert numbers(**{"sweep.optimizer.lr": (0.1, 0.2)}) == {}
  # The config's own rate at every replica stays a constant of the model.
  assert numbers(**{"sweep.points": ("lr=0.1,dropout=0.1", "lr=0.2")}) == {}
  traced = numbers(**{"sweep.points": ("dropout=0.0", "dropout=0.3")})
  np.testing.assert_allclose(traced["model.dropout_rate"], [0.0, 0.3])
  # One replica whose rate is not the config's: traced too (the model is built from the config).
  np.testing.assert_allclose(
    numbers(**{"sweep.points": ("dropout=0.3",)})["model.dropout_rate"], [0.3]
  )
  replica = sweep.replica_model(model, {"model.dropout_rate": np.float32(0.3), "b1": 0.5})
  assert replica.dropout_rate == np.float32(0.3) and replica.hidden == 4
  assert sweep.replica_model(model, {"b1": 0.5}) is model


def test_a_traced_dropout_rate_drops_as_the_constant_rate():
  x = jax.random.normal(jax.random.key(0), (3, 5, 4))
  rngs = {"dropout": jax.random.key(1)}

  def dropped(rate):
    return blocks.Dropout(rate).apply({}, x, deterministic=False, rngs=rngs)

  traced = jax.jit(dropped)
  for rate in (0.0, 0.25):
    np.testing.assert_allclose(traced(np.float32(rate)), dropped(rate), rtol=1e-6)
  np.testing.assert_array_equal(traced(np.float32(0.0)), x)
  assert bool(jnp.any(dropped(0.25) == 0.0))
  # The attention weights' dropout (the kernels') takes a traced rate the same way.
  weights = jax.nn.softmax(x[None], axis=-1)
  drop = functools.partial(
    kernel_common.apply_dropout,
    dropout_rng=jax.random.key(2),
    broadcast_dropout=False,
    deterministic=False,
  )
  np.testing.assert_allclose(
    jax.jit(lambda r: drop(weights, dropout_rate=r))(np.float32(0.25)),
    drop(weights, dropout_rate=0.25),
    rtol=1e-6,
  )


# ------------------------------------------------------------------------------------------------
# What cannot be replicated: one-line config errors, before anything is trained.


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"sweep.model": {"hidden": (8, 16)}}, r"cannot replicate model\.hidden"),
    ({"sweep.batch_size": (8, 16)}, r"cannot replicate batch_size"),
    ({"sweep.num_train_steps": (4, 8)}, r"cannot replicate num_train_steps"),
    ({"sweep.optimizer.schedule": ("constant", "rsqrt")}, r"cannot replicate optimizer\.schedule"),
    ({"sweep.optimizer.weight_decay": (0.0, 0.1)}, r"weight_decay 0 and > 0"),
    ({"sweep.optimizer.grad_clip_norm": (0.0, 1.0)}, r"grad_clip_norm 0 and > 0"),
    ({"sweep.optimizer.warmup_steps": (1, 1.5)}, r"1\.5 is not an integer"),
    ({"sweep.optimizer.lr": (0.1, 0.1)}, r"must be distinct"),
    ({"sweep.optimizer.lr": (0.1, -0.1)}, r"optimizer\.lr must be > 0"),
    ({"sweep.seed": (0, 1)}, r"train_data_on_device=True"),
    ({"seeds": (2, 3)}, r"^config\.seeds is now config\.sweep\.seed: set --config\.sweep\.seed="),
    ({"sweep.model.attention_dropout_rate": (0.0, 0.1)}, r"attention_dropout_rate is not a field"),
    ({"sweep.model.dropout_rate": (0.1, 1.0)}, r"dropout_rate=1\.0 must be in \[0, 1\)"),
    ({"sweep.points": ("lr=0.1,width=2",)}, r"'width=2' is not <field>=<number>"),
    ({"sweep.points": ("lr=0.1,lr=0.2",)}, r"sets lr twice"),
    ({"sweep.points": ("lr=fast",)}, r"'fast' is not a number"),
    ({"sweep.points": ("warmup=1.5",)}, r"1\.5 is not an integer"),
    ({"sweep.points": ("lr=0.1,wd=0.01", "lr=0.1")}, r"points\[0\] and \[1\] are the same"),
    ({"sweep.points": ("lr=0.1",), "sweep.optimizer.lr": (0.2,)}, r"both set lr"),
    ({"sweep.points": ("seed=1", "seed=2"), "sweep.seed": (2, 3)}, r"both set seed"),
    ({"sweep.points": ("wd=0.0", "wd=0.1")}, r"weight_decay 0 and > 0"),
  ],
)
def test_settings_that_change_the_program_are_config_errors(overrides, message, tmp_path):
  config = config_lib.with_fields(_synthetic(), overrides)  # a config file may add any field
  with pytest.raises(errors.ConfigError, match=message):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert not any(tmp_path.iterdir())  # nothing written (the lock is gone again)


def test_replica_names_configs_and_product_order():
  config = setup.resolve_config(
    _synthetic(**{"sweep.seed": (0, 1), "sweep.optimizer.lr": (1e-3, 3e-5)})
  )
  replicas = sweep.replicas_of(config)
  assert [r.name for r in replicas] == [
    "lr=0.001,seed=0",
    "lr=0.001,seed=1",
    "lr=3e-05,seed=0",
    "lr=3e-05,seed=1",
  ]
  last = replicas[-1].config
  assert (last.seed, last.optimizer.lr, tuple(last.sweep.seed)) == (1, 3e-05, ())
  assert "seeds" not in last
  # A seed-only sweep is named by the same rule.
  seeds_only = sweep.replicas_of(setup.resolve_config(_synthetic(**{"sweep.seed": (4, 2)})))
  assert [r.name for r in seeds_only] == ["seed=4", "seed=2"]
  # No sweep: one replica, the config itself, in the workdir itself.
  (single,) = sweep.replicas_of(setup.resolve_config(_synthetic()))
  assert single.name == "" and single.values == {}
  # Integer fields take integral values in their own type (names and config.json agree).
  (replica,) = sweep.replicas_of(
    setup.resolve_config(_synthetic(**{"sweep.optimizer.warmup_steps": (3.0,)}))
  )
  assert replica.name == "warmup=3" and type(replica.config.optimizer.warmup_steps) is int


def test_replica_optimizer_traces_only_what_differs():
  opts = [
    ml_collections.ConfigDict(
      dict(_synthetic().optimizer.to_dict(), schedule="constant", warmup_steps=0, **values)
    )
    for values in (dict(lr=0.1, weight_decay=0.1), dict(lr=0.2, weight_decay=0.3))
  ]
  optimizer = optim.make_replica_optimizer(opts, total_steps=10)
  assert sorted(optimizer.hyperparameters) == ["replica", "weight_decay"]
  np.testing.assert_allclose(optimizer.hyperparameters["weight_decay"], [0.1, 0.3], rtol=1e-6)
  # Each replica's learning rate is its own schedule's, picked by its index inside the program.
  for index, opt in enumerate(opts):
    tx = optimizer.transformation(
      {k: np.asarray(v[index]) for k, v in optimizer.hyperparameters.items()}
    )
    params = {"w": np.ones((2, 2), np.float32)}
    grads = {"w": np.full((2, 2), 0.5, np.float32)}
    updates, _ = tx.update(grads, tx.init(params), params)
    alone, _ = optim.make_optimizer(opt, 10)
    expected, _ = alone.update(grads, alone.init(params), params)
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-6)


def test_train_command_takes_the_sweep_as_config_flags(tmp_path):
  """docs/training.md's syntax: `--config.sweep.<field>='(v1,v2)'`; errors in one line."""
  import subprocess
  import sys

  repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config_file = tmp_path / "config.py"
  config_file.write_text(
    "from primal_dual.training import config_lib\n"
    "def get_config(arg=None):\n"
    "  config = config_lib.training_defaults()\n"
    "  config.update(num_train_steps=2, batch_size=8, progress_bar=False)\n"
    "  config.data.update(dict(num_train=16, num_eval=8, seq_len=4, num_features=2, num_classes=2))\n"
    "  return config_lib.lock(config)\n"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")

  def train(*flags):
    return subprocess.run(
      [sys.executable, os.path.join(repo_root, "train.py"), f"--config={config_file}", *flags],
      capture_output=True,
      text=True,
      env=env,
      cwd=repo_root,
      timeout=300,
    )

  refused = train("--config.sweep.optimizer.weight_decay=(0,0.1)", f"--workdir={tmp_path / 'bad'}")
  assert refused.returncode == 2, refused.stderr
  assert (
    refused.stderr.strip()
    .splitlines()[-1]
    .startswith("error: replicas with optimizer.weight_decay 0 and > 0")
  )
  assert "Traceback" not in refused.stderr
  refused = train("--config.sweep.points=('lr=0.01,width=2',)", f"--workdir={tmp_path / 'bad'}")
  assert refused.returncode == 2, refused.stderr
  assert (
    refused.stderr.strip()
    .splitlines()[-1]
    .startswith(
      "error: config.sweep.points[0]='lr=0.01,width=2': 'width=2' is not <field>=<number>"
    )
  )
  done = train(
    "--config.sweep.optimizer.lr=(0.01,0.02)",
    "--config.sweep.optimizer.warmup_steps=(1,)",
    f"--workdir={tmp_path / 'w'}",
  )
  assert done.returncode == 0, done.stderr
  for name in ("lr=0.01,warmup=1", "lr=0.02,warmup=1"):
    config = json.loads((tmp_path / "w" / name / "config.json").read_text())
    assert config["optimizer"]["warmup_steps"] == 1 and config["sweep"]["optimizer"]["lr"] == []
    assert (tmp_path / "w" / name / trainer.FINAL_METRICS_FILE).exists()
