"""Every problem a user can fix is one line `error: ...` on stderr and exit status 2.

Each case runs `train.py` or `eval.py` as a subprocess, the way a user meets it. The cases fail
before any training step, most of them before JAX is imported, so the table runs in seconds.

The module's subprocesses share one persistent compilation cache (a program one command compiled
is loaded by the next), and the cases that need a trained UEA workdir copy one trained once.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import helpers

from reproduce import grid
from primal_dual.training import config_lib
from primal_dual.training import setup
from primal_dual.training import workdir as workdir_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The synthetic and UEA programs are compiled once, not once per command.
compilation_cache = pytest.fixture(scope="module", autouse=True)(
  helpers.subprocess_compilation_cache
)


# A tiny synthetic-task config file; `steps=` is its only argument.
SYNTHETIC_CONFIG = """
import ml_collections
from primal_dual.training import config_lib

def get_config(arg=None):
  arg = config_lib.parse_arg(arg, steps=4)
  config = config_lib.training_defaults()
  config.task = 'synthetic'
  config.num_train_steps = arg.steps
  config.batch_size = 8
  config.progress_bar = False
  config.model = ml_collections.ConfigDict(dict(hidden=8, dropout_rate=0.1, use_batch_norm=False))
  config.data = ml_collections.ConfigDict(dict(num_train=32, num_eval=8, seq_len=4,
                                               num_features=3, num_classes=3))
  return config_lib.lock(config)
