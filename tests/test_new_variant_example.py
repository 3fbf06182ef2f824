"""The worked example of docs/new_variant.md: a variant with a learned parameter in one file,
registered, trained through a task config, counted by the FLOP analysis."""

import importlib.util
import json
import os

import flax
import jax
import numpy as np
import pytest

from primal_dual.configs import sraven as sraven_configs
from primal_dual.configs import uea as uea_configs
from primal_dual import registry
from primal_dual.analysis import flops
from primal_dual.training import evaluation
from primal_dual.training import trainer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def example():
  path = os.path.join(REPO_ROOT, "docs", "examples", "learned_temperature.py")
  spec = importlib.util.spec_from_file_location("learned_temperature_example", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  yield module
  del registry.ATTENTION_REGISTRY[module.NAME]


def test_registered_variant_reaches_configs_and_flop_analysis(example):
  assert example.NAME in registry.ATTENTION_REGISTRY
  config = uea_configs.get_config(f"attention={example.NAME},runlocal")
  assert config.model.attention == example.NAME
  cost = flops.attention_flops(config.model, seq_len=29)
  assert cost["relative_to_softmax"] == 1.0


def test_example_variant_trains_and_learns_its_parameter(example, tmp_path):
  config = sraven_configs.get_config(f"attention={example.NAME},runlocal")
  final = trainer.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(final["train/loss"])
  with open(tmp_path / "final_metrics.json") as f:
    assert json.load(f)["model/num_parameters"] == final["model/num_parameters"]
  _, state = evaluation.restore_workdir(str(tmp_path))
  params = flax.traverse_util.flatten_dict(jax.device_get(state.params), sep="/")
  learned = {name: value for name, value in params.items() if name.endswith("log_temperature")}
  assert learned and all(value.shape == (config.model.num_heads,) for value in learned.values())
  # Initialised at 0 (plain softmax); four steps of AdamW at lr ~1e-3 moved it.
  assert any(np.abs(value).max() > 0 for value in learned.values())
