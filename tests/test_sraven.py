"""Tests of the sRAVEN generator, its splits, sources and metrics (primal_dual/data/sraven.py).

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
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from primal_dual.data import sraven

DEFAULT = sraven.SRavenConfig()
NO_SHUFFLE = sraven.SRavenConfig(shuffle_features=False)
# Constant rows with 64 values: the values of a row are distinct with high probability, so the
# slot permutation between two columns can be read off the panels.
CONSTANT_WIDE = sraven.SRavenConfig(num_values=64, rules=("constant",), ood_fraction=0.0)
BATCH = 256
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train_batch():
  return sraven.generate_batch(DEFAULT, 0, np.arange(BATCH), "train")


@pytest.fixture(scope="module")
def ood_batch():
  return sraven.generate_batch(DEFAULT, 0, np.arange(BATCH), "ood")


def _underlying_grids(config, batch):
  """Undo the column shuffle: int [B, F, rows, columns] per underlying feature, rule ids [B, F]."""
  panels = sraven.panels_from_record(config, batch["inputs"], batch["targets"])
  order = batch["feature_order"]  # [B, 3, F]
  num = len(panels)
  grids = np.empty_like(panels)
  for b, c in itertools.product(range(num), range(3)):
    grids[b, :, c, order[b, c]] = panels[b, :, c, :].T
  rules = np.empty_like(batch["rules"])
  rules[np.arange(num)[:, None], order[:, 2]] = batch["rules"]
  return np.moveaxis(grids, -1, 1), rules


# -- rules ----------------------------------------------------------------------------------------


def test_row_builders_on_hand_built_rows():
  np.testing.assert_array_equal(sraven.constant_row(4), [4, 4, 4])
  np.testing.assert_array_equal(sraven.progression_row(7, 2, 8), [7, 1, 3])
  np.testing.assert_array_equal(sraven.progression_row(6, 1, 8), [6, 7, 0])
  np.testing.assert_array_equal(sraven.progression_row(1, -2, 8), [1, 7, 5])
  np.testing.assert_array_equal(sraven.progression_row(0, -1, 8), [0, 7, 6])
  np.testing.assert_array_equal(sraven.addition_row(3, 6, 8), [3, 6, 1])
  np.testing.assert_array_equal(sraven.subtraction_row(2, 5, 8), [2, 5, 5])
  np.testing.assert_array_equal(
    sraven.distribute_three_row(jnp.array([5, 1, 3]), jnp.array([2, 0, 1])), [3, 5, 1]
  )


def test_distinct_values_is_a_bijection_onto_ordered_triples():
  num_values = 5
  draws = np.array(list(itertools.product(range(5), range(4), range(3))), np.int32)
  triples = np.asarray(jax.vmap(sraven.distinct_values)(draws))
  assert all(len(set(t)) == 3 for t in triples.tolist())
  assert triples.min() >= 0 and triples.max() < num_values
  # 60 draws -> 60 different ordered triples: uniform draws give uniform triples.
  assert len({tuple(t) for t in triples.tolist()}) == len(draws) == 5 * 4 * 3


def test_distribute_three_rule_on_hand_built_draws():
  draws = sraven.RuleDraws(
    operands=jnp.zeros((3, 2), jnp.int32),
    distinct=jnp.array([6, 0, 4]),
    row_orders=jnp.array([0, 5, 3]),
  )
  grid = np.asarray(sraven.RULES["distribute_three"](draws, 8))
  # distinct [6, 0, 4] -> values 6, 0, then 4 skips past 0 and 6 -> 5.
  np.testing.assert_array_equal(grid[0], [6, 0, 5])
  for row in grid:
    assert sorted(row) == [0, 5, 6]
  assert len({tuple(row) for row in grid.tolist()}) == 3  # orders 0, 5, 3 differ


@pytest.mark.parametrize(
  "rule, good, bad",
  [
    ("constant", [[2, 2, 2], [5, 5, 5], [0, 0, 0]], [[2, 2, 2], [5, 5, 5], [0, 0, 1]]),
    ("progression_plus_1", [[6, 7, 0], [0, 1, 2], [3, 4, 5]], [[6, 7, 0], [0, 1, 2], [3, 4, 6]]),
    ("progression_plus_2", [[7, 1, 3], [0, 2, 4], [6, 0, 2]], [[7, 1, 3], [0, 2, 4], [6, 0, 1]]),
    ("progression_minus_1", [[0, 7, 6], [3, 2, 1], [1, 0, 7]], [[0, 7, 6], [3, 2, 1], [1, 2, 3]]),
    ("progression_minus_2", [[1, 7, 5], [4, 2, 0], [0, 6, 4]], [[1, 7, 5], [4, 2, 0], [0, 6, 5]]),
    ("addition", [[3, 6, 1], [0, 0, 0], [7, 7, 6]], [[3, 6, 1], [0, 0, 0], [7, 7, 7]]),
    ("subtraction", [[2, 5, 5], [6, 1, 5], [0, 7, 1]], [[2, 5, 5], [6, 1, 5], [0, 7, 7]]),
    ("distribute_three", [[1, 4, 6], [6, 1, 4], [4, 6, 1]], [[1, 4, 6], [6, 1, 4], [4, 6, 2]]),
    ("distribute_three", [[1, 4, 6], [1, 4, 6], [6, 4, 1]], [[1, 1, 6], [6, 1, 1], [1, 6, 1]]),
  ],
)
def test_rule_checks_on_hand_built_grids(rule, good, bad):
  assert sraven.grid_satisfies(rule, np.array(good), 8)
  assert not sraven.grid_satisfies(rule, np.array(bad), 8)


@pytest.mark.parametrize("rule", sraven.DEFAULT_RULES)
def test_each_rule_generates_grids_its_check_accepts(rule):
  words = np.random.default_rng(1).integers(0, 2**32, (64, sraven.WORDS_PER_RULE), np.uint32)
  grids = np.asarray(
    jax.jit(jax.vmap(lambda w: sraven.RULES[rule](sraven.rule_draws(w, 8), 8)))(words)
  )
  assert grids.shape == (64, 3, 3) and grids.min() >= 0 and grids.max() < 8
  assert sraven.grid_satisfies(rule, grids, 8).all()
  assert len({g.tobytes() for g in grids}) > 32  # really random


# -- latents and splits ---------------------------------------------------------------------------


def test_latent_table_and_heldout_split_default():
  table = sraven.latent_table(DEFAULT)
  assert table.shape == (330, 4)
  assert (np.diff(table, axis=1) >= 0).all()  # multisets, stored sorted
  assert len({tuple(r) for r in table.tolist()}) == 330
  held = sraven.heldout_latent_ids(DEFAULT)
  inside = sraven.split_latent_ids(DEFAULT, "train")
  assert len(held) == 82  # floor(0.25 * 330)
  assert len(inside) == 248 and not set(held) & set(inside)
  for split in ("validation", "test"):
    np.testing.assert_array_equal(sraven.split_latent_ids(DEFAULT, split), inside)
  np.testing.assert_array_equal(sraven.split_latent_ids(DEFAULT, "ood"), held)
  other = sraven.heldout_latent_ids(sraven.SRavenConfig(split_seed=1))
  assert set(other) != set(held)
  np.testing.assert_array_equal(sraven.heldout_latent_ids(sraven.SRavenConfig(split_seed=0)), held)


def test_tokens_shapes_one_hot_context_and_zero_queries(train_batch):
  inputs = train_batch["inputs"]
  assert inputs.shape == (BATCH, 36, 8) and inputs.dtype == np.float32
  context, queries = inputs[:, :32], inputs[:, 32:]
  assert set(np.unique(context)) == {0.0, 1.0}
  np.testing.assert_array_equal(context.sum(-1), 1.0)
  assert not queries.any()
  assert train_batch["targets"].shape == (BATCH, 4) and train_batch["targets"].dtype == np.int32
  assert 0 <= train_batch["targets"].min() and train_batch["targets"].max() < 8
  assert train_batch["rules"].shape == (BATCH, 4) and train_batch["rules"].max() < 8
  np.testing.assert_array_equal(
    np.sort(train_batch["feature_order"], axis=-1), np.broadcast_to(np.arange(4), (BATCH, 3, 4))
  )


@pytest.mark.parametrize("batch_name", ["train_batch", "ood_batch"])
def test_generated_problems_follow_their_rules_row_by_row(batch_name, request):
  batch = request.getfixturevalue(batch_name)
  grids, rules = _underlying_grids(DEFAULT, batch)  # [B, F, 3, 3], [B, F]
  for rule_id, name in enumerate(DEFAULT.rules):
    chosen = rules == rule_id
    assert sraven.grid_satisfies(name, grids[chosen], 8).all(), name
  # The rules are an assignment of the problem's latent multiset.
  np.testing.assert_array_equal(
    np.sort(rules, axis=1), sraven.latent_table(DEFAULT)[batch["latent_id"]]
  )
  assert len(np.unique(rules)) == len(DEFAULT.rules)  # every rule occurs in 256 problems


def test_no_heldout_latent_in_training_and_ood_uses_only_heldout(train_batch, ood_batch):
  table = sraven.latent_table(DEFAULT)
  held = {tuple(table[i]) for i in sraven.heldout_latent_ids(DEFAULT)}
  more_train = sraven.generate_batch(DEFAULT, 0, np.arange(BATCH, 2 * BATCH), "train")
  for batch in (train_batch, more_train):
    multisets = {tuple(r) for r in np.sort(batch["rules"], axis=1).tolist()}
    assert not multisets & held
  ood_multisets = {tuple(r) for r in np.sort(ood_batch["rules"], axis=1).tolist()}
  assert ood_multisets <= held and len(ood_multisets) > 40


def test_column_shuffle_is_shared_by_the_panels_of_a_column():
  batch = sraven.generate_batch(CONSTANT_WIDE, 3, np.arange(BATCH), "train")
  panels = sraven.panels_from_record(CONSTANT_WIDE, batch["inputs"], batch["targets"])
  checked = moved = 0
  for problem in panels:  # [rows, columns, F]
    if any(len(set(row[0])) < 4 for row in problem):
      continue  # a repeated value hides the permutation
    checked += 1
    for column in (1, 2):
      # Where each slot of this column sits in column 0, read row by row.
      maps = {tuple(list(row[0]).index(v) for v in row[column]) for row in problem}
      assert len(maps) == 1, problem
      moved += maps != {(0, 1, 2, 3)}
  assert checked > 150 and moved > 100


def test_without_shuffle_slots_are_features():
  config = sraven.SRavenConfig(
    num_values=64, rules=("constant",), ood_fraction=0.0, shuffle_features=False
  )
  batch = sraven.generate_batch(config, 3, np.arange(BATCH), "train")
  np.testing.assert_array_equal(
    batch["feature_order"], np.broadcast_to(np.arange(4), (BATCH, 3, 4))
  )
  panels = sraven.panels_from_record(config, batch["inputs"], batch["targets"])
  np.testing.assert_array_equal(panels, np.broadcast_to(panels[:, :, :1], panels.shape))


# -- streams, determinism, sources ----------------------------------------------------------------


def test_streams_of_different_splits_and_seeds_are_disjoint(train_batch, ood_batch):
  def fingerprints(batch):
    return {
      (b["inputs"].tobytes(), b["targets"].tobytes())
      for b in ({k: v[i] for k, v in batch.items()} for i in range(BATCH))
    }

  streams = [train_batch, ood_batch]
  streams += [
    sraven.generate_batch(DEFAULT, 0, np.arange(BATCH), split) for split in ("validation", "test")
  ]
  streams.append(sraven.generate_batch(DEFAULT, 1, np.arange(BATCH), "train"))
  prints = [fingerprints(s) for s in streams]
  assert all(len(p) == BATCH for p in prints)
  for a, b in itertools.combinations(prints, 2):
    assert not a & b


def test_generation_is_deterministic_across_processes(tmp_path, ood_batch):
  out = tmp_path / "ood.npz"
  script = textwrap.dedent(f"""
      import numpy as np
      from primal_dual.data import sraven
      batch = sraven.generate_batch(sraven.SRavenConfig(), 0, np.arange({BATCH}), "ood")
      np.savez({str(out)!r}, **batch)
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT, env=env, timeout=120)
  other = np.load(out)
  assert set(other.files) == set(ood_batch)
  for name, value in ood_batch.items():
    assert other[name].tobytes() == value.tobytes(), name