"""


def _synthetic_config_file(tmp_path) -> str:
  path = tmp_path / "synthetic.py"
  path.write_text(SYNTHETIC_CONFIG)
  return str(path)


def _run(script: str, args: list[str], **kwargs) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.run(
    [sys.executable, os.path.join(REPO_ROOT, script), *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO_ROOT,
    timeout=120,
    **kwargs,
  )


def _foreign_workdir(tmp_path, config_file) -> str:
  """A workdir of an earlier version whose config.json has seed 5."""
  workdir = tmp_path / "foreign"
  workdir.mkdir()
  config = setup.resolve_config(grid.load_config(config_file, None))
  as_dict = json.loads(config_lib.to_json(config))
  as_dict["seed"] = 5
  (workdir / "config.json").write_text(json.dumps(as_dict))
  return str(workdir)


# Workdir locks this test process holds (an OS lock lasts as long as its holder).
_HELD_LOCKS = []


def _busy_workdir(tmp_path) -> str:
  workdir = tmp_path / "busy"
  lock = workdir_lib.WorkdirLock(str(workdir))
  lock.acquire()
  _HELD_LOCKS.append(lock)
  return str(workdir)


# Folders this test process mounted, unmounted after each case.
_MOUNTS = []


def _read_only_workdir(tmp_path) -> str:
  """A folder nobody may write into: mode 0555, and for root (who ignores modes) a read-only
  tmpfs mounted on it."""
  workdir = tmp_path / "read_only"
  workdir.mkdir()
  workdir.chmod(0o555)
  if os.geteuid() == 0:
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=64k,mode=0555", "tmpfs", str(workdir)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
      pytest.skip("root ignores folder modes, and mounting a read-only tmpfs failed here")
    _MOUNTS.append(str(workdir))
  return str(workdir)


def _broken_config_file(tmp_path) -> str:
  path = tmp_path / "broken.py"
  path.write_text("def get_config(arg=None):\n  config = None\n  return config.foo\n")
  return str(path)


def _a_file(tmp_path) -> str:
  path = tmp_path / "a_file"
  path.write_text("")
  return str(path)


def _workdir_with_a_garbled(tmp_path, name: str) -> str:
  """A workdir whose `name` (config.json, experiment.json) was cut short, as by an interrupted
  copy."""
  workdir = tmp_path / "garbled"
  workdir.mkdir()
  (workdir / name).write_text('{"task": "synth')
  return str(workdir)


# An argument naming this folder names a copy, in the test's tmp_path, of the UEA workdir trained
# once for the module (a case may write into its copy).
TRAINED_UEA = "<trained UEA workdir>"


@pytest.fixture(scope="module")
def trained_uea_workdir(tmp_path_factory) -> str:
  """A UEA workdir (default:runlocal, 2 tiny epochs) with its checkpoints at steps 33 and 66."""
  workdir = str(tmp_path_factory.mktemp("trained") / "uea")
  trained = _run("train.py", ["--config=default:runlocal", f"--workdir={workdir}"])
  assert trained.returncode == 0, trained.stderr
  return workdir


def _copy_of_trained_uea(request, tmp_path) -> str:
  workdir = tmp_path / "uea"
  shutil.copytree(request.getfixturevalue("trained_uea_workdir"), workdir)
  return str(workdir)


def _with_trained_uea(args: list[str], request, tmp_path) -> list[str]:
  """`args` with TRAINED_UEA replaced by a fresh copy of the trained UEA workdir."""
  if not any(TRAINED_UEA in arg for arg in args):
    return args
  workdir = _copy_of_trained_uea(request, tmp_path)
  return [arg.replace(TRAINED_UEA, workdir) for arg in args]


# (script, arguments given the synthetic config file and tmp_path, expected message regex)
CASES = {
  "unknown config field": (
    "train.py",
    lambda c, t: [f"--config={c}", "--config.optimzer.lr=0.1", f"--workdir={t}/run"],
    r"unknown config field --config\.optimzer\.lr; did you mean --config\.optimizer\.lr\?",
  ),
  "typo in config argument": (
    "train.py",
    lambda c, t: [f"--config={c}:step=3", f"--workdir={t}/run"],
    r"unknown config argument 'step' in 'step=3'; did you mean 'steps'\?",
  ),
  "missing config file": (
    "train.py",
    lambda c, t: [f"--config={t}/nope.py", f"--workdir={t}/run"],
    r"config file .*nope\.py not found",
  ),
  "config file that raises": (
    "train.py",
    lambda c, t: [f"--config={_broken_config_file(t)}", f"--workdir={t}/run"],
    r"loading the config failed at .*broken\.py:3: AttributeError: .*'foo'",
  ),
  "unknown attention variant as an override": (
    "train.py",
    lambda c, t: [
      "--config=default:runlocal",
      "--config.model.attention=flash",
      f"--workdir={t}/run",
    ],
    r"unknown attention variant \(--config\.model\.attention\) 'flash'; known: .*, softmax",
  ),
  "an extra positional argument": (
    "train.py",
    lambda c, t: [f"--config={c}", f"--workdir={t}/run", "extra"],
    r"unexpected arguments: extra; give every flag as --name=value \(`.*train\.py --help` "
    r"lists them\)",
  ),
  "eval of a step never saved": (
    "eval.py",
    lambda c, t: [f"--workdir={TRAINED_UEA}", "--checkpoint=7"],
    r"no checkpoint at step 7 in .*/uea/checkpoints; its checkpoints: steps 33, 66",
  ),
  "zero model size": (
    "train.py",
    lambda c, t: [f"--config={c}", "--config.model.hidden=0", f"--workdir={t}/run"],
    r"config\.model\.hidden=0 must be a positive integer",
  ),
  "no layers": (
    "train.py",
    lambda c, t: [
      "--config=primal_dual/configs/default.py:runlocal",
      "--config.model.num_layers=-1",
      f"--workdir={t}/run",
    ],
    r"config\.model\.num_layers=-1 must be a positive integer",
  ),
  "dropout rate of 1": (
    "train.py",
    lambda c, t: [f"--config={c}", "--config.model.dropout_rate=1.0", f"--workdir={t}/run"],
    r"config\.model\.dropout_rate=1\.0 must be in \[0, 1\)",
  ),
  "selection split the task lacks": (
    "train.py",
    lambda c, t: [f"--config={c}", "--config.selection.split=dev", f"--workdir={t}/run"],
    r"config\.selection\.split='dev' is not a split of task 'synthetic'",
  ),
  "workdir is a file": (
    "train.py",
    lambda c, t: [f"--config={c}", f"--workdir={_a_file(t)}"],
    r"workdir .*a_file is a file, not a folder",
  ),
  "workdir is read-only": (
    "train.py",
    lambda c, t: [f"--config={c}", f"--workdir={_read_only_workdir(t)}/run"],
    r"cannot create workdir .*read_only/run: (Permission denied|Read-only file system)",
  ),
  "workdir of another experiment": (
    "train.py",
    lambda c, t: [f"--config={c}", f"--workdir={_foreign_workdir(t, c)}"],
    r"workdir .*foreign holds another experiment: seed 5 != 0; use a new --workdir",
  ),
  "workdir in use": (
    "train.py",
    lambda c, t: [f"--config={c}", f"--workdir={_busy_workdir(t)}"],
    rf"workdir .*busy is in use by process {os.getpid()} on {re.escape(socket.gethostname())}",
  ),
  "selection metric the task lacks": (
    "train.py",
    lambda c, t: [f"--config={c}", "--config.selection.metric=f1", f"--workdir={t}/run"],
    r"config\.selection\.metric='f1' is not a metric of task 'synthetic'; it reports accuracy, "
    r"loss",
  ),
  "selection mode typo": (
    "train.py",
    lambda c, t: [f"--config={c}", "--config.selection.mode=maximum", f"--workdir={t}/run"],
    r"config\.selection\.mode='maximum' must be 'max', 'min' or ''",
  ),
  "highest loss selected": (
    "train.py",
    lambda c, t: [
      f"--config={c}",
      "--config.selection.metric=loss",
      "--config.selection.mode=max",
      f"--workdir={t}/run",
    ],
    r"config\.selection\.mode='max' with metric 'loss' selects the worst checkpoint",
  ),
  "eval of a bad checkpoint name": (
    "eval.py",
    lambda c, t: [f"--workdir={t}", "--checkpoint=foo"],
    r"--checkpoint must be 'latest', 'selected' or a step number",
  ),
  "eval of a folder without a run": (
    "eval.py",
    lambda c, t: [f"--workdir={t}/nothing"],
    r"config\.json not found",
  ),
  "eval of a damaged config.json": (
    "eval.py",
    lambda c, t: [f"--workdir={_workdir_with_a_garbled(t, 'config.json')}"],
    r"garbled/config\.json is damaged \(not valid JSON: .*\); copy it again from the workdir "
    r"this one was copied from",
  ),
  "train on a damaged experiment.json": (
    "train.py",
    lambda c, t: [f"--config={c}", f"--workdir={_workdir_with_a_garbled(t, 'experiment.json')}"],
    r"garbled/experiment\.json is damaged \(not valid JSON: .*\); copy it again from the workdir "
    r"this one was copied from",
  ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_error_is_one_line_with_exit_status_2(name, tmp_path, request):
  script, make_args, expected = CASES[name]
  try:
    args = make_args(_synthetic_config_file(tmp_path), tmp_path)
    result = _run(script, _with_trained_uea(args, request, tmp_path))
  finally:
    while _MOUNTS:
      subprocess.run(["umount", "-l", _MOUNTS.pop()], check=True)
  lines = result.stderr.splitlines()
  assert result.returncode == 2, result.stderr
  assert len(lines) == 1, result.stderr
  assert re.fullmatch(r"error: .*" + expected + r".*", lines[0]), lines[0]


def test_a_running_job_refuses_a_second_one_and_stops_on_ctrl_c(tmp_path):
  """While a job trains, the same command again exits at once naming the job's process; SIGINT
  then stops the job with one line giving the last step and checkpoint, and frees the workdir."""
  workdir = tmp_path / "run"
  args = [
    f"--config={_synthetic_config_file(tmp_path)}:steps=1000000",
    "--config.log_every_steps=1",
    "--config.checkpoint_every_steps=5",
    f"--workdir={workdir}",
  ]
  job = _train_job(args)
  try:
    deadline = time.monotonic() + 120
    while not (workdir / "checkpoints" / "5").exists() and time.monotonic() < deadline:
      time.sleep(0.2)
    second = _run("train.py", args)
    records_before_stop = (workdir / "metrics.jsonl").read_text().splitlines()
    job.send_signal(signal.SIGINT)
    _, stderr = job.communicate(timeout=60)
  finally:
    if job.poll() is None:
      job.kill()
  assert second.returncode == 2 and len(second.stderr.splitlines()) == 1, second.stderr
  assert second.stderr.startswith(
    f"error: workdir {workdir} is in use by process {job.pid} on {socket.gethostname()}; "
  )
  steps = [json.loads(line)["step"] for line in records_before_stop]
  assert steps == sorted(set(steps))  # one writer: no duplicate or out-of-order records
  assert job.returncode == 2, stderr
  assert len(stderr.splitlines()) == 1, stderr
  assert re.fullmatch(
    r"error: stopped at step \d+; last checkpoint step \d+; re-run the same "
    r"command to resume",
    stderr.strip(),
  ), stderr
  assert not (workdir / workdir_lib.LOCK_FILE).exists()


def _train_job(args: list[str]) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.Popen(
    [sys.executable, os.path.join(REPO_ROOT, "train.py"), *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
    cwd=REPO_ROOT,
  )


def _params(workdir) -> dict:
  from primal_dual.training import evaluation

  _, state = evaluation.restore_workdir(str(workdir))
  return jax.device_get(state.params)


def test_sigterm_saves_a_checkpoint_in_one_line_and_the_run_resumes_exactly(tmp_path):
  """SIGTERM to a training job (a pre-empted VM, SLURM, `docker stop`): one line, exit status
  75, a checkpoint of the step reached; the same command resumes, and ends where a run that was
  never stopped does."""
  config_file = _synthetic_config_file(tmp_path)
  workdir, reference = tmp_path / "run", tmp_path / "reference"
  cadence = ["--config.log_every_steps=1", "--config.checkpoint_every_steps=1000"]
  job = _train_job([f"--config={config_file}:steps=1000000", *cadence, f"--workdir={workdir}"])
  try:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
      not (workdir / "metrics.jsonl").exists()
      or len((workdir / "metrics.jsonl").read_text().splitlines()) < 5
    ):
      time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
  finally:
    if job.poll() is None:
      job.kill()
  assert job.returncode == 75, stderr
  stopped = re.fullmatch(
    r"error: stopped by SIGTERM at step (\d+); checkpoint saved at step \1; re-run the same "
    r"command to resume",
    stderr.strip(),
  )
  assert stopped and len(stderr.splitlines()) == 1, stderr
  step = int(stopped[1])
  assert os.listdir(workdir / "checkpoints") == [str(step)]
  assert not (workdir / workdir_lib.LOCK_FILE).exists()

  # The run's length may change between runs: both end 3 steps after the stop.
  end = [f"--config={config_file}:steps={step + 3}", *cadence]
  resumed = _run("train.py", [*end, f"--workdir={workdir}"])
  uninterrupted = _run("train.py", [*end, f"--workdir={reference}"])
  assert resumed.returncode == 0 and uninterrupted.returncode == 0, resumed.stderr
  assert f"resuming from step {step} " in resumed.stdout
  assert helpers.records_without_timing(workdir) == helpers.records_without_timing(reference)
  final, expected = (
    json.loads((w / "final_metrics.json").read_text()) for w in (workdir, reference)
  )
  assert helpers.without_timing(final) == helpers.without_timing(expected)
  jax.tree.map(np.testing.assert_array_equal, _params(workdir), _params(reference))


def test_a_damaged_checkpoint_is_one_line_and_the_newest_intact_one_is_used(tmp_path):
  """An interrupted copy of a workdir: its newest checkpoint's arrays cut short. Evaluation and a
  longer training each say so in one line, move it aside and go on from the intact one."""
  config_file = _synthetic_config_file(tmp_path)
  trained = tmp_path / "trained"
  training = [f"--config={config_file}:steps=8", "--config.checkpoint_every_steps=4"]
  assert _run("train.py", [*training, f"--workdir={trained}"]).returncode == 0
  for path in (trained / "checkpoints" / "8" / "state" / "d").iterdir():
    os.truncate(path, path.stat().st_size // 2)
  for command, args, going_on in [
    ("eval.py", [], "evaluating step 4, the newest intact one"),
    (
      "train.py",
      [f"--config={config_file}:steps=12"],
      "resuming from step 4, the newest intact one",
    ),
  ]:
    workdir = tmp_path / command
    shutil.copytree(trained, workdir)
    result = _run(command, [*args, f"--workdir={workdir}"])
    folder = workdir / "checkpoints"
    assert result.returncode == 0, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert re.fullmatch(
      rf"warning: checkpoint step 8 in {folder} cannot be restored \(OUT_OF_RANGE: .*\); moved "
      rf"it to {folder}/8\.damaged; {going_on}",
      result.stderr.strip(),
    ), result.stderr
    assert (folder / "8.damaged").is_dir()
  assert "checkpoint: latest (step 4)" in _run("eval.py", [f"--workdir={tmp_path}/eval.py"]).stdout


# Commands beyond train.py/eval.py: (argv after `python`, given tmp_path; expected message regex).
# Each message also says what to do (the regex includes that part).
FULL_DISK = """
import errno, os, sys
from primal_dual.training import trainer
def disk_full(config, workdir):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(workdir, 'checkpoints'))
trainer._train_in_workdir = disk_full
sys.path.insert(0, os.getcwd())
from primal_dual.commands import main
sys.exit(main(sys.argv[1:]))
"""
# How tensorstore (under Orbax) reports a full disk: a ValueError, raised by the save and raised
# again when the checkpoint manager is closed.
TENSORSTORE_FULL_DISK = """
import os, sys
from primal_dual.training import checkpointing
def disk_full(self, *args, **kwargs):
  raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "' + self.directory + '/1/_sharding": '
                   "Failed to write 20532 bytes to file 14: No space left on device "
                   "[os_error_code='28']")
