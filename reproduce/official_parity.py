"""Our sRAVEN `paper` model against the official code's, number by number, on the CPU.

docs/reproduction.md compares the two setups line by line; this measures it. From a checkout of
smonsays/hypernetwork-attention (see reproduce/official_sraven.py) it checks:

* **forward**: their initial parameters, renamed into ours (`to_our_params`), give the same logits
  on the same problems, with dropout off, for HYLA, softmax and linear attention;
* **dropout**: with attention dropout 0.1, the logits' mean and standard deviation over many
  dropout draws agree (the masks come from different random streams, so only in distribution);
* **initialisation**: each parameter's mean and standard deviation over many initialisations;
* **optimizer**: their AdamW chain and ours (`training.optim.make_optimizer` of the preset) from
  the same parameters under the same random gradients, and both learning-rate schedules.

    python -m reproduce.official_parity --official=workdirs/official \\
        --results=results/paper/official_parity.json

writes the figures as JSON and Markdown. The problems' distribution (the data generator) is
compared by reading, in docs/reproduction.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from reproduce import official_sraven

NUM_LAYERS = 4
NUM_FEATURES = 4  # one query token per feature of the answer panel, after 8 context panels
NUM_VALUES = 8


def to_our_params(theirs: Mapping[str, Any], num_layers: int = NUM_LAYERS) -> dict[str, Any]:
  """Their parameter tree (`CausalTransformer`'s `params`) with our `SequenceTransformer` names.

  Shapes agree leaf for leaf (q/k/v kernels `[d, heads, head size]`, position tables
  `[heads, buckets]`), so the renaming is the whole conversion.
  """
  ours = {
    "input_projection": theirs["embedding"],
    "final_norm": theirs["decoder_norm"],
    "readout": theirs["logitdense"],
  }
  for layer in range(num_layers):
    block = theirs[f"transformer_block_{layer}"]
    ours[f"block_{layer}"] = {
      "LayerNorm_0": block["norm1"],
      "LayerNorm_1": block["norm2"],
      "attention": block["sequence_mixer"],
      "mlp": block["state_mixer"],
    }
    ours[f"relative_bias_{layer}"] = {"table": block["relative_embedding"]["rel_embedding"]}
  return ours


def problems(count: int, seed: int = 0):
  """Random one-hot context tokens and all-zero query tokens, float32 `[count, 36, 8]`."""
  import jax.numpy as jnp

  from primal_dual.tasks import sraven

  values = np.random.default_rng(seed).integers(0, NUM_VALUES, (count, 8 * NUM_FEATURES))
  queries = np.full((count, NUM_FEATURES), -1)  # −1: an all-zero token
  tokens = np.concatenate([values, queries], axis=1)
  return jnp.asarray(sraven.decode_tokens(tokens, NUM_VALUES))


def their_config(official, attention: str = "hyla"):
  """Their `configs/raven.py` config of the sRAVEN setup for one of our attention variants."""
  flags = ["--official=-", "--out=-", f"--model={attention}"]
  return official_sraven.official_config(official, official_sraven.parse(flags))


def our_config(attention: str = "hyla"):
  """Our `paper` preset for one attention variant."""
  from primal_dual.configs import sraven as sraven_configs

  return sraven_configs.get_config(f"preset=paper,attention={attention}")


def models(official, attention: str, attention_dropout: float | None = None):
  """(their model, our model) of the sRAVEN paper setup for one attention variant."""
  from primal_dual.tasks import sraven as sraven_task

  config = their_config(official, attention)
  if attention_dropout is not None:
    config.model.attention_dropout_rate = attention_dropout
  ours = sraven_task.build_model(our_config(attention), {"num_values": NUM_VALUES})
  return official_sraven.official_model(official, config), ours


def their_init(model, inputs, seed: int):
  import jax

  keys = {"params": jax.random.PRNGKey(seed), "dropout": jax.random.PRNGKey(seed + 1)}
  return model.init(keys, inputs, deterministic=True)["params"]


def forward_check(official, attention: str) -> dict[str, float]:
  """Largest |their logits − ours| at their initial parameters, dropout off."""
  import jax.numpy as jnp

  theirs, ours = models(official, attention)
  inputs = problems(8)
  params = their_init(theirs, inputs, seed=0)
  their_logits = theirs.apply({"params": params}, inputs, deterministic=True)
  our_logits = ours.apply({"params": to_our_params(params)}, inputs)
  return {
    "max_abs_difference": float(jnp.max(jnp.abs(their_logits - our_logits))),
    "max_abs_logit": float(jnp.max(jnp.abs(their_logits))),
  }


def dropout_check(official, attention: str, draws: int) -> dict[str, float]:
  """The answer logits' mean and std over `draws` dropout masks (rate 0.1), theirs and ours."""
  import jax

  theirs, ours = models(official, attention, attention_dropout=0.1)
  inputs = problems(8)
  params = their_init(theirs, inputs, seed=0)
  our_params = to_our_params(params)

  def their_logits(key):
    return theirs.apply({"params": params}, inputs, deterministic=False, rngs={"dropout": key})[
      :, -NUM_FEATURES:
    ]

  def our_logits(key):
    return ours.apply({"params": our_params}, inputs, train=True, rngs={"dropout": key})[
      :, -NUM_FEATURES:
    ]

  keys = jax.random.split(jax.random.PRNGKey(5), draws)
  a = np.asarray(jax.jit(jax.vmap(their_logits))(keys), np.float64)
  b = np.asarray(jax.jit(jax.vmap(our_logits))(keys), np.float64)
  deterministic = np.asarray(
    theirs.apply({"params": params}, inputs, deterministic=True)[:, -NUM_FEATURES:]
  )
  standard_error = np.sqrt((a.var(0) + b.var(0)) / draws)
  z = np.abs(a.mean(0) - b.mean(0)) / standard_error
  return {
    "draws": draws,
    # For two equal distributions |z| is half-normal: median 0.674, 99th percentile 2.58.
    "median_abs_z_of_means": float(np.median(z)),
    "share_abs_z_above_2.58": float(np.mean(z > 2.58)),
    "median_std_ratio": float(np.median(a.std(0) / b.std(0))),
    "mean_std": float(a.std(0).mean()),
    "mean_shift_from_no_dropout": float(np.abs(a.mean(0) - deterministic).mean()),
  }


def initialisation_check(official, inits: int) -> dict[str, float]:
  """Per parameter, the std over `inits` initialisations: the largest relative difference."""
  import flax.linen as nn
  import jax

  theirs, ours = models(official, "hyla")
  inputs = problems(1)
  their_trees = [to_our_params(their_init(theirs, inputs, seed)) for seed in range(inits)]
  our_trees = [nn.unbox(ours.init(jax.random.key(seed), inputs))["params"] for seed in range(inits)]
  leaves_a = [np.stack(leaves) for leaves in zip(*map(jax.tree_util.tree_leaves, their_trees))]
  leaves_b = [np.stack(leaves) for leaves in zip(*map(jax.tree_util.tree_leaves, our_trees))]
  worst, constant_equal = 0.0, True
  for a, b in zip(leaves_a, leaves_b):
    if a.std() == 0 or b.std() == 0:  # LayerNorm scales, zero biases: equal constants
      constant_equal &= bool(np.array_equal(a, b))
      continue
    worst = max(worst, abs(a.std() / b.std() - 1))
  return {
    "initialisations": inits,
    "max_relative_std_difference": float(worst),
    "constants_equal": constant_equal,
  }


def optimizer_check(official, steps: int) -> dict[str, float]:
  """Their AdamW and ours, each built from its own config, from the same parameters under the
  same random gradients, over our preset's total steps (theirs: num_train / batch, the same)."""
  import jax.numpy as jnp
  import optax

  from primal_dual.training import optim

  config, theirs_config = our_config(), their_config(official)
  total = config.num_train_steps
  theirs = official_sraven.official_optimizer(theirs_config, total)
  ours, our_schedule = optim.make_optimizer(config.optimizer, total)
  their_schedule = official_sraven.official_schedule(theirs_config, total)
  probe = [0, 1, 500, 1000, 50_000, 100_000, 155_000, 155_250, 156_249]
  schedule_difference = max(abs(float(our_schedule(s)) - float(their_schedule(s))) for s in probe)
  rng = np.random.default_rng(0)
  shapes = {"kernel": (16, 8, 4), "table": (16, 36), "bias": (8,), "scale": (16,)}
  start = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  ours_state, theirs_state = ours.init(start), theirs.init(start)
  ours_params = theirs_params = start
  for _ in range(steps):
    grads = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    update, ours_state = ours.update(grads, ours_state, ours_params)
    ours_params = optax.apply_updates(ours_params, update)
    update, theirs_state = theirs.update(grads, theirs_state, theirs_params)
    theirs_params = optax.apply_updates(theirs_params, update)
  return {
    "steps": steps,
    "max_abs_parameter_difference": max(
      float(jnp.max(jnp.abs(ours_params[k] - theirs_params[k]))) for k in shapes
    ),
    "max_abs_parameter_change": max(
      float(jnp.max(jnp.abs(theirs_params[k] - start[k]))) for k in shapes
    ),
    "max_abs_schedule_difference": schedule_difference,
  }


def report(figures: Mapping[str, Any], command: str) -> str:
  forward = figures["forward"]
  dropout = figures["dropout"]
  init = figures["initialisation"]
  opt = figures["optimizer"]
  lines = [
    "# The official HYLA code against ours, on the sRAVEN paper setup\n",
    f"Measured by `{command}` (CPU; {figures['environment']}). Their code: "
    f"{figures['official']}. What each row checks: reproduce/official_parity.py.\n",
    "| check | attention | figure |",
    "|---|---|---|",
  ]
  for attention, row in forward.items():
    lines.append(
      f"| logits at their initial parameters, dropout off | {attention} | max abs difference "
      f"{row['max_abs_difference']:.2e} (logits up to {row['max_abs_logit']:.2f}) |"
    )
  for attention, row in dropout.items():
    lines.append(
      f"| attention dropout 0.1, {row['draws']} masks each | {attention} | means: median \\|z\\| "
      f"{row['median_abs_z_of_means']:.3f} (0.674 if equal), "
      f"{100 * row['share_abs_z_above_2.58']:.1f}% above 2.58 (1% if equal); std ratio "
      f"{row['median_std_ratio']:.4f}; dropout moves the logits by "
      f"{row['mean_shift_from_no_dropout']:.3f} on average (std {row['mean_std']:.3f}) |"
    )
  lines.append(
    f"| initialisation, {init['initialisations']} draws | hyla | largest relative difference of a "
    f"parameter's std {100 * init['max_relative_std_difference']:.1f}%; constants equal: "
    f"{init['constants_equal']} |"
  )
  lines.append(
    f"| AdamW, {opt['steps']} steps of random gradients | – | max abs parameter difference "
    f"{opt['max_abs_parameter_difference']:.2e} (parameters moved up to "
    f"{opt['max_abs_parameter_change']:.2f}); schedules differ by at most "
    f"{opt['max_abs_schedule_difference']:.2e} |"
  )
  return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--official", type=Path, required=True, help="checkout of their code")
  parser.add_argument("--results", type=Path, required=True, help="figures (JSON); .md beside")
  parser.add_argument("--dropout_draws", type=int, default=2000)
  parser.add_argument("--inits", type=int, default=20)
  parser.add_argument("--optimizer_steps", type=int, default=2000)
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse(argv)
  official = official_sraven.import_official(args.official.resolve())
  import flax
  import jax

  figures = {
    "official": official_sraven.checkout_description(args.official),
    "environment": f"jax {jax.__version__}, flax {flax.__version__}",
    "forward": {
      attention: forward_check(official, attention) for attention in official_sraven.MODELS
    },
    "dropout": {a: dropout_check(official, a, args.dropout_draws) for a in ("hyla", "softmax")},
    "initialisation": initialisation_check(official, args.inits),
    "optimizer": optimizer_check(official, args.optimizer_steps),
  }
  args.results.parent.mkdir(parents=True, exist_ok=True)
  args.results.write_text(json.dumps(figures, indent=2) + "\n")
  command = "python -m reproduce.official_parity " + " ".join(
    argv if argv is not None else sys.argv[1:]
  )
  markdown = report(figures, command)
  args.results.with_suffix(".md").write_text(markdown)
  print(markdown)
  return 0


if __name__ == "__main__":
  sys.exit(main())
