"""Every primal_dual/configs/*.py builds, is locked, and has a runlocal variant; bad arguments fail
clearly; the packaged short names resolve."""

import glob
import os

import ml_collections
import pytest

from primal_dual import configs
from primal_dual.configs import load as load_config
from primal_dual.commands import cli
from primal_dual.training import config_lib, errors

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO_ROOT, "primal_dual", "configs")
# The config files: every module but the private ones (``__init__.py``, the helpers ``_*.py``).
CONFIG_FILES = sorted(
  p for p in glob.glob(os.path.join(CONFIG_DIR, "*.py")) if not os.path.basename(p).startswith("_")
)


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
  assert "train.py --config=primal_dual/configs/" in source, (
    f"{path}: docstring lacks the exact command"
  )


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_rejects_unknown_arguments(path):
  with pytest.raises(errors.ConfigError, match="not_an_option"):
    load_config(path, "not_an_option=1")


# -- packaged short names --------------------------------------------------------------------------


def test_packaged_names_are_the_config_files():
  assert configs.packaged_names() == sorted(
    os.path.splitext(os.path.basename(p))[0] for p in CONFIG_FILES
  )


@pytest.mark.parametrize("name", configs.packaged_names())
def test_short_name_and_package_paths_resolve_from_any_folder(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # no primal_dual/configs/ or configs/ folder here
  expected = os.path.join(CONFIG_DIR, f"{name}.py")
  for spec in (name, f"primal_dual/configs/{name}.py", f"configs/{name}.py"):
    assert os.path.samefile(configs.resolve(spec), expected), spec


@pytest.mark.parametrize("name", configs.packaged_names())
def test_every_packaged_config_builds_by_short_name_with_runlocal(name):
  config = load_config(name, "runlocal")
  assert config.is_locked and config.task and config.model.attention


def test_an_existing_file_wins_over_a_packaged_config_of_its_name(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "uea.py").write_text("def get_config(arg=None):\n  return arg\n")
  assert configs.resolve("configs/uea.py") == "configs/uea.py"
  assert load_config("configs/uea.py", "mine") == "mine"


def test_unknown_short_name_is_one_line_listing_the_packaged_ones():
  with pytest.raises(errors.ConfigError) as raised:
    configs.resolve("uae")
  message = str(raised.value)
  assert "\n" not in message and message.startswith("unknown config 'uae'")
  assert all(name in message for name in configs.packaged_names())


def test_missing_file_names_the_file_and_the_packaged_configs(tmp_path):
  with pytest.raises(
    errors.ConfigError,
    match=r"config file .*nope\.py not found; packaged "
    r"configs: default, ",
  ):
    configs.resolve(str(tmp_path / "nope.py"))


def test_command_line_specs_keep_their_argument_and_other_flags():
  argv = [
    "train",
    "--config=uea:dataset=Heartbeat,runlocal",
    "--config.seed=3",
    "--config",
    "default",
    "--workdir=w",
  ]
  resolved = cli.resolve_config_specs(argv)
  assert resolved[0] == "train" and resolved[2:4] == ["--config.seed=3", "--config"]
  assert resolved[1] == (
    f"--config={os.path.join(CONFIG_DIR, 'uea.py')}:dataset=Heartbeat,runlocal"
  )
  assert resolved[4:] == [os.path.join(CONFIG_DIR, "default.py"), "--workdir=w"]


# JapaneseVowels' TRAIN split: 270 series (the aeon archive); default.py trains on all of it.
JAPANESE_VOWELS_TRAIN_SIZE = 270


def test_default_docstring_states_its_training_steps():
  from primal_dual.configs import default
  from primal_dual.training import setup

  config = configs.load("default")
  steps, _ = setup._training_length(config, JAPANESE_VOWELS_TRAIN_SIZE)
  assert f"{config.num_epochs} epochs = {steps} steps" in " ".join(default.__doc__.split())


# Variants whose options differ by task: SH's ratios, ListOps' primal linear attention.
VARIANTS_TO_SWITCH = ("softmax", "linear", "sh", "bn_sh", "hyla")


@pytest.mark.parametrize("name", ["uea", "listops", "images", "sraven", "logic"])
def test_both_ways_of_choosing_a_variant_resolve_to_the_same_run(name):
  """``--config=NAME:attention=V`` and ``--config=NAME --config.model.attention=V``."""
  from primal_dual.training import setup

  for variant in VARIANTS_TO_SWITCH:
    by_argument = load_config(name, f"attention={variant},runlocal")
    by_field = load_config(name, "runlocal")
    by_field.model.attention = variant  # what the command-line override does to a locked config
    assert setup.resolve_config(by_field) == setup.resolve_config(by_argument), (name, variant)
  # The options really are the variant's: SH gets ratios, softmax none.
  sh = setup.resolve_config(load_config(name, "attention=sh,runlocal"))
  assert "ratios" in sh.model.attention_options


# -- compute and parameter dtypes ----------------------------------------------------------------


@pytest.mark.parametrize("name", configs.packaged_names())
def test_model_dtype_is_a_field_and_bf16_is_its_shorthand(name):
  """``--config.model.dtype=bfloat16`` (parsed as the commands parse it) and the config argument
  ``bf16`` give the same run; both configs start float32 (the published results' setting)."""
  from absl import flags
  from ml_collections import config_flags

  from primal_dual.training import setup

  argv = ["train", f"--config={configs.resolve(name)}:runlocal", "--config.model.dtype=bfloat16"]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  by_field = flag_values.config
  by_shorthand = load_config(name, "runlocal,bf16")
  assert (by_shorthand.model.dtype, by_shorthand.model.param_dtype) == ("bfloat16", "float32")
  assert setup.resolve_config(by_field) == setup.resolve_config(by_shorthand)
  plain = load_config(name, "runlocal").model
  assert (plain.dtype, plain.param_dtype) == ("float32", "float32")


# -- count arguments ------------------------------------------------------------------------------

COUNT_ARGUMENTS = ("epochs", "steps")


@pytest.mark.parametrize("name", configs.packaged_names())
def test_a_count_of_minus_one_is_the_configs_own(name):
  """``epochs=-1`` / ``steps=-1`` (``config_lib.CONFIG_DEFAULT_COUNT``) is the config's own count,
  the one it trains without the argument: ``default:epochs=-1`` is 40 epochs, not uea's 100."""
  from primal_dual.commands import listing

  counts = [key for key in listing.config_arguments(name) if key in COUNT_ARGUMENTS]
  for key in counts:
    own = load_config(name, None)
    given = load_config(name, f"{key}={config_lib.CONFIG_DEFAULT_COUNT}")
    assert given.to_dict() == own.to_dict(), (name, key)
  if name == "default":
    assert counts == ["epochs"] and load_config(name, "epochs=-1").num_epochs == 40
    with pytest.raises(errors.ConfigError, match=r"epochs=0: .* the config's own \(40\)"):
      load_config(name, "epochs=0")
