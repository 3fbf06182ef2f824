"""The report of runs of the official HYLA code (`reproduce/official_sraven.py`'s JSON lines).

Their number for a run is the whole-panel accuracy on the held-out rule combinations (`ood_acc`)
at the end of training: their code keeps no checkpoints and selects nothing. A run the lease cut
before its last step has no final number; its last evaluation is reported, marked as cut.

    python -m reproduce.official_report --hardware="1 × NVIDIA H100 80GB HBM3" \\
        --out=results/paper/official_sraven results/paper/official_runs/hyla_s*.jsonl

writes `official_sraven.json` (the summary: every evaluation of every run) and
`official_sraven.md` (rendered from that JSON alone, so a committed report can be re-rendered).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from primal_dual import atomic
from reproduce import hyla_paper, sraven

# Their default run: num_train 20,000,000 problems / batch 128 (official:configs/raven.py).
DEFAULT_TOTAL_STEPS = 156_250
EVALUATED = ("test_acc", "ood_acc", "test_loss", "ood_loss")


def summarize_run(path: Path, total_steps: int) -> dict[str, Any]:
  """One run's summary from its JSON lines; the file name is `<model>_s<seed>.jsonl` (`model`:
  our name of the attention variant, `official_sraven.MODELS`).

  Raises:
    ValueError: a file named otherwise, or holding no metrics.
  """
  model, separator, seed = path.stem.rpartition("_s")
  if not separator or not seed.isdigit():
    raise ValueError(f"{path.name}: name each run's file <model>_s<seed>.jsonl, e.g. hyla_s0.jsonl")
  rows = hyla_paper.read_jsonl(str(path))
  if not rows:
    raise ValueError(f"{path} holds no metrics: pass the --out file of a run that has started")
  evaluations: dict[int, dict[str, float]] = {}
  for row in rows:
    for name in EVALUATED:
      if name in row:
        evaluations.setdefault(row["step"], {"step": row["step"]})[name] = row[name]
  speeds = [row["train_steps_per_sec"] for row in rows if "train_steps_per_sec" in row]
  last_step = max(row["step"] for row in rows)
  return {
    "model": model,
    "seed": int(seed),
    "num_params": next((int(row["num_params"]) for row in rows if "num_params" in row), None),
    "total_steps": total_steps,
    "last_logged_step": last_step,
    "completed": last_step >= total_steps,
    "wall_time_s": max(row["wall_time_s"] for row in rows),
    "median_train_steps_per_sec": round(statistics.median(speeds), 1) if speeds else None,
    "evaluations": [evaluations[step] for step in sorted(evaluations)],
  }


def summarize(paths: Sequence[Path], total_steps: int, hardware: str, source: str) -> dict:
  runs = sorted(
    (summarize_run(path, total_steps) for path in paths), key=lambda r: (r["model"], r["seed"])
  )
  return {"source": source, "hardware": hardware, "runs": runs}


def render(summary: dict) -> str:
  """The Markdown report of `summarize`'s output."""
  runs = summary["runs"]
  lines = [
    "# The official HYLA code at its defaults on sRAVEN",
    "",
    f"Measured by `python -m reproduce.official_sraven --official=<checkout> --seed=<seed> "
    f"--out=<model>_s<seed>.jsonl` (their `configs/raven.py:raven_3x3_4features;linear_hypatt`, "
    f"every setting theirs: lr 1e-3, weight decay 0.1, warm-up 1000, attention dropout 0.1, "
    f"batch 128) on {summary['hardware']}. "
    f"Their code: {summary['source']}. Their number is the OOD whole-panel accuracy at the end "
    "of training (no checkpoint is selected); ID = their in-distribution test split. Raw "
    "metrics: `official_runs/` next to this file. Report: `python -m reproduce.official_report`.",
    "",
    "| model | seed | steps run | OOD whole-panel % (last eval) | ID whole-panel % (last eval) "
    "| at step | train steps/s (median) | OOD % Table A1 (reference) |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for run in runs:
    last = run["evaluations"][-1]
    steps = f"{run['last_logged_step']:,} of {run['total_steps']:,}"
    if not run["completed"]:
      steps += " (cut by the lease)"
    lines.append(
      f"| {run['model']} | {run['seed']} | {steps} | {hyla_paper.format_mean_se([last.get('ood_acc')])} | "
      f"{hyla_paper.format_mean_se([last.get('test_acc')])} | {last['step']:,} | "
      f"{run['median_train_steps_per_sec']} | {sraven.REFERENCES.get(run['model'], '–')} |"
    )
  lines += [
    "",
    "OOD whole-panel % at every evaluation:",
    "",
    "| step | " + " | ".join(f"{run['model']} seed {run['seed']}" for run in runs) + " |",
    "|---|" + "---|" * len(runs),
  ]
  by_run = [{row["step"]: row.get("ood_acc") for row in run["evaluations"]} for run in runs]
  for step in sorted({step for ood in by_run for step in ood}):
    lines.append(
      f"| {step:,} | "
      + " | ".join(hyla_paper.format_mean_se([ood.get(step)]) for ood in by_run)
      + " |"
    )
  return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("runs", nargs="*", type=Path, help="<model>_s<seed>.jsonl files")
  parser.add_argument("--out", type=Path, required=True, help="writes <out>.json and <out>.md")
  parser.add_argument("--hardware", default="", help="the device the runs shared")
  parser.add_argument(
    "--source", default="smonsays/hypernetwork-attention @ af9805f", help="their checkout"
  )
  parser.add_argument("--total_steps", type=int, default=DEFAULT_TOTAL_STEPS)
  parser.add_argument(
    "--render_only", action="store_true", help="re-render <out>.md from <out>.json"
  )
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse(argv)
  summary_path, report_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
  if args.render_only:
    if not summary_path.exists():
      print(
        f"error: no {summary_path} to re-render: run once without --render_only", file=sys.stderr
      )
      return 2
    summary = json.loads(summary_path.read_text())
  elif not args.runs or not args.hardware:
    print("error: pass the runs' .jsonl files and --hardware (or --render_only)", file=sys.stderr)
    return 2
  else:
    try:
      summary = summarize(args.runs, args.total_steps, args.hardware, args.source)
    except ValueError as error:
      print(f"error: {error}", file=sys.stderr)
      return 2
    # Atomic, as the grids write theirs: a crash mid-write leaves the earlier report, not half of it.
    atomic.write_text(str(summary_path), json.dumps(summary, indent=1) + "\n")
  atomic.write_text(str(report_path), render(summary))
  print(f"wrote {report_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
