"""The HYLA paper's setups (primal_dual/configs/sraven.py and primal_dual/configs/logic.py `paper`
presets): model sizes, position buckets, attention width, dropout, the paper's linear attention, its R² and schedule."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from primal_dual.configs import logic as logic_configs
from primal_dual.configs import sraven as sraven_configs
from primal_dual.data import logic as logic_data
from primal_dual.data import sraven as sraven_data
from primal_dual import registry
from primal_dual.tasks import logic as logic_task
from primal_dual.tasks import sraven as sraven_task
from primal_dual.models import parameter_count
from primal_dual.models.sequence import unidirectional_position_buckets
from primal_dual.training import config_lib
from primal_dual.training import errors
from primal_dual.training import optim


def _abstract_params(task, config, num_tokens, num_features):
  model = task.build_model(config, {"num_values": 8})
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, num_tokens, num_features)))
  )
  return nn.unbox(variables["params"])


def _with(config, **model_fields):
  """An unlocked copy of ``config`` with ``model`` fields replaced."""
  copy = ml_collections.ConfigDict(config.to_dict())
  copy.model.update(model_fields)
  return copy


@pytest.mark.parametrize("attention", ["softmax", "linear_plain", "hyla"])
def test_sraven_paper_model_has_the_papers_parameter_count_and_head_size(attention):
  config = sraven_configs.get_config(f"preset=paper,attention={attention}")
  params = _abstract_params(sraven_task, config, 36, 8)
  assert parameter_count(params) == 402_824
  query = params["block_0"]["attention"]["query"]["kernel"]
  assert query.shape == (128, 16, 4)  # 16 heads of size 4: q/k/v width 64, apart from d 128
  assert params["relative_bias_0"]["table"].shape == (16, 36)


def test_logic_paper_model_parameter_count_and_head_size():
  config = logic_configs.get_config("preset=paper,attention=hyla")
  params = _abstract_params(logic_task, config, 32, 5)
  # 151,009 (the paper code's count at its default seq_len 16) + 2 layers × 8 heads × 16 more
  # bias buckets at the headline seq_len 32.
  assert parameter_count(params) == 151_265
  assert params["block_0"]["attention"]["query"]["kernel"].shape == (128, 8, 2)
  short = _with(config, num_buckets=16, max_distance=16)
  assert parameter_count(_abstract_params(logic_task, short, 16, 5)) == 151_009


# Bucket of offset n = query − key for n = 0 … T−1 (keys after the query share bucket 0).
# fmt: off
UNIDIRECTIONAL_36 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22,
                     23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 32, 33, 34, 35]
UNIDIRECTIONAL_32 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22,
                     23, 24, 25, 26, 27, 28, 28, 29, 30, 31]
# fmt: on


@pytest.mark.parametrize("length, expected", [(36, UNIDIRECTIONAL_36), (32, UNIDIRECTIONAL_32)])
def test_unidirectional_bucket_table(length, expected):
  table = unidirectional_position_buckets(length, length, length)
  assert table.shape == (length, length) and table.dtype == np.int32
  query, key = np.indices((length, length))
  np.testing.assert_array_equal(table, np.asarray(expected)[np.maximum(query - key, 0)])
  assert (table[key >= query] == 0).all()
  if length == 36:
    assert len(np.unique(table)) == 35  # sRAVEN's 71 offsets share 35 biases


def _tiny_paper_model(config_module, task, num_tokens, num_features):
  config = config_module.get_config("preset=paper,attention=hyla,runlocal")
  assert config.model.attention_dropout_rate == 0.1 and config.model.dropout_rate == 0.0
  model = task.build_model(config, {"num_values": 8})
  inputs = jax.random.normal(jax.random.key(1), (2, num_tokens, num_features))
  variables = model.init(jax.random.key(0), inputs)
  return model, variables, inputs


def test_attention_dropout_is_active_only_in_training():
  model, variables, inputs = _tiny_paper_model(sraven_configs, sraven_task, 36, 8)

  def run(train, seed):
    return np.asarray(
      model.apply(variables, inputs, train=train, rngs={"dropout": jax.random.key(seed)})
    )

  np.testing.assert_array_equal(run(False, 1), run(False, 2))
  assert not np.allclose(run(True, 1), run(True, 2))
  assert not np.allclose(run(True, 1), run(False, 1))


def test_linear_plain_is_the_papers_unnormalised_linear_attention():
  # One example, one head, d = 4 (scale 1/2), two queries and keys, d_v = 2.
  query = jnp.array([[2.0, 0, 0, 0], [0, 2.0, 0, 0]])[None, :, None, :]
  key = jnp.array([[1.0, 0, 0, 0], [1.0, 1.0, 0, 0]])[None, :, None, :]
  value = jnp.array([[1.0, 0], [0, 3.0]])[None, :, None, :]
  bias = jnp.array([[0.5, 0.0], [0.0, 0.0]])[None, None]
  attention = registry.make_attention_fn("linear_plain")
  # a = q·k/2 + bias = [[1.5, 1], [0, 1]]; out_i = Σ_j a_ij v_j.
  out = attention(query, key, value, bias=bias)
  np.testing.assert_allclose(out[0, :, 0], [[1.5, 3.0], [0.0, 3.0]], rtol=1e-6)
  mask = jnp.array([[True, False], [True, True]])
  out = attention(query, key, value, bias=bias, mask=mask)  # masked scores are 0
  np.testing.assert_allclose(out[0, :, 0], [[1.5, 0.0], [0.0, 3.0]], rtol=1e-6)


def test_per_sequence_r2_is_the_papers_definition():
  # Sequence 0: context targets 0 and 1, query target 0.5 → var = 1/6; prediction 0.7.
  inputs = jnp.array([[[0.3, 0.0], [0.1, 1.0], [0.9, 0.0]], [[0.2, 0.4], [0.5, 0.4], [0.6, 0.0]]])
  batch = {
    "inputs": inputs,
    "target": jnp.array([0.5, 0.4]),
    "task_variance": jnp.array([0.1, 0.1]),
    "valid": jnp.array([True, False]),
  }
  outputs = jnp.zeros((2, 3, 1)).at[:, -1, 0].set(jnp.array([0.7, 0.0]))
  _, metrics = logic_task.logic_loss_and_metrics(outputs, batch)
  total, count = (float(v) for v in metrics["r2_per_sequence"])
  assert count == 1.0
  assert total == pytest.approx(1.0 - 0.04 / (1.0 / 6.0), rel=1e-5)


def test_paper_schedule_reaches_the_end_rate_at_total_minus_warmup():
  config = sraven_configs.get_config("preset=paper")
  schedule = optim.make_schedule(config.optimizer, config.num_train_steps)
  assert float(schedule(1000)) == pytest.approx(1e-3)
  assert float(schedule(100_000)) > 1.1e-4
  for step in (155_250, 156_000, 156_249):
    assert float(schedule(step)) == pytest.approx(1e-4, rel=1e-5)
  ours = ml_collections.ConfigDict(dict(config.optimizer.to_dict(), cosine_end="total"))
  assert float(optim.make_schedule(ours, config.num_train_steps)(155_250)) > 1e-4 * 1.0005


def test_logic_paper_preset_protocol():
  config = logic_configs.get_config("preset=paper")
  data = config.data
  assert (data.seq_len, data.test_fraction, data.ood_term_sets) == (32, 0.7, "all_held_out")
  assert config.num_train_steps == 50_000 and config.batch_size == 128
  assert (config.optimizer.warmup_steps, config.optimizer.cosine_end) == (100, "total_minus_warmup")
  tasks = logic_task.task_family(config)
  from primal_dual.data import logic

  assert len(logic.split_task_ids(tasks, "ood")) == 6  # C(4, 2): held-out conjunctions only
  assert len(logic.split_task_ids(tasks, "test")) == 46  # 70% of the 66 seen term sets


# -- where the paper's code and this library's earlier presets differ: named rules ----------------

SEQUENCE_CONFIGS = {"sraven": sraven_configs, "logic": logic_configs}


def _end_rate(config_arg, module=sraven_configs, **optimizer_fields):
  """The schedule's value after the cosine ended (held to the last step)."""
  config = module.get_config(config_arg)
  opt = ml_collections.ConfigDict(dict(config.optimizer.to_dict(), **optimizer_fields))
  return float(optim.make_schedule(opt, config.num_train_steps)(config.num_train_steps - 1))


