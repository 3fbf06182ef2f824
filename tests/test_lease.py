"""tools/device/lease.py: a job detached from the call that starts it, and what `collect` packs into
`$OUT` within the device tool's limits (docs/reproduction.md, the lease recipe)."""

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from tools.device import lease

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_detached_command_runs_in_its_own_session_and_records_its_status():
  argv = lease.detached_command(["python3", "-m", "x", "a b"], "d/j.log", "d/j.rc")
  assert argv[:3] == ["setsid", "bash", "-c"]
  assert argv[3] == "python3 -m x 'a b' > d/j.log 2>&1 < /dev/null; echo $? > d/j.rc"


def test_a_job_outlives_the_process_that_started_it(tmp_path):
  jobs = str(tmp_path / "jobs")
  starter = (
    "import sys; from tools.device import lease; "
    f"lease.start({jobs!r}, 'slow', [sys.executable, '-c', "
    "'import time; time.sleep(1); print(\"finished\")'])"
  )
  # The starting process returns at once and its output closes: the job keeps running.
  subprocess.run([sys.executable, "-c", starter], cwd=REPO_ROOT, check=True, timeout=30)
  assert lease.status(jobs, "slow") == "running"
  with pytest.raises(lease.LeaseError, match="still running"):
    lease.start(jobs, "slow", ["true"])
  assert lease.wait(jobs, "slow", 60, poll=0.1) == "done 0"
  assert "finished" in lease.log_tail(jobs, "slow")
  lease.start(jobs, "failing", ["bash", "-c", "exit 3"])
  assert lease.wait(jobs, "failing", 60, poll=0.1) == "done 3"
  assert lease.status(jobs, "never") == "absent"


def _fake_runs(root):
  """A grid root with one sweep of two replicas, each with checkpoints at steps 4 and 8."""
  (root / "grid_run").mkdir(parents=True)
  (root / "grid_run" / "experiment.json").write_text("{}")  # the sweep's definition
  for replica in ("lr=0.1", "lr=0.2"):
    workdir = root / "grid_run" / replica
    for step in (4, 8):
      (workdir / "checkpoints" / str(step)).mkdir(parents=True)
      (workdir / "checkpoints" / str(step) / "state").write_bytes(os.urandom(3000))
    (workdir / "checkpoints_selected" / "4").mkdir(parents=True)
    (workdir / "checkpoints_selected" / "4" / "state").write_bytes(b"s")
    (workdir / "tensorboard").mkdir()
    (workdir / "tensorboard" / "events").write_text("e")
    (workdir / "metrics.jsonl").write_text('{"step": 8}\n')
    (workdir / "config.json").write_text("{}")


