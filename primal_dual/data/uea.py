"""The UEA multivariate time-series archive (docs/maths.md §4): `.ts` reading, preprocessing, splits.

Pure NumPy; the TFDS builder and the sources (``uea_sources``, ``uea_info``) are in
:mod:`primal_dual.data.builders`, which imports this module (never the other way round).

Where the files come from
  JapaneseVowels and BasicMotions ship inside the installed ``aeon`` package
  (``aeon/datasets/data/<Name>/<Name>_{TRAIN,TEST}.ts``) and work offline. Every other data set
  is read from a folder the user downloaded (the TFDS ``manual_dir``), laid out as
  ``<manual_dir>/<Name>/<Name>_TRAIN.ts`` and ``<manual_dir>/<Name>/<Name>_TEST.ts``; the files come
  from https://www.timeseriesclassification.com (the Multivariate ``.ts`` archive, or one data set
  at a time from ``https://timeseriesclassification.com/aeon-toolkit/<Name>.zip``).

Preprocessing (every choice below is deliberate; bump ``builders.UeaMultivariate.VERSION`` when
changing one, so prepared copies are rebuilt):
  * Length of a series: trailing time steps where every channel is NaN are padding (the archive
    pads some unequal-length sets with NaN); the length is the last step with any finite value.
  * ``T`` = the longest length over all splits (train and test), so train and test share a shape.
  * Per-channel standardisation ``(x - mean) / std`` with NaN-aware statistics of the TRAIN split
    only, over real (unpadded) steps, computed in float64; ``std`` is the population standard
    deviation and a channel with zero (or no) spread keeps ``std = 1``. The test split never
    contributes. Under the clean protocol the validation part of TRAIN does contribute to these two
    label-free numbers per channel (the test split still never does).
  * NaNs inside a series (a missing reading, or a channel shorter than the others in the same case)
    become 0 after standardisation, i.e. the training mean of that channel; the mask stays True
    there, because the other channels of that step are real. Padding is 0 with mask False.
  * Labels: the class names of TRAIN, sorted numerically when every name is a number (so '10'
    follows '9') and as strings otherwise, mapped to ``0..K-1``. A test label absent from TRAIN is
    an error.

Record of every split: ``{'inputs': float32 [T, C], 'mask': bool [T], 'label': int32 []}``.

Splits: ``train`` and ``test`` as in the archive; for the clean protocol ``train_fit`` and
``validation``, a deterministic stratified carve of ``train`` (:func:`stratified_split`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Any, Sequence

import numpy as np

# The 30 data sets of the UEA multivariate archive (Bagnall et al. 2018), spelled as it does.
ARCHIVE_DATASETS: tuple[str, ...] = (
  "ArticularyWordRecognition",
  "AtrialFibrillation",
  "BasicMotions",
  "CharacterTrajectories",
  "Cricket",
  "DuckDuckGeese",
  "EigenWorms",
  "Epilepsy",
  "EthanolConcentration",
  "ERing",
  "FaceDetection",
  "FingerMovements",
  "HandMovementDirection",
  "Handwriting",
  "Heartbeat",
  "InsectWingbeat",
  "JapaneseVowels",
  "Libras",
  "LSST",
  "MotorImagery",
  "NATOPS",
  "PenDigits",
  "PEMS-SF",
  "PhonemeSpectra",
  "RacketSports",
  "SelfRegulationSCP1",
  "SelfRegulationSCP2",
  "SpokenArabicDigits",
  "StandWalkJump",
  "UWaveGestureLibrary",
)
# The ten data sets of the standard Transformer protocol (docs/maths.md §4).
PROTOCOL_DATASETS: tuple[str, ...] = (
  "EthanolConcentration",
  "FaceDetection",
  "Handwriting",
  "Heartbeat",
  "JapaneseVowels",
  "PEMS-SF",
  "SelfRegulationSCP1",
  "SelfRegulationSCP2",
  "SpokenArabicDigits",
  "UWaveGestureLibrary",
)
# Shipped as .ts files inside the installed aeon package: no download needed.
BUNDLED_DATASETS: tuple[str, ...] = ("JapaneseVowels", "BasicMotions")

ARCHIVE_SPLITS: tuple[str, ...] = ("train", "test")
CLEAN_SPLITS: tuple[str, ...] = ("train_fit", "validation")
ALL_SPLITS: tuple[str, ...] = ARCHIVE_SPLITS + CLEAN_SPLITS

DOWNLOAD_HELP = (
  "Download the Multivariate .ts archive from https://www.timeseriesclassification.com "
  "(or one data set as https://timeseriesclassification.com/aeon-toolkit/<Name>.zip) and "
  "unzip it so that each data set has its own folder <manual_dir>/<Name>/ holding "
  "<Name>_TRAIN.ts and <Name>_TEST.ts; pass that folder as manual_dir (TFDS default: "
  "<data_dir>/downloads/manual)."
)


def check_name(name: str) -> str:
  """Returns ``name`` if it is a data set of the archive, else raises ValueError."""
  if name not in ARCHIVE_DATASETS:
    raise ValueError(
      f"Unknown UEA data set {name!r}; expected one of the archive's names (case matters): "
      f"{', '.join(ARCHIVE_DATASETS)}."
    )
  return name


# ------------------------------------------------------------------------------------------------
# .ts files


@dataclasses.dataclass(frozen=True)
class TsFile:
  """Contents of one `.ts` file.

  Attributes:
    series: one float64 array ``[C, L_i]`` per case, NaN where the file says ``?``/``NaN`` or where
      a channel is shorter than the longest channel of its case.
    labels: str ``[N]``, the class label of each case as written in the file.
    header: the ``@key value`` lines, keys lower-cased without ``@``.
  """

  series: list[np.ndarray]
  labels: np.ndarray
  header: dict[str, str]


def _parse_channel(text: str) -> np.ndarray:
  text = text.strip()
  if not text:
    return np.zeros((0,), np.float64)
  # NumPy parses "nan" in any case; the archive writes missing values as "?".
  return np.asarray(text.replace("?", "nan").split(","), dtype=np.float64)


def _stack_channels(channels: Sequence[np.ndarray]) -> np.ndarray:
  length = max(len(c) for c in channels)
  out = np.full((len(channels), length), np.nan, np.float64)
  for i, channel in enumerate(channels):
    out[i, : len(channel)] = channel
  return out


def read_ts(path: str | os.PathLike[str]) -> TsFile:
  """Reads a classification `.ts` file of the UEA/UCR archive (no time stamps).

  Args:
    path: the file.

  Returns:
    The parsed :class:`TsFile`.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: the file uses time stamps, has no class labels, or is malformed (the message
      gives the line number).
  """
  path = pathlib.Path(path)
  header: dict[str, str] = {}
  series, labels = [], []
  in_data = False
  num_channels = None
  with path.open("r", encoding="utf-8", errors="replace") as f:
    for line_number, line in enumerate(f, start=1):
      line = line.strip()
      if not line or line.startswith("#"):
        continue
      if not in_data:
        if not line.startswith("@"):
          raise ValueError(
            f"{path}:{line_number}: expected a @header line before @data, got {line[:60]!r}."
          )
        key, _, value = line[1:].partition(" ")
        key = key.lower()
        if key == "data":
          in_data = True
          if header.get("timestamps", "false").lower() == "true":
            raise ValueError(f"{path}: .ts files with @timeStamps true are not supported.")
          if not header.get("classlabel", "false").lower().startswith("true"):
            raise ValueError(
              f"{path}: no '@classLabel true ...' header; only classification files are supported."
            )
        else:
          header[key] = value.strip()
        continue
      *channel_texts, label = line.split(":")
      if not channel_texts:
        raise ValueError(
          f"{path}:{line_number}: a case needs channels and a label separated by ':'."
        )
      if num_channels is None:
        num_channels = len(channel_texts)
      elif len(channel_texts) != num_channels:
        raise ValueError(
          f"{path}:{line_number}: {len(channel_texts)} channels where earlier "
          f"cases had {num_channels}."
        )
      try:
        series.append(_stack_channels([_parse_channel(c) for c in channel_texts]))
      except ValueError as e:
        raise ValueError(f"{path}:{line_number}: cannot parse a value ({e}).") from None
      labels.append(label.strip())
  if not series:
    raise ValueError(f"{path}: no cases after @data.")
  declared = header.get("dimensions")
  if declared is not None and declared.isdigit() and int(declared) != num_channels:
    raise ValueError(
      f"{path}: @dimensions says {declared} but the cases have {num_channels} channels."
    )
  return TsFile(series=series, labels=np.asarray(labels, dtype=str), header=header)


def check_manual_dir(name: str, manual_dir: str | os.PathLike[str] | None) -> None:
  """Raises FileNotFoundError for a user's ``manual_dir`` that does not exist, naming the files
  it should hold (never falling back to a bundled copy the user did not ask for)."""
  if manual_dir is None or pathlib.Path(manual_dir).is_dir():
    return
  expected = [
    str(pathlib.Path(manual_dir) / name / f"{name}_{s.upper()}.ts") for s in ARCHIVE_SPLITS
  ]
  raise FileNotFoundError(
    f"manual_dir {manual_dir} does not exist; UEA data set {name} would be read from "
    f"{expected[0]} and {expected[1]}. " + DOWNLOAD_HELP
  )


def ts_paths(
  name: str, manual_dir: str | os.PathLike[str] | None = None
) -> dict[str, pathlib.Path]:
  """Returns ``{'train': path, 'test': path}`` of a data set's `.ts` files.

  Bundled data sets (:data:`BUNDLED_DATASETS`) are found inside the installed aeon package unless
  ``manual_dir`` holds them; every other one must be under ``manual_dir``.

  Raises:
    ValueError: ``name`` is not an archive data set.
    FileNotFoundError: a file is missing; the message names every expected path and where to get it.
  """
  check_name(name)
  candidates = []
  if manual_dir is not None:
    candidates.append(pathlib.Path(manual_dir) / name)
  if name in BUNDLED_DATASETS:
    import importlib_resources

    # `import aeon` alone is cheap; aeon.datasets is not, so walk from the top-level package.
    candidates.append(
      pathlib.Path(str(importlib_resources.files("aeon"))) / "datasets" / "data" / name
    )
  for folder in candidates:
    paths = {split: folder / f"{name}_{split.upper()}.ts" for split in ARCHIVE_SPLITS}
    if all(p.is_file() for p in paths.values()):
      return paths
  if manual_dir is None:
    raise FileNotFoundError(
      f"UEA data set {name} is not bundled with aeon and no manual_dir was given. " + DOWNLOAD_HELP
    )
  expected = [
    str(pathlib.Path(manual_dir) / name / f"{name}_{s.upper()}.ts") for s in ARCHIVE_SPLITS
  ]
  raise FileNotFoundError(
    f"UEA data set {name}: expected the files {expected[0]} and {expected[1]}, which do not both "
    "exist. " + DOWNLOAD_HELP
  )


# ------------------------------------------------------------------------------------------------
# Preprocessing (pure NumPy)


def series_length(series: np.ndarray) -> int:
  """Real steps of ``series [C, L]``: trailing steps where every channel is NaN are padding."""
  has_value = ~np.all(np.isnan(series), axis=0)
  return int(np.flatnonzero(has_value)[-1] + 1) if has_value.any() else 0


def channel_statistics(
  series: Sequence[np.ndarray], lengths: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
  """NaN-aware per-channel mean and population std over the real steps of ``series``.

  Args:
    series: float arrays ``[C, L_i]``.
    lengths: real length of each series (steps beyond it are ignored).

  Returns:
    ``(mean, std)``, float64 ``[C]``; ``std`` is 1 where a channel has no spread or no finite
    value (so standardising leaves it centred instead of dividing by zero), ``mean`` 0 where a
    channel has no finite value.
  """
  values = np.concatenate([s[:, :n] for s, n in zip(series, lengths)], axis=1)  # [C, sum L]
  finite = np.isfinite(values)
  count = finite.sum(axis=1)
  safe_count = np.maximum(count, 1)
  filled = np.where(finite, values, 0.0)
  mean = filled.sum(axis=1) / safe_count
  var = (np.where(finite, values - mean[:, None], 0.0) ** 2).sum(axis=1) / safe_count
  std = np.sqrt(var)
  std = np.where((count == 0) | (std <= 1e-12 * np.maximum(np.abs(mean), 1.0)), 1.0, std)
  return mean, std


def standardise_and_pad(
  series: Sequence[np.ndarray],
  lengths: Sequence[int],
  mean: np.ndarray,
  std: np.ndarray,
  max_length: int,
) -> tuple[np.ndarray, np.ndarray]:
  """Standardises each series with ``mean``/``std`` and pads it to ``max_length``.

  Args:
    series: float arrays ``[C, L_i]``.
    lengths: real length of each series, ``<= max_length``.
    mean, std: float ``[C]``.
    max_length: the padded length ``T``.

  Returns:
    ``inputs`` float32 ``[N, T, C]`` (NaN and padding are 0) and ``mask`` bool ``[N, T]``
    (True on the first ``lengths[i]`` steps).
  """
  num_channels = len(mean)
  inputs = np.zeros((len(series), max_length, num_channels), np.float32)
  mask = np.zeros((len(series), max_length), bool)
  for i, (s, n) in enumerate(zip(series, lengths)):
    if n > max_length:
      raise ValueError(f"series {i} has {n} steps, more than max_length={max_length}.")
    z = (s[:, :n].T - mean) / std  # [n, C]
    inputs[i, :n] = np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0)
    mask[i, :n] = True
  return inputs, mask


def sorted_class_names(labels: Sequence[str]) -> tuple[str, ...]:
  """Unique labels, sorted numerically if every one is a number, else as strings."""
  unique = set(str(label) for label in labels)
  try:
    return tuple(sorted(unique, key=lambda s: (float(s), s)))
  except ValueError:
    return tuple(sorted(unique))


def encode_labels(labels: Sequence[str], class_names: Sequence[str]) -> np.ndarray:
  """Maps label strings to their index in ``class_names``; int32 ``[N]``.

  Raises:
    ValueError: a label is not in ``class_names``.
  """
  index = {name: i for i, name in enumerate(class_names)}
  unknown = sorted(set(str(label) for label in labels) - set(index))
  if unknown:
    raise ValueError(
      f"labels {unknown} do not occur in the training split (classes {list(class_names)})."
    )
  return np.asarray([index[str(label)] for label in labels], dtype=np.int32)


def stratified_split(
  labels: np.ndarray, validation_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Deterministic stratified carve of a labelled split into fit and validation indices.

  Each class contributes ``round(validation_fraction * n_c)`` of its ``n_c`` examples (half up,
  at most ``n_c - 1``, so every class keeps a training example), chosen by a permutation drawn from
  ``numpy.random.default_rng(seed)``. The same labels, fraction and seed always give the same carve.

  Args:
    labels: int ``[N]`` class indices.
    validation_fraction: in (0, 1).
    seed: non-negative integer.

  Returns:
    ``(fit_indices, validation_indices)``: sorted int64 arrays, disjoint, covering ``0..N-1``.
  """
  if not 0.0 < validation_fraction < 1.0:
    raise ValueError(f"validation_fraction must be in (0, 1); got {validation_fraction}.")
  labels = np.asarray(labels)
  rng = np.random.default_rng(seed)
  validation = []
  for label in np.unique(labels):  # sorted: the draw order does not depend on label order
    members = np.flatnonzero(labels == label)
    count = min(int(math.floor(validation_fraction * len(members) + 0.5)), len(members) - 1)
    validation.append(rng.permutation(members)[:count])
  validation_indices = np.sort(np.concatenate(validation)).astype(np.int64)
  fit_indices = np.setdiff1d(np.arange(len(labels)), validation_indices).astype(np.int64)
  return fit_indices, validation_indices


