"""Figures of the analyses: attention maps (heads × layers) and head distance per variant.

Both functions write a PNG with matplotlib's non-interactive Agg backend and return its path.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

from primal_dual import atomic


def pyplot():
  """``matplotlib.pyplot`` on the non-interactive Agg backend (imported on first use)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def save_figure(fig, path, *, dpi: int = 110, tight_bbox: bool = True) -> str:
  """Writes ``fig`` to ``path`` atomically (creating its folder), closes it and returns ``path``;
  the format follows ``path``'s extension."""
  file_format = os.path.splitext(path)[1].lstrip(".") or "png"
  atomic.write_with(
    path,
    lambda tmp: fig.savefig(
      tmp, format=file_format, dpi=dpi, bbox_inches="tight" if tight_bbox else None
    ),
  )
  pyplot().close(fig)
  return path


def plot_attention_grid(
  maps: Mapping[str, Sequence[np.ndarray]], path: str, title: str = ""
) -> str:
  """One example's attention maps: a row per (variant, layer), a column per head.

  Args:
    maps: variant name → one ``[heads, q_len, kv_len]`` array per layer (full width, cropped to
      the example's valid tokens). Variants may differ in head and layer counts.
    path: output PNG.
    title: figure title.

  Returns:
    ``path``.
  """
  plt = pyplot()
  rows = [
    (name, layer, np.asarray(m)) for name, layers in maps.items() for layer, m in enumerate(layers)
  ]
  if not rows:
    raise ValueError("plot_attention_grid needs at least one variant with one layer of maps")
  columns = max(m.shape[0] for _, _, m in rows)
  fig, axes = plt.subplots(
    len(rows), columns, figsize=(1.9 * columns + 0.6, 1.9 * len(rows)), squeeze=False
  )
  for row, (name, layer, layer_maps) in enumerate(rows):
    for head in range(columns):
      ax = axes[row, head]
      ax.set_xticks([])
      ax.set_yticks([])
      if head >= layer_maps.shape[0]:
        ax.axis("off")
        continue
      ax.imshow(layer_maps[head], cmap="viridis", aspect="auto", interpolation="nearest")
      if row == 0:
        ax.set_title(f"head {head}", fontsize=8)
      if head == 0:
        ax.set_ylabel(f"{name}\nlayer {layer}\nquery", fontsize=8)
      if row == len(rows) - 1:
        ax.set_xlabel("key", fontsize=8)
  if title:
    fig.suptitle(title, fontsize=10)
  return save_figure(fig, path)


def plot_redundancy_bars(
  values: Mapping[str, Mapping[str, tuple[float, float]]],
  path: str,
  title: str = "",
  ylabel: str = "head distance (higher = less redundant)",
) -> str:
  """Grouped bar chart: a group per data set (or any key), a bar per variant, std error bars.

  Args:
    values: group → variant → (mean, std). Missing or NaN means are left out.
    path: output PNG. title, ylabel: labels.

  Returns:
    ``path``.
  """
  plt = pyplot()
  groups = list(values)
  variants = list(dict.fromkeys(v for group in values.values() for v in group))
  if not groups or not variants:
    raise ValueError("plot_redundancy_bars needs at least one group with one variant")
  width = 0.8 / len(variants)
  fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(groups) * len(variants) * 0.35 + 2), 3.2))
  for index, variant in enumerate(variants):
    means = np.array([values[g].get(variant, (np.nan, np.nan))[0] for g in groups], float)
    stds = np.array([values[g].get(variant, (np.nan, np.nan))[1] for g in groups], float)
    positions = np.arange(len(groups)) + (index - (len(variants) - 1) / 2) * width
    shown = np.isfinite(means)
    ax.bar(
      positions[shown],
      means[shown],
      width,
      yerr=np.nan_to_num(stds[shown]),
      label=variant,
      capsize=2,
    )
  ax.set_xticks(np.arange(len(groups)))
  ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
  ax.set_ylabel(ylabel, fontsize=8)
  ax.legend(fontsize=7, ncol=min(len(variants), 6))
  if title:
    ax.set_title(title, fontsize=10)
  return save_figure(fig, path)
