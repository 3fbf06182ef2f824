"""`primal-dual reproduce uea` on runlocal configs (--quick): two runs, a resume that trains nothing, the
records' schema, the Markdown report, the figures and `eval.py --analyses=redundancy`.

One BasicMotions grid (tiny model, 2 epochs) is run three times in a module fixture: the first
invocation is half the grid (best_test only), the second the whole grid (adds the clean run and
must reuse the first), the third the same again (must train and analyse nothing).
"""

import copy
import json
import os
import shutil

import pytest

import cli_helpers
import helpers

from reproduce import grid
from reproduce import uea as uea_study

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(argv):
  return grid.reproduce(uea_study.REPRODUCTION, argv)


compilation_cache_dir = pytest.fixture(scope="module", autouse=True)(
  helpers.fresh_compilation_cache
)


def _snapshot(root):
  """mtime of every file under root (training outputs and cached analyses)."""
  return {
    os.path.join(folder, name): os.stat(os.path.join(folder, name)).st_mtime_ns
    for folder, _, names in os.walk(root)
    for name in names
  }


@pytest.fixture(scope="module")
def grid_runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("uea_grid")
  root, results = str(tmp / "root"), str(tmp / "results" / "uea.json")
  args = [
    "--datasets=BasicMotions",
    "--variants=softmax",
    "--seeds=0",
    "--quick",
    f"--root={root}",
    f"--results={results}",
    f"--data_dir={tmp / 'tfds'}",
    "--redundancy_examples=24",
  ]
  calls = {"train": [], "analyse": []}
  train_one, analyse = grid.train_one, uea_study.analyse_workdir

  def counted_train(run, workdir):
    calls["train"].append(run.name)
    return train_one(run, workdir)

  def counted_analyse(workdir, checkpoint, max_examples):
    calls["analyse"].append(os.path.basename(workdir))
    return analyse(workdir, checkpoint, max_examples)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(grid, "train_one", counted_train)
    patch.setattr(uea_study, "analyse_workdir", counted_analyse)
    assert _main(args + ["--protocols=best_test"]) == 0
    after_first = copy.deepcopy(calls)
    # --report_only tabulates the finished run and trains nothing.
    assert _main(args + ["--protocols=best_test,clean", "--report_only"]) == 0
    after_report = copy.deepcopy(calls)
    with open(results) as f:
      reported = [r["name"] for r in json.load(f)]
    assert _main(args + ["--protocols=best_test,clean"]) == 0
    after_second, files_second = copy.deepcopy(calls), _snapshot(root)
    assert _main(args + ["--protocols=best_test,clean"]) == 0
    files_third = _snapshot(root)
  with open(results) as f:
    records = json.load(f)
  return dict(
    root=root,
    results=results,
    records=records,
    after_first=after_first,
    after_report=after_report,
    reported=reported,
    after_second=after_second,
    after_third=calls,
    files_second=files_second,
    files_third=files_third,
  )


def test_resume_trains_and_analyses_only_what_is_missing(grid_runs):
  best, clean = (
    "BasicMotions-best_test-softmax-runlocal-s0",
    "BasicMotions-clean-softmax-runlocal-s0",
  )
  assert grid_runs["after_first"] == {"train": [best], "analyse": [best]}
  assert grid_runs["after_report"] == grid_runs["after_first"]
  assert grid_runs["reported"] == [best]
  assert grid_runs["after_second"] == {"train": [best, clean], "analyse": [best, clean]}
  assert grid_runs["after_third"] == grid_runs["after_second"]
  # Nothing in any workdir was rewritten by the third invocation.
  assert grid_runs["files_third"] == grid_runs["files_second"]
  assert [r["name"] for r in grid_runs["records"]] == [best, clean]


