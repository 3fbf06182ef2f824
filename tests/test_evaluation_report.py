"""`evaluation.evaluate_workdir` returns what its annotation says: `EvalReport`, the checkpoint
asked for, the step restored and the metrics per split, the same as `eval.json` holds."""

import json
import typing

import helpers
from primal_dual.training import evaluation
from primal_dual.training import trainer


def test_evaluate_workdir_returns_its_annotated_report(tmp_path):
  config = helpers.tiny_config(num_train_steps=2, eval_every_steps=0, checkpoint_every_steps=2)
  trainer.train_and_evaluate(config, str(tmp_path))
  report = evaluation.evaluate_workdir(str(tmp_path), ("test",))

  returned = typing.get_type_hints(evaluation.evaluate_workdir)["return"]
  assert returned is evaluation.EvalReport
  fields = typing.get_type_hints(returned)
  assert report.keys() == fields.keys()
  assert (report["checkpoint"], report["step"]) == ("latest", 2)
  assert isinstance(report["step"], fields["step"])
  assert all(isinstance(value, float) for value in report["results"]["test"].values())
  assert json.loads((tmp_path / evaluation.EVAL_FILE).read_text()) == report