@pytest.mark.parametrize("task", ["sraven", "logic"])
def test_paper_preset_end_rate_is_relative_to_the_peak(task):
  module = SEQUENCE_CONFIGS[task]
  # The paper's code: end_value = 0.1 × lr, so the sweep's lr 3e-4 ends at 3e-5.
  assert _end_rate("preset=paper", module) == pytest.approx(1e-4, rel=1e-5)
  assert _end_rate("preset=paper", module, lr=3e-4) == pytest.approx(3e-5, rel=1e-5)
  # The earlier absolute rule, kept as end_lr=absolute: 1e-4 whatever lr.
  assert _end_rate("preset=paper,end_lr=absolute", module, lr=3e-4) == pytest.approx(1e-4, rel=1e-5)
  # The CPU preset keeps the absolute rule (its numbers are unchanged).
  cpu = module.get_config("preset=cpu").optimizer
  assert (cpu.end_lr, cpu.end_lr_factor) == (1e-4, None)
  assert _end_rate("preset=cpu,end_lr=relative", module, lr=3e-4) == pytest.approx(3e-5, rel=1e-5)


def test_end_rate_refuses_both_an_absolute_and_a_relative_end():
  config = sraven_configs.get_config("preset=paper")
  both = ml_collections.ConfigDict(dict(config.optimizer.to_dict(), end_lr=1e-4))
  with pytest.raises(errors.ConfigError, match="end_lr must be None"):
    optim.make_schedule(both, 100)
  with pytest.raises(ValueError, match="unknown sRAVEN end_lr rule"):
    sraven_configs.get_config("preset=paper,end_lr=linear")


