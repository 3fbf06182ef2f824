"""Tests of the fuzzy-logic generator, its splits, sources and R² (primal_dual/data/logic.py).

Every generation call below uses 256 indices (or 1, through the source), so each config compiles
once per bucket size.
"""

import itertools
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest

import helpers

from primal_dual.data import logic

DEFAULT = logic.LogicConfig()
BATCH = 256
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train_batch():
  return logic.generate_batch(DEFAULT, 0, np.arange(BATCH), "train")


def _direct_task_output(x, conjunctions):
  """max over terms of min over literals, in plain Python on one point x (list of floats)."""
  polarity_of = list(itertools.product([0, 1], repeat=len(x)))
  return max(min(xi if p else 1.0 - xi for xi, p in zip(x, polarity_of[c])) for c in conjunctions)


def test_conjunction_and_term_set_tables():
  table = logic.conjunction_table(DEFAULT)
  assert table.shape == (16, 4)
  np.testing.assert_array_equal(table[:3], [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]])
  np.testing.assert_array_equal(logic.heldout_conjunction_ids(DEFAULT), [12, 13, 14, 15])
  terms = logic.term_set_table(DEFAULT)
  assert terms.shape == (120, 2) and (terms[:, 0] < terms[:, 1]).all()


@pytest.mark.parametrize("mode, num_ood", [("any_held_out", 54), ("all_held_out", 6)])
def test_splits_keep_heldout_conjunctions_out_of_train_and_test(mode, num_ood):
  config = logic.LogicConfig(ood_term_sets=mode)
  terms = logic.term_set_table(config)
  held = set(logic.heldout_conjunction_ids(config).tolist())
  train, test, ood = (logic.split_task_ids(config, s) for s in ("train", "test", "ood"))
  np.testing.assert_array_equal(logic.split_task_ids(config, "validation"), train)
  assert len(train) == len(test) == 33  # 66 term sets of seen conjunctions, half each
  assert not set(train) & set(test) and not (set(train) | set(test)) & set(ood)
  for task in np.concatenate([train, test]):
    assert not set(terms[task].tolist()) & held
  assert len(ood) == num_ood
  need = all if mode == "all_held_out" else any
  for task in ood:
    assert need(c in held for c in terms[task].tolist())
  other = logic.split_task_ids(logic.LogicConfig(split_seed=1, ood_term_sets=mode), "test")
  assert set(other) != set(test)


def test_records_match_direct_max_of_min(train_batch):
  inputs, target, task_id = train_batch["inputs"], train_batch["target"], train_batch["task_id"]
  assert inputs.shape == (BATCH, 16, 5) and inputs.dtype == np.float32
  assert target.shape == (BATCH,) and target.dtype == np.float32
  assert task_id.shape == (BATCH,) and task_id.dtype == np.int32
  assert (inputs[:, :, :4] >= 0).all() and (inputs[:, :, :4] < 1).all()
  assert not inputs[:, -1, -1].any()  # the query's y is hidden
  terms = logic.term_set_table(DEFAULT)
  for b in range(0, BATCH, 8):
    conjunctions = terms[task_id[b]].tolist()
    for t in range(16):
      expected = _direct_task_output(inputs[b, t, :4].astype(np.float64).tolist(), conjunctions)
      got = target[b] if t == 15 else inputs[b, t, 4]
      assert abs(float(got) - expected) < 1e-6


def test_training_stream_never_uses_heldout_conjunctions(train_batch):
  terms = logic.term_set_table(DEFAULT)
  held = set(logic.heldout_conjunction_ids(DEFAULT).tolist())
  more = logic.generate_batch(DEFAULT, 5, np.arange(BATCH), "train")
  used = np.concatenate([train_batch["task_id"], more["task_id"]])
  assert set(used) <= set(logic.split_task_ids(DEFAULT, "train"))
  assert not set(terms[used].ravel().tolist()) & held
  ood = logic.generate_batch(DEFAULT, 0, np.arange(BATCH), "ood")["task_id"]
  assert all(set(terms[t].tolist()) & held for t in ood)


def test_streams_of_different_splits_and_seeds_are_disjoint(train_batch):
  batches = [train_batch]
  batches += [
    logic.generate_batch(DEFAULT, 0, np.arange(BATCH), s) for s in ("validation", "test", "ood")
  ]
  batches.append(logic.generate_batch(DEFAULT, 1, np.arange(BATCH), "train"))
  prints = [{row.tobytes() for row in b["inputs"]} for b in batches]
  assert all(len(p) == BATCH for p in prints)
  for a, b in itertools.combinations(prints, 2):
    assert not a & b


