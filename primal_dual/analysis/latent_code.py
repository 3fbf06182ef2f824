"""Latent-code analysis of sRAVEN models: can a linear decoder read the rule from attention?

HYLA's view of multi-head attention (Schug et al.) is that for a query–key pair ``(i, j)`` the
vector over heads ``a_ij = (a_1ij, …, a_Hij)`` is a *latent code* that configures the value network
applied to key ``j``. If a model solves sRAVEN compositionally, the code of a query that predicts a
feature should say which rule that feature follows.

**Which pairs.** For problem ``b`` and answer slot ``s`` the query is the token at position
``8F + s`` (the query token of slot ``s``). Its feature is ``u = feature_order[b, 2, s]`` (the
underlying feature the answer panel shows in slot ``s``). The keys are the tokens of the same
feature in the two context panels of the third row, which hold the operands the rule is applied
to: panel ``6 + c`` for columns ``c = 0, 1``, slot ``feature_order[b, c].index(u)`` (slots are
shuffled per column), position ``(6 + c)·F + slot``. The code of ``(b, s)`` in layer ``l`` is the
concatenation over the two keys of the head vectors: ``2H`` numbers. Its label is the rule of that
feature, ``rules[b, s]``.

**Which numbers.** The attention weights the kernel actually uses to mix values, read from the
model run with ``sow_weights=True`` (``intermediates/block_l/attention/attention_weights``):
softmax probabilities over keys for softmax attention, ``a_hij`` normalised across heads for HYLA,
the normalised ``Φ(q)ᵀΦ(k)`` weights for linear attention (dual form). Kernels that never form
``[heads, q_len, kv_len]`` weights (random features, the primal form, Attention-SH's pooled maps)
are reported as unavailable rather than approximated.

**Decoder.** A ridge classifier (closed form, NumPy): features standardised with the training
half's statistics, one-vs-rest targets ±1, ``W = (XᵀX + λI)⁻¹XᵀY`` with an unpenalised intercept,
prediction by argmax. Problems (not codes: the ``F`` codes of a problem stay together) are split in
half by a seeded permutation; the decoder is fitted on the first half and scored on the second.
``chance`` is the accuracy of always predicting the training half's most frequent rule.

**Plot.** The codes of every layer projected on their first two principal components, coloured by
rule: ``<out_dir>/latent_code_pca.png``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np

NUM_CONTEXT_PANELS = 8
THIRD_ROW_PANELS = (6, 7)  # the context panels of the third row (columns 0 and 1)
PLOT_FILE = "latent_code_pca.png"
DEFAULT_L2 = 1.0


# ------------------------------------------------------------------------------------------------
# Which query–key pairs carry a rule.


def rule_pair_positions(
  feature_order: np.ndarray, num_features: int
) -> tuple[np.ndarray, np.ndarray]:
  """Token positions of the query of every answer slot and of its feature's third-row operands.

  Args:
    feature_order: int ``[N, 3, F]``: column ``c`` slot ``s`` shows feature ``feature_order[c, s]``.
    num_features: ``F``.

  Returns:
    ``query [N, F]`` (``8F + s``) and ``keys [N, F, 2]`` (``(6 + c)·F + slot``, ``c = 0, 1``).
  """
  feature_order = np.asarray(feature_order)
  if feature_order.ndim != 3 or feature_order.shape[1:] != (3, num_features):
    raise ValueError(f"feature_order must be [N, 3, {num_features}]; got {feature_order.shape}")
  count = feature_order.shape[0]
  answer_features = feature_order[:, 2, :]  # [N, F]
  # slot_in_column[n, c, u]: the slot of column c that shows feature u.
  slot_in_column = np.argsort(feature_order, axis=-1)  # [N, 3, F]
  keys = np.stack(
    [
      panel * num_features + np.take_along_axis(slot_in_column[:, column], answer_features, -1)
      for column, panel in enumerate(THIRD_ROW_PANELS)
    ],
    axis=-1,
  )  # [N, F, 2]
  query = np.broadcast_to(
    NUM_CONTEXT_PANELS * num_features + np.arange(num_features), (count, num_features)
  )
  return np.array(query), keys


def codes_from_weights(weights: np.ndarray, query: np.ndarray, keys: np.ndarray) -> np.ndarray:
  """Head vectors of the chosen pairs, concatenated over keys.

  Args:
    weights: ``[N, H, T, T]`` one layer's attention weights.
    query: int ``[N, F]``. keys: int ``[N, F, K]``.

  Returns:
    float64 ``[N, F, K·H]``: for each (problem, slot) the ``H`` weights of key 0, then key 1, ...
  """
  weights = np.asarray(weights, np.float64)
  rows = np.arange(weights.shape[0])[:, None, None]
  picked = weights[rows, :, query[..., None], keys]  # [N, F, K, H]
  return picked.reshape(*picked.shape[:2], -1)


# ------------------------------------------------------------------------------------------------
# The ridge decoder.


def fit_ridge(
  features: np.ndarray, labels: np.ndarray, num_classes: int, l2: float = DEFAULT_L2
) -> dict[str, np.ndarray]:
  """Closed-form one-vs-rest ridge classifier.

  Args:
    features: ``[M, D]``. labels: int ``[M]`` in ``[0, num_classes)``.
    num_classes: ``K``. l2: ridge penalty λ > 0 (on standardised features; intercept free).

  Returns:
    ``{'mean' [D], 'scale' [D], 'weights' [D, K], 'intercept' [K]}``.
  """
  features = np.asarray(features, np.float64)
  labels = np.asarray(labels)
  if features.ndim != 2 or labels.shape != features.shape[:1]:
    raise ValueError(
      f"features must be [M, D] and labels [M]; got {features.shape}, {labels.shape}"
    )
  if l2 <= 0:
    raise ValueError(f"l2 must be > 0, got {l2}")
  mean = features.mean(axis=0)
  scale = features.std(axis=0)
  scale = np.where(scale > 1e-12, scale, 1.0)  # constant features stay 0 after centring
  x = (features - mean) / scale
  targets = np.where(labels[:, None] == np.arange(num_classes), 1.0, -1.0)
  target_mean = targets.mean(axis=0)
  gram = x.T @ x + l2 * np.eye(x.shape[1])
  weights = np.linalg.solve(gram, x.T @ (targets - target_mean))
  return {"mean": mean, "scale": scale, "weights": weights, "intercept": target_mean}


def predict_ridge(decoder: Mapping[str, np.ndarray], features: np.ndarray) -> np.ndarray:
  """int ``[M]``: the argmax class of a ``fit_ridge`` decoder."""
  x = (np.asarray(features, np.float64) - decoder["mean"]) / decoder["scale"]
  return np.argmax(x @ decoder["weights"] + decoder["intercept"], axis=-1)


def split_problems(
  num_problems: int, train_fraction: float = 0.5, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Disjoint sorted problem indices (train, test) from a seeded permutation."""
  if num_problems < 2:
    raise ValueError(f"need at least 2 problems to fit and score a decoder; got {num_problems}")
  order = np.random.default_rng(seed).permutation(num_problems)
  cut = min(max(int(round(train_fraction * num_problems)), 1), num_problems - 1)
  return np.sort(order[:cut]), np.sort(order[cut:])


