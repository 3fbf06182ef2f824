"""grain loader: batching, shuffling, checkpointed position; exact-once evaluation batches."""

import grain
import hypothesis
import hypothesis.strategies as st
import numpy as np
import orbax.checkpoint as ocp
import pytest

from primal_dual.data import pipeline


class CountingSource:
  """Record i is {'x': int32 [2] = [i, -i], 'label': int32 i}; repr is stable for grain."""

  def __init__(self, size):
    self.size = size

  def __len__(self):
    return self.size

  def __getitem__(self, index):
    index = int(index)
    if not 0 <= index < self.size:
      raise IndexError(index)
    return {"x": np.array([index, -index], np.int32), "label": np.int32(index)}

  def __repr__(self):
    return f"CountingSource({self.size})"


def _take(iterator, count):
  return [next(iterator) for _ in range(count)]


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def _loader(**overrides):
  # Few read threads: starting grain's default 16 is slow on a busy 2-core machine.
  kwargs = dict(
    batch_size=4,
    seed=3,
    shuffle=True,
    read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=8),
  )
  kwargs.update(overrides)
  return pipeline.make_loader(CountingSource(10), **kwargs)


def test_batches_shapes_and_epoch_coverage():
  batches = _take(_loader(num_epochs=1, drop_remainder=False), 3)
  assert [b["x"].shape for b in batches] == [(4, 2), (4, 2), (2, 2)]
  labels = np.concatenate([b["label"] for b in batches])
  np.testing.assert_array_equal(np.sort(labels), np.arange(10))  # each once per epoch
  assert not np.array_equal(labels, np.arange(10))  # shuffled
  np.testing.assert_array_equal(batches[0]["x"][:, 1], -batches[0]["label"])
  dropped = list(_loader(num_epochs=1, drop_remainder=True))
  assert [b["x"].shape[0] for b in dropped] == [4, 4]  # the remainder of 2 is dropped


def test_epochs_are_reshuffled():
  labels = np.concatenate([b["label"] for b in _take(_loader(batch_size=5), 4)])
  first, second = labels[:10], labels[10:]
  np.testing.assert_array_equal(np.sort(second), np.arange(10))
  assert not np.array_equal(first, second)


def test_unshuffled_order_and_transforms():
  class AddOne(grain.transforms.Map):
    def map(self, record):
      return {**record, "y": record["x"] + 1}

  batch = next(_loader(shuffle=False, transforms=(AddOne(),)))
  np.testing.assert_array_equal(batch["label"], np.arange(4))
  np.testing.assert_array_equal(batch["y"], batch["x"] + 1)


def test_state_restore_replays_the_same_batches():
  iterator = _loader()
  _take(iterator, 3)
  state = iterator.get_state()
  expected = _take(iterator, 2)  # crosses the epoch boundary (10 records, batches of 4)
  unrestored = _take(_loader(), 2)
  assert not all(np.array_equal(a["label"], b["label"]) for a, b in zip(unrestored, expected))
  fresh = _loader()
  fresh.set_state(state)
  _assert_same_batches(_take(fresh, 2), expected)


def test_orbax_composite_checkpoint_restores_position(tmp_path):
  iterator = _loader()
  _take(iterator, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(3, args=ocp.args.Composite(loader=grain.checkpoint.CheckpointSave(iterator)))
    manager.wait_until_finished()
  expected = _take(iterator, 2)
  fresh = _loader()
  next(fresh)  # a moved iterator is reset by the restore as well
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.restore(3, args=ocp.args.Composite(loader=grain.checkpoint.CheckpointRestore(fresh)))
  _assert_same_batches(_take(fresh, 2), expected)


def test_restore_with_other_seed_is_rejected():
  iterator = _loader()
  next(iterator)
  with pytest.raises(ValueError, match="Sampler"):
    _loader(seed=4).set_state(iterator.get_state())


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="batch_size"):
    _loader(batch_size=0)
  with pytest.raises(ValueError, match="empty"):
    pipeline.make_loader(CountingSource(0), batch_size=2, seed=0, shuffle=False)
  with pytest.raises(ValueError, match="seed"):
    _loader(seed=-1)


def _eval_labels(batches):
  return np.concatenate([b["label"][b["valid"]] for b in batches])


def test_iterate_eval_pads_last_batch():
  batches = list(pipeline.iterate_eval(CountingSource(10), 4, process_index=0, process_count=1))
  assert len(batches) == 3 and all(b["x"].shape == (4, 2) for b in batches)
  np.testing.assert_array_equal(batches[-1]["valid"], [True, True, False, False])
  np.testing.assert_array_equal(batches[-1]["x"][2:], 0)
  np.testing.assert_array_equal(_eval_labels(batches), np.arange(10))


