"""Config helpers: the `key=value,flag` argument of `primal_dual/configs/*.py`, defaults, locking,
saving.

Every config file follows one pattern::

  from primal_dual.training import config_lib

  def get_config(arg=None):
    arg = config_lib.parse_arg(arg, dataset='JapaneseVowels', attention='softmax', runlocal=False)
    config = config_lib.training_defaults()
    config.task = 'uea'
    ...
    if arg.runlocal:
      config.num_train_steps = 20
    return config_lib.lock(config)

`train.py --config=primal_dual/configs/uea.py:dataset=Heartbeat,runlocal` passes
`'dataset=Heartbeat,runlocal'` as `arg`. Values are typed by the defaults' types (int, float, bool, str); a bare name sets a bool
default to True. Values cannot contain commas.
"""

import difflib
import json
import math
import os
from typing import Any, Mapping

import ml_collections

from primal_dual import atomic
from primal_dual.training import errors

_TRUE = frozenset({"1", "true", "yes", "on", "t", "y"})
_FALSE = frozenset({"0", "false", "no", "off", "f", "n"})


def _parse_bool(raw: str, key: str) -> bool:
  lowered = raw.strip().lower()
  if lowered in _TRUE:
    return True
  if lowered in _FALSE:
    return False
  raise errors.ConfigError(f"config argument {key}={raw!r}: expected a boolean (true/false)")


def _parse_number(cast):
  def parse(raw: str, key: str):
    try:
      return cast(raw)
    except ValueError:
      raise errors.ConfigError(
        f"config argument {key}={raw!r}: expected a value of type {cast.__name__}"
      ) from None

  return parse


# Keyed by the exact type of the default, so that `bool` never falls through to `int`.
_PARSERS = {
  bool: _parse_bool,
  int: _parse_number(int),
  float: _parse_number(float),
  str: lambda raw, key: raw,
}


def choice(table: Mapping[str, Any], name: str, what: str) -> Any:
  """``table[name]``, or ``errors.ConfigError`` (printed by the commands as one line) ``unknown
  <what> <name>; choose one of <the sorted names>``."""
  if name not in table:
    raise errors.ConfigError(f"unknown {what} {name!r}; choose one of {', '.join(sorted(table))}")
  return table[name]


# A count argument (``epochs=``, ``steps=``) set to this means "the config's own count".
CONFIG_DEFAULT_COUNT = -1


def count_or_default(value: int, default: int, name: str) -> int:
  """``value`` of the count argument ``name``, or ``default`` for ``CONFIG_DEFAULT_COUNT``.

  Raises:
    errors.ConfigError: any other value below 1 (a typo such as ``epochs=-40`` would otherwise
      train the default length without a word).
  """
  if value == CONFIG_DEFAULT_COUNT:
    return default
  if value < 1:
    raise errors.ConfigError(
      f"config argument {name}={value}: give a count >= 1, or {name}={CONFIG_DEFAULT_COUNT} for "
      f"the config's own ({default})"
    )
  return value


# The arguments every task config takes (`parse_arg(arg, **RUN_ARGUMENTS, ...)`): the attention
# variant, the training seed, the `runlocal` smoke-test flag and `bf16`, short for
# `--config.model.dtype=bfloat16` (bfloat16 compute, float32 parameters).
RUN_ARGUMENTS = dict(attention="softmax", seed=0, runlocal=False, bf16=False)

