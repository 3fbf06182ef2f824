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
  """A single run's final metrics one per line; a sweep's as a table of its replicas' selected
  numbers, all its metrics written to `<workdir>/sweep_summary.json`. Then the report line."""
  from primal_dual import atomic
  from primal_dual.training import metrics_logging
  from primal_dual.training import sweep

  if not sweep.is_sweep_result(final):
    for name, value in final.items():
      print(f"{name:40s} {value}")
  else:
    print(metrics_logging.format_table(sweep.summary_rows(final), row_title="replica"))
    path = atomic.write_json(
      os.path.join(os.path.abspath(workdir), sweep.SUMMARY_FILE), sweep.per_replica(final)
    )
    print(f"every replica's final metrics: {path}")
  for line in which_to_report(final):
    print(line)


def which_to_report(final: dict) -> list[str]:
  """The closing line naming the one number to report: ``selected/<split>_<metric>``, read at the
  checkpoint the run selected, on the test split where there is one and for the metric that
  selected it (``best/*`` are best values over evaluations, optimistic). A sweep's names carry
  their replica's prefix (``lr=0.001,seed=0/selected/...``); its line names the field."""
  names = [name for name in final if name.startswith("selected/") or "/selected/" in name]
  fields = {name.rpartition("selected/")[2]: name for name in names}
  rule = final.get(fields.get("rule"), "") if "rule" in fields else ""
  words = rule.partition(";")[0].split()  # "max validation accuracy"
  if len(words) != 3 or words[0] not in ("max", "min"):
    return []
  _, chooser, metric = words
  splits = sorted(name.removesuffix(f"_{metric}") for name in fields if name.endswith(f"_{metric}"))
  if not splits:
    return []
  split = "test" if "test" in splits else splits[0]
  field = f"selected/{split}_{metric}"
  caveat = f"; optimistic: {chooser} also chose it" if split == chooser else ""
  step = final.get(fields.get("step"))
  if any(name != f"selected/{key}" for key, name in fields.items()):  # a sweep's replicas
    return [f"report: <replica>/{field} of each replica (chosen by {' '.join(words)}{caveat})"]
  return [
    f"report: {field} = {final[field]:.4g} (the step {step} checkpoint, chosen by "
    f"{' '.join(words)}{caveat})"
  ]
