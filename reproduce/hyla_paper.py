"""What the HYLA paper's two studies, sRAVEN (``reproduce/sraven.py``) and fuzzy logic
(``reproduce/logic.py``), share: the plan of runs (main variants × seeds 0, 1, 2 and ablations at
seed 0), the grid flags, the per-run facts read from a workdir (learning curve, training speed),
the report's speed and environment lines, the learning-curves figure and the ``Reproduction``
built from a study module.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from reproduce import grid


# ------------------------------------------------------------------------------------------------
# The reproduction grid (``primal-dual reproduce sraven``). The fuzzy-logic grid (logic.py) uses
# its plan, flags, per-run facts and report pieces.


def sequence_grid_commands(
  task: str, *, cpu: str, paper: str, resume: str, smoke_note: str = ""
) -> str:
  """The commands part of a sequence grid's ``--help`` (this module's and logic.py's): the CPU
  preset, the paper's setup and a smoke test, each under its comment (``cpu``, ``paper``, and
  ``smoke_note`` closing the smoke test's), then the ``resume`` paragraph."""

  def comment(text: str) -> str:
    return "\n".join(f"  # {line}" for line in text.splitlines())

  return f"""Commands (from the repository root; ``primal-dual reproduce {task}`` where the package is
installed)::

{comment(cpu)}
  .venv/bin/python scripts/reproduce.py {task}

{comment(paper)}
  python scripts/reproduce.py {task} --scale=paper --root=workdirs/{task}_paper

  # Smoke test: 2 tiny runs (softmax and hyla, runlocal){smoke_note}.
  .venv/bin/python scripts/reproduce.py {task} --quick --root=/tmp/{task}_quick \\
      --results=/tmp/{task}_quick/{task}.json

{resume}
"""


# Preset → (main variants, run at every seed; ablations, run at seed 0). The paper preset runs
# the paper's baselines (its linear attention is `linear_plain`) and the other Table A1 rows.
GRID_VARIANTS = {
  "cpu": (("softmax", "linear", "hyla"), ("hyla_no_relu", "hyla_no_norm")),
  "paper": (
    ("softmax", "linear_plain", "hyla"),
    ("hyla_linear_value", "hyla_no_norm", "hyla_no_relu", "hyla_no_relu_no_norm", "hyla_softmax"),
  ),
}
SEEDS = (0, 1, 2)
QUICK_VARIANTS = ("softmax", "hyla")


def grid_plan(quick: bool, preset: str = "cpu") -> list[tuple[str, int]]:
  """(attention, seed) pairs: main variants × 3 seeds, then the ablations × seed 0."""
  if quick:
    return [(attention, 0) for attention in QUICK_VARIANTS]
  main, ablations = GRID_VARIANTS[preset]
  return [(attention, seed) for seed in SEEDS for attention in main] + [
    (attention, 0) for attention in ablations
  ]


def build_runs(
  config_file: str,
  task: str,
  preset: str,
  quick: bool,
  steps: int,
  steps_per_call: int = 1,
  seeds_together: bool = False,
  held_out: str = "",
) -> list[grid.GridRun]:
  """The grid's ``GridRun``s; ``quick`` uses the configs' ``runlocal``.

  One run per (attention, seed); with ``seeds_together``, one run per attention trains its seeds
  as replicas in one program (batches made on the device). ``steps_per_call > 1`` (or
  ``seeds_together``) trains on device-made batches, that many steps per jitted call.
  ``held_out`` names the config's held-out rule ('' = the preset's; see ``--held_out``).
  """
  label = "quick" if quick else preset
  overrides = (
    {"train_data_on_device": True, "steps_per_call": steps_per_call}
    if steps_per_call > 1 or seeds_together
    else {}
  )
  seeds_by_variant: dict[str, list[int]] = {}
  for attention, seed in grid_plan(quick, preset):
    seeds_by_variant.setdefault(attention, []).append(seed)
  runs = []
  for attention, seeds in seeds_by_variant.items():
    groups = [tuple(seeds)] if seeds_together and len(seeds) > 1 else [(s,) for s in seeds]
    for group in groups:
      config_arg = grid.config_argument(
        dict(preset=preset, attention=attention, seed=group[0]),
        dict(steps=steps, held_out=held_out),
        runlocal=quick,
      )
      together = len(group) > 1
      runs.append(
        grid.GridRun(
          name=f"{task}_{label}_{attention}_s{'-'.join(map(str, group))}",
          config_file=config_file,
          config_arg=config_arg,
          tags=dict(attention=attention, preset=label, **({} if together else {"seed": group[0]})),
          overrides={**overrides, **({"sweep.seed": list(group)} if together else {})},
          replicas=_seed_replicas(group) if together else (),
        )
      )
  return runs


