"""A sweep trained as replicas of one program: `config.sweep` → `Replica`s.

`config.sweep` holds value lists of scalar settings that leave the program's shapes and operations
alone (`config_lib.SWEEPABLE`); the replicas are their product. Each replica is a single run of its own
config: `config` with the replica's values set and no sweep. A config without a sweep is the
one-replica case, whose run is the workdir itself::

  config.sweep.optimizer.lr = (1e-3, 3e-4)
  config.sweep.optimizer.weight_decay = (0.1, 0.3)
  config.sweep.seed = (0, 1, 2)        # 12 replicas, in <workdir>/lr=0.001,wd=0.1,seed=0 ...

`config.sweep.seed = (0, 1)` alone is the seed-only sweep, in `<workdir>/seed=0` and `seed=1`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping

import ml_collections

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
  for part in dotted.split("."):
    node = node[part]
  return node


def _typed_values(config, dotted: str, values) -> tuple:
  """`values` in the type of the config field they set (an int field takes integral values)."""
  if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
    raise errors.ConfigError(f"config.sweep.{dotted} must be a list of values, got {values!r}")
  kind = type(_field_value(config, dotted))
  typed = []
  for value in values:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise errors.ConfigError(f"config.sweep.{dotted}: {value!r} is not a number")
    if kind is int and value != int(value):
      raise errors.ConfigError(f"config.sweep.{dotted}: {value!r} is not an integer")
    typed.append(kind(value))
  if len(set(typed)) != len(typed):
    raise errors.ConfigError(f"config.sweep.{dotted} values must be distinct; got {tuple(typed)}")
  return tuple(typed)


def swept_values(config) -> dict[str, tuple]:
  """The non-empty value lists of `config.sweep`, in `SWEEPABLE` order.

  Raises:
    errors.ConfigError: a field that cannot be replicated, a value that is not a number of the
      field's type, or repeated values.
  """
  given = {k: v for k, v in _flatten(config.get("sweep") or {}).items() if len(v or ())}
  unknown = sorted(set(given) - set(SWEEPABLE))
  if unknown:
    raise errors.ConfigError(
      f"config.sweep cannot replicate {', '.join(unknown)}: replicas share one program, so only "
      f"settings that keep its shapes and operations can differ ({', '.join(SWEEPABLE)})"
    )
  return {
    dotted: _typed_values(config, dotted, given[dotted]) for dotted in SWEEPABLE if dotted in given
  }


def _format(value) -> str:
  return repr(value)  # shortest round-tripping form: 0.001, 3e-05, 10


def replica_name(values: Mapping[str, Any]) -> str:
  """The sub-workdir name of a replica, `lr=0.001,wd=0.1,seed=0` (short names of `SWEEPABLE`, in
  its order); '' for a single run."""
  return ",".join(f"{SWEEPABLE[dotted]}={_format(values[dotted])}" for dotted in values)


def replica_config(config, values: Mapping[str, Any]) -> ml_collections.FrozenConfigDict:
  """`config` with `values` set and no sweep: the config of a single run."""
  as_dict = (
    config.as_configdict() if isinstance(config, ml_collections.FrozenConfigDict) else config
  )
  single = config_lib.with_fields(as_dict, values)
  single.sweep = config_lib.sweep_defaults()
  return config_lib.freeze(single)


def replicas_of(config: ml_collections.FrozenConfigDict) -> tuple[Replica, ...]:
  """The replicas of a resolved config: its sweep's product, or the config itself alone.

  Raises:
    errors.ConfigError: see `swept_values`.
  """
  swept = swept_values(config)
  if not swept:
    return (Replica(config, "", {}),)
  replicas = []
  for combination in itertools.product(*swept.values()):
    values = dict(zip(swept, combination))
    replicas.append(Replica(replica_config(config, values), replica_name(values), values))
  return tuple(replicas)
