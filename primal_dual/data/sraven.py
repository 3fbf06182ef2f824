"""Symbolic Raven (sRAVEN) problems as a random-access, JAX-generated data source (docs/maths.md §4).

A problem is a 3 × 3 grid of panels; each panel has ``F`` integer features in ``[0, V)``. Every
feature follows one rule along each row of the grid (rows drawn independently):

| rule name | one row `[c1, c2, c3]` |
|---|---|
| ``constant`` | ``[a, a, a]`` |
| ``progression_{plus,minus}_{1,2}`` | ``[s, s+k, s+2k] mod V``, random ``s``, ``k = ±1, ±2`` |
| ``addition`` | ``[a, b, (a + b) mod V]`` |
| ``subtraction`` | ``[a, b, (a − b) mod V]`` |
| ``distribute_three`` | a permutation of three distinct values that all three rows share |

For ``distribute_three`` the three values are drawn once per grid and each row is an independent
random permutation of them (rows may repeat an ordering), as in the reference generator of
Schug et al. (HYLA).

**Latents.** A problem's latent is a multiset of ``F`` rules
(``itertools.combinations_with_replacement`` of the rule ids, in that order; 330 for 4 features and
8 rules). ``floor(ood_fraction × L)`` of the ``L`` latents (82 of 330 by default:
``0.25 × 330 = 82.5`` rounds *down*) are held out for the OOD split, chosen by a NumPy permutation
seeded with ``split_seed``. Which feature carries which rule of the multiset is a uniform random
assignment per problem.

**Shuffle.** With ``shuffle_features`` the feature slots of each grid column are permuted, one
permutation per column shared by the three panels of that column, so a solver must also find which
slots correspond across columns.

**Tokens.** One token per (panel, slot) for the first 8 panels, panel-major
(panel = row · 3 + column), each a one-hot vector of size ``V``; then ``F`` all-zero query tokens:
``inputs float32 [9F, V]``. The answer ``targets int32 [F]`` is the 9th panel in its own slot order.

**Streams.** Record ``i`` of split ``s`` is a pure function of ``(config, seed, s, i)``: its key is
``fold_in(fold_in(key(seed), stream_id[s]), i)``. Every split has its own stream id, so no index of
one split reproduces another split's problem; ``train`` and ``validation`` and ``test`` draw
in-distribution latents, ``ood`` draws held-out latents. Each record also carries ``rules`` (rule id
per answer slot), ``latent_id`` and ``feature_order`` for latent-code analysis and tests.

**Metrics.** ``whole_panel_accuracy`` (exact match of all ``F`` answer features) and
``ambiguity_rate`` (share of problems with more than one consistent answer, by brute force).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from primal_dual.data import generated
from primal_dual.data import sources

GRID_SIZE = 3  # rows and columns of a problem grid
NUM_PANELS = GRID_SIZE * GRID_SIZE
# The ambiguity checker enumerates (F!)^2 column alignments; beyond this it is too slow to use.
_MAX_FEATURES_FOR_SHUFFLED_AMBIGUITY = 5

# ----------------------------------------------------------------------------------------------
# Row builders: deterministic, one row of one feature. Values are int32 scalars (may be traced).
# ----------------------------------------------------------------------------------------------


def constant_row(value: jax.Array) -> jax.Array:
  """``[a, a, a]`` from a scalar ``a``. Returns int32 ``[3]``."""
  return jnp.full((GRID_SIZE,), value, dtype=jnp.int32)


def progression_row(start: jax.Array, step: int, num_values: int) -> jax.Array:
  """``[s, s + k, s + 2k] mod V``. Returns int32 ``[3]`` in ``[0, V)``."""
  return ((start + step * jnp.arange(GRID_SIZE)) % num_values).astype(jnp.int32)


def addition_row(a: jax.Array, b: jax.Array, num_values: int) -> jax.Array:
  """``[a, b, (a + b) mod V]``. Returns int32 ``[3]``."""
  return jnp.stack([a, b, (a + b) % num_values]).astype(jnp.int32)


def subtraction_row(a: jax.Array, b: jax.Array, num_values: int) -> jax.Array:
  """``[a, b, (a − b) mod V]`` (Python modulo: always in ``[0, V)``). Returns int32 ``[3]``."""
  return jnp.stack([a, b, (a - b) % num_values]).astype(jnp.int32)


def distribute_three_row(values: jax.Array, order: jax.Array) -> jax.Array:
  """``values[order]``: the row's permutation of the grid's three values. Returns int32 ``[3]``."""
  return jnp.asarray(values, jnp.int32)[order]


# ----------------------------------------------------------------------------------------------
# Rules: pre-drawn uniform integers -> int32 [3 rows, 3 columns], one feature of one grid.
# All randomness of a problem is one flat ``jax.random.bits`` call, mapped to ranges by
# ``uniform_below``; rules only do arithmetic on it. Random calls inside the eight switch branches,
# ``randint`` and multi-dimensional draws each made the vmapped generator several times slower to
# compile, and compile time dominates on CPU.
# ----------------------------------------------------------------------------------------------

# The 3! orderings of a row, indexed by a uniform draw in [0, 6).
_ORDERS_OF_THREE = np.array(list(itertools.permutations(range(GRID_SIZE))), np.int32)


class RuleDraws(NamedTuple):
  """Uniform integers one feature's rule may use (all int32).

  Attributes:
    operands: ``[3, 2]`` in ``[0, V)``: per row a start / value ``a`` and a second operand ``b``.
    distinct: ``[3]`` in ``[0, V)``, ``[0, V − 1)``, ``[0, V − 2)``: three distinct values after
      ``distinct_values``.
    row_orders: ``[3]`` in ``[0, 6)``: the ordering of each row (``distribute_three``).
  """

  operands: jax.Array
  distinct: jax.Array
  row_orders: jax.Array


WORDS_PER_RULE = 2 * GRID_SIZE + GRID_SIZE + GRID_SIZE  # operands, distinct, row_orders


def rule_draws(words: jax.Array, num_values: int) -> RuleDraws:
  """``RuleDraws`` from uniform uint32 words ``[..., WORDS_PER_RULE]`` (leading axes kept)."""
  bounds = np.array(
    [num_values] * 2 * GRID_SIZE
    + [num_values, max(num_values - 1, 1), max(num_values - 2, 1)]
    + [len(_ORDERS_OF_THREE)] * GRID_SIZE,
    np.uint32,
  )
  draws = generated.uniform_below(words, bounds)
  split = 2 * GRID_SIZE
  return RuleDraws(
    operands=draws[..., :split].reshape(draws.shape[:-1] + (GRID_SIZE, 2)),
    distinct=draws[..., split : split + GRID_SIZE],
    row_orders=draws[..., split + GRID_SIZE :],
  )


def distinct_values(draws: jax.Array) -> jax.Array:
  """Three distinct values, uniform over ordered triples, from draws in ``[0,V)×[0,V−1)×[0,V−2)``.

  Each draw after the first skips the values already taken (the usual rank-to-value map).
  Returns int32 ``[3]``.
  """
  first = draws[0]
  second = draws[1] + (draws[1] >= first)
  low, high = jnp.minimum(first, second), jnp.maximum(first, second)
  third = draws[2] + (draws[2] >= low)
  third = third + (third >= high)
  return jnp.stack([first, second, third]).astype(jnp.int32)


def _rule_constant(draws: RuleDraws, num_values: int) -> jax.Array:
  del num_values
  return jax.vmap(constant_row)(draws.operands[:, 0])


def _rule_progression(draws: RuleDraws, num_values: int, *, step: int) -> jax.Array:
  return jax.vmap(progression_row, in_axes=(0, None, None))(draws.operands[:, 0], step, num_values)


def _rule_addition(draws: RuleDraws, num_values: int) -> jax.Array:
  return jax.vmap(addition_row, in_axes=(0, 0, None))(
    draws.operands[:, 0], draws.operands[:, 1], num_values
  )


def _rule_subtraction(draws: RuleDraws, num_values: int) -> jax.Array:
  return jax.vmap(subtraction_row, in_axes=(0, 0, None))(
    draws.operands[:, 0], draws.operands[:, 1], num_values
  )


def _rule_distribute_three(draws: RuleDraws, num_values: int) -> jax.Array:
  del num_values
  orders = jnp.asarray(_ORDERS_OF_THREE)[draws.row_orders]  # independent ordering per row
  return jax.vmap(distribute_three_row, in_axes=(None, 0))(distinct_values(draws.distinct), orders)


Rule = Callable[[RuleDraws, int], jax.Array]

PROGRESSION_STEPS = {
  "progression_plus_1": 1,
  "progression_plus_2": 2,
  "progression_minus_1": -1,
  "progression_minus_2": -2,
}


def _rule_table(constant, progression, addition, subtraction, distribute_three) -> dict:
  """Rule name → the function of its family (``progression`` takes its ``step`` by keyword), in
  rule-id order; the one list of rule names, shared by ``RULES`` and ``RULE_CHECKS``."""
  return {
    "constant": constant,
    **{name: functools.partial(progression, step=step) for name, step in PROGRESSION_STEPS.items()},
    "addition": addition,
    "subtraction": subtraction,
    "distribute_three": distribute_three,
  }


RULES: dict[str, Rule] = _rule_table(
  _rule_constant, _rule_progression, _rule_addition, _rule_subtraction, _rule_distribute_three
)
DEFAULT_RULES: tuple[str, ...] = tuple(RULES)

# ----------------------------------------------------------------------------------------------
# Rule checks (NumPy, written independently of the samplers): grids [..., 3, 3] -> bool [...].
# ----------------------------------------------------------------------------------------------


def _holds_constant(grid: np.ndarray, num_values: int) -> np.ndarray:
  del num_values
  return np.all(grid == grid[..., :1], axis=(-2, -1))


def _holds_progression(grid: np.ndarray, num_values: int, *, step: int) -> np.ndarray:
  return np.all((np.diff(grid, axis=-1) - step) % num_values == 0, axis=(-2, -1))


def _holds_addition(grid: np.ndarray, num_values: int) -> np.ndarray:
  return np.all((grid[..., 0] + grid[..., 1] - grid[..., 2]) % num_values == 0, axis=-1)


def _holds_subtraction(grid: np.ndarray, num_values: int) -> np.ndarray:
  return np.all((grid[..., 0] - grid[..., 1] - grid[..., 2]) % num_values == 0, axis=-1)


def _holds_distribute_three(grid: np.ndarray, num_values: int) -> np.ndarray:
  del num_values
  rows = np.sort(grid, axis=-1)
  distinct = np.all(rows[..., 1:] != rows[..., :-1], axis=(-2, -1))
  same_values = np.all(rows == rows[..., :1, :], axis=(-2, -1))
  return distinct & same_values


RULE_CHECKS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = _rule_table(
  _holds_constant, _holds_progression, _holds_addition, _holds_subtraction, _holds_distribute_three
)


def grid_satisfies(rule: str, grid: np.ndarray, num_values: int) -> np.ndarray:
  """Whether every row of a feature grid follows ``rule``.

  Args:
    rule: a name in ``RULE_CHECKS``.
    grid: int ``[..., 3 rows, 3 columns]``, one feature's values.
    num_values: ``V``, the modulus of the arithmetic rules.

  Returns:
    bool ``[...]``.
  """
  if rule not in RULE_CHECKS:
    raise ValueError(f"Unknown sRAVEN rule {rule!r}; choose from {sorted(RULE_CHECKS)}.")
  grid = np.asarray(grid)
  if grid.shape[-2:] != (GRID_SIZE, GRID_SIZE):
    raise ValueError(f"grid must have shape [..., 3, 3], got {grid.shape}.")
  return RULE_CHECKS[rule](grid.astype(np.int64), num_values)


# ----------------------------------------------------------------------------------------------
# Configuration and latents.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SRavenConfig:
  """What problems look like and which latents are held out.

  Attributes:
    num_features: ``F``, features per panel (4 in the reference).
    num_values: ``V``, values per feature (8 in the reference); also the one-hot token size.
    rules: rule names (keys of ``RULES``); a rule's id is its position here.
    shuffle_features: permute the feature slots per grid column.
    ood_fraction: share of latents held out for the ``ood`` split, rounded down.
    split_seed: seeds the choice of held-out latents (≥ 0; a config's ``SPLIT_SEED_OF_RUN`` is
      resolved to the run's seed by the task before it gets here).
  """

  num_features: int = 4
  num_values: int = 8
  rules: tuple[str, ...] = DEFAULT_RULES
  shuffle_features: bool = True
  ood_fraction: float = 0.25
  split_seed: int = 0

  def __post_init__(self):
    # ConfigDicts hand over lists; a tuple keeps the config hashable (it keys the jit cache).
    object.__setattr__(self, "rules", tuple(self.rules))
    if self.num_features < 1:
      raise ValueError(f"num_features must be >= 1, got {self.num_features}.")
    if not self.rules:
      raise ValueError("rules must name at least one rule.")
    unknown = [r for r in self.rules if r not in RULES]
    if unknown:
      raise ValueError(f"Unknown sRAVEN rules {unknown}; choose from {list(RULES)}.")
    if len(set(self.rules)) != len(self.rules):
      raise ValueError(f"rules must not repeat a name, got {self.rules}.")
    min_values = GRID_SIZE if "distribute_three" in self.rules else 2
    if self.num_values < min_values:
      raise ValueError(
        f"num_values must be >= {min_values} for rules {self.rules}, got {self.num_values}."
      )
    if not 0.0 <= self.ood_fraction < 1.0:
      raise ValueError(f"ood_fraction must be in [0, 1), got {self.ood_fraction}.")
    if self.split_seed < 0:
      raise ValueError(f"split_seed must be >= 0, got {self.split_seed}.")

  @property
  def num_rules(self) -> int:
    return len(self.rules)

  @property
  def num_tokens(self) -> int:
    """Sequence length: 8 context panels and one query panel, ``F`` tokens each."""
    return NUM_PANELS * self.num_features


class _Split(NamedTuple):
  stream_id: int  # distinct per split, so splits never share a random stream
  held_out: bool  # draws held-out (OOD) latents instead of in-distribution ones


SPLITS: dict[str, _Split] = {
  "train": _Split(stream_id=0, held_out=False),
  "validation": _Split(stream_id=1, held_out=False),
  "test": _Split(stream_id=2, held_out=False),
  "ood": _Split(stream_id=3, held_out=True),
}


@functools.lru_cache(maxsize=None)
def latent_table(config: SRavenConfig) -> np.ndarray:
  """All latents: int32 ``[L, F]`` rule ids, ``combinations_with_replacement`` order."""
  combos = itertools.combinations_with_replacement(range(config.num_rules), config.num_features)
  return generated.read_only(
    np.array(list(combos), dtype=np.int32).reshape(-1, config.num_features)
  )


def num_heldout_latents(config: SRavenConfig) -> int:
  """``floor(ood_fraction × L)`` (the epsilon keeps e.g. 0.29 × 100 from flooring to 28)."""
  return int(math.floor(config.ood_fraction * len(latent_table(config)) + 1e-9))


@functools.lru_cache(maxsize=None)
def _latent_ids_by_heldout(config: SRavenConfig) -> tuple[np.ndarray, np.ndarray]:
  num_latents = len(latent_table(config))
  order = np.random.default_rng(config.split_seed).permutation(num_latents)
  num_heldout = num_heldout_latents(config)
  heldout = np.sort(order[:num_heldout]).astype(np.int32)
  in_distribution = np.sort(order[num_heldout:]).astype(np.int32)
  return generated.read_only(in_distribution), generated.read_only(heldout)


def heldout_latent_ids(config: SRavenConfig) -> np.ndarray:
  """Sorted int32 ids (rows of ``latent_table``) of the latents reserved for the ``ood`` split."""
  return _latent_ids_by_heldout(config)[1]


def split_latent_ids(config: SRavenConfig, split: str) -> np.ndarray:
  """Sorted int32 ids of the latents a split draws from (uniformly)."""
  in_distribution, heldout = _latent_ids_by_heldout(config)
  return heldout if STREAMS.split(split).held_out else in_distribution


# ----------------------------------------------------------------------------------------------
# Generation (JAX).
# ----------------------------------------------------------------------------------------------


def _sample_problem(
  key: jax.Array, config: SRavenConfig, latent_pool: jax.Array, pool_size: jax.Array
) -> dict[str, jax.Array]:
  """One problem from the first ``pool_size`` latent ids of ``latent_pool`` (int32 ``[L]``).

  Permutations are argsorts of 32-bit random words (one sort, no rejection rounds); ties, and so a
  bias, have probability below ``F² / 2³²``.
  """
  num_features, num_values = config.num_features, config.num_values
  # One flat draw (see the note above the rules): [latent | 4 orderings | rule inputs].
  num_order_words = (1 + GRID_SIZE) * num_features
  words = jax.random.bits(key, (1 + num_order_words + num_features * WORDS_PER_RULE,))
  latent_words, order_words, rule_words = jnp.split(words, [1, 1 + num_order_words])

  latent_id = latent_pool[generated.uniform_below(latent_words[0], pool_size)]
  multiset = jnp.asarray(latent_table(config))[latent_id]
  # Row 0: which feature gets which rule of the multiset; rows 1-3: slot order of each column.
  orders = jnp.argsort(order_words.reshape(1 + GRID_SIZE, num_features), axis=-1)
  feature_rules = multiset[orders[0]]

  rules = [functools.partial(RULES[name], num_values=num_values) for name in config.rules]
  draws = rule_draws(rule_words.reshape(num_features, WORDS_PER_RULE), num_values)
  grids = jax.vmap(lambda rule, d: jax.lax.switch(rule, rules, d))(feature_rules, draws)
  panels = jnp.transpose(grids, (1, 2, 0))  # [rows, columns, F]

  if config.shuffle_features:
    feature_order = orders[1:]
  else:
    feature_order = jnp.broadcast_to(jnp.arange(num_features), (GRID_SIZE, num_features))
  # Slot s of every panel in column c shows underlying feature feature_order[c, s].
  panels = panels[:, jnp.arange(GRID_SIZE)[:, None], feature_order]

  flat = panels.reshape(NUM_PANELS, num_features)
  context = jax.nn.one_hot(flat[:-1].reshape(-1), num_values, dtype=jnp.float32)
  queries = jnp.zeros((num_features, num_values), jnp.float32)
  return {
    "inputs": jnp.concatenate([context, queries], axis=0),
    "targets": flat[-1].astype(jnp.int32),
    "rules": feature_rules[feature_order[-1]].astype(jnp.int32),
    "latent_id": latent_id.astype(jnp.int32),
    "feature_order": feature_order.astype(jnp.int32),
  }


def _empty_split_message(config: SRavenConfig, split: str) -> str:
  return (
    f"Split {split!r} has no latents: raise ood_fraction "
    f"(now {config.ood_fraction}) or use fewer features/more rules."
  )


STREAMS = generated.GeneratedTask(
  title="sRAVEN",
  splits=SPLITS,
  sample=_sample_problem,
  split_ids=split_latent_ids,
  table_size=lambda config: len(latent_table(config)),
  empty_split_message=_empty_split_message,
)


# The streams (generated.GeneratedTask): ``sample_problem(key, config, split="train")``, one
# problem from a JAX key (traceable); ``split_stream(config, split)``, a traceable
# ``(seed, indices) -> batch`` for batches made inside a jitted step; and
# ``generate_batch(config, seed, indices, split="train")``, problems ``indices`` in one jitted
# call as NumPy arrays: ``inputs`` float32 ``[B, 9F, V]``; ``targets`` int32 ``[B, F]`` (the 9th
# panel); ``rules`` int32 ``[B, F]`` (rule id of the feature in each answer slot, aligned with
# ``targets``); ``latent_id`` int32 ``[B]`` (row of ``latent_table``); ``feature_order`` int32
# ``[B, 3, F]`` (column ``c`` slot ``s`` shows underlying feature ``feature_order[c, s]``).
sample_problem = STREAMS.sample_one
split_stream = STREAMS.split_stream
generate_batch = STREAMS.generate_batch


class SRavenSource(sources.GeneratedSource):
  """``size`` sRAVEN problems of one split: records as in ``generate_batch`` without batch axis."""

  task = STREAMS


# ----------------------------------------------------------------------------------------------
# Analysis and metrics.
# ----------------------------------------------------------------------------------------------


def panels_from_record(config: SRavenConfig, inputs: Any, targets: Any) -> np.ndarray:
  """Rebuild the full grid from tokens and answer.

  Args:
    config: the problem family.
    inputs: float ``[..., 9F, V]`` (one-hot context tokens, zero query tokens).
    targets: int ``[..., F]``.

  Returns:
    int64 ``[..., 3 rows, 3 columns, F]`` in each panel's own (shuffled) slot order.
  """
  inputs, targets = np.asarray(inputs), np.asarray(targets)
  num_features = config.num_features
  if inputs.shape[-2:] != (config.num_tokens, config.num_values):
    raise ValueError(
      f"inputs must have shape [..., {config.num_tokens}, {config.num_values}], got {inputs.shape}."
    )
  if targets.shape != inputs.shape[:-2] + (num_features,):
    raise ValueError(
      f"targets must have shape {inputs.shape[:-2] + (num_features,)}, got {targets.shape}."
    )
  batch_shape = inputs.shape[:-2]
  context = np.argmax(inputs[..., :-num_features, :], axis=-1)
  context = context.reshape(batch_shape + (NUM_PANELS - 1, num_features))
  panels = np.concatenate([context, targets[..., None, :]], axis=-2).astype(np.int64)
  return panels.reshape(batch_shape + (GRID_SIZE, GRID_SIZE, num_features))


def _column_alignments(config: SRavenConfig) -> np.ndarray:
  """int ``[P, 2, F]``: slots of columns 0 and 1 matched to each slot of column 2."""
  num_features = config.num_features
  if not config.shuffle_features:
    return np.broadcast_to(np.arange(num_features), (1, 2, num_features))
  if num_features > _MAX_FEATURES_FOR_SHUFFLED_AMBIGUITY:
    raise ValueError(
      f"The ambiguity check enumerates (F!)^2 column alignments; use "
      f"num_features <= {_MAX_FEATURES_FOR_SHUFFLED_AMBIGUITY} with "
      f"shuffle_features, got {num_features}."
    )
  perms = list(itertools.permutations(range(num_features)))
  return np.array([(p0, p1) for p0 in perms for p1 in perms], dtype=np.int64)


def _consistent_values(config: SRavenConfig, panels: np.ndarray) -> np.ndarray:
  """Which answer values complete a feature made of one slot from each column.

  Args:
    config: the problem family.
    panels: int ``[B, 3 rows, 3 columns, F]``; the answer panel's values are ignored.

  Returns:
    bool ``[B, F, F, F, V]``: entry ``[b, i, j, s, v]`` says that the feature formed by slot
    ``i`` of column 0, slot ``j`` of column 1 and slot ``s`` of column 2, with ``v`` as the answer,
    follows at least one rule of the config in every row.
  """
  num_features, num_values = config.num_features, config.num_values
  # columns[c]: [B, F, rows], the values of every slot of column c.
  columns = [np.swapaxes(panels[:, :, c, :], 1, 2) for c in range(GRID_SIZE)]
  shape = (panels.shape[0], num_features, num_features, num_features, num_values, GRID_SIZE)
  grid = np.stack(
    [
      np.broadcast_to(columns[0][:, :, None, None, None, :], shape),
      np.broadcast_to(columns[1][:, None, :, None, None, :], shape),
      np.broadcast_to(columns[2][:, None, None, :, None, :], shape),
    ],
    axis=-1,
  )  # [B, i, j, s, v, row, column]
  grid[..., GRID_SIZE - 1, GRID_SIZE - 1] = np.arange(num_values)  # candidate answers
  fits = np.zeros(shape[:-1], bool)
  for name in config.rules:
    fits |= RULE_CHECKS[name](grid, num_values)
  return fits


def _panel_products(allowed: np.ndarray) -> np.ndarray:
  """bool ``[P, F, V]`` per-slot allowed values -> bool ``[P, V**F]`` allowed whole panels.

  Panels are flattened with slot 0 most significant (``np.ravel_multi_index`` order).
  """
  products = allowed[:, 0]
  for slot in range(1, allowed.shape[1]):
    products = (products[:, :, None] & allowed[:, slot, None, :]).reshape(len(allowed), -1)
  return products


def consistent_answers(config: SRavenConfig, problems: Mapping[str, Any]) -> np.ndarray:
  """Every answer panel consistent with the 8 context panels, by brute force.

  A candidate answer ``a`` (in the answer panel's slot order) is consistent when some alignment of
  the slots of columns 0 and 1 to those of column 2 (only the identity without
  ``shuffle_features``) and some rule of ``config.rules`` per feature (any rule, not only latents
  of the problem's split: the solver is not told the split) make every row of every feature follow
  its rule. Given an alignment, features constrain the answer independently, so the candidates of
  ``V^F`` are the product of per-slot candidate values; the result is the union over alignments.

  Args:
    config: the problem family.
    problems: a batch from ``generate_batch`` (``inputs`` ``[B, 9F, V]``, ``targets`` ``[B, F]``).

  Returns:
    bool ``[B, V**F]``, panels flattened with slot 0 most significant.
  """
  panels = panels_from_record(config, problems["inputs"], problems["targets"])
  if panels.ndim != 4:
    raise ValueError(
      f"problems must be batched: inputs [B, {config.num_tokens}, "
      f"{config.num_values}], got {np.shape(problems['inputs'])}."
    )
  alignments = _column_alignments(config)  # [P, 2, F]
  slots = np.arange(config.num_features)
  fits = _consistent_values(config, panels)  # [B, i, j, s, V]
  result = np.zeros((len(panels), config.num_values**config.num_features), bool)
  for b in range(len(panels)):
    allowed = fits[b][alignments[:, 0], alignments[:, 1], slots]  # [P, F, V]
    allowed = allowed[allowed.any(axis=-1).all(axis=-1)]  # alignments with some answer
    if len(allowed):
      result[b] = _panel_products(allowed).any(axis=0)
  return result


def is_ambiguous(config: SRavenConfig, problems: Mapping[str, Any]) -> np.ndarray:
  """bool ``[B]``: more than one answer panel is consistent (see ``consistent_answers``)."""
  return consistent_answers(config, problems).sum(axis=-1) > 1


def ambiguity_rate(config: SRavenConfig, problems: Mapping[str, Any]) -> float:
  """Share of the batch's problems with more than one consistent answer panel."""
  return float(np.mean(is_ambiguous(config, problems)))


def whole_panel_correct(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """bool ``[B]``: the argmax of every feature equals the target (jit-friendly).

  Args:
    logits: float ``[B, F, V]``.
    targets: int ``[B, F]``.
  """
  if logits.ndim != 3 or targets.shape != logits.shape[:2]:
    raise ValueError(
      f"Expected logits [B, F, V] and targets [B, F], got logits "
      f"{logits.shape} and targets {targets.shape}."
    )
  return jnp.all(jnp.argmax(logits, axis=-1) == targets, axis=-1)


def whole_panel_accuracy(logits: jax.Array, targets: jax.Array) -> float:
  """Share of problems whose answer panel is predicted exactly (all ``F`` features).

  Args:
    logits: float ``[B, F, V]``.
    targets: int ``[B, F]``.
  """
  return float(jnp.mean(whole_panel_correct(jnp.asarray(logits), jnp.asarray(targets))))