def test_records_follow_the_schema_and_the_protocols(grid_runs):
  records = {r["protocol"]: r for r in grid_runs["records"]}
  for record in records.values():
    uea_study.validate_record(record)
    metrics = record["metrics"]
    assert record["dataset"] == "BasicMotions" and record["attention"] == "softmax"
    assert record["model_size"] == "runlocal" and record["epochs"] == 2 and record["seed"] == 0
    assert record["best_epoch_accuracy"] == metrics["best/test_accuracy"]
    assert record["final_test_accuracy"] == metrics["test/accuracy"]
    assert record["redundancy_examples"] == 24
    assert len(record["head_distance_per_layer"]) == 1  # runlocal: one layer
    assert record["head_distance"] == pytest.approx(record["head_distance_per_layer"][0])
    assert 0.0 < record["head_distance"] <= 2**0.5
    assert record["attention_flops_relative"] == 1.0
    assert record["padded_length"] == 100
    assert record["wall_time_s"] > 0
  best, clean = records["best_test"], records["clean"]
  assert best["test_accuracy"] == best["metrics"]["best/test_accuracy"]
  assert clean["test_accuracy"] == clean["metrics"]["selected/test_accuracy"]
  assert (best["redundancy_checkpoint"], clean["redundancy_checkpoint"]) == ("latest", "selected")
  assert best["redundancy_step"] == best["metrics"]["step"]
  assert clean["redundancy_step"] == clean["metrics"]["selected/step"]
  assert best["num_params"] == clean["num_params"] > 0


def test_validate_record_names_missing_and_mistyped_fields(grid_runs):
  record = dict(grid_runs["records"][0])
  del record["head_distance"]
  record["seed"] = "0"
  with pytest.raises(ValueError, match=r"head_distance: missing.*|seed: str"):
    uea_study.validate_record(record)
  with pytest.raises(ValueError, match="protocol"):
    uea_study.validate_record({**grid_runs["records"][0], "protocol": "optimistic"})


def test_markdown_and_figures_are_written(grid_runs):
  folder = os.path.dirname(grid_runs["results"])
  with open(os.path.join(folder, "uea.md")) as f:
    markdown = f.read()
  assert "## best_test protocol" in markdown and "## clean protocol" in markdown
  assert uea_study.REFERENCE_HEADER in markdown
  assert "| BasicMotions | softmax |" in markdown
  for name in (uea_study.REDUNDANCY_PLOT, uea_study.MAPS_PLOT):
    with open(os.path.join(folder, name), "rb") as f:
      assert f.read(4) == b"\x89PNG"


def _record(dataset, attention, seed, accuracy, protocol="best_test"):
  """A made-up record (report formatting only; not a result)."""
  return {
    "dataset": dataset,
    "attention": attention,
    "protocol": protocol,
    "seed": seed,
    "model_size": "small",
    "epochs": 100,
    "test_accuracy": accuracy,
    "head_distance": 0.5,
    "num_params": 1000,
    "attention_flops_relative": 1.0,
    "wall_time_s": 60.0,
  }


def test_markdown_report_reference_column_and_ten_dataset_average():
  from primal_dual.configs import uea as uea_config

  records = [
    _record("JapaneseVowels", "softmax", 0, 0.9),
    _record("JapaneseVowels", "softmax", 1, 0.8),
    _record("JapaneseVowels", "bn", 0, 0.7),
    _record("JapaneseVowels", "bn", 0, 0.6, "clean"),
  ]
  markdown = uea_study.markdown_report(records, "cmd")
  rows = {
    line.split("|")[2].strip(): line
    for line in markdown.splitlines()
    if line.startswith("| JapaneseVowels")
  }
  assert "85.0 ± 7.1" in rows["softmax"] and rows["softmax"].rstrip(" |").endswith("98.7")
  assert "Average over the ten" not in markdown
  ten = [
    _record(d, "softmax", 0, 0.5 + i / 100) for i, d in enumerate(uea_config.PROTOCOL_DATASETS)
  ]
  average = uea_study.markdown_report(ten, "cmd")
  assert "| softmax | 54.5 | 71.9 |" in average


