"""Pieces shared by the task modules: model keyword arguments from ``config.model``, the
registration of classification tasks, the size of generated train streams, and the size and
attention-cost fields of the ListOps and images grids."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import ml_collections

from primal_dual.experiments import grid
from primal_dual.training import tasks as tasks_lib

# The EncoderClassifier fields a config's model sets (UEA, ListOps).
ENCODER_FIELDS = (
  "num_layers",
  "model_dim",
  "num_heads",
  "mlp_dim",
  "positional",
  "pre_norm",
  "norm",
  "pooling",
  "dropout_rate",
  "attention_dropout_rate",
)


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


def model_arguments(
  model_config: ml_collections.ConfigDict, names: tuple[str, ...]
) -> dict[str, Any]:
  """``model_kwargs`` and ``attention_kwargs`` together: what a model class takes from a config."""
  return {**model_kwargs(model_config, names), **attention_kwargs(model_config)}


def register_classification_task(
  name: str,
  build_data: Callable[[ml_collections.ConfigDict], tuple[dict, dict]],
  build_model: Callable[[ml_collections.ConfigDict, Any], Any],
) -> tasks_lib.Task:
  """Registers a task of labelled examples scored by cross-entropy and accuracy."""
  return tasks_lib.register_task(
    tasks_lib.Task(
      name=name,
      build_data=build_data,
      build_model=build_model,
      loss_and_metrics=tasks_lib.classification_loss_and_metrics,
      eval_splits=("validation", "test"),
    )
  )


def stream_train_size(config: ml_collections.ConfigDict, task: str) -> int:
  """``data.num_train``, or ``num_train_steps × batch_size`` (no record seen twice) if ≤ 0."""
  if config.data.get("num_train", 0) > 0:
    return int(config.data.num_train)
  if config.num_train_steps <= 0:
    raise ValueError(
      f"set data.num_train > 0 or num_train_steps > 0 to size the {task} train stream"
    )
  return int(config.num_train_steps * config.batch_size)


# ------------------------------------------------------------------------------------------------
# Size and attention cost of a grid's runs (ListOps, images: their ``model_summary``).

NUMBER = (int, float)
SIZE_AND_COST_SCHEMA: dict[str, tuple[type, ...]] = {
  "num_params": (int,),
  "sequence_length": (int,),
  "attention_flops": NUMBER,
  "attention_flops_relative": NUMBER,
}


def size_and_cost_fields(
  model_summary: Callable[[ml_collections.ConfigDict], Mapping[str, Any]], run: grid.GridRun
) -> dict[str, Any]:
  """The ``SIZE_AND_COST_SCHEMA`` fields of a run, from its config alone."""
  summary = model_summary(grid.load_config(run.config_file, run.config_arg))
  return {
    "num_params": int(summary["parameters"]),
    "sequence_length": int(summary["sequence_length"]),
    "attention_flops": float(summary["attention_flops"]),
    "attention_flops_relative": float(summary["attention_flops_relative"]),
  }


def size_and_cost_columns(
  records: Sequence[Mapping[str, Any]], per: str
) -> dict[str, Callable[[tuple], str]]:
  """``summary_table`` extra columns (rows keyed by attention): parameters, attention MFLOPs per
  ``per`` (e.g. 'image') and attention FLOPs relative to softmax."""
  params = grid.first_by_variant(records, "num_params")
  flops = grid.first_by_variant(records, "attention_flops")
  relative = grid.first_by_variant(records, "attention_flops_relative")
  return {
    "params": lambda key: f"{params[key[0]]:,}",
    f"attention MFLOPs / {per}": lambda key: f"{flops[key[0]] / 1e6:.4g}",
    "attention FLOPs / softmax": lambda key: f"{relative[key[0]]:.2f}",
  }
