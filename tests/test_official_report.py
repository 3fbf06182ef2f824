"""The report of the official code's runs: a cut run is never reported as finished, and the
committed report is what its committed metrics give today."""

import json
import os
from pathlib import Path

from reproduce import official_report

PAPER = Path(__file__).resolve().parent.parent / "results" / "paper"


def write_run(path: Path, last_step: int, ood_at: dict[int, float]) -> Path:
  rows = [{"step": 0, "wall_time_s": 1.0, "num_params": 10.0}]
  for step in range(1, last_step + 1, 2):
    rows.append({"step": step, "wall_time_s": float(step), "train_steps_per_sec": 100.0 + step})
  for step, ood in ood_at.items():
    rows.append({"step": step, "wall_time_s": float(step), "test_acc": ood + 0.1})
    rows.append({"step": step, "wall_time_s": float(step), "ood_acc": ood})
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return path


def test_a_run_cut_before_its_last_step_reports_its_last_evaluation_as_cut(tmp_path):
  finished = write_run(tmp_path / "hyla_s1.jsonl", 10, {1: 0.1, 5: 0.3, 10: 0.5})
  cut = write_run(tmp_path / "hyla_s0.jsonl", 7, {1: 0.2, 5: 0.4})
  summary = official_report.summarize([finished, cut], 10, "cpu", "theirs")
  assert [(run["seed"], run["completed"]) for run in summary["runs"]] == [(0, False), (1, True)]
  assert summary["runs"][0]["evaluations"][-1] == {"step": 5, "test_acc": 0.5, "ood_acc": 0.4}
  assert summary["runs"][1]["num_params"] == 10
  report = official_report.render(summary)
  assert "| hyla | 0 | 7 of 10 (cut by the lease) | 40.00 | 50.00 | 5 |" in report
  assert "| hyla | 1 | 10 of 10 | 50.00 | 60.00 | 10 |" in report
  assert "| 10 | – | 50.00 |" in report  # the cut run has no evaluation at the end


def test_the_committed_report_is_its_metrics_summarized_and_rendered(tmp_path):
  committed = json.loads((PAPER / "official_sraven.json").read_text())
  runs = sorted((PAPER / "official_runs").glob("*.jsonl"))
  summary = official_report.summarize(
    runs, official_report.DEFAULT_TOTAL_STEPS, committed["hardware"], committed["source"]
  )
  assert summary == committed
  assert official_report.render(committed) == (PAPER / "official_sraven.md").read_text()


def test_without_runs_or_hardware_it_says_what_to_pass(tmp_path, capsys):
  assert official_report.main([f"--out={tmp_path}/report"]) == 2
  assert capsys.readouterr().err.strip() == (
    "error: pass the runs' .jsonl files and --hardware (or --render_only)"
  )
  assert not os.listdir(tmp_path)


def test_a_misnamed_or_empty_run_file_ends_in_one_line_and_writes_nothing(tmp_path, capsys):
  runs = tmp_path / "runs"
  runs.mkdir()
  misnamed = write_run(runs / "hyla_seed0.jsonl", 4, {4: 0.5})
  empty = runs / "hyla_s2.jsonl"
  empty.write_text("")
  for run, message in (
    (misnamed, "hyla_seed0.jsonl: name each run's file <model>_s<seed>.jsonl, e.g. hyla_s0.jsonl"),
    (empty, f"{empty} holds no metrics: pass the --out file of a run that has started"),
  ):
    assert official_report.main([f"--out={tmp_path}/report", "--hardware=cpu", str(run)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
  assert sorted(os.listdir(tmp_path)) == ["runs"]


def test_render_only_without_its_summary_says_to_summarize_first(tmp_path, capsys):
  assert official_report.main([f"--out={tmp_path}/report", "--render_only"]) == 2
  assert capsys.readouterr().err.strip() == (
    f"error: no {tmp_path}/report.json to re-render: run once without --render_only"
  )
  assert not os.listdir(tmp_path)
