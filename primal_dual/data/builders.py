"""TFDS builders for the UEA archive and ListOps, stored as array_record, read without TensorFlow.

What was checked with tensorflow-datasets 4.9.10, TensorFlow absent:
  * ``GeneratorBasedBuilder.download_and_prepare`` with ``file_format='array_record'`` works, and
    ``builder.as_data_source()`` returns random-access sources that decode to NumPy.
  * ``tfds.features.Tensor`` with more than one unknown dimension needs ``encoding='zlib'`` (or
    ``'bytes'``), which also works without TF; ``Scalar`` decodes to a Python ``int``, so the
    sources here cast every field to its declared NumPy dtype.
  * ``self.dataset_info_from_configs`` reads metadata files next to the builder's module (there are
    none), so ``_info`` builds ``tfds.core.DatasetInfo`` directly.
  * ``DatasetInfo(metadata=tfds.core.MetadataDict())`` filled in ``_split_generators`` is saved
    with the data and restored when a prepared builder is opened: it carries the UEA statistics,
    class names and TRAIN labels (used for the clean-protocol carve without reading every record).
  * ``disable_shuffling=True`` keeps the generator's order (TFDS otherwise orders records by a
    hash of their key), so record ``i`` of ``train`` is case ``i`` of the ``.ts`` file.
  * ``dl_manager.manual_dir`` raises AssertionError when the folder is missing or empty; the UEA
    builder turns that into the FileNotFoundError of :func:`primal_dual.data.uea.ts_paths`.

The builders are registered with TFDS as ``uea_multivariate`` (one config per archive name) and
``listops`` (configs ``full``, ``short``, ``tiny``; other seeds get a custom config
``<preset>_seed<n>``), so after importing this module ``tfds.data_source('uea_multivariate/
JapaneseVowels', data_dir=...)`` also works. Preparing is not safe to run from several processes at
once into the same ``data_dir``: prepare once (e.g. on process 0) before a multi-host run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from primal_dual.data import listops
from primal_dual.data import uea
from primal_dual.data.sources import DecodedSource, SubsetSource

FILE_FORMAT = "array_record"


def _field_dtypes(features: tfds.features.FeaturesDict) -> dict[str, np.dtype]:
  return {k: np.dtype(f.np_dtype) for k, f in features.items()}


def decoded_sources(
  builder: tfds.core.DatasetBuilder, splits: Sequence[str]
) -> dict[str, DecodedSource]:
  """``{split: DecodedSource}`` of a prepared array_record builder."""
  available = set(builder.info.splits.keys())
  missing = [s for s in splits if s not in available]
  if missing:
    raise ValueError(
      f"{builder.info.full_name} has no split(s) {missing}; it has {sorted(available)}."
    )
  pin = _ReaderPin(_readers_path(builder))
  raw = builder.as_data_source(split=list(splits))
  dtypes = _field_dtypes(builder.info.features)
  return {
    s: DecodedSource(r, dtypes, f"{builder.info.full_name}, split={s}", pin)
    for s, r in zip(splits, raw)
  }


SOURCE_FINGERPRINT_FILE = "source_fingerprint.json"


def file_fingerprint(paths: Mapping[str, os.PathLike[str] | str]) -> dict[str, dict[str, Any]]:
  """``{name: {'file', 'size', 'sha256'}}`` of source files: their content and file name, never
  their folder, so identical files in two environments (e.g. aeon's bundled copy in two
  virtualenvs) share one preparation."""
  out = {}
  for name, path in sorted(paths.items()):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
      for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    out[name] = {
      "file": os.path.basename(path),
      "size": os.path.getsize(path),
      "sha256": digest.hexdigest(),
    }
  return out


def _content(fingerprint: dict | None) -> dict | None:
  """What two fingerprints are compared on: size and hash (older ones also stored a path)."""
  if fingerprint is None:
    return None
  return {name: (e.get("size"), e.get("sha256")) for name, e in fingerprint.items()}


class _ReaderPin:
  """A shared file lock on a prepared data set, held while sources read it: a preparation that
  would replace the files refuses while any process holds one. Pickled copies (loader workers)
  hold nothing; the parent's pin covers them."""

  def __init__(self, path: str):
    self._file = open(path, "a")
    fcntl.flock(self._file, fcntl.LOCK_SH)  # waits for a preparation in progress

  def __getstate__(self):
    return {}

  def __setstate__(self, state):
    self._file = None

  def __del__(self):
    if getattr(self, "_file", None) is not None:
      self._file.close()


