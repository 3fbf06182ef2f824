"""Evaluate a training workdir: `python eval.py --workdir=<dir> [--splits=test,validation]`.

Restores the workdir's checkpoint (`--checkpoint=latest`, `selected` for the one chosen on the
validation split, or a step number) with its saved `config.json`, evaluates the named splits
(default: the task's evaluation splits), prints a table and writes `<workdir>/eval.json`.

Analyses (`primal_dual.analysis.ANALYSES`) run after the evaluation on the same checkpoint:
`--analyses=redundancy` (head distance per layer, see `primal_dual/analysis/redundancy.py`) or
`latent_code` (sRAVEN), a comma list. They read `--analysis_split` and at most `--max_examples`
examples (unset: each analysis' own defaults, for redundancy the whole test split), write their
JSON under `analyses` in eval.json and their figures into the workdir. Example::

  python eval.py --workdir=workdirs/default --checkpoint=selected --analyses=redundancy
"""

import json
import os

from absl import app
from absl import flags

from primal_dual.training import cli

_WORKDIR = flags.DEFINE_string('workdir', None, 'A workdir written by train.py.')
_SPLITS = flags.DEFINE_list('splits', [], 'Splits to evaluate (default: the task\'s).')
_CHECKPOINT = flags.DEFINE_string(
    'checkpoint', 'latest', "'latest', 'selected' or a step number.")
_ANALYSES = flags.DEFINE_list(
    'analyses', [], 'Analyses to run after evaluation, e.g. redundancy,latent_code.')
_ANALYSIS_SPLIT = flags.DEFINE_string(
    'analysis_split', '', "Split the analyses read; empty = each analysis' default (test, ood).")
_MAX_EXAMPLES = flags.DEFINE_integer(
    'max_examples', 0,
    "At most this many examples per analysis; 0 = the analysis' default (redundancy: all).")
flags.mark_flags_as_required(['workdir'])
flags.register_validator(
    'checkpoint', lambda name: name in ('latest', 'selected') or name.isdigit(),
    message="--checkpoint must be 'latest', 'selected' or a step number")


def _evaluate_and_analyse(workdir: str) -> dict:
  """Evaluation plus the requested analyses on one restored checkpoint; writes eval.json."""
  from primal_dual import analysis  # pylint: disable=g-import-not-at-top
  from primal_dual.training import trainer  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  for name in _ANALYSES.value:  # Fail on a typo before restoring anything.
    analysis.get_analysis(name)
  experiment, state = trainer.restore_workdir(workdir, _CHECKPOINT.value)
  if _ANALYSIS_SPLIT.value and _ANALYSIS_SPLIT.value not in experiment.splits:
    from primal_dual.training import errors  # pylint: disable=g-import-not-at-top
    raise errors.ConfigError(f'--analysis_split={_ANALYSIS_SPLIT.value!r} is not a split of this '
                             f'task; choose one of {sorted(experiment.splits)}')
  results = trainer.evaluate(experiment, state, tuple(_SPLITS.value) or None)
  report = {'checkpoint': str(_CHECKPOINT.value), 'step': int(jax.device_get(state.step)),
            'results': results}
  report['analyses'] = analysis.run_analyses(
      _ANALYSES.value, experiment, state, split=_ANALYSIS_SPLIT.value or None,
      max_examples=_MAX_EXAMPLES.value or None, out_dir=workdir)
  if jax.process_index() == 0:
    path = os.path.join(os.path.abspath(workdir), 'eval.json')
    with open(path + '.tmp', 'w') as f:
      json.dump(report, f, indent=2, sort_keys=True)
    os.replace(path + '.tmp', path)
  return report


def main(argv: list[str]) -> int:
  cli.start_main(argv)
  from primal_dual.training import errors  # pylint: disable=g-import-not-at-top
  from primal_dual.training import metrics_logging  # pylint: disable=g-import-not-at-top
  from primal_dual.training import sharding  # pylint: disable=g-import-not-at-top
  try:
    sharding.maybe_initialize_distributed()
    from primal_dual.training import trainer  # pylint: disable=g-import-not-at-top
    if _ANALYSES.value:
      report = _evaluate_and_analyse(_WORKDIR.value)
    else:
      report = trainer.evaluate_workdir(_WORKDIR.value, tuple(_SPLITS.value) or None,
                                         _CHECKPOINT.value)
  except errors.UserError as e:
    return cli.report(str(e))
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    print(f"checkpoint: {report['checkpoint']} (step {report['step']})")
    print(metrics_logging.format_table(report['results']))
    for name, result in report.get('analyses', {}).items():
      summary = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
      print(f'{name}: {json.dumps(summary, sort_keys=True)}')
      if 'head_distance_per_layer' in result:
        print(f"  head_distance_per_layer: {result['head_distance_per_layer']}")
  return 0


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)
