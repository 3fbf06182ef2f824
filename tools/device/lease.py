"""A job that outlives the device call that started it, and its files brought back in `$OUT`.

A lent accelerator runs one command at a time, for at most 10 minutes, and brings back only what
the command leaves under `$OUT` (at most 8 files of at most 16 MiB, two folders deep); between the
calls of one lease the machine, its disk and its processes stay. So a run longer than one call
starts in a session of its own (`setsid`, which the end of the call does not stop), a later call
waits for it, and the last one packs its metrics (and, when it has not finished, what resuming
needs) into `$OUT`::

  python3 -m tools.device.lease start NAME -- COMMAND ...   # returns at once
  python3 -m tools.device.lease wait NAME SECONDS           # until the job ends or SECONDS pass
  python3 -m tools.device.lease collect NAME ROOT [FILE ...]
  python3 -m tools.device.lease restore NAME                # in a later lease: unpack the state
  python3 -m tools.device.lease progress ROOT STEM          # curves of runs, finished or not

`collect` writes `NAME_metrics.tar.gz` (every run's metrics.jsonl, final_metrics.json, config.json,
experiment.json and grid_run.json under ROOT, the FILEs, e.g. the grid's results JSON, and the
job's log) and, unless the job ended with status 0, `NAME_state.tar.NN` parts (ROOT without
TensorBoard files, checkpoints being written, checkpoints other than the one resuming restores
(a folder's newest; for the replicas of a sweep, the newest they all have), and the checkpoints of
finished runs): carried back to the device, `restore` unpacks them and the same
command resumes from the checkpoints. The job's files
(`NAME.log`, `NAME.pid`, `NAME.rc` with its exit status once it ends) are in `--jobs_dir`
(default `workdirs/lease`). `progress` reads the runs under ROOT (unpacked metrics, finished or
cut short by the end of a lease) and writes `STEM.json` and `STEM.md`: per run its point, the steps
done, its learning curve every `--every` steps and its best evaluation on the selection split so
far. docs/reproduction.md has the lease recipe.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib
import io
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from typing import Sequence

JOBS_DIR = os.path.join("workdirs", "lease")
# The device tool's limits on what comes back: files, and the size of each.
MAX_FILES = 8
MAX_TOTAL_BYTES = 64 * 2**20
PART_BYTES = 15 * 2**20
# Orbax writes a checkpoint under a temporary name and renames it when complete.
ORBAX_TMP = "orbax-checkpoint-tmp"
# A finished run's final record (grid.FINAL_METRICS; not imported: the job commands need no numpy).
FINAL_METRICS = "final_metrics.json"
# A workdir's definition (primal_dual.training.workdir.EXPERIMENT_FILE); a sweep's workdir has one.
EXPERIMENT_FILE = "experiment.json"
# Files of a workdir the metrics archive takes (the trainer's and the grid's records of a run).
RUN_FILES = (
  "metrics.jsonl",
  FINAL_METRICS,
  "config.json",
  EXPERIMENT_FILE,
  "grid_run.json",
)
POLL_SECONDS = 5.0


class LeaseError(Exception):
  """A refusal, reported in one line."""


def job_paths(jobs_dir: str, name: str) -> dict[str, str]:
  """The job's log, process id and exit-status files."""
  return {kind: os.path.join(jobs_dir, f"{name}.{kind}") for kind in ("log", "pid", "rc")}


def detached_command(command: Sequence[str], log: str, rc: str) -> list[str]:
  """The argv that runs ``command`` in a session of its own (``setsid``), its output in ``log``
  and its exit status written to ``rc`` when it ends."""
  script = (
    f"{shlex.join(command)} > {shlex.quote(log)} 2>&1 < /dev/null; echo $? > {shlex.quote(rc)}"
  )
  return ["setsid", "bash", "-c", script]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def status(jobs_dir: str, name: str) -> str:
  """``'absent'``, ``'running'``, ``'done <exit status>'`` or ``'lost'`` (its process gone
  without an exit status: the machine was given back, or it was killed)."""
  paths = job_paths(jobs_dir, name)
  if os.path.exists(paths["rc"]):
    with open(paths["rc"]) as f:
      return f"done {f.read().strip()}"
  if not os.path.exists(paths["pid"]):
    return "absent"
  with open(paths["pid"]) as f:
    return "running" if _alive(int(f.read())) else "lost"


def job_environment() -> dict[str, str]:
  """This environment, with JAX told not to preallocate 75% of the accelerator's memory unless
  the caller said otherwise: a lease runs several jobs on one GPU, and in lease 5 the second
  job's preallocation left the first none for cuBLAS ("failed to create cublas handle")."""
  return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}


