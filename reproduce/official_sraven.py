"""Train the official code of "Attention as a Hypernetwork" on sRAVEN, as its `run.py` would.

The decisive check of a reproduction is the authors' own code at its own defaults on the same
machine. Their `run.py` imports TensorFlow (for its WikiText task) and wandb, neither of which a
lent accelerator has, and logs only to text. This driver imports the rest of their code from a
checkout (not part of this repository) and builds what `run.py` builds for
`configs/raven.py:raven_3x3_4features;<model>`: the data loaders from the seed, the loss, the
model from `config.model`, AdamW with the warm-up-cosine schedule to `0.1 × lr`, and their
`Experiment` loop, unchanged. Their metrics go to JSON lines (one object per log or evaluation:
`step`, then `train_*`, `test_*`, `ood_*` fields as their `Experiment.log` names them;
`ood_acc` is the whole-panel accuracy on the held-out rule combinations).

    git clone https://github.com/smonsays/hypernetwork-attention official   # commit 2bef94c/af9805f
    pip install chex einops        # their imports beyond jax, flax, optax, ml_collections
    python -m reproduce.official_sraven --official=official --seed=0 --out=official_s0.jsonl

Options that are not their defaults are named: `--attention_dropout` sets the field
`TransformerConfig.attention_dropout_rate` (their config never sets it, so it stays at the
dataclass's 0.1); `--num_train`, `--num_eval` and `--warmup_steps` shrink the run for a smoke
test. Nothing here changes their computation.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# `run.py`'s model argument of the config name: our variant names → theirs.
MODELS = {"hyla": "linear_hypatt", "softmax": "transformer", "linear_plain": "linear_transformer"}


class JsonLinesLogger:
  """Their `Logger` interface (`log(step, metrics)`), written as one JSON object per call."""

  def __init__(self, path: Path):
    self.path = path
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.started = time.time()

  def log(self, step: int, metrics: Mapping[str, Any]) -> None:
    row = {"step": int(step), "wall_time_s": round(time.time() - self.started, 1)}
    for name, value in metrics.items():
      try:
        row[name] = float(value)
      except (TypeError, ValueError):  # a non-scalar (e.g. a callback's array) is not a metric
        continue
    with self.path.open("a") as stream:
      stream.write(json.dumps(row) + "\n")
    if any(name.startswith(("test_", "ood_")) for name in row):
      print(json.dumps(row), flush=True)


def import_official(checkout: Path) -> types.SimpleNamespace:
  """Their modules, imported from `checkout`; wandb (imported by `hyla.logging` at the top,
  used only by its `WandbLogger`) is replaced by an empty module when it is not installed."""
  if not (checkout / "hyla" / "experiment.py").is_file():
    raise SystemExit(
      f"error: {checkout} is not a checkout of smonsays/hypernetwork-attention; clone it and "
      "pass its path as --official"
    )
  sys.path.insert(0, str(checkout))
  try:
    importlib.import_module("wandb")
  except ImportError:
    sys.modules["wandb"] = types.ModuleType("wandb")
  names = {
    "configs": "configs.raven",
    "raven": "hyla.data.raven",
    "experiment": "hyla.experiment",
    "loss": "hyla.loss",
    "transformer": "hyla.models.transformer",
  }
  return types.SimpleNamespace(**{key: importlib.import_module(m) for key, m in names.items()})


def checkout_description(checkout: Path) -> str:
  """`smonsays/hypernetwork-attention @ <commit>`, or `@ unknown commit` for a checkout without
  its own `.git` (git would otherwise answer for a repository around it, such as this one)."""
  import subprocess

  commit = "unknown commit"
  if (checkout / ".git").exists():
    result = subprocess.run(
      ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    if result.returncode == 0:
      commit = result.stdout.strip()
  return f"smonsays/hypernetwork-attention @ {commit}"


def official_config(official: types.SimpleNamespace, args: argparse.Namespace):
  """`configs/raven.py:raven_3x3_4features;<model>` with the seed and the named options."""
  config = official.configs.get_config(f"raven_3x3_4features;{MODELS[args.model]}")
  config.seed = args.seed
  if args.attention_dropout is not None:
    config.model.attention_dropout_rate = args.attention_dropout
  if args.num_train:
    config.data.num_train = args.num_train
  if args.num_eval:
    config.data.num_test = config.data.num_ood = args.num_eval
  if args.warmup_steps is not None:
    config.warmup_steps = args.warmup_steps
  return config


def official_model(official: types.SimpleNamespace, config):
  """Their `CausalTransformer` of `config.model`, with the raven task's read-out and position
  range as their `run.setup` sets them."""
  fields = {
    **config.model,
    "relative_position_max_dist": config.data.seq_len,
    "output_dim": config.data.feature_maxval,
  }
  return official.transformer.CausalTransformer(official.transformer.TransformerConfig(**fields))


def official_schedule(config, steps: int):
  """Their learning rate: warm-up from 0, then cosine to `0.1 × lr`. Optax's `decay_steps`
  counts the warm-up, so their `steps − warm-up` ends the cosine at `steps − warm-up` and holds
  the end rate for the last `warm-up` steps."""
  import optax

  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.lr,
    warmup_steps=config.warmup_steps,
    decay_steps=steps - config.warmup_steps,
    end_value=0.1 * config.lr,
  )


def official_optimizer(config, steps: int):
  """Their AdamW on `official_schedule`, decaying every parameter with `ndim != 1` (no gradient
  clipping: their raven config has none)."""
  import jax
  import optax

  decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim != 1, params)  # noqa: E731
  return optax.chain(
    getattr(optax, config.optimizer)(
      learning_rate=official_schedule(config, steps),
      weight_decay=config.weight_decay,
      mask=decay_mask if config.mask_weight_decay else None,
    )
  )


def build_experiment(
  official: types.SimpleNamespace, config, logger: JsonLinesLogger, log_every: int, eval_every: int
):
  """What their `run.setup` builds for a raven config."""
  import functools

  data = config.data
  (train_loader, eval_loaders, _), _ = official.raven.create_raven_datasets(
    batch_size=config.batch_size, seed=config.seed, **data
  )
  model = official_model(official, config)
  # Their raven loaders report no num_train, so their steps are len(loader) = num_train / batch.
  optimizer = official_optimizer(config, len(train_loader))
  loss = functools.partial(
    official.loss.SymbolicRavenLoss,
    num_features=data.num_features,
    num_feature_values=data.feature_maxval,
  )
  return official.experiment.Experiment(
    config=config,
    model=model,
    loss=loss,
    optimizer=optimizer,
    train_loader=train_loader,
    eval_loaders=eval_loaders,
    callback_loaders={},
    logger=[logger],
    callbacks=(),
    log_every=log_every,
    eval_every=eval_every,
    log_level=1,
  )


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--official", type=Path, required=True, help="checkout of their code")
  parser.add_argument("--model", choices=sorted(MODELS), default="hyla")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--attention_dropout", type=float, default=None, help="default: theirs")
  parser.add_argument("--num_train", type=int, default=0, help="default: theirs (20,000,000)")
  parser.add_argument("--num_eval", type=int, default=0, help="default: theirs (51,200)")
  parser.add_argument("--warmup_steps", type=int, default=None, help="default: theirs (1000)")
  parser.add_argument("--log_every", type=int, default=1000, help="their run.py's default")
  parser.add_argument("--eval_every", type=int, default=10000, help="their run.py's default")
  parser.add_argument("--out", type=Path, required=True, help="metrics, JSON lines")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  # Runs of a lease share one GPU: without this each process would reserve 75% of its memory.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  args = parse(argv)
  if args.out.exists():
    print(f"error: {args.out} exists; pass a new --out (one file per run)", file=sys.stderr)
    return 2
  checkout = args.official.resolve()
  official = import_official(checkout)
  config = official_config(official, args)
  logger = JsonLinesLogger(args.out)
  experiment = build_experiment(official, config, logger, args.log_every, args.eval_every)

  import jax

  state = experiment.reset(jax.random.PRNGKey(config.seed))
  parameters = jax.flatten_util.ravel_pytree(state.params["params"])[0].size
  logger.log(0, {"num_params": parameters})
  source = checkout_description(checkout)
  print(f"{source}: {args.model}, seed {args.seed}, {parameters:,} parameters", flush=True)
  experiment.run(state)
  return 0


if __name__ == "__main__":
  sys.exit(main())
