"""A sweep trained as replicas of one program: `config.sweep` → `Replica`s.

`config.sweep` holds value lists of scalar settings that leave the program's shapes and operations
alone (`config_lib.SWEEPABLE`), whose product is the replicas, and/or `config.sweep.points`, the
replicas listed one by one. Each replica is a single run of its own config: `config` with the
replica's values set and no sweep. A config without a sweep is the one-replica case, whose run is
the workdir itself::

  config.sweep.optimizer.lr = (1e-3, 3e-4)
  config.sweep.optimizer.weight_decay = (0.1, 0.3)
  config.sweep.seed = (0, 1, 2)        # 12 replicas, in <workdir>/lr=0.001,wd=0.1,seed=0 ...

  config.sweep.points = ("lr=0.001,attn_dropout=0.0", "lr=0.0003,attn_dropout=0.1")
  config.sweep.seed = (0, 1)           # 4 replicas: each point at each seed

A point is written as a sub-workdir name is (the short names of `SWEEPABLE`); a field some point
leaves out keeps the config's value there. A field is given by the points or by a value list, never
both. `config.sweep.seed = (0, 1)` alone is the seed-only sweep, in `<workdir>/seed=0` and
`seed=1`.

The optimizer's numbers differ between replicas inside `optim.ReplicaOptimizer`; the model's
dropout rates (`MODEL_NUMBERS`) as traced numbers set on the model (`replica_model`), whose dropout
layers take a traced rate.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping

import flax.linen as nn
import ml_collections
import numpy as np

from primal_dual.training import config_lib
from primal_dual.training import errors

SWEEPABLE = config_lib.SWEEPABLE


@dataclasses.dataclass(frozen=True)
class Replica:
  """One model of a sweep.

  Attributes:
    config: the replica's own config, that of a single run (no sweep).
    name: its sub-workdir's name; '' for a single run (its workdir is the workdir itself).
    values: the swept fields' values, by dotted name ({} for a single run).
  """

  config: ml_collections.FrozenConfigDict
  name: str
  values: Mapping[str, Any]


# The short name of each `SWEEPABLE` field → the field (a point names fields by short name).
FIELDS_BY_SHORT_NAME = {short: dotted for dotted, short in SWEEPABLE.items()}

# The `SWEEPABLE` fields of the model, which replicas set apart as traced numbers on the model's
# attributes of the same names (`replica_model`).
MODEL_NUMBERS = ("model.dropout_rate", "model.attention_dropout_rate")


def _flatten(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in node.items():
    if isinstance(value, (Mapping, ml_collections.ConfigDict)):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def _field_value(config, dotted: str):
  node = config
  try:
    for part in dotted.split("."):
      node = node[part]
  except (KeyError, AttributeError):
    raise errors.ConfigError(
      f"config.{dotted} is not a field of this config, so a sweep cannot set it"
    ) from None
  return node


def _typed_value(config, dotted: str, value, where: str):
  """`value` in the type of the config field it sets (an int field takes an integral value)."""
  kind = type(_field_value(config, dotted))
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise errors.ConfigError(f"{where}: {value!r} is not a number")
  if kind is int and value != int(value):
    raise errors.ConfigError(f"{where}: {value!r} is not an integer")
  return kind(value)


def _typed_values(config, dotted: str, values) -> tuple:
  """`values` in the type of the config field they set (an int field takes integral values)."""
  where = f"config.sweep.{dotted}"
  if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
    raise errors.ConfigError(f"{where} must be a list of values, got {values!r}")
  typed = [_typed_value(config, dotted, value, where) for value in values]
  if len(set(typed)) != len(typed):
    raise errors.ConfigError(f"{where} values must be distinct; got {tuple(typed)}")
  return tuple(typed)


def swept_values(config) -> dict[str, tuple]:
  """The non-empty value lists of `config.sweep`, in `SWEEPABLE` order.

  Raises:
    errors.ConfigError: a field that cannot be replicated, a value that is not a number of the
      field's type, or repeated values.
  """
  lists = {k: v for k, v in (config.get("sweep") or {}).items() if k != "points"}
  given = {k: v for k, v in _flatten(lists).items() if len(v or ())}
  unknown = sorted(set(given) - set(SWEEPABLE))
  if unknown:
    raise errors.ConfigError(
      f"config.sweep cannot replicate {', '.join(unknown)}: replicas share one program, so only "
      f"settings that keep its shapes and operations can differ ({', '.join(SWEEPABLE)})"
    )
  return {
    dotted: _typed_values(config, dotted, given[dotted]) for dotted in SWEEPABLE if dotted in given
  }


def _parse_point(config, index: int, point) -> dict[str, Any]:
  """Entry `index` of `config.sweep.points`, `'lr=0.001,wd=0.1'` → `{dotted field: value}`."""
  where = f"config.sweep.points[{index}]={point!r}"
  if not isinstance(point, str):
    raise errors.ConfigError(
      f"{where} must be a string of short names and values: 'lr=0.001,wd=0.1'"
    )
  values = {}
  for item in point.split(","):
    short, has_value, raw = (part.strip() for part in item.partition("="))
    if short not in FIELDS_BY_SHORT_NAME or not has_value:
      raise errors.ConfigError(
        f"{where}: {item.strip()!r} is not <field>=<number> of a field a sweep can set "
        f"({', '.join(FIELDS_BY_SHORT_NAME)})"
      )
    dotted = FIELDS_BY_SHORT_NAME[short]
    if dotted in values:
      raise errors.ConfigError(f"{where} sets {short} twice")
    try:
      number = int(raw) if raw.lstrip("+-").isdigit() else float(raw)
    except ValueError:
      raise errors.ConfigError(f"{where}: {raw!r} is not a number") from None
    values[dotted] = _typed_value(config, dotted, number, where)
  return values


def listed_points(config) -> list[dict[str, Any]]:
  """`config.sweep.points` as `{dotted field: value}`, each over every field some point sets (a
  field a point leaves out takes the config's value), in `SWEEPABLE` order.

  Raises:
    errors.ConfigError: a point that is not `<short name>=<number>,...` of `SWEEPABLE` fields, a
      value not of its field's type, a field set twice, or two equal points.
  """
  given = (config.get("sweep") or {}).get("points") or ()
  points = [_parse_point(config, index, point) for index, point in enumerate(given)]
  fields = [dotted for dotted in SWEEPABLE if any(dotted in point for point in points)]
  filled = [{d: point.get(d, _field_value(config, d)) for d in fields} for point in points]
  seen: dict[tuple, int] = {}
  for index, point in enumerate(filled):
    key = tuple(point.values())
    if key in seen:
      raise errors.ConfigError(
        f"config.sweep.points[{seen[key]}] and [{index}] are the same point "
        f"({replica_name(point)}); list each point once"
      )
    seen[key] = index
  return filled


def _format(value) -> str:
  return repr(value)  # shortest round-tripping form: 0.001, 3e-05, 10


def replica_name(values: Mapping[str, Any]) -> str:
  """The sub-workdir name of a replica, `lr=0.001,wd=0.1,seed=0` (short names of `SWEEPABLE`, in
  its order); '' for a single run."""
  return ",".join(f"{SWEEPABLE[dotted]}={_format(values[dotted])}" for dotted in values)


def replica_config(config, values: Mapping[str, Any]) -> ml_collections.FrozenConfigDict:
  """`config` with `values` set and no sweep: the config of a single run.

  Raises:
    errors.ConfigError: a value its field refuses (`config_lib.validate`: a dropout rate outside
      [0, 1)).
  """
  as_dict = (
    config.as_configdict() if isinstance(config, ml_collections.FrozenConfigDict) else config
  )
  single = config_lib.with_fields(as_dict, values)
  single.sweep = config_lib.sweep_defaults()
  config_lib.validate(single)
  return config_lib.freeze(single)


def replicas_of(config: ml_collections.FrozenConfigDict) -> tuple[Replica, ...]:
  """The replicas of a resolved config: every listed point (`config.sweep.points`, or the config
  itself without) at every combination of the value lists (their product, the last varying
  fastest), or the config itself alone.

  Raises:
    errors.ConfigError: see `swept_values` and `listed_points`; a field given both by the points
      and by a value list.
  """
  swept = swept_values(config)
  points = listed_points(config)
  both = [SWEEPABLE[dotted] for dotted in swept if points and dotted in points[0]]
  if both:
    raise errors.ConfigError(
      f"config.sweep.points and a value list (config.sweep.<field>) both set "
      f"{', '.join(both)}: give each field in the points or in a list, not both"
    )
  if not swept and not points:
    return (Replica(config, "", {}),)
  replicas = []
  for point in points or [{}]:
    for combination in itertools.product(*swept.values()):
      given = {**point, **dict(zip(swept, combination))}
      values = {dotted: given[dotted] for dotted in SWEEPABLE if dotted in given}
      replicas.append(Replica(replica_config(config, values), replica_name(values), values))
  return tuple(replicas)


def model_numbers(config, replicas: tuple[Replica, ...], model: nn.Module) -> dict[str, np.ndarray]:
  """float32 `[R]` of each `MODEL_NUMBERS` field that some replica sets apart from `config` (the
  config `model` is built from). The others stay the model's constants, so a single run's
  program is unchanged.

  Raises:
    errors.ConfigError: `model` has no attribute of the field's name to take the number.
  """
  numbers = {}
  for dotted in MODEL_NUMBERS:
    values = [replica.values.get(dotted) for replica in replicas]
    if all(value is None for value in values):
      continue
    base = _field_value(config, dotted)
    values = [base if value is None else value for value in values]
    if all(value == base for value in values):
      continue
    name = dotted.split(".", 1)[1]
    if not hasattr(model, name):
      raise errors.ConfigError(
        f"the model of task {config.task!r} ({type(model).__name__}) has no {name}, so a sweep "
        f"cannot set config.{dotted}"
      )
    numbers[dotted] = np.asarray(values, np.float32)
  return numbers


def replica_model(model: nn.Module, hyperparameters: Mapping[str, Any]) -> nn.Module:
  """`model` with one replica's `MODEL_NUMBERS` found in `hyperparameters` (traced `[]` each, see
  `model_numbers`) in place of its constant attributes of the same names."""
  fields = {
    dotted.split(".", 1)[1]: hyperparameters[dotted]
    for dotted in MODEL_NUMBERS
    if dotted in hyperparameters
  }
  return model.clone(**fields) if fields else model


SUMMARY_FILE = "sweep_summary.json"


def is_sweep_result(final: Mapping[str, Any]) -> bool:
  """Whether ``final`` (``train_and_evaluate``'s result) is a sweep's: a single run's has a bare
  ``step``, a sweep's only ``<replica>/step``."""
  return "step" not in final


def per_replica(final: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """A sweep's final metrics ``{'<replica>/<metric>': value}`` as ``{replica: {metric: value}}``,
  replicas in name order."""
  names = sorted(
    name.removesuffix("/step") for name in final if name.endswith("/step") and name.count("/") == 1
  )
  return {
    replica: {
      name[len(replica) + 1 :]: value
      for name, value in final.items()
      if name.startswith(f"{replica}/")
    }
    for replica in names
  }


def setting_of(replica: str) -> str:
  """A replica's setting, its sub-workdir name without the seed: `lr=0.001,seed=0` → `lr=0.001`
  ('' for the replicas of a seed-only sweep, whose setting is the config's own)."""
  seed = f"{SWEEPABLE['seed']}="
  return ",".join(part for part in replica.split(",") if not part.startswith(seed))


def by_setting(final: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
  """A sweep's final metrics as ``{setting: {replica: {metric: value}}}``: the replicas grouped by
  their swept values other than the seed (`setting_of`), in name order."""
  groups: dict[str, dict[str, dict[str, Any]]] = {}
  for replica, metrics in per_replica(final).items():
    groups.setdefault(setting_of(replica), {})[replica] = metrics
  return groups


def mean_and_standard_error(values) -> tuple[float, float | None]:
  """The mean of ``values`` and its standard error over them (the sample standard deviation over
  √n); None for a single value, which has no spread to estimate."""
  values = np.asarray(values, np.float64)
  if values.size < 2:
    return float(values.mean()), None
  return float(values.mean()), float(values.std(ddof=1) / np.sqrt(values.size))