def sequence_grid_runs(task: str, args: argparse.Namespace) -> list[grid.GridRun]:
  """``build_runs`` (with ``--protocol=paper_sweep`` ``build_sweep_runs``, with
  ``--protocol=points`` ``build_point_runs``) of the task's packaged config with the flags of
  ``SEQUENCE_GRID_FLAGS``; ``--no_selected_checkpoints`` sets ``keep_selected_checkpoint=False``
  on every run (not a defining field: the records are the same)."""
  runs = _protocol_runs(task, args)
  if args.no_selected_checkpoints:
    runs = [
      dataclasses.replace(run, overrides={**run.overrides, "keep_selected_checkpoint": False})
      for run in runs
    ]
  return runs


def _protocol_runs(task: str, args: argparse.Namespace) -> list[grid.GridRun]:
  if args.protocol == "paper_sweep":
    return build_sweep_runs(
      task,
      task,
      args.preset,
      args.quick,
      args.steps,
      sweep_variants(args),
      args.steps_per_call,
      args.held_out,
      as_replicas=args.sweep_programs == "replicas",
      seeds=sweep_seeds(args),
    )
  if args.protocol == "points":
    return build_point_runs(
      task,
      task,
      args.preset,
      args.quick,
      args.steps,
      sweep_variants(args),
      sweep_seeds(args),
      args.points,
      args.steps_per_call,
      args.held_out,
    )
  return build_runs(
    task,
    task,
    args.preset,
    args.quick,
    args.steps,
    args.steps_per_call,
    args.seeds_together,
    args.held_out,
  )


# ------------------------------------------------------------------------------------------------
# The paper's protocol (``--protocol=paper_sweep``): every variant trained at each point of the
# official sweep (``sweeps/raven.yaml``, ``raven_ablation.yaml``, ``logic.yaml``,
# ``logic_ablation.yaml`` of smonsays/hypernetwork-attention) over seeds 0, 1, 2; per variant the
# setting with the best mean validation metric is reported (docs/reproduction.md).


class SweepSetting(NamedTuple):
  """One hyperparameter point of a sweep; ``warmup_steps`` None keeps the preset's."""

  lr: float
  weight_decay: float
  warmup_steps: int | None = None

  @property
  def label(self) -> str:
    """``lr0.001_wd0.1`` (``_wu3000`` when the point sets the warm-up)."""
    warmup = "" if self.warmup_steps is None else f"_wu{self.warmup_steps}"
    return f"lr{self.lr:g}_wd{self.weight_decay:g}{warmup}"

  def overrides(self) -> dict[str, Any]:
    """The config fields the point sets (dotted names, for ``GridRun.overrides``)."""
    fields = {"optimizer.lr": self.lr, "optimizer.weight_decay": self.weight_decay}
    if self.warmup_steps is not None:
      fields["optimizer.warmup_steps"] = self.warmup_steps
    return fields


class Sweep(NamedTuple):
  """A task's official sweep: lr × weight decay, and the warm-ups of the variants that sweep it."""

  lrs: tuple[float, ...]
  weight_decays: tuple[float, ...]
  warmups: Mapping[str, tuple[int, ...]]


PAPER_SWEEPS = {
  # raven_ablation.yaml (HYLA, linear attention and the ablations): lr × wd, warm-up 1000;
  # raven.yaml (the softmax transformer): lr × wd × warm-up {1000, 3000}.
  "sraven": Sweep((1e-3, 3e-4), (0.1, 0.3), {"softmax": (1000, 3000)}),
  # logic.yaml and logic_ablation.yaml: lr × wd for every model, warm-up the config's 100.
  "logic": Sweep((1e-3, 3e-3), (0.1, 0.03), {}),
}


def sweep_settings(task: str, attention: str) -> list[SweepSetting]:
  """The official sweep's points for ``attention`` on ``task``, in the sweep files' order."""
  sweep = PAPER_SWEEPS[task]
  warmups = sweep.warmups.get(attention, (None,))
  return [
    SweepSetting(lr, weight_decay, warmup)
    for lr in sweep.lrs
    for weight_decay in sweep.weight_decays
    for warmup in warmups
  ]