def start(jobs_dir: str, name: str, command: Sequence[str]) -> int:
  """Starts ``command`` detached and returns its process id (the session leader's).

  Raises:
    LeaseError: no command, or a job of this name is still running.
  """
  if not command:
    raise LeaseError("give the command after --: lease start NAME -- COMMAND ...")
  if status(jobs_dir, name) == "running":
    raise LeaseError(f"job {name!r} is still running; wait for it or pick another name")
  os.makedirs(jobs_dir, exist_ok=True)
  paths = job_paths(jobs_dir, name)
  for stale in (paths["rc"], paths["pid"]):
    if os.path.exists(stale):
      os.remove(stale)
  # No inherited output: the device tool would wait for the job to close it.
  process = subprocess.Popen(
    detached_command(command, paths["log"], paths["rc"]),
    env=job_environment(),
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  with open(paths["pid"], "w") as f:
    f.write(str(process.pid))
  return process.pid


def wait(jobs_dir: str, name: str, seconds: float, poll: float = POLL_SECONDS) -> str:
  """The job's status once it is no longer running, or after ``seconds``."""
  deadline = time.monotonic() + seconds
  while (state := status(jobs_dir, name)) == "running" and time.monotonic() < deadline:
    time.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))
  return state


def log_tail(jobs_dir: str, name: str, lines: int = 20) -> str:
  path = job_paths(jobs_dir, name)["log"]
  if not os.path.exists(path):
    return ""
  with open(path, errors="replace") as f:
    return "".join(f.readlines()[-lines:])


def _files_under(root: str, keep) -> list[str]:
  found = []
  for folder, subfolders, files in os.walk(root):
    subfolders.sort()
    found += [os.path.join(folder, f) for f in sorted(files) if keep(os.path.join(folder, f))]
  return found


def _complete_steps(checkpoints: str) -> set[int]:
  """The steps of the complete checkpoints in a ``checkpoints/`` folder (orbax names one being
  written ``<step>.orbax-checkpoint-tmp-...``, not a number)."""
  return {int(name) for name in os.listdir(checkpoints) if name.isdigit()}


def resume_step(checkpoints: str) -> int | None:
  """The step a resumed run restores from its ``checkpoints/`` folder: the newest, or, for a
  replica of a sweep (its parent workdir holds ``experiment.json``), the newest step every
  replica has: a kill during a save can leave one replica a checkpoint ahead (lease 5), and the
  program restores the replicas together."""
  steps = _complete_steps(checkpoints)
  sweep = os.path.dirname(os.path.dirname(checkpoints))
  if os.path.exists(os.path.join(sweep, EXPERIMENT_FILE)):
    replicas = [os.path.join(sweep, name, "checkpoints") for name in sorted(os.listdir(sweep))]
    steps = set.intersection(*(_complete_steps(c) for c in replicas if os.path.isdir(c))) or steps
  return max(steps, default=None)


def run_finished(workdir: str) -> bool:
  """Whether the run in ``workdir`` has ended (its final record is written)."""
  return os.path.exists(os.path.join(workdir, FINAL_METRICS))


def _resume_skips(path: str, step_of, finished) -> bool:
  """Whether resuming does without ``path``: a TensorBoard file, a checkpoint being written
  (orbax's ``*.orbax-checkpoint-tmp*`` folders, which vanish as it completes), a checkpoint other
  than the one resuming restores (``step_of(<checkpoints folder>)``), or any checkpoint of a
  finished run (``finished(<workdir>)``: its record and analyses were made when it ended)."""
  parts = path.split(os.sep)
  if "tensorboard" in parts or any(ORBAX_TMP in part for part in parts):
    return True
  for index, part in enumerate(parts[:-1]):
    if not part.startswith("checkpoints"):
      continue
    if finished(os.sep.join(parts[:index])):
      return True
    if part == "checkpoints" and parts[index + 1].isdigit() and index + 2 < len(parts):
      return int(parts[index + 1]) != step_of(os.sep.join(parts[: index + 1]))
  return False


def metrics_files(root: str) -> list[str]:
  """The records of every run under ``root`` (``RUN_FILES``)."""
  return _files_under(root, lambda path: os.path.basename(path) in RUN_FILES)


def state_files(root: str) -> list[str]:
  """What resuming the runs under ``root`` needs (everything ``_resume_skips`` keeps)."""
  # Asked once per folder, not once per file (a checkpoint holds tens of files).
  step_of = functools.cache(resume_step)
  finished = functools.cache(run_finished)
  return _files_under(root, lambda path: not _resume_skips(path, step_of, finished))


def _tar_bytes(paths: Sequence[str], mode: str) -> bytes:
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode=mode) as archive:
    for path in paths:
      try:
        archive.add(path)
      except FileNotFoundError:  # removed since it was listed (a job still writing): not needed
        continue
  return buffer.getvalue()


