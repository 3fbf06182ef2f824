"""The 'listops' task: configs, padding invariance of every variant, analytic FLOPs, and the
reproduction script end to end (tiny preset, 2 runs)."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primal_dual.data import listops as listops_data
from reproduce import grid
from primal_dual.tasks import listops as listops_task
from reproduce import listops as listops_study
from primal_dual.kernels.scaled_head import attention_cost_ratio
from primal_dual.layers import ATTENTION_REGISTRY
from primal_dual.models import EncoderClassifier
from primal_dual.training import errors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(REPO, "primal_dual", "configs", "listops.py")
SETTINGS = {
  "jax_lra": dict(num_layers=4, model_dim=512, num_heads=8, mlp_dim=1024, pooling="cls"),
  "pytorch": dict(num_layers=2, model_dim=64, num_heads=2, mlp_dim=128, pooling="mean"),
}
CONFIG_VARIANTS = ("softmax", "linear", "bn", "sh", "bn_sh", "hyla", "random_feature")


def load(arg):
  return grid.load_config(CONFIG_FILE, arg)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("preset", ["full", "short"])
@pytest.mark.parametrize("attention", CONFIG_VARIANTS)
def test_config_builds_for_setting_preset_and_attention(setting, preset, attention):
  config = load(f"setting={setting},preset={preset},attention={attention},seed=3")
  assert config.task == "listops" and config.seed == 3
  assert config.data.preset == preset
  assert {k: config.model[k] for k in SETTINGS[setting]} == SETTINGS[setting]
  assert config.model.attention == attention
  assert config.batch_size == 32 and config.num_train_steps == 5000
  assert config.selection.split == "validation"
  options = dict(config.model.attention_options)
  if attention in ("sh", "bn_sh"):
    assert len(options["ratios"]) == config.model.num_heads
    assert options["ratios"][0] == 1  # a full-resolution head is kept
  if attention == "linear":
    assert options == {"form": "primal"}
  with pytest.raises(AttributeError):  # locked: a misspelt field cannot be added
    config.not_a_field = 1


def test_config_settings_optimizers_and_runlocal():
  lra = load("setting=jax_lra")
  # LRA's schedule 0.05·min(1, s/1000)/√max(s, 1000) peaks at 0.05/√1000 after warm-up.
  assert lra.optimizer.schedule == "rsqrt" and lra.optimizer.warmup_steps == 1000
  assert np.isclose(lra.optimizer.lr * np.sqrt(1000), 0.05)
  assert lra.optimizer.weight_decay == 0.1 and lra.model.positional == "sinusoidal"
  torch = load("setting=pytorch")
  assert torch.optimizer.lr == 1e-4 and torch.model.positional == "learned"
  local = load("setting=jax_lra,attention=sh,runlocal,steps=7")
  assert local.data.preset == "tiny" and local.num_train_steps == 7
  assert local.model.model_dim == 16 and tuple(local.model.attention_options.ratios) == (1, 2)


@pytest.mark.parametrize(
  "arg, message",
  [
    ("setting=tf", "unknown ListOps setting"),
    ("preset=medium", "unknown ListOps preset"),
    ("attention=sparse_magic", "unknown attention"),
    ("presett=full", "unknown config argument"),
  ],
)
def test_config_errors_say_what_to_do(arg, message):
  with pytest.raises(ValueError, match=message):
    load(arg)


def test_model_rejects_flatten_pooling():
  config = load("runlocal")
  with config.unlocked():
    config.model.pooling = "flatten"
  with pytest.raises(errors.ConfigError, match="pooling"):
    listops_task.build_model(config, listops_task.listops_metadata(config))


PADDED_LENGTH, VALID_LENGTH = 12, 7


def _tiny_model(attention, pooling, options=None):
  options = dict(options or {})
  if attention in ("sh", "bn_sh"):
    options["ratios"] = (1, 2)
  return EncoderClassifier(
    num_classes=10,
    num_layers=1,
    model_dim=8,
    num_heads=2,
    mlp_dim=16,
    input_kind="embed",
    vocab_size=listops_data.VOCAB_SIZE,
    pooling=pooling,
    attention=attention,
    attention_options=options,
    dropout_rate=0.0,
  )


@functools.lru_cache(maxsize=None)
def _shared_variables(pooling):
  """One set of parameters for every variant (none adds parameters to softmax attention), so
  each test compiles only its forward pass."""
  tokens = jnp.zeros((1, PADDED_LENGTH), jnp.int32)
  model = _tiny_model("softmax", pooling)
  variables = jax.jit(lambda rng: model.init(rng, tokens, mask=tokens > 0))(jax.random.PRNGKey(0))
  if pooling == "cls":
    # The CLS token is initialised to zeros and gets no position: under HYLA its query is then 0,
    # its scores 0 and its output exactly 0, so every input gives the same logits. A trained
    # (non-zero) CLS token is the case worth testing.
    params = dict(variables["params"])
    params["cls"] = jax.random.normal(jax.random.PRNGKey(99), params["cls"].shape)
    variables = {**variables, "params": params}
  return variables


# Every registry variant, and linear attention in the primal form the ListOps config uses.
PADDING_CASES = [
  *((name, {}) for name in sorted(ATTENTION_REGISTRY)),
  ("linear", {"form": "primal"}),
]


@pytest.mark.parametrize(
  "index, attention, options",
  [(i, name, options) for i, (name, options) in enumerate(PADDING_CASES)],
)
def test_padded_tokens_do_not_change_logits(index, attention, options):
  pooling = ("cls", "mean")[index % 2]  # both poolings, alternating over the variants
  vocab, valid = listops_data.VOCAB_SIZE, VALID_LENGTH
  rng = np.random.default_rng(index)
  tokens = rng.integers(2, vocab, size=PADDED_LENGTH)
  tokens[valid:] = listops_data.PAD_ID
  other_padding = tokens.copy()
  other_padding[valid:] = rng.integers(0, vocab, size=PADDED_LENGTH - valid)
  changed_valid = tokens.copy()
  changed_valid[valid - 2] = 2 + (changed_valid[valid - 2] - 1) % (vocab - 2)  # another token
  batch = jnp.asarray(np.stack([tokens, other_padding, changed_valid]), jnp.int32)
  mask = jnp.broadcast_to(jnp.arange(PADDED_LENGTH) < valid, batch.shape)
  model = _tiny_model(attention, pooling, options)
  logits = jax.jit(lambda v, x, m: model.apply(v, x, mask=m))(
    _shared_variables(pooling), batch, mask
  )
  logits = np.asarray(logits)
  assert np.all(np.isfinite(logits))
  np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)
  assert not np.allclose(logits[2], logits[0], atol=1e-5)  # a valid token does matter


def test_model_summary_parameters_and_flops():
  summaries = {
    a: listops_study.model_summary(load(f"setting=pytorch,preset=short,attention={a}"))
    for a in ("softmax", "linear", "bn", "sh")
  }
  assert summaries["softmax"]["sequence_length"] == listops_data.PRESETS["short"]["max_length"]
  # No variant adds parameters to softmax attention.
  assert len({s["parameters"] for s in summaries.values()}) == 1
  assert summaries["softmax"]["attention_flops_relative"] == 1.0
  assert summaries["sh"]["attention_flops"] < summaries["softmax"]["attention_flops"]
  assert summaries["linear"]["attention_flops"] < summaries["sh"]["attention_flops"]  # primal
  lra = listops_study.model_summary(load("setting=jax_lra,preset=full,attention=sh"))
  assert lra["sequence_length"] == listops_data.PRESETS["full"]["max_length"] + 1  # CLS
  # The configured ratios reach the count: cost ≈ (1/H) Σ 1/r_h, up to ceil and the CLS key.
  ratios = load("setting=jax_lra,attention=sh").model.attention_options.ratios
  assert abs(lra["attention_flops_relative"] - attention_cost_ratio(ratios)) < 0.01


@pytest.mark.slow
def test_reproduce_quick_trains_evaluates_and_reports(tmp_path, capsys):
  results = tmp_path / "out" / "listops.json"
  argv = [
    "--quick",
    f"--root={tmp_path / 'runs'}",
    f"--results={results}",
    f"--data_dir={tmp_path / 'tfds'}",
  ]
  assert grid.reproduce(listops_study.REPRODUCTION, argv) == 0
  records = json.loads(results.read_text())
  assert [r["attention"] for r in records] == ["softmax", "sh"]
  for record in records:
    listops_study.validate_record(record)
    metrics = record["metrics"]
    assert metrics["step"] == 4 and record["steps"] == 4 and record["preset"] == "tiny"
    for key in ("validation/accuracy", "test/accuracy", "selected/test_accuracy"):
      assert 0.0 <= metrics[key] <= 1.0
    assert record["test_accuracy"] == metrics["test/accuracy"]
    assert os.path.isdir(tmp_path / "runs" / record["name"] / "checkpoints")
  assert records[1]["attention_flops"] < records[0]["attention_flops"]
  markdown = results.with_suffix(".md").read_text()
  assert "| softmax |" in markdown and "| sh |" in markdown
  assert listops_study.REFERENCE_HEADER in markdown and "Full-scale commands" in markdown
  assert "37.10" in markdown  # the PyTorch-lineage reference sits in the softmax row
  # A second invocation reuses the finished runs instead of training again.
  capsys.readouterr()
  assert grid.reproduce(listops_study.REPRODUCTION, argv) == 0
  assert capsys.readouterr().out.count("finished earlier, reusing") == 2