def sweep_points(
  task: str, variants: Sequence[str], seeds: Sequence[int] | None = None
) -> list[tuple[str, SweepSetting, int]]:
  """(variant, setting, seed) of every run of the paper's protocol (seeds: ``SEEDS`` unless
  given), variant by variant, each setting's seeds together (``build_sweep_runs`` groups them
  into one program per variant and seed)."""
  seeds = SEEDS if seeds is None else seeds
  return [
    (attention, setting, seed)
    for attention in variants
    for setting in sweep_settings(task, attention)
    for seed in seeds
  ]


def sweep_variants(args: argparse.Namespace) -> tuple[str, ...]:
  """``--sweep_variants``, by default ``--quick``'s two or every variant of the preset."""
  if args.sweep_variants:
    return tuple(args.sweep_variants)
  if args.quick:
    return QUICK_VARIANTS
  main, ablations = GRID_VARIANTS[args.preset]
  return main + ablations


def sweep_seeds(args: argparse.Namespace) -> tuple[int, ...]:
  """``--sweep_seeds``, by default ``SEEDS``."""
  return SEEDS if args.sweep_seeds is None else tuple(args.sweep_seeds)


def build_sweep_runs(
  config_file: str,
  task: str,
  preset: str,
  quick: bool,
  steps: int,
  variants: Sequence[str],
  steps_per_call: int = 1,
  held_out: str = "",
  as_replicas: bool = True,
  seeds: Sequence[int] | None = None,
) -> list[grid.GridRun]:
  """The runs of ``sweep_points`` (at ``seeds``, by default ``SEEDS``): the preset with each
  point's optimizer fields and the end rate relative to the peak (``end_lr=relative``, as the
  official code, so each lr keeps the schedule's shape).

  With ``as_replicas`` (``--sweep_programs=replicas``) one ``GridRun`` per variant trains every
  point of the sweep at every seed as the replicas of one program (``config.sweep``: lr × weight
  decay (× warm-up) × seed, batches made on the device; each seed keeps its own held-out split,
  ``setup.ReplicaData``), one record per replica; otherwise one ``GridRun`` per point and seed.
  Either way a record's tags: attention, preset, seed, protocol, setting (its label), lr,
  weight_decay, warmup_steps (the run's) and preset_setting (the point is the preset's own lr,
  weight decay and warm-up: the fixed-setting protocol's run).
  """
  label = "quick" if quick else preset
  defaults: dict[str, Any] = {}
  points: dict[str, list[tuple[SweepSetting, int, dict[str, Any]]]] = {}
  config_args: dict[tuple[str, int], str] = {}
  for attention, setting, seed in sweep_points(task, variants, seeds):
    config_arg = grid.config_argument(
      dict(preset=preset, attention=attention, seed=seed, end_lr="relative"),
      dict(steps=steps, held_out=held_out),
      runlocal=quick,
    )
    if attention not in defaults:  # the preset's own point (any seed's config has it)
      opt = grid.load_config(config_file, config_arg).optimizer
      defaults[attention] = (opt.lr, opt.weight_decay, opt.warmup_steps)
    warmup = defaults[attention][2] if setting.warmup_steps is None else setting.warmup_steps
    tags = dict(
      seed=seed,
      setting=setting.label,
      lr=setting.lr,
      weight_decay=setting.weight_decay,
      warmup_steps=warmup,
      preset_setting=(setting.lr, setting.weight_decay, warmup) == defaults[attention],
    )
    points.setdefault(attention, []).append((setting, seed, tags))
    config_args[(attention, seed)] = config_arg
  runs = []
  for attention, settings in points.items():
    shared = dict(attention=attention, preset=label, protocol="paper_sweep")
    if as_replicas:
      variant_seeds = tuple(dict.fromkeys(seed for _, seed, _ in settings))
      unique = list(dict.fromkeys(setting for setting, _, _ in settings))
      runs.append(
        grid.GridRun(
          name=f"{task}_{label}_sweep_{attention}",
          config_file=config_file,
          config_arg=config_args[(attention, variant_seeds[0])],
          tags=shared,
          overrides={
            **_sweep_overrides(unique),
            "sweep.seed": variant_seeds,
            **_on_device(steps_per_call, always=True),
          },
          replicas=tuple((_replica_name(setting, seed), tags) for setting, seed, tags in settings),
        )
      )
      continue
    for setting, seed, tags in settings:
      runs.append(
        grid.GridRun(
          name=f"{task}_{label}_sweep_{attention}_{setting.label}_s{seed}",
          config_file=config_file,
          config_arg=config_args[(attention, seed)],
          tags={**shared, **tags},
          overrides={**setting.overrides(), **_on_device(steps_per_call)},
        )
      )
  return runs