def decoding_accuracy(
  codes: np.ndarray,
  labels: np.ndarray,
  num_classes: int,
  *,
  l2: float = DEFAULT_L2,
  train_fraction: float = 0.5,
  seed: int = 0,
) -> dict[str, float]:
  """Fits the decoder on some problems, scores it on the others.

  Args:
    codes: ``[N, F, D]`` (or ``[N, D]``): codes grouped by problem.
    labels: int ``[N, F]`` (or ``[N]``).
    num_classes: number of rules.

  Returns:
    ``{'accuracy', 'chance', 'num_train', 'num_test'}`` (counts of codes).
  """
  codes = np.asarray(codes, np.float64)
  labels = np.asarray(labels)
  if codes.ndim == 2:
    codes, labels = codes[:, None], labels[:, None]
  train, test = split_problems(codes.shape[0], train_fraction, seed)
  x_train, y_train = codes[train].reshape(-1, codes.shape[-1]), labels[train].reshape(-1)
  x_test, y_test = codes[test].reshape(-1, codes.shape[-1]), labels[test].reshape(-1)
  decoder = fit_ridge(x_train, y_train, num_classes, l2)
  majority = np.bincount(y_train, minlength=num_classes).argmax()
  return {
    "accuracy": float(np.mean(predict_ridge(decoder, x_test) == y_test)),
    "chance": float(np.mean(y_test == majority)),
    "num_train": int(y_train.size),
    "num_test": int(y_test.size),
  }


