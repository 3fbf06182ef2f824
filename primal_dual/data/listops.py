"""ListOps (Long Range Arena): a seeded, vectorised generator of nested list expressions.

An expression is a tree. A leaf is a digit 0-9; an operator node is written
``[OP arg_1 ... arg_k ]`` with k in 2..max_args and OP one of

- ``MIN``, ``MAX``: the smallest / largest argument;
- ``MED``: the median rounded down. For an odd count it is the middle value of the
  sorted arguments; for an even count it is ``(a + b) // 2`` where a <= b are the two
  middle values (the floor of their mean). This equals LRA's ``int(np.median(args))``
  since all values are non-negative;
- ``SM``: the sum of the arguments modulo 10.

The label is the value of the whole expression (10 classes).

Tokens are LRA's: ``[MIN``, ``[MAX``, ``[MED``, ``[SM``, ``]`` and the ten digits (LRA's
parentheses are dropped, as LRA's own input pipeline does). The token count of an
expression is therefore ``#leaves + 2 * #operators``.

Distribution (the one of LRA's ``generate_tree``): the root is an operator; every other
node at depth ``d < max_depth`` (the root has depth 1) is a leaf with probability 0.75 and
otherwise an operator with a number of arguments drawn uniformly from 2..max_args; nodes at
depth ``max_depth`` are leaves. Hence the deepest bracket nesting is ``max_depth - 1``.
Operators and digits are uniform. An expression is kept when its token count lies in
``[min_length, max_length]`` (both inclusive); the kept expressions follow exactly the
conditional distribution of this process given the length.

How the sampler reaches long lengths quickly, without changing that distribution:

1. The tree *shape* does not depend on the operator kinds or digits, so shapes are sampled
   first and values only for the shapes that are kept.
2. Shapes are sampled breadth-first for a whole batch of candidate trees at once with NumPy
   (one vectorised draw per depth level instead of one Python call per node).
3. A candidate is dropped as soon as a lower bound on its final length (tokens of the
   levels already decided plus one token per node of the next level) exceeds
   ``max_length``. This is exact rejection, and it keeps memory bounded: branching is
   supercritical (mean 0.25 * 6 = 1.5 children per node), so unpruned trees can be huge.
4. Token positions (depth-first order), the token array and the value of every node are
   then computed level by level with array operations (cumulative sums, ``reduceat``,
   one ``lexsort`` for the medians).

With the default depth and arity about 33% of candidates land in 500-2000 tokens, 20% in
100-500 and 17% in 10-40 (the branching is supercritical, so long trees are not rare; the
cost of LRA's generator is its per-node Python recursion). The 'full' preset (100k
expressions) takes about 25 s and 0.6 GB on one CPU core, 'short' about 1 s.

``evaluate`` is an independent recursive evaluator over the token strings; the tests
check the generator's labels against it and against a third evaluator.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

PAD = "<pad>"
CLS = "<cls>"
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
DIGITS = tuple(str(d) for d in range(10))

VOCAB: list[str] = [PAD, CLS, *OPERATORS, END, *DIGITS]
VOCAB_SIZE = len(VOCAB)
TOKEN_TO_ID = {token: index for index, token in enumerate(VOCAB)}
PAD_ID = TOKEN_TO_ID[PAD]
CLS_ID = TOKEN_TO_ID[CLS]
END_ID = TOKEN_TO_ID[END]
FIRST_OPERATOR_ID = TOKEN_TO_ID[OPERATORS[0]]
FIRST_DIGIT_ID = TOKEN_TO_ID[DIGITS[0]]
NUM_CLASSES = 10

LEAF_PROBABILITY = 0.75

# Index of each operator in OPERATORS, used by the vectorised value computation.
_MIN, _MAX, _MED, _SM = range(4)

# Sizes chosen so that one dataset fits comfortably in memory:
# - 'full' is the LRA benchmark (96k/2k/2k, 500-2000 tokens; ~0.4 GB as int32 ids).
# - 'short' trains on a 2-core CPU in minutes with the small (d 64, 2 layers) model:
#   sequences of at most 500 tokens, 10k training examples = ~300 steps per epoch at
#   batch 32; 500 examples per evaluation split give accuracies to about +-2%.
# - 'tiny' is for tests and smoke runs: 200 short expressions, generated in milliseconds.
PRESETS: dict[str, dict[str, int]] = {
  "full": dict(
    min_length=500, max_length=2000, num_train=96000, num_validation=2000, num_test=2000
  ),
  "short": dict(min_length=100, max_length=500, num_train=10000, num_validation=500, num_test=500),
  "tiny": dict(min_length=10, max_length=40, num_train=160, num_validation=20, num_test=20),
}

_SPLITS = ("train", "validation", "test")


# --------------------------------------------------------------------------- tokens


def tokenize(tokens: Sequence[str]) -> np.ndarray:
  """Maps token strings to ids.

  Args:
    tokens: token strings from ``VOCAB`` (no CLS or padding is added).

  Returns:
    int32 ``[len(tokens)]`` ids, index into ``VOCAB``.
  """
  try:
    return np.asarray([TOKEN_TO_ID[token] for token in tokens], dtype=np.int32)
  except KeyError as error:
    raise ValueError(
      f"Unknown ListOps token {error.args[0]!r}; the vocabulary is {VOCAB}."
    ) from None


def detokenize(ids: np.ndarray) -> list[str]:
  """Inverse of ``tokenize`` for an int ``[T]`` array (PAD and CLS ids are dropped)."""
  return [VOCAB[i] for i in np.asarray(ids).tolist() if i not in (PAD_ID, CLS_ID)]


def _median_rounded_down(values: list[int]) -> int:
  """Middle value, or the floor of the mean of the two middle values for an even count."""
  ordered = sorted(values)
  return (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) // 2


def evaluate(tokens: Sequence[str]) -> int:
  """Value of an expression, by direct recursion over its token strings.

  Independent from the generator's vectorised value computation, so it can check it.

  Args:
    tokens: a complete expression, e.g. ``['[MAX', '2', '[SM', '5', '7', ']', ']']``.

  Returns:
    The value, an int in 0..9.
  """
  reducers = {
    "[MIN": min,
    "[MAX": max,
    "[MED": _median_rounded_down,
    "[SM": lambda args: sum(args) % 10,
  }

  def parse(position: int) -> tuple[int, int]:
    """Returns (value, position after) for the sub-expression starting at `position`."""
    if position >= len(tokens):
      raise ValueError("Truncated ListOps expression.")
    token = tokens[position]
    if token in DIGITS:
      return int(token), position + 1
    if token not in reducers:
      raise ValueError(f"Unexpected ListOps token {token!r} at position {position}.")
    args = []
    position += 1
    while position < len(tokens) and tokens[position] != END:
      value, position = parse(position)
      args.append(value)
    if position >= len(tokens) or not args:
      raise ValueError(f"Malformed ListOps expression at operator {token!r}.")
    return reducers[token](args), position + 1

  value, end = parse(0)
  if end != len(tokens):
    raise ValueError(f"Trailing tokens after a complete ListOps expression at position {end}.")
  return value


# --------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class _Level:
  """The nodes of one depth level of a batch of trees (breadth-first, grouped by parent).

  Attributes:
    tree: int64 ``[n]`` candidate index of each node's tree.
    parent: int64 ``[n]`` index of the parent in the previous level (-1 for roots).
    num_children: int64 ``[n]`` argument count (0 for leaves).
  """

  tree: np.ndarray
  parent: np.ndarray
  num_children: np.ndarray


class _Limits(NamedTuple):
  """What an expression may be: its inclusive token-count range, node depth and operator arity."""

  min_length: int
  max_length: int
  max_depth: int
  max_args: int


def _sample_shapes(
  rng: np.random.Generator, num_candidates: int, limits: _Limits
) -> tuple[list[_Level], np.ndarray]:
  """Samples tree shapes breadth-first and keeps those whose length is in range.

  Returns:
    (levels, lengths): the kept trees' levels, renumbered so that tree ids are 0..m-1 in
    candidate order, and int64 ``[m]`` token counts.
  """
  min_length, max_length, max_depth, max_args = limits
  tree = np.arange(num_candidates)
  parent = np.full(num_candidates, -1)
  alive = np.ones(num_candidates, dtype=bool)
  tokens_so_far = np.zeros(num_candidates, dtype=np.int64)
  levels = []
  for depth in range(1, max_depth + 1):
    if depth == 1:
      is_operator = np.ones(tree.size, dtype=bool)
    elif depth < max_depth:
      is_operator = rng.random(tree.size) >= LEAF_PROBABILITY
    else:
      is_operator = np.zeros(tree.size, dtype=bool)
    num_children = np.where(is_operator, rng.integers(2, max_args + 1, size=tree.size), 0)
    # Leaves add 1 token, operators 2 (the operator and its ']'); every child adds >= 1.
    tokens_so_far += np.bincount(tree, weights=1 + is_operator, minlength=num_candidates).astype(
      np.int64
    )
    lower_bound = tokens_so_far + np.bincount(
      tree, weights=num_children, minlength=num_candidates
    ).astype(np.int64)
    alive &= lower_bound <= max_length
    # Dropping a dead tree's children keeps the work proportional to max_length.
    num_children = np.where(alive[tree], num_children, 0)
    levels.append(_Level(tree=tree, parent=parent, num_children=num_children))
    if not num_children.any():
      break
    parent = np.repeat(np.arange(tree.size), num_children)
    tree = tree[parent]

  kept = alive & (tokens_so_far >= min_length)
  return _renumber(levels, kept), tokens_so_far[kept]


def _renumber(levels: list[_Level], kept_trees: np.ndarray) -> list[_Level]:
  """Restricts every level to the nodes of kept trees and remaps tree and parent indices."""
  new_tree_id = np.cumsum(kept_trees) - 1
  result = []
  previous_new_index = None
  for level in levels:
    keep = kept_trees[level.tree]
    if not keep.any():
      break
    parent = level.parent[keep]
    if previous_new_index is not None:
      parent = previous_new_index[parent]
    result.append(
      _Level(
        tree=new_tree_id[level.tree[keep]], parent=parent, num_children=level.num_children[keep]
      )
    )
    previous_new_index = np.cumsum(keep) - 1
  return result


# --------------------------------------------------------------------------- tokens and values


def _group_starts(num_children: np.ndarray) -> np.ndarray:
  """Index of each operator's first child in the next level (children are grouped by parent)."""
  operators = num_children > 0
  return (np.cumsum(num_children) - num_children)[operators]