def test_source_reads_match_batches_and_work_in_grain(train_batch):
  source = sraven.SRavenSource(DEFAULT, "train", seed=0, size=BATCH)
  assert len(source) == BATCH
  records = source._getitems(list(range(BATCH)))
  for i in (0, 17, BATCH - 1):
    for name, value in train_batch.items():
      np.testing.assert_array_equal(records[i][name], value[i])
  single = source[17]
  assert single["latent_id"].shape == () and single["inputs"].shape == (36, 8)
  for name, value in train_batch.items():
    np.testing.assert_array_equal(single[name], value[17])
  grain_record = grain.MapDataset.source(source)[17]
  np.testing.assert_array_equal(grain_record["inputs"], train_batch["inputs"][17])
  restored = pickle.loads(pickle.dumps(source))
  assert (restored.config, restored.split, restored.seed, len(restored)) == (
    DEFAULT,
    "train",
    0,
    BATCH,
  )
  with pytest.raises(IndexError):
    source[BATCH]


@pytest.mark.parametrize(
  "make",
  [
    lambda: sraven.SRavenConfig(rules=("constant", "spiral")),
    lambda: sraven.SRavenConfig(rules=("constant", "constant")),
    lambda: sraven.SRavenConfig(num_values=2),
    lambda: sraven.SRavenConfig(ood_fraction=1.0),
    lambda: sraven.SRavenConfig(num_features=0),
    lambda: sraven.SRavenSource(DEFAULT, "dev", 0, 10),
    lambda: sraven.SRavenSource(DEFAULT, "train", -1, 10),
    lambda: sraven.SRavenSource(DEFAULT, "train", 0, 0),
    lambda: sraven.SRavenSource(sraven.SRavenConfig(ood_fraction=0.0), "ood", 0, 10),
    lambda: sraven.generate_batch(DEFAULT, 0, np.zeros((2, 2), int)),
  ],
)
def test_user_errors_raise_value_error(make):
  with pytest.raises(ValueError):
    make()