# ------------------------------------------------------------------------------------------------
# Running the model.


def collect_records(source: Any, max_examples: int) -> dict[str, np.ndarray]:
  """The first ``min(max_examples, len(source))`` records of a split, stacked."""
  count = min(int(max_examples), len(source))
  if count < 1:
    raise ValueError(f"max_examples must be >= 1, got {max_examples}")
  indices = list(range(count))
  records = (
    source.__getitems__(indices)
    if hasattr(source, "__getitems__")
    else [source[i] for i in indices]
  )
  return {name: np.stack([np.asarray(r[name]) for r in records]) for name in records[0]}


def sown_attention_weights(intermediates: Mapping[str, Any], num_layers: int) -> list[Any] | None:
  """Per layer, the sown ``attention_weights`` (first sow), or None if a layer sowed nothing."""
  maps = []
  for layer in range(num_layers):
    sown = intermediates.get(f"block_{layer}", {}).get("attention", {}).get("attention_weights")
    if not sown:
      return None
    maps.append(sown[0])
  return maps


# id(model) → (model, jitted apply): one compilation per model even across calls (the model is
# kept alive with its function so that its id is never reused). Linen modules holding dicts are
# not hashable, so they cannot key a cache themselves.
_SOW_APPLY_CACHE: dict[int, tuple[Any, Any]] = {}


def sow_apply(model) -> Any:
  """Jitted ``(variables, inputs) -> intermediates`` with ``sow_weights=True``."""
  if id(model) not in _SOW_APPLY_CACHE:

    def apply(variables, inputs):
      _, state = model.apply(
        variables, inputs, train=False, sow_weights=True, mutable=["intermediates"]
      )
      return state.get("intermediates", {})

    _SOW_APPLY_CACHE[id(model)] = (model, jax.jit(apply))
  return _SOW_APPLY_CACHE[id(model)][1]


def latent_codes(
  program: Any, state: Any, records: Mapping[str, np.ndarray], batch_size: int
) -> tuple[list[np.ndarray] | None, str]:
  """Codes ``[N, F, 2H]`` per layer for the records, or ``(None, reason)`` without weights."""
  from primal_dual.training import sharding
  from primal_dual.training import steps

  model = program.model
  num_layers = model.num_layers
  num_features = records["targets"].shape[-1]
  query, keys = rule_pair_positions(records["feature_order"], num_features)
  variables = steps.model_variables(state.params, state.batch_stats)
  apply = sow_apply(model)
  per_layer: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
  count = len(records["inputs"])
  with sharding.mesh_context(program.mesh):
    for start in range(0, count, batch_size):
      stop = min(start + batch_size, count)
      maps = sown_attention_weights(apply(variables, records["inputs"][start:stop]), num_layers)
      if maps is None:
        return None, (
          f"attention variant {model.attention!r} sows no attention weights "
          "(it never forms the [heads, q_len, kv_len] matrix)"
        )
      for layer, weights in enumerate(maps):
        if (
          not hasattr(weights, "shape")
          or np.ndim(weights) != 4
          or (weights.shape[-1] != weights.shape[-2])
        ):
          return None, (
            f"attention variant {model.attention!r} sows weights that are not one "
            "[batch, heads, T, T] array per layer (pooled or grouped maps)"
          )
        per_layer[layer].append(
          codes_from_weights(
            np.asarray(jax.device_get(weights)), query[start:stop], keys[start:stop]
          )
        )
  return [np.concatenate(chunks) for chunks in per_layer], ""


# ------------------------------------------------------------------------------------------------
# The plot.


def principal_components(codes: np.ndarray, count: int = 2) -> np.ndarray:
  """``[M, count]`` projections of ``codes [M, D]`` on their first principal components."""
  centred = np.asarray(codes, np.float64) - np.mean(codes, axis=0)
  _, _, vt = np.linalg.svd(centred, full_matrices=False)
  components = vt[:count]
  # Fix each component's sign (largest loading positive) so the plot is deterministic.
  signs = np.sign(components[np.arange(len(components)), np.abs(components).argmax(axis=1)])
  projected = centred @ (components * signs[:, None]).T
  if projected.shape[1] < count:  # fewer dimensions than components: pad with zeros
    projected = np.pad(projected, ((0, 0), (0, count - projected.shape[1])))
  return projected


