"""Analytic attention FLOPs of a model config, per layer and per variant.

What is counted: the products inside the attention kernel for **one example** of padded length
``N`` (queries and keys), per layer, with a multiply-add counted as 2 FLOPs. The q/k/v/out
projections, the MLP, softmax exponentials, feature maps, BN statistics and SH pooling are left
out: the projections are the same for every variant, and the rest is O(N·D), lower order than the
products below. ``D = H·d`` is the total query/key width (``model_dim``), ``d`` one head's width,
``d_v = d``.

Per layer (``N_h = pooled_length(N, r_h)``, i.e. ``ceil(N/r_h)`` in 1-D; m random features):

* softmax, bn, linear (dual form), linear_bn: ``QK 2·N²·D + AV 2·N²·D = 4·N²·D``;
* linear (``form='primal'``): ``Σ_h 2·N·d·d_v`` for ``S = Σ_j Φ(k_j)v_jᵀ`` plus ``2·N·d·d_v``
  for ``Φ(q)ᵀS``;
* random_feature: ``Σ_h 2·N·d·m`` for ``Φ(q)``, the same for ``Φ(k)``, ``2·2·N·m·d_v`` for
  ``S`` and ``Φ(q)ᵀS``;
* sh, bn_sh: ``Σ_h 4·N·N_h·d``;
* hyla, hyla_no_relu, hyla_no_norm, hyla_softmax: ``6·N²·D`` (scores, ``Σ_h a v``, ``Σ_j a u``);
* hyla_linear_value: ``4·N²·D``.

SH therefore costs ``(1/H) Σ_h N_h/N`` of softmax, which is SPEC's ``(1/H) Σ_h 1/r_h`` when every
``r_h`` divides ``N`` (this module counts the exact ``ceil``, prefix tokens such as CLS included,
and 2-D windows on an image grid).

Example::

  attention_flops(config.model, seq_len=29)
  # {'per_layer': [...], 'total': ..., 'softmax_total': ..., 'relative_to_softmax': 0.75}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """Sizes of one self-attention layer on one example.

  Attributes:
    length: tokens N (queries = keys), prefix tokens included.
    heads: H. head_dim: d (queries, keys and values).
    grid_shape: ``(gh, gw)`` when the non-prefix keys are an image patch grid (SH pools 2-D).
    num_prefix_tokens: leading tokens SH never pools (CLS).
  """
  length: int
  heads: int
  head_dim: int
  grid_shape: tuple[int, int] | None = None
  num_prefix_tokens: int = 0

  @property
  def width(self) -> int:
    return self.heads * self.head_dim


def _quadratic(products: int) -> Callable[[AttentionShape, Mapping[str, Any]], float]:
  """``products`` N×N×D products of 2 FLOPs per multiply-add (softmax has 2: QK and AV)."""
  def count(shape: AttentionShape, options: Mapping[str, Any]) -> float:
    del options
    return 2.0 * products * shape.length * shape.length * shape.width
  return count


def _linear(shape: AttentionShape, options: Mapping[str, Any]) -> float:
  if options.get("form", "dual") == "dual":
    return _quadratic(2)(shape, options)
  d = shape.head_dim
  return shape.heads * (2.0 * shape.length * d * d + 2.0 * shape.length * d * d)


def _random_feature(shape: AttentionShape, options: Mapping[str, Any]) -> float:
  m, d, n = options.get("num_features", 256), shape.head_dim, shape.length
  return shape.heads * (2.0 * n * d * m * 2 + 2.0 * n * m * d * 2)


def _scaled_head(shape: AttentionShape, options: Mapping[str, Any]) -> float:
  from primal_dual.kernels.scaled_head import pooled_length  # pylint: disable=g-import-not-at-top
  ratios = options.get("ratios")
  if ratios is None or len(ratios) != shape.heads:
    raise ValueError(f"SH FLOPs need attention_options['ratios'] with one ratio per head "
                     f"(heads={shape.heads}); got {ratios!r}")
  grid = None if shape.grid_shape is None else tuple(shape.grid_shape)
  pooled = [pooled_length(shape.length, int(r), grid_shape=grid,
                          num_prefix_tokens=shape.num_prefix_tokens) for r in ratios]
  return sum(4.0 * shape.length * n_h * shape.head_dim for n_h in pooled)


def _hyla(value_network: str) -> Callable[[AttentionShape, Mapping[str, Any]], float]:
  def count(shape: AttentionShape, options: Mapping[str, Any]) -> float:
    network = options.get("value_network", value_network)
    return _quadratic(2 if network == "linear" else 3)(shape, options)
  return count


# Variant name (``primal_dual.layers.ATTENTION_REGISTRY``) → FLOPs of one layer on one example.
FLOP_COUNTERS: dict[str, Callable[[AttentionShape, Mapping[str, Any]], float]] = {
    "softmax": _quadratic(2),
    "bn": _quadratic(2),
    "linear": _linear,
    "linear_bn": _quadratic(2),
    "random_feature": _random_feature,
    "sh": _scaled_head,
    "bn_sh": _scaled_head,
    "hyla": _hyla("mlp_relu"),
    "hyla_no_relu": _hyla("mlp_linear"),
    "hyla_no_norm": _hyla("mlp_relu"),
    "hyla_softmax": _hyla("mlp_relu"),
    "hyla_linear_value": _hyla("linear"),
}


def layer_flops(attention: str, shape: AttentionShape,
                options: Mapping[str, Any] | None = None) -> float:
  """Attention FLOPs of one layer of variant ``attention`` on one example (module table)."""
  if attention not in FLOP_COUNTERS:
    raise ValueError(f"no FLOP count for attention variant {attention!r}; known: "
                     f"{', '.join(sorted(FLOP_COUNTERS))} (add one to FLOP_COUNTERS)")
  return float(FLOP_COUNTERS[attention](shape, dict(options or {})))


def attention_flops(model_config: Mapping[str, Any], seq_len: int, *,
                    grid_shape: tuple[int, int] | None = None,
                    num_prefix_tokens: int | None = None) -> dict[str, Any]:
  """Attention FLOPs of a whole model on one example.

  Args:
    model_config: ``config.model`` (``num_layers``, ``model_dim``, ``num_heads``, ``attention``,
      ``attention_options``; ``pooling='cls'`` adds one prefix token).
    seq_len: padded input length (time steps, or patches for images), without CLS.
    grid_shape: patch grid for images (SH pools 2-D).
    num_prefix_tokens: override of the prefix count (default: 1 with CLS pooling or a grid, else 0).

  Returns:
    ``{'per_layer': [float], 'total': float, 'softmax_total': float,
    'relative_to_softmax': float}``; every layer has the same attention, so the list repeats.
  """
  if num_prefix_tokens is None:
    num_prefix_tokens = int(model_config.get("pooling") == "cls" or grid_shape is not None)
  heads = int(model_config["num_heads"])
  width = int(model_config["model_dim"])
  if width % heads:
    raise ValueError(f"model_dim={width} is not divisible by num_heads={heads}")
  shape = AttentionShape(length=int(seq_len) + num_prefix_tokens, heads=heads,
                         head_dim=width // heads, grid_shape=grid_shape,
                         num_prefix_tokens=num_prefix_tokens)
  options = dict(model_config.get("attention_options") or {})
  one_layer = layer_flops(model_config["attention"], shape, options)
  softmax_layer = layer_flops("softmax", shape)
  layers = int(model_config["num_layers"])
  return {"per_layer": [one_layer] * layers, "total": one_layer * layers,
          "softmax_total": softmax_layer * layers,
          "relative_to_softmax": float(np.float64(one_layer) / softmax_layer)}