def _held_out(task, config_arg):
  """The held-out latents of a config: sRAVEN rule multisets (ood), logic term sets (test)."""
  if task == "sraven":
    config = sraven_configs.get_config(config_arg)
    return sraven_data.heldout_latent_ids(sraven_task.problem_family(config))
  config = logic_configs.get_config(config_arg)
  return logic_data.split_task_ids(logic_task.task_family(config), "test")


@pytest.mark.parametrize("task", ["sraven", "logic"])
def test_paper_preset_draws_a_held_out_set_per_seed(task):
  seed0, seed1, seed2 = (_held_out(task, f"preset=paper,seed={s}") for s in (0, 1, 2))
  assert len(seed0) == len(seed1) == len(seed2)
  assert not np.array_equal(seed0, seed1) and not np.array_equal(seed1, seed2)
  # held_out=fixed: split seed 0 for every seed, the earlier rule (and the CPU preset's).
  fixed = [_held_out(task, f"preset=paper,held_out=fixed,seed={s}") for s in (0, 1)]
  np.testing.assert_array_equal(fixed[0], fixed[1])
  np.testing.assert_array_equal(fixed[0], seed0)  # seed 0 draws split 0 either way
  cpu = [_held_out(task, f"preset=cpu,seed={s}") for s in (0, 2)]
  np.testing.assert_array_equal(cpu[0], cpu[1])


@pytest.mark.parametrize("task", ["sraven", "logic"])
def test_per_seed_held_out_set_refuses_replica_seeds(task):
  module = {"sraven": sraven_task, "logic": logic_task}[task]
  config = SEQUENCE_CONFIGS[task].get_config("preset=paper,seed=1,runlocal")
  family = getattr(module, "problem_family" if task == "sraven" else "task_family")
  one = config_lib.with_fields(config, {"sweep.seed": (2,)})
  assert family(one).split_seed == 2  # a single replica seed is the run's seed
  # A sweep's config of several seeds has no one held-out set (each replica's own config has).
  with pytest.raises(ValueError, match="one held-out set per seed"):
    module.build_data(config_lib.with_fields(config, {"sweep.seed": (0, 1)}))
  # Seeds set by listed points are replica seeds too.
  with pytest.raises(ValueError, match="one held-out set per seed"):
    module.build_data(config_lib.with_fields(config, {"sweep.points": ("seed=0", "seed=1")}))
  points = config_lib.with_fields(config, {"sweep.points": ("seed=3,lr=0.001", "seed=3,lr=0.0003")})
  assert family(points).split_seed == 3
  # Sweeping other settings at one seed keeps the per-seed split.
  swept = config_lib.with_fields(config, {"sweep.optimizer.lr": (1e-3, 3e-4)})
  assert family(swept).split_seed == 1
