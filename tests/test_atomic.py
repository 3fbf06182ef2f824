"""primal_dual/atomic.py: a file is replaced whole or left as it was, and no temporary file stays."""

import os

import pytest

from primal_dual import atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
  path = str(tmp_path / "sub" / "report.md")
  atomic.write_text(path, "old")

  def fail(tmp):
    with open(tmp, "w") as f:
      f.write("half")
    raise OSError(28, "No space left on device")

  with pytest.raises(OSError, match="No space left"):
    atomic.write_with(path, fail)
  assert open(path).read() == "old"
  assert os.listdir(tmp_path / "sub") == ["report.md"]


def test_each_write_uses_its_own_temporary(tmp_path):
  path = str(tmp_path / "x.json")
  seen = []
  atomic.write_with(path, lambda tmp: (seen.append(tmp), open(tmp, "w").close()))
  atomic.write_with(path, lambda tmp: (seen.append(tmp), open(tmp, "w").close()))
  assert seen[0] != seen[1] and all(os.path.dirname(t) == str(tmp_path) for t in seen)
  atomic.write_json(path, {"b": 1, "a": 2})
  assert open(path).read() == '{\n  "a": 2,\n  "b": 1\n}'


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_written_file_has_the_mode_open_would_give_it(tmp_path, umask, mode):
  previous = os.umask(umask)
  try:
    path = atomic.write_json(str(tmp_path / "final_metrics.json"), {"a": 1})
  finally:
    os.umask(previous)
  assert os.stat(path).st_mode & 0o777 == mode
