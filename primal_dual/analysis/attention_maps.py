"""Per-layer, full-width attention maps of a trained model, and the 'redundancy' analysis.

A model is applied with ``sow_weights=True, mutable=['intermediates']``; every attention layer sows
``intermediates/.../attention/attention_weights`` as a 1-tuple holding either an array
``[B, H, q, kv]`` or, for Attention-SH kernels, a tuple of per-ratio-group arrays
``[B, heads_in_group, q, pooled_len]`` in the order of
:func:`primal_dual.kernels.scaled_head.head_groups`. :func:`collect_layer_maps` turns these into one
full-width ``[B, H, q, N]`` array per layer: pooled columns are spread back over the keys of their
window (:func:`primal_dual.analysis.redundancy.expand_by_window`), 1-D with the key padding mask
for sequences, 2-D over the patch grid for ViT, prefix tokens (CLS) kept as their own column.

:func:`run_redundancy` is the registered 'redundancy' analysis
(``primal_dual.analysis.ANALYSES``): head distance per layer over an evaluation split (definition:
:mod:`primal_dual.analysis.redundancy`), one example's maps saved as ``.npz`` and plotted.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Iterator, Mapping, Sequence

import flax
import jax
import numpy as np

from primal_dual.analysis import redundancy
from primal_dual.kernels import scaled_head

WEIGHTS_NAME = "attention_weights"
EXAMPLE_MAPS_FILE = "attention_maps_example.npz"
EXAMPLE_PLOT_FILE = "attention_maps.png"
# Budget for the maps one analysis batch holds (layers × batch × H × q × kv float32 elements,
# about 256 MB): long series get small batches instead of running out of memory.
MAX_MAP_ELEMENTS = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class TokenLayout:
  """How a model's tokens sit on the key axis (what SH pooled over).

  Attributes:
    num_prefix_tokens: leading tokens never pooled (CLS), each its own column.
    grid_shape: ``(gh, gw)`` of an image patch grid pooled 2-D, or None for 1-D sequences.
  """

  num_prefix_tokens: int = 0
  grid_shape: tuple[int, int] | None = None


def _encoder_layout(model, inputs) -> TokenLayout:
  del inputs
  return TokenLayout(num_prefix_tokens=int(getattr(model, "pooling", "") == "cls"))


def _vit_layout(model, inputs) -> TokenLayout:
  height, width = np.shape(inputs)[1:3]
  return TokenLayout(
    num_prefix_tokens=1, grid_shape=(height // model.patch_size, width // model.patch_size)
  )


# Model class name → its token layout; models not listed have plain 1-D sequences, no prefix.
LAYOUTS: dict[str, Callable[[Any, np.ndarray], TokenLayout]] = {
  "EncoderClassifier": _encoder_layout,
  "ViT": _vit_layout,
}


def token_layout(model, inputs) -> TokenLayout:
  """The :class:`TokenLayout` of ``model`` on ``inputs`` (see ``LAYOUTS``)."""
  return LAYOUTS.get(type(model).__name__, lambda m, x: TokenLayout())(model, inputs)


def token_validity(
  mask: np.ndarray | None, batch: int, num_tokens: int, layout: TokenLayout
) -> np.ndarray:
  """bool ``[batch, num_tokens]``: prefix tokens valid, then the input mask (None = all valid)."""
  if mask is None:
    return np.ones((batch, num_tokens), bool)
  mask = np.asarray(mask, bool)
  prefix = np.ones((batch, layout.num_prefix_tokens), bool)
  valid = np.concatenate([prefix, mask], axis=1)
  if valid.shape != (batch, num_tokens):
    raise ValueError(
      f"mask {mask.shape} with {layout.num_prefix_tokens} prefix tokens does not "
      f"match the attention maps' {num_tokens} keys"
    )
  return valid


def window_of_key(kv_len: int, ratio: int, layout: TokenLayout) -> np.ndarray:
  """int ``[kv_len]``: the pooled column of every key under SH ratio ``ratio``."""
  windows = scaled_head.key_windows(kv_len, ratio, layout.grid_shape, layout.num_prefix_tokens)
  out = np.full(kv_len, -1, np.int64)
  window, slot = np.nonzero(windows.real)
  out[windows.index[window, slot]] = window
  if (out < 0).any():
    raise ValueError(f"SH windows of ratio {ratio} do not cover all {kv_len} keys")
  return out


def full_width(
  sown: Any, ratios: Sequence[int] | None, kv_len: int, layout: TokenLayout, key_valid: np.ndarray
) -> np.ndarray:
  """One layer's sown weights as float64 ``[B, H, q, kv_len]``.

  Args:
    sown: an array ``[B, H, q, kv]`` or a tuple of SH group arrays ``[B, h_g, q, pooled_len]``.
    ratios: the SH ratios (needed for a tuple).
    kv_len: N, the unpooled key count.
    layout: prefix tokens and grid of the keys.
    key_valid: bool ``[B, kv_len]``.
  """
  if not isinstance(sown, (tuple, list)):
    return np.asarray(sown, np.float64)
  if ratios is None:
    raise ValueError(
      "the attention weights come in SH groups, but the model's attention_options "
      "have no 'ratios' to map them to heads"
    )
  groups = scaled_head.head_groups(tuple(int(r) for r in ratios))
  if len(groups) != len(sown):
    raise ValueError(
      f"{len(sown)} weight groups sown but ratios {tuple(ratios)} give {len(groups)} groups"
    )
  first = np.asarray(sown[0])
  out = np.zeros((first.shape[0], len(ratios), first.shape[2], kv_len))
  for (ratio, heads), weights in zip(groups, sown):
    weights = np.asarray(weights, np.float64)
    if ratio > 1:
      weights = redundancy.expand_by_window(
        weights, window_of_key(kv_len, ratio, layout), key_valid
      )
    out[:, list(heads)] = weights
  return out


def _layer_order(path: tuple[str, ...]) -> tuple:
  """Sort key: numbers in module names compared as numbers (block_10 after block_9)."""
  return tuple(
    tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", part)) for part in path
  )


def sown_weights(intermediates: Mapping[str, Any]) -> list[tuple[tuple[str, ...], Any]]:
  """``(module path, sown value)`` of every attention layer, in layer order."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(intermediates))
  found = [
    (path[:-1], value[0]) for path, value in flat.items() if path and path[-1] == WEIGHTS_NAME
  ]
  return sorted(found, key=lambda item: _layer_order(item[0]))