def test_generation_is_deterministic_across_processes(tmp_path):
  out = tmp_path / "test.npz"
  script = textwrap.dedent(f"""
      import numpy as np
      from primal_dual.data import logic
      batch = logic.generate_batch(logic.LogicConfig(), 7, np.arange(100, 100 + {BATCH}), "test")
      np.savez({str(out)!r}, **batch)
  """)
  subprocess.run(
    [sys.executable, "-c", script],
    check=True,
    cwd=REPO_ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=120,
  )
  here = logic.generate_batch(DEFAULT, 7, np.arange(100, 100 + BATCH), "test")
  other = np.load(out)
  assert set(other.files) == set(here)
  for name, value in here.items():
    assert other[name].tobytes() == value.tobytes(), name


def test_source_reads_match_batches_and_work_in_grain(train_batch):
  source = logic.LogicSource(DEFAULT, "train", seed=0, size=1000)
  assert len(source) == 1000
  records = source._getitems(list(range(BATCH)))
  single = source[42]
  assert single["target"].shape == () and single["inputs"].shape == (16, 5)
  for name, value in train_batch.items():
    np.testing.assert_array_equal(records[42][name], value[42])
    np.testing.assert_array_equal(single[name], value[42])
  np.testing.assert_array_equal(
    grain.MapDataset.source(source)[42]["inputs"], train_batch["inputs"][42]
  )
  restored = pickle.loads(pickle.dumps(source))
  assert (restored.config, restored.split, len(restored)) == (DEFAULT, "train", 1000)
  with pytest.raises(IndexError):
    source[1000]


def test_exact_moments_single_minterm_is_beta():
  config = logic.LogicConfig(num_terms=1, num_variables=3)
  mean, variance = logic.task_moments(config)
  n = 3  # min of n uniforms is Beta(1, n)
  np.testing.assert_allclose(mean, 1 / (n + 1), rtol=1e-12)
  np.testing.assert_allclose(variance, n / ((n + 1) ** 2 * (n + 2)), rtol=1e-12)


def test_exact_moments_match_monte_carlo():
  mean, variance = logic.task_moments(DEFAULT)
  terms = logic.term_set_table(DEFAULT)
  polarities = logic.conjunction_table(DEFAULT)
  x = np.random.default_rng(0).random((200_000, 4))
  for task in (0, 1, 17, 60, 119):  # neighbours, far apart, both held out
    literals = np.where(polarities[terms[task]][:, None, :], x, 1 - x)  # [terms, N, n]
    y = literals.min(-1).max(0)
    se = y.std() / np.sqrt(len(y))
    assert abs(y.mean() - mean[task]) < 5 * se
    assert abs(y.var() - variance[task]) < 0.02 * variance[task]


def test_r_squared_perfect_and_mean_predictions(train_batch):
  mean, variance = logic.task_moments(DEFAULT)
  batches = [train_batch] + [
    logic.generate_batch(DEFAULT, 0, np.arange(i, i + BATCH), "train")
    for i in range(BATCH, 16 * BATCH, BATCH)
  ]
  target = np.concatenate([b["target"] for b in batches])
  task_id = np.concatenate([b["task_id"] for b in batches])
  assert logic.r_squared(target, target, variance[task_id]) == 1.0
  assert abs(logic.r_squared(mean[task_id], target, variance[task_id])) < 0.1
  assert logic.r_squared(np.zeros_like(target), target, variance[task_id]) < -0.5
  with pytest.raises(ValueError):
    logic.r_squared(target[:-1], target, variance[task_id])


@pytest.mark.parametrize(
  "make",
  [
    lambda: logic.LogicConfig(ood_term_sets="some"),
    lambda: logic.LogicConfig(num_terms=13),
    lambda: logic.LogicConfig(seq_len=1),
    lambda: logic.LogicConfig(ood_fraction=1.0),
    lambda: logic.LogicConfig(test_fraction=0.0),
    lambda: logic.LogicSource(DEFAULT, "dev", 0, 10),
    lambda: logic.LogicSource(logic.LogicConfig(ood_fraction=0.0), "ood", 0, 10),
    lambda: logic.generate_batch(DEFAULT, 2**32, [0]),
  ],
)
def test_user_errors_raise_value_error(make):
  with pytest.raises(ValueError):
    make()


def test_single_key_sampler_matches_documented_key_derivation(train_batch):
  helpers.assert_sampler_follows_key_derivation(
    lambda key: logic.sample_sequence(key, DEFAULT, "train"),
    logic.SPLITS["train"].stream_id,
    3,
    train_batch,
  )
