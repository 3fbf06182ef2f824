"""Generated data streams: the machinery shared by the sRAVEN and fuzzy-logic tasks.

A generated task draws every record from a counter-based key: record ``i`` of split ``s`` is a pure
function of ``(config, seed, s, i)``, its key being ``fold_in(fold_in(key(seed), stream_id[s]),
i)``. Each split draws uniformly from a *pool* of ids (latents, term sets) padded to the length of
the task's table, so every split of a config shares one compiled generator. The task modules
(``sraven.py``, ``logic.py``) keep only their maths: the sampler of one record and the ids of each
split; a :class:`GeneratedTask` turns them into host batches (``generate_batch``) and traceable
device streams that agree record for record (``pooled_stream``, whose seed and ids are arguments:
``StreamArguments``, so runs of different seeds and held-out splits share one compiled program;
``split_stream``, one split's own).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_UINT32 = 2**32 - 1

Record = dict[str, jax.Array]
DeviceStream = Callable[[jax.Array, jax.Array], Record]


class Sampler(Protocol):
  """One record of a task from its key and the first ``pool_size`` ids of ``pool`` (int32 ``[P]``);
  traceable, with ``config`` static."""

  def __call__(self, key: jax.Array, config: Any, pool: jax.Array, pool_size: Any) -> Record: ...


def read_only(array: np.ndarray) -> np.ndarray:
  """``array``, no longer writeable: cached tables are shared, nobody may edit them in place."""
  array.flags.writeable = False
  return array


def uniform_below(words: jax.Array, bounds: Any) -> jax.Array:
  """Map uniform uint32 words to ints in ``[0, bound)`` by remainder.

  The remainder's bias is at most ``bound / 2³²`` in probability: invisible for the bounds used
  here (feature values, row orderings, pool sizes).

  Args:
    words: uint32 ``[...]`` uniform random words.
    bounds: positive ints broadcastable to ``words`` (may be traced).

  Returns:
    int32 ``[...]``.
  """
  # Broadcast explicitly: the bounds are often of lower rank than the words.
  bounds = jnp.broadcast_to(jnp.asarray(bounds, jnp.uint32), words.shape)
  return (words % bounds).astype(jnp.int32)


def check_seed(seed: int) -> np.uint32:
  """Validate a stream seed; returns it as uint32."""
  seed = operator.index(seed)
  if not 0 <= seed <= MAX_UINT32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}.")
  return np.uint32(seed)


def replica_stream_seed(stream_seed: int, seed: jax.Array | int) -> jax.Array:
  """uint32 ``[]``: the train-stream seed of run ``seed`` when batches are made on the device, so
  runs that differ only in ``seed`` see different records (the host loader shuffles one stream
  instead). Traceable in ``seed``: replicas trained in one program each pass their own."""
  return jax.random.bits(jax.random.fold_in(jax.random.key(stream_seed), seed), (), jnp.uint32)


def padded_pool(ids: np.ndarray, table_size: int) -> tuple[np.ndarray, int]:
  """``(int32 [table_size] read-only, len(ids))``: ``ids`` followed by zeros."""
  pool = np.zeros(table_size, np.int32)
  pool[: len(ids)] = ids
  return read_only(pool), len(ids)


def _bucket_size(n: int) -> int:
  """Next power of two >= n: bounds the number of compiled batch shapes to ~log2(max batch)."""
  return 1 << max(0, (n - 1).bit_length())


def _check_indices(indices: Sequence[int] | np.ndarray) -> np.ndarray:
  indices = np.asarray(indices)
  if indices.ndim != 1:
    raise ValueError(f"indices must be 1-D, got shape {indices.shape}.")
  if indices.size and not np.issubdtype(indices.dtype, np.integer):
    raise ValueError(f"indices must be integers, got dtype {indices.dtype}.")
  if indices.size and (indices.min() < 0 or indices.max() > MAX_UINT32):
    raise ValueError("indices must be in [0, 2**32).")
  return indices.astype(np.uint32)


class StreamArguments(NamedTuple):
  """What one run's stream of a split reads at run time rather than at compile time, so that runs
  differing in it (their seeds, their held-out splits) share one compiled program: the stream's
  ``seed`` uint32 ``[]``, the split's ids ``pool`` int32 ``[P]`` (padded to the task's table) and
  their count ``pool_size`` int32 ``[]``. Stacked ``[R, ...]`` for R replicas."""

  seed: Any
  pool: Any
  pool_size: Any


def pooled_stream(
  sample: Callable[[jax.Array, jax.Array, Any], Record], stream_id: int
) -> Callable[[StreamArguments, jax.Array], Record]:
  """A traceable ``(arguments, indices uint32 [B]) -> batch`` of the split ``stream_id``.

  ``sample(key, pool, pool_size)`` makes one record; record ``i`` uses the key
  ``fold_in(fold_in(key(arguments.seed), stream_id), i)`` and draws its id from
  ``arguments.pool``, exactly as ``GeneratedTask.generate_batch``, so a batch made inside a jitted
  training step (no host work, nothing stored) equals the one the host makes.
  """

  def generate(arguments: StreamArguments, indices):
    stream = jax.random.fold_in(jax.random.key(arguments.seed), stream_id)
    pool, pool_size = jnp.asarray(arguments.pool), jnp.asarray(arguments.pool_size)
    return jax.vmap(lambda i: sample(jax.random.fold_in(stream, i), pool, pool_size))(indices)

  return generate


@functools.lru_cache(maxsize=None)
def _batched_generator(sample: Sampler, config: Any) -> Callable[..., Record]:
  """One jitted function per task and config; seed, split and pool are traced, so they never
  recompile."""

  def generate_one(seed, stream_id, pool, pool_size, index):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream_id), index)
    return sample(key, config, pool, pool_size)

  return jax.jit(jax.vmap(generate_one, in_axes=(None, None, None, None, 0)))


def call_generator(
  generator: Callable[..., Mapping[str, jax.Array]],
  seed: int,
  stream_id: int,
  pool: np.ndarray,
  pool_size: int,
  indices: Sequence[int] | np.ndarray,
) -> dict[str, np.ndarray]:
  """Run a jitted ``(seed, stream_id, pool, pool_size, indices) -> batch`` generator.

  Indices are padded to a power-of-two bucket (one compiled shape per bucket), generated in one
  call, trimmed and returned as NumPy arrays.
  """
  indices = _check_indices(indices)
  num = len(indices)
  padded = np.zeros(_bucket_size(num), np.uint32)
  padded[:num] = indices
  out = generator(check_seed(seed), np.uint32(stream_id), pool, np.int32(pool_size), padded)
  return {name: np.asarray(value)[:num] for name, value in out.items()}


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: one instance per task
class GeneratedTask:
  """A generated task's splits and streams.

  Attributes:
    title: names the task in error messages (``'sRAVEN'``).
    splits: split name -> a record with a distinct ``stream_id`` (the task's own split table).
    sample: the task's sampler of one record.
    split_ids: ``(config, split) -> int32 [n]`` the ids a split draws from (uniformly).
    table_size: ``config -> P``, the length every split's pool is padded to.
    empty_split_message: ``(config, split) -> str``, the error for a split with no ids.
  """

  title: str
  splits: Mapping[str, Any]
  sample: Sampler
  split_ids: Callable[[Any, str], np.ndarray]
  table_size: Callable[[Any], int]
  empty_split_message: Callable[[Any, str], str]

  def split(self, split: str) -> Any:
    """The split's entry of ``splits``; ``ValueError`` for an unknown name."""
    if split not in self.splits:
      raise ValueError(f"Unknown {self.title} split {split!r}; choose from {list(self.splits)}.")
    return self.splits[split]

  def pool(self, config: Any, split: str) -> tuple[np.ndarray, int]:
    """The split's ids padded to ``table_size`` and their count; ``ValueError`` when it has none."""
    return _pool(self, config, split)

  def check_source(self, config: Any, split: str, seed: int) -> None:
    """Raise ``ValueError`` for an unknown split, one with no ids, or a seed out of range."""
    self.pool(config, split)
    check_seed(seed)

  def sample_one(self, key: jax.Array, config: Any, split: str = "train") -> Record:
    """One record of a split from a JAX key (traceable; an unbatched ``generate_batch`` record).

    ``generate_batch(config, seed, [i], split)`` equals this with
    ``key = fold_in(fold_in(jax.random.key(seed), splits[split].stream_id), i)``.
    """
    pool, pool_size = self.pool(config, split)
    return self.sample(key, config, jnp.asarray(pool), pool_size)

  def generate_batch(
    self, config: Any, seed: int, indices: Sequence[int] | np.ndarray, split: str = "train"
  ) -> dict[str, np.ndarray]:
    """Records ``indices`` (int ``[B]`` in ``[0, 2**32)``) of a split's stream (seed in
    ``[0, 2**32)``), in one jitted call; NumPy arrays with a leading batch axis ``B``."""
    stream_id = self.split(split).stream_id
    pool, pool_size = self.pool(config, split)
    generator = _batched_generator(self.sample, config)
    return call_generator(generator, seed, stream_id, pool, pool_size, indices)

  def stream_arguments(self, config: Any, split: str, seed: Any) -> StreamArguments:
    """The ``StreamArguments`` (NumPy) of a split's stream of ``seed`` (uint32, or a uint32
    ``[]`` array such as ``replica_stream_seed``'s)."""
    pool, pool_size = self.pool(config, split)
    return StreamArguments(np.asarray(seed, np.uint32), pool, np.int32(pool_size))

  def pooled_stream(
    self, config: Any, split: str
  ) -> Callable[[StreamArguments, jax.Array], Record]:
    """``pooled_stream`` of a split: ``config`` fixes the records' shapes and tables; the seed and
    the ids drawn from are arguments (``stream_arguments``), so the same function serves every
    split seed of the family."""
    return pooled_stream(
      lambda key, pool, pool_size: self.sample(key, config, pool, pool_size),
      self.split(split).stream_id,
    )

  def split_stream(self, config: Any, split: str) -> DeviceStream:
    """A traceable ``(seed uint32 [], indices uint32 [B]) -> batch`` of a split (records as
    ``generate_batch``'s): ``pooled_stream`` with the split's own ids."""
    pool, pool_size = self.pool(config, split)
    generate = self.pooled_stream(config, split)
    return lambda seed, indices: generate(StreamArguments(seed, pool, pool_size), indices)


@functools.lru_cache(maxsize=None)
def _pool(task: GeneratedTask, config: Any, split: str) -> tuple[np.ndarray, int]:
  ids = task.split_ids(config, split)
  if len(ids) == 0:
    raise ValueError(task.empty_split_message(config, split))
  return padded_pool(ids, task.table_size(config))


# ``split_seed`` value meaning "the run's seed": each training seed draws its own held-out set, as
# the HYLA paper's code does (its generators permute the latents with the run's seed). The
# generated tasks (``primal_dual/tasks/sraven.py``, ``logic.py``) resolve it with
# ``run_split_seed``.
SPLIT_SEED_OF_RUN = -1


def run_split_seed(split_seed: int, seed: int, seeds: tuple[int, ...] = ()) -> int:
  """The split seed a run uses: ``split_seed``, or for ``SPLIT_SEED_OF_RUN`` the run's seed.

  Args:
    split_seed: ``config.data.split_seed`` (≥ 0, or ``SPLIT_SEED_OF_RUN``).
    seed: ``config.seed``.
    seeds: the seeds of the replicas a sweep's config trains (``config.sweep.seed`` or its points).

  Raises:
    ValueError: a per-run split asked of a sweep's config whose replicas have several seeds: it
      has no one held-out set. Each replica's data comes from its own config (the trainer builds
      one per held-out split: ``setup.ReplicaData``).
  """
  if split_seed != SPLIT_SEED_OF_RUN:
    return split_seed
  seeds = tuple(seeds)
  if len(seeds) > 1:
    raise ValueError(
      f"data.split_seed={SPLIT_SEED_OF_RUN} (a held-out set per seed): a sweep of the seeds "
      f"{seeds} has one held-out set per seed, not one for the sweep; build the data of each "
      "replica's own config (sweep.replicas_of(config)[i].config), as the trainer does"
    )
  return seeds[0] if seeds else seed
