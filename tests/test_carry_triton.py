"""The slim Triton archive for a device machine: what it keeps, and that it unpacks into a
package the interpreter imports first, with the ptxas of the Triton it had."""

import os
import subprocess
import sys
import tarfile
import zipfile

import gpu_dev
import pytest

from tools.device import carry_triton


@pytest.mark.parametrize(
  "member, expected",
  [
    ("triton/__init__.py", True),
    ("triton/_C/libtriton.so", True),
    ("triton/language/core.py", True),
    ("triton/backends/nvidia/compiler.py", True),
    ("triton/backends/nvidia/include/cuda.h", True),  # the launcher's driver.c includes it
    ("triton/backends/nvidia/lib/libdevice.10.bc", True),
    ("triton/_C/libproton.so", False),
    ("triton/backends/amd/compiler.py", False),
    ("triton/backends/nvidia/bin/ptxas", False),
    ("triton/backends/nvidia/lib/cupti/libcupti.so.12", False),
    ("triton/include/triton/Dialect/Triton/IR/Dialect.h", False),
    ("triton/language/__pycache__/core.cpython-312.pyc", False),
    ("triton-3.9.0.dist-info/METADATA", False),
    ("triton/", False),
  ],
)
def test_kept_members(member, expected):
  assert carry_triton.kept(member) is expected


def test_wheel_version_reads_the_name_and_refuses_other_wheels(tmp_path):
  name = "triton-3.9.0-cp312-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
  assert carry_triton.wheel_version(tmp_path / name) == "3.9.0"
  with pytest.raises(ValueError, match="not a triton wheel: torch-2.11.0"):
    carry_triton.wheel_version(tmp_path / "torch-2.11.0-cp312-none-any.whl")


def test_packed_archive_imports_first_with_the_previous_ptxas(tmp_path):
  """A fake wheel's package, packed and activated, shadows the installed one; both ptxas
  settings name the installed Triton's ptxas (the PTX version the image's jaxlib takes)."""
  gpu_dev.require("triton")
  wheel = tmp_path / "triton-9.9.9-cp312-abi3-manylinux_2_28_x86_64.whl"
  with zipfile.ZipFile(wheel, "w") as fake:
    fake.writestr("triton/__init__.py", "__version__ = '9.9.9'\n")
    fake.writestr("triton/backends/amd/compiler.py", "raise ImportError\n")
    fake.writestr("triton-9.9.9.dist-info/METADATA", "Name: triton\n")
  archive = carry_triton.pack(wheel, tmp_path / "out", strip=False)
  assert archive.name == "triton-9.9.9.tar.xz"
  with tarfile.open(archive) as packed:
    assert packed.getnames() == ["triton/__init__.py"]
  root = tmp_path / "unpacked"
  lines = carry_triton.activate_lines(archive, root)
  script = f"{lines}\n{sys.executable} -c 'import triton; print(triton.__version__)'"
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
  assert run.stdout.strip() == "9.9.9", run.stderr
  import triton

  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  assert f"export TRITON_PTXAS_PATH={ptxas}" in lines.splitlines()
  assert f"export TRITON_PTXAS_BLACKWELL_PATH={ptxas}" in lines.splitlines()