def _on_device(steps_per_call: int, always: bool = False) -> dict[str, Any]:
  """The overrides of batches made on the device, ``steps_per_call`` steps per call: when
  ``steps_per_call > 1``, or ``always`` (replicas of several seeds need them)."""
  if steps_per_call > 1 or always:
    return {"train_data_on_device": True, "steps_per_call": steps_per_call}
  return {}


def _sweep_overrides(settings: Sequence[SweepSetting]) -> dict[str, tuple]:
  """``config.sweep`` value lists whose product is exactly ``settings`` (the official sweeps are
  products of their lists)."""
  fields = {
    "sweep.optimizer.lr": [s.lr for s in settings],
    "sweep.optimizer.weight_decay": [s.weight_decay for s in settings],
  }
  if settings[0].warmup_steps is not None:
    fields["sweep.optimizer.warmup_steps"] = [s.warmup_steps for s in settings]
  lists = {name: tuple(dict.fromkeys(values)) for name, values in fields.items()}
  if int(np.prod([len(v) for v in lists.values()])) != len(settings):
    raise ValueError(f"the sweep's points are not a product of value lists: {settings}")
  return lists


def _seed_replicas(seeds: Sequence[int]) -> tuple[tuple[str, Mapping[str, Any]], ...]:
  """``GridRun.replicas`` of a seed sweep (``config.sweep.seed``): sub-workdir and tags of each."""
  from primal_dual.training import sweep

  return tuple((sweep.replica_name({"seed": seed}), {"seed": seed}) for seed in seeds)


def _replica_name(setting: SweepSetting, seed: int) -> str:
  """The sub-workdir the trainer gives the replica of ``setting`` at ``seed``
  (``sweep.replica_name``)."""
  from primal_dual.training import sweep

  values = {"optimizer.lr": setting.lr, "optimizer.weight_decay": setting.weight_decay}
  if setting.warmup_steps is not None:
    values["optimizer.warmup_steps"] = setting.warmup_steps
  values["seed"] = seed
  return sweep.replica_name({k: values[k] for k in sweep.SWEEPABLE if k in values})


# Fields of a replica's config that a listed point may set, as its record's tags: tag → field.
POINT_TAGS = {
  "lr": "optimizer.lr",
  "weight_decay": "optimizer.weight_decay",
  "warmup_steps": "optimizer.warmup_steps",
  "attention_dropout_rate": "model.attention_dropout_rate",
  "dropout_rate": "model.dropout_rate",
}


def _field(config, dotted: str) -> Any:
  for part in dotted.split("."):
    config = config[part]
  return config


def build_point_runs(
  config_file: str,
  task: str,
  preset: str,
  quick: bool,
  steps: int,
  variants: Sequence[str],
  seeds: Sequence[int],
  points: Sequence[str],
  steps_per_call: int = 1,
  held_out: str = "",
) -> list[grid.GridRun]:
  """``--protocol=points``: per variant one ``GridRun`` training exactly ``points``
  (``config.sweep.points``, e.g. ``'lr=0.001,wd=0.1,attn_dropout=0.0'``) at every seed
  (``config.sweep.seed``; each seed keeps its own held-out split) as the replicas of one
  program, batches made on the device, with the end rate relative to the peak as
  ``build_sweep_runs``.

  A record's tags: attention, preset, protocol ('points'), seed, setting (the replica's point,
  named as a sub-workdir is), the fields of ``POINT_TAGS`` (the replica's) and preset_setting
  (they are the preset's own).

  Raises:
    errors.UserError: a point the config refuses (``sweep.listed_points``).
  """
  from primal_dual.training import config_lib, sweep

  label = "quick" if quick else preset
  overrides = {
    "sweep.points": tuple(points),
    "sweep.seed": tuple(seeds),
    **_on_device(steps_per_call, always=True),
  }
  runs = []
  for attention in variants:
    config_arg = grid.config_argument(
      dict(preset=preset, attention=attention, seed=seeds[0], end_lr="relative"),
      dict(steps=steps, held_out=held_out),
      runlocal=quick,
    )
    config = config_lib.with_fields(grid.load_config(config_file, config_arg), overrides)
    preset_values = {tag: _field(config, dotted) for tag, dotted in POINT_TAGS.items()}
    replicas = []
    for replica in sweep.replicas_of(config):
      tags = {tag: _field(replica.config, dotted) for tag, dotted in POINT_TAGS.items()}
      setting = sweep.replica_name({k: v for k, v in replica.values.items() if k != "seed"})
      replicas.append(
        (
          replica.name,
          dict(
            seed=replica.config.seed,
            setting=setting,
            **tags,
            preset_setting=tags == preset_values,
          ),
        )
      )
    runs.append(
      grid.GridRun(
        name=f"{task}_{label}_points_{attention}",
        config_file=config_file,
        config_arg=config_arg,
        tags=dict(attention=attention, preset=label, protocol="points"),
        overrides=overrides,
        replicas=tuple(replicas),
      )
    )
  return runs


