"""The notebooks run headless, top to bottom, as a Colab user runs them (so the quick start cannot
drift from the API): executed by nbclient in a fresh kernel at their CPU (`runlocal`) sizes."""

import glob
import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO_ROOT, "notebooks", "*.ipynb")))


def test_there_is_a_notebook():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_every_cell_has_an_id_and_runs(path, tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat", reason="the dev extra installs nbformat")
  nbclient = pytest.importorskip("nbclient", reason="the dev extra installs nbclient")
  notebook = nbformat.read(path, as_version=4)
  nbformat.validate(notebook)
  ids = [cell.get("id") for cell in notebook.cells]
  assert all(ids) and len(set(ids)) == len(ids), ids
  # The kernel inherits this environment: the CPU, this clone, workdirs under tmp_path.
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("PRIMAL_DUAL_ROOT", REPO_ROOT)
  monkeypatch.setenv("PRIMAL_DUAL_NOTEBOOK_DIR", str(tmp_path))
  monkeypatch.setenv("MPLBACKEND", "agg")
  client = nbclient.NotebookClient(
    notebook,
    timeout=300,
    kernel_name="python3",
    resources={"metadata": {"path": os.path.dirname(path)}},
  )
  client.execute()  # raises CellExecutionError naming the failing cell
  outputs = {
    cell.id: "".join(out.get("text", "") for out in cell.get("outputs", []))
    for cell in notebook.cells
    if cell.cell_type == "code"
  }
  assert "primal_dual from " + REPO_ROOT in outputs["install"]
  assert "job size: runlocal" in outputs["devices"]
  assert "selected/test_accuracy:" in outputs["train"]
  assert "head distance per layer:" in outputs["redundancy"]
  assert outputs["kernels"].count("\n") == 7  # the header and one row per variant
  assert outputs["paper"].startswith("skipped: the paper preset is a GPU job")
