"""UEA reading, preprocessing, TFDS preparation and clean-protocol splits.

The reference for every number is aeon's own `.ts` reader plus plain NumPy, independent of the
parser and preprocessing under test.
"""

import pathlib

import hypothesis
import hypothesis.strategies as st
import importlib_resources
import numpy as np
import pytest

from primal_dual.data import builders
from primal_dual.data import uea


def _aeon_raw(name, split):
  from aeon.datasets import load_from_ts_file  # slow import: only where needed

  path = importlib_resources.files("aeon") / "datasets" / "data" / name / f"{name}_{split}.ts"
  x, y = load_from_ts_file(str(path))
  return [np.asarray(s, np.float64) for s in x], np.asarray(y, str)


def _stack(source):
  records = [source[i] for i in range(len(source))]
  return {k: np.stack([r[k] for r in records]) for k in records[0]}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def vowels(data_dir):
  sources = builders.uea_sources(
    "JapaneseVowels", data_dir=data_dir, splits=("train", "test", "train_fit", "validation")
  )
  return {split: _stack(s) for split, s in sources.items()}, sources


@pytest.fixture(scope="module")
def motions(data_dir):
  sources = builders.uea_sources("BasicMotions", data_dir=data_dir)
  return {split: _stack(s) for split, s in sources.items()}


def test_japanese_vowels_sizes_and_lengths(vowels):
  arrays, _ = vowels
  assert len(arrays["train"]["label"]) == 270 and len(arrays["test"]["label"]) == 370
  for split in ("train", "test"):
    raw, _ = _aeon_raw("JapaneseVowels", split.upper())
    a = arrays[split]
    assert a["inputs"].shape[1:] == (29, 12) and a["inputs"].dtype == np.float32
    assert a["mask"].dtype == np.bool_ and a["label"].dtype == np.int32
    np.testing.assert_array_equal(a["mask"].sum(1), [s.shape[1] for s in raw])
    # the mask is a prefix: True on the first `length` steps only
    lengths = a["mask"].sum(1)
    np.testing.assert_array_equal(a["mask"], np.arange(29)[None] < lengths[:, None])
  all_lengths = np.concatenate([arrays[s]["mask"].sum(1) for s in ("train", "test")])
  assert all_lengths.min() == 7 and all_lengths.max() == 29
  assert set(np.unique(arrays["train"]["label"])) == set(range(9))


def test_basic_motions_sizes(motions):
  assert len(motions["train"]["label"]) == 40 and len(motions["test"]["label"]) == 40
  assert motions["train"]["inputs"].shape[1:] == (100, 6)
  assert motions["train"]["mask"].all() and motions["test"]["mask"].all()
  assert set(np.unique(motions["train"]["label"])) == set(range(4))


def test_uea_info(data_dir, vowels):
  del vowels  # prepared there
  info = builders.uea_info("JapaneseVowels", data_dir=data_dir)
  assert {
    k: info[k] for k in ("num_classes", "num_channels", "max_length", "num_train", "num_test")
  } == dict(num_classes=9, num_channels=12, max_length=29, num_train=270, num_test=370)


@pytest.mark.parametrize("name", ["JapaneseVowels", "BasicMotions"])
def test_standardisation_uses_train_statistics(name, data_dir):
  arrays = {s: _stack(src) for s, src in builders.uea_sources(name, data_dir=data_dir).items()}
  raw = {s: _aeon_raw(name, s.upper()) for s in ("train", "test")}
  train_steps = np.concatenate([s.T for s in raw["train"][0]], axis=0)  # [sum L, C]
  mean, std = train_steps.mean(0), train_steps.std(0)
  class_names = sorted(set(raw["train"][1]), key=lambda c: (float(c), c) if c.isdigit() else (0, c))
  for split in ("train", "test"):
    series, labels = raw[split]
    a = arrays[split]
    for i, s in enumerate(series):
      length = s.shape[1]
      np.testing.assert_allclose(a["inputs"][i, :length], (s.T - mean) / std, rtol=1e-5, atol=1e-5)
      assert not a["inputs"][i, length:].any()  # padding is zero
      assert not a["mask"][i, length:].any()
    np.testing.assert_array_equal(a["label"], [class_names.index(c) for c in labels])
  valid = arrays["train"]["inputs"][arrays["train"]["mask"]]  # [steps, C]
  np.testing.assert_allclose(valid.mean(0), 0.0, atol=1e-5)
  np.testing.assert_allclose(valid.std(0), 1.0, atol=1e-4)
  # the test split is standardised with the train statistics, so it is not exactly 0/1
  test_valid = arrays["test"]["inputs"][arrays["test"]["mask"]]
  assert np.abs(test_valid.mean(0)).max() > 1e-3