# -- ambiguity and accuracy -----------------------------------------------------------------------


def _problems(config, feature_grids):
  """Batch dict from underlying feature grids int [B, F, 3, 3] placed in slot order."""
  panels = np.moveaxis(np.asarray(feature_grids), 1, -1).reshape(len(feature_grids), 9, -1)
  context = np.eye(config.num_values, dtype=np.float32)[panels[:, :-1]].reshape(
    len(panels), -1, config.num_values
  )
  queries = np.zeros((len(panels), config.num_features, config.num_values), np.float32)
  return {"inputs": np.concatenate([context, queries], axis=1), "targets": panels[:, -1]}


PROGRESSIONS = [  # each has exactly one answer under the 8 rules
  [[0, 1, 2], [5, 6, 7], [3, 4, 5]],
  [[2, 3, 4], [6, 7, 0], [1, 2, 3]],
  [[0, 2, 4], [3, 5, 7], [1, 3, 5]],
  [[1, 1, 1], [6, 6, 6], [4, 4, 4]],
]
ADD_OR_SUBTRACT = [[1, 4, 5], [2, 4, 6], [3, 1, 4]]  # addition gives 4, subtraction gives 2


def test_ambiguity_on_hand_made_problems_without_shuffle():
  clear = _problems(NO_SHUFFLE, [PROGRESSIONS])
  answers = sraven.consistent_answers(NO_SHUFFLE, clear)
  assert answers.sum() == 1
  assert answers[0, np.ravel_multi_index(clear["targets"][0], (8,) * 4)]
  ambiguous = _problems(NO_SHUFFLE, [[ADD_OR_SUBTRACT] + PROGRESSIONS[1:]])
  assert sraven.consistent_answers(NO_SHUFFLE, ambiguous).sum() == 2
  both = {k: np.concatenate([clear[k], ambiguous[k]]) for k in clear}
  np.testing.assert_array_equal(sraven.is_ambiguous(NO_SHUFFLE, both), [False, True])
  assert sraven.ambiguity_rate(NO_SHUFFLE, both) == 0.5


