"""Train a model: `primal-dual train --config=<config>[:arg] --workdir=<dir>` (or `python train.py`).

`<config>` is a packaged config's short name (`default`, `uea`, ...: `primal_dual/configs/`) or
the path of any config file, e.g. `--config=uea:dataset=Heartbeat` or
`--config=primal_dual/configs/uea.py:dataset=Heartbeat`. Config fields can be overridden on the
command line, e.g. `--config.optimizer.lr=3e-4 --config.num_train_steps=1000`. Re-running with the
same workdir resumes from its last checkpoint. Problems the user can fix (bad config value, missing
data, diverged loss, Ctrl-C) are printed as one line `error: ...` with exit status 2. SIGTERM (a
pre-empted VM, SLURM, `docker stop`) stops training after the call in flight, saves a checkpoint
of the step reached and exits with status 75 after one line `error: stopped by SIGTERM at step N;
...`.

Multi-process (TPU pod, SLURM, several localhost processes): see primal_dual/training/sharding.py.
"""

import os

from absl import flags
from ml_collections import config_flags

from primal_dual.commands import cli


def define_flags() -> None:
  """Defines `--config` (with its `--config.<field>` overrides) and `--workdir`."""
  config_flags.DEFINE_config_file(
    "config",
    None,
    "A packaged config's name or a config file, optionally with an argument: "
    "uea:dataset=Heartbeat or primal_dual/configs/uea.py:dataset=Heartbeat",
    lock_config=True,
  )
  flags.DEFINE_string(
    "workdir", None, "Output folder: config.json, metrics.jsonl, tensorboard/, checkpoints/."
  )
  flags.mark_flags_as_required(["config", "workdir"])
  cli.show_in_help(__name__)


def main(argv: list[str]) -> int:
  cli.start_main(argv)
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  # Imported here so that `--help` stays fast.
  from primal_dual.training import config_lib
  from primal_dual.training import errors

  try:
    config_lib.validate(config)  # before JAX loads: a bad size is reported at once
    from primal_dual.training import sharding

    sharding.maybe_initialize_distributed(config)
    from primal_dual.training import trainer

    final = trainer.train_and_evaluate(config, workdir)
  except errors.DiskFullError as e:
    cli.report_and_exit_now(str(e))
  except errors.PreemptedError as e:
    cli.report(str(e))
    return cli.EXIT_PREEMPTED
  except errors.UserError as e:
    return cli.report(str(e))
  except KeyboardInterrupt:  # during set-up; the training loop reports its own step
    return cli.report("stopped before training started; re-run the same command to start again")
  import jax

  if jax.process_index() == 0:
    print_final(final, workdir)
  return 0


def print_final(final: dict, workdir: str) -> None:
  """A single run's final metrics one per line; a sweep's as a table of its settings
  (`sweep_summary`), all its metrics written to `<workdir>/sweep_summary.json`. Then the report
  line."""
  from primal_dual import atomic
  from primal_dual.training import sweep

  if not sweep.is_sweep_result(final):
    for name, value in final.items():
      print(f"{name:40s} {value}")
  else:
    print("\n".join(sweep_summary(final)))
    path = atomic.write_json(
      os.path.join(os.path.abspath(workdir), sweep.SUMMARY_FILE), sweep.per_replica(final)
    )
    print(f"every replica's final metrics: {path}")
  for line in which_to_report(final):
    print(line)


# A sweep's summary table fits a terminal this wide.
SUMMARY_COLUMNS = 100
# The setting column of a seed-only sweep, whose one setting is the config's own.
OWN_SETTING = "-"


def _rule(metrics: dict) -> tuple[str, str, str] | None:
  """A run's selection rule, ``selected/rule`` "max validation accuracy; ties: ..." as
  ``('max', 'validation', 'accuracy')``; None where it chose nothing."""
  words = str(metrics.get("selected/rule", "")).partition(";")[0].split()
  return tuple(words) if len(words) == 3 and words[0] in ("max", "min") else None


def _selected_splits(runs: list[dict], metric: str) -> list[str]:
  """The splits with a selected value of ``metric`` (``selected/<split>_<metric>``) in ``runs``,
  sorted."""
  fields = {name for metrics in runs for name in metrics}
  return sorted(
    name.removeprefix("selected/").removesuffix(f"_{metric}")
    for name in fields
    if name.startswith("selected/") and name.endswith(f"_{metric}")
  )


def _reported_split(splits: list[str]) -> str:
  return "test" if "test" in splits else splits[0]


def _caveat(split: str, chooser: str) -> str:
  return f"; optimistic: {chooser} also chose it" if split == chooser else ""


def _mean_and_se_text(values: list[float]) -> str:
  """``0.9250 ± 0.0071``: the mean of ``values`` and its standard error; one value alone."""
  from primal_dual.training import sweep

  if not values:
    return "-"
  mean, error = sweep.mean_and_standard_error(values)
  return f"{mean:.4f}" if error is None else f"{mean:.4f} ± {error:.4f}"