def sweep_records(
  records: Sequence[Mapping[str, Any]], protocol: str = "paper_sweep"
) -> list[Mapping[str, Any]]:
  """The records of ``--protocol=<protocol>`` runs (``paper_sweep`` or ``points``)."""
  return [r for r in records if r.get("protocol") == protocol]


def fixed_records(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """The records of the fixed-setting grid (``--protocol=fixed``, and records made before the
  protocol was a tag)."""
  return [r for r in records if r.get("protocol", "fixed") == "fixed"]


def mean_standard_error(values: Sequence[float]) -> tuple[float, float, int]:
  """Mean, standard error of the mean (sample std / √n; 0 for one value) and count; NaN and None
  left out."""
  mean, std, count = grid.mean_std(values)
  return mean, (std / np.sqrt(count) if count > 1 else 0.0), count


def format_mean_se(values: Sequence[float], scale: float = 100.0, digits: int = 2) -> str:
  mean, se, count = mean_standard_error(values)
  if count == 0:
    return "–"
  if count == 1:
    return f"{mean * scale:.{digits}f}"
  return f"{mean * scale:.{digits}f} ± {se * scale:.{digits}f}"


class Selection(NamedTuple):
  """A variant's selected setting: its label, mean validation metric and its seeds' records."""

  setting: str
  validation: float
  records: list[Mapping[str, Any]]


def select_settings(
  records: Sequence[Mapping[str, Any]], validation_field: str, protocol: str = "paper_sweep"
) -> dict[str, Selection]:
  """Per variant, the setting of ``protocol``'s records with the highest mean of
  ``validation_field`` over its seeds.

  Only the validation metric decides (test and OOD fields are never read); a tie keeps the first
  setting in record order. Settings whose validation values are all missing are skipped.
  """
  by_setting = grid.group_records(sweep_records(records, protocol), ("attention", "setting"))
  chosen: dict[str, Selection] = {}
  for (attention, setting), group in by_setting.items():
    mean, _, count = grid.mean_std(r.get(validation_field) for r in group)
    if count == 0:
      continue
    if attention not in chosen or mean > chosen[attention].validation:
      chosen[attention] = Selection(setting, mean, list(group))
  return chosen


# A selecting protocol's report section: protocol → (its title, which points it runs).
SELECTING_PROTOCOLS = {
  "paper_sweep": (
    "The paper's protocol",
    "Every variant at each point of the official sweep (lr × weight decay, × warm-up where the "
    "official sweep has it; end rate 0.1 × lr) × seeds 0, 1, 2 (n: the seeds run).",
  ),
  "points": (
    "Listed points",
    "Every variant at each listed point (`--points`; end rate 0.1 × lr) × the seeds run (n).",
  ),
}


def sweep_report(
  records: Sequence[Mapping[str, Any]],
  *,
  validation_field: str,
  columns: Mapping[str, str],
  references: Mapping[str, str],
  reference_column: str,
  scale: float = 100.0,
  protocol: str = "paper_sweep",
  plateau: float | None = None,
) -> str:
  """The ``--protocol=<protocol>`` part of a report (a protocol of ``SELECTING_PROTOCOLS``): per
  variant the selected setting's mean ± s.e. over seeds beside the preset's own point (the fixed
  setting) and the published reference; beside it, labelled, the setting a selection on the
  headline metric itself would pick (what code without a validation split can select); then every
  setting's row and every run's.

  Args:
    records: the grid's records (those of other protocols are left out).
    validation_field: the record field that selects (mean over seeds, highest wins).
    columns: header → record field, reported for the selected and the fixed setting; the first
      is the headline metric.
    references: attention → the published number (as printed), under ``reference_column``.
    scale: display multiplier (100: percentages).
    protocol: whose records are reported.
    plateau: a validation value (unscaled) below which a run has not left the task's early
      plateau; given, every setting's row counts the seeds above it ("escaped").
  """
  sweep = sweep_records(records, protocol)
  if not sweep:
    return ""
  chosen = select_settings(sweep, validation_field, protocol)
  first, *_ = columns
  title, points = SELECTING_PROTOCOLS[protocol]
  lines = [
    f"\n## {title} (`--protocol={protocol}`)\n",
    f"{points} Per variant, the setting with the "
    f"best mean validation metric (`{validation_field}`) is selected; test and OOD values never "
    "select. Cells: mean ± standard error over seeds; *fixed setting* = the preset's own lr, "
    "weight decay and warm-up (the fixed-setting protocol); *reference* = the paper, as "
    "published.\n",
  ]
  header = ["attention", "selected setting", "n", "validation"]
  header += [f"{title} (selected)" for title in columns]
  header += [f"{first} (fixed setting)", f"{reference_column} (reference)"]
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  variants = list(dict.fromkeys(r["attention"] for r in sweep))
  for attention in variants:
    fixed = [r for r in sweep if r["attention"] == attention and r.get("preset_setting")]
    fixed_cell = format_mean_se([r.get(columns[first]) for r in fixed], scale)
    if attention not in chosen:
      cells = [attention, "–", "0", "–"] + ["–"] * len(columns)
    else:
      selection = chosen[attention]
      group = selection.records
      cells = [
        attention,
        selection.setting,
        str(len(group)),
        format_mean_se([r.get(validation_field) for r in group], scale),
      ]
      cells += [format_mean_se([r.get(name) for r in group], scale) for name in columns.values()]
    cells += [fixed_cell, references.get(attention, "–")]
    lines.append("| " + " | ".join(cells) + " |")
  headline = columns[first]
  by_headline = select_settings(
    [dict(r, _headline=r.get(headline)) for r in sweep], "_headline", protocol
  )
  lines += [
    f"\nFor comparison only, per variant the setting with the best mean {first} itself: what a "
    "selection on the reported numbers would pick (the paper's code has no validation split). "
    "It is optimistic and is not the result.\n",
    f"| attention | best setting by {first} | n | {first} (best by itself, optimistic) | "
    f"{first} (selected on validation) |",
    "|---|---|---|---|---|",
  ]
  for attention, best in by_headline.items():
    selected = chosen.get(attention)
    selected_cell = (
      format_mean_se([r.get(headline) for r in selected.records], scale) if selected else "–"
    )
    cells = [attention, best.setting, str(len(best.records))]
    cells += [format_mean_se([r.get(headline) for r in best.records], scale), selected_cell]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["\nEvery setting:\n"]
  escaped = [] if plateau is None else [f"escaped (validation > {plateau * scale:g})"]
  header = ["attention", "setting", "n", "validation", *columns, *escaped, "selected"]
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for (attention, setting), group in grid.group_records(sweep, ("attention", "setting")).items():
    picked = attention in chosen and chosen[attention].setting == setting
    fixed = " (fixed setting)" if any(r.get("preset_setting") for r in group) else ""
    cells = [
      attention,
      setting + fixed,
      str(len(group)),
      format_mean_se([r.get(validation_field) for r in group], scale),
    ]
    cells += [format_mean_se([r.get(name) for r in group], scale) for name in columns.values()]
    if plateau is not None:
      values = [r.get(validation_field) for r in group]
      known = [v for v in values if isinstance(v, (int, float)) and np.isfinite(v)]
      cells.append(f"{sum(v > plateau for v in known)} of {len(known)}")
    cells.append("✓" if picked else "")
    lines.append("| " + " | ".join(cells) + " |")
  # Seeds can disagree by tens of points (one may never leave a plateau); a mean ± s.e. of
  # three hides which, so every run is listed too.
  lines += ["\nEvery run (the checkpoint selected on validation, and its step):\n"]
  header = ["attention", "setting", "seed", "validation", *columns, "selected step"]
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for record in sorted(sweep, key=lambda r: (r["attention"], r["setting"], r.get("seed", -1))):
    cells = [record["attention"], record["setting"], str(record.get("seed", "–"))]
    cells += [format_mean_se([record.get(validation_field)], scale)]
    cells += [format_mean_se([record.get(name)], scale) for name in columns.values()]
    step = record.get("selected_step")
    cells.append(f"{step:,}" if isinstance(step, int) else "–")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


# The flags of the sRAVEN and fuzzy-logic grids: flag → add_argument options.
SEQUENCE_GRID_FLAGS: dict[str, dict[str, Any]] = {
  "--scale": dict(dest="preset", choices=("cpu", "paper"), default="cpu", help="the preset="),
  "--steps": dict(type=int, default=-1, help="override the preset's steps"),
  "--steps_per_call": dict(
    type=int,
    default=1,
    help="optimizer steps per jitted call (> 1: batches made on the device); "
    "must divide the preset's log/eval/checkpoint periods (e.g. 125)",
  ),
  "--seeds_together": dict(
    action="store_true",
    help="train each variant's seeds as replicas of one program (config.sweep.seed)",
  ),
  "--protocol": dict(
    choices=("fixed", "paper_sweep", "points"),
    default="fixed",
    help="fixed: the preset's one setting (main variants × seeds 0, 1, 2, ablations × seed 0); "
    "paper_sweep: every variant × the official lr × weight-decay (× warm-up) sweep × seeds 0, 1, "
    "2, the best mean validation setting reported per variant; points: every variant × the "
    "--points × --sweep_seeds, one program per variant and seed, reported as paper_sweep",
  ),
  "--points": dict(
    nargs="+",
    default=(),
    metavar="POINT",
    help="with --protocol=points: the points trained as the replicas of one program, each as a "
    "sweep's sub-workdir is named (config.sweep.points), e.g. lr=0.001,wd=0.1,attn_dropout=0.0",
  ),
  "--sweep_seeds": dict(
    type=grid.comma_list(int),
    default=None,
    help="with --protocol=paper_sweep or points: the seeds (comma list; default 0,1,2)",
  ),
  "--held_out": dict(
    choices=("", "per_seed", "fixed"),
    default="",
    help="the held-out split rule (config argument held_out): per_seed (the paper's code; the "
    "paper preset's), fixed (split seed 0 for every seed; the cpu preset's); '' = the preset's",
  ),
  "--sweep_programs": dict(
    choices=("replicas", "separate"),
    default="replicas",
    help="with --protocol=paper_sweep: replicas (one program per variant trains every point of "
    "the sweep at every seed, config.sweep) or separate (one run per point and seed)",
  ),
  "--no_selected_checkpoints": dict(
    action="store_true",
    help="keep no checkpoint of each run's selected step (its metrics are recorded all the "
    "same): halves the state of a program, so that the 12 replicas of an sRAVEN paper-grid "
    "program (4.8 MB each) come back from a device call in one carry (tools/device/lease.py)",
  ),
  "--sweep_variants": dict(
    type=grid.comma_list(),
    default=(),
    help="with --protocol=paper_sweep or points: the variants swept (default: all of the "
    "preset's; --quick: softmax, hyla)",
  ),
}


def check_sequence_arguments(args: argparse.Namespace) -> None:
  """ValueError for flags that do not go together."""
  if args.protocol in SELECTING_PROTOCOLS and args.seeds_together:
    raise ValueError(f"--protocol={args.protocol} trains one run per seed; drop --seeds_together")
  if (args.protocol == "points") != bool(args.points):
    raise ValueError("--points and --protocol=points go together")
  if args.sweep_seeds is not None and not args.sweep_seeds:
    raise ValueError("--sweep_seeds: give at least one seed")
  if args.protocol not in SELECTING_PROTOCOLS and (
    args.sweep_variants or args.sweep_seeds is not None
  ):
    raise ValueError("--sweep_variants and --sweep_seeds need --protocol=paper_sweep or points")


# ------------------------------------------------------------------------------------------------
# Per-run facts read from the workdir (shared with the fuzzy-logic grid).


def read_jsonl(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def learning_curve(workdir: str, names: Sequence[str]) -> dict[str, list]:
  """``{'step': [...], name: [...]}`` from every evaluation record of ``metrics.jsonl``."""
  records = [
    r
    for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if all(r.get(name) is not None for name in names)
  ]
  curve = {"step": [int(r["step"]) for r in records]}
  curve.update({name: [float(r[name]) for r in records] for name in names})
  return curve


def median_steps_per_second(workdir: str) -> float | None:
  """Median logged training speed, leaving out the first log period (it includes compilation)."""
  speeds = [
    r["train/steps_per_second"]
    for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if r.get("train/steps_per_second") is not None
  ]
  if not speeds:
    return None
  return float(np.median(speeds[1:] if len(speeds) > 1 else speeds))


class CurveFigure(NamedTuple):
  """A grid's learning-curves figure: its title, y axis, and the titles of the panels of the
  first ``CURVE_METRICS`` (one panel each)."""

  title: str
  ylabel: str
  panel_titles: tuple[str, ...]


def progress_fields(workdir: str, curve_metrics: Sequence[str]) -> dict[str, Any]:
  """A run's learning curve of ``curve_metrics`` and its median training speed (shared with
  logic.py's records)."""
  return {
    "curve": learning_curve(workdir, curve_metrics),
    "steps_per_second": median_steps_per_second(workdir),
  }


# ------------------------------------------------------------------------------------------------
# Report (shared with the fuzzy-logic grid).


def speed_ratio(
  records: Sequence[Mapping[str, Any]], numerator: str = "hyla", denominator: str = "softmax"
) -> float | None:
  """Step time of ``numerator`` over that of ``denominator`` (mean steps/s over their runs)."""

  def mean_speed(attention):
    speeds = [
      r["steps_per_second"]
      for r in records
      if r["attention"] == attention and r.get("steps_per_second")
    ]
    return float(np.mean(speeds)) if speeds else None

  slow, fast = mean_speed(numerator), mean_speed(denominator)
  if not slow or not fast:
    return None
  return fast / slow  # time per step ∝ 1 / speed


def speed_ratio_line(records: Sequence[Mapping[str, Any]]) -> str:
  """The report's sentence on HYLA's step time relative to softmax's."""
  ratio = speed_ratio(records)
  if not ratio:
    return "HYLA/softmax step-time ratio: not available (needs runs of both)."
  return (
    f"HYLA's training step takes {ratio:.2f}× the time of softmax attention's on the same model "
    "(mean logged steps/s over runs, compilation excluded)."
  )


def environment_line(command: str, records: Sequence[Mapping[str, Any]]) -> str:
  return (
    f"Measured by `{command}` on {grid.describe_hardware(records)}."
    + grid.shared_machine_note(command)
  )


def plot_curves(
  records: Sequence[Mapping[str, Any]],
  panels: Mapping[str, str],
  path: str,
  ylabel: str,
  title: str,
) -> str:
  """One panel per metric (title → curve key), one line per run, coloured by attention, or by
  attention and setting where the records hold more than one setting (`--protocol=points`)."""
  from primal_dual.analysis import plots

  plt = plots.pyplot()
  by_setting = len({r.get("setting") for r in records}) > 1
  line_names = [
    f"{r['attention']} ({r['setting']})" if by_setting and r.get("setting") else r["attention"]
    for r in records
  ]
  colours = {
    name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(dict.fromkeys(line_names))
  }
  figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
  for axis, (panel_title, key) in zip(axes[0], panels.items()):
    seen = set()
    for record, name in zip(records, line_names):
      curve = record["curve"]
      axis.plot(
        curve["step"],
        curve[key],
        color=colours[name],
        alpha=0.8,
        label=None if name in seen else name,
      )
      seen.add(name)
    axis.set_title(panel_title)
    axis.set_xlabel("training step")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=8)
  figure.suptitle(title)
  figure.tight_layout()
  return plots.save_figure(figure, path, dpi=100, tight_bbox=False)


def write_curves(
  records: Sequence[Mapping[str, Any]],
  args: argparse.Namespace,
  *,
  panels: Mapping[str, str],
  ylabel: str,
  title: str,
) -> list[str]:
  """The learning-curves figure, ``<--results without .json>_curves.png``."""
  path = os.path.splitext(args.results)[0] + "_curves.png"
  return [plot_curves(records, panels, path, ylabel, title)]


def sequence_reproduction(module_name: str, summary: str) -> grid.Reproduction:
  """The grid of a sequence task (this module's or logic.py's, named by ``module_name``): the
  shared plan and flags, and the learning-curves figure of the module's ``CURVE_FIGURE``."""
  task = module_name.rpartition(".")[2]
  module = sys.modules[module_name]
  figure = module.CURVE_FIGURE
  return grid.module_reproduction(
    module_name,
    task=task,
    summary=summary,
    quick="2 tiny runs (softmax, hyla; the configs' runlocal)",
    build_runs=functools.partial(sequence_grid_runs, task),
    check_arguments=check_sequence_arguments,
    write_figures=functools.partial(
      write_curves,
      panels=dict(zip(figure.panel_titles, module.CURVE_METRICS)),
      ylabel=figure.ylabel,
      title=figure.title,
    ),
  )