# `config.model.dtype` (what the model computes in) and `config.model.param_dtype` (what its
# parameters, and with them the optimizer state, are stored in), by name. Statistics (LayerNorm,
# BatchNorm), softmax, losses and metrics are float32 whatever the compute dtype.
# float16 is left out: it would need loss scaling.
COMPUTE_DTYPES = PARAM_DTYPES = ("float32", "bfloat16")
MODEL_DTYPES = dict(dtype="float32", param_dtype="float32")


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parses a `key=value,key=value,flag` string into a ConfigDict typed by `defaults`.

  Args:
    arg: the string after `:` in `--config=primal_dual/configs/x.py:arg`, or None / '' for all
      defaults.
    **defaults: every accepted key with its default value; the default's type (bool, int, float,
      str; None means str) decides how the value is parsed.

  Returns:
    An unlocked ConfigDict holding every key of `defaults`, overridden by `arg`.

  Raises:
    errors.ConfigError (a ValueError): unknown key, unparsable value, or a bare name whose default
      is not a bool.
  """
  parsed = dict(defaults)
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    key, has_value, raw = item.partition("=")
    key = key.strip()
    if key not in defaults:
      known = ", ".join(sorted(defaults)) or "(none)"
      close = difflib.get_close_matches(key, list(defaults), n=1)
      hint = f"did you mean {close[0]!r}? " if close else ""
      raise errors.ConfigError(f"unknown config argument {key!r} in {arg!r}; {hint}known: {known}")
    default = defaults[key]
    if not has_value:
      if not isinstance(default, bool):
        raise errors.ConfigError(f"config argument {key!r} needs a value: {key}=...")
      parsed[key] = True
      continue
    parser = _PARSERS.get(type(default), _PARSERS[str])
    parsed[key] = parser(raw.strip(), key)
  return ml_collections.ConfigDict(parsed)


# Config fields a sweep may vary (`config.sweep.<field>`): scalars that leave the program's shapes
# and operations alone, with their short names in sub-workdir names and in `config.sweep.points`.
# Their order is that of the names and of the product (the last varies fastest). Everything else
# (model sizes, batch size, schedule kind, run length, optimizer name) would change the program.
# The model's dropout rates enter its program as traced numbers when they differ (`sweep.py`).
SWEEPABLE: dict[str, str] = {
  "optimizer.lr": "lr",
  "optimizer.end_lr": "end_lr",
  "optimizer.warmup_steps": "warmup",
  "optimizer.weight_decay": "wd",
  "optimizer.grad_clip_norm": "clip",
  "optimizer.b1": "b1",
  "optimizer.b2": "b2",
  "optimizer.eps": "eps",
  "optimizer.momentum": "momentum",
  "model.dropout_rate": "dropout",
  "model.attention_dropout_rate": "attn_dropout",
  "seed": "seed",
}


def sweep_defaults() -> ml_collections.ConfigDict:
  """`config.sweep`: every `SWEEPABLE` field, nested, empty (so `--config.sweep.<field>` works),
  and `points`, the explicit list of points (empty)."""
  sweep = ml_collections.ConfigDict()
  for dotted in SWEEPABLE:
    node = sweep
    *parents, leaf = dotted.split(".")
    for parent in parents:
      if parent not in node:
        node[parent] = ml_collections.ConfigDict()
      node = node[parent]
    node[leaf] = ()
  sweep.points = ()
  return sweep


def training_defaults() -> ml_collections.ConfigDict:
  """Every field the trainer reads, with its default. Configs start from this.

  Returns:
    An unlocked ConfigDict. `data` is empty and `model` holds only its dtypes (`MODEL_DTYPES`):
    the rest belongs to the task.
  """
  config = ml_collections.ConfigDict()
  config.task = "synthetic"
  config.seed = 0
  # Global batch size (all processes together); must divide by the mesh's `data` size.
  config.batch_size = 32
  config.eval_batch_size = 0  # 0: same as batch_size.
  # Length of training: num_train_steps if > 0, else num_epochs (> 0) of the train split.
  config.num_train_steps = -1
  config.num_epochs = -1
  # Periodic actions; 0 means "only at the final step".
  # *_every_epochs (> 0) overrides *_every_steps.
  config.log_every_steps = 50
  config.eval_every_steps = 0
  config.eval_every_epochs = 0
  config.checkpoint_every_steps = 500
  # Optimizer steps per jitted call (a `lax.scan`): logging, evaluation and checkpoints happen
  # between calls, so it must divide their periods. Several steps per call remove the per-step
  # host round trip that limits small models on accelerators.
  config.steps_per_call = 1
  # Generated tasks (sRAVEN, logic): make each training batch on the device inside the step
  # from a counter-based key, instead of reading it from the host loader.
  config.train_data_on_device = False
  # A sweep in one program (`training/sweep.py`): value lists of `SWEEPABLE` fields, e.g.
  # sweep.optimizer.lr = (1e-3, 3e-4), whose product is the replicas, and/or sweep.points, the
  # replicas listed one by one ("lr=0.001,wd=0.1", ...). All empty: no sweep.
  config.sweep = sweep_defaults()
  config.checkpoint_every_epochs = 0
  config.keep_checkpoints = 3
  config.keep_selected_checkpoint = True  # also keep the checkpoint chosen on `selection.split`.
  config.async_checkpointing = True
  # Continue a workdir's checkpoint with other `optimizer.*` values (e.g. a lower lr after a
  # non-finite loss); the change is recorded in experiment.json's `history`.
  config.resume_with_changed_optimizer = False
  config.progress_bar = True
  # Splits evaluated periodically and at the end; empty: the task's `eval_splits`.
  config.eval_splits = ()  # e.g. ('validation', 'test')
  # Model selection: the 'clean' protocol picks the evaluation with the best `metric` on `split`.
  config.selection = ml_collections.ConfigDict(dict(split="validation", metric="", mode=""))

  # The optimizer: its learning-rate schedule, regularisation, then Adam's and SGD's own options.
  schedule = dict(lr=1e-3, schedule="constant", warmup_steps=0, end_lr=0.0, cosine_end="total")
  regularisation = dict(weight_decay=0.0, grad_clip_norm=0.0)
  adam = dict(b1=0.9, b2=0.999, eps=1e-8)
  sgd = dict(momentum=0.9, nesterov=False)
  config.optimizer = ml_collections.ConfigDict(
    dict(name="adamw", **schedule, **regularisation, **adam, **sgd)
  )
  # Device mesh: -1 = all remaining devices. data * model must equal the device count.
  config.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))
  # Multi-process launch; empty values defer to environment variables / cluster auto-detection.
  config.distributed = ml_collections.ConfigDict(
    dict(coordinator_address="", num_processes=0, process_id=-1)
  )

  # Training input pipeline (grain): worker processes, reader threads, records read ahead, and
  # batch_reads (one grain record per batch: several times less host time per step, the thing
  # that limits small models on an accelerator; a different example order, so off by default to
  # keep the published results reproducible; see pipeline.make_loader).
  config.loader = ml_collections.ConfigDict(
    dict(worker_count=0, num_threads=2, prefetch_buffer_size=64, batch_reads=False)
  )

  # The rest of `model` belongs to the task; its dtypes are every model's (`MODEL_DTYPES`).
  config.model = ml_collections.ConfigDict(MODEL_DTYPES)
  config.data = ml_collections.ConfigDict()
  return config


# Model fields that count something (layers, widths, heads, patch side): positive integers.
POSITIVE_MODEL_FIELDS = ("num_layers", "model_dim", "num_heads", "mlp_dim", "hidden", "patch_size")


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks model sizes, dropout rates and dtypes, which otherwise fail deep inside a trace (or not
  at all).

  Raises:
    errors.ConfigError: a field of `POSITIVE_MODEL_FIELDS` that is not an integer > 0, a
      `config.model.*dropout_rate` outside [0, 1), a `config.model.dtype` / `param_dtype` outside
      `COMPUTE_DTYPES` / `PARAM_DTYPES`, or an unknown `config.selection.mode`.
  """
  model = config.get("model") or {}
  for name, known in (("dtype", COMPUTE_DTYPES), ("param_dtype", PARAM_DTYPES)):
    if name in model and model[name] not in known:
      raise errors.ConfigError(
        f"config.model.{name}={model[name]!r}; choose one of {', '.join(known)}"
      )
  for name in POSITIVE_MODEL_FIELDS:
    value = model.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
      raise errors.ConfigError(f"config.model.{name}={value!r} must be a positive integer")
  for name, value in model.items():
    if not name.endswith("dropout_rate"):
      continue
    if not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 <= value < 1):
      raise errors.ConfigError(f"config.model.{name}={value!r} must be in [0, 1)")
  # Checked here, before anything is built: a run that failed later left Orbax threads behind.
  mode = (config.get("selection") or {}).get("mode", "")
  if mode not in ("", "max", "min"):
    raise errors.ConfigError(
      f"config.selection.mode={mode!r} must be 'max', 'min' or '' (the metric's own: 'min' for "
      "losses)"
    )