def _values(replicas: dict[str, dict], field: str) -> list[float]:
  return [metrics[field] for metrics in replicas.values() if field in metrics]


def _sweep_selection(
  groups: dict[str, dict[str, dict]],
) -> tuple[tuple[str, str, str], list[str]] | None:
  """A sweep's selection rule (that of its replicas, `_rule`) and the splits with a selected value
  of its metric, or None where no replica chose a checkpoint."""
  runs = [metrics for replicas in groups.values() for metrics in replicas.values()]
  rule = next(filter(None, map(_rule, runs)), None)
  splits = _selected_splits(runs, rule[2]) if rule else []
  return (rule, splits) if splits else None


def _setting_table(groups: dict[str, dict[str, dict]], metric: str, splits: list[str]) -> list[str]:
  """The lines of a table of settings: per setting its seeds and, per split of ``splits``, mean ±
  s.e. over them of ``selected/<split>_<metric>``."""
  from primal_dual.training import metrics_logging

  rows = {
    setting or OWN_SETTING: {
      "seeds": len(replicas),
      **{
        split: _mean_and_se_text(_values(replicas, f"selected/{split}_{metric}"))
        for split in splits
      },
    }
    for setting, replicas in groups.items()
  }
  table = metrics_logging.format_table(rows, row_title="setting", columns=["seeds", *splits])
  return table.splitlines()


def sweep_summary(final: dict) -> list[str]:
  """A sweep's replicas by setting (`sweep.by_setting`): per setting its seeds and, per split,
  mean ± s.e. over them of the selected checkpoints' number of the selection metric; the choosing
  split and the reported one first, the others where they fit in `SUMMARY_COLUMNS`."""
  from primal_dual.training import sweep

  groups = sweep.by_setting(final)
  selection = _sweep_selection(groups)
  if selection is None:
    return _setting_table(groups, "", [])
  (_, chooser, metric), splits = selection
  first = list(dict.fromkeys(s for s in (chooser, _reported_split(splits)) if s in splits))
  table = _setting_table(groups, metric, list(dict.fromkeys(first + splits)))
  if max(map(len, table)) > SUMMARY_COLUMNS:
    # Too wide: without the splits that neither chose nor are reported.
    table = _setting_table(groups, metric, first)
  return [f"replicas by setting: mean ± s.e. over seeds of selected/<split>_{metric}", *table]


def which_to_report(final: dict) -> list[str]:
  """The closing line naming the one number to report: ``selected/<split>_<metric>``, read at the
  checkpoint the run selected, on the test split where there is one and for the metric that
  selected it (``best/*`` are best values over evaluations, optimistic). A sweep's: that number's
  mean ± s.e. over the seeds of the setting whose mean on the choosing split is best
  (`sweep_report`)."""
  if "selected/rule" not in final and any(name.endswith("/selected/rule") for name in final):
    return sweep_report(final)
  rule = _rule(final)
  splits = _selected_splits([final], rule[2]) if rule else []
  if not splits:
    return []
  _, chooser, metric = rule
  split = _reported_split(splits)
  field = f"selected/{split}_{metric}"
  return [
    f"report: {field} = {final[field]:.4g} (the step {final.get('selected/step')} checkpoint, "
    f"chosen by {' '.join(rule)}{_caveat(split, chooser)})"
  ]


def sweep_report(final: dict) -> list[str]:
  """A sweep's report line: ``selected/<split>_<metric>`` as mean ± s.e. over the seeds of the
  setting with the best mean of the selection metric on the choosing split (validation, so the
  test number stays unbiased), naming that setting; [] where no replica chose a checkpoint."""
  from primal_dual.training import sweep

  groups = sweep.by_setting(final)
  selection = _sweep_selection(groups)
  if selection is None:
    return []
  (direction, chooser, metric), splits = selection
  choosing = {
    setting: sweep.mean_and_standard_error(values)[0]
    for setting, replicas in groups.items()
    if (values := _values(replicas, f"selected/{chooser}_{metric}"))
  }
  if not choosing:
    return []
  best = (max if direction == "max" else min)(choosing, key=choosing.get)
  split = _reported_split(splits)
  field = f"selected/{split}_{metric}"
  values = _values(groups[best], field)
  at = f" at {best}" if best else ""
  seeds = f"{len(values)} seed{'s' if len(values) != 1 else ''}"
  chosen = "setting and checkpoints" if len(groups) > 1 else "checkpoints"
  return [
    f"report: {field} = {_mean_and_se_text(values)}{at} ({seeds}; {chosen} chosen by "
    f"{direction} {chooser} {metric}{_caveat(split, chooser)})"
  ]
