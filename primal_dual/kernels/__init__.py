"""Attention kernels: pure functions with Flax's ``attention_fn`` contract (docs/maths.md §1, §3)."""

from primal_dual.kernels._common import dropout_on
from primal_dual.kernels.batchnorm import batchnorm_attention
from primal_dual.kernels.hyla import hyla_attention
from primal_dual.kernels.linear import linear_attention, random_feature_attention
from primal_dual.kernels.masks import (
  causal_mask,
  combine_masks,
  local_mask,
  padding_mask,
  strided_mask,
)
from primal_dual.kernels.scaled_head import scaled_head_attention
from primal_dual.kernels.softmax import softmax_attention

__all__ = [
  "batchnorm_attention",
  "causal_mask",
  "combine_masks",
  "dropout_on",
  "hyla_attention",
  "linear_attention",
  "local_mask",
  "padding_mask",
  "random_feature_attention",
  "scaled_head_attention",
  "softmax_attention",
  "strided_mask",
]