@hypothesis.given(
  size=st.integers(1, 40), batch_size=st.integers(1, 7), process_count=st.integers(1, 4)
)
def test_iterate_eval_covers_every_example_once_across_processes(size, batch_size, process_count):
  per_process = [
    list(
      pipeline.iterate_eval(
        CountingSource(size), batch_size, process_index=p, process_count=process_count
      )
    )
    for p in range(process_count)
  ]
  assert len({len(b) for b in per_process}) == 1  # processes stay in step
  labels = np.concatenate([_eval_labels(b) for b in per_process])
  np.testing.assert_array_equal(np.sort(labels), np.arange(size))
  for batches in per_process:
    for b in batches:
      assert b["valid"].shape == (batch_size,)
      np.testing.assert_array_equal(b["x"][:, 0], np.where(b["valid"], b["label"], 0))


def test_loader_on_uea_source_restores(tmp_path):
  from primal_dual.data import builders  # TFDS import only for this test

  source = builders.uea_sources("JapaneseVowels", data_dir=tmp_path, splits=("train_fit",))[
    "train_fit"
  ]
  make = lambda: pipeline.make_loader(source, batch_size=16, seed=0, shuffle=True)
  iterator = make()
  first = _take(iterator, 3)
  assert first[0]["inputs"].shape == (16, 29, 12) and first[0]["inputs"].dtype == np.float32
  assert first[0]["mask"].dtype == np.bool_ and first[0]["label"].shape == (16,)
  state = iterator.get_state()
  expected = _take(iterator, 2)
  fresh = make()
  fresh.set_state(state)
  _assert_same_batches(_take(fresh, 2), expected)
  eval_batches = list(pipeline.iterate_eval(source, 50))
  assert sum(b["valid"].sum() for b in eval_batches) == len(source) == 216


# --- batch_reads: one grain record per batch --------------------------------------------------


def test_batch_reads_cover_each_epoch_once_in_a_fresh_seeded_order():
  batches = _take(_loader(batch_reads=True, num_epochs=2), 4)  # 10 records: 2 batches per epoch
  assert [b["x"].shape for b in batches] == [(4, 2)] * 4
  epochs = [np.concatenate([b["label"] for b in batches[i : i + 2]]) for i in (0, 2)]
  for labels in epochs:
    assert len(set(labels.tolist())) == 8  # 8 distinct records, the remainder of 2 dropped
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled every epoch
  np.testing.assert_array_equal(batches[0]["x"][:, 1], -batches[0]["label"])
  again = _take(_loader(batch_reads=True, num_epochs=2), 4)
  _assert_same_batches(again, batches)  # deterministic from the seed
  other = _take(_loader(batch_reads=True, num_epochs=2, seed=4), 4)
  assert not all(np.array_equal(a["label"], b["label"]) for a, b in zip(other, batches))
  ordered = _take(_loader(batch_reads=True, shuffle=False), 3)
  np.testing.assert_array_equal(
    np.concatenate([b["label"] for b in ordered]), [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
  )


def test_batch_reads_end_after_num_epochs():
  assert len(list(_loader(batch_reads=True, num_epochs=3))) == 6


def test_batch_reads_state_restore_replays_the_same_batches(tmp_path):
  iterator = _loader(batch_reads=True)
  _take(iterator, 3)
  state = iterator.get_state()
  expected = _take(iterator, 3)  # crosses an epoch boundary
  fresh = _loader(batch_reads=True)
  fresh.set_state(state)
  _assert_same_batches(_take(fresh, 3), expected)
  with pytest.raises(ValueError):
    _loader(batch_reads=True, seed=4).set_state(state)


class GatheringSource(CountingSource):
  """CountingSource with a vectorised ``get_batch`` that records how it was called."""

  calls = 0

  def get_batch(self, indices):
    GatheringSource.calls += 1
    indices = np.asarray(indices)
    return {
      "x": np.stack([indices, -indices], axis=1).astype(np.int32),
      "label": indices.astype(np.int32),
    }


def test_batch_stream_uses_get_batch_and_slices_processes_disjointly():
  source = GatheringSource(10)
  slices = [
    pipeline.BatchStream(
      source, batch_size=2, seed=0, shuffle=True, start=start, stop=stop, num_epochs=1
    )
    for start, stop in ((0, 5), (5, 10))
  ]
  before = GatheringSource.calls
  seen = [np.concatenate([stream[i]["label"] for i in range(len(stream))]) for stream in slices]
  assert GatheringSource.calls - before == 4  # one gather per batch
  assert set(seen[0]) <= set(range(5)) and set(seen[1]) <= set(range(5, 10))
  assert [len(s) for s in seen] == [4, 4]
  assert "seed=0" in repr(slices[0]) and "start=5" in repr(slices[1])


def test_batch_reads_refuse_what_they_cannot_do():
  with pytest.raises(ValueError, match="drop_remainder=True and no transforms"):
    _loader(batch_reads=True, drop_remainder=False)
  with pytest.raises(ValueError, match="drop_remainder=True and no transforms"):
    _loader(batch_reads=True, transforms=[grain.transforms.Batch(batch_size=1)])
  with pytest.raises(ValueError, match="exceeds this process's 10 records"):
    _loader(batch_reads=True, batch_size=11)
