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


@pytest.mark.parametrize("study", STUDIES)
def test_committed_report_is_its_re_render(study, tmp_path, capsys):
  for extension in (".json", ".md"):
    shutil.copy(os.path.join(RESULTS, study + extension), tmp_path)
  module = importlib.import_module(f"reproduce.{study}")
  argv = ["--report_only", f"--results={tmp_path}/{study}.json", f"--root={tmp_path}/no_runs"]
  assert grid.reproduce(module.REPRODUCTION, argv) == 0, capsys.readouterr().err
  with open(os.path.join(RESULTS, f"{study}.md")) as f:
    committed = f.read()
  with open(tmp_path / f"{study}.md") as f:
    assert f.read() == committed, f"results/{study}.md differs from its re-render"


def test_a_report_of_a_removed_script_names_todays_command():
  command = "python scripts/reproduce_uea.py --model_size=small --epochs=40 --jobs=2"
  assert grid.current_command(command) == (
    "python scripts/reproduce.py uea --scale=small --epochs=40 --jobs=2"
  )
