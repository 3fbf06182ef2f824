"""Pieces shared by the task modules: turning ``config.model`` into model keyword arguments."""

from __future__ import annotations

from typing import Any, Mapping

import ml_collections


def plain(value: Any) -> Any:
  """ConfigDicts → dicts and lists → tuples, so options are hashable and JSON-like."""
  if isinstance(value, (ml_collections.ConfigDict, Mapping)):
    return {k: plain(v) for k, v in dict(value).items()}
  if isinstance(value, (list, tuple)):
    return tuple(plain(v) for v in value)
  return value


def attention_kwargs(model_config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``attention`` name and ``attention_options`` dict of a model config."""
  return {
    "attention": model_config.attention,
    "attention_options": plain(model_config.get("attention_options", {}) or {}),
  }


def model_kwargs(model_config: ml_collections.ConfigDict, names: tuple[str, ...]) -> dict[str, Any]:
  """The fields ``names`` of ``model_config`` that are set, as plain Python values."""
  return {name: plain(model_config[name]) for name in names if name in model_config}