checkpointing.Checkpointer.save = disk_full
checkpointing.Checkpointer.wait = disk_full
checkpointing.Checkpointer.close = disk_full
from primal_dual.commands import main
sys.exit(main(sys.argv[1:]))
"""
# `primal-dual train` where ml_collections (of the [train] extra) is not installed.
WITHOUT_TRAIN_EXTRA = """
import sys
sys.modules['ml_collections'] = None  # `import ml_collections` raises ModuleNotFoundError
from primal_dual.commands import main
sys.exit(main(sys.argv[1:]))
"""
_UEA_QUICK = ["--quick", "--variants=softmax", "--seeds=0", "--protocols=best_test"]

COMMAND_CASES = {
  "unknown sRAVEN preset": (
    lambda t: ["train.py", "--config=sraven:preset=huge", f"--workdir={t}/run"],
    r"unknown sRAVEN preset 'huge'; choose one of cpu, paper",
  ),
  "unknown ListOps setting": (
    lambda t: ["train.py", "--config=listops:setting=torch", f"--workdir={t}/run"],
    r"unknown ListOps setting 'torch'; choose one of jax_lra, pytorch",
  ),
  "unknown ListOps preset": (
    lambda t: ["train.py", "--config=listops:preset=long", f"--workdir={t}/run"],
    r"unknown ListOps preset 'long'; choose one of full, short",
  ),
  "unknown ViT size": (
    lambda t: ["train.py", "--config=images:model=huge", f"--workdir={t}/run"],
    r"unknown ViT preset 'huge'; choose one of .*tiny",
  ),
  "unknown image data set": (
    lambda t: ["train.py", "--config=images:dataset=mnist", f"--workdir={t}/run"],
    r"unknown image data set 'mnist'; choose one of .*digits",
  ),
  "unknown sRAVEN attention": (
    lambda t: ["train.py", "--config=sraven:attention=hyal", f"--workdir={t}/run"],
    r"unknown attention variant \(attention=\) 'hyal'; choose one of .*hyla",
  ),
  "unknown logic attention": (
    lambda t: ["train.py", "--config=logic:attention=hyal", f"--workdir={t}/run"],
    r"unknown attention variant \(attention=\) 'hyal'; choose one of .*hyla",
  ),
  "negative epochs": (
    lambda t: ["train.py", "--config=uea:epochs=-40", f"--workdir={t}/run"],
    r"config argument epochs=-40: give a count >= 1, or epochs=-1 for the config's own \(100\)",
  ),
  "negative images epochs": (
    lambda t: ["train.py", "--config=images:epochs=-2", f"--workdir={t}/run"],
    r"config argument epochs=-2: give a count >= 1, or epochs=-1",
  ),
  "grid with no jobs": (
    lambda t: ["scripts/reproduce.py", "uea", "--jobs=0", f"--root={t}"],
    r"--jobs=0: give at least 1 .*--help",
  ),
  "grid with an unknown flag": (
    lambda t: ["scripts/reproduce.py", "uea", "--job=2", f"--root={t}", "--dry_run"],
    r"unrecognized arguments: --job=2 \(see primal-dual reproduce uea --help\)",
  ),
  "a grid run's config error": (
    lambda t: ["scripts/reproduce.py", "uea", *_UEA_QUICK, "--epochs=-3", f"--root={t}"],
    r"grid run config uea:.*epochs=-3.*: config argument epochs=-3: give a count >= 1",
  ),
  "grid report without its JSON": (
    lambda t: ["scripts/reproduce.py", "listops", "--report_only", f"--results={t}/none.json"],
    r"none\.json does not exist: run the grid first",
  ),
  "grid report of finished runs where none has finished": (
    lambda t: ["scripts/reproduce.py", "listops", "--quick", "--finished_only", f"--root={t}"],
    r"no run of the grid has finished under .*: pass the --root its runs trained in",
  ),
  "grid report from both the JSON and the runs": (
    lambda t: ["scripts/reproduce.py", "listops", "--report_only", "--finished_only"],
    r"--report_only reads --results, --finished_only reads the runs under --root: pass one",
  ),
  "latent_code analysis of a UEA workdir": (
    lambda t: ["eval.py", f"--workdir={TRAINED_UEA}", "--analyses=latent_code"],
    r"the latent_code analysis reads sRAVEN rules; the workdir's task is 'uea': leave latent_code "
    r"out of --analyses",
  ),
  "a full disk under a grid": (
    lambda t: ["-c", FULL_DISK, "reproduce", "uea", *_UEA_QUICK, f"--root={t}/grid"],
    r"no space left on the disk of .*grid.*; free space there and re-run the same command",
  ),
  "a full disk under tensorstore": (
    lambda t: [
      "-c",
      TENSORSTORE_FULL_DISK,
      "train",
      "--config=default:runlocal",
      "--config.progress_bar=False",
      f"--workdir={t}/r",
    ],
    r"no space left on the disk of .*/r; free space there and re-run the same command to resume",
  ),
  "train without the train extra": (
    lambda t: ["-c", WITHOUT_TRAIN_EXTRA, "train", "--config=default", f"--workdir={t}/run"],
    r"`primal-dual train` needs ml_collections; install the train extra: "
    r"pip install 'primal_dual\[train\]'",
  ),
}


@pytest.mark.parametrize("name", sorted(COMMAND_CASES))
def test_command_user_error_is_one_line_with_exit_status_2(name, tmp_path, request):
  make_argv, expected = COMMAND_CASES[name]
  script, *args = _with_trained_uea(make_argv(tmp_path), request, tmp_path)
  result = _run(script, args) if script != "-c" else _run_python_code(args[0], args[1:])
  lines = result.stderr.splitlines()
  assert result.returncode == 2, result.stderr
  assert len(lines) == 1, result.stderr
  assert re.fullmatch(r"error: .*" + expected + r".*", lines[0]), lines[0]


def _run_python_code(code: str, args: list[str]) -> subprocess.CompletedProcess:
  # One device, as _run's commands have: the same programs, loaded from the compilation cache.
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=1",
    PYTHONPATH=REPO_ROOT,
  )
  return subprocess.run(
    [sys.executable, "-c", code, *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO_ROOT,
    timeout=120,
  )


@pytest.fixture
def nearly_full_disk(tmp_path, request):
  """A 3 MB tmpfs mounted at `tmp_path/disk` with `request.param` KiB left free (root only: the
  test is skipped where mounting is impossible; the tensorstore case above runs everywhere)."""
  folder = tmp_path / "disk"
  folder.mkdir()
  mounted = os.geteuid() == 0 and (
    subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True
    ).returncode
    == 0
  )
  if not mounted:
    pytest.skip("mounting a small tmpfs needs root (the tensorstore full-disk case still runs)")
  try:
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    (folder / "filler").write_bytes(bytes(free - request.param * 1024))
    yield folder
  finally:
    subprocess.run(["umount", "-l", str(folder)], check=True)


# 150 KiB: tensorstore's array writes fail (its ValueError); 400 KiB: Orbax's metadata writes
# fail (OSError ENOSPC) while other saves are in flight.
@pytest.mark.parametrize("nearly_full_disk", [150, 400], indirect=True)
def test_a_really_full_disk_is_one_line(nearly_full_disk):
  result = _run(
    "train.py",
    [
      "--config=default:runlocal",
      "--config.progress_bar=False",
      f"--workdir={nearly_full_disk}/run",
    ],
  )
  assert result.returncode == 2, result.stderr
  assert result.stderr.splitlines() == [
    f"error: no space left on the disk of {nearly_full_disk}/run; free space there and re-run the "
    "same command to resume"
  ], result.stderr


def _make_read_only(folder: str) -> None:
  """Makes `folder` unwritable even for root: a read-only bind mount of itself (else mode 0555)."""
  os.chmod(folder, 0o555)
  if os.geteuid() != 0:
    return
  bind = subprocess.run(["mount", "--bind", folder, folder], capture_output=True)
  if bind.returncode != 0:
    pytest.skip("root ignores folder modes, and a read-only bind mount failed here")
  _MOUNTS.append(folder)
  subprocess.run(["mount", "-o", "remount,bind,ro", folder], check=True)


def test_eval_of_a_read_only_workdir_prints_its_metrics_and_one_error_line(tmp_path, request):
  workdir = _copy_of_trained_uea(request, tmp_path)
  try:
    _make_read_only(workdir)
    result = _run("eval.py", [f"--workdir={workdir}"])
  finally:
    while _MOUNTS:
      subprocess.run(["umount", "-l", _MOUNTS.pop()], check=True)
  assert result.returncode == 2, result.stderr
  reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
  assert result.stderr.splitlines() == [
    f"error: could not write {workdir}/eval.json: {reason}; the results printed above were not "
    "saved (make the folder writable, or copy the workdir somewhere writable, and re-run)"
  ], result.stderr
  assert re.search(r"^test\s+\d\.\d+\s+\d\.\d+$", result.stdout, re.M), result.stdout


SAVE_WAIT_WARNING = """
from absl import app, logging
from primal_dual.commands import cli

