"""The UEA task's user errors: each ends in one clear UserError before any training happens."""

import pytest

from primal_dual.configs import load as load_config
from primal_dual.training import config_lib
from primal_dual.training import errors, trainer

CONFIG = "primal_dual/configs/uea.py"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def _config(arg, **overrides):
  config = load_config(CONFIG, arg)
  with config.unlocked():
    return config_lib.with_fields(config, overrides)


def test_unknown_attention_name_lists_the_known_ones():
  with pytest.raises(errors.ConfigError, match="unknown attention 'nope'.*softmax"):
    load_config(CONFIG, "attention=nope,runlocal")


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"model.num_heads": 3}, r"model config.*not divisible by num_heads=3"),
    ({"model.attention_options": {"ratios": (1, 2, 2)}}, r"model config.*ratios.*heads=2"),
  ],
)
def test_bad_model_options_are_config_errors(overrides, message, data_dir, tmp_path):
  arg = f"dataset=BasicMotions,attention=sh,runlocal,data_dir={data_dir}"
  with pytest.raises(errors.ConfigError, match=message):
    trainer.train_and_evaluate(_config(arg, **overrides), str(tmp_path / "run"))


def test_missing_data_folder_says_which_files_to_put_where(tmp_path):
  arg = f"dataset=Heartbeat,runlocal,data_dir={tmp_path / 'tfds'},manual_dir={tmp_path / 'none'}"
  with pytest.raises(errors.DataNotFoundError, match=r"Heartbeat_TRAIN\.ts.*Heartbeat_TEST\.ts"):
    trainer.train_and_evaluate(load_config(CONFIG, arg), str(tmp_path / "run"))
