"""Evaluate a training workdir: `primal-dual eval --workdir=<dir> [--splits=test,validation]` (or
`python eval.py`).

Restores the workdir's checkpoint (`--checkpoint=latest`, `selected` for the one chosen on the
validation split, or a step number) with its saved `config.json`, evaluates the named splits
(default: the task's evaluation splits), prints a table and writes `<workdir>/eval.json`.

Analyses (`primal_dual.analysis.ANALYSES`) run after the evaluation on the same checkpoint:
`--analyses=redundancy` (head distance per layer, see `primal_dual/analysis/redundancy.py`) or
`latent_code` (sRAVEN), a comma list. They read `--analysis_split` and at most `--max_examples`
examples (unset: each analysis' own defaults, for redundancy the whole test split), write their
JSON under `analyses` in eval.json and their figures into the workdir. Example::

  primal-dual eval --workdir=workdirs/default --checkpoint=selected --analyses=redundancy
"""

import json

from absl import flags

from primal_dual.commands import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines `--workdir`, `--splits`, `--checkpoint` and the analysis flags."""
  flags.DEFINE_string("workdir", None, "A workdir written by `primal-dual train` (train.py).")
  flags.DEFINE_list("splits", [], "Splits to evaluate (default: the task's).")
  flags.DEFINE_string("checkpoint", "latest", "'latest', 'selected' or a step number.")
  flags.DEFINE_list(
    "analyses", [], "Analyses to run after evaluation, e.g. redundancy,latent_code."
  )
  flags.DEFINE_string(
    "analysis_split", "", "Split the analyses read; empty = each analysis' default (test, ood)."
  )
  flags.DEFINE_integer(
    "max_examples",
    0,
    "At most this many examples per analysis; 0 = the analysis' default (redundancy: all).",
  )
  flags.mark_flags_as_required(["workdir"])
  flags.register_validator(
    "checkpoint",
    lambda name: name in ("latest", "selected") or name.isdigit(),
    message="--checkpoint must be 'latest', 'selected' or a step number",
  )
  cli.show_in_help(__name__)


def _evaluate_and_analyse(workdir: str) -> dict:
  """Evaluation plus the requested analyses on one restored checkpoint; writes eval.json."""
  from primal_dual import analysis
  from primal_dual.training import evaluation
  import jax

  for name in FLAGS.analyses:  # Fail on a typo before restoring anything.
    analysis.get_analysis(name)
  program, state = evaluation.restore_workdir(workdir, FLAGS.checkpoint)
  if FLAGS.analysis_split and FLAGS.analysis_split not in program.splits:
    from primal_dual.training import errors

    raise errors.ConfigError(
      f"--analysis_split={FLAGS.analysis_split!r} is not a split of this "
      f"task; choose one of {sorted(program.splits)}"
    )
  results = evaluation.evaluate(program, state, tuple(FLAGS.splits) or None)
  report = {
    "checkpoint": str(FLAGS.checkpoint),
    "step": int(jax.device_get(state.step)),
    "results": results,
  }
  report["analyses"] = analysis.run_analyses(
    FLAGS.analyses,
    program,
    state,
    split=FLAGS.analysis_split or None,
    max_examples=FLAGS.max_examples or None,
    out_dir=workdir,
  )
  if jax.process_index() == 0:
    evaluation.write_eval_report(workdir, report)
  return report


def main(argv: list[str]) -> int:
  cli.start_main(argv)
  from primal_dual.training import errors
  from primal_dual.training import sharding

  try:
    sharding.maybe_initialize_distributed()
    from primal_dual.training import evaluation

    if FLAGS.analyses:
      report = _evaluate_and_analyse(FLAGS.workdir)
    else:
      report = evaluation.evaluate_workdir(
        FLAGS.workdir, tuple(FLAGS.splits) or None, FLAGS.checkpoint
      )
  except errors.ReportNotSavedError as e:  # a read-only workdir: the results still shown
    _print_report(e.report)
    return cli.report(str(e))
  except errors.UserError as e:
    return cli.report(str(e))
  except OSError as e:  # writing a figure
    if not errors.is_disk_full(e):
      raise
    return cli.report(str(errors.DiskFullError(FLAGS.workdir)))
  _print_report(report)
  return 0


def _print_report(report: dict) -> None:
  """The checkpoint, the metrics table and the analyses' scalars, on process 0."""
  import jax

  from primal_dual.training import metrics_logging

  if jax.process_index() != 0:
    return
  print(f"checkpoint: {report['checkpoint']} (step {report['step']})")
  print(metrics_logging.format_table(report["results"]))
  for name, result in report.get("analyses", {}).items():
    summary = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
    print(f"{name}: {json.dumps(summary, sort_keys=True)}")
    if "head_distance_per_layer" in result:
      print(f"  head_distance_per_layer: {result['head_distance_per_layer']}")