def plot_codes(
  codes_per_layer: Sequence[np.ndarray],
  labels: np.ndarray,
  rule_names: Sequence[str],
  path: str,
  title: str = "",
) -> str:
  """Scatter of each layer's codes on their first two principal components, coloured by rule."""
  from primal_dual.analysis import plots

  plt = plots.pyplot()
  labels = np.asarray(labels).reshape(-1)
  figure, axes = plt.subplots(
    1, len(codes_per_layer), figsize=(4 * len(codes_per_layer), 4), squeeze=False
  )
  colours = plt.get_cmap("tab10")
  for layer, (axis, codes) in enumerate(zip(axes[0], codes_per_layer)):
    projected = principal_components(codes.reshape(-1, codes.shape[-1]))
    for rule, name in enumerate(rule_names):
      chosen = labels == rule
      axis.scatter(
        projected[chosen, 0],
        projected[chosen, 1],
        s=6,
        alpha=0.6,
        color=colours(rule % 10),
        label=name,
      )
    axis.set_title(f"layer {layer}")
    axis.set_xlabel("PC 1")
    axis.set_ylabel("PC 2")
  axes[0][-1].legend(fontsize=7, markerscale=2, loc="best")
  if title:
    figure.suptitle(title)
  figure.tight_layout()
  return plots.save_figure(figure, path, dpi=100, tight_bbox=False)


# ------------------------------------------------------------------------------------------------
# Entry point.


def run(
  program: Any,
  state: Any,
  *,
  split: str = "ood",
  max_examples: int = 1024,
  out_dir: str | None = None,
  l2: float = DEFAULT_L2,
  seed: int = 0,
) -> dict[str, Any]:
  """Decodes rules from latent codes of a trained sRAVEN model (see the module docstring).

  Args:
    program: a ``setup.Program`` of the 'sraven' task.
    state: its ``TrainState`` (e.g. restored from a checkpoint).
    split: the split whose problems are analysed ('ood': held-out rule combinations).
    max_examples: problems used (the first ones of the split); half fit, half score.
    out_dir: where the PCA plot goes (None: no plot).
    l2: ridge penalty. seed: the fit/score split of problems.

  Returns:
    JSON-able: ``{'available': True, 'split', 'num_problems', 'attention', 'rules',
    'per_layer': [{'layer', 'accuracy', 'chance', 'num_train', 'num_test'}], 'all_layers':
    {...} (codes of every layer concatenated), 'best_layer_accuracy', 'plot'}``, or
    ``{'available': False, 'reason': ...}`` for kernels without attention weights.
  """
  from primal_dual.training import errors

  if program.config.task != "sraven":
    raise errors.ConfigError(
      f"the latent_code analysis reads sRAVEN rules; the workdir's task is "
      f"{program.config.task!r}: leave latent_code out of --analyses (redundancy works for "
      "every task)"
    )
  if split not in program.splits:
    raise errors.ConfigError(
      f"unknown split {split!r}; the task has {sorted(program.splits)} (--analysis_split)"
    )
  records = collect_records(program.splits[split], max_examples)
  rule_names = tuple(program.metadata["rules"])
  codes, reason = latent_codes(program, state, records, program.eval_batch_size)
  summary = {
    "split": split,
    "num_problems": int(len(records["inputs"])),
    "attention": program.model.attention,
    "rules": list(rule_names),
  }
  if codes is None:
    return {"available": False, "reason": reason, **summary}
  labels = records["rules"]
  per_layer = [
    {"layer": layer, **decoding_accuracy(layer_codes, labels, len(rule_names), l2=l2, seed=seed)}
    for layer, layer_codes in enumerate(codes)
  ]
  all_layers = decoding_accuracy(
    np.concatenate(codes, axis=-1), labels, len(rule_names), l2=l2, seed=seed
  )
  plot = None
  if out_dir:
    plot = plot_codes(
      codes,
      labels,
      rule_names,
      os.path.join(out_dir, PLOT_FILE),
      title=f"{program.model.attention}: latent codes on {split}",
    )
  return {
    "available": True,
    **summary,
    "per_layer": per_layer,
    "all_layers": all_layers,
    "best_layer_accuracy": max(entry["accuracy"] for entry in per_layer),
    "plot": plot,
  }
