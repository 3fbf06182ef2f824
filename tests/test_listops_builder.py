"""ListOps TFDS builder: records round-trip from the generator, seeds give separate configs."""

import threading
import time

import numpy as np
import pytest

from primal_dual.data import builders
from primal_dual.data import listops

SPLITS = ("train", "validation", "test")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


def _check_round_trip(sources, expected, max_length):
  for split in SPLITS:
    assert len(sources[split]) == len(expected[split])
    for i, (ids, label) in enumerate(expected[split]):
      record = sources[split][i]
      assert record["inputs"].shape == (max_length,) and record["inputs"].dtype == np.int32
      assert record["mask"].dtype == np.bool_ and record["label"].dtype == np.int32
      assert record["label"].shape == ()
      n = len(ids)
      np.testing.assert_array_equal(record["inputs"][:n], ids)
      np.testing.assert_array_equal(record["inputs"][n:], listops.PAD_ID)
      np.testing.assert_array_equal(record["mask"], np.arange(max_length) < n)
      assert int(record["label"]) == label


def test_tiny_round_trips_generator_records(data_dir):
  preset = listops.PRESETS["tiny"]
  sources = builders.listops_sources("tiny", data_dir=data_dir)
  expected = listops.generate_splits(seed=0, **preset)
  assert [len(sources[s]) for s in SPLITS] == [
    preset["num_train"],
    preset["num_validation"],
    preset["num_test"],
  ]
  _check_round_trip(sources, expected, preset["max_length"])
  # opening the prepared data again reads the same records
  again = builders.listops_sources("tiny", data_dir=data_dir, splits=("test",))
  np.testing.assert_array_equal(again["test"][3]["inputs"], sources["test"][3]["inputs"])


def test_other_seed_is_its_own_config(data_dir):
  preset = listops.PRESETS["tiny"]
  sources = builders.listops_sources("tiny", seed=5, data_dir=data_dir)
  _check_round_trip(sources, listops.generate_splits(seed=5, **preset), preset["max_length"])
  seed0 = builders.listops_sources("tiny", data_dir=data_dir, splits=("train",))["train"]
  assert not all(
    np.array_equal(seed0[i]["inputs"], sources["train"][i]["inputs"]) for i in range(5)
  )
  assert (data_dir / "listops" / "tiny_seed5").is_dir()


def test_registered_configs_and_bad_arguments():
  assert {"full", "short", "tiny"} <= set(builders.ListOps.builder_configs)
  assert builders.ListOps.builder_configs["full"].max_length == 2000
  with pytest.raises(ValueError, match="preset"):
    builders.listops_config("huge")
  with pytest.raises(ValueError, match="seed"):
    builders.listops_config("tiny", seed=-1)
  with pytest.raises(ValueError, match="at most 4"):
    builders.pad_tokens(np.arange(5), 0, 4)


def test_processes_starting_together_prepare_once(tmp_path, monkeypatch):
  """Two callers at once (a grid's --jobs): one prepares while the other waits, then reads it."""
  original = builders.ListOps.download_and_prepare
  calls = []

  def slow_prepare(self, *args, **kwargs):
    calls.append(time.monotonic())
    time.sleep(0.5)  # long enough for the other caller to find the data unprepared
    return original(self, *args, **kwargs)

  monkeypatch.setattr(builders.ListOps, "download_and_prepare", slow_prepare)
  results, errors = [None, None], []

  def load(slot):
    try:
      results[slot] = builders.listops_sources("tiny", seed=9, data_dir=tmp_path, splits=("test",))[
        "test"
      ]
    except Exception as error:
      errors.append(error)

  threads = [threading.Thread(target=load, args=(slot,)) for slot in (0, 1)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert not errors and len(calls) == 1
  assert len(results[0]) == len(results[1]) > 0
  for i in range(len(results[0])):
    np.testing.assert_array_equal(results[0][i]["inputs"], results[1][i]["inputs"])
