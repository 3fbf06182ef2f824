"""Random-access sources: the contract every data set meets and the wrappers the tasks share.

A source is ``grain.RandomAccessDataSource``-like (:class:`Source`): ``len(source)`` records,
``source[i]`` a dict of NumPy arrays, and a stable ``repr`` (grain compares it when restoring an
iterator, so it must not contain memory addresses). Two hooks are optional: ``__getitems__``
(several records in one read, grain's batched-read name) and ``get_batch`` (:class:`BatchSource`:
a whole batch as stacked arrays in one call, used by ``pipeline.BatchStream``).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # the module itself stays free of JAX, as pipeline.py
  from primal_dual.data import generated


@runtime_checkable
class Source(Protocol):
  """``len`` records, each a dict of NumPy arrays (``__getitem__``)."""

  def __len__(self) -> int: ...

  def __getitem__(self, index: int) -> Mapping[str, np.ndarray]: ...


@runtime_checkable
class BatchSource(Source, Protocol):
  """A source that also makes a batch in one call: ``{field: [B, ...]}`` for indices int ``[B]``."""

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]: ...


def read_records(source: Source, indices: Sequence[int]) -> list[Any]:
  """``[source[i] for i in indices]``, in one ``__getitems__`` read where the source has one."""
  if hasattr(source, "__getitems__"):
    return list(source.__getitems__([int(i) for i in indices]))
  return [source[int(i)] for i in indices]


def gather(source: Source, indices: np.ndarray) -> dict[str, np.ndarray]:
  """A batch of ``source``'s records ``{field: [B, ...]}``: its ``get_batch`` when it has one."""
  if isinstance(source, BatchSource):
    return source.get_batch(indices)
  records = read_records(source, indices.tolist())
  return {k: np.stack([np.asarray(r[k]) for r in records]) for k in records[0]}


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class DecodedSource:
  """A split of a prepared TFDS data set whose records are dicts of NumPy arrays.

  Attributes:
    source: the TFDS data source (``__len__``, ``__getitem__``, ``__getitems__``).
    dtypes: NumPy dtype of each field; every field is cast (TFDS gives a Python int for scalars).
    description: stable text for ``repr``.
  """

  source: Any
  dtypes: Mapping[str, Any]
  description: str
  # Keeps the prepared files from being rebuilt while this source may read them (builders.py).
  pin: Any = dataclasses.field(default=None, compare=False)

  def __len__(self) -> int:
    return len(self.source)

  def _cast(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=self.dtypes.get(k)) for k, v in record.items()}

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self._cast(self.source[index])

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
    return [self._cast(r) for r in self.source.__getitems__([int(i) for i in indices])]

  def __repr__(self) -> str:
    return f"DecodedSource({self.description}, len={len(self)})"


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class SubsetSource:
  """The records ``indices`` of ``source``, in that order (e.g. a carved validation split).

  Attributes:
    source: any random-access source.
    indices: int ``[n]`` positions in ``source``.
    description: stable text for ``repr``.
  """

  source: Source
  indices: np.ndarray
  description: str

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, index: int) -> Any:
    return self.source[int(self.indices[index])]

  def __getitems__(self, indices: Sequence[int]) -> list[Any]:
    return read_records(self.source, [int(self.indices[i]) for i in indices])

  def __repr__(self) -> str:
    return f"SubsetSource({self.description} of {self.source!r}, len={len(self)})"


class ArraySource:
  """Images and labels held in memory.

  Attributes:
    images: float32 ``[N, H, W, C]``.
    labels: int32 ``[N]``.
  """

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    if len(images) != len(labels):
      raise ValueError(f"images and labels differ in length: {images.shape} vs {labels.shape}.")
    self.images = images
    self.labels = labels

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    """Returns ``{'image': float32 [H, W, C], 'label': int32 []}``."""
    return {"image": self.images[index], "label": self.labels[index]}

  def __repr__(self) -> str:
    return f"ArraySource(num_records={len(self)}, image_shape={self.images.shape[1:]})"


class GeneratedSource:
  """``size`` records of one split of a generated task (base of ``SRavenSource``, ``LogicSource``).

  Subclasses set ``task`` (a :class:`primal_dual.data.generated.GeneratedTask`). Records are its
  ``generate_batch`` records without the batch axis. ``_getitems`` is grain's batched-read hook
  (``SupportsBatchedReadRandomAccessDataSource``, used by ``MapDataset.batch`` when batch pushdown
  is enabled) and makes a whole batch in one jitted call; ``__getitems__`` is the same under the
  PyTorch-style name. A source holds only its arguments, so it pickles into grain workers.
  """

  task: generated.GeneratedTask

  def __init__(self, config: Any, split: str, seed: int, size: int):
    self.task.check_source(config, split, seed)  # fail now, not in a worker
    if operator.index(size) < 1:
      raise ValueError(f"size must be >= 1, got {size}.")
    self.config, self.split, self.seed, self.size = config, split, seed, int(size)

  def __len__(self) -> int:
    return self.size

  def _check_index(self, index: int) -> int:
    index = operator.index(index)
    if not 0 <= index < self.size:
      raise IndexError(f"index {index} out of range for a source of size {self.size}.")
    return index

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self._getitems([index])[0]

  def _getitems(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
    indices = [self._check_index(i) for i in indices]
    batch = self.task.generate_batch(self.config, self.seed, indices, self.split)
    return [
      {name: np.array(value[i]) for name, value in batch.items()} for i in range(len(indices))
    ]

  __getitems__ = _getitems

  def __repr__(self) -> str:
    return (
      f"{type(self).__name__}(split={self.split!r}, seed={self.seed}, size={self.size}, "
      f"config={self.config})"
    )