def _readers_path(builder) -> str:
  folder, version = os.path.split(builder.data_dir)
  return os.path.join(folder, f".{version}.readers")


def _stored_fingerprint(builder) -> dict | None:
  path = os.path.join(builder.data_dir, SOURCE_FINGERPRINT_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _is_current(builder, fingerprint: dict | None) -> bool:
  """Prepared from these sources (``fingerprint`` None: sources unknown, any preparation is)."""
  return builder.is_prepared() and (
    fingerprint is None or _content(_stored_fingerprint(builder)) == _content(fingerprint)
  )


def prepared_builder(
  builder_cls: type[tfds.core.GeneratorBasedBuilder],
  config: str | tfds.core.BuilderConfig,
  *,
  data_dir: str | os.PathLike[str] | None = None,
  manual_dir: str | os.PathLike[str] | None = None,
  source_fingerprint: Callable[[], dict | None] | None = None,
) -> tfds.core.GeneratorBasedBuilder:
  """Opens ``builder_cls`` with ``config`` in ``data_dir``, preparing it first if needed.

  Preparation holds an exclusive file lock next to the data, so processes that start at once
  (a grid's ``--jobs``, several hosts on one file system) prepare a data set once and the others
  wait for it, instead of writing the same folder concurrently.

  ``source_fingerprint()`` describes the files a preparation reads (``file_fingerprint``; None when
  they cannot be found, e.g. deleted after preparing). It is stored beside the prepared data; a
  data set prepared from other files (edited, or another ``manual_dir``), or prepared before
  fingerprints were kept, is prepared again, but never under a process that reads it (its
  sources hold a shared lock, `_ReaderPin`): that is refused with a ValueError saying what to do.
  """

  def open_builder():
    return builder_cls(
      config=config,
      data_dir=None if data_dir is None else os.fspath(data_dir),
      file_format=FILE_FORMAT,
    )

  with _quiet_tfds():
    return _open_or_prepare(open_builder, data_dir, manual_dir, source_fingerprint)


@contextlib.contextmanager
def _quiet_tfds() -> Iterator[None]:
  """Hides TFDS's progress bars, its 'Downloading and preparing' lines (stdout) and its warnings
  about the folder it is about to fill: the one line ``preparing X into Y`` says what happens."""
  from absl import logging as absl_logging
  from tensorflow_datasets.core.utils import tqdm_utils

  verbosity, bars = absl_logging.get_verbosity(), getattr(tqdm_utils, "_active", True)
  absl_logging.set_verbosity(absl_logging.ERROR)
  tfds.display_progress_bar(False)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      yield
  finally:
    tfds.display_progress_bar(bars)
    absl_logging.set_verbosity(verbosity)


def _open_or_prepare(open_builder, data_dir, manual_dir, source_fingerprint):
  """``prepared_builder``'s work: the builder, prepared first unless current."""
  fingerprint = None if source_fingerprint is None else source_fingerprint()
  builder = open_builder()
  if _is_current(builder, fingerprint):
    return builder
  # A failed preparation (missing source files) leaves no folder it created behind.
  created = _outermost_missing_folder(
    builder.data_dir, os.fspath(data_dir) if data_dir is not None else None
  )
  try:
    _prepare_under_lock(open_builder, fingerprint, manual_dir)
  except BaseException:
    if created is not None:
      shutil.rmtree(created, ignore_errors=True)
    raise
  return open_builder()


def _outermost_missing_folder(folder: str, root: str | None) -> str | None:
  """The outermost of ``folder`` and its parents (up to ``root``, or the data set's name
  folder two levels up when None) that does not exist yet; None if ``folder`` exists."""
  stop = os.path.abspath(root) if root else os.path.dirname(os.path.dirname(folder))
  missing, current = None, os.path.abspath(folder)
  while not os.path.exists(current):
    missing = current
    if current == stop or os.path.dirname(current) == current:
      break
    current = os.path.dirname(current)
  return missing


def _prepare_under_lock(open_builder, fingerprint: dict | None, manual_dir) -> None:
  """Prepares the data set of ``open_builder()`` unless another process did it meanwhile, under
  the exclusive lock of ``prepared_builder``."""
  builder = open_builder()
  lock_path = os.path.join(os.path.dirname(builder.data_dir), ".prepare.lock")
  os.makedirs(os.path.dirname(lock_path), exist_ok=True)
  with open(lock_path, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    # Reopened: a builder made before another process finished has no prepared metadata.
    builder = open_builder()
    if not _is_current(builder, fingerprint):
      with open(_readers_path(builder), "a") as readers:
        if builder.is_prepared():  # prepared from other source files: prepare again
          try:  # only when no process reads the old files (their sources hold shared locks)
            fcntl.flock(readers, fcntl.LOCK_EX | fcntl.LOCK_NB)
          except BlockingIOError:
            raise ValueError(
              f"the prepared data in {builder.data_dir} came from other source files and a "
              "running job reads them; prepare again once it has finished, or set another "
              "data.data_dir"
            ) from None
          shutil.rmtree(builder.data_dir)
          builder = open_builder()
        download_config = tfds.download.DownloadConfig(
          manual_dir=None if manual_dir is None else os.fspath(manual_dir)
        )
        print(
          f"preparing {builder.info.full_name} into {builder.data_dir} (once; later runs reuse "
          "it; `make clean-data` removes prepared data)",
          file=sys.stderr,
          flush=True,
        )
        builder.download_and_prepare(download_config=download_config)
        if fingerprint is not None:
          with open(os.path.join(builder.data_dir, SOURCE_FINGERPRINT_FILE), "w") as f:
            json.dump(fingerprint, f, indent=1, sort_keys=True)


def uea_fingerprint(name: str, manual_dir) -> Callable[[], dict | None]:
  """``source_fingerprint`` of a UEA data set: its two ``.ts`` files, or None if they are gone
  (a prepared copy is then used as it is; without one, preparing reports the missing files)."""

  def fingerprint():
    uea.check_manual_dir(name, manual_dir)
    try:
      return file_fingerprint(uea.ts_paths(name, manual_dir))
    except FileNotFoundError:
      return None

  return fingerprint


# ------------------------------------------------------------------------------------------------
# UEA


def _uea_features() -> tfds.features.FeaturesDict:
  # T and C differ per data set and are only known after reading the files, hence unknown dims
  # (which need zlib/bytes encoding); every record of one data set has the same [T, C].
  return tfds.features.FeaturesDict(
    {
      "inputs": tfds.features.Tensor(shape=(None, None), dtype=np.float32, encoding="zlib"),
      "mask": tfds.features.Tensor(shape=(None,), dtype=np.bool_, encoding="zlib"),
      "label": tfds.features.Scalar(dtype=np.int32),
    }
  )


class UeaMultivariate(tfds.core.GeneratorBasedBuilder):
  """UEA multivariate archive, one config per data set, preprocessed by :func:`uea.load_uea`."""

  name = "uea_multivariate"
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {
    "1.0.0": "Train-statistics standardisation, NaN -> channel mean, padded to the "
    "longest series with a mask."
  }
  BUILDER_CONFIGS = [
    tfds.core.BuilderConfig(name=n, description=f"UEA {n}") for n in uea.ARCHIVE_DATASETS
  ]
  MANUAL_DOWNLOAD_INSTRUCTIONS = uea.DOWNLOAD_HELP

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description="UEA multivariate time-series classification (.ts archive).",
      features=_uea_features(),
      homepage="https://www.timeseriesclassification.com",
      disable_shuffling=True,
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
    name = self.builder_config.name
    try:
      manual_dir = dl_manager.manual_dir
    except AssertionError:
      # TFDS asserts on a missing or empty folder. Bundled sets do not need it, and for the others
      # ts_paths reports the exact files expected there, which says more than TFDS's message.
      manual_dir = dl_manager._manual_dir
    data = uea.load_uea(name, manual_dir=manual_dir)
    self.info.metadata.update(data.metadata())
    return {split: self._generate_examples(arrays) for split, arrays in data.splits.items()}

  def _generate_examples(
    self, arrays: Mapping[str, np.ndarray]
  ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    for i in range(len(arrays["label"])):
      yield i, {k: v[i] for k, v in arrays.items()}


# ------------------------------------------------------------------------------------------------
# ListOps


@dataclasses.dataclass(eq=False, kw_only=True)
class ListOpsConfig(tfds.core.BuilderConfig):
  """A ListOps preset plus the generator seed (see :func:`listops.generate_splits`)."""

  seed: int = 0
  min_length: int = 0
  max_length: int = 0
  num_train: int = 0
  num_validation: int = 0
  num_test: int = 0
  max_depth: int = 10
  max_args: int = 10

  def generator_arguments(self) -> dict[str, int]:
    """The fields added to ``BuilderConfig``'s: the arguments of ``listops.generate_splits``."""
    inherited = {field.name for field in dataclasses.fields(tfds.core.BuilderConfig)}
    return {
      field.name: getattr(self, field.name)
      for field in dataclasses.fields(self)
      if field.name not in inherited
    }


def listops_config(preset: str, seed: int = 0) -> ListOpsConfig:
  """The config of ``preset`` (a key of ``listops.PRESETS``) generated with ``seed``."""
  if preset not in listops.PRESETS:
    raise ValueError(f"Unknown ListOps preset {preset!r}; choose from {sorted(listops.PRESETS)}.")
  if seed < 0:
    raise ValueError(f"ListOps seed must be >= 0, got {seed}.")
  name = preset if seed == 0 else f"{preset}_seed{seed}"
  return ListOpsConfig(
    name=name,
    description=f"ListOps preset {preset}, seed {seed}",
    seed=seed,
    **listops.PRESETS[preset],
  )


class ListOps(tfds.core.GeneratorBasedBuilder):
  """ListOps expressions from :func:`listops.generate_splits`, padded to the preset's max_length."""

  name = "listops"
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Vectorised seeded generator, deduplicated and sorted before split."}
  BUILDER_CONFIGS = [listops_config(preset) for preset in listops.PRESETS]

  def _info(self) -> tfds.core.DatasetInfo:
    length = self.builder_config.max_length
    return tfds.core.DatasetInfo(
      builder=self,
      description="ListOps (Long Range Arena task), token ids padded with PAD_ID.",
      features=tfds.features.FeaturesDict(
        {
          "inputs": tfds.features.Tensor(shape=(length,), dtype=np.int32, encoding="zlib"),
          "mask": tfds.features.Tensor(shape=(length,), dtype=np.bool_, encoding="zlib"),
          "label": tfds.features.Scalar(dtype=np.int32),
        }
      ),
      disable_shuffling=True,
      metadata=tfds.core.MetadataDict(
        vocab_size=listops.VOCAB_SIZE, pad_id=listops.PAD_ID, num_classes=listops.NUM_CLASSES
      ),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
    del dl_manager  # generated, nothing to download
    splits = listops.generate_splits(**self.builder_config.generator_arguments())
    return {split: self._generate_examples(examples) for split, examples in splits.items()}

  def _generate_examples(
    self, examples: Sequence[tuple[np.ndarray, int]]
  ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    length = self.builder_config.max_length
    for i, (ids, label) in enumerate(examples):
      yield i, pad_tokens(ids, label, length)


def pad_tokens(ids: np.ndarray, label: int, length: int) -> dict[str, np.ndarray]:
  """One ListOps record: ``inputs`` int32 ``[length]`` padded with PAD_ID, ``mask``, ``label``."""
  ids = np.asarray(ids, np.int32)
  if ids.ndim != 1 or len(ids) > length:
    raise ValueError(f"token ids must be 1-D with at most {length} entries; got shape {ids.shape}.")
  inputs = np.full((length,), listops.PAD_ID, np.int32)
  inputs[: len(ids)] = ids
  return {"inputs": inputs, "mask": np.arange(length) < len(ids), "label": np.int32(label)}


def listops_sources(
  preset: str,
  *,
  seed: int = 0,
  data_dir: str | os.PathLike[str] | None = None,
  splits: Sequence[str] = ("train", "validation", "test"),
) -> dict[str, DecodedSource]:
  """Random-access ListOps sources, generated and prepared with TFDS on first use.

  Args:
    preset: ``'full'`` (LRA: 96k/2k/2k, 500-2000 tokens), ``'short'`` or ``'tiny'``.
    seed: generator seed (0 is the registered config; others use ``<preset>_seed<n>``).
    data_dir: TFDS data folder (default: TFDS's).
    splits: any of ``'train', 'validation', 'test'``.

  Returns:
    ``{split: source}``, records ``{'inputs': int32 [max_length], 'mask': bool [max_length],
    'label': int32 []}``.
  """
  config = listops_config(preset, seed)
  registered = ListOps.builder_configs.get(config.name)
  builder = prepared_builder(ListOps, registered or config, data_dir=data_dir)
  return decoded_sources(builder, list(splits))


def _prepared_uea(name: str, data_dir, manual_dir) -> tfds.core.GeneratorBasedBuilder:
  """The UEA builder of ``name``, prepared from (and kept in step with) its ``.ts`` files."""
  uea.check_name(name)
  return prepared_builder(
    UeaMultivariate,
    name,
    data_dir=data_dir,
    manual_dir=manual_dir,
    source_fingerprint=uea_fingerprint(name, manual_dir),
  )


def uea_sources(
  name: str,
  *,
  data_dir: str | os.PathLike[str] | None = None,
  manual_dir: str | os.PathLike[str] | None = None,
  splits: Sequence[str] = uea.ARCHIVE_SPLITS,
  validation_fraction: float = 0.2,
  split_seed: int = 0,
) -> dict[str, Any]:
  """Random-access sources of a UEA data set, prepared with TFDS on first use.

  Args:
    name: archive name, e.g. ``'JapaneseVowels'``.
    data_dir: TFDS data folder (default: TFDS's, ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
    manual_dir: folder holding ``<Name>/<Name>_{TRAIN,TEST}.ts`` for non-bundled data sets
      (default: ``<data_dir>/downloads/manual``).
    splits: any of ``'train', 'test', 'train_fit', 'validation'``.
    validation_fraction, split_seed: the clean-protocol carve (:func:`stratified_split`); only used
      for ``train_fit``/``validation``.

  Returns:
    ``{split: source}``; a source has ``__len__`` and ``__getitem__`` returning
    ``{'inputs': float32 [T, C], 'mask': bool [T], 'label': int32 []}`` as NumPy arrays.
  """
  uea.check_name(name)
  unknown = [s for s in splits if s not in uea.ALL_SPLITS]
  if unknown:
    raise ValueError(f"Unknown UEA split(s) {unknown}; choose from {list(uea.ALL_SPLITS)}.")
  builder = _prepared_uea(name, data_dir, manual_dir)
  archive = decoded_sources(builder, [s for s in uea.ARCHIVE_SPLITS if s in splits or s == "train"])
  out = {s: archive[s] for s in uea.ARCHIVE_SPLITS if s in splits}
  if any(s in uea.CLEAN_SPLITS for s in splits):
    labels = np.asarray(builder.info.metadata["train_labels"], np.int32)
    fit, validation = uea.stratified_split(labels, validation_fraction, split_seed)
    tag = f"fraction={validation_fraction}, seed={split_seed}"
    carved = {
      "train_fit": SubsetSource(archive["train"], fit, f"train_fit({tag})"),
      "validation": SubsetSource(archive["train"], validation, f"validation({tag})"),
    }
    out.update({s: carved[s] for s in uea.CLEAN_SPLITS if s in splits})
  return {s: out[s] for s in splits}


def uea_info(
  name: str,
  *,
  data_dir: str | os.PathLike[str] | None = None,
  manual_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
  """Sizes of a UEA data set (prepares it with TFDS on first use, like :func:`uea_sources`).

  Returns:
    ``dict(num_classes, num_channels, max_length, num_train, num_test, class_names)``.
  """
  builder = _prepared_uea(name, data_dir, manual_dir)
  metadata: Mapping[str, Any] = builder.info.metadata
  keys = ("num_classes", "num_channels", "max_length", "num_train", "num_test", "class_names")
  return {k: metadata[k] for k in keys}
