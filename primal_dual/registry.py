"""The attention variants: one registry entry each, read by every other part of the library.

An entry (:class:`AttentionVariant`) says everything the library needs to know about a variant:

* ``factory(**options) -> attention_fn``: the kernel, with Flax's ``attention_fn`` contract;
* ``flops(shape, options) -> float``: attention FLOPs of one layer on one example
  (:class:`AttentionShape`; a multiply-add counts 2), read by ``analysis.flops``;
* ``takes_ratios``: the variant needs one integer ratio per head (Attention-SH); task configs give
  their ratio pattern through :func:`model_options`, which also falls back to :func:`default_ratios`;
* ``params``: learned parameters the kernel owns (:class:`KernelParam`). The layers
  (``primal_dual.layers.MultiHeadAttention``) create them under the attention module and pass them
  to the kernel as keyword arguments of the same name;
* ``description``: one line for docs and error messages.

Adding a variant is one call of :func:`register_attention` (see ``docs/new_variant.md``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from typing import Any, Callable, Mapping

import jax

from primal_dual import kernels
from primal_dual.kernels import scaled_head

AttentionFactory = Callable[..., Callable[..., jax.Array]]


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


FlopCounter = Callable[[AttentionShape, Mapping[str, Any]], float]


@dataclasses.dataclass(frozen=True)
class KernelParam:
  """A learned parameter owned by a kernel.

  Attributes:
    shape: ``shape(num_heads, head_dim) -> tuple`` of the parameter.
    init: a Flax initializer ``init(key, shape, dtype)``.
    logical_axes: logical axis names for sharding (one per dimension; None = replicated).
  """

  shape: Callable[[int, int], tuple[int, ...]]
  init: Callable[..., jax.Array]
  logical_axes: tuple[str | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
  """A registry entry (see the module docstring)."""

  factory: AttentionFactory
  flops: FlopCounter
  description: str = ""
  takes_ratios: bool = False
  params: Mapping[str, KernelParam] = dataclasses.field(default_factory=dict)


ATTENTION_REGISTRY: dict[str, AttentionVariant] = {}


def register_attention(
  name: str,
  factory: AttentionFactory,
  description: str = "",
  *,
  flops: FlopCounter | None = None,
  takes_ratios: bool = False,
  params: Mapping[str, KernelParam] | None = None,
  overwrite: bool = False,
) -> AttentionVariant:
  """Adds a variant under ``name`` and returns its entry.

  Args:
    name: the registry name (``config.model.attention``).
    factory: ``factory(**options) -> attention_fn``.
    description: one line.
    flops: FLOP formula; default: softmax's ``4·N²·D`` (two N×N×D products).
    takes_ratios: the variant needs ``ratios`` (one per head) from the task.
    params: learned parameters the layers create and pass to the kernel by name.
    overwrite: replace an existing entry.
  """
  if name in ATTENTION_REGISTRY and not overwrite:
    raise ValueError(f"attention variant {name!r} is already registered; pass overwrite=True")
  entry = AttentionVariant(
    factory, flops or quadratic_flops(2), description, takes_ratios, dict(params or {})
  )
  ATTENTION_REGISTRY[name] = entry
  return entry


def lookup(name: str) -> AttentionVariant:
  """The entry of ``name``; ValueError listing the known names otherwise."""
  if name not in ATTENTION_REGISTRY:
    raise ValueError(
      f"unknown attention variant {name!r}; known variants: {', '.join(sorted(ATTENTION_REGISTRY))}"
    )
  return ATTENTION_REGISTRY[name]


def make_attention_fn(
  name: str, options: Mapping[str, Any] | None = None, context: Mapping[str, Any] | None = None
) -> Callable[..., jax.Array]:
  """Builds the ``attention_fn`` registered as ``name``.

  Args:
    name: a key of ``ATTENTION_REGISTRY``.
    options: the variant's options (e.g. ``{'ratios': (1, 2)}`` for ``sh``).
    context: facts about the input that a model knows and some kernels use (``grid_shape``,
      ``num_prefix_tokens``); each is passed only if the kernel declares it.

  Raises:
    ValueError: unknown name (listing the known ones) or options the kernel rejects.
  """
  entry = lookup(name)
  options = dict(options or {})
  _check_option_names(name, options)
  try:
    fn = entry.factory(**options)
  except TypeError as e:
    raise ValueError(f"bad options {options} for attention variant {name!r}: {e}") from None
  params = inspect.signature(fn).parameters
  extra = {k: v for k, v in (context or {}).items() if k in params and k not in options}
  return functools.partial(fn, **extra) if extra else fn


def option_names(name: str) -> tuple[str, ...] | None:
  """The options variant ``name`` takes: its factory's own keywords and its kernel's options,
  less the arguments Flax passes every kernel (``driver.CALL_PARAMETERS``). None where they
  cannot be known: a kernel taking ``**options``, or a factory that needs options to build one."""
  from primal_dual.kernels import driver

  entry = lookup(name)
  try:
    kernel = entry.factory()
  except (TypeError, ValueError):
    return None
  kernel_parameters = inspect.signature(kernel).parameters.values()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in kernel_parameters):
    return None
  named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  factory_parameters = inspect.signature(entry.factory).parameters.values()
  found = {p.name for p in (*factory_parameters, *kernel_parameters) if p.kind in named}
  return tuple(sorted(found - {parameter.name for parameter in driver.CALL_PARAMETERS}))


def _check_option_names(name: str, options: Mapping[str, Any]) -> None:
  """ValueError in one line for an option ``name`` does not take, naming those it takes."""
  known = option_names(name)
  unknown = sorted(set(options) - set(known)) if known is not None else []
  if not unknown:
    return
  close = difflib.get_close_matches(unknown[0], known, n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  raise ValueError(
    f"unknown option {', '.join(map(repr, unknown))} for attention variant {name!r}{hint}; "
    f"its options: {', '.join(known)}"
  )


def default_ratios(num_heads: int) -> tuple[int, ...]:
  """Half the heads (rounded up) at full resolution, the rest pooled by 2."""
  return tuple(1 if h < (num_heads + 1) // 2 else 2 for h in range(num_heads))


def model_options(
  name: str, num_heads: int, *, ratios: tuple[int, ...] | None = None, **options
) -> dict[str, Any]:
  """The ``attention_options`` a model config gives variant ``name``.

  ``options`` are the task's own choices for this variant; a variant that takes ratios gets the
  task's ``ratios`` (or :func:`default_ratios` when the task has none), others ignore ``ratios``.
  """
  if lookup(name).takes_ratios:
    options["ratios"] = tuple(ratios) if ratios is not None else default_ratios(num_heads)
  return options


# --- FLOP formulas (per layer, one example, multiply-add = 2 FLOPs) ------------------------------


def quadratic_flops(products: int) -> FlopCounter:
  """``products`` N×N×D products (softmax has 2: QK and AV)."""

  def count(shape: AttentionShape, options: Mapping[str, Any]) -> float:
    del options
    return 2.0 * products * shape.length * shape.length * shape.width

  return count


def _linear_flops(shape: AttentionShape, options: Mapping[str, Any]) -> float:
  if options.get("form", "dual") == "dual":
    return quadratic_flops(2)(shape, options)
  d = shape.head_dim
  return shape.heads * (2.0 * shape.length * d * d + 2.0 * shape.length * d * d)


def _random_feature_flops(shape: AttentionShape, options: Mapping[str, Any]) -> float:
  m, d, n = options.get("num_features", 256), shape.head_dim, shape.length
  return shape.heads * (2.0 * n * d * m * 2 + 2.0 * n * m * d * 2)


def _scaled_head_flops(shape: AttentionShape, options: Mapping[str, Any]) -> float:
  ratios = options.get("ratios")
  if ratios is None or len(ratios) != shape.heads:
    raise ValueError(
      f"SH FLOPs need attention_options['ratios'] with one ratio per head "
      f"(heads={shape.heads}); got {ratios!r}"
    )
  grid = None if shape.grid_shape is None else tuple(shape.grid_shape)
  pooled = [
    scaled_head.pooled_length(
      shape.length, int(r), grid_shape=grid, num_prefix_tokens=shape.num_prefix_tokens
    )
    for r in ratios
  ]
  return sum(4.0 * shape.length * n_h * shape.head_dim for n_h in pooled)


def _hyla_flops(value_network: str) -> FlopCounter:
  """Scores and ``Σ_j a u`` plus, for the MLP value networks, ``Σ_h a v``: 3 or 2 products."""

  def count(shape: AttentionShape, options: Mapping[str, Any]) -> float:
    network = options.get("value_network", value_network)
    return quadratic_flops(2 if network == "linear" else 3)(shape, options)

  return count


# --- The built-in variants ---------------------------------------------------------------------


def _partial(attention_fn, /, **fixed) -> AttentionFactory:
  """A factory binding ``fixed`` options, which the caller's options may override."""

  def factory(**options):
    return functools.partial(attention_fn, **{**fixed, **options})

  return factory


