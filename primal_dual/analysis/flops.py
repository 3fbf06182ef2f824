"""Analytic attention FLOPs of a model config, per layer and per variant.

What is counted: the products inside the attention kernel for **one example** of padded length
``N`` (queries and keys), per layer, with a multiply-add counted as 2 FLOPs. The q/k/v/out
projections, the MLP, softmax exponentials, feature maps, BN statistics and SH pooling are left
out: the projections are the same for every variant, and the rest is O(N·D), lower order than the
products below. ``D = H·d`` is the total query/key width (``qkv_features`` if set, else ``model_dim``), ``d`` one head's width,
``d_v = d``.

Each variant's formula is part of its registry entry (``primal_dual.registry``); per layer
(``N_h = pooled_length(N, r_h)``, i.e. ``ceil(N/r_h)`` in 1-D; m random features):

* softmax, bn, linear (dual form), linear_bn: ``QK 2·N²·D + AV 2·N²·D = 4·N²·D``;
* linear (``form='primal'``): ``Σ_h 2·N·d·d_v`` for ``S = Σ_j Φ(k_j)v_jᵀ`` plus ``2·N·d·d_v``
  for ``Φ(q)ᵀS``;
* random_feature: ``Σ_h 2·N·d·m`` for ``Φ(q)``, the same for ``Φ(k)``, ``2·2·N·m·d_v`` for
  ``S`` and ``Φ(q)ᵀS``;
* sh, bn_sh: ``Σ_h 4·N·N_h·d``;
* hyla, hyla_no_relu, hyla_no_norm, hyla_softmax, hyla_no_relu_no_norm: ``6·N²·D`` (scores,
  ``Σ_h a v``, ``Σ_j a u``);
* hyla_linear_value, linear_plain: ``4·N²·D``.

SH therefore costs ``(1/H) Σ_h N_h/N`` of softmax, which is docs/maths.md's ``(1/H) Σ_h 1/r_h`` when every
``r_h`` divides ``N`` (this module counts the exact ``ceil``, prefix tokens such as CLS included,
and 2-D windows on an image grid).

Example::

  attention_flops(config.model, seq_len=29)
  # {'per_layer': [...], 'total': ..., 'softmax_total': ..., 'relative_to_softmax': 0.75}
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from primal_dual import registry
from primal_dual.registry import AttentionShape


def layer_flops(
  attention: str, shape: AttentionShape, options: Mapping[str, Any] | None = None
) -> float:
  """Attention FLOPs of one layer of variant ``attention`` on one example (its registry entry)."""
  return float(registry.lookup(attention).flops(shape, dict(options or {})))


def attention_flops(
  model_config: Mapping[str, Any],
  seq_len: int,
  *,
  grid_shape: tuple[int, int] | None = None,
  num_prefix_tokens: int | None = None,
) -> dict[str, Any]:
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
  # The attention width: qkv_features where a model sets it apart from model_dim.
  width = int(model_config.get("qkv_features") or model_config["model_dim"])
  if width % heads:
    raise ValueError(f"attention width {width} is not divisible by num_heads={heads}")
  shape = AttentionShape(
    length=int(seq_len) + num_prefix_tokens,
    heads=heads,
    head_dim=width // heads,
    grid_shape=grid_shape,
    num_prefix_tokens=num_prefix_tokens,
  )
  options = dict(model_config.get("attention_options") or {})
  one_layer = layer_flops(model_config["attention"], shape, options)
  softmax_layer = layer_flops("softmax", shape)
  layers = int(model_config["num_layers"])
  return {
    "per_layer": [one_layer] * layers,
    "total": one_layer * layers,
    "softmax_total": softmax_layer * layers,
    "relative_to_softmax": float(np.float64(one_layer) / softmax_layer),
  }
