"""Files written whole or not at all: a crash or a full disk never leaves half a file behind.

Each writer fills a temporary file of a unique name beside the target, then replaces the target
in one rename (two processes writing the same path never share a temporary file).
"""

import contextlib
import json
import os
import tempfile
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
  """Yields a temporary path beside ``path`` to write; on success it replaces ``path``, on error
  it is removed and ``path`` is left as it was. Creates the parent folder."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
  try:
    # mkstemp creates 0600; a result file gets what `open` would give it (0644 under umask 022).
    os.fchmod(fd, 0o666 & ~_current_umask())
  finally:
    os.close(fd)
  try:
    yield tmp
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def _current_umask() -> int:
  """The process's umask (reading it means setting it: it is set back at once)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def write_with(path: str, write: Callable[[str], Any]) -> str:
  """``write(tmp_path)`` (e.g. a figure's ``savefig``) made atomic for ``path``; returns ``path``."""
  with replacing(path) as tmp:
    write(tmp)
  return path


def write_text(path: str, text: str) -> str:
  """Writes ``text`` to ``path`` atomically, creating the parent folder; returns ``path``."""

  def write(tmp: str) -> None:
    with open(tmp, "w") as f:
      f.write(text)

  return write_with(path, write)


def write_json(path: str, payload: Any, *, indent: int = 2) -> str:
  """``payload`` as JSON (sorted keys, ``indent``) written atomically to ``path``; returns it."""
  return write_text(path, json.dumps(payload, indent=indent, sort_keys=True))