def make_sow_apply(model) -> Callable:
  """A jitted ``(variables, inputs, mask) -> intermediates`` of ``model`` in evaluation mode."""

  def apply(variables, inputs, mask):
    _, state = model.apply(
      variables, inputs, mask=mask, train=False, sow_weights=True, mutable=["intermediates"]
    )
    return state["intermediates"]

  return jax.jit(apply)


def num_keys(layout: TokenLayout, inputs) -> int:
  """N: prefix tokens plus the grid's patches or the sequence length of ``inputs``."""
  body = (
    int(np.prod(layout.grid_shape)) if layout.grid_shape is not None else int(np.shape(inputs)[1])
  )
  return layout.num_prefix_tokens + body


def collect_layer_maps(
  model,
  variables: Mapping[str, Any],
  inputs: np.ndarray,
  mask: np.ndarray | None = None,
  *,
  apply_fn: Callable | None = None,
) -> tuple[list[np.ndarray], np.ndarray]:
  """Full-width attention maps of every layer of ``model`` on one batch.

  Args:
    model: a Linen model accepting ``(inputs, mask=..., train=False, sow_weights=True)``.
    variables: its variables (``params``, and ``batch_stats`` if any).
    inputs: one batch of inputs. mask: bool ``[B, T]`` padding mask or None.
    apply_fn: ``make_sow_apply(model)``, to reuse one compiled function over batches.

  Returns:
    (one float64 ``[B, H, q, N]`` array per layer, bool ``[B, N]`` token validity). The list is
    empty when no layer sows weights (primal-form kernels never form them).
  """
  apply_fn = apply_fn or make_sow_apply(model)
  layers = sown_weights(jax.device_get(apply_fn(variables, inputs, mask)))
  layout = token_layout(model, inputs)
  kv_len = num_keys(layout, inputs)
  valid = token_validity(mask, np.shape(inputs)[0], kv_len, layout)
  ratios = dict(getattr(model, "attention_options", {}) or {}).get("ratios")
  maps = [full_width(value, ratios, kv_len, layout, valid) for _, value in layers]
  for (path, _), weights in zip(layers, maps):
    if weights.shape[-1] != kv_len:
      raise ValueError(
        f"attention weights of {'/'.join(path)} have {weights.shape[-1]} keys; "
        f"expected {kv_len} from the model's token layout {layout}"
      )
  return maps, valid


def map_elements_per_example(
  apply_fn: Callable, variables: Mapping[str, Any], record: Mapping[str, np.ndarray]
) -> int:
  """Elements of one example's full-width maps over all layers (shapes only, nothing runs)."""
  inputs = np.asarray(record["inputs"])[None]
  mask = None if "mask" not in record else np.asarray(record["mask"])[None]
  shapes = sown_weights(jax.eval_shape(apply_fn, variables, inputs, mask))
  total = 0
  for _, value in shapes:
    groups = value if isinstance(value, (tuple, list)) else (value,)
    heads = sum(g.shape[1] for g in groups)
    q_len = groups[0].shape[2]
    total += heads * q_len * q_len  # self-attention: full width N = q_len
  return total


class _Prefix:
  """The first ``size`` records of a random-access source."""

  def __init__(self, source, size: int):
    self._source, self._size = source, min(size, len(source))

  def __len__(self) -> int:
    return self._size

  def __getitem__(self, index: int):
    if not 0 <= index < self._size:
      raise IndexError(index)
    return self._source[index]


