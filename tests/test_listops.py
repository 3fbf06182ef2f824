"""Tests of the ListOps generator: values, lengths, depth, distribution, splits."""

import collections
import math
import statistics

import numpy as np
import pytest

from primal_dual.data import listops


def python_value(tokens):
  """Third evaluator: rewrites the expression as Python calls and runs it."""
  functions = {
    "MIN": lambda *a: min(a),
    "MAX": lambda *a: max(a),
    "MED": lambda *a: math.floor(statistics.median(a)),
    "SM": lambda *a: sum(a) % 10,
  }
  pieces = []
  for token in tokens:
    if token.startswith("["):
      pieces.append(f"{token[1:]}(")
    elif token == "]":
      pieces.append("),")
    else:
      pieces.append(f"{int(token)},")
  return eval("".join(pieces).rstrip(","), {"__builtins__": {}}, functions)


def nesting_depth(tokens):
  depth = deepest = 0
  for token in tokens:
    depth += token.startswith("[")
    depth -= token == "]"
    deepest = max(deepest, depth)
  return deepest


@pytest.fixture(scope="module")
def tiny_splits():
  return listops.generate_splits(seed=3, **listops.PRESETS["tiny"])


def test_vocabulary():
  assert listops.VOCAB[listops.PAD_ID] == "<pad>" and listops.PAD_ID == 0
  assert listops.VOCAB[listops.CLS_ID] == "<cls>"
  assert listops.VOCAB_SIZE == len(set(listops.VOCAB)) == 17
  for token in ["[MIN", "[MAX", "[MED", "[SM", "]", *map(str, range(10))]:
    assert token in listops.VOCAB


@pytest.mark.parametrize(
  "tokens, value",
  [
    ("[MED 1 2 3 4 ]", 2),  # even count: floor((2 + 3) / 2)
    ("[MED 1 9 ]", 5),
    ("[MED 0 9 ]", 4),
    ("[MED 3 1 2 ]", 2),
    ("[MED 7 7 0 9 ]", 7),
    ("[SM 5 7 9 ]", 1),
    ("[SM 0 0 ]", 0),
    ("[MIN 4 [MAX 1 8 ] 6 ]", 4),
    ("[MAX 2 [SM 5 7 ] [MIN 3 [MED 9 8 ] ] ]", 3),
    ("[MIN [MAX 9 9 ] [SM 4 5 ] ]", 9),
  ],
)
def test_evaluate_hand_made(tokens, value):
  tokens = tokens.split()
  assert listops.evaluate(tokens) == value
  assert python_value(tokens) == value


@pytest.mark.parametrize("tokens", ["[MIN 1 2", "[MIN ]", "[MIN 1 ] 3", "[FOO 1 2 ]", "]"])
def test_evaluate_rejects_malformed(tokens):
  with pytest.raises(ValueError):
    listops.evaluate(tokens.split())


def test_tokenize_roundtrip_and_unknown_token():
  tokens = "[SM 3 [MED 1 2 ] ]".split()
  ids = listops.tokenize(tokens)
  assert ids.dtype == np.int32 and ids.shape == (7,)
  assert listops.detokenize(ids) == tokens
  with pytest.raises(ValueError, match="Unknown ListOps token"):
    listops.tokenize(["[FOO"])


@pytest.mark.parametrize("min_length, max_length", [(4, 12), (30, 60), (200, 300)])
def test_generate_expression_value_and_length(min_length, max_length):
  rng = np.random.default_rng(min_length)
  for _ in range(5):
    tokens = listops.generate_expression(rng, min_length=min_length, max_length=max_length)
    assert min_length <= len(tokens) <= max_length
    assert tokens[0] in listops.OPERATORS and tokens[-1] == "]"
    assert listops.evaluate(tokens) == python_value(tokens)


def test_labels_are_true_values_and_lengths_in_range(tiny_splits):
  preset = listops.PRESETS["tiny"]
  for examples in tiny_splits.values():
    for ids, label in examples:
      tokens = listops.detokenize(ids)
      assert ids.dtype == np.int32
      assert preset["min_length"] <= len(tokens) <= preset["max_length"]
      assert label == python_value(tokens) == listops.evaluate(tokens)


def test_labels_of_long_expressions():
  splits = listops.generate_splits(
    seed=0, num_train=20, num_validation=5, num_test=5, min_length=500, max_length=2000
  )
  for examples in splits.values():
    for ids, label in examples:
      tokens = listops.detokenize(ids)
      assert 500 <= len(tokens) <= 2000
      assert label == python_value(tokens)


