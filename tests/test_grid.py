"""reproduce/grid.py: parallel runs, hardware records, report helpers."""

import argparse
import json
import os

import pytest

from primal_dual.training import errors
from reproduce import grid

CPU = {
  "platform": "cpu",
  "device_kind": "cpu",
  "device_count": 1,
  "host_machine": "x86_64",
  "host_cpu_count": 2,
  "jax_version": "0.10.2",
}
H100 = {
  "platform": "gpu",
  "device_kind": "NVIDIA H100 80GB HBM3",
  "device_count": 1,
  "host_machine": "x86_64",
  "host_cpu_count": 16,
  "jax_version": "0.11.2",
}


def test_describe_hardware_names_each_distinct_machine_once():
  assert grid.describe_hardware([{"hardware": H100}, {"hardware": H100}]) == (
    "1 × NVIDIA H100 80GB HBM3 (gpu; host x86_64 with 16 CPU cores; JAX 0.11.2)"
  )
  mixed = grid.describe_hardware([{"hardware": CPU}, {"hardware": None}, {"hardware": CPU}])
  assert mixed == "x86_64 CPU with 2 cores (JAX 0.10.2) and unrecorded hardware"
  assert grid.describe_hardware([]) == "no runs"


def test_hardware_info_describes_this_process():
  info = grid.hardware_info()
  assert set(info) == set(CPU)
  assert info["device_count"] >= 1 and info["host_cpu_count"] >= 1


def test_shared_machine_note_and_invocation():
  assert grid.shared_machine_note("python s.py --jobs=1") == ""
  assert grid.shared_machine_note("python s.py") == ""
  assert "With `--jobs=4`, 4 runs trained at once" in grid.shared_machine_note(
    "python s.py --root=x --jobs=4"
  )
  assert grid.invocation("scripts/x.py", ["--jobs=3", "--report_only", "--quick"]) == (
    "python scripts/x.py --jobs=3 --quick"
  )


def test_jobs_below_one_and_missing_results_are_refused(tmp_path):
  with pytest.raises(ValueError, match="--jobs=0: give at least 1"):
    grid.run_grid([], str(tmp_path), str(tmp_path / "r.json"), jobs=0)
  with pytest.raises(errors.UserError, match="run the grid first"):
    grid.records_for_report([], str(tmp_path), str(tmp_path / "missing.json"), report_only=True)


def test_report_only_reads_the_records_without_training(tmp_path):
  path = tmp_path / "r.json"
  path.write_text(json.dumps([{"name": "a", "hardware": CPU}]))
  never_run = [grid.GridRun(name="a", config_file="no/such/config.py", config_arg="")]
  assert grid.records_for_report(never_run, str(tmp_path), str(path), report_only=True) == [
    {"name": "a", "hardware": CPU}
  ]


def test_a_failing_parallel_run_raises_with_its_log_tail(tmp_path):
  config_file = tmp_path / "broken_config.py"
  config_file.write_text("def get_config(arg):\n  raise ValueError('broken config: ' + arg)\n")
  runs = [grid.GridRun(name="broken", config_file=str(config_file), config_arg="xyz")]
  with pytest.raises(RuntimeError, match=r"grid run broken failed \(exit 1\)") as failure:
    grid.run_grid(runs, str(tmp_path / "runs"), str(tmp_path / "r.json"), jobs=2)
  assert "broken config: xyz" in str(failure.value)
  assert os.path.exists(tmp_path / "runs" / "broken" / grid.RUN_LOG)
  assert not grid.is_finished(str(tmp_path / "runs" / "broken"))


def _parse(argv, quick_variants=("softmax",)):
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  grid.add_variant_and_seed_arguments(parser, ("softmax", "sh"), quick_variants, (0, 1, 2))
  args = parser.parse_args(argv)
  grid.check_variants_and_seeds(parser, args, ("softmax", "sh"), quick_variants, (0, 1, 2))
  return args