def test_clean_protocol_splits(vowels):
  arrays, sources = vowels
  fit, validation = sources["train_fit"].indices, sources["validation"].indices
  assert len(np.intersect1d(fit, validation)) == 0
  np.testing.assert_array_equal(np.sort(np.concatenate([fit, validation])), np.arange(270))
  np.testing.assert_array_equal(
    arrays["validation"]["inputs"], arrays["train"]["inputs"][validation]
  )
  np.testing.assert_array_equal(arrays["train_fit"]["label"], arrays["train"]["label"][fit])
  labels = arrays["train"]["label"]
  for c in range(9):  # 30 per class -> 6 in validation each
    assert abs((labels[validation] == c).sum() - 0.2 * (labels == c).sum()) <= 1
  assert len(validation) == 54


def test_clean_split_is_deterministic_and_seeded(data_dir, vowels):
  del vowels
  again = builders.uea_sources("JapaneseVowels", data_dir=data_dir, splits=("validation",))
  other = builders.uea_sources(
    "JapaneseVowels",
    data_dir=data_dir,
    splits=("validation",),
    split_seed=1,
    validation_fraction=0.3,
  )
  first = builders.uea_sources("JapaneseVowels", data_dir=data_dir, splits=("validation",))
  np.testing.assert_array_equal(again["validation"].indices, first["validation"].indices)
  assert len(other["validation"]) == 81  # round(0.3 * 30) = 9 per class
  assert not np.array_equal(other["validation"].indices[:54], first["validation"].indices)


@hypothesis.given(
  labels=st.lists(st.integers(0, 4), min_size=2, max_size=60),
  fraction=st.floats(0.05, 0.95),
  seed=st.integers(0, 2**31),
)
def test_stratified_split_properties(labels, fraction, seed):
  labels = np.asarray(labels)
  fit, validation = uea.stratified_split(labels, fraction, seed)
  assert len(np.intersect1d(fit, validation)) == 0
  np.testing.assert_array_equal(np.sort(np.concatenate([fit, validation])), np.arange(len(labels)))
  for c in np.unique(labels):
    n_c, v_c = (labels == c).sum(), (labels[validation] == c).sum()
    assert v_c < n_c  # every class keeps a training example
    assert abs(v_c - fraction * n_c) <= 1
  again = uea.stratified_split(labels, fraction, seed)
  np.testing.assert_array_equal(again[1], validation)


def test_missing_manual_folder_names_expected_files(tmp_path):
  manual = tmp_path / "manual"
  with pytest.raises(FileNotFoundError) as info:
    builders.uea_sources("Heartbeat", data_dir=tmp_path / "tfds", manual_dir=manual)
  message = str(info.value)
  assert str(manual / "Heartbeat" / "Heartbeat_TRAIN.ts") in message
  assert str(manual / "Heartbeat" / "Heartbeat_TEST.ts") in message
  assert "timeseriesclassification.com" in message


def test_unknown_name_and_split_raise(tmp_path):
  with pytest.raises(ValueError, match="Unknown UEA data set"):
    builders.uea_sources("japanesevowels", data_dir=tmp_path)
  with pytest.raises(ValueError, match="Unknown UEA split"):
    builders.uea_sources("JapaneseVowels", data_dir=tmp_path, splits=("valid",))


_HEADER = """# comment line
@problemName Heartbeat
@timeStamps false
@missing true
@univariate false
@dimensions 2
@equalLength false
@classLabel true 2 9 10
@data
"""


def _write_ts(path: pathlib.Path, lines):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(_HEADER + "\n".join(lines) + "\n")