@pytest.mark.parametrize("max_depth, max_args", [(2, 3), (3, 2), (4, 5)])
def test_depth_and_arity_bounds(max_depth, max_args):
  rng = np.random.default_rng(0)
  depths = set()
  for _ in range(40):
    tokens = listops.generate_expression(
      rng, min_length=4, max_length=400, max_depth=max_depth, max_args=max_args
    )
    depths.add(nesting_depth(tokens))
    # Count each operator's arguments with a stack.
    stack = []
    for token in tokens:
      if stack and token != "]":
        stack[-1] += 1
      if token.startswith("["):
        stack.append(0)
      elif token == "]":
        assert 2 <= stack.pop() <= max_args
  # Brackets nest at most max_depth - 1 deep, and that depth is reached.
  assert max(depths) == max_depth - 1


def test_length_distribution_matches_the_branching_process():
  # max_depth=3, max_args=2: the root has two children, each a leaf (p = 0.75) or an
  # operator over two leaves; length = 4 + 3 * (#operator children).
  rng = np.random.default_rng(1)
  lengths = collections.Counter(
    len(listops.generate_expression(rng, min_length=4, max_length=10, max_depth=3, max_args=2))
    for _ in range(600)
  )
  total = sum(lengths.values())
  assert set(lengths) <= {4, 7, 10}
  for length, probability in [(4, 0.5625), (7, 0.375), (10, 0.0625)]:
    # 600 draws: standard error <= 0.02; 4 sigma keeps this deterministic test meaningful.
    assert abs(lengths[length] / total - probability) < 0.08


def test_conditioning_on_length_keeps_the_distribution():
  # Under max_depth=3, max_args=2 and lengths 7..7 exactly one child is an operator, each
  # side with probability 1/2.
  rng = np.random.default_rng(2)
  counts = collections.Counter()
  for _ in range(400):
    tokens = listops.generate_expression(rng, min_length=7, max_length=7, max_depth=3, max_args=2)
    counts[tokens[1].startswith("[")] += 1
  assert abs(counts[True] / 400 - 0.5) < 0.1


def test_same_seed_same_splits_different_seed_different(tiny_splits):
  again = listops.generate_splits(seed=3, **listops.PRESETS["tiny"])
  other = listops.generate_splits(seed=4, **listops.PRESETS["tiny"])
  for split in ("train", "validation", "test"):
    assert len(again[split]) == len(tiny_splits[split])
    for (ids_a, label_a), (ids_b, label_b) in zip(tiny_splits[split], again[split]):
      np.testing.assert_array_equal(ids_a, ids_b)
      assert label_a == label_b
  as_set = lambda split: {ids.tobytes() for ids, _ in split}
  assert as_set(other["train"]) != as_set(tiny_splits["train"])


def test_splits_are_disjoint_distinct_and_sized(tiny_splits):
  preset = listops.PRESETS["tiny"]
  sizes = {split: len(examples) for split, examples in tiny_splits.items()}
  assert sizes == dict(
    train=preset["num_train"], validation=preset["num_validation"], test=preset["num_test"]
  )
  keys = [ids.tobytes() for examples in tiny_splits.values() for ids, _ in examples]
  assert len(set(keys)) == len(keys)


def test_presets():
  assert listops.PRESETS["full"] == dict(
    min_length=500, max_length=2000, num_train=96000, num_validation=2000, num_test=2000
  )
  for preset in listops.PRESETS.values():
    assert preset["min_length"] <= preset["max_length"]


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(min_length=50, max_length=40),
    dict(min_length=2, max_length=40),
    dict(min_length=10, max_length=40, max_args=1),
    dict(min_length=10, max_length=40, max_depth=1),
    dict(min_length=100, max_length=200, max_depth=2, max_args=3),  # longest possible: 5
  ],
)
def test_bad_arguments_raise(kwargs):
  with pytest.raises(ValueError):
    listops.generate_expression(np.random.default_rng(0), **kwargs)


def test_too_few_distinct_expressions_raises():
  # Only 4 operators x 100 digit pairs = 400 distinct 4-token expressions exist.
  shortest = dict(min_length=4, max_length=4, max_depth=2, max_args=2)
  with pytest.raises(ValueError, match="distinct"):
    listops.generate_splits(seed=0, num_train=500, num_validation=0, num_test=0, **shortest)
