"""Files written whole or not at all: a crash or a full disk never leaves half a file behind
(the text goes to `<path>.tmp`, which then replaces `path` in one rename)."""

import json
import os
from typing import Any


def write_text(path: str, text: str) -> str:
  """Writes `text` to `path` atomically, creating the parent folder; returns `path`."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)
  return path


def write_json(path: str, payload: Any, *, indent: int = 2) -> str:
  """`payload` as JSON (sorted keys, `indent`) written atomically to `path`; returns `path`."""
  return write_text(path, json.dumps(payload, indent=indent, sort_keys=True))
