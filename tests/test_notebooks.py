"""The notebooks run headless, top to bottom, as a Colab user runs them (so the quick start cannot
drift from the API): executed by nbclient in a fresh kernel at their CPU (`runlocal`) sizes."""

import glob
import os
import shutil
import subprocess
import sys
import venv

import pytest

import helpers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO_ROOT, "notebooks", "*.ipynb")))


# The clone's notebook run compiles the notebook's programs, the wheel's run loads them.
compilation_cache = pytest.fixture(scope="module", autouse=True)(
  helpers.subprocess_compilation_cache
)


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
  assert f"from {REPO_ROOT} |" in outputs["install"]
  assert "job size: runlocal" in outputs["devices"]
  assert "selected/test_accuracy:" in outputs["train"]
  assert "head distance per layer:" in outputs["redundancy"]
  assert outputs["kernels"].count("\n") == 7  # the header and one row per variant
  assert outputs["paper"].startswith("skipped: the paper preset is a GPU job")


# Runs a notebook in the interpreter running this script and writes it back executed:
# argv = notebook, working folder, output path.
_RUN_NOTEBOOK = """
import sys, nbclient, nbformat
notebook = nbformat.read(sys.argv[1], as_version=4)
client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                 resources={"metadata": {"path": sys.argv[2]}})
client.execute()
nbformat.write(notebook, sys.argv[3])
"""


@pytest.mark.slow
def test_the_notebook_installs_from_a_wheel_where_only_jax_is(tmp_path):
  """Colab from a link: `make dist`'s wheel, given to the first cell as PRIMAL_DUAL_WHEEL, in a
  fresh environment holding only jax, jaxlib and the notebook runner (no clone on any path):
  the cell installs the package with its [train] extra around the runtime's jax, which stays
  at its version, and the whole notebook runs."""
  import jax
  import jaxlib

  nbformat = pytest.importorskip("nbformat", reason="the dev extra installs nbformat")
  # `make dist`'s command, on a copy of what the wheel is built from (setuptools writes build/).
  source, dist = tmp_path / "source", tmp_path / "dist"
  shutil.copytree(
    os.path.join(REPO_ROOT, "primal_dual"),
    source / "primal_dual",
    ignore=shutil.ignore_patterns("__pycache__"),
  )
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(os.path.join(REPO_ROOT, name), source / name)
  build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
  subprocess.run([*build, "-w", str(dist), str(source)], check=True, capture_output=True)
  [wheel] = dist.glob("primal_dual-*-py3-none-any.whl")
  env_dir = tmp_path / "jax_only"
  venv.EnvBuilder(with_pip=True).create(env_dir)
  python = str(env_dir / "bin" / "python")
  jax_pins = [f"jax=={jax.__version__}", f"jaxlib=={jaxlib.__version__}"]
  runner = ["ipykernel", "nbclient", "nbformat"]
  # No byte-compiling of every installed module (here and in the notebook's install, PIP_COMPILE
  # below): Python compiles the ones imported when it imports them.
  subprocess.run(
    [python, "-m", "pip", "install", "-q", "--no-compile", *jax_pins, *runner],
    check=True,
    capture_output=True,
  )
  work = tmp_path / "colab"
  work.mkdir()
  notebook = work / "quickstart.ipynb"
  shutil.copy(os.path.join(REPO_ROOT, "notebooks", "quickstart.ipynb"), notebook)
  env = {
    key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "PRIMAL"))
  }
  env.update(
    PATH=f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
    JAX_PLATFORMS="cpu",
    MPLBACKEND="agg",
    PRIMAL_DUAL_WHEEL=str(wheel),
    PRIMAL_DUAL_NOTEBOOK_DIR=str(tmp_path / "workdirs"),
    PIP_COMPILE="0",
  )
  executed = tmp_path / "executed.ipynb"
  done = subprocess.run(
    [python, "-c", _RUN_NOTEBOOK, str(notebook), str(work), str(executed)],
    cwd=work,
    env=env,
    capture_output=True,
    text=True,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  outputs = {
    cell.id: "".join(out.get("text", "") for out in cell.get("outputs", []))
    for cell in nbformat.read(str(executed), as_version=4).cells
    if cell.cell_type == "code"
  }
  assert f"from wheel {wheel}" in outputs["install"], outputs["install"]
  assert "selected/test_accuracy:" in outputs["train"]
  versions = subprocess.run(
    [python, "-c", "import jax, jaxlib; print(jax.__version__, jaxlib.__version__)"],
    capture_output=True,
    text=True,
    check=True,
  )
  assert versions.stdout.split() == [jax.__version__, jaxlib.__version__]
