"""Tests of the 'sraven' task (primal_dual/tasks/sraven.py), primal_dual/configs/sraven.py and
`primal-dual reproduce sraven` (its --quick grid is the task's end-to-end run)."""

import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primal_dual.configs import sraven as sraven_configs
from primal_dual.data import generated
from primal_dual.data import sraven
from reproduce import grid
from primal_dual.tasks import sraven as task
from reproduce import hyla_paper
from reproduce import sraven as sraven_study
from primal_dual.layers import ATTENTION_REGISTRY
from primal_dual.training import task_registry

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = sraven.SRavenConfig(num_features=2, num_values=5, rules=("constant", "addition"))


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  shifted = x - x.max(axis=-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# -- loss and metrics ------------------------------------------------------------------------------


def test_loss_and_metrics_on_hand_made_logits():
  # 3 problems, F = 2 features, V = 3 values, 5 positions: the answer is read at positions 3, 4.
  rng = np.random.default_rng(0)
  outputs = rng.normal(size=(3, 5, 3)).astype(np.float32)
  targets = np.array([[0, 2], [1, 1], [2, 0]], np.int32)
  # Problem 0: both argmaxes right. Problem 1: feature 0 right, feature 1 wrong.
  outputs[0, 3], outputs[0, 4] = [5, 0, 0], [0, 0, 5]
  outputs[1, 3], outputs[1, 4] = [0, 5, 0], [5, 0, 0]
  outputs[2, 3:] = np.nan  # a padding row: must not poison the sums
  valid = np.array([True, True, False])
  loss, metrics = jax.jit(task.sraven_loss_and_metrics)(
    jnp.asarray(outputs), {"targets": jnp.asarray(targets), "valid": jnp.asarray(valid)}
  )

  answer = _log_softmax(outputs[:2, 3:])  # [2, F, V]
  per_problem = -np.take_along_axis(answer, targets[:2, :, None], -1)[..., 0].mean(-1)
  np.testing.assert_allclose(float(loss), per_problem.mean(), rtol=1e-5)
  np.testing.assert_allclose(
    [float(v) for v in metrics["loss"]], [per_problem.sum(), 2.0], rtol=1e-5
  )
  assert [float(v) for v in metrics["whole_panel_accuracy"]] == [1.0, 2.0]
  assert [float(v) for v in metrics["feature_accuracy"]] == [1.5, 2.0]


def test_training_batches_without_valid_count_every_row():
  outputs = jnp.zeros((4, 6, 3)).at[:, -1, 1].set(1.0)
  targets = jnp.array([[0, 1], [1, 1], [2, 1], [0, 0]], jnp.int32)
  loss, metrics = jax.jit(task.sraven_loss_and_metrics)(outputs, {"targets": targets})
  assert float(metrics["whole_panel_accuracy"][1]) == 4.0
  # Position -2 is all zeros, whose argmax is value 0: problems 0 and 3 have feature 0 right;
  # feature 1 (predicted 1) is right for problems 0-2. Only problem 0 is right as a whole.
  assert float(metrics["whole_panel_accuracy"][0]) == 1.0
  assert float(metrics["feature_accuracy"][0]) == pytest.approx(2.5)
  assert np.isfinite(float(loss))


# -- data ------------------------------------------------------------------------------------------


def test_token_encoding_round_trips_context_and_query_tokens():
  batch = sraven.generate_batch(SMALL, 0, np.arange(8), "train")
  tokens = task.encode_tokens(batch["inputs"])
  assert tokens.dtype == np.int8 and tokens.shape == (8, SMALL.num_tokens)
  assert np.all(tokens[:, -SMALL.num_features :] == -1)  # query tokens are all-zero
  np.testing.assert_array_equal(task.decode_tokens(tokens, SMALL.num_values), batch["inputs"])


def test_materialized_source_equals_the_stream():
  stored = task.MaterializedSRavenSource(SMALL, "train", 3, 20, chunk_size=10)
  # The same stream read independently (batches of 10 share the generator's compiled shape).
  halves = [
    sraven.generate_batch(SMALL, 3, np.arange(start, start + 10), "train") for start in (0, 10)
  ]
  stream = {name: np.concatenate([h[name] for h in halves]) for name in halves[0]}
  assert len(stored) == 20
  for index in (0, 9, 10, 19):  # both chunks, both edges
    expected = {name: value[index] for name, value in stream.items()}
    record = stored[index]
    assert set(record) == set(task.TRAIN_FIELDS)
    for name in task.TRAIN_FIELDS:
      np.testing.assert_array_equal(record[name], expected[name])
      assert record[name].dtype == expected[name].dtype
  single = sraven.SRavenSource(SMALL, "train", 3, 20)[13]  # a record generated on its own
  np.testing.assert_array_equal(stored[13]["inputs"], single["inputs"])
  with pytest.raises(IndexError):
    stored[20]
  with pytest.raises(ValueError, match="stores only"):
    task.MaterializedSRavenSource(SMALL, "train", 3, 20, fields=("rules",))
  assert repr(stored) == repr(task.MaterializedSRavenSource(SMALL, "train", 3, 20))
  # get_batch (the batch_reads path) equals the stacked records, dtypes included.
  indices = np.array([19, 0, 13, 10])
  batch = stored.get_batch(indices)
  for name in task.TRAIN_FIELDS:
    expected = np.stack([stored[int(i)][name] for i in indices])
    np.testing.assert_array_equal(batch[name], expected)
    assert batch[name].dtype == expected.dtype
  with pytest.raises(IndexError):
    stored.get_batch(np.array([3, 20]))


def test_build_data_splits_and_metadata():
  config = sraven_configs.get_config("runlocal")
  splits, metadata = task.build_data(config)
  assert set(splits) == {"train", "validation", "test", "ood"}
  assert isinstance(splits["train"], task_registry.LazySplit)  # built only when training reads it
  assert len(splits["train"].build()) == config.num_train_steps * config.batch_size
  assert metadata["num_values"] == config.data.num_values
  assert metadata["num_tokens"] == 9 * config.data.num_features
  heldout = set(sraven.heldout_latent_ids(metadata["problems"]).tolist())
  ood, test = (splits[name].__getitems__(range(32)) for name in ("ood", "test"))
  assert set(ood[0]) >= {"rules", "feature_order"}
  assert all(int(r["latent_id"]) in heldout for r in ood)
  assert not any(int(r["latent_id"]) in heldout for r in test)


# -- configs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(sraven_configs.PRESETS))
def test_configs_build_for_every_preset_and_variant(preset):
  for attention in ATTENTION_REGISTRY:
    for extra in ("", ",runlocal"):
      config = sraven_configs.get_config(f"preset={preset},attention={attention},seed=2{extra}")
      assert config.task == "sraven" and config.seed == 2
      assert config.model.attention == attention
      assert config.selection.split == "validation"  # never selected on the OOD split
      tokens = 9 * config.data.num_features
      # The paper's scheme: unidirectional T5 buckets, num_buckets = max_distance = tokens.
      assert config.model.position_buckets == "unidirectional"
      assert config.model.num_buckets == config.model.max_distance == tokens
      ratios = config.model.attention_options.get("ratios")
      if ratios is not None:
        assert len(ratios) == config.model.num_heads
      with pytest.raises(AttributeError):
        config.new_field = 1  # locked


def test_paper_preset_is_the_spec_setup_and_steps_override():
  config = sraven_configs.get_config("preset=paper,attention=hyla")
  assert (config.data.num_features, config.data.num_values) == (4, 8)
  assert tuple(config.data.rules) == sraven.DEFAULT_RULES and config.data.shuffle_features
  assert (
    config.model.model_dim,
    config.model.num_heads,
    config.model.num_layers,
    config.model.mlp_dim,
  ) == (128, 16, 4, 256)
  assert config.batch_size == 128 and config.num_train_steps == 156_250
  assert config.model.qkv_features == 64 and config.model.attention_dropout_rate == 0.1
  assert config.optimizer.cosine_end == "total_minus_warmup"
  optimizer = config.optimizer
  assert (
    optimizer.name,
    optimizer.lr,
    optimizer.warmup_steps,
    optimizer.end_lr,
    optimizer.end_lr_factor,
    optimizer.weight_decay,
    optimizer.schedule,
  ) == ("adamw", 1e-3, 1000, None, 0.1, 0.1, "warmup_cosine")
  assert config.data.split_seed == generated.SPLIT_SEED_OF_RUN  # a held-out set per seed
  assert sraven_configs.get_config("preset=cpu,steps=123").num_train_steps == 123
  with pytest.raises(ValueError, match="unknown sRAVEN preset"):
    sraven_configs.get_config("preset=huge")


def test_cpu_preset_keeps_held_out_rule_combinations():
  config = sraven_configs.get_config("preset=cpu")
  problems = task.sraven_config(config.data)
  assert len(sraven.heldout_latent_ids(problems)) >= 5
  assert len(sraven.split_latent_ids(problems, "train")) > len(sraven.heldout_latent_ids(problems))


# -- the reproduce script: 2 tiny runs end to end --------------------------------------------------


def test_reproduce_quick_trains_analyses_and_reports(tmp_path):
  root, out = tmp_path / "runs", tmp_path / "out"
  argv = [
    "--quick",
    f"--root={root}",
    f"--results={out / 'sraven_quick.json'}",
    "--max_examples=32",
  ]
  assert grid.reproduce(sraven_study.REPRODUCTION, argv) == 0
  records = json.loads((out / "sraven_quick.json").read_text())
  assert [r["attention"] for r in records] == ["softmax", "hyla"]
  for record in records:
    for name in (
      "id_whole_panel",
      "ood_whole_panel",
      "id_feature",
      "ood_feature",
      "validation_whole_panel",
    ):
      assert 0.0 <= record[name] <= 1.0
    assert record["curve"]["step"] and len(record["curve"]["step"]) == len(
      record["curve"]["ood/whole_panel_accuracy"]
    )
    assert record["steps_per_second"] > 0 and record["wall_time_s"] > 0
    assert record["hardware"] == grid.hardware_info()
    latent = record["latent_code"]
    assert latent["available"] and 0.0 <= record["latent_decoding"] <= 1.0
    assert (root / record["name"] / "latent_code_pca.png").exists()
  markdown = (out / "sraven_quick.md").read_text()
  assert "| attention | ID whole-panel %" in markdown
  assert "--scale=paper" in markdown and "× the time of softmax" in markdown
  assert (out / "sraven_quick_curves.png").stat().st_size > 0

  # Re-running reuses the finished runs and the cached analyses: same records.
  assert grid.reproduce(sraven_study.REPRODUCTION, argv) == 0
  again = json.loads((out / "sraven_quick.json").read_text())
  assert again == records


def test_speed_ratio_is_step_time_ratio():
  records = [
    {"attention": "softmax", "steps_per_second": 10.0},
    {"attention": "softmax", "steps_per_second": 30.0},
    {"attention": "hyla", "steps_per_second": 5.0},
  ]
  assert hyla_paper.speed_ratio(records) == pytest.approx(4.0)
  assert hyla_paper.speed_ratio(records[:2]) is None
  assert math.isclose(
    sraven_study.whole_panel_chance(
      os.path.join(REPO_ROOT, "primal_dual", "configs", "sraven.py"), "preset=paper"
    ),
    8.0**-4,
  )
