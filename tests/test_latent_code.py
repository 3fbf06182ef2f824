"""Tests of the latent-code analysis (primal_dual/analysis/latent_code.py)."""

import types

import flax.linen as nn
import jax
import numpy as np
import pytest

import helpers

from primal_dual.analysis import latent_code
from primal_dual.data import sraven
from primal_dual.models import SequenceTransformer
from primal_dual.training import sharding

SHUFFLED = sraven.SRavenConfig(num_features=3, num_values=8)  # F = 3: 27 tokens


# -- which pairs -----------------------------------------------------------------------------------


def test_pair_positions_pick_the_query_and_its_features_third_row_tokens():
  batch = sraven.generate_batch(SHUFFLED, 0, np.arange(64), "train")
  num_features = SHUFFLED.num_features
  query, keys = latent_code.rule_pair_positions(batch["feature_order"], num_features)
  np.testing.assert_array_equal(query[0], 8 * num_features + np.arange(num_features))
  order = batch["feature_order"]
  for column, panel in enumerate(latent_code.THIRD_ROW_PANELS):
    slots = keys[..., column] - panel * num_features
    assert np.all((0 <= slots) & (slots < num_features))
    # The key's slot in column c shows the same underlying feature as the answer slot.
    np.testing.assert_array_equal(np.take_along_axis(order[:, column], slots, -1), order[:, 2])
  # Data-level check: a feature following 'constant' has the answer's value at both keys.
  values = np.argmax(batch["inputs"], axis=-1)  # [N, T]
  constant = batch["rules"] == SHUFFLED.rules.index("constant")  # [N, F]
  assert constant.sum() > 5
  for column in range(2):
    at_key = np.take_along_axis(values, keys[..., column], axis=1)  # [N, F]
    np.testing.assert_array_equal(at_key[constant], batch["targets"][constant])


def test_codes_from_weights_reads_heads_of_the_chosen_pairs():
  weights = np.arange(2 * 3 * 4 * 4, dtype=np.float64).reshape(2, 3, 4, 4)  # [N, H, T, T]
  query = np.array([[3], [2]])
  keys = np.array([[[0, 1]], [[1, 3]]])
  codes = latent_code.codes_from_weights(weights, query, keys)
  assert codes.shape == (2, 1, 6)
  np.testing.assert_array_equal(codes[1, 0], [*weights[1, :, 2, 1], *weights[1, :, 2, 3]])


# -- the decoder -----------------------------------------------------------------------------------


def test_decoder_reads_separable_codes_and_not_random_labels():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 5, size=(600, 3))
  centres = rng.normal(size=(5, 12)) * 3.0
  codes = centres[labels] + rng.normal(size=(600, 3, 12)) * 0.3
  separable = latent_code.decoding_accuracy(codes, labels, 5)
  assert separable["accuracy"] > 0.98
  assert separable["num_train"] == separable["num_test"] == 900

  shuffled = rng.permutation(labels.reshape(-1)).reshape(labels.shape)
  chance = latent_code.decoding_accuracy(codes, shuffled, 5)
  assert abs(chance["accuracy"] - 0.2) < 0.06
  assert abs(chance["chance"] - 0.2) < 0.06


def test_decoder_errors_are_value_errors():
  with pytest.raises(ValueError, match="l2"):
    latent_code.fit_ridge(np.zeros((4, 2)), np.zeros(4, int), 2, l2=0.0)
  with pytest.raises(ValueError, match="at least 2 problems"):
    latent_code.decoding_accuracy(np.zeros((1, 2, 3)), np.zeros((1, 2), int), 2)
  program = types.SimpleNamespace(config=types.SimpleNamespace(task="logic"))
  with pytest.raises(ValueError, match="sRAVEN"):
    latent_code.run(program, None)


def test_missing_weights_are_reported_not_guessed():
  assert latent_code.sown_attention_weights({}, 2) is None
  sown = {"block_0": {"attention": {"attention_weights": (np.zeros((1, 2, 3, 3)),)}}}
  assert latent_code.sown_attention_weights(sown, 2) is None
  assert latent_code.sown_attention_weights(sown, 1)[0].shape == (1, 2, 3, 3)


# -- on a (tiny, untrained) model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_program():
  """What ``run`` reads of a trainer Program and TrainState, for an untrained 1-layer HYLA
  model (the trainer's own path is covered by tests/test_sraven_task.py's reproduce test)."""
  problems = sraven.SRavenConfig(num_features=3, num_values=8)
  model = SequenceTransformer(
    num_outputs=8,
    **helpers.tiny_model_sizes(model_dim=16, num_heads=4, mlp_dim=32),
    attention="hyla",
    num_buckets=108,
    max_distance=108,
  )
  source = sraven.SRavenSource(problems, "ood", 0, 16)
  variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), source[0]["inputs"][None]))
  program = types.SimpleNamespace(
    config=types.SimpleNamespace(task="sraven"),
    splits={"ood": source},
    metadata={"rules": problems.rules},
    model=model,
    eval_batch_size=16,
    mesh=sharding.make_mesh({"data": -1, "model": 1}),
  )
  return program, types.SimpleNamespace(params=variables["params"], batch_stats={})


def test_run_on_a_tiny_model_is_deterministic_and_plots(tiny_program, tmp_path):
  program, state = tiny_program
  result = latent_code.run(program, state, split="ood", max_examples=16, out_dir=str(tmp_path))
  assert result["available"] and result["attention"] == "hyla"
  assert result["num_problems"] == 16 and len(result["per_layer"]) == 1
  for entry in (*result["per_layer"], result["all_layers"]):
    assert 0.0 <= entry["accuracy"] <= 1.0 and 0.0 <= entry["chance"] <= 1.0
    assert entry["num_train"] + entry["num_test"] == 16 * 3
  assert (tmp_path / latent_code.PLOT_FILE).stat().st_size > 0
  again = latent_code.run(program, state, split="ood", max_examples=16, out_dir=None)
  assert again["plot"] is None
  assert {k: v for k, v in again.items() if k != "plot"} == {
    k: v for k, v in result.items() if k != "plot"
  }
  with pytest.raises(ValueError, match="unknown split"):
    latent_code.run(program, state, split="nope")
