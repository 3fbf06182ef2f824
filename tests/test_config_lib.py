"""Tests for primal_dual.training.config_lib (no JAX computation: fast)."""

import json

import ml_collections
import pytest

from primal_dual.training import config_lib
from primal_dual.training import errors


def test_parse_arg_types_values_by_their_defaults():
  arg = config_lib.parse_arg(
    "steps=12,lr=3e-4,name=Heartbeat,shuffle=false",
    steps=1,
    lr=1.0,
    name="JapaneseVowels",
    shuffle=True,
    runlocal=False,
  )
  assert arg.steps == 12 and isinstance(arg.steps, int)
  assert arg.lr == pytest.approx(3e-4) and isinstance(arg.lr, float)
  assert arg.name == "Heartbeat"
  assert arg.shuffle is False
  assert arg.runlocal is False  # untouched default


def test_parse_arg_defaults_when_empty_or_none():
  for raw in (None, "", " , "):
    arg = config_lib.parse_arg(raw, steps=3, runlocal=False)
    assert arg.to_dict() == {"steps": 3, "runlocal": False}


def test_bare_flag_sets_bool_true_and_float_accepts_int_text():
  arg = config_lib.parse_arg("runlocal,lr=2", runlocal=False, lr=0.5)
  assert arg.runlocal is True
  assert arg.lr == 2.0 and isinstance(arg.lr, float)


@pytest.mark.parametrize(
  "raw, message",
  [
    ("unknown=1", "unknown config argument 'unknown'"),
    ("steps=abc", "expected a value of type int"),
    ("runlocal=maybe", "expected a boolean"),
    ("steps", "needs a value"),
  ],
)
def test_parse_arg_errors_are_clear_value_errors(raw, message):
  with pytest.raises(ValueError, match=message) as info:
    config_lib.parse_arg(raw, steps=1, runlocal=False)
  assert isinstance(info.value, errors.UserError)


def test_unknown_key_message_lists_known_keys():
  with pytest.raises(errors.ConfigError, match="known: lr, runlocal"):
    config_lib.parse_arg("lrr=1", lr=0.1, runlocal=False)


def test_unknown_key_suggests_the_closest_one():
  with pytest.raises(errors.ConfigError, match="'lrr' in 'lrr=1'; did you mean 'lr'\\? known"):
    config_lib.parse_arg("lrr=1", lr=0.1, runlocal=False)


def _with_model(**fields):
  config = config_lib.training_defaults()
  config.model = ml_collections.ConfigDict(fields)
  return config


@pytest.mark.parametrize(
  "fields, message",
  [
    ({"num_layers": 0}, r"config.model.num_layers=0 must be a positive integer"),
    ({"model_dim": -16}, r"config.model.model_dim=-16 must be a positive integer"),
    ({"num_heads": 2.0}, r"config.model.num_heads=2.0 must be a positive integer"),
    ({"hidden": True}, r"config.model.hidden=True must be a positive integer"),
    ({"dropout_rate": 1.0}, r"config.model.dropout_rate=1.0 must be in \[0, 1\)"),
    ({"attention_dropout_rate": -0.1}, r"config.model.attention_dropout_rate=-0.1 must be in"),
    ({"dtype": "float16"}, r"config.model.dtype='float16'; choose one of float32, bfloat16"),
    ({"param_dtype": "bf16"}, r"config.model.param_dtype='bf16'; choose one of float32, bf"),
  ],
)
def test_validate_refuses_bad_sizes_and_rates(fields, message):
  with pytest.raises(errors.ConfigError, match=message):
    config_lib.validate(_with_model(**fields))


def test_validate_accepts_sound_models_and_empty_ones():
  config_lib.validate(
    _with_model(
      num_layers=1, model_dim=16, num_heads=2, dropout_rate=0.0, attention_dropout_rate=0.5
    )
  )
  config_lib.validate(config_lib.training_defaults())
  config_lib.validate(_with_model(dtype="bfloat16", param_dtype="bfloat16"))


