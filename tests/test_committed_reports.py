"""The committed reports (results/<study>.md) are what `--report_only` renders from the committed
records (results/<study>.json) today: a fresh clone's re-render rewrites none of them, and no
report names a script, config path or flag that no longer exists."""

import importlib
import os
import shutil

import pytest

from reproduce import grid

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO_ROOT, "results")
STUDIES = ("uea", "listops", "images", "sraven", "logic")
# Reports of the paper presets (results/paper/<stem>): stem → (study, the flags they were
# rendered with).
PAPER_REPORTS = {
  "logic": ("logic", ["--scale=paper", "--steps_per_call=125"]),
  "sraven_points": (
    "sraven",
    [
      "--scale=paper",
      "--protocol=points",
      "--sweep_variants=hyla",
      "--sweep_seeds=0,1,2",
      "--points",
      "lr=0.001,wd=0.1,attn_dropout=0.0",
      "lr=0.0003,wd=0.1,attn_dropout=0.1",
    ],
  ),
  "sraven_points_softmax": (
    "sraven",
    [
      "--scale=paper",
      "--steps_per_call=125",
      "--protocol=points",
      "--sweep_variants=softmax",
      "--points",
      "lr=0.001,wd=0.1,attn_dropout=0.0",
      "lr=0.001,wd=0.1,attn_dropout=0.1",
      "--sweep_seeds=0,1,2",
    ],
  ),
  "sraven_points_linear_plain": (
    "sraven",
    [
      "--scale=paper",
      "--steps_per_call=125",
      "--protocol=points",
      "--sweep_variants=linear_plain",
      "--points",
      "lr=0.001,wd=0.1,attn_dropout=0.0",
      "lr=0.001,wd=0.1,attn_dropout=0.1",
      "--sweep_seeds=0,1",
    ],
  ),
}
REPORTS = [(study, study, []) for study in STUDIES] + [
  (f"paper/{stem}", study, flags) for stem, (study, flags) in PAPER_REPORTS.items()
]


@pytest.mark.parametrize("path,study,flags", REPORTS)
def test_committed_report_is_its_re_render(path, study, flags, tmp_path, capsys):
  stem = os.path.basename(path)
  for extension in (".json", ".md"):
    shutil.copy(os.path.join(RESULTS, path + extension), tmp_path)
  module = importlib.import_module(f"reproduce.{study}")
  argv = [*flags, "--report_only", f"--results={tmp_path}/{stem}.json"]
  argv.append(f"--root={tmp_path}/no_runs")
  assert grid.reproduce(module.REPRODUCTION, argv) == 0, capsys.readouterr().err
  with open(os.path.join(RESULTS, f"{path}.md")) as f:
    committed = f.read()
  with open(tmp_path / f"{stem}.md") as f:
    assert f.read() == committed, f"results/{path}.md differs from its re-render"


def test_a_report_of_a_removed_script_names_todays_command():
  command = "python scripts/reproduce_uea.py --model_size=small --epochs=40 --jobs=2"
  assert grid.current_command(command) == (
    "python scripts/reproduce.py uea --scale=small --epochs=40 --jobs=2"
  )
