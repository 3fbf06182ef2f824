"""A Triton other than the device image's, small enough to carry to a device machine.

The lent image has Triton 3.6.0 (torch's pin), whose masked 16-bit products in the tensorcore HYLA
kernels an H100 computed wrong (``hyla.tensorcore.NATIVE_16BIT_ON_GPU``; fixed from 3.8) and whose
ptxas spills their dq_dk launch. A Triton wheel is 190–290 MB; a call carries 64 MiB in all. What
jax-triton and the tensorcore probe need of it is the compiler (``libtriton.so``, stripped of its
symbols: 480 → 185 MB, about 37 MB as xz) and its Python files; this keeps those and leaves out
the profiler (``libproton.so``, CUPTI), the AMD backend, the bundled CUDA tools and the headers for
building plugins. The device then takes the image's own ptxas (``TRITON_PTXAS_*_PATH``): it makes
the PTX version the image's jaxlib already compiles (8.7 for sm_90a), which a newer bundled ptxas
would raise. Checked on a CPU with the cp312 archive under Python 3.12: jax-triton 0.3.1 compiles
the three tensorcore launches to sm_90a PTX with the slim Triton 3.9.0 and the image's Triton 3.6
ptxas.

Here (the registry is reachable; about 3 minutes, mostly xz)::

  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d /tmp/w triton==3.9.0
  python3 -m tools.device.carry_triton /tmp/w/triton-3.9.0-*.whl

writes ``.triton/triton-3.9.0.tar.xz`` (an ignored folder: carry ``.triton``). On the device,
first, before anything imports triton::

  eval "$(python3 -m tools.device.carry_triton --activate .triton/triton-3.9.0.tar.xz)"
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import io
import lzma
import shlex
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

OUT_DIR = Path(".triton")
UNPACK_ROOT = Path("/tmp/carried_triton")
# Members of the wheel left out (fnmatch patterns on their paths; '*' crosses '/').
LEFT_OUT = (
  "triton/_C/libproton.so",  # the profiler
  "triton/profiler/*",
  "triton/backends/amd/*",  # found only by entry point; --activate discovers backends in tree
  "triton/backends/nvidia/bin/*",  # ptxas, cuobjdump, nvdisasm: the image's own are used
  "triton/backends/nvidia/lib/cupti*",
  "triton/instrumentation/*",
  "triton/include/*",  # MLIR headers, for building plugins
  "triton/plugins/*",
  "triton/FileCheck/*",
  "*/__pycache__/*",
)


def kept(member: str) -> bool:
  """Whether a wheel member goes into the carried archive: the package's files, less LEFT_OUT."""
  if not member.startswith("triton/") or member.endswith("/"):
    return False
  return not any(fnmatch.fnmatch(member, pattern) for pattern in LEFT_OUT)


def wheel_version(wheel: Path) -> str:
  """``'3.9.0'`` of ``triton-3.9.0-cp312-abi3-....whl``."""
  name, version, *rest = wheel.name.split("-")
  if name != "triton" or not rest or not wheel.name.endswith(".whl"):
    raise ValueError(f"not a triton wheel: {wheel.name}")
  return version


def _stripped(data: bytes) -> bytes:
  """A shared library without its symbol tables (``strip --strip-unneeded``)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "lib.so"
    path.write_bytes(data)
    subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
    return path.read_bytes()


def pack(wheel: Path, out_dir: Path = OUT_DIR, strip: bool = True) -> Path:
  """Writes ``out_dir/triton-<version>.tar.xz`` of the kept members (shared libraries stripped)
  and returns its path."""
  out_dir.mkdir(parents=True, exist_ok=True)
  out = out_dir / f"triton-{wheel_version(wheel)}.tar.xz"
  preset = 9 | lzma.PRESET_EXTREME
  with zipfile.ZipFile(wheel) as source, tarfile.open(out, "w:xz", preset=preset) as archive:
    for info in source.infolist():
      if not kept(info.filename):
        continue
      data = source.read(info)
      if strip and info.filename.endswith(".so"):
        data = _stripped(data)
      entry = tarfile.TarInfo(info.filename)
      entry.size = len(data)
      entry.mode = 0o755 if info.filename.endswith(".so") else 0o644
      archive.addfile(entry, io.BytesIO(data))
  return out


def activate_lines(archive: Path, root: Path = UNPACK_ROOT) -> str:
  """Shell lines that unpack ``archive`` under ``root`` and put it first on ``PYTHONPATH``, with
  the ptxas of the Triton the interpreter already has (run before the switch) for both of
  Triton's ptxas settings, and in-tree backend discovery (the image's dist-info names an AMD
  backend the archive leaves out)."""
  with tarfile.open(archive) as members:
    members.extractall(root, filter="data")
  installed = importlib.util.find_spec("triton")  # the image's, located without importing it
  if installed is None or not installed.submodule_search_locations:
    raise SystemExit("no triton is installed to take ptxas from: run this with the image's python3")
  ptxas = Path(installed.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / "ptxas"
  return "\n".join(
    [
      f"export PYTHONPATH={shlex.quote(str(root))}${{PYTHONPATH:+:$PYTHONPATH}}",
      f"export TRITON_PTXAS_PATH={shlex.quote(str(ptxas))}",
      f"export TRITON_PTXAS_BLACKWELL_PATH={shlex.quote(str(ptxas))}",
      "export TRITON_BACKENDS_IN_TREE=1",
    ]
  )


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("path", type=Path, help="a triton wheel; with --activate, its archive")
  parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
  parser.add_argument(
    "--activate", action="store_true", help="unpack the archive; print the lines to eval"
  )
  args = parser.parse_args(argv)
  if args.activate:
    print(activate_lines(args.path))
    return
  out = pack(args.path, args.out_dir)
  print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
  main()
