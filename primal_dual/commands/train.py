"""Train a model: `primal-dual train --config=<config>[:arg] --workdir=<dir>` (or `python train.py`).

`<config>` is a packaged config's short name (`default`, `uea`, ...: `primal_dual/configs/`) or
the path of any config file, e.g. `--config=uea:dataset=Heartbeat` or
`--config=primal_dual/configs/uea.py:dataset=Heartbeat`. Config fields can be overridden on the
command line, e.g. `--config.optimizer.lr=3e-4 --config.num_train_steps=1000`. Re-running with the
same workdir resumes from its last checkpoint. Problems the user can fix (bad config value, missing
data, diverged loss) are printed as one line `error: ...` with exit status 2.

Multi-process (TPU pod, SLURM, several localhost processes): see primal_dual/training/sharding.py.
"""

from absl import flags
from ml_collections import config_flags

from primal_dual.commands import cli


def define_flags() -> None:
  """Defines `--config` (with its `--config.<field>` overrides) and `--workdir`."""
  config_flags.DEFINE_config_file(
    'config',
    None,
    'A packaged config\'s name or a config file, optionally with an argument: '
    'uea:dataset=Heartbeat or primal_dual/configs/uea.py:dataset=Heartbeat',
    lock_config=True,
  )
  flags.DEFINE_string(
    'workdir', None, 'Output folder: config.json, metrics.jsonl, tensorboard/, checkpoints/.'
  )
  flags.mark_flags_as_required(['config', 'workdir'])
  cli.show_in_help(__name__)


def main(argv: list[str]) -> int:
  cli.start_main(argv)
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  # Imported here so that `--help` stays fast.
  from primal_dual.training import config_lib  # pylint: disable=g-import-not-at-top
  from primal_dual.training import errors  # pylint: disable=g-import-not-at-top

  try:
    config_lib.validate(config)  # before JAX loads: a bad size is reported at once
    from primal_dual.training import sharding  # pylint: disable=g-import-not-at-top

    sharding.maybe_initialize_distributed(config)
    from primal_dual.training import trainer  # pylint: disable=g-import-not-at-top

    final = trainer.train_and_evaluate(config, workdir)
  except errors.UserError as e:
    return cli.report(str(e))
  except KeyboardInterrupt:  # during set-up; the training loop reports its own step
    return cli.report('stopped before training started; re-run the same command to start again')
  import jax  # pylint: disable=g-import-not-at-top

  if jax.process_index() == 0:
    for name, value in final.items():
      print(f'{name:40s} {value}')
  return 0
