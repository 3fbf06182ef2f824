"""The notebooks' code cells run as written (so the quick start cannot drift from the API)."""

import glob
import json
import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO_ROOT, "notebooks", "*.ipynb")))


def test_there_is_a_notebook():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_code_cells_run(path, tmp_path, monkeypatch):
  with open(path) as f:
    cells = json.load(f)["cells"]
  monkeypatch.chdir(os.path.dirname(path))
  namespace = {}
  for cell in cells:
    if cell["cell_type"] != "code":
      continue
    source = "".join(cell["source"]).replace("/tmp/primal_dual_notebook", str(tmp_path / "run"))
    exec(compile(source, f"{os.path.basename(path)} cell", "exec"), namespace)
