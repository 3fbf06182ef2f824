"""Experiment configs: each module defines ``get_config(arg=None)`` returning a locked ConfigDict.

A config is named on the command line (``--config=...``) and in grids either by the path of any
config file or by the short name of one packaged here (``uea``, or ``primal_dual/configs/uea.py``
and the older ``configs/uea.py`` where no such file exists, e.g. outside a clone); ``resolve``
turns either into a file path, so an installed package trains from any folder.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def packaged_names() -> list[str]:
  """The short names of the configs in this package: ``['default', 'images', ...]``."""
  return sorted(
    os.path.splitext(name)[0]
    for name in os.listdir(_HERE)
    if name.endswith(".py") and not name.startswith("_")
  )


def _is_short_name(path: str) -> bool:
  """``uea`` is a short name; ``uea.py`` and ``x/uea`` are paths."""
  return "/" not in path and os.sep not in path and not path.endswith(".py")


def _packaged_alias(path: str) -> str | None:
  """``uea`` for ``configs/uea.py`` or ``.../primal_dual/configs/uea.py``; else None."""
  head, file_name = os.path.split(path)
  name, extension = os.path.splitext(file_name)
  return name if extension == ".py" and os.path.basename(head) == "configs" else None


def resolve(path: str) -> str:
  """The file of the config named by ``path``: the packaged config of a short name (``uea``), else
  the file ``path`` where it exists, else the packaged config of the same name for a
  ``configs/<name>.py`` path (a clone's command run elsewhere).

  Raises:
    ConfigError (one line, listing the packaged names): an unknown short name, or a missing file.
  """
  names = packaged_names()
  name = path if _is_short_name(path) else None
  if name is None and os.path.isfile(path):
    return path
  name = name or _packaged_alias(path)
  if name in names:
    return os.path.join(_HERE, f"{name}.py")
  from primal_dual.training import errors

  known = f"packaged configs: {', '.join(names)}"
  if _is_short_name(path):
    raise errors.ConfigError(f"unknown config {path!r}; {known} (or give a config file's path)")
  raise errors.ConfigError(f"config file {path} not found; {known}")


def resolve_spec(spec: str) -> str:
  """``resolve`` applied to the file part of ``'<file or name>[:arg]'``, the argument kept."""
  path, has_arg, arg = spec.partition(":")
  return resolve(path) + has_arg + arg


def load(path: str, arg: str | None = None):
  """``get_config(arg)`` of the config file or packaged name ``path`` (``resolve``), imported by
  path (the user's config files are not modules of a package)."""
  import importlib.util

  file_path = resolve(path)
  spec = importlib.util.spec_from_file_location(
    "primal_dual_config_" + os.path.splitext(os.path.basename(file_path))[0], file_path
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)
