"""The paper's protocol of the sRAVEN and logic grids (``--protocol=paper_sweep``): the points it
runs, selection on validation only, and the report."""

import itertools
import os

import pytest

from reproduce import grid
from reproduce import hyla_paper
from reproduce import logic as logic_study
from reproduce import sraven as sraven_study

SEEDS = (0, 1, 2)


def _args(study, *argv, programs="separate"):
  return grid.parse_arguments(
    study.REPRODUCTION, ["--protocol=paper_sweep", f"--sweep_programs={programs}", *argv]
  )


def _points(runs):
  return {
    (
      r.tags["attention"],
      r.tags["lr"],
      r.tags["weight_decay"],
      r.tags["warmup_steps"],
      r.tags["seed"],
    )
    for r in runs
  }


def test_sraven_quick_sweep_lists_exactly_the_official_points(capsys):
  runs = sraven_study.REPRODUCTION.build_runs(_args(sraven_study, "--quick"))
  # raven.yaml (softmax): lr × wd × warm-up; raven_ablation.yaml (HYLA): lr × wd, warm-up 1000
  # (the quick runs' preset, cpu, has warm-up 500 and runlocal 1: not swept for HYLA, kept).
  softmax = itertools.product(["softmax"], (1e-3, 3e-4), (0.1, 0.3), (1000, 3000), SEEDS)
  hyla = itertools.product(["hyla"], (1e-3, 3e-4), (0.1, 0.3), (1,), SEEDS)
  assert _points(runs) == set(softmax) | set(hyla)
  assert len(runs) == 24 + 12 == len({r.name for r in runs})
  for run in runs[:3] + runs[-3:]:
    config = run.config()
    assert config.optimizer.lr == run.tags["lr"] and config.seed == run.tags["seed"]
    assert config.optimizer.weight_decay == run.tags["weight_decay"]
    assert config.optimizer.warmup_steps == run.tags["warmup_steps"]
    # The official end rate, 0.1 × lr, whatever the preset's rule.
    assert (config.optimizer.end_lr, config.optimizer.end_lr_factor) == (None, 0.1)
  assert (
    grid.reproduce(
      sraven_study.REPRODUCTION,
      [
        "--quick",
        "--protocol=paper_sweep",
        "--sweep_programs=separate",
        "--dry_run",
        "--root=/nonexistent",
      ],
    )
    == 0
  )
  listed = [line for line in capsys.readouterr().out.splitlines() if "to train" in line]
  assert len(listed) == 36


def _replica_points(runs):
  return {
    (r.tags["attention"], t["lr"], t["weight_decay"], t["warmup_steps"], t["seed"])
    for r in runs
    for _, t in r.replicas
  }


def test_the_sweep_trains_each_variant_as_one_program_of_its_points_and_seeds():
  from primal_dual.training import setup, sweep

  separate = sraven_study.REPRODUCTION.build_runs(_args(sraven_study, "--quick"))
  together = sraven_study.REPRODUCTION.build_runs(
    _args(sraven_study, "--quick", programs="replicas")
  )
  # One program per variant, holding the same 36 points (softmax 8 × 3 seeds, HYLA 4 × 3).
  assert len(together) == 2 and _replica_points(together) == _points(separate)
  assert sorted(len(r.replicas) for r in together) == [12, 24]
  for run in together:
    # The sub-workdirs the grid reads are those the trainer writes, with each point's settings.
    config = setup.resolve_config(run.config())
    assert config.train_data_on_device  # replicas of several seeds: batches made on the device
    replicas = sweep.replicas_of(config)
    assert sorted(r.name for r in replicas) == sorted(name for name, _ in run.replicas)
    by_name = dict(run.replicas)
    for replica in replicas:
      tags = by_name[replica.name]
      assert replica.config.optimizer.lr == tags["lr"]
      assert replica.config.optimizer.weight_decay == tags["weight_decay"]
      assert replica.config.optimizer.warmup_steps == tags["warmup_steps"]
      assert replica.config.seed == tags["seed"]
      assert (replica.config.optimizer.end_lr, replica.config.optimizer.end_lr_factor) == (
        None,
        0.1,
      )