def test_model_dtypes_default_to_float32():
  """Every config starts with float32 compute and parameters (the results' setting)."""
  model = config_lib.training_defaults().model
  assert (model.dtype, model.param_dtype) == ("float32", "float32")


def test_lock_refuses_new_fields_but_allows_overrides():
  config = config_lib.lock(config_lib.training_defaults())
  config.optimizer.lr = 0.5  # command-line overrides of existing fields still work
  assert config.optimizer.lr == 0.5
  with pytest.raises(AttributeError):
    config.optimizer.lrr = 0.1  # a misspelt field raises
  with pytest.raises(AttributeError):
    config.not_a_field = 1


def test_freeze_refuses_any_mutation():
  frozen = config_lib.freeze(config_lib.training_defaults())
  with pytest.raises((AttributeError, ValueError)):
    frozen.seed = 3
  with pytest.raises((AttributeError, ValueError)):
    frozen.optimizer.lr = 3.0
  hash(frozen)  # frozen configs are hashable (usable as static jit arguments)


def test_merge_fills_defaults_and_keeps_task_fields():
  override = ml_collections.ConfigDict(
    {"batch_size": 8, "optimizer": {"lr": 0.2}, "model": {"hidden": 32}, "extra": "x"}
  )
  merged = config_lib.merge(config_lib.training_defaults(), override)
  assert merged.batch_size == 8
  assert merged.optimizer.lr == 0.2
  assert merged.optimizer.name == "adamw"  # default kept inside a partly overridden sub-dict
  assert merged.model.hidden == 32
  assert merged.extra == "x"
  assert config_lib.training_defaults().batch_size == 32  # defaults untouched


def test_write_then_read_config_round_trips(tmp_path):
  config = config_lib.training_defaults()
  config.model.hidden = 7
  config.eval_splits = ("validation", "test")
  path = config_lib.write_config(config_lib.freeze(config), str(tmp_path))
  assert path == str(tmp_path / "config.json")
  with open(path) as f:
    assert json.load(f)["model"] == {**config_lib.MODEL_DTYPES, "hidden": 7}
  restored = config_lib.read_config(str(tmp_path))
  assert restored.model.hidden == 7
  assert tuple(restored.eval_splits) == ("validation", "test")
  assert restored.optimizer.to_dict() == config.optimizer.to_dict()


def test_read_config_missing_is_a_user_error(tmp_path):
  with pytest.raises(errors.CheckpointNotFoundError, match="config.json"):
    config_lib.read_config(str(tmp_path / "nowhere"))


def test_retired_seeds_are_refused_when_set_and_dropped_when_empty():
  """`config.sweep.seed` is the one spelling of several seeds: `config.seeds` set is refused in
  one line naming it (as a config field and as a command-line override), and the empty one an
  earlier version wrote into config.json and experiment.json is dropped."""
  from primal_dual.commands import cli
  from primal_dual.training import setup
  from primal_dual.training import workdir as workdir_lib

  config = config_lib.training_defaults()
  assert "seeds" not in config
  with pytest.raises(errors.ConfigError) as info:
    setup.resolve_config(config_lib.with_fields(config, {"seeds": (0, 1)}))
  assert str(info.value) == (
    "config.seeds is now config.sweep.seed: set --config.sweep.seed='(0, 1)' instead"
  )
  assert cli.unknown_field_message(config, "seeds").startswith(
    "config.seeds is now config.sweep.seed"
  )
  old = setup.resolve_config(config_lib.with_fields(config, {"seeds": ()}))
  assert "seeds" not in old
  stored = {**workdir_lib.definition(old), "seeds": []}
  assert workdir_lib.differences(stored, workdir_lib.definition(old)) == []
  assert workdir_lib.differences({**stored, "seeds": [3]}, workdir_lib.definition(old)) == [
    "seeds [3] != '<unset>'"
  ]