def _files_and_bytes(folder: str) -> tuple[int, int]:
  """How many files ``folder`` holds, and their bytes."""
  paths = [os.path.join(folder, f) for f in os.listdir(folder)]
  return len(paths), sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def collect(
  jobs_dir: str,
  name: str,
  root: str,
  extra: Sequence[str],
  out: str,
  part_bytes: int = PART_BYTES,
) -> list[str]:
  """Writes the job's metrics archive, and the state parts unless it ended with status 0, into
  ``out``; returns their paths. A second collect of the job in the same ``out`` replaces its
  first one's files; other files there count against what the device tool brings back.

  Raises:
    LeaseError: more files or bytes than the device tool brings back (``MAX_FILES``,
      ``MAX_TOTAL_BYTES``, with the files already in ``out``); the metrics archive is written
      before the state is refused.
  """
  os.makedirs(out, exist_ok=True)
  # A collect of this job earlier in the same call: its files are replaced, not counted.
  own = [glob.escape(f"{name}_metrics.tar.gz"), glob.escape(f"{name}_state.tar.") + "[0-9][0-9]"]
  for stale in (p for pattern in own for p in glob.glob(os.path.join(glob.escape(out), pattern))):
    os.remove(stale)
  files_elsewhere, bytes_elsewhere = _files_and_bytes(out)
  log = job_paths(jobs_dir, name)["log"]
  given = [path for path in [*extra, log] if os.path.exists(path)]
  written = [os.path.join(out, f"{name}_metrics.tar.gz")]
  with open(written[0], "wb") as f:
    f.write(_tar_bytes(metrics_files(root) + given, "w:gz"))
  if status(jobs_dir, name) != "done 0":
    state = _tar_bytes(state_files(root), "w")
    parts = [state[i : i + part_bytes] for i in range(0, len(state), part_bytes)]
    files = files_elsewhere + 1 + len(parts)
    total = bytes_elsewhere + os.path.getsize(written[0]) + len(state)
    if files > MAX_FILES or total > MAX_TOTAL_BYTES:
      raise LeaseError(
        f"the state of {root} is {len(state):,} bytes in {len(parts)} parts: with the "
        f"{files - len(parts)} files ({total - len(state):,} bytes) in {out} that is {files} "
        f"files and {total:,} bytes, more than the {MAX_FILES} files and {MAX_TOTAL_BYTES:,} "
        "bytes $OUT brings back; collect it in a call of its own"
      )
    for index, part in enumerate(parts):
      written.append(os.path.join(out, f"{name}_state.tar.{index:02d}"))
      with open(written[-1], "wb") as f:
        f.write(part)
  return written


def restore(name: str, source: str, destination: str = ".") -> list[str]:
  """Unpacks the state parts ``source/NAME_state.tar.NN`` under ``destination``; returns the
  files written.

  Raises:
    LeaseError: no parts.
  """
  parts = sorted(glob.glob(os.path.join(source, f"{name}_state.tar.[0-9][0-9]")))
  if not parts:
    raise LeaseError(f"no {name}_state.tar.NN parts in {source}")
  data = b"".join(open(part, "rb").read() for part in parts)
  with tarfile.open(fileobj=io.BytesIO(data), mode="r") as archive:
    archive.extractall(destination, filter="data")
    return [member.name for member in archive.getmembers() if member.isfile()]


# --- progress: what the runs under a folder have reached ------------------------------------------


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def run_progress(workdir: str, every: int) -> dict:
  """One run's record: its point, steps done of its total, its learning curve of the task's
  ``CURVE_METRICS`` (``reproduce.<task>``) at the multiples of ``every``, and its best evaluation
  on the selection split so far (the last of the curve metrics; ties keep the earliest step)."""
  from reproduce import hyla_paper  # local: the job commands need no numpy

  config = _read_json(os.path.join(workdir, "config.json"))
  metrics = importlib.import_module(f"reproduce.{config['task']}").CURVE_METRICS
  curve = hyla_paper.learning_curve(workdir, metrics)
  rows = [dict(zip(curve, values)) for values in zip(*curve.values())]
  selection = metrics[-1]
  best = max(rows, key=lambda row: (row[selection], -row["step"])) if rows else None
  logged = hyla_paper.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  optimizer, model = config["optimizer"], config["model"]
  return {
    "run": workdir,
    "attention": model["attention"],
    "seed": config["seed"],
    "lr": optimizer["lr"],
    "weight_decay": optimizer["weight_decay"],
    "warmup_steps": optimizer["warmup_steps"],
    "attention_dropout_rate": model["attention_dropout_rate"],
    "steps_done": max((int(r["step"]) for r in logged), default=0),
    "num_train_steps": config["num_train_steps"],
    "finished": run_finished(workdir),
    "steps_per_second": hyla_paper.median_steps_per_second(workdir),
    "metrics": list(metrics),
    "curve": [row for row in rows if row["step"] % every == 0],
    "best": best,
  }