def test_manual_files_nan_handling_and_numeric_labels(tmp_path):
  """A hand-written data set in manual_dir: trailing NaN = padding, inner NaN = channel mean."""
  manual = tmp_path / "manual"
  _write_ts(
    manual / "Heartbeat" / "Heartbeat_TRAIN.ts",
    [
      "1,2,3,NaN:10,20,30,NaN:10",  # trailing all-NaN step -> length 3
      "3,?,5:30,40,50:9",  # '?' inside -> 0 after standardising, mask True
      "5,6:50,60:2",  # length 2
    ],
  )
  _write_ts(
    manual / "Heartbeat" / "Heartbeat_TEST.ts",
    [
      "1,2,3,4,5:10,20:10",  # channel 2 shorter: its steps 3-5 are NaN -> 0
    ],
  )
  sources = builders.uea_sources("Heartbeat", data_dir=tmp_path / "tfds", manual_dir=manual)
  train, test = _stack(sources["train"]), _stack(sources["test"])
  assert train["inputs"].shape == (3, 5, 2)  # T = 5, the longest over both splits
  np.testing.assert_array_equal(train["mask"].sum(1), [3, 3, 2])
  np.testing.assert_array_equal(train["label"], [2, 1, 0])  # classes sorted as numbers: 2, 9, 10
  c0 = np.array([1, 2, 3, 3, 5, 5, 6], float)  # train values of channel 0, the '?' left out
  c1 = np.array([10, 20, 30, 30, 40, 50, 50, 60], float)
  mean, std = np.array([c0.mean(), c1.mean()]), np.array([c0.std(), c1.std()])
  first = np.array([[1, 10], [2, 20], [3, 30]], float)
  np.testing.assert_allclose(train["inputs"][0, :3], (first - mean) / std, rtol=1e-5)
  assert train["inputs"][1, 1, 0] == 0.0 and train["mask"][1, 1]
  np.testing.assert_allclose(train["inputs"][1, 1, 1], (40 - mean[1]) / std[1], rtol=1e-5)
  np.testing.assert_array_equal(test["mask"][0], [True] * 5)
  np.testing.assert_allclose(
    test["inputs"][0, :, 0], (np.arange(1, 6) - mean[0]) / std[0], rtol=1e-5
  )
  np.testing.assert_array_equal(test["inputs"][0, 2:, 1], 0.0)


def test_test_label_unseen_in_train_raises(tmp_path):
  manual = tmp_path / "manual"
  _write_ts(manual / "Heartbeat" / "Heartbeat_TRAIN.ts", ["1,2:3,4:2", "1,3:3,5:9"])
  _write_ts(manual / "Heartbeat" / "Heartbeat_TEST.ts", ["1,2:3,4:10"])
  with pytest.raises(ValueError, match="do not occur in the training split"):
    uea.load_uea("Heartbeat", manual_dir=manual)


def test_timestamped_ts_rejected(tmp_path):
  path = tmp_path / "x.ts"
  path.write_text("@timeStamps true\n@classLabel true a\n@data\n(0,1):a\n")
  with pytest.raises(ValueError, match="timeStamps"):
    uea.read_ts(path)


def test_prepared_data_follow_their_source_files(tmp_path):
  """A prepared data set records its source files: an edited file or another manual_dir is
  prepared again, a manual_dir that does not exist is an error (never the bundled copy)."""
  tfds_dir, manual, other = tmp_path / "tfds", tmp_path / "manual", tmp_path / "other"
  rows = ["1,2,3:10,20,30:10", "3,4,5:30,40,50:9", "5,6:50,60:2"]
  for folder in (manual, other):
    _write_ts(folder / "Heartbeat" / "Heartbeat_TRAIN.ts", rows)
    _write_ts(folder / "Heartbeat" / "Heartbeat_TEST.ts", ["1,2,3,4,5:10,20:10"])

  def train_labels(manual_dir):
    sources = builders.uea_sources("Heartbeat", data_dir=tfds_dir, manual_dir=manual_dir)
    return _stack(sources["train"])["label"].tolist()

  assert train_labels(manual) == [2, 1, 0]
  _write_ts(manual / "Heartbeat" / "Heartbeat_TRAIN.ts", rows[:2] + ["5,6:50,60:10"])
  # Labels 10, 9, 10: classes 9 and 10 only, so 10 -> 1; the edited file, not the old copy.
  assert train_labels(manual) == [1, 0, 1]
  assert train_labels(other) == [2, 1, 0]  # another manual_dir: its own files
  with pytest.raises(FileNotFoundError, match="manual_dir .*missing does not exist"):
    builders.uea_sources("JapaneseVowels", data_dir=tfds_dir, manual_dir=tmp_path / "missing")