def test_the_paper_grid_of_hyla_is_one_program_of_12_replicas_with_a_held_out_split_per_seed():
  """G1 of the sRAVEN grid: Table A1's lr × weight decay × seeds 0, 1, 2 for HYLA, one program
  whose three seeds keep each its own held-out split."""
  from primal_dual.training import setup

  argv = ("--scale=paper", "--sweep_variants=hyla", "--no_selected_checkpoints")
  (run,) = sraven_study.REPRODUCTION.build_runs(_args(sraven_study, *argv, programs="replicas"))
  config = setup.resolve_config(run.config())
  assert config.data.split_seed == -1 and config.model.attention_dropout_rate == 0.1
  assert not config.keep_selected_checkpoint  # the newest checkpoint only: 12 × 4.8 MB of state
  assert setup.build_program(config, for_training=False).data.num_groups == 3
  assert len(run.replicas) == 12
  assert {(t["lr"], t["weight_decay"], t["seed"]) for _, t in run.replicas} == set(
    itertools.product((1e-3, 3e-4), (0.1, 0.3), SEEDS)
  )


@pytest.mark.slow
def test_a_quick_logic_sweep_of_replicas_trains_and_reports(tmp_path, monkeypatch):
  monkeypatch.setattr(hyla_paper, "SEEDS", (0,))  # one program keeps the test short
  root, results = tmp_path / "runs", tmp_path / "logic.json"
  argv = [
    "--quick",
    "--protocol=paper_sweep",
    "--sweep_variants=hyla",
    f"--root={root}",
    f"--results={results}",
  ]
  assert grid.reproduce(logic_study.REPRODUCTION, argv) == 0
  records = grid.load_records(str(results))
  # HYLA: lr {1e-3, 3e-3} × wd {0.1, 0.03} at seed 0, one program of 4 replicas.
  assert len(records) == 4 and len({r["name"] for r in records}) == 4
  assert {r["name"].split("/")[0] for r in records} == {"logic_quick_sweep_hyla"}
  assert {(r["lr"], r["weight_decay"]) for r in records} == set(
    itertools.product((1e-3, 3e-3), (0.1, 0.03))
  )
  markdown = (tmp_path / "logic.md").read_text()
  assert "hyla" in markdown and "selected" in markdown.lower()


def test_paper_preset_sweeps_every_variant_and_marks_the_presets_own_point():
  runs = logic_study.REPRODUCTION.build_runs(_args(logic_study, "--scale=paper"))
  main, ablations = hyla_paper.GRID_VARIANTS["paper"]
  expected = itertools.product(main + ablations, (1e-3, 3e-3), (0.1, 0.03), (100,), SEEDS)
  assert _points(runs) == set(expected)
  fixed = {(r.tags["attention"], r.tags["setting"]) for r in runs if r.tags["preset_setting"]}
  assert fixed == {(v, "lr0.001_wd0.1") for v in main + ablations}
  chosen = sraven_study.REPRODUCTION.build_runs(
    _args(sraven_study, "--scale=paper", "--sweep_variants=hyla,softmax")
  )
  assert len(chosen) == 12 + 24
  assert {r.tags["setting"] for r in chosen if r.tags["preset_setting"]} == {
    "lr0.001_wd0.1",
    "lr0.001_wd0.1_wu1000",
  }
  assert hyla_paper.sweep_points("sraven", ["hyla"])[:3] == [
    ("hyla", hyla_paper.SweepSetting(1e-3, 0.1), s) for s in SEEDS
  ]


def test_sweep_refuses_flags_that_do_not_go_together():
  for argv in (["--protocol=paper_sweep", "--seeds_together"], ["--sweep_variants=hyla"]):
    assert grid.reproduce(sraven_study.REPRODUCTION, [*argv, "--dry_run"]) == 2
  # Seeds as replicas keep the paper preset's per-seed held-out splits.
  assert (
    grid.reproduce(sraven_study.REPRODUCTION, ["--scale=paper", "--seeds_together", "--dry_run"])
    == 0
  )


def _record(attention, setting, seed, validation, ood, preset_setting=False):
  return {
    "attention": attention,
    "setting": setting,
    "seed": seed,
    "protocol": "paper_sweep",
    "preset_setting": preset_setting,
    "validation_whole_panel": validation,
    "ood_whole_panel": ood,
    "id_whole_panel": 0.9,
    "final_ood_whole_panel": ood,
  }


