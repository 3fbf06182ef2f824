"""A damaged workdir (an interrupted copy, a full disk when a file was written): each file kind is
truncated or garbled in a real workdir.

A checkpoint that fails to restore is reported in one line naming its step and the cause, moved
aside to `<step>.damaged` (never deleted), and training or evaluation goes on from the newest
intact one; training then ends exactly where an uninterrupted run did. Every other damaged file
is one `errors.DamagedFileError` naming it and what to do, and doing that works. The commands
themselves (one stderr line, exit statuses) are in test_cli_errors.py.
"""

import json
import logging
import os
import re
import shutil
import sys

import jax
import numpy as np
import pytest

import helpers
from primal_dual.training import checkpointing
from primal_dual.training import errors
from primal_dual.training import evaluation
from primal_dual.training import setup
from primal_dual.training import trainer
from primal_dual.training import workdir as workdir_lib

compilation_cache_dir = pytest.fixture(scope="module", autouse=True)(
  helpers.fresh_compilation_cache
)
# A failed restore leaves tensorstore reads that complete on the event loop Orbax has closed; the
# commands hide those reports (`errors.hide_disk_full_logs`), here pytest would show each.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _config(**overrides):
  """16 steps, checkpoints at 8, 12 and 16 kept (every 4, the last 3)."""
  return helpers.tiny_config(num_train_steps=16, async_checkpointing=False, **overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished workdir of `_config()`; copied by every test, never changed."""
  workdir = tmp_path_factory.mktemp("trained")
  trainer.train_and_evaluate(_config(), str(workdir))
  return workdir


def _copy(trained, tmp_path, final_metrics: bool = False):
  """A copy of the trained workdir; without its final metrics the next run goes through the
  restore (a finished workdir is reported without one)."""
  workdir = tmp_path / "w"
  shutil.copytree(trained, workdir)
  if not final_metrics:
    os.remove(workdir / trainer.FINAL_METRICS_FILE)
  return workdir


def _truncate_arrays(step):
  for path in (step / "state" / "d").iterdir():
    os.truncate(path, path.stat().st_size // 2)


def _garble(path, text):
  path.write_text(text)


# Damage to one checkpoint folder → the cause its one line gives.
CHECKPOINT_DAMAGE = {
  "truncated array files": (_truncate_arrays, r"OUT_OF_RANGE: Error reading .*state/d/\w+"),
  "truncated manifest": (
    lambda step: os.truncate(step / "state" / "manifest.ocdbt", 10),
    r"DATA_LOSS: .*manifest\.ocdbt",
  ),
  "missing state": (lambda step: shutil.rmtree(step / "state"), r'Item "state" was not found'),
  "garbled meta": (
    lambda step: _garble(step / "meta" / "metadata", '{"step": 16, "trac'),
    r"meta/metadata: not valid JSON",
  ),
  "garbled data position": (
    lambda step: _garble(step / "data" / "process_0-of-1.json", '{"version": 2, "last_s'),
    r"data/process_0-of-1\.json: not valid JSON",
  ),
}


def _restored(workdir, step):
  program = setup.build_program(setup.resolve_config(_config()))
  folder = os.path.join(workdir, checkpointing.CHECKPOINT_DIR)
  with checkpointing.Checkpointer(folder, read_only=True) as checkpointer:
    state, _ = checkpointer.restore(step, program.restore_target())
  return jax.device_get(state)


def _assert_one_line(capfd, pattern: str) -> None:
  """What was written to stderr since the last read is one line that fullmatches `pattern`."""
  lines = capfd.readouterr().err.splitlines()
  assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), lines


@pytest.mark.parametrize("damage", sorted(CHECKPOINT_DAMAGE))
def test_training_moves_a_damaged_checkpoint_aside_and_resumes_exactly(
  damage, trained, tmp_path, capfd
):
  workdir = _copy(trained, tmp_path)
  damage_step, cause = CHECKPOINT_DAMAGE[damage]
  folder = workdir / "checkpoints"
  damage_step(folder / "16")
  damaged_files = _files(folder / "16")
  capfd.readouterr()

  trainer.train_and_evaluate(_config(), str(workdir))

  _assert_one_line(
    capfd,
    rf"warning: checkpoint step 16 in {folder} cannot be restored \({cause}.*\); moved it to "
    rf"{folder}/16\.damaged; resuming from step 12, the newest intact one",
  )
  # Moved, never deleted: every file of it is still there, as it was.
  assert sorted(os.listdir(folder)) == ["12", "16", "16.damaged", "8"]
  assert _files(folder / "16.damaged") == damaged_files
  # Steps 13-16 trained again are those of the run that was never damaged.
  jax.tree.map(np.testing.assert_array_equal, _restored(trained, 16), _restored(workdir, 16))
  assert helpers.records_without_timing(workdir) == helpers.records_without_timing(trained)


def _files(folder) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
  "damage", sorted(set(CHECKPOINT_DAMAGE) - {"garbled data position"})
)  # evaluation reads no data position
def test_evaluation_goes_on_from_the_newest_intact_checkpoint(damage, trained, tmp_path, capfd):
  workdir = _copy(trained, tmp_path, final_metrics=True)
  damage_step, cause = CHECKPOINT_DAMAGE[damage]
  damage_step(workdir / "checkpoints" / "16")
  capfd.readouterr()

  report = evaluation.evaluate_workdir(str(workdir))

  folder = workdir / "checkpoints"
  _assert_one_line(
    capfd,
    rf"warning: checkpoint step 16 in {folder} cannot be restored \({cause}.*\); moved it to "
    rf"{folder}/16\.damaged; evaluating step 12, the newest intact one",
  )
  assert report["step"] == 12 and sorted(os.listdir(folder)) == ["12", "16.damaged", "8"]
  assert report["results"] == evaluation.evaluate_workdir(str(workdir), checkpoint="12")["results"]
  assert not (workdir / workdir_lib.LOCK_FILE).exists()


def test_evaluation_leaves_a_damaged_checkpoint_of_a_workdir_in_use_in_place(
  trained, tmp_path, capfd
):
  """A run training in the workdir lists and deletes its checkpoints: evaluation moves nothing
  under it."""
  workdir = _copy(trained, tmp_path, final_metrics=True)
  _truncate_arrays(workdir / "checkpoints" / "16")
  capfd.readouterr()
  with workdir_lib.WorkdirLock(str(workdir)):
    report = evaluation.evaluate_workdir(str(workdir))
  _assert_one_line(
    capfd,
    r"warning: checkpoint step 16 in .* cannot be restored \(OUT_OF_RANGE: .*\); left it in "
    r"place \(the workdir is in use by a training run\); evaluating step 12, the newest intact one",
  )
  assert report["step"] == 12
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "16", "8"]


def test_no_checkpoint_that_restores_is_one_error_and_moves_nothing(trained, tmp_path):
  """The same failure on every checkpoint is more likely a program that does not fit them than
  damage: nothing is moved, and a re-run with the right program or copy still finds them."""
  workdir = _copy(trained, tmp_path)
  for step in ("8", "12", "16"):
    _truncate_arrays(workdir / "checkpoints" / step)
  folder = workdir / "checkpoints"
  expected = (
    rf"no checkpoint in {folder} can be restored \(steps 8, 12, 16; step 16: OUT_OF_RANGE: .*\); "
    r"copy the workdir again if it is an interrupted copy"
  )
  with pytest.raises(errors.DamagedCheckpointError) as info:
    trainer.train_and_evaluate(_config(), str(workdir))
  assert re.fullmatch(
    expected + r", or move the checkpoints/ folder aside to start again from step 0",
    str(info.value),
  )
  with pytest.raises(errors.DamagedCheckpointError) as info:
    evaluation.evaluate_workdir(str(workdir))
  assert re.fullmatch(expected, str(info.value))
  assert sorted(os.listdir(folder)) == ["12", "16", "8"]


def test_a_damaged_checkpoint_asked_for_by_name_is_one_error(trained, tmp_path):
  workdir = _copy(trained, tmp_path, final_metrics=True)
  _truncate_arrays(workdir / "checkpoints" / "12")
  (selected,) = os.listdir(workdir / "checkpoints_selected")
  _truncate_arrays(workdir / "checkpoints_selected" / selected)
  with pytest.raises(errors.DamagedCheckpointError) as info:
    evaluation.evaluate_workdir(str(workdir), checkpoint="12")
  assert re.fullmatch(
    rf"checkpoint step 12 in {workdir}/checkpoints cannot be restored \(OUT_OF_RANGE: .*\); "
    r"evaluate another: --checkpoint=latest or a step of 8, 16",
    str(info.value),
  )
  with pytest.raises(errors.DamagedCheckpointError) as info:
    evaluation.evaluate_workdir(str(workdir), checkpoint="selected")
  assert re.fullmatch(
    rf"checkpoint step {selected} in {workdir}/checkpoints_selected cannot be restored "
    r"\(OUT_OF_RANGE: .*\); evaluate --checkpoint=latest, or copy the workdir again if it is an "
    r"interrupted copy",
    str(info.value),
  )
  assert "12" in os.listdir(workdir / "checkpoints")  # asked for by name: left as it is


def _delete_damaged_line(path):
  path.write_text("".join(line for line in path.open() if not line.startswith('{"step": 4, "tr')))


# File → (damage, the command that meets it, expected message after the path, following it).
FILE_DAMAGE = {
  "config.json": (
    '{"task": "synth',
    "evaluate",
    r"\(not valid JSON: .*\); copy it again from the workdir this one was copied from",
    lambda workdir, trained: shutil.copy(trained / "config.json", workdir / "config.json"),
  ),
  "experiment.json": (
    '{"fields": [',
    "train",
    r"\(not valid JSON: .*\); delete it and re-run: it is written again from config\.json \(its "
    r"record of optimizer changes is lost\)",
    lambda workdir, trained: os.remove(workdir / "experiment.json"),
  ),
  "metrics.jsonl": (
    None,  # a record cut short, as an interrupted copy leaves the last one
    "train",
    r"\(line 9: not valid JSON: .*\); delete that line \(or move the file aside\) and re-run the "
    r"same command; the checkpoints are intact",
    lambda workdir, trained: _delete_damaged_line(workdir / "metrics.jsonl"),
  ),
  "final_metrics.json": (
    '{"step": 16, "test/accura',
    "train",
    r"\(not valid JSON: .*\); delete it and re-run the same command: the final metrics are "
    r"computed again from the last checkpoint",
    lambda workdir, trained: os.remove(workdir / "final_metrics.json"),
  ),
}


@pytest.mark.parametrize("name", sorted(FILE_DAMAGE))
def test_a_damaged_workdir_file_is_one_error_naming_it_and_what_to_do(name, trained, tmp_path):
  text, command, expected, follow_advice = FILE_DAMAGE[name]
  workdir = _copy(trained, tmp_path, final_metrics=name == "final_metrics.json")
  path = workdir / name
  if text is None:
    with path.open("a") as f:
      f.write('{"step": 4, "train/lo')
  else:
    path.write_text(text)

  def run():
    if command == "evaluate":
      return evaluation.evaluate_workdir(str(workdir))
    return trainer.train_and_evaluate(_config(), str(workdir))

  with pytest.raises(errors.DamagedFileError) as info:
    run()
  assert re.fullmatch(re.escape(str(path)) + r" is damaged " + expected, str(info.value))
  follow_advice(workdir, trained)
  run()  # what the message says to do is enough


def test_a_sweep_resumes_from_the_newest_step_every_replica_has_intact(tmp_path, capfd):
  config = helpers.tiny_config(
    num_train_steps=4,
    checkpoint_every_steps=2,
    eval_every_steps=2,
    async_checkpointing=False,
    **{"sweep.optimizer.lr": (0.05, 0.02)},
  )
  reference, workdir = tmp_path / "reference", tmp_path / "w"
  trainer.train_and_evaluate(config, str(reference))
  shutil.copytree(reference, workdir)
  names = sorted(p.name for p in reference.iterdir() if p.is_dir())
  for name in names:
    os.remove(workdir / name / trainer.FINAL_METRICS_FILE)
  damaged = workdir / names[1] / "checkpoints"
  _truncate_arrays(damaged / "4")
  capfd.readouterr()

  trainer.train_and_evaluate(config, str(workdir))

  _assert_one_line(
    capfd,
    rf"warning: checkpoint step 4 in {damaged} cannot be restored \(OUT_OF_RANGE: .*\); moved it "
    rf"to {damaged}/4\.damaged; resuming from step 2, the newest every replica has",
  )
  for name in names:
    _, expected = evaluation.restore_workdir(str(reference / name))
    _, actual = evaluation.restore_workdir(str(workdir / name))
    jax.tree.map(np.testing.assert_array_equal, expected.params, actual.params)
    assert helpers.records_without_timing(workdir / name) == helpers.records_without_timing(
      reference / name
    )
  assert (damaged / "4.damaged").is_dir()


def test_describe_keeps_a_restore_error_to_its_file_and_reason():
  tensorstore = ValueError(
    'OUT_OF_RANGE: Error opening "cast" driver: Error opening "zarr" driver: Error reading '
    '"rng/.zarray" in OCDBT database at local file "/w/8/state/": Error reading Byte range '
    '[0, 1202) of local file "/w/8/state/d/ab": Requested byte range [0, 1202) is not valid for '
    "value of size 600 [tensorstore_spec='{\"context\": {}}'] [source locations='x.cc:1']"
  )
  assert errors.describe(tensorstore) == (
    'OUT_OF_RANGE: Error reading Byte range [0, 1202) of local file "/w/8/state/d/ab": '
    "Requested byte range [0, 1202) is not valid for value of size 600"
  )
  with pytest.raises(json.JSONDecodeError) as info:
    json.loads('{"a": 1')
  assert errors.describe(info.value).startswith("not valid JSON: Expecting ',' delimiter")
  assert errors.describe(RuntimeError("x\n  y")) == "RuntimeError: x y"
  assert len(errors.describe(RuntimeError("z" * 1000))) == 300


def test_only_abandoned_orbax_reads_go_unreported():
  """Orbax's read tasks whose failure nobody retrieved are hidden (each would be a traceback);
  any other task's failure is still reported."""
  namespace = {}
  exec(
    compile(
      "def read():\n  raise ValueError('OUT_OF_RANGE')\n", "/x/orbax/checkpoint/r.py", "exec"
    ),
    namespace,
  )
  infos = {}
  for name, fail in (("orbax", namespace["read"]), ("other", lambda: 1 / 0)):
    try:
      fail()
    except Exception:
      infos[name] = sys.exc_info()

  def shown(message, info):
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, info)
    return errors.not_an_abandoned_checkpoint_read(record)

  never_retrieved = "Task exception was never retrieved\nfuture: <Task finished ...>"
  assert not shown(never_retrieved, infos["orbax"])
  assert shown(never_retrieved, infos["other"])
  assert shown("Unclosed event loop", infos["orbax"])
  # A tensorstore future behind an Orbax read fails in C++: no traceback, tensorstore's spec in
  # its message (as CI once printed it, nine lines after the one-line warning).
  tensorstore = ValueError(
    'OUT_OF_RANGE: Error opening "zarr" driver: Error reading "b/.zarray" '
    '[tensorstore_spec=\'{"driver":"zarr"}\']'
  )
  future_never_retrieved = "Future exception was never retrieved\nfuture: <Future finished ...>"
  assert not shown(future_never_retrieved, (ValueError, tensorstore, None))
  assert shown(future_never_retrieved, (ValueError, ValueError("OUT_OF_RANGE"), None))
  assert shown(future_never_retrieved, infos["other"])
