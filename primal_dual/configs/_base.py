"""Presets as data: nested dicts of the values a preset sets, applied to the training defaults.

A preset (or a ``runlocal`` smoke-test variant) lists only the values that differ from what it
starts from; ``merge`` derives one preset from another and ``apply`` writes one onto a config.
"""

from typing import Any, Mapping

import ml_collections

from primal_dual import registry

from primal_dual.training import config_lib

# The tiny model and few steps of every ``runlocal`` smoke test (batch sizes divide 8 devices).
RUNLOCAL_MODEL = dict(num_layers=1, model_dim=16, num_heads=2, mlp_dim=32)
RUNLOCAL_STEPS = dict(
  batch_size=8,
  num_train_steps=4,
  eval_every_steps=2,
  checkpoint_every_steps=0,  # only after the last step
  log_every_steps=2,
)


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
  """``base`` with ``overrides`` applied; nested dicts are merged key by key."""
  merged = dict(base)
  for key, value in overrides.items():
    if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
      value = merge(merged[key], value)
    merged[key] = value
  return merged


def apply(config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> None:
  """Set ``values`` on ``config``; a dict for an existing sub-config updates it key by key."""
  for key, value in values.items():
    if isinstance(value, Mapping) and isinstance(config.get(key), ml_collections.ConfigDict):
      apply(config[key], value)
    else:
      config[key] = value


def build(
  task: str, arg: ml_collections.ConfigDict, *presets: Mapping[str, Any]
) -> ml_collections.ConfigDict:
  """The training defaults of ``task`` with ``presets`` applied in order, then the seed, the
  attention variant and the ``bf16`` shorthand (bfloat16 compute) of ``arg``
  (``config_lib.RUN_ARGUMENTS``); unlocked.

  Raises:
    errors.ConfigError: ``arg.attention`` is not a variant of ``registry.ATTENTION_REGISTRY``.
  """
  config_lib.choice(registry.ATTENTION_REGISTRY, arg.attention, "attention variant (attention=)")
  config = config_lib.training_defaults()
  config.task = task
  for values in presets:
    apply(config, values)
  config.seed = arg.seed
  apply(config, dict(model=dict(attention=arg.attention, attention_options={})))
  if arg.bf16:
    config.model.dtype = "bfloat16"
  return config


def finish(
  config: ml_collections.ConfigDict,
  *,
  ratios: tuple[int, ...] | None = None,
  by_variant: Mapping[str, Mapping[str, Any]] | None = None,
) -> ml_collections.ConfigDict:
  """``config`` locked, after giving its attention variant its options for the model's head count:
  the task's SH ``ratios`` to variants that take them, ``by_variant[variant]`` to that variant
  (``config_lib.variant_options``). What the task gives is kept in
  ``model.task_attention_options`` so that a variant chosen later by
  ``--config.model.attention`` gets the same options (``config_lib.with_variant_options``)."""
  config.model.task_attention_options = dict(
    ratios=None if ratios is None else tuple(ratios),
    by_variant={name: dict(options) for name, options in (by_variant or {}).items()},
  )
  config.model.attention_options = config_lib.variant_options(config.model)
  config.model.attention_options_variant = config.model.attention
  return config_lib.lock(config)
