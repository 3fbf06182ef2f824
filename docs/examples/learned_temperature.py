"""A new attention variant in one file: softmax attention with a learned per-head temperature.

Importing this module registers ``softmax_learned_temperature``. From then on every part of the
library knows it: the Linen layer creates its parameter ``log_temperature [heads]`` (zeros, so it
starts as plain softmax) under each attention module and passes it to the kernel, every task
config accepts ``attention=softmax_learned_temperature``, and the FLOP analysis counts it.

  out_hi = Σ_j softmax_j(exp(τ_h) · q_hi·k_hj / √d + bias_hij) v_hj
"""

import functools

import flax.linen as nn
import jax.numpy as jnp

from primal_dual import registry
from primal_dual.kernels import softmax_attention

NAME = "softmax_learned_temperature"


def learned_temperature_attention(
  query, key, value, bias=None, mask=None, *, log_temperature, **flax_arguments
):
  """Softmax attention whose logits head h multiplies by ``exp(log_temperature[h])``.

  Args:
    query: ``[batch..., q_len, heads, d]``; key ``[batch..., kv_len, heads, d]``; value
      ``[batch..., kv_len, heads, d_v]``; bias, mask and ``flax_arguments`` as for
      ``softmax_attention``.
    log_temperature: ``[heads]``, the learned parameter.
  """
  # Scaling each head's queries scales that head's logits, bias excluded. The explicit shape
  # [1..., heads, 1] broadcasts under jax_numpy_rank_promotion='raise' too.
  temperature = jnp.exp(log_temperature).astype(query.dtype)
  temperature = temperature.reshape((1,) * (query.ndim - 2) + (-1, 1))
  return softmax_attention(query * temperature, key, value, bias=bias, mask=mask, **flax_arguments)


registry.register_attention(
  NAME,
  lambda **options: functools.partial(learned_temperature_attention, **options),
  "softmax attention with a learned per-head temperature",
  flops=registry.quadratic_flops(2),  # QK and AV, as softmax
  params={
    "log_temperature": registry.KernelParam(
      shape=lambda num_heads, head_dim: (num_heads,),
      init=nn.initializers.zeros_init(),
      logical_axes=("heads",),
    )
  },
  overwrite=True,
)
