"""Fuzzy-logic regression tasks as a random-access, JAX-generated data source (docs/maths.md §4).

Variables ``x ∈ [0, 1]^n``. A *conjunction* is a minterm over all ``n`` variables: a polarity
vector ``p ∈ {0, 1}^n`` with literal ``x_i`` where ``p_i = 1`` and ``1 − x_i`` where ``p_i = 0``,
combined with ``min``. Conjunctions are numbered in ``itertools.product([0, 1], repeat=n)`` order.
A *task* is a set of ``num_terms`` distinct conjunctions combined with ``max``:
``y(x) = max_t min_i literal_{t,i}(x_i)``. Tasks are numbered by
``itertools.combinations(range(2^n), num_terms)`` order; that number is the record's ``task_id``.

**Splits.** The last ``floor(ood_fraction × 2^n)`` conjunctions are held out. Term sets made only
of seen conjunctions are permuted with ``numpy.random.default_rng(split_seed)``; the first
``floor(test_fraction × count)`` are the ``test`` tasks (unseen combinations of seen
conjunctions), the rest the ``train`` tasks (also used by ``validation``, with fresh sequences).
``ood`` tasks are chosen by ``ood_term_sets``:

- ``'any_held_out'`` (default): term sets containing at least one held-out conjunction.
- ``'all_held_out'``: term sets made only of held-out conjunctions (the reference code of Schug et
  al.); mixed term sets then belong to no split.

**Sequences.** ``seq_len`` tokens ``[x_1 … x_n, y]`` with ``x ~ U[0, 1]^n``; the last token's ``y``
is zeroed and is the regression target. Record ``i`` of split ``s`` is a pure function of
``(config, seed, s, i)``, its key being ``fold_in(fold_in(key(seed), stream_id[s]), i)`` with a
different stream id per split.

**Metric.** ``r_squared`` compares the squared error with each task's exact target variance
(``task_moments``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from primal_dual.data import generated
from primal_dual.data import sources

# Term-set tables beyond this size would make the split tables themselves the bottleneck.
_MAX_TERM_SETS = 2_000_000

OOD_TERM_SET_RULES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
  # held: bool [T, num_terms], whether each term of each term set is a held-out conjunction.
  "any_held_out": lambda held: held.any(axis=-1),
  "all_held_out": lambda held: held.all(axis=-1),
}


@dataclasses.dataclass(frozen=True)
class LogicConfig:
  """The task family and its splits.

  Attributes:
    num_variables: ``n``.
    num_terms: conjunctions per task (distinct).
    seq_len: tokens per sequence, the last one being the query.
    ood_fraction: share of conjunctions held out (the last ones), rounded down.
    split_seed: seeds the train/test split of in-distribution term sets (≥ 0; a config's
      ``generated.SPLIT_SEED_OF_RUN`` is resolved to the run's seed by the task).
    test_fraction: share of in-distribution term sets given to ``test``, rounded down (0.5 as in
      the reference configs of Schug et al.).
    ood_term_sets: which term sets form the ``ood`` split, a key of ``OOD_TERM_SET_RULES``.
  """

  num_variables: int = 4
  num_terms: int = 2
  seq_len: int = 16
  ood_fraction: float = 0.25
  split_seed: int = 0
  test_fraction: float = 0.5
  ood_term_sets: str = "any_held_out"

  def __post_init__(self):
    if self.num_variables < 1:
      raise ValueError(f"num_variables must be >= 1, got {self.num_variables}.")
    if self.num_terms < 1:
      raise ValueError(f"num_terms must be >= 1, got {self.num_terms}.")
    if self.seq_len < 2:
      raise ValueError(f"seq_len must be >= 2 (context and query), got {self.seq_len}.")
    if not 0.0 <= self.ood_fraction < 1.0:
      raise ValueError(f"ood_fraction must be in [0, 1), got {self.ood_fraction}.")
    if not 0.0 < self.test_fraction < 1.0:
      raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}.")
    if self.split_seed < 0:
      raise ValueError(f"split_seed must be >= 0, got {self.split_seed}.")
    if self.ood_term_sets not in OOD_TERM_SET_RULES:
      raise ValueError(
        f"Unknown ood_term_sets {self.ood_term_sets!r}; choose from {list(OOD_TERM_SET_RULES)}."
      )
    num_seen = self.num_conjunctions - self.num_heldout_conjunctions
    if self.num_terms > num_seen:
      raise ValueError(
        f"num_terms ({self.num_terms}) exceeds the {num_seen} seen conjunctions; "
        "lower num_terms or ood_fraction."
      )
    if math.comb(self.num_conjunctions, self.num_terms) > _MAX_TERM_SETS:
      raise ValueError(
        f"C(2^{self.num_variables}, {self.num_terms}) term sets is too many to "
        f"tabulate (limit {_MAX_TERM_SETS}); lower num_variables or num_terms."
      )
    if math.comb(num_seen, self.num_terms) < 2:
      raise ValueError(
        "Fewer than 2 in-distribution term sets: train and test cannot both be "
        "non-empty; lower ood_fraction or num_terms."
      )

  @property
  def num_conjunctions(self) -> int:
    return 2**self.num_variables

  @property
  def num_heldout_conjunctions(self) -> int:
    """``floor(ood_fraction × 2^n)`` (epsilon guards float products like 0.29 × 100)."""
    return int(math.floor(self.ood_fraction * self.num_conjunctions + 1e-9))


class _Split(NamedTuple):
  stream_id: int  # distinct per split, so splits never share a random stream
  tasks: str  # which task table it draws from


SPLITS: dict[str, _Split] = {
  "train": _Split(stream_id=0, tasks="train"),
  "validation": _Split(stream_id=1, tasks="train"),
  "test": _Split(stream_id=2, tasks="test"),
  "ood": _Split(stream_id=3, tasks="ood"),
}


@functools.lru_cache(maxsize=None)
def conjunction_table(config: LogicConfig) -> np.ndarray:
  """int32 ``[2^n, n]`` polarities (1: literal ``x_i``, 0: literal ``1 − x_i``), product order."""
  rows = itertools.product([0, 1], repeat=config.num_variables)
  return generated.read_only(np.array(list(rows), np.int32))


def heldout_conjunction_ids(config: LogicConfig) -> np.ndarray:
  """int32 ids of the held-out conjunctions: the last ``num_heldout_conjunctions``."""
  return np.arange(
    config.num_conjunctions - config.num_heldout_conjunctions,
    config.num_conjunctions,
    dtype=np.int32,
  )


@functools.lru_cache(maxsize=None)
def term_set_table(config: LogicConfig) -> np.ndarray:
  """int32 ``[T, num_terms]`` conjunction ids per task (row = ``task_id``), combinations order."""
  combos = itertools.combinations(range(config.num_conjunctions), config.num_terms)
  return generated.read_only(np.array(list(combos), np.int32).reshape(-1, config.num_terms))


@functools.lru_cache(maxsize=None)
def _task_ids_by_table(config: LogicConfig) -> dict[str, np.ndarray]:
  held = term_set_table(config) >= config.num_conjunctions - config.num_heldout_conjunctions
  in_distribution = np.flatnonzero(~held.any(axis=-1))
  order = np.random.default_rng(config.split_seed).permutation(in_distribution)
  num_test = int(math.floor(config.test_fraction * len(order) + 1e-9))
  if num_test == 0 or num_test == len(order):
    raise ValueError(
      f"test_fraction {config.test_fraction} leaves train or test without tasks "
      f"({len(order)} in-distribution term sets)."
    )
  ood = np.flatnonzero(OOD_TERM_SET_RULES[config.ood_term_sets](held))
  return {
    "train": generated.read_only(np.sort(order[num_test:]).astype(np.int32)),
    "test": generated.read_only(np.sort(order[:num_test]).astype(np.int32)),
    "ood": generated.read_only(ood.astype(np.int32)),
  }


def split_task_ids(config: LogicConfig, split: str) -> np.ndarray:
  """Sorted int32 task ids (rows of ``term_set_table``) a split draws from (uniformly)."""
  return _task_ids_by_table(config)[STREAMS.split(split).tasks]


def evaluate_task(x: jax.Array, polarities: jax.Array) -> jax.Array:
  """``max_t min_i literal_{t,i}(x_i)``.

  Args:
    x: float ``[..., n]`` in ``[0, 1]``.
    polarities: int or bool ``[num_terms, n]`` (1: ``x_i``, 0: ``1 − x_i``).

  Returns:
    float ``[...]``, dtype of ``x``.
  """
  literals = jnp.where(polarities.astype(bool), x[..., None, :], 1.0 - x[..., None, :])
  return jnp.max(jnp.min(literals, axis=-1), axis=-1)


def _sample_sequence(
  key: jax.Array, config: LogicConfig, task_pool: jax.Array, pool_size: jax.Array
) -> dict[str, jax.Array]:
  """One sequence of a task drawn from the first ``pool_size`` ids of ``task_pool``."""
  # One flat draw: multi-dimensional or split draws compile several times slower under vmap.
  num_x = config.seq_len * config.num_variables
  words = jax.random.bits(key, (1 + num_x,))
  task_id = task_pool[generated.uniform_below(words[0], pool_size)]
  # 24 high bits -> float32 in [0, 1) exactly representable, like jax.random.uniform's mantissa.
  x = (words[1:] >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
  x = x.reshape(config.seq_len, config.num_variables)
  polarities = jnp.asarray(conjunction_table(config))[jnp.asarray(term_set_table(config))[task_id]]
  y = evaluate_task(x, polarities)
  return {
    "inputs": jnp.concatenate([x, y.at[-1].set(0.0)[:, None]], axis=-1),
    "target": y[-1],
    "task_id": task_id.astype(jnp.int32),
  }


def _empty_split_message(config: LogicConfig, split: str) -> str:
  return (
    f"Split {split!r} has no tasks: raise ood_fraction (now "
    f"{config.ood_fraction}) so that at least {config.num_terms} conjunctions "
    "are held out, or use ood_term_sets='any_held_out'."
  )


STREAMS = generated.GeneratedTask(
  title="logic",
  splits=SPLITS,
  sample=_sample_sequence,
  split_ids=split_task_ids,
  table_size=lambda config: len(term_set_table(config)),
  empty_split_message=_empty_split_message,
)


# The streams (generated.GeneratedTask): ``sample_sequence(key, config, split="train")``, one
# sequence from a JAX key (traceable); ``split_stream(config, split)``, a traceable
# ``(seed, indices) -> batch`` for batches made inside a jitted step; and
# ``generate_batch(config, seed, indices, split="train")``, sequences ``indices`` in one jitted
# call as NumPy arrays: ``inputs`` float32 ``[B, seq_len, n + 1]`` (last token's ``y`` zeroed),
# ``target`` float32 ``[B]``, ``task_id`` int32 ``[B]`` (row of ``term_set_table``).
sample_sequence = STREAMS.sample_one
split_stream = STREAMS.split_stream
generate_batch = STREAMS.generate_batch


class LogicSource(sources.GeneratedSource):
  """``size`` fuzzy-logic sequences of one split; records as in ``generate_batch`` without the
  batch axis, a whole batch per jitted call through grain's ``_getitems``."""

  task = STREAMS


# ----------------------------------------------------------------------------------------------
# Exact task statistics and the metric.
# ----------------------------------------------------------------------------------------------


def _survival_integrals(agree: np.ndarray, disagree: np.ndarray, power: int) -> np.ndarray:
  """``∫₀¹ power · z^(power−1) (1 − z)^agree (1 − 2z)₊^disagree dz`` by Gauss–Legendre.

  The integrand is a polynomial on ``[0, ½]`` and on ``[½, 1]`` (where it vanishes unless
  ``disagree == 0``) of degree ``< n + power``, so ``n + power`` nodes per piece are exact.
  """
  degree = int(agree.max(initial=0) + disagree.max(initial=0)) + power
  nodes, weights = np.polynomial.legendre.leggauss(degree // 2 + 1)
  total = np.zeros(agree.shape, np.float64)
  for low, high in ((0.0, 0.5), (0.5, 1.0)):
    z = 0.5 * (high - low) * nodes + 0.5 * (high + low)  # [Q]
    w = 0.5 * (high - low) * weights
    integrand = (
      power
      * z ** (power - 1)
      * (1 - z) ** agree[..., None]
      * np.clip(1 - 2 * z, 0.0, None) ** disagree[..., None]
    )
    total += integrand @ w
  return total


@functools.lru_cache(maxsize=None)
def task_moments(config: LogicConfig) -> tuple[np.ndarray, np.ndarray]:
  """Exact mean and variance of ``y`` under ``x ~ U[0, 1]^n`` for every task.

  ``P(y > z) = P(∪_t A_t)`` with ``A_t = {every literal of term t exceeds z}``. For a set ``S`` of
  terms, ``P(∩_S A_t) = (1 − z)^a (1 − 2z)₊^d`` where ``d`` counts the variables on which the terms
  of ``S`` disagree in polarity (both ``x_i > z`` and ``1 − x_i > z``) and ``a = n − d``.
  Inclusion–exclusion over ``S`` and ``E[y^k] = ∫ k z^(k−1) P(y > z) dz`` give the moments; the
  integrals are of piecewise polynomials, computed exactly by Gauss–Legendre quadrature.

  Returns:
    ``(mean, variance)``, float64 ``[T]`` indexed by ``task_id`` (read-only).
  """
  polarities = conjunction_table(config)[term_set_table(config)]  # [T, terms, n]
  first = np.zeros(len(polarities))
  second = np.zeros(len(polarities))
  for size in range(1, config.num_terms + 1):
    sign = (-1.0) ** (size + 1)
    for subset in itertools.combinations(range(config.num_terms), size):
      chosen = polarities[:, subset, :]  # [T, size, n]
      disagree = np.sum(chosen.min(axis=1) != chosen.max(axis=1), axis=-1)
      agree = config.num_variables - disagree
      first += sign * _survival_integrals(agree, disagree, power=1)
      second += sign * _survival_integrals(agree, disagree, power=2)
  return generated.read_only(first), generated.read_only(second - first**2)


def r_squared(predictions: Any, targets: Any, task_variance: Any) -> float:
  """Coefficient of determination against each example's task variance.

  ``R² = 1 − Σ_i (p_i − y_i)² / Σ_i Var[y | task_i]``, sums over the batch. Predicting each task's
  mean gives ``R² ≈ 0`` in expectation, perfect predictions give 1. Use
  ``task_moments(config)[1][task_id]`` for ``task_variance``.

  Args:
    predictions: float ``[B]``.
    targets: float ``[B]``.
    task_variance: float ``[B]``, positive.

  Returns:
    Python float.
  """
  predictions, targets, task_variance = (
    np.asarray(a, np.float64) for a in (predictions, targets, task_variance)
  )
  if not predictions.shape == targets.shape == task_variance.shape or predictions.ndim != 1:
    raise ValueError(
      f"predictions, targets and task_variance must all be [B]; got "
      f"{predictions.shape}, {targets.shape}, {task_variance.shape}."
    )
  if np.any(task_variance <= 0):
    raise ValueError("task_variance must be positive; look it up with task_moments(config)[1].")
  return float(1.0 - np.sum((predictions - targets) ** 2) / np.sum(task_variance))