# HYLA: setting B has the best mean validation, setting C the best OOD (and the best single
# validation seed): B must be selected. Softmax: one setting only.
FAKE = [
  _record("hyla", "A", 0, 0.50, 0.40, preset_setting=True),
  _record("hyla", "A", 1, 0.52, 0.42, preset_setting=True),
  _record("hyla", "B", 0, 0.80, 0.50),
  _record("hyla", "B", 1, 0.82, 0.54),
  _record("hyla", "C", 0, 0.95, 0.90),
  _record("hyla", "C", 1, 0.30, 0.92),
  _record("softmax", "A", 0, 0.60, 0.55, preset_setting=True),
  {"attention": "softmax", "seed": 0, "ood_whole_panel": 0.99, "validation_whole_panel": 0.99},
]


def test_selection_is_on_mean_validation_never_ood():
  chosen = hyla_paper.select_settings(FAKE, "validation_whole_panel")
  assert chosen["hyla"].setting == "B"  # C: best OOD and best single seed, worse mean validation
  assert chosen["hyla"].validation == pytest.approx(0.81)
  assert chosen["softmax"].setting == "A"  # the fixed-protocol record takes no part
  # Swap the fields: the choice follows whatever field selects.
  assert hyla_paper.select_settings(FAKE, "ood_whole_panel")["hyla"].setting == "C"


def test_sweep_report_gives_selected_fixed_and_reference_with_standard_errors():
  report = sraven_study.sweep_section(FAKE)
  selected = next(line for line in report.splitlines() if line.startswith("| hyla | B | 2"))
  # OOD of B: mean 52.00, s.e. = std(50, 54)/√2 = 2.83/1.41 = 2.00; fixed setting A: 41.00 ± 1.00.
  assert "52.00 ± 2.00" in selected and "41.00 ± 1.00" in selected and "69.13 ± 1.90" in selected
  rows = [line for line in report.splitlines() if line.startswith("| hyla | ")]
  best_by_ood, per_setting, per_run = rows[1], rows[2:5], rows[5:]
  # Beside the selection, labelled: C, the setting a selection on OOD itself would pick.
  assert best_by_ood == "| hyla | C | 2 | 91.00 ± 1.00 | 52.00 ± 2.00 |"
  assert "optimistic" in report
  assert len(per_setting) == 3 and per_setting[1].endswith("| 2 of 2 | ✓ |")
  assert per_setting[2].endswith("| 1 of 2 |  |")  # C's seed 1 stayed under the plateau (35 %)
  # Every run, in (setting, seed) order: C's seeds apart (validation 95 and 30), steps unknown.
  assert [row.split(" | ")[1:4] for row in per_run] == [
    [setting, str(seed), f"{100 * validation:.2f}"]
    for setting, seed, validation in [
      ("A", 0, 0.50),
      ("A", 1, 0.52),
      ("B", 0, 0.80),
      ("B", 1, 0.82),
      ("C", 0, 0.95),
      ("C", 1, 0.30),
    ]
  ]
  assert per_run[5].endswith("| 92.00 | 90.00 | 92.00 | – |")
  assert "A (fixed setting)" in per_setting[0]
  assert "91.00 ± 1.00" in per_setting[2]  # C's OOD is listed, not selected
  assert (
    "(reference)" in report
    and hyla_paper.sweep_report(
      [], validation_field="x", columns={"a": "b"}, references={}, reference_column="r"
    )
    == ""
  )


def test_logic_sweep_report_selects_on_validation_r2():
  records = [
    {
      **_record("hyla", "lr0.001_wd0.1", s, 0, 0),
      "validation_r2": v,
      "test_r2_per_sequence": t,
      "test_r2": t,
      "ood_r2": t,
    }
    for s, (v, t) in enumerate([(0.9, 0.5), (0.9, 0.5)])
  ] + [
    {
      **_record("hyla", "lr0.003_wd0.1", s, 0, 0),
      "validation_r2": v,
      "test_r2_per_sequence": t,
      "test_r2": t,
      "ood_r2": t,
    }
    for s, (v, t) in enumerate([(0.8, 0.9), (0.8, 0.9)])
  ]
  report = logic_study.sweep_section(records)
  assert (
    "| hyla | lr0.001_wd0.1 | 2 | 90.00 ± 0.00 | 50.00 ± 0.00" in report
    and "81.13 ± 7.77" in report
  )


PROBE_POINTS = ("lr=0.001,wd=0.1,attn_dropout=0.0", "lr=0.0003,wd=0.1,attn_dropout=0.1")


