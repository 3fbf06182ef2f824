"""Linear attention and positive random features: kernels with a finite feature map (docs/maths.md §2, §3.2).

For one head, with a feature map ``Φ``, positional factor ``f_ij = exp(bias_ij)`` (1 without a
bias) and mask ``m``::

  dual:    out_i = Σ_j Φ(q_i)·Φ(k_j) f_ij m_ij v_j / (Σ_j Φ(q_i)·Φ(k_j) f_ij m_ij + eps)
  primal:  S = Σ_j Φ(k_j) v_jᵀ,  z = Σ_j Φ(k_j),  out_i = Φ(q_i)ᵀS / (Φ(q_i)ᵀz + eps)

With a finite feature map ``Φ`` the SVR dual ``Σ_j Φ(q)ᵀΦ(k_j) v_j / h(q)`` can be evaluated in its
primal form ``Φ(q)ᵀS / Φ(q)ᵀz`` with ``S = Σ_j Φ(k_j) v_jᵀ`` and ``z = Σ_j Φ(k_j)``: O(N) instead of
O(N²). Two feature maps live here:

* :func:`linear_attention`: ``Φ = elu + 1`` (exact, both forms available);
* :func:`random_feature_attention`: positive random features, an unbiased estimate of the
  exponential (softmax) kernel, computed in the primal form only.

One-head building blocks (:func:`elu_feature_map`, :func:`linear_weights_one_head`,
:func:`linear_primal_one_head`, :func:`feature_primal_one_head`) are pure and shared with the other
kernel families.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from primal_dual.kernels import _common as C
from primal_dual.kernels import driver

DEFAULT_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# One-head building blocks.
# ---------------------------------------------------------------------------------------------


def elu_feature_map(x):
  """``Φ(x) = elu(x) + 1``, elementwise, strictly positive. Returns float32 of ``x``'s shape.

  Computed as ``exp(x)`` for ``x ≤ 0`` (the same function): ``elu(x) + 1`` rounds to exactly 0
  below x ≈ −17 in float32, which a query seeing one key turns into a 0/0."""
  x = x.astype(C.F32)
  return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


def positional_factor(bias):
  """``exp(bias − max_j bias)`` in float32: a logit bias turned into a kernel factor.

  Softmax adds a bias to the logits, i.e. multiplies its kernel ``exp(qᵀk/√D)`` by ``exp(b_ij)``;
  the linear dual form takes the same product with its own kernel, so a relative position bias
  means the same thing for both. The per-row shift keeps ``exp`` finite and cancels in the
  normalisation (up to the ``eps`` guard).
  """
  bias = bias.astype(C.F32)
  return jnp.exp(bias - jax.lax.stop_gradient(jnp.max(bias, axis=-1, keepdims=True)))


def linear_weights_one_head(q, k, bias, mask, *, eps: float = DEFAULT_EPS, precision=None):
  """Dual-form (N×N) linear attention weights of one head.

  ``A_ij = Φ(q_i)ᵀΦ(k_j) f_ij m_ij / (Σ_j' Φ(q_i)ᵀΦ(k_j') f_ij' m_ij' + eps)`` with ``Φ = elu + 1``
  and ``f = positional_factor(bias)`` (1 without a bias).

  Args:
    q: ``[q_len, d_qk]``. k: ``[kv_len, d_qk]``, any float dtype.
    bias: ``[q_len, kv_len]`` logit bias or None; enters multiplicatively as ``exp(bias)``.
    mask: bool ``[q_len, kv_len]`` or None (True = may attend).
    eps: guards the denominator; a query with no valid key gets a zero row.
    precision: passed to the einsum.

  Returns:
    float32 ``[q_len, kv_len]``.
  """
  scores = jnp.einsum("qd,kd->qk", elu_feature_map(q), elu_feature_map(k), precision=precision)
  return normalize_linear_scores(scores, bias, mask, eps=eps)


def normalize_linear_scores(scores, bias, mask, *, eps: float):
  """Kernel values ``scores [q_len, kv_len]`` (float32, positive) to dual-form weights: times the
  positional factor and the mask, divided by their row sum ``+ eps``."""
  if bias is not None:
    scores = scores * positional_factor(bias)
  if mask is not None:
    scores = scores * mask
  return scores / (jnp.sum(scores, axis=-1, keepdims=True) + eps)


def causal_prefix(x, q_len: int, offset: int):
  """Inclusive prefix sums of ``x [kv_len, ...]`` along keys, read at each query's last visible key.

  Query ``i`` sees keys ``j <= i + offset`` (``_common.causal_offset``); a query that sees no key
  gets zeros. Returns ``[q_len, ...]``.
  """
  kv_len = x.shape[0]
  last = jnp.arange(q_len) + offset
  prefix = jnp.cumsum(x, axis=0)
  taken = jnp.take(prefix, jnp.clip(last, 0, kv_len - 1), axis=0)
  sees_any = (last >= 0).reshape((q_len,) + (1,) * (x.ndim - 1))
  return jnp.where(sees_any, taken, 0.0)


def feature_primal_one_head(
  phi_q, phi_k, v, key_valid, *, eps: float, causal_offset: int | None = None, precision=None
):
  """Primal form ``out_i = Φ(q_i)ᵀS / (Φ(q_i)ᵀz + eps)`` from precomputed features of one head.

  Args:
    phi_q: float32 ``[q_len, f]`` query features. phi_k: float32 ``[kv_len, f]`` key features.
    v: ``[kv_len, d_v]``.
    key_valid: bool ``[kv_len]`` or None; invalid keys contribute nothing to ``S`` or ``z``.
    eps: added to the denominator. A denominator that is still not positive (no valid key and
      ``eps = 0``) is replaced by 1, so such queries get zeros.
    causal_offset: None (not causal) or an int: query ``i`` then only uses keys
      ``j <= i + causal_offset``, through prefix sums of ``Φ(k_j) v_jᵀ``; this holds a
      ``[kv_len, f, d_v]`` float32 tensor (memory O(N·f·d_v)).
    precision: passed to the einsums.

  Returns:
    float32 ``[q_len, d_v]``.
  """
  if key_valid is not None:
    phi_k = phi_k * key_valid[:, None]
  v = v.astype(C.F32)
  if causal_offset is not None:
    q_len = phi_q.shape[0]
    states = causal_prefix(
      jnp.einsum("kf,kd->kfd", phi_k, v, precision=precision), q_len, causal_offset
    )
    normalizers = causal_prefix(phi_k, q_len, causal_offset)
    numerator = jnp.einsum("qf,qfd->qd", phi_q, states, precision=precision)
    denominator = jnp.einsum("qf,qf->q", phi_q, normalizers, precision=precision)
  else:
    state = jnp.einsum("kf,kd->fd", phi_k, v, precision=precision)
    numerator = jnp.einsum("qf,fd->qd", phi_q, state, precision=precision)
    denominator = jnp.einsum("qf,f->q", phi_q, jnp.sum(phi_k, axis=0), precision=precision)
  denominator = denominator + eps
  return numerator / jnp.where(denominator > 0, denominator, 1.0)[:, None]


def linear_primal_one_head(
  q, k, v, key_valid, *, eps: float = DEFAULT_EPS, precision=None, causal_offset: int | None = None
):
  """Primal-form (O(N)) linear attention of one head, ``Φ = elu + 1``.

  Args:
    q: ``[q_len, d_qk]``. k: ``[kv_len, d_qk]``. v: ``[kv_len, d_v]``.
    key_valid: bool ``[kv_len]`` or None; invalid keys contribute nothing.
    eps: guards the denominator (same role as in :func:`linear_weights_one_head`).
    precision: passed to the einsums.
    causal_offset: None, or the prefix-sum causal form (see :func:`feature_primal_one_head`).

  Returns:
    float32 ``[q_len, d_v]``; equals ``linear_weights_one_head(q, k, None, mask) @ v`` when
    ``mask`` is ``key_valid`` on every row, up to float error.
  """
  return feature_primal_one_head(
    elu_feature_map(q),
    elu_feature_map(k),
    v,
    key_valid,
    eps=eps,
    causal_offset=causal_offset,
    precision=precision,
  )


def draw_random_features(feature_key, num_features: int, d_qk: int):
  """Projection ``ω ~ N(0, I)`` of the positive random features, float32 ``[num_features, d]``."""
  return jax.random.normal(feature_key, (num_features, d_qk), C.F32)


def _log_positive_random_features(x, omega, precision=None):
  """``log Φ(x) + log √m = ωᵀx̃ − ‖x̃‖²/2`` with ``x̃ = x/D^¼``; ``[n, D] -> [n, m]`` float32."""
  x = x.astype(C.F32) * x.shape[-1] ** -0.25
  projected = jnp.einsum("nd,md->nm", x, omega, precision=precision)
  return projected - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)


def random_feature_primal_one_head(
  q, k, v, key_valid, *, omega, causal_offset: int | None = None, precision=None
):
  """Approximate softmax attention of one head with positive random features.

  ``Φ(x) = exp(ωᵀx̃ − ‖x̃‖²/2)/√m`` gives ``E[Φ(q)ᵀΦ(k)] = exp(qᵀk/√D)``. For stability each query's
  log-features are shifted by their max and the keys' by one max over valid keys and features;
  both shifts (and the ``1/√m``) cancel between numerator and denominator, so no eps is added
  (a query with no valid key gets zeros through the denominator guard).

  Args:
    q: ``[q_len, d_qk]``. k: ``[kv_len, d_qk]``. v: ``[kv_len, d_v]``.
    key_valid: bool ``[kv_len]`` or None.
    omega: float32 ``[m, d_qk]`` from :func:`draw_random_features`.
    causal_offset: None, or the prefix-sum causal form (see :func:`feature_primal_one_head`).
    precision: passed to the einsums.

  Returns:
    float32 ``[q_len, d_v]``.
  """
  log_q = _log_positive_random_features(q, omega, precision)
  log_k = _log_positive_random_features(k, omega, precision)
  log_q = log_q - jax.lax.stop_gradient(jnp.max(log_q, axis=-1, keepdims=True))
  if key_valid is not None:
    # exp(-inf) = 0: padded keys, however large, can neither overflow nor set the shift.
    log_k = jnp.where(key_valid[:, None], log_k, -jnp.inf)
  if causal_offset is not None:
    return _causal_random_feature_primal(
      jnp.exp(log_q), log_k, v, causal_offset=causal_offset, precision=precision
    )
  key_shift = jnp.max(log_k)
  key_shift = jnp.where(jnp.isfinite(key_shift), key_shift, 0.0)  # no valid key: any shift works
  log_k = log_k - jax.lax.stop_gradient(key_shift)
  return feature_primal_one_head(
    jnp.exp(log_q),
    jnp.exp(log_k),
    v,
    key_valid,
    eps=0.0,
    causal_offset=causal_offset,
    precision=precision,
  )


def _finite_or_zero(x):
  return jnp.where(jnp.isfinite(x), x, 0.0)


def _merge_rescaled_sums(earlier, later):
  """Associative merge of ``(log_scale, state, normalizer)`` sums, each stored divided by
  ``exp(log_scale)``: both are brought to the larger scale (``-inf``: an empty sum)."""
  (scale_a, state_a, norm_a), (scale_b, state_b, norm_b) = earlier, later
  scale = jnp.maximum(scale_a, scale_b)
  factor_a, factor_b = (
    jnp.where(jnp.isfinite(s), jnp.exp(s - _finite_or_zero(scale)), 0.0) for s in (scale_a, scale_b)
  )
  return (
    scale,
    factor_a[:, None, None] * state_a + factor_b[:, None, None] * state_b,
    factor_a[:, None] * norm_a + factor_b[:, None] * norm_b,
  )


def _causal_random_feature_primal(phi_q, log_k, v, *, causal_offset: int, precision=None):
  """The causal primal form of random features: prefix sums of ``Φ(k_j) v_jᵀ`` and ``Φ(k_j)``,
  each prefix scaled by the largest key feature *of that prefix* (a running maximum through an
  associative scan), so that no later key sets the scale a query's sums are rounded at.

  Args:
    phi_q: float32 ``[q_len, m]``. log_k: float32 ``[kv_len, m]`` log-features, ``-inf`` for
      invalid keys. v: ``[kv_len, d_v]``. causal_offset: query ``i`` sees keys ``j <= i + offset``.

  Returns:
    float32 ``[q_len, d_v]``; zeros for a query that sees no valid key.
  """
  row_scale = jax.lax.stop_gradient(jnp.max(log_k, axis=-1))  # [kv_len], -inf when invalid
  phi_k = jnp.exp(log_k - _finite_or_zero(row_scale)[:, None])
  states = jnp.einsum("kf,kd->kfd", phi_k, v.astype(C.F32), precision=precision)
  _, states, normalizers = jax.lax.associative_scan(
    _merge_rescaled_sums, (row_scale, states, phi_k)
  )
  q_len = phi_q.shape[0]
  last = jnp.clip(jnp.arange(q_len) + causal_offset, 0, log_k.shape[0] - 1)
  sees_any = (jnp.arange(q_len) + causal_offset >= 0)[:, None]
  numerator = jnp.einsum("qf,qfd->qd", phi_q, states[last], precision=precision)
  denominator = jnp.einsum("qf,qf->q", phi_q, normalizers[last], precision=precision)
  out = numerator / jnp.where(denominator > 0, denominator, 1.0)[:, None]
  return jnp.where(sees_any, out, 0.0)


# ---------------------------------------------------------------------------------------------
# Argument handling shared by the primal forms.
# ---------------------------------------------------------------------------------------------


def key_only_validity(mask, shapes: C.QKVShapes, form_hint: str):
  """Per-key validity ``[B | 1, H | 1, kv_len]`` of a key-only mask (size 1 on the q_len axis).

  ``mask`` may have any dtype (nonzero = may attend); None stays None.

  Raises:
    ValueError: if ``mask`` depends on the query or does not broadcast.
  """
  mask = C.as_bool_mask(mask)
  if mask is None:
    return None
  if mask.ndim >= 2 and mask.shape[-2] != 1 and shapes.q_len != 1:
    raise ValueError(
      f"the primal form needs a key-only mask (size 1 on the q_len axis, e.g. padding_mask's "
      f"output [batch..., 1, 1, kv_len]); got mask.shape={tuple(mask.shape)} with "
      f"q_len={shapes.q_len}. {form_hint}"
    )
  validity = C.broadcast_logits_arg(mask, "mask", shapes._replace(q_len=1))
  return validity[:, :, 0, :]


def check_no_bias(bias, name: str):
  if bias is not None:
    raise ValueError(
      f"bias is not defined for {name} (an additive logit bias has no meaning for its kernel); "
      f"got bias.shape={tuple(jnp.shape(bias))}"
    )


def attend_primal(call: driver.AttentionCall, primal_one_head, *, name: str, mask_hint: str):
  """A whole call of a primal form (no bias, no weights, a key-only mask).

  ``primal_one_head(q, k, v, key_valid, *, causal_offset, precision) -> float32 [q_len, d_v]``
  as :func:`feature_primal_one_head`; ``name`` and ``mask_hint`` go into the error messages.
  """
  check_no_bias(call.bias, name)
  call.refuse_weights(name)
  key_valid = key_only_validity(call.mask, call.shapes, mask_hint)
  offset = C.causal_offset(call.causal_alignment, call.shapes.q_len, call.shapes.kv_len)
  one_head = functools.partial(
    primal_one_head, causal_offset=offset if call.is_causal else None, precision=call.precision
  )
  return call.finish(C.map_heads(one_head, *call.heads_major(), key_valid))


# ---------------------------------------------------------------------------------------------
# Kernels.
# ---------------------------------------------------------------------------------------------


def _linear_dual(call: driver.AttentionCall, *, eps: float):
  return call.attend(functools.partial(linear_weights_one_head, eps=eps, precision=call.precision))


def _linear_primal(call: driver.AttentionCall, *, eps: float):
  return attend_primal(
    call,
    functools.partial(linear_primal_one_head, eps=eps),
    name="linear_attention(form='primal')",
    mask_hint="Use form='dual' for query-dependent masks.",
  )


# form name -> the whole call in that form.
LINEAR_FORMS = {"dual": _linear_dual, "primal": _linear_primal}


@driver.attention_kernel
def linear_attention(call: driver.AttentionCall, *, form: str = "dual", eps: float = DEFAULT_EPS):
  """Linear attention, ``Φ = elu + 1`` on queries and keys (no 1/√D).

  ``out_i = Σ_j Φ(q_i)ᵀΦ(k_j) m_ij v_j / (Σ_j Φ(q_i)ᵀΦ(k_j) m_ij + eps)``; masked keys contribute
  nothing and a query with no valid key gets zeros. With a ``bias`` (dual form) each term is also
  multiplied by ``exp(b_ij)``.

  Args:
    query, key, value, bias, mask and Flax's other ``attention_fn`` arguments: see
      :class:`driver.AttentionCall`.
    bias: ``dual`` form only: it multiplies the kernel by ``exp(bias)``, as a logit bias does in
      softmax (e.g. a relative position bias).
    The ``primal`` form never forms pairwise weights: it raises ValueError for a bias, dropout
      on the weights or ``return_weights=True`` (which need form='dual'), sows nothing, needs a
      key-only mask (size 1 on the q_len axis, as made by ``masks.padding_mask``) and computes
      ``is_causal`` with prefix sums, which hold a ``[batch, heads, kv_len, d_qk, d_v]`` float32
      tensor.
    form: ``'dual'`` (N×N weights) or ``'primal'`` (O(N), ``Φ(q)ᵀS / (Φ(q)ᵀz + eps)``).
    eps: added to the denominator.

  Returns:
    ``[batch..., q_len, heads, d_v]`` (and the weights if requested).
  """
  return C.lookup(LINEAR_FORMS, form, "form")(call, eps=eps)


@driver.attention_kernel
def random_feature_attention(
  call: driver.AttentionCall, *, num_features: int = 256, feature_key=None
):
  """Softmax attention approximated in the primal with positive random features (docs/maths.md §2).

  ``Φ(x) = exp(ωᵀx̃ − ‖x̃‖²/2)/√m`` with ``x̃ = x/D^¼`` and ``ω ~ N(0, I)`` (``m = num_features``),
  so ``E[Φ(q)ᵀΦ(k)] = exp(qᵀk/√D)``; then ``out_i = Φ(q_i)ᵀS / Φ(q_i)ᵀz`` in O(N·m). The error
  shrinks like ``1/√m`` and grows with ``‖q‖, ‖k‖``. The same ``ω`` serves every example and head.

  Args:
    query, key, value, bias, mask and Flax's other ``attention_fn`` arguments: see
      :class:`driver.AttentionCall`.
    A primal form, as ``linear_attention(form='primal')``: ValueError for a bias (a logit bias
      cannot be moved into the features), dropout on the weights or ``return_weights=True``;
      a key-only mask; nothing sown; ``is_causal`` through prefix sums (holding
      ``[batch, heads, kv_len, m, d_v]``).
    num_features: ``m``, the number of random features.
    feature_key: a JAX PRNG key drawing ``ω`` (required; reuse it to keep the features fixed).

  Returns:
    ``[batch..., q_len, heads, d_v]``.
  """
  if feature_key is None:
    raise ValueError(
      "random_feature_attention needs feature_key (a jax PRNG key drawing the "
      "random features); got feature_key=None"
    )
  if num_features < 1:
    raise ValueError(f"num_features must be >= 1; got num_features={num_features}")
  omega = draw_random_features(feature_key, num_features, call.shapes.d_qk)
  return attend_primal(
    call,
    functools.partial(random_feature_primal_one_head, omega=omega),
    name="random_feature_attention",
    mask_hint="Random-feature attention is a primal form; use softmax_attention instead.",
  )