def test_ambiguity_on_hand_made_problems_with_shuffle():
  # Identical features make every column alignment equivalent.
  clear = _problems(DEFAULT, [[PROGRESSIONS[0]] * 4])
  assert sraven.consistent_answers(DEFAULT, clear).sum() == 1
  ambiguous = _problems(DEFAULT, [[ADD_OR_SUBTRACT] * 4])
  assert sraven.consistent_answers(DEFAULT, ambiguous).sum() == 2**4  # {2, 4} in every slot
  assert sraven.ambiguity_rate(DEFAULT, ambiguous) == 1.0


def test_true_answer_is_always_consistent(train_batch):
  subset = {k: v[:48] for k, v in train_batch.items()}
  answers = sraven.consistent_answers(DEFAULT, subset)
  truth = np.ravel_multi_index(subset["targets"].T, (8,) * 4)
  assert answers[np.arange(48), truth].all()
  assert 0.0 <= sraven.ambiguity_rate(DEFAULT, subset) < 1.0


def test_whole_panel_accuracy():
  targets = np.array([[1, 2, 3, 4], [0, 0, 7, 7], [5, 5, 5, 5], [6, 1, 6, 1]])
  logits = np.eye(8, dtype=np.float32)[targets] * 3.0
  assert sraven.whole_panel_accuracy(logits, targets) == 1.0
  logits[1, 2] = np.eye(8)[0]  # one wrong feature spoils the panel
  logits[3, 0] = np.eye(8)[2]
  assert sraven.whole_panel_accuracy(logits, targets) == 0.5
  with pytest.raises(ValueError):
    sraven.whole_panel_accuracy(logits[:, 0], targets)


def test_single_key_sampler_matches_documented_key_derivation(ood_batch):
  helpers.assert_sampler_follows_key_derivation(
    lambda key: sraven.sample_problem(key, DEFAULT, "ood"),
    sraven.SPLITS["ood"].stream_id,
    9,
    ood_batch,
  )