def test_variant_and_seed_arguments_fill_defaults_and_reject_unknown_names(capsys):
  args = _parse([])
  assert args.variants == ("softmax", "sh") and args.seeds == (0, 1, 2)
  args = _parse(["--quick"])
  assert args.variants == ("softmax",) and args.seeds == (0,)
  args = _parse(["--variants=bn,hyla", "--seeds=4"])
  assert args.variants == ("bn", "hyla") and args.seeds == (4,)
  for argv, message in (
    (["--variants=softmax,nope"], "--variants: unknown ['nope']"),
    (["--variants=,"], "--variants: unknown empty list"),
    (["--seeds=,"], "--seeds: give at least one seed"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      _parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_check_schema_names_every_problem():
  schema = {"name": (str,), "count": (int,), "flag": (bool,), "score": (int, float)}
  grid.check_schema({"name": "a", "count": 3, "flag": True, "score": 0.5}, schema, "X")
  with pytest.raises(ValueError) as failure:
    grid.check_schema(
      {"name": "a", "count": True, "score": "high"},
      schema,
      "X",
      ["protocol: 'p' is not one of ['q']"],
    )
  message = str(failure.value)
  assert message.startswith("X record 'a' does not match RECORD_SCHEMA: ")
  for part in (
    "count: bool where ['int'] expected",
    "flag: missing",
    "score: str where ['int', 'float'] expected",
    "protocol: 'p' is not one of",
  ):
    assert part in message


def test_report_helpers():
  records = [
    {"attention": "softmax", "n": 1},
    {"attention": "sh", "n": 2},
    {"attention": "softmax", "n": 3},
  ]
  assert grid.first_by_variant(records, "n") == {"softmax": 1, "sh": 2}
  assert grid.field("n")(records[1]) == 2 and grid.field("missing")(records[1]) is None


def test_report_command_keeps_the_command_of_the_report_it_replaces(tmp_path):
  markdown = tmp_path / "r.md"
  assert grid.report_command("scripts/x.py", ["--jobs=3"], str(markdown), report_only=True) == (
    "python scripts/x.py --jobs=3"
  )  # no report yet: this command
  markdown.write_text("# Title\n\nMeasured by `python scripts/x.py --jobs=6 --quick` on a GPU.\n")
  assert grid.previous_report_command(str(markdown)) == "python scripts/x.py --jobs=6 --quick"
  assert (
    grid.report_command("scripts/x.py", ["--report_only"], str(markdown), report_only=True)
    == "python scripts/x.py --jobs=6 --quick"
  )
  # A grid that trains names its own command, whatever the old report said.
  assert grid.report_command("scripts/x.py", ["--jobs=2"], str(markdown), report_only=False) == (
    "python scripts/x.py --jobs=2"
  )


def test_replica_runs_give_one_record_per_seed(tmp_path):
  """A GridRun sweeping seeds (``sweep.seed``) trains them in one program and yields a record per
  seed, read from <root>/<name>/seed=<s>; a second call reuses them."""
  from reproduce import hyla_paper

  run = grid.GridRun(
    name="pair",
    config_file="sraven",
    config_arg="runlocal",
    tags={"attention": "softmax"},
    overrides={"steps_per_call": 2, "train_data_on_device": True, "sweep.seed": [0, 5]},
    replicas=hyla_paper._seed_replicas((0, 5)),
  )
  config = run.config()
  assert (
    tuple(config.sweep.seed) == (0, 5)
    and config.train_data_on_device
    and config.steps_per_call == 2
  )
  results = str(tmp_path / "results.json")
  records = grid.run_grid([run], str(tmp_path / "runs"), results, log=lambda _: None)
  assert [(r["name"], r["seed"]) for r in records] == [("pair/seed=0", 0), ("pair/seed=5", 5)]
  assert records[0]["metrics"] != records[1]["metrics"]
  assert records[0]["overrides"] == {
    "steps_per_call": 2,
    "train_data_on_device": True,
    "sweep.seed": [0, 5],
  }
  for record in records:
    assert record["metrics"]["model/num_parameters"] > 0
  assert run.is_finished(str(tmp_path / "runs"))
  assert grid.run_grid([run], str(tmp_path / "runs"), results, log=lambda _: None) == records


def test_hyla_grids_group_seeds_into_replica_runs():
  from reproduce import hyla_paper as sraven_task

  runs = sraven_task.build_runs("sraven", "sraven", "paper", False, -1, 125, True)
  main, ablations = sraven_task.GRID_VARIANTS["paper"]
  assert [r.tags["attention"] for r in runs[:3]] == list(main)
  device = {"train_data_on_device": True, "steps_per_call": 125}
  assert all(r.overrides == {**device, "sweep.seed": [0, 1, 2]} for r in runs[:3])
  assert all([name for name, _ in r.replicas] == ["seed=0", "seed=1", "seed=2"] for r in runs[:3])
  assert [(r.tags["attention"], r.tags["seed"], r.replicas) for r in runs[3:]] == [
    (name, 0, ()) for name in ablations
  ]
  assert all(r.overrides == device for r in runs[3:])
  plain = sraven_task.build_runs("sraven", "sraven", "paper", False, -1)
  assert len(plain) == 3 * 3 + len(ablations) and not any(r.overrides for r in plain)


def _finish(workdir, value):
  """A workdir as a finished run leaves it (final metrics and the grid's run record)."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, grid.FINAL_METRICS), "w") as f:
    json.dump({"value": value}, f)
  with open(os.path.join(workdir, grid.RUN_INFO), "w") as f:
    json.dump({"wall_time_s": 1.0, "hardware": CPU}, f)


def test_a_parallel_grid_cut_short_keeps_the_records_of_its_finished_runs(tmp_path, monkeypatch):
  """With --jobs > 1 each run's record is written as it ends: a failing run leaves the results
  JSON holding the runs that finished (before, nothing was written until every run ended)."""

  def fake_train(run, workdir):
    if run.name == "broken":
      raise RuntimeError("grid run broken failed")
    _finish(workdir, len(run.name))

  monkeypatch.setattr(grid, "train_in_subprocess", fake_train)
  runs = [grid.GridRun(name=n, config_file="x", config_arg="") for n in ("a", "broken", "ccc")]
  results = tmp_path / "r.json"
  with pytest.raises(RuntimeError, match="broken failed"):
    grid.run_grid(runs, str(tmp_path / "runs"), str(results), jobs=3, log=lambda _: None)
  records = json.loads(results.read_text())
  assert sorted((r["name"], r["metrics"]["value"]) for r in records) == [("a", 1), ("ccc", 3)]


def test_finished_only_reports_the_finished_runs_and_trains_nothing(tmp_path):
  root = tmp_path / "runs"
  _finish(root / "b", 7)
  never_trained = "no/such/config.py"  # training any run would fail on it
  runs = [grid.GridRun(name=n, config_file=never_trained, config_arg="") for n in ("a", "b", "c")]
  log = []
  records = grid.run_grid(
    runs, str(root), str(tmp_path / "r.json"), finished_only=True, log=log.append
  )
  assert [(r["name"], r["metrics"]) for r in records] == [("b", {"value": 7})]
  assert json.loads((tmp_path / "r.json").read_text()) == records
  assert log == [
    "[1/3] a: not finished, left out",
    "[2/3] b: finished earlier, reusing",
    "[3/3] c: not finished, left out",
  ]
  assert grid.runs_without_records(runs, records) == ["a", "c"]
  section = grid.left_out_section(["a", "c"], 3)
  assert "2 of the grid's 3 runs" in section and "- `a`\n- `c`" in section
  assert grid.left_out_section([], 3) == ""
  with pytest.raises(errors.UserError, match="no run of the grid has finished under"):
    grid.run_grid(runs[:1], str(root), str(tmp_path / "r2.json"), finished_only=True)


def test_runs_without_records_reads_replica_records_as_their_run():
  runs = [grid.GridRun(name=n, config_file="x", config_arg="") for n in ("p_s0", "p_s1")]
  records = [{"name": "p_s0/lr=0.001,wd=0.1"}, {"name": "p_s0/lr=0.0003,wd=0.1"}]
  assert grid.runs_without_records(runs, records) == ["p_s1"]