def _fill_tokens_and_values(
  rng: np.random.Generator, levels: list[_Level], lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Draws operators and digits for kept shapes and lays the trees out as tokens.

  Returns:
    (buffer, offsets, labels): int32 ``[sum(lengths)]`` token ids of all trees one after
    the other, int64 ``[m + 1]`` tree boundaries in `buffer`, int32 ``[m]`` root values.
  """
  # Values are independent of the shape, so drawing them now leaves the distribution intact.
  kinds = [rng.integers(0, len(OPERATORS), size=level.tree.size) for level in levels]
  digits = [rng.integers(0, 10, size=level.tree.size) for level in levels]

  # Subtree token counts and node values, bottom-up.
  sizes = [None] * len(levels)
  values = [None] * len(levels)
  for d in reversed(range(len(levels))):
    level = levels[d]
    is_operator = level.num_children > 0
    sizes[d] = np.where(is_operator, 2, 1).astype(np.int64)
    values[d] = digits[d].copy()
    if is_operator.any():
      children = levels[d + 1]
      sizes[d] += np.bincount(
        children.parent, weights=sizes[d + 1], minlength=level.tree.size
      ).astype(np.int64)
      values[d][is_operator] = _reduce_children(
        values[d + 1], children.parent, _group_starts(level.num_children), kinds[d][is_operator]
      )

  # Depth-first start position of every node, top-down.
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  starts = [offsets[:-1].copy()]
  for d in range(1, len(levels)):
    children = levels[d]
    exclusive = np.cumsum(sizes[d]) - sizes[d]
    first_sibling = np.repeat(
      _group_starts(levels[d - 1].num_children),
      levels[d - 1].num_children[levels[d - 1].num_children > 0],
    )
    starts.append(starts[d - 1][children.parent] + 1 + exclusive - exclusive[first_sibling])

  buffer = np.full(int(offsets[-1]), PAD_ID, dtype=np.int32)
  for d, level in enumerate(levels):
    is_operator = level.num_children > 0
    buffer[starts[d]] = np.where(
      is_operator, FIRST_OPERATOR_ID + kinds[d], FIRST_DIGIT_ID + digits[d]
    )
    buffer[(starts[d] + sizes[d] - 1)[is_operator]] = END_ID
  return buffer, offsets, values[0].astype(np.int32)


def _reduce_children(
  child_values: np.ndarray, child_parent: np.ndarray, group_starts: np.ndarray, kinds: np.ndarray
) -> np.ndarray:
  """Applies each operator to its (contiguous, >= 2) children.

  Args:
    child_values: int ``[n_children]`` values, grouped by parent in parent order.
    child_parent: int ``[n_children]`` parent index (non-decreasing).
    group_starts: int ``[n_operators]`` first child of each operator.
    kinds: int ``[n_operators]`` operator index into ``OPERATORS``.

  Returns:
    int ``[n_operators]`` values.
  """
  counts = np.diff(np.append(group_starts, child_values.size))
  minimum = np.minimum.reduceat(child_values, group_starts)
  maximum = np.maximum.reduceat(child_values, group_starts)
  sum_mod = np.add.reduceat(child_values, group_starts) % 10
  # Sorting by (parent, value) sorts every group in place; groups keep their positions.
  sorted_values = child_values[np.lexsort((child_values, child_parent))]
  median = (
    sorted_values[group_starts + (counts - 1) // 2] + sorted_values[group_starts + counts // 2]
  ) // 2
  return np.choose(kinds, [minimum, maximum, median, sum_mod])


# --------------------------------------------------------------------------- public generator


def _validated_limits(min_length: int, max_length: int, max_depth: int, max_args: int) -> _Limits:
  if max_args < 2:
    raise ValueError(
      f"max_args must be >= 2 (an operator has 2..max_args arguments), got {max_args}."
    )
  if max_depth < 2:
    raise ValueError(
      f"max_depth must be >= 2 (the root is an operator over leaves), got {max_depth}."
    )
  if not 4 <= min_length <= max_length:
    raise ValueError(
      f"Need 4 <= min_length <= max_length (the shortest expression, '[SM 1 2 ]', "
      f"has 4 tokens), got min_length={min_length}, max_length={max_length}."
    )
  # The longest expression is the full max_args-ary tree.
  longest = sum(max_args**k for k in range(max_depth)) + sum(
    max_args**k for k in range(max_depth - 1)
  )
  if min_length > longest:
    raise ValueError(
      f"min_length={min_length} exceeds the longest possible expression ({longest} tokens) "
      f"for max_depth={max_depth}, max_args={max_args}."
    )
  return _Limits(min_length, max_length, max_depth, max_args)


def _candidates_per_round(max_length: int) -> int:
  # Pruning bounds each surviving candidate by max_length tokens; ~4M nodes per round at most.
  return int(np.clip(4_000_000 // max_length, 64, 4096))


def _generate_batch(
  rng: np.random.Generator, num_candidates: int, limits: _Limits
) -> tuple[list[np.ndarray], np.ndarray]:
  """One round of candidates: returns the kept token-id arrays and their labels (maybe none)."""
  levels, lengths = _sample_shapes(rng, num_candidates, limits)
  if lengths.size == 0:
    return [], np.zeros(0, dtype=np.int32)
  buffer, offsets, labels = _fill_tokens_and_values(rng, levels, lengths)
  return np.split(buffer, offsets[1:-1]), labels


# Give up after this many rounds with nothing kept (generate_expression) or nothing new
# (generate_splits): the requested lengths are (almost) unreachable or exhausted.
_MAX_EMPTY_ROUNDS = 200
_MAX_ROUNDS_WITHOUT_NEW = 25


def generate_expression(
  rng: np.random.Generator,
  *,
  min_length: int,
  max_length: int,
  max_depth: int = 10,
  max_args: int = 10,
) -> list[str]:
  """Samples one expression whose token count lies in ``[min_length, max_length]``.

  Args:
    rng: NumPy generator (advanced in place).
    min_length: fewest tokens, inclusive.
    max_length: most tokens, inclusive.
    max_depth: node depth limit (root = 1); brackets nest at most ``max_depth - 1`` deep.
    max_args: most arguments of an operator (at least 2).

  Returns:
    The expression's token strings, e.g. ``['[MAX', '2', '9', ']']``.
  """
  limits = _validated_limits(min_length, max_length, max_depth, max_args)
  # Few candidates first (one expression is wanted), more while none is kept.
  num_candidates = 16
  for _ in range(_MAX_EMPTY_ROUNDS):
    expressions, _ = _generate_batch(rng, num_candidates, limits)
    if expressions:
      return detokenize(expressions[0])
    num_candidates = min(2 * num_candidates, _candidates_per_round(max_length))
  raise ValueError(
    f"Lengths [{min_length}, {max_length}] are (almost) never reached with "
    f"max_depth={max_depth}, max_args={max_args}; widen the range."
  )


def generate_splits(
  *,
  seed: int,
  num_train: int,
  num_validation: int,
  num_test: int,
  min_length: int,
  max_length: int,
  max_depth: int = 10,
  max_args: int = 10,
) -> dict[str, list[tuple[np.ndarray, int]]]:
  """Generates disjoint train / validation / test sets of distinct expressions.

  Expressions are generated from ``seed`` until ``num_train + num_validation + num_test``
  distinct ones exist (the first occurrence wins), sorted by their token ids (so the result
  does not depend on generation order), then split with a permutation seeded by ``seed``.

  Args:
    seed: integer seed; the same seed gives identical splits.
    num_train, num_validation, num_test: split sizes.
    min_length, max_length: inclusive token-count range.
    max_depth, max_args: see ``generate_expression``.

  Returns:
    ``{'train' | 'validation' | 'test': [(ids, label), ...]}`` with ids int32 ``[T]``
    (no CLS, no padding) and label an int in 0..9.
  """
  limits = _validated_limits(min_length, max_length, max_depth, max_args)
  sizes = dict(train=num_train, validation=num_validation, test=num_test)
  if any(size < 0 for size in sizes.values()):
    raise ValueError(f"Split sizes must be >= 0, got {sizes}.")
  total = sum(sizes.values())
  generation_seed, split_seed = np.random.SeedSequence(seed).spawn(2)
  rng = np.random.default_rng(generation_seed)

  # Ids are < 256, so their uint8 bytes identify an expression compactly.
  unique: dict[bytes, tuple[np.ndarray, int]] = {}
  rounds_without_new = 0
  while len(unique) < total:
    expressions, labels = _generate_batch(rng, _candidates_per_round(max_length), limits)
    before = len(unique)
    for ids, label in zip(expressions, labels.tolist()):
      unique.setdefault(ids.astype(np.uint8).tobytes(), (ids, label))
      if len(unique) == total:
        break
    rounds_without_new = 0 if len(unique) > before else rounds_without_new + 1
    if rounds_without_new >= _MAX_ROUNDS_WITHOUT_NEW:
      raise ValueError(
        f"Found only {len(unique)} distinct expressions of {min_length}-{max_length} "
        f"tokens, {total} requested; widen the length range or ask for fewer."
      )

  ordered = [unique[key] for key in sorted(unique)]
  permutation = np.random.default_rng(split_seed).permutation(total)
  splits, start = {}, 0
  for name in _SPLITS:
    splits[name] = [ordered[i] for i in permutation[start : start + sizes[name]]]
    start += sizes[name]
  return splits