# ------------------------------------------------------------------------------------------------
# A whole data set


@dataclasses.dataclass(frozen=True)
class UeaArrays:
  """A preprocessed UEA data set held in memory.

  Attributes:
    name: archive name.
    splits: ``{'train': record_arrays, 'test': record_arrays}`` with record arrays
      ``{'inputs': float32 [N, T, C], 'mask': bool [N, T], 'label': int32 [N]}``.
    class_names: the TRAIN class names in label order.
    mean, std: float64 ``[C]`` TRAIN statistics used to standardise every split.
  """

  name: str
  splits: dict[str, dict[str, np.ndarray]]
  class_names: tuple[str, ...]
  mean: np.ndarray
  std: np.ndarray

  def metadata(self) -> dict[str, Any]:
    """JSON-friendly summary, stored with the prepared TFDS data set."""
    train, test = self.splits["train"], self.splits["test"]
    return dict(
      name=self.name,
      num_classes=len(self.class_names),
      num_channels=int(train["inputs"].shape[2]),
      max_length=int(train["inputs"].shape[1]),
      num_train=int(len(train["label"])),
      num_test=int(len(test["label"])),
      class_names=list(self.class_names),
      channel_mean=[float(x) for x in self.mean],
      channel_std=[float(x) for x in self.std],
      train_labels=[int(x) for x in train["label"]],
    )


