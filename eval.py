"""Evaluate a training workdir: `python eval.py --workdir=<dir> [--splits=test,validation]`.

Restores the workdir's checkpoint (`--checkpoint=latest`, `selected` for the one chosen on the
validation split, or a step number) with its saved `config.json`, evaluates the named splits
(default: the task's evaluation splits), prints a table and writes `<workdir>/eval.json`.
"""

import sys

from absl import app
from absl import flags
from absl import logging

_WORKDIR = flags.DEFINE_string('workdir', None, 'A workdir written by train.py.')
_SPLITS = flags.DEFINE_list('splits', [], 'Splits to evaluate (default: the task\'s).')
_CHECKPOINT = flags.DEFINE_string(
    'checkpoint', 'latest', "'latest', 'selected' or a step number.")
flags.mark_flags_as_required(['workdir'])


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  from primal_dual.training import errors  # pylint: disable=g-import-not-at-top
  from primal_dual.training import metrics_logging  # pylint: disable=g-import-not-at-top
  from primal_dual.training import sharding  # pylint: disable=g-import-not-at-top
  try:
    sharding.maybe_initialize_distributed()
    from primal_dual.training import trainer  # pylint: disable=g-import-not-at-top
    report = trainer.evaluate_workdir(_WORKDIR.value, tuple(_SPLITS.value) or None,
                                       _CHECKPOINT.value)
  except errors.UserError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    print(f"checkpoint: {report['checkpoint']} (step {report['step']})")
    print(metrics_logging.format_table(report['results']))
  return 0


if __name__ == '__main__':
  app.run(main)
