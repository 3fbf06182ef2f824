"""Every configs/*.py builds, is locked, and has a runlocal variant; bad arguments fail clearly."""

import glob
import os

import ml_collections
import pytest

from primal_dual.experiments.grid import load_config
from primal_dual.training import config_lib, errors

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(p for p in glob.glob(os.path.join(REPO_ROOT, "configs", "*.py"))
                      if not p.endswith("__init__.py"))


def test_there_are_configs():
  names = {os.path.basename(p) for p in CONFIG_FILES}
  assert {"default.py", "uea.py"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
@pytest.mark.parametrize("arg", [None, "runlocal"])
def test_config_builds_locked_with_every_trainer_field(path, arg):
  config = load_config(path, arg)
  assert isinstance(config, ml_collections.ConfigDict)
  assert config.is_locked
  with pytest.raises(AttributeError):
    config.not_a_field = 1  # locked: new fields are refused
  missing = set(config_lib.training_defaults()) - set(config)
  assert not missing, f"{path} lacks trainer fields {missing}"
  assert config.task and config.model.attention


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_docstring_gives_a_command(path):
  with open(path) as f:
    source = f.read()
  assert "train.py --config=configs/" in source, f"{path}: docstring lacks the exact command"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_rejects_unknown_arguments(path):
  with pytest.raises(errors.ConfigError, match="not_an_option"):
    load_config(path, "not_an_option=1")