def test_unavailable_or_unknown_inputs_fail_in_one_line(tmp_path, capsys):
  args = [f"--root={tmp_path}", f"--results={tmp_path / 'r.json'}", "--quick"]
  assert _main(args + ["--datasets=Heartbeat"]) == 2
  assert "manual_dir" in capsys.readouterr().err
  assert _main(args + ["--datasets=NotADataSet"]) == 2
  with pytest.raises(SystemExit):
    _main(args + ["--variants=softmax,nope"])
  assert not os.path.exists(tmp_path / "r.json")


def test_eval_cli_redundancy_matches_the_grid_record(grid_runs, capsys):
  record = next(r for r in grid_runs["records"] if r["protocol"] == "best_test")
  workdir = os.path.join(grid_runs["root"], record["name"])
  from absl import flags

  with cli_helpers.loaded_script("eval.py") as eval_cli:
    flags.FLAGS(
      [
        "eval.py",
        f"--workdir={workdir}",
        "--splits=test",
        "--analyses=redundancy",
        "--max_examples=24",
      ]
    )
    assert eval_cli.main(["eval.py"]) == 0
    flags.FLAGS(["eval.py", f"--workdir={workdir}", "--analyses=nope"])
    assert eval_cli.main(["eval.py"]) == 2
  captured = capsys.readouterr()
  assert "head_distance_per_layer" in captured.out
  assert "unknown analysis" in captured.err
  with open(os.path.join(workdir, "eval.json")) as f:
    report = json.load(f)
  result = report["analyses"]["redundancy"]
  assert result["num_examples"] == 24 and result["step"] == record["redundancy_step"]
  assert result["head_distance"] == pytest.approx(record["head_distance"], rel=1e-6)
  assert report["results"]["test"]["accuracy"] == pytest.approx(record["final_test_accuracy"])
  assert os.path.exists(result["files"]["plot"])


def test_report_only_in_a_fresh_clone_rerenders_every_record(tmp_path):
  """No workdirs here (a fresh clone): --report_only renders every record of the results JSON
  into the same tables and keeps the provenance command of the report it replaces."""
  results, markdown = tmp_path / "uea.json", tmp_path / "uea.md"
  for name, target in (("uea.json", results), ("uea.md", markdown)):
    shutil.copyfile(os.path.join(REPO_ROOT, "results", name), target)
  committed_json, committed_md = results.read_text(), markdown.read_text()
  assert (
    _main(
      ["--report_only", f"--results={results}", f"--root={tmp_path / 'no_workdirs'}", "--jobs=4"]
    )
    == 0
  )
  assert results.read_text() == committed_json  # no record dropped or rewritten
  rendered = markdown.read_text()

  def table_rows(text):
    return [line for line in text.splitlines() if line.startswith("| ")]

  assert table_rows(rendered) == table_rows(committed_md)
  groups = {(r["protocol"], r["dataset"], r["attention"]) for r in json.loads(committed_json)}
  protocols = {protocol for protocol, _, _ in groups}
  assert len(table_rows(rendered)) == len(groups) + len(protocols)  # + one header per table
  assert grid.previous_report_command(str(markdown)) == grid.previous_report_command(
    os.path.join(REPO_ROOT, "results", "uea.md")
  )


def test_the_grid_without_flags_is_the_published_one():
  """`primal-dual reproduce uea` runs the grid of results/uea.md (small model, 40 epochs), not
  the day-long reference grid."""
  args = grid.parse_arguments(uea_study.REPRODUCTION, [])
  uea_study.check_arguments(args)
  assert (args.model, args.epochs) == ("small", 40)
  quick = grid.parse_arguments(uea_study.REPRODUCTION, ["--quick"])
  uea_study.check_arguments(quick)
  assert quick.epochs == -1  # the runlocal config's own 2 epochs
  # A smoke test of 2 runs (one data set, one variant, both protocols), as the other grids'.
  assert len(uea_study.REPRODUCTION.build_runs(quick)) == 2
  assert quick.results == os.path.join("workdirs", "uea_quick", "uea_quick.json")
  with open(os.path.join(cli_helpers.REPO_ROOT, "results", "uea.md")) as f:
    assert "--scale=small --epochs=40" in f.read().splitlines()[2]