def load_uea(name: str, *, manual_dir: str | os.PathLike[str] | None = None) -> UeaArrays:
  """Reads and preprocesses a UEA data set (see the module docstring for every choice).

  Raises:
    ValueError: unknown name, malformed file, or TRAIN and TEST disagree on channels or labels.
    FileNotFoundError: the `.ts` files are not where they should be (message says where).
  """
  paths = ts_paths(name, manual_dir)
  files = {split: read_ts(path) for split, path in paths.items()}
  channels = {split: f.series[0].shape[0] for split, f in files.items()}
  if len(set(channels.values())) != 1:
    raise ValueError(f"UEA data set {name}: splits disagree on the number of channels {channels}.")
  lengths = {split: [series_length(s) for s in f.series] for split, f in files.items()}
  max_length = max(max(v) for v in lengths.values())
  mean, std = channel_statistics(files["train"].series, lengths["train"])
  class_names = sorted_class_names(files["train"].labels)
  splits = {}
  for split, f in files.items():
    inputs, mask = standardise_and_pad(f.series, lengths[split], mean, std, max_length)
    splits[split] = dict(inputs=inputs, mask=mask, label=encode_labels(f.labels, class_names))
  return UeaArrays(name=name, splits=splits, class_names=class_names, mean=mean, std=std)


# ------------------------------------------------------------------------------------------------
# Random-access sources (TFDS-backed)