# Fields of earlier versions → the field that now says the same. An empty value (in a config.json
# or experiment.json they wrote) meant nothing and is dropped; any other is refused in one line.
RETIRED_FIELDS = {"seeds": "sweep.seed"}


def retired_field_message(name: str, value: Any = None) -> str:
  """'config.seeds is now config.sweep.seed: ...', the one line refusing a retired field."""
  given = f"='{tuple(value)}'" if value else "='(<values>)'"
  return (
    f"config.{name} is now config.{RETIRED_FIELDS[name]}: set "
    f"--config.{RETIRED_FIELDS[name]}{given} instead"
  )


def without_retired_fields(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` without the `RETIRED_FIELDS` (an empty one, as earlier versions wrote, is dropped).

  Raises:
    errors.ConfigError: a retired field that is set, e.g. `config.seeds=(0, 1)`.
  """
  present = [name for name in RETIRED_FIELDS if name in config]
  if not present:
    return config
  for name in present:
    if config[name]:
      raise errors.ConfigError(retired_field_message(name, config[name]))
  kept = ml_collections.ConfigDict(config.to_dict())
  for name in present:
    del kept[name]
  return kept


def with_fields(
  config: ml_collections.ConfigDict, overrides: Mapping[str, Any]
) -> ml_collections.ConfigDict:
  """An unlocked copy of `config` with dotted fields set (`{'optimizer.lr': 0.1}`)."""
  config = ml_collections.ConfigDict(config.to_dict())
  for dotted, value in overrides.items():
    node = config
    *parents, leaf = dotted.split(".")
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config


def merge(
  base: ml_collections.ConfigDict, override: ml_collections.ConfigDict | dict
) -> ml_collections.ConfigDict:
  """Returns a copy of `base` with every field of `override` set, recursing into sub-dicts.

  Keys of `override` absent from `base` are added; this lets a config carry task-specific fields.
  """
  merged = ml_collections.ConfigDict(base.to_dict() if hasattr(base, "to_dict") else base)
  for key, value in override.items():
    current = merged.get(key)
    is_mapping = isinstance(value, (dict, ml_collections.ConfigDict))
    if is_mapping and isinstance(current, ml_collections.ConfigDict):
      value = merge(current, value)
    elif isinstance(value, ml_collections.ConfigDict):
      value = ml_collections.ConfigDict(value.to_dict())
    # Replace rather than assign: ConfigDict's type check refuses e.g. str → int changes, which
    # the override is allowed to make for fields it owns (model/data).
    with merged.ignore_type():
      merged[key] = value
  return merged


def variant_options(model: ml_collections.ConfigDict) -> dict[str, Any]:
  """The ``attention_options`` the task gives ``model.attention``: the options a config's
  ``get_config`` computes for its ``attention=`` argument, from what it stored in
  ``model.task_attention_options`` (``ratios`` for the variants that take them, and ``by_variant``:
  a variant's own options)."""
  from primal_dual import registry  # imports JAX: the commands check configs before it loads

  errors.lookup(
    registry.ATTENTION_REGISTRY, model.attention, "attention variant (--config.model.attention)"
  )
  given = dict(model.get("task_attention_options") or {})
  own = dict((given.get("by_variant") or {}).get(model.attention) or {})
  return registry.model_options(model.attention, model.num_heads, ratios=given.get("ratios"), **own)


def with_variant_options(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config`` whose ``model.attention_options`` belong to ``model.attention``.

  A config's ``get_config`` gives the variant of its ``attention=`` argument its options and
  records that variant in ``model.attention_options_variant``. A variant chosen afterwards
  (``--config.model.attention=bn_sh``) gets, here, the options the config argument would have
  given it (``variant_options``), so both ways of choosing a variant train the same run.
  Configs that record nothing (written by hand) are returned as they are.
  """
  model = config.get("model") or {}
  chosen_for = model.get("attention_options_variant")
  if not chosen_for or chosen_for == model.get("attention"):
    return config
  return merge(
    config,
    {
      "model": {
        "attention_options": variant_options(model),
        "attention_options_variant": model.attention,
      }
    },
  )


def lock(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Locks `config` in place (adding a field raises; existing fields may still be overridden).

  Locking is what `primal_dual/configs/*.py` return: command-line overrides of existing fields
  still work, a misspelt override raises.
  """
  config.lock()
  return config


def freeze(config: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
  """Returns an immutable, hashable copy: any assignment raises. The trainer reads only this."""
  return ml_collections.FrozenConfigDict(config)


def to_json(config: ml_collections.ConfigDict) -> str:
  """Serialises a (frozen or not) config to indented JSON; tuples become lists."""
  as_dict = (
    config.as_configdict().to_dict()
    if isinstance(config, ml_collections.FrozenConfigDict)
    else config.to_dict()
  )
  return json.dumps(as_dict, indent=2, sort_keys=True, default=str)


def write_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Writes `config` to `workdir/config.json` (creating workdir) and returns the path."""
  return atomic.write_text(os.path.join(workdir, "config.json"), to_json(config))


def read_config(workdir: str) -> ml_collections.ConfigDict:
  """Reads `workdir/config.json` written by `write_config`.

  Raises:
    errors.CheckpointNotFoundError: the file does not exist.
    errors.DamagedFileError: it is not a JSON object (truncated, garbled).
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise errors.CheckpointNotFoundError(
      f"{path} not found: is {workdir!r} the workdir of a training run?"
    )
  stored = errors.read_json_object(path, "copy it again from the workdir this one was copied from")
  return ml_collections.ConfigDict(stored)
