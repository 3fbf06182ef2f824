"""Tests of the 'logic' task (primal_dual/tasks/logic.py), primal_dual/configs/logic.py and
`primal-dual reproduce logic` (its --quick grid is the task's end-to-end run)."""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from primal_dual.configs import logic as logic_configs
from primal_dual.data import logic
from reproduce import grid
from primal_dual.tasks import logic as task
from reproduce import logic as logic_study
from primal_dual.layers import ATTENTION_REGISTRY
from primal_dual.training import evaluation

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = logic.LogicConfig(num_variables=3, num_terms=2, seq_len=4)


def _context_inputs(targets, seq_len=3, seed=0):
  """Inputs ``[B, seq_len, 2]`` whose context tokens carry random y's (the query's is zeroed)."""
  rng = np.random.default_rng(seed)
  inputs = rng.uniform(size=(len(targets), seq_len, 2)).astype(np.float32)
  inputs[:, -1, -1] = 0.0
  return jnp.asarray(inputs)


def _outputs_predicting(predictions, seq_len=3):
  """Model outputs [B, T, 1] whose last position holds ``predictions`` (others: garbage)."""
  predictions = np.asarray(predictions, np.float32)
  outputs = np.full((len(predictions), seq_len, 1), 7.0, np.float32)
  outputs[:, -1, 0] = predictions
  return jnp.asarray(outputs)


def test_loss_and_metrics_on_hand_made_predictions():
  batch = {
    "target": jnp.array([0.5, 0.2, 0.9]),
    "task_variance": jnp.array([0.1, 0.2, 0.4]),
    "valid": jnp.array([True, True, False]),
    "inputs": _context_inputs([0.5, 0.2, 0.9]),
  }
  loss, metrics = task.logic_loss_and_metrics(_outputs_predicting([0.7, 0.2, np.nan]), batch)
  assert float(loss) == pytest.approx(0.04 / 2)
  np.testing.assert_allclose([float(v) for v in metrics["mse"]], [0.04, 2.0], rtol=1e-5)
  # R² pair: (Σ variance − Σ squared error, Σ variance) over the two real rows.
  np.testing.assert_allclose([float(v) for v in metrics["r2"]], [0.3 - 0.04, 0.3], rtol=1e-5)


def test_r2_through_the_trainer_reduction_equals_r_squared():
  rng = np.random.default_rng(1)
  variances = np.asarray(logic.task_moments(logic.LogicConfig())[1])
  per_batch, kept = [], []
  for size, num_valid in ((8, 8), (8, 8), (8, 3)):  # the last batch has 5 padding rows
    task_ids = rng.integers(0, len(variances), size)
    batch = {
      "target": rng.uniform(size=size).astype(np.float32),
      "task_variance": variances[task_ids].astype(np.float32),
      "valid": np.arange(size) < num_valid,
      "inputs": _context_inputs(np.zeros(size), seed=size + num_valid),
    }
    predictions = rng.uniform(size=size).astype(np.float32)
    _, metrics = task.logic_loss_and_metrics(
      _outputs_predicting(predictions), {k: jnp.asarray(v) for k, v in batch.items()}
    )
    per_batch.append(metrics)
    kept.append(
      (predictions[:num_valid], batch["target"][:num_valid], batch["task_variance"][:num_valid])
    )
  reduced = evaluation.reduce_metrics(per_batch)  # the trainer's Σ sums / Σ counts
  expected = logic.r_squared(*(np.concatenate(parts) for parts in zip(*kept)))
  assert reduced["r2"] == pytest.approx(expected, rel=1e-5)
  assert reduced["r2"] < 1.0