def main(argv):
  cli.start_main(argv)
  logging.warning("Waiting for previous save to complete took %f seconds. If this number is "
                  "high, consider checkpointing less frequently.", 1.55)
  logging.warning("another warning")

app.run(main)
"""


@pytest.mark.parametrize("verbosity", [[], ["--verbosity=0"]])
def test_orbax_save_wait_warnings_are_hidden_unless_verbosity_is_given(verbosity):
  """Orbax warns when a save waits for the previous one; on a loaded machine the line came out
  beside a stopped run's one-line error (test_a_running_job_refuses_a_second_one_...)."""
  shown = subprocess.run(
    [sys.executable, "-c", SAVE_WAIT_WARNING, *verbosity],
    capture_output=True,
    text=True,
    cwd=REPO_ROOT,
    timeout=120,
  )
  assert shown.returncode == 0, shown.stderr
  assert "another warning" in shown.stderr
  assert ("Waiting for previous save" in shown.stderr) == bool(verbosity), shown.stderr


# `train.py`'s own code, with the modules loaded once it stopped printed last.
_TRAIN_THEN_LIST_MODULES = """
import runpy, sys
sys.argv = ["train.py", *sys.argv[1:]]
try:
  runpy.run_path("train.py", run_name="__main__")
finally:
  print(" ".join(sorted(m for m in ("jax", "flax") if m in sys.modules)), file=sys.stderr)
"""


def test_a_config_file_not_found_is_answered_before_jax_is_imported():
  """`import primal_dual` loads neither jax nor flax (its submodules come on first access), so
  an error found before any model is built needs neither; the submodules still load on access."""
  result = subprocess.run(
    [sys.executable, "-c", _TRAIN_THEN_LIST_MODULES, "--config=/no/such/config.py"],
    capture_output=True,
    text=True,
    cwd=REPO_ROOT,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  *error, loaded = result.stderr.splitlines()
  assert result.returncode == 2 and error, result.stderr
  assert error[-1].startswith("error: config file /no/such/config.py not found"), result.stderr
  assert loaded == "", result.stderr
  code = "import primal_dual, sys; primal_dual.kernels; print('jax' in sys.modules)"
  accessed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert accessed.stdout.strip() == "True", accessed.stderr
