"""The driver of the official sRAVEN code (reproduce/official_sraven.py), on a stand-in checkout.

Their code is not part of this repository; the stand-in has its module layout and a config of
the same fields, so what is tested is ours: the checkout check, the wandb stand-in, the named
options on their config, and the JSON-lines logger.
"""

import json
import os
import sys
import textwrap

import pytest

from reproduce import official_sraven

CONFIG = """
import ml_collections as mlc

def get_config(name=""):
    config = mlc.ConfigDict()
    config.name = name
    config.seed = 2024
    config.warmup_steps = 1000
    config.data = mlc.ConfigDict(dict(num_train=20_000_000, num_test=51200, num_ood=51200))
    config.model = mlc.ConfigDict(dict(sequence_mixer=name.split(";")[1], dropout_rate=0.0))
    return config
"""


@pytest.fixture
def checkout(tmp_path, monkeypatch):
  """A stand-in checkout; its modules (and a wandb stand-in) are forgotten afterwards."""
  root = tmp_path / "official"
  files = {
    "configs/raven.py": CONFIG,
    "hyla/experiment.py": "import wandb  # as their hyla.logging does\n",
    "hyla/loss.py": "",
    "hyla/data/raven.py": "",
    "hyla/models/transformer.py": "",
  }
  for name, text in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(textwrap.dedent(text))
  monkeypatch.setattr(sys, "path", list(sys.path))
  before = set(sys.modules)
  yield root
  for name in set(sys.modules) - before:
    del sys.modules[name]


def test_their_config_gets_only_the_named_options(checkout):
  official = official_sraven.import_official(checkout)
  defaults = official_sraven.official_config(
    official, official_sraven.parse(["--official=x", "--seed=3", "--out=y"])
  )
  assert defaults.seed == 3 and defaults.model.sequence_mixer == "linear_hypatt"
  # Their config never sets attention dropout: left unset, the dataclass's 0.1 applies.
  assert "attention_dropout_rate" not in defaults.model and defaults.warmup_steps == 1000
  assert defaults.data.num_train == 20_000_000 and defaults.data.num_ood == 51200
  args = official_sraven.parse(
    "--official=x --model=softmax --attention_dropout=0 --num_train=2560 --num_eval=256 "
    "--warmup_steps=5 --out=y".split()
  )
  smoke = official_sraven.official_config(official, args)
  assert smoke.model.attention_dropout_rate == 0.0 and smoke.model.sequence_mixer == "transformer"
  assert (smoke.data.num_train, smoke.data.num_test, smoke.data.num_ood) == (2560, 256, 256)
  assert smoke.warmup_steps == 5


def test_a_checkout_without_its_own_git_metadata_has_no_commit_even_inside_a_repository(checkout):
  # A repository around the stand-in (as this one is around workdirs/official): `git -C` alone
  # would answer with that repository's commit.
  import subprocess

  identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
  subprocess.run(["git", "init", "-q", str(checkout.parent)], check=True)
  subprocess.run(
    ["git", *identity, "-C", str(checkout.parent), "commit", "-q", "--allow-empty", "-m", "x"],
    check=True,
  )
  description = official_sraven.checkout_description(checkout)
  assert description == "smonsays/hypernetwork-attention @ unknown commit"


def test_a_folder_that_is_not_their_checkout_ends_in_one_line(tmp_path):
  with pytest.raises(SystemExit, match="not a checkout of smonsays/hypernetwork-attention"):
    official_sraven.import_official(tmp_path)