def test_task_source_adds_exact_variance_and_materializes_the_same_records():
  variances = logic.task_moments(SMALL)[1]
  stream = logic.LogicSource(SMALL, "test", 4, 12)
  for materialize in (False, True):
    source = task.LogicTaskSource(SMALL, "test", 4, 12, materialize=materialize, chunk_size=5)
    for index in (0, 5, 11):
      record, expected = source[index], stream[index]
      for name in ("inputs", "target", "task_id"):
        np.testing.assert_array_equal(record[name], expected[name])
      assert record["task_variance"] == pytest.approx(variances[expected["task_id"]], rel=1e-6)
    # get_batch (the batch_reads path) equals the stacked records, dtypes included.
    indices = np.array([11, 0, 5, 6])
    batch = source.get_batch(indices)
    for name, value in batch.items():
      expected = np.stack([source[int(i)][name] for i in indices])
      np.testing.assert_allclose(value, expected, rtol=1e-6)
      assert value.dtype == expected.dtype
    with pytest.raises(IndexError):
      source.get_batch(np.array([12]))
  trimmed = task.LogicTaskSource(SMALL, "train", 0, 4, fields=task.TRAIN_FIELDS)
  assert set(trimmed[0]) == set(task.TRAIN_FIELDS)
  with pytest.raises(IndexError):
    trimmed[4]


def test_build_data_uses_the_split_term_sets():
  config = logic_configs.get_config("runlocal")
  splits, metadata = task.build_data(config)
  tasks = metadata["tasks"]
  assert set(splits) == {"train", "validation", "test", "ood"}
  for split in ("test", "ood"):
    ids = {int(r["task_id"]) for r in splits[split].__getitems__(range(32))}
    assert ids <= set(logic.split_task_ids(tasks, split).tolist())


@pytest.mark.parametrize("preset", sorted(logic_configs.PRESETS))
def test_configs_build_for_every_preset_and_variant(preset):
  for attention in ATTENTION_REGISTRY:
    for extra in ("", ",runlocal"):
      config = logic_configs.get_config(f"preset={preset},attention={attention},seed=1{extra}")
      assert config.task == "logic" and config.model.attention == attention
      assert config.selection.split == "validation" and config.selection.metric == "r2"
      ratios = config.model.attention_options.get("ratios")
      if ratios is not None:
        assert len(ratios) == config.model.num_heads
  reference = logic_configs.get_config("preset=paper")
  assert (reference.data.num_variables, reference.data.num_terms, reference.data.seq_len) == (
    4,
    2,
    32,
  )
  assert (reference.model.model_dim, reference.model.num_heads, reference.model.num_layers) == (
    128,
    8,
    2,
  )
  with pytest.raises(ValueError, match="unknown logic preset"):
    logic_configs.get_config("preset=tiny")


def test_reproduce_quick_trains_in_parallel_and_reports(tmp_path):
  """--jobs=2: both runs train at once in subprocesses; --report_only re-renders the report."""
  root, out = tmp_path / "runs", tmp_path / "out"
  argv = ["--quick", f"--root={root}", f"--results={out / 'logic_quick.json'}", "--jobs=2"]
  assert grid.reproduce(logic_study.REPRODUCTION, argv) == 0
  records = json.loads((out / "logic_quick.json").read_text())
  assert [r["attention"] for r in records] == ["softmax", "hyla"]
  for record in records:
    assert np.isfinite(record["test_r2"]) and record["test_r2"] <= 1.0
    assert np.isfinite(record["ood_r2"]) and record["ood_r2"] <= 1.0
    assert record["curve"]["step"] and record["steps_per_second"] > 0
    assert record["hardware"]["platform"] == "cpu"  # Recorded by the training subprocess.
    assert (root / record["name"] / "grid_run.log").exists()
  markdown = (out / "logic_quick.md").read_text()
  assert "| attention | validation R²" in markdown and "--scale=paper" in markdown
  assert "With `--jobs=2`, 2 runs trained at once" in markdown
  assert (out / "logic_quick_curves.png").stat().st_size > 0

  # --report_only trains nothing (the workdirs may be gone) and rewrites the same report.
  (out / "logic_quick.md").unlink()
  shutil.rmtree(root)
  assert grid.reproduce(logic_study.REPRODUCTION, [*argv, "--report_only"]) == 0
  assert (out / "logic_quick.md").read_text() == markdown
  assert not root.exists()