def test_points_protocol_trains_the_listed_points_and_seeds_as_one_program_per_variant(capsys):
  from primal_dual.training import setup, sweep

  args = grid.parse_arguments(
    sraven_study.REPRODUCTION,
    [
      "--scale=paper",
      "--protocol=points",
      "--points",
      *PROBE_POINTS,
      "lr=0.001,wd=0.1,attn_dropout=0.1",  # the paper preset's own point
      "--sweep_variants=hyla,softmax",
      "--sweep_seeds=1,2",
      "--steps_per_call=125",
    ],
  )
  runs = sraven_study.REPRODUCTION.build_runs(args)
  assert [r.tags["attention"] for r in runs] == ["hyla", "softmax"]
  listed = [
    "lr=0.001,wd=0.1,attn_dropout=0.0",
    "lr=0.0003,wd=0.1,attn_dropout=0.1",
    "lr=0.001,wd=0.1,attn_dropout=0.1",
  ]
  for run in runs:
    config = setup.resolve_config(run.config())
    assert config.train_data_on_device and config.steps_per_call == 125
    replicas = sweep.replicas_of(config)
    # Exactly the listed points, in their order, at each seed, in the sub-workdirs the grid reads.
    assert (
      [r.name for r in replicas]
      == [name for name, _ in run.replicas]
      == [f"{point},seed={seed}" for point in listed for seed in (1, 2)]
    )
    for replica, (_, tags) in zip(replicas, run.replicas):
      assert replica.config.model.attention_dropout_rate == tags["attention_dropout_rate"]
      assert replica.config.optimizer.lr == tags["lr"] and replica.config.seed == tags["seed"]
      assert replica.config.optimizer.end_lr_factor == 0.1
    assert [tags["setting"] for _, tags in run.replicas] == [p for p in listed for _ in (1, 2)]
    assert [tags["preset_setting"] for _, tags in run.replicas] == [False] * 4 + [True] * 2
  assert grid.reproduce(sraven_study.REPRODUCTION, ["--points", PROBE_POINTS[0], "--dry_run"]) == 2
  assert "--points and --protocol=points go together" in capsys.readouterr().err
  assert grid.reproduce(sraven_study.REPRODUCTION, ["--sweep_seeds=1", "--dry_run"]) == 2
  assert "--sweep_seeds need --protocol=paper_sweep or points" in capsys.readouterr().err
  bad = ["--quick", "--protocol=points", "--points", "lr=0.001,depth=2", "--dry_run"]
  assert grid.reproduce(sraven_study.REPRODUCTION, bad) == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert "'depth=2' is not <field>=<number>" in line


def test_points_report_selects_on_validation_beside_the_paper_sweep():
  points = [dict(r, protocol="points") for r in FAKE[:6]]
  markdown = sraven_study.sweep_section(points)
  assert "## Listed points (`--protocol=points`)" in markdown
  assert "The paper's protocol" not in markdown
  assert (
    hyla_paper.select_settings(points, "validation_whole_panel", "points")["hyla"].setting == "B"
  )
  both = sraven_study.sweep_section(points + FAKE)
  assert both.index("The paper's protocol") < both.index("Listed points")


def test_curves_of_several_settings_are_told_apart(tmp_path, monkeypatch):
  """Lease 5's figure drew both of softmax's points in one colour under one label."""
  from primal_dual.analysis import plots

  saved = []
  save_figure = plots.save_figure

  def keep_legend(figure, path, **kwargs):
    saved.append([text.get_text() for text in figure.axes[-1].get_legend().get_texts()])
    return save_figure(figure, path, **kwargs)

  monkeypatch.setattr(plots, "save_figure", keep_legend)
  curve = {"step": [1, 2], "ood": [0.1, 0.2]}
  records = [
    {"attention": "softmax", "setting": setting, "curve": curve}
    for setting in ("lr=0.001,wd=0.1,attn_dropout=0.0", "lr=0.001,wd=0.1,attn_dropout=0.1")
  ]
  one_setting = [dict(r, setting="lr=0.001") for r in records]
  with_a_fixed_run = [*records, {"attention": "hyla", "curve": curve}]  # no setting of its own
  for name, runs in (("points", records), ("fixed", one_setting), ("mixed", with_a_fixed_run)):
    path = hyla_paper.plot_curves(runs, {"ood": "ood"}, str(tmp_path / f"{name}.png"), "acc", "t")
    assert os.path.getsize(path) > 0
  by_setting = [f"softmax ({r['setting']})" for r in records]
  assert saved == [by_setting, ["softmax"], [*by_setting, "hyla"]]
