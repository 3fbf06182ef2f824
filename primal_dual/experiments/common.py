"""Pieces shared by the task modules: model keyword arguments from ``config.model``, the
registration of classification tasks, the size of generated train streams, and the size and
attention-cost fields of the ListOps and images grids."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Mapping, Sequence, TypeVar

import ml_collections

from primal_dual.experiments import grid
from primal_dual.training import tasks as tasks_lib

DataclassT = TypeVar("DataclassT")

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


def config_dataclass(cls: type[DataclassT], values: ml_collections.ConfigDict) -> DataclassT:
  """The dataclass ``cls`` from the entries of ``values`` named as its fields, as ``plain`` values
  (lists made tuples, so the result stays hashable)."""
  return cls(**{field.name: plain(values[field.name]) for field in dataclasses.fields(cls)})


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


def seed_major_runs(
  args: argparse.Namespace, make_run: Callable[[str, int], grid.GridRun]
) -> list[grid.GridRun]:
  """``make_run(attention, seed)`` for every seed of ``args.seeds`` and within it every variant
  of ``args.variants``: a half-finished grid already covers every variant."""
  return [make_run(attention, seed) for seed in args.seeds for attention in args.variants]


# The tags variant_run gives every run besides its labels.
VARIANT_RUN_SCHEMA: dict[str, tuple[type, ...]] = {
  "attention": (str,),
  "seed": (int,),
  "steps": (int,),
  "quick": (bool,),
}


def variant_run(
  config_file: str,
  config_arg: str,
  labels: Mapping[str, Any],
  attention: str,
  seed: int,
  steps: int,
  quick: bool,
  **more_tags: Any,
) -> grid.GridRun:
  """A run of ``config_file`` with ``config_arg``, named ``<labels' values>-<attention>-steps<steps>-s<seed>`` and
  tagged with ``labels``, the variant, seed, steps, ``quick`` and ``more_tags``."""
  return grid.GridRun(
    name="-".join([*map(str, labels.values()), attention, f"steps{steps}", f"s{seed}"]),
    config_file=config_file,
    config_arg=config_arg,
    tags=dict(labels, attention=attention, seed=seed, steps=steps, quick=bool(quick), **more_tags),
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