def progress(root: str, every: int) -> list[dict]:
  """The records of every run (a folder with ``config.json`` and ``metrics.jsonl``) under
  ``root``."""
  runs = [
    os.path.dirname(path)
    for path in _files_under(root, lambda path: os.path.basename(path) == "metrics.jsonl")
    if os.path.exists(os.path.join(os.path.dirname(path), "config.json"))
  ]
  return [run_progress(run, every) for run in runs]


def progress_markdown(records: Sequence[dict], note: str) -> str:
  """The records as Markdown: per run its point, progress and best, then its curve."""
  lines = ["# Runs in progress", "", note, ""] if note else ["# Runs in progress", ""]
  for record in records:
    metrics, best = record["metrics"], record["best"]
    state = "finished" if record["finished"] else "cut short (resumable from its checkpoint)"
    lines += [
      f"## {record['attention']}, seed {record['seed']}: lr {record['lr']:g}, weight decay "
      f"{record['weight_decay']:g}, warm-up {record['warmup_steps']}, attention dropout "
      f"{record['attention_dropout_rate']:g}",
      "",
      f"`{record['run']}`: {record['steps_done']:,} of {record['num_train_steps']:,} steps, "
      f"{state}; {record['steps_per_second'] or 0:.0f} steps/s logged (median).",
    ]
    if best:
      values = ", ".join(f"{m} {best[m]:.4f}" for m in metrics)
      lines += ["", f"Best on `{metrics[-1]}` so far: step {best['step']:,}: {values}."]
    lines += ["", "| step | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    lines += [
      f"| {row['step']:,} | " + " | ".join(f"{row[m]:.4f}" for m in metrics) + " |"
      for row in record["curve"]
    ]
    lines.append("")
  return "\n".join(lines)


def write_progress(root: str, stem: str, every: int, note: str) -> list[str]:
  """``STEM.json`` and ``STEM.md`` of the runs under ``root``; returns their paths.

  Raises:
    LeaseError: no run under ``root``.
  """
  records = progress(root, every)
  if not records:
    raise LeaseError(f"no run (config.json and metrics.jsonl) under {root}: unpack the metrics")
  os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
  with open(stem + ".json", "w") as f:
    json.dump({"note": note, "every": every, "runs": records}, f, indent=1)
  with open(stem + ".md", "w") as f:
    f.write(progress_markdown(records, note))
  return [stem + ".json", stem + ".md"]


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python3 -m tools.device.lease", description=__doc__.split("\n")[0]
  )
  parser.add_argument("--jobs_dir", default=JOBS_DIR, help="where the job's log, pid and rc go")
  commands = parser.add_subparsers(dest="action", required=True)
  started = commands.add_parser("start", help="start COMMAND (after --) in its own session")
  started.add_argument("name")
  started.add_argument("command", nargs=argparse.REMAINDER)
  waited = commands.add_parser("wait", help="wait until the job ends or SECONDS pass")
  waited.add_argument("name")
  waited.add_argument("seconds", type=float)
  collected = commands.add_parser("collect", help="pack the job's metrics (and state) into $OUT")
  collected.add_argument("name")
  collected.add_argument("root", help="the folder of the job's workdirs (a grid's --root)")
  collected.add_argument("files", nargs="*", help="more files, e.g. the grid's --results")
  collected.add_argument("--out", default=os.environ.get("OUT", ""))
  reported = commands.add_parser("progress", help="curves of the runs under ROOT, as STEM.json/md")
  reported.add_argument("root")
  reported.add_argument("stem", help="output path without extension")
  reported.add_argument("--every", type=int, default=12_500, help="curve points every N steps")
  reported.add_argument("--note", default="", help="a line for the report: command, hardware")
  restored = commands.add_parser("restore", help="unpack NAME_state.tar.NN parts")
  restored.add_argument("name")
  restored.add_argument("--source", default=os.path.join(JOBS_DIR, "state"))
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    if args.action == "start":
      command = args.command[1:] if args.command[:1] == ["--"] else args.command
      print(f"started {args.name}: process {start(args.jobs_dir, args.name, command)}")
    elif args.action == "wait":
      state = wait(args.jobs_dir, args.name, args.seconds)
      print(f"{args.name}: {state}\n{log_tail(args.jobs_dir, args.name)}", end="")
    elif args.action == "collect":
      if not args.out:
        raise LeaseError("no --out and no $OUT: give the folder the files go to")
      for path in collect(args.jobs_dir, args.name, args.root, args.files, args.out):
        print(f"{path}: {os.path.getsize(path)} bytes")
    elif args.action == "progress":
      print(" ".join(write_progress(args.root, args.stem, args.every, args.note)))
    else:
      print(f"restored {len(restore(args.name, args.source))} files")
  except LeaseError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
