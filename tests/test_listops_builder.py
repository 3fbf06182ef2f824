"""ListOps TFDS builder: records round-trip from the generator, seeds give separate configs."""
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
  assert [len(sources[s]) for s in SPLITS] == [preset["num_train"], preset["num_validation"],
                                               preset["num_test"]]
  _check_round_trip(sources, expected, preset["max_length"])
  # opening the prepared data again reads the same records
  again = builders.listops_sources("tiny", data_dir=data_dir, splits=("test",))
  np.testing.assert_array_equal(again["test"][3]["inputs"], sources["test"][3]["inputs"])


def test_other_seed_is_its_own_config(data_dir):
  preset = listops.PRESETS["tiny"]
  sources = builders.listops_sources("tiny", seed=5, data_dir=data_dir)
  _check_round_trip(sources, listops.generate_splits(seed=5, **preset), preset["max_length"])
  seed0 = builders.listops_sources("tiny", data_dir=data_dir, splits=("train",))["train"]
  assert not all(np.array_equal(seed0[i]["inputs"], sources["train"][i]["inputs"])
                 for i in range(5))
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