def _random_feature_factory(*, feature_seed: int = 0, **options):
  # The random features are part of the model, not of the data: a fixed seed keeps them
  # identical across steps, processes and restarts.
  return functools.partial(
    kernels.random_feature_attention, feature_key=jax.random.key(feature_seed), **options
  )


def _hyla(
  description: str, *, normalization: str = "rms_head", value_network: str = "mlp_relu"
) -> dict[str, Any]:
  return dict(
    factory=_partial(
      kernels.hyla_attention, normalization=normalization, value_network=value_network
    ),
    flops=_hyla_flops(value_network),
    description=description,
  )


_BUILT_IN: dict[str, dict[str, Any]] = {
  "softmax": dict(
    factory=_partial(kernels.softmax_attention),
    description="softmax attention (SVR dual, exp kernel)",
  ),
  "linear": dict(
    factory=_partial(kernels.linear_attention),
    flops=_linear_flops,
    description="linear attention, Φ = elu + 1",
  ),
  "random_feature": dict(
    factory=_random_feature_factory,
    flops=_random_feature_flops,
    description="softmax's approximate primal, random features",
  ),
  "bn": dict(
    factory=_partial(kernels.batchnorm_attention, kernel="softmax"),
    description="Attention-BN (softmax)",
  ),
  "linear_bn": dict(
    factory=_partial(kernels.batchnorm_attention, kernel="linear"),
    description="Attention-BN (linear)",
  ),
  "sh": dict(
    factory=_partial(kernels.scaled_head_attention),
    flops=_scaled_head_flops,
    takes_ratios=True,
    description="Attention-SH (heads on pooled keys)",
  ),
  "bn_sh": dict(
    factory=_partial(kernels.scaled_head_attention, batchnorm=True),
    flops=_scaled_head_flops,
    takes_ratios=True,
    description="Attention-BN+SH",
  ),
  "hyla": _hyla("HYLA: rms-head normalisation + relu value MLP"),
  "hyla_no_relu": _hyla("HYLA ablation: value network without relu", value_network="mlp_linear"),
  "hyla_no_norm": _hyla("HYLA ablation: no normalisation across heads", normalization="none"),
  "hyla_softmax": _hyla(
    "HYLA ablation: softmax over keys instead of rms over heads", normalization="softmax"
  ),
  "hyla_linear_value": _hyla(
    "HYLA ablation: plain linear value aggregation (= linear attention with rms_head)",
    value_network="linear",
  ),
  "hyla_no_relu_no_norm": _hyla(
    "HYLA ablation: value network without relu and no normalisation across heads",
    normalization="none",
    value_network="mlp_linear",
  ),
  # The HYLA paper's "linear attention" baseline: no feature map and no denominator,
  # a_hij = q_hi·k_hj/√d + bias_hij (0 where masked), out_hi = Σ_j a_hij v_hj. Not `linear`
  # (elu + 1 features, normalised), which is the primal-dual paper's.
  "linear_plain": _hyla(
    "linear attention of the HYLA paper: unnormalised q·k/√d + bias",
    normalization="none",
    value_network="linear",
  ),
}

for _name, _entry in _BUILT_IN.items():
  register_attention(_name, **_entry)