def test_collect_packs_metrics_and_the_newest_state_in_parts_that_restore(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # archives hold paths relative to the repository root
  _fake_runs(tmp_path / "runs")
  jobs, out = "jobs", str(tmp_path / "out")
  os.makedirs(jobs)
  (tmp_path / "results.json").write_text("[]")
  # A job that is not done (no exit status): its state comes back too, in parts.
  written = lease.collect(jobs, "probe", "runs", ["results.json"], out, part_bytes=8192)
  names = [os.path.basename(path) for path in written]
  assert names[0] == "probe_metrics.tar.gz" and 3 <= len(names) <= lease.MAX_FILES
  assert names[1:] == [f"probe_state.tar.{i:02d}" for i in range(len(names) - 1)]
  with tarfile.open(written[0]) as archive:
    assert sorted(archive.getnames()) == [
      "results.json",
      "runs/grid_run/experiment.json",
      "runs/grid_run/lr=0.1/config.json",
      "runs/grid_run/lr=0.1/metrics.jsonl",
      "runs/grid_run/lr=0.2/config.json",
      "runs/grid_run/lr=0.2/metrics.jsonl",
    ]
  restored = sorted(lease.restore("probe", out, str(tmp_path / "again")))
  assert "runs/grid_run/lr=0.1/checkpoints/8/state" in restored
  assert "runs/grid_run/lr=0.1/checkpoints_selected/4/state" in restored
  assert not [p for p in restored if "checkpoints/4/" in p or "tensorboard" in p]
  again = tmp_path / "again" / "runs/grid_run/lr=0.2/checkpoints/8/state"
  assert again.read_bytes() == (tmp_path / "runs/grid_run/lr=0.2/checkpoints/8/state").read_bytes()
  # More parts than the device tool brings back: refused in one line.
  with pytest.raises(lease.LeaseError, match="more than the 8 files"):
    lease.collect(jobs, "probe", "runs", [], out, part_bytes=500)


def test_a_tiny_training_run_through_the_lease_commands(tmp_path):
  """start → wait → collect of a 2-step synthetic run, as the device calls run them."""
  config = tmp_path / "config.py"
  config.write_text(
    "from primal_dual.training import config_lib\n"
    "def get_config(arg=None):\n"
    "  config = config_lib.training_defaults()\n"
    "  config.update(num_train_steps=2, batch_size=8, progress_bar=False)\n"
    "  config.data.update(dict(num_train=16, num_eval=8, seq_len=4, num_features=2, num_classes=2))\n"
    "  return config_lib.lock(config)\n"
  )
  jobs, root, out = tmp_path / "jobs", tmp_path / "runs", tmp_path / "out"
  train = [sys.executable, os.path.join(REPO_ROOT, "train.py"), f"--config={config}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")

  def call(*argv):
    return subprocess.run(
      [sys.executable, "-m", "tools.device.lease", f"--jobs_dir={jobs}", *argv],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
    )

  started = call("start", "tiny", "--", *train, f"--workdir={root / 'run'}")
  assert started.returncode == 0 and started.stdout.startswith("started tiny"), started.stderr
  waited = call("wait", "tiny", "240")
  assert waited.stdout.startswith("tiny: done 0"), waited.stdout + lease.log_tail(str(jobs), "tiny")
  collected = call("collect", "tiny", str(root), f"--out={out}")
  assert collected.returncode == 0, collected.stderr
  # Finished: the metrics only, no state to resume.
  assert sorted(os.listdir(out)) == ["tiny_metrics.tar.gz"]
  with tarfile.open(out / "tiny_metrics.tar.gz") as archive:
    names = [name.rsplit("/", 2)[-2:] for name in archive.getnames()]
  assert ["run", "final_metrics.json"] in names and ["run", "metrics.jsonl"] in names
  assert ["jobs", "tiny.log"] in names
  refused = call("collect", "tiny", str(root), "--out=")
  assert refused.returncode == 2 and refused.stderr.startswith("error: no --out and no $OUT")


def _evaluation(step, validation, ood):
  return {
    "step": step,
    "validation/whole_panel_accuracy": validation,
    "ood/whole_panel_accuracy": ood,
    "test/whole_panel_accuracy": ood + 0.01,
  }


def test_progress_reports_curves_and_the_best_on_validation_of_runs_cut_short(tmp_path):
  workdir = tmp_path / "A" / "grid" / "lr=0.001,attn_dropout=0.0"
  workdir.mkdir(parents=True)
  config = {
    "task": "sraven",
    "seed": 0,
    "num_train_steps": 156_250,
    "model": {"attention": "hyla", "attention_dropout_rate": 0.0},
    "optimizer": {"lr": 0.001, "weight_decay": 0.1, "warmup_steps": 1000},
  }
  (workdir / "config.json").write_text(json.dumps(config))
  logged = [
    {"step": 500, "train/loss": 2.0, "train/steps_per_second": 100.0},
    {"step": 1000, "train/loss": 1.9, "train/steps_per_second": 300.0},
    _evaluation(6_250, 0.20, 0.25),
    _evaluation(12_500, 0.60, 0.50),  # best on validation, though not on OOD
    _evaluation(18_750, 0.55, 0.58),
    _evaluation(25_000, 0.60, 0.40),  # ties the best later: the earlier step stays
    {"step": 25_500, "train/loss": 0.5, "train/steps_per_second": 310.0},
  ]
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
  json_path, md_path = lease.write_progress(str(tmp_path / "A"), str(tmp_path / "p"), 12_500, "n")
  (record,) = json.loads(open(json_path).read())["runs"]
  assert [row["step"] for row in record["curve"]] == [12_500, 25_000]
  assert record["best"]["step"] == 12_500 and record["best"]["ood/whole_panel_accuracy"] == 0.50
  assert (record["steps_done"], record["finished"], record["attention_dropout_rate"]) == (
    25_500,
    False,
    0.0,
  )
  assert record["steps_per_second"] == 305.0  # the first log period (compilation) left out
  markdown = open(md_path).read()
  assert "25,500 of 156,250 steps, cut short" in markdown
  assert "| 12,500 | 0.5100 | 0.5000 | 0.6000 |" in markdown
  with pytest.raises(lease.LeaseError, match="no run"):
    lease.write_progress(str(tmp_path / "empty"), str(tmp_path / "q"), 12_500, "")


def test_state_leaves_out_checkpoints_being_written_and_those_of_finished_runs(
  tmp_path, monkeypatch
):
  """A checkpoint orbax is still writing (it vanished under collect in lease 4) and the
  checkpoints of a finished run (its record is made when it ends) are not resume state."""
  monkeypatch.chdir(tmp_path)
  _fake_runs(tmp_path / "runs")
  writing = tmp_path / "runs/grid_run/lr=0.1/checkpoints/12.orbax-checkpoint-tmp/state"
  writing.parent.mkdir()
  writing.write_bytes(b"partial")
  (tmp_path / "runs/grid_run/lr=0.2/final_metrics.json").write_text("{}")
  kept = lease.state_files("runs")
  assert "runs/grid_run/lr=0.1/checkpoints/8/state" in kept
  assert "runs/grid_run/lr=0.1/checkpoints_selected/4/state" in kept
  assert not [p for p in kept if "orbax-checkpoint-tmp" in p]
  finished = sorted(p for p in kept if "lr=0.2" in p)
  assert finished == [
    "runs/grid_run/lr=0.2/config.json",
    "runs/grid_run/lr=0.2/final_metrics.json",
    "runs/grid_run/lr=0.2/metrics.jsonl",
  ]


def test_state_keeps_the_newest_checkpoint_every_replica_of_a_sweep_has(tmp_path, monkeypatch):
  """Lease 5 stopped a sweep while it saved: one replica had step 12, the other only 8. The
  program restores the replicas together, from a step they share, so that is the one kept; a
  run outside a sweep keeps its own newest."""
  monkeypatch.chdir(tmp_path)
  _fake_runs(tmp_path / "runs")
  ahead = tmp_path / "runs/grid_run/lr=0.1/checkpoints/12/state"
  ahead.parent.mkdir()
  ahead.write_bytes(b"new")
  single = tmp_path / "runs/single_run"
  for step in (4, 12):
    (single / "checkpoints" / str(step)).mkdir(parents=True)
    (single / "checkpoints" / str(step) / "state").write_bytes(b"s")
  kept = lease.state_files("runs")
  assert lease.resume_step("runs/grid_run/lr=0.1/checkpoints") == 8
  assert "runs/grid_run/lr=0.1/checkpoints/8/state" in kept
  assert "runs/grid_run/lr=0.2/checkpoints/8/state" in kept
  assert not [p for p in kept if "/checkpoints/12/" in p and "grid_run" in p]
  assert [p for p in kept if p.startswith("runs/single_run")] == [
    "runs/single_run/checkpoints/12/state"
  ]
  # Replicas that share no step (not a state a program leaves): each keeps its newest.
  for step in (4, 8):
    shutil.rmtree(tmp_path / f"runs/grid_run/lr=0.1/checkpoints/{step}")
  assert lease.resume_step("runs/grid_run/lr=0.1/checkpoints") == 12


def test_a_job_runs_without_preallocating_the_accelerator_unless_told_to(tmp_path, monkeypatch):
  """Several lease jobs share one GPU: each preallocating 75% of its memory left cuBLAS none in
  lease 5. A setting the caller made is kept."""
  jobs = str(tmp_path / "jobs")
  show = [sys.executable, "-c", "import os; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"]
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  lease.start(jobs, "default", show)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
  lease.start(jobs, "told", show)
  for name, expected in (("default", "false"), ("told", "true")):
    assert lease.wait(jobs, name, 60, poll=0.1) == "done 0"
    assert lease.log_tail(jobs, name).strip() == expected


def test_collect_replaces_its_own_parts_and_counts_the_other_files_in_out(tmp_path, monkeypatch):
  """Lease 4 collected two jobs into one $OUT: 71 MB, over the 64 MiB the device tool brings
  back, which dropped a part silently. collect now counts what is already there."""
  monkeypatch.chdir(tmp_path)
  _fake_runs(tmp_path / "runs")
  jobs, out = "jobs", tmp_path / "out"
  os.makedirs(jobs)
  first = lease.collect(jobs, "probe", "runs", [], str(out), part_bytes=6000)
  again = lease.collect(jobs, "probe", "runs", [], str(out), part_bytes=8192)
  assert len(again) < len(first)
  assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p in again)
  assert lease.restore("probe", str(out), str(tmp_path / "back"))  # no stale part in between
  (out / "other_job_state.tar.00").write_bytes(b"x" * 1000)
  monkeypatch.setattr(lease, "MAX_TOTAL_BYTES", 1000 + 6000)
  with pytest.raises(lease.LeaseError, match=r"more than the 8 files and 7,000 bytes"):
    lease.collect(jobs, "probe", "runs", [], str(out), part_bytes=8192)
  assert (out / "probe_metrics.tar.gz").exists()  # the metrics still come back
  assert not list(out.glob("probe_state.tar.*"))