def test_identical_source_files_elsewhere_share_the_prepared_data(tmp_path, monkeypatch):
  """Two environments (e.g. two virtualenvs with aeon's bundled files) have the same bytes at
  different paths: the second uses the first one's preparation as it is."""
  tfds_dir = tmp_path / "tfds"
  rows = ["1,2,3:10,20,30:10", "3,4,5:30,40,50:9"]
  for env in ("env_a", "env_b"):
    _write_ts(tmp_path / env / "Heartbeat" / "Heartbeat_TRAIN.ts", rows)
    _write_ts(tmp_path / env / "Heartbeat" / "Heartbeat_TEST.ts", ["1,2,3,4,5:10,20:10"])
  first = builders.uea_sources("Heartbeat", data_dir=tfds_dir, manual_dir=tmp_path / "env_a")
  assert _stack(first["train"])["label"].tolist() == [1, 0]

  def no_preparation(*args, **kwargs):
    raise AssertionError("prepared again")

  monkeypatch.setattr(builders.UeaMultivariate, "download_and_prepare", no_preparation)
  second = builders.uea_sources("Heartbeat", data_dir=tfds_dir, manual_dir=tmp_path / "env_b")
  assert _stack(second["train"])["label"].tolist() == [1, 0]


def test_changed_source_files_never_replace_data_a_reader_holds(tmp_path):
  tfds_dir, manual = tmp_path / "tfds", tmp_path / "manual"
  rows = ["1,2,3:10,20,30:10", "3,4,5:30,40,50:9"]
  _write_ts(manual / "Heartbeat" / "Heartbeat_TRAIN.ts", rows)
  _write_ts(manual / "Heartbeat" / "Heartbeat_TEST.ts", ["1,2,3,4,5:10,20:10"])
  reader = builders.uea_sources("Heartbeat", data_dir=tfds_dir, manual_dir=manual)
  _write_ts(manual / "Heartbeat" / "Heartbeat_TRAIN.ts", rows[:1] + ["3,4,5:30,40,50:11"])
  with pytest.raises(ValueError, match="a running job reads them; prepare again once") as info:
    builders.uea_sources("Heartbeat", data_dir=tfds_dir, manual_dir=manual)
  assert "\n" not in str(info.value)
  assert _stack(reader["train"])["label"].tolist() == [1, 0]  # the old data, still readable
  del reader  # the job ended: now the data are prepared again from the new files
  again = builders.uea_sources("Heartbeat", data_dir=tfds_dir, manual_dir=manual)
  assert _stack(again["train"])["label"].tolist() == [0, 1]


def test_a_data_set_that_cannot_be_prepared_leaves_no_folder(tmp_path):
  """Source files missing from an existing manual folder: preparing fails, and the data folder
  it had created (with TFDS's metadata and the preparation's lock files) is gone."""
  manual = tmp_path / "manual"
  manual.mkdir()
  with pytest.raises(FileNotFoundError, match="Heartbeat_TRAIN.ts"):
    builders.uea_sources("Heartbeat", data_dir=tmp_path / "tfds", manual_dir=manual)
  assert not (tmp_path / "tfds").exists()


def test_preparing_says_one_line(tmp_path, capfd):
  """TFDS's progress bars, 'Downloading and preparing' lines and folder warnings are hidden."""
  from absl import logging as absl_logging

  verbosity = absl_logging.get_verbosity()
  builders.uea_sources("JapaneseVowels", data_dir=tmp_path / "tfds")
  out, err = capfd.readouterr()
  assert out == ""
  assert err.splitlines() == [
    f"preparing uea_multivariate/JapaneseVowels/1.0.0 into {tmp_path}/tfds/uea_multivariate/"
    "JapaneseVowels/1.0.0 (once; later runs reuse it; `make clean-data` removes prepared data)"
  ]
  assert absl_logging.get_verbosity() == verbosity
