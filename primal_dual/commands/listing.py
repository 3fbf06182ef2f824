"""`primal-dual list`: the attention variants, the packaged configs with their arguments and
defaults, and, in a clone, the paper studies `primal-dual reproduce` runs.

The variants and the studies need only the base install; the configs (ml_collections) need the
`[train]` extra, so without it their section says how to install it instead.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable

from primal_dual import commands, configs, registry  # configs: the base install's `os` only


class _Declared(Exception):
  """Carries the arguments a config's ``get_config`` declares to ``config_lib.parse_arg``."""

  def __init__(self, defaults: dict[str, Any]):
    super().__init__()
    self.defaults = defaults


def config_arguments(name: str) -> dict[str, Any]:
  """The ``key=value`` arguments config ``name`` takes, with their defaults: what its
  ``get_config`` passes to ``config_lib.parse_arg`` (caught there; nothing else is built)."""
  from primal_dual.training import config_lib

  def declare(arg, **defaults):
    del arg
    raise _Declared(defaults)

  parse_arg = config_lib.parse_arg
  config_lib.parse_arg = declare
  try:
    configs.load(name, None)
  except _Declared as declared:
    return declared.defaults
  finally:
    config_lib.parse_arg = parse_arg
  return {}


def _variant_lines() -> list[str]:
  width = max(map(len, registry.ATTENTION_REGISTRY))
  return [
    f"  {name:<{width}}  {entry.description}".rstrip()
    for name, entry in registry.ATTENTION_REGISTRY.items()
  ]


# A config refusing an argument's value names the allowed ones: "...; choose one of a, b".
_CHOICES = re.compile(r"choose one of ([\w.-]+(?:, [\w.-]+)*)")
_PROBE = "__not_a_value__"


def allowed_values(name: str, key: str) -> tuple[str, ...] | None:
  """The values config ``name`` accepts for its text argument ``key``, as its own refusal of
  another value lists them (the config is the one place that knows them); None for a free-form
  argument (a folder) or one whose refusal names none."""
  try:
    configs.load(name, f"{key}={_PROBE}")
  except Exception as e:  # noqa: BLE001 - a refusal is what is read here
    found = _CHOICES.search(str(e))
    return tuple(found.group(1).split(", ")) if found else None
  return None


def _shown_argument(name: str, key: str, value: Any) -> str:
  """``key=default``, with the allowed values of a text argument: ``preset=cpu (cpu|paper)``."""
  shown = f"{key}={value!r}" if value == "" else f"{key}={value}"
  if key == "attention":
    return f"{shown} (a variant: list variants)"
  choices = allowed_values(name, key) if isinstance(value, str) else None
  return f"{shown} ({'|'.join(choices)})" if choices else shown


def _config_lines() -> list[str]:
  try:
    from primal_dual.training import config_lib  # noqa: F401 - the configs' ml_collections
  except ModuleNotFoundError as e:
    if not commands.missing_train_extra(e):
      raise
    return [f"  (the configs need the train extra: {commands.PIP_INSTALL_TRAIN_EXTRA})"]
  lines = []
  for name in configs.packaged_names():
    arguments = config_arguments(name)
    shown = " ".join(_shown_argument(name, key, value) for key, value in arguments.items())
    lines.append(f"  {name}: {shown}")
  return lines


def _study_lines() -> list[str]:
  from primal_dual.commands import reproduce

  studies = reproduce.find_studies()
  if studies is None:
    return ["  (none here: the grids live in a clone's reproduce/ folder)"]
  return [f"  {', '.join(studies.study_names())}"]


SECTIONS: dict[str, tuple[str, Callable[[], list[str]]]] = {
  "variants": ("attention variants (attention=NAME, config.model.attention)", _variant_lines),
  "configs": ("configs and their arguments (--config=NAME:key=value,...)", _config_lines),
  "studies": ("paper studies (primal-dual reproduce STUDY)", _study_lines),
}


def main(argv: list[str]) -> int:
  """Prints the sections named in ``argv`` (default: all); returns the exit status."""
  if argv and argv[0] in ("-h", "--help"):
    print(f"usage: primal-dual list [{'|'.join(SECTIONS)}]\n\n{__doc__}")
    return 0
  unknown = [name for name in argv if name not in SECTIONS]
  if unknown:
    print(f"error: unknown list {unknown[0]!r}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
    return 2
  for name in argv or SECTIONS:
    title, lines = SECTIONS[name]
    print(f"{title}:")
    print("\n".join(lines()))
  return 0
