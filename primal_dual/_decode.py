"""One autoregressive decoding step with a key/value cache, shared by the Linen and NNX layers.

The cache holds the projected keys and values of the whole sequence, ``[batch..., max_length,
heads, head_dim]``, filled up to ``index``. A step writes the new position's key and value at
``index`` and lets its single query attend to the positions ``0..index`` only. For every variant
whose row depends only on the keys it may see (softmax, linear, random features, HYLA, and
Attention-BN, whose statistics under a causal mask are those of the keys seen so far) the step
gives the row of the full causal pass. Attention-SH and BN+SH cannot: a step cannot tell the keys
not yet fed from padding, so it would pool the incomplete window that the full causal pass hides;
their registry entries say ``decodes=False`` and the layers refuse ``decode=True``
(:func:`check_variant_decodes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from primal_dual.registry import lookup


def check_variant_decodes(name: str) -> None:
  """Raises ValueError when the registered variant ``name`` cannot decode exactly."""
  if not lookup(name).decodes:
    raise ValueError(
      f"attention variant {name!r} cannot decode with a key/value cache (its rows would differ "
      "from the full causal pass); run the whole sequence with is_causal=True instead"
    )


def check_step_shape(cached: jax.Array, new: jax.Array) -> None:
  """Raises ValueError unless ``new`` is one position ``[batch..., 1, heads, head_dim]`` of
  ``cached [batch..., max_length, heads, head_dim]``."""
  expected = (*cached.shape[:-3], 1, *cached.shape[-2:])
  if tuple(new.shape) != expected:
    raise ValueError(
      f"decoding feeds one position at a time: expected projected keys of shape "
      f"{expected} (cache {tuple(cached.shape)}), got {tuple(new.shape)}"
    )


def write_step(cached: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
  """``cached [batch..., max_length, heads, d]`` with position ``index`` replaced by ``new
  [batch..., 1, heads, d]`` (cast to the cache's dtype)."""
  start = [jnp.zeros((), index.dtype)] * cached.ndim
  start[-3] = index
  return jax.lax.dynamic_update_slice(cached, new.astype(cached.dtype), start)


def seen_keys_mask(
  mask: jax.Array | None, index: jax.Array, max_length: int, batch_shape: tuple[int, ...]
) -> jax.Array:
  """The step's mask ``[batch..., 1, 1, max_length]`` (bool): keys ``0..index``, and ``mask``
  (any dtype, nonzero = may attend, broadcastable to ``[batch..., heads, 1, max_length]``) if
  given."""
  seen = jnp.arange(max_length) <= index
  seen = jnp.broadcast_to(seen, (*batch_shape, 1, 1, max_length))
  if mask is None:
    return seen
  allowed = jnp.asarray(mask) != 0
  shape = jnp.broadcast_shapes(seen.shape, allowed.shape)  # explicit: no rank promotion
  return jnp.logical_and(jnp.broadcast_to(seen, shape), jnp.broadcast_to(allowed, shape))