def test_an_existing_metrics_file_is_never_appended_to(tmp_path, capsys, monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  out = tmp_path / "run.jsonl"
  out.write_text('{"step": 0}\n')
  assert official_sraven.main(["--official", str(tmp_path), "--out", str(out)]) == 2
  assert "pass a new --out" in capsys.readouterr().err
  assert out.read_text() == '{"step": 0}\n'
  # Set before their code imports jax: two runs can share a lease's GPU.
  assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_the_logger_writes_one_json_object_per_call_and_drops_non_scalars(tmp_path):
  np = pytest.importorskip("numpy")
  logger = official_sraven.JsonLinesLogger(tmp_path / "logs" / "run.jsonl")
  logger.log(1000, {"train_loss": np.float32(0.5), "train_steps_per_sec": 410})
  logger.log(1000, {"ood_acc": np.asarray(0.25), "callback_latents": np.zeros((2, 3))})
  rows = [json.loads(line) for line in (tmp_path / "logs" / "run.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == [1000, 1000]
  assert rows[0]["train_loss"] == 0.5 and rows[0]["train_steps_per_sec"] == 410.0
  assert rows[1]["ood_acc"] == 0.25 and "callback_latents" not in rows[1]


def test_their_parameter_names_map_onto_our_paper_model_leaf_for_leaf():
  """`to_our_params` of a tree shaped as theirs (every leaf a distinct array) is our sRAVEN
  `paper` model's parameter tree: same structure, same shapes, each leaf used once."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np

  from primal_dual.configs import sraven as sraven_configs
  from primal_dual.tasks import sraven as sraven_task
  from reproduce import official_parity

  def block(layer):
    heads = {"kernel": (128, 16, 4), "bias": (16, 4)}
    return {
      "norm1": {"scale": (128,), "bias": (128,)},
      "norm2": {"scale": (128,), "bias": (128,)},
      "relative_embedding": {"rel_embedding": (16, 36)},
      "sequence_mixer": {
        "query": heads,
        "key": heads,
        "value": heads,
        "out": {"kernel": (16, 4, 128), "bias": (128,)},
      },
      "state_mixer": {
        "Dense_0": {"kernel": (128, 256), "bias": (256,)},
        "Dense_1": {"kernel": (256, 128), "bias": (128,)},
      },
    }

  shapes = {
    "embedding": {"kernel": (8, 128), "bias": (128,)},
    "decoder_norm": {"scale": (128,), "bias": (128,)},
    "logitdense": {"kernel": (128, 8), "bias": (8,)},
    **{f"transformer_block_{i}": block(i) for i in range(4)},
  }
  counter = iter(range(10**6))
  theirs = jax.tree.map(
    lambda shape: np.full(shape, next(counter), np.float32),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )
  mapped = official_parity.to_our_params(theirs)
  model = sraven_task.build_model(
    sraven_configs.get_config("preset=paper,attention=hyla"), {"num_values": 8}
  )
  ours = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 36, 8)))))
  assert jax.tree.structure(mapped) == jax.tree.structure(ours["params"])
  assert jax.tree.map(np.shape, mapped) == jax.tree.map(lambda x: x.shape, ours["params"])
  used = sorted(float(leaf.flat[0]) for leaf in jax.tree.leaves(mapped))
  assert used == sorted(float(leaf.flat[0]) for leaf in jax.tree.leaves(theirs))
  assert len(set(used)) == len(used)  # no leaf of theirs used twice, none dropped


def test_the_parity_report_is_one_table_whose_rows_keep_their_columns():
  from reproduce import official_parity

  dropout = {
    "draws": 10,
    "median_abs_z_of_means": 0.7,
    "share_abs_z_above_2.58": 0.01,
    "median_std_ratio": 1.0,
    "mean_std": 0.5,
    "mean_shift_from_no_dropout": 0.2,
  }
  figures = {
    "official": "smonsays/hypernetwork-attention @ abc1234",
    "environment": "jax x",
    "forward": {"hyla": {"max_abs_difference": 0.0, "max_abs_logit": 3.0}},
    "dropout": {"hyla": dropout},
    "initialisation": {
      "initialisations": 2,
      "max_relative_std_difference": 0.01,
      "constants_equal": True,
    },
    "optimizer": {
      "steps": 3,
      "max_abs_parameter_difference": 0.0,
      "max_abs_parameter_change": 0.1,
      "max_abs_schedule_difference": 0.0,
    },
  }
  rows = [r for r in official_parity.report(figures, "cmd").splitlines() if r.startswith("| ")]
  # A bare '|' inside a cell would split it: every row has the header's three cells.
  assert len(rows) == 5 and all(r.replace("\\|", "").count("|") == 4 for r in rows)
  assert "abc1234" in official_parity.report(figures, "cmd")


def test_the_parity_checks_problems_are_one_hot_context_tokens_and_zero_queries():
  import numpy as np

  from reproduce import official_parity

  tokens = np.asarray(official_parity.problems(3, seed=1))
  assert tokens.shape == (3, 36, 8) and tokens.dtype == np.float32
  np.testing.assert_array_equal(tokens[:, :32].sum(-1), 1.0)
  np.testing.assert_array_equal(tokens[:, 32:], 0.0)