def analysis_batch_size(elements_per_example: int, cap: int) -> int:
  """Examples per batch so that the maps of all layers stay under ``MAX_MAP_ELEMENTS``."""
  return int(max(1, min(cap, MAX_MAP_ELEMENTS // max(elements_per_example, 1))))


def iterate_valid_batches(source, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """Batches of ``source`` (all examples once, fixed shape for one compile) with ``valid``."""
  from primal_dual.data import pipeline

  return pipeline.iterate_eval(source, batch_size, process_index=0, process_count=1)


def redundancy_of_split(
  model,
  variables: Mapping[str, Any],
  source,
  *,
  max_batch_size: int = 16,
  max_examples: int | None = None,
) -> dict[str, Any]:
  """Head distances over (the first ``max_examples`` of) ``source`` and example 0's maps.

  Returns:
    ``{'head_distance_per_layer', 'head_distance', 'num_examples', 'example'}`` where
    ``example`` is ``{'maps': [H, q, N] per layer, cropped to the valid tokens, 'valid_length'}``
    (None when no weights were sown; then the distances are None too).
  """
  if max_examples is not None and max_examples > 0:
    source = _Prefix(source, max_examples)
  apply_fn = make_sow_apply(model)
  batch_size = analysis_batch_size(
    map_elements_per_example(apply_fn, variables, source[0]), min(max_batch_size, len(source))
  )
  accumulator = redundancy.RedundancyAccumulator()
  example = None
  for batch in iterate_valid_batches(source, batch_size):
    maps, valid_tokens = collect_layer_maps(
      model, variables, batch["inputs"], batch.get("mask"), apply_fn=apply_fn
    )
    if not maps:
      return {
        "head_distance_per_layer": [],
        "head_distance": None,
        "num_examples": 0,
        "example": None,
      }
    rows = np.asarray(batch["valid"], bool)
    accumulator.add([m[rows] for m in maps], valid_tokens[rows])
    if example is None:
      length = int(valid_tokens[0].sum())
      keep = np.nonzero(valid_tokens[0])[0]
      example = {"maps": [m[0][:, keep][:, :, keep] for m in maps], "valid_length": length}
  summary = accumulator.summary()
  return {
    "head_distance_per_layer": summary["per_layer"],
    "head_distance": summary["mean"],
    "num_examples": summary["num_examples"],
    "example": example,
  }


def save_example_maps(path: str, maps: Sequence[np.ndarray]) -> None:
  """Writes one example's per-layer maps ``[H, q, N]`` as ``layer_0``, ``layer_1``, ... (npz)."""
  np.savez_compressed(path, **{f"layer_{i}": np.asarray(m, np.float32) for i, m in enumerate(maps)})


def load_example_maps(path: str) -> list[np.ndarray]:
  """The per-layer maps written by :func:`save_example_maps`, in layer order."""
  with np.load(path) as data:
    return [data[f"layer_{i}"] for i in range(len(data.files))]


def _host_variables(state) -> dict[str, Any]:
  from primal_dual.training import steps

  return jax.device_get(steps.model_variables(state.params, state.batch_stats))


def run_redundancy(
  program,
  state,
  *,
  split: str = "test",
  max_examples: int | None = None,
  out_dir: str | None = None,
) -> dict[str, Any]:
  """The 'redundancy' analysis: head distance per layer of ``state``'s model on ``split``.

  Args:
    program: ``setup.build_program``'s Program (model, splits, config).
    state: the restored TrainState.
    split: evaluation split. max_examples: cap (first examples in order); None or ≤ 0 = all.
    out_dir: where ``attention_maps_example.npz`` and ``attention_maps.png`` (example 0, heads ×
      layers) go; None writes nothing.

  Returns:
    JSON-able ``{'split', 'step', 'attention', 'num_examples', 'head_distance_per_layer',
    'head_distance', 'files'}``; distances are None (with a ``note``) for kernels that never form
    the weights.

  Raises:
    ValueError: unknown split.
  """
  if split not in program.splits:
    raise ValueError(
      f"unknown split {split!r} for the redundancy analysis; the task has {sorted(program.splits)}"
    )
  result = redundancy_of_split(
    program.model,
    _host_variables(state),
    program.splits[split],
    max_batch_size=program.eval_batch_size,
    max_examples=max_examples,
  )
  attention = program.config.model.get("attention", "")
  report = {
    "split": split,
    "step": int(jax.device_get(state.step)),
    "attention": attention,
    "num_examples": result["num_examples"],
    "head_distance_per_layer": result["head_distance_per_layer"],
    "head_distance": result["head_distance"],
    "files": {},
  }
  if result["example"] is None:
    report["note"] = (
      f"attention {attention!r} sows no attention weights (a primal form never "
      "forms them), so head distances are undefined"
    )
    return report
  if out_dir:
    from primal_dual.analysis import plots

    os.makedirs(out_dir, exist_ok=True)
    maps_path = os.path.join(out_dir, EXAMPLE_MAPS_FILE)
    save_example_maps(maps_path, result["example"]["maps"])
    plot_path = plots.plot_attention_grid(
      {attention: result["example"]["maps"]},
      os.path.join(out_dir, EXAMPLE_PLOT_FILE),
      title=f"{split} example 0, step {report['step']}",
    )
    report["files"] = {"example_maps": maps_path, "plot": plot_path}
  return report
