"""Optimizer and learning-rate schedule from `config.optimizer`.

Every optimizer is the same chain, so the options mean the same thing whatever the name::

  clip_by_global_norm(grad_clip_norm)     # if grad_clip_norm > 0
  → direction[name]                       # adam / radam moments, or SGD momentum
  → add_decayed_weights(weight_decay, mask=non-vector parameters)   # if weight_decay > 0
  → scale_by_learning_rate(schedule)

The whole chain runs in float32 (`float32_state`): with bfloat16 parameters
(`config.model.param_dtype`) its state (Adam's moments, SGD's momentum) is float32 and its updates
are float32, added to the parameters by `optax.apply_updates` in float32 and rounded to the
parameter dtype once.

Weight decay is therefore *decoupled* (AdamW-style: `p ← p − lr·(update + wd·p)`) for all three.
Only parameters of rank ≥ 2 decay: kernels, embedding tables and positional embeddings. Rank ≤ 1
parameters — biases, LayerNorm/BatchNorm scales and offsets, and any learned scalar — do not, as
shrinking them toward zero changes what the layer computes rather than its capacity (docs/maths.md §4 sRAVEN:
"weight decay on non-vector parameters").

Config fields (`config.optimizer`): name ('adamw' | 'radam' | 'sgd'), lr, b1, b2, eps (adam
family), momentum, nesterov (sgd; momentum 0 = plain SGD), weight_decay, grad_clip_norm,
schedule ('constant' | 'warmup_cosine' | 'rsqrt'), warmup_steps, end_lr, end_lr_factor,
cosine_end (where the cosine reaches the end rate: 'total' = the last step, or 'total_minus_warmup'
= `warmup_steps` before it, then held: optax's `decay_steps = total − warm-up`, as the HYLA paper's
code sets it).

The end rate of 'warmup_cosine' and 'rsqrt' is `end_lr` (absolute), or, when `end_lr_factor` is set
(not None, and then `end_lr` must be None), `end_lr_factor × lr`: relative to the peak, so a sweep
over `lr` keeps the schedule's shape (the HYLA paper's code ends at `0.1 × lr`).
"""

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from primal_dual.training import errors


# ------------------------------------------------------------------------------------------------
# Schedules: (opt_config, total_steps) -> optax.Schedule. All start with a linear warm-up from 0
# to `lr` over `warmup_steps` (none if 0).


def _linear_warmup(lr: float, warmup_steps: int) -> optax.Schedule:
  return optax.linear_schedule(0.0, lr, max(warmup_steps, 1))


def _constant(opt: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """`lr` after warm-up. `end_lr` is ignored."""
  del total_steps
  if opt.warmup_steps <= 0:
    return optax.constant_schedule(opt.lr)
  return optax.join_schedules(
    [_linear_warmup(opt.lr, opt.warmup_steps), optax.constant_schedule(opt.lr)], [opt.warmup_steps]
  )


def end_rate(opt: ml_collections.ConfigDict) -> float:
  """The schedule's end rate: `end_lr_factor × lr` if `end_lr_factor` is set, else `end_lr`."""
  factor = opt.get("end_lr_factor")
  if factor is None:
    return opt.end_lr
  if opt.get("end_lr") is not None:
    # Both set would leave one silently unused.
    raise errors.ConfigError(
      f"optimizer.end_lr_factor ({factor}) is set, so optimizer.end_lr must be None "
      f"(got {opt.end_lr}): one end rate, absolute or relative to lr"
    )
  if factor < 0:
    raise errors.ConfigError(f"optimizer.end_lr_factor must be ≥ 0, got {factor}")
  return factor * opt.lr


# Step at which the cosine reaches the end rate (optax's `decay_steps`, warm-up included).
COSINE_ENDS: dict[str, Callable[[int, int], int]] = {
  "total": lambda total_steps, warmup_steps: total_steps,
  "total_minus_warmup": lambda total_steps, warmup_steps: total_steps - warmup_steps,
}


def _warmup_cosine(opt: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Warm-up, then half a cosine from `lr` to the end rate (`end_rate`) at the `cosine_end` step, then held."""
  cosine_end = errors.lookup(COSINE_ENDS, opt.get("cosine_end", "total"), "cosine_end")
  end_step = cosine_end(total_steps, max(opt.warmup_steps, 0))
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=opt.lr,
    warmup_steps=max(opt.warmup_steps, 0),
    decay_steps=max(end_step, opt.warmup_steps + 1),
    end_value=end_rate(opt),
  )


def _rsqrt(opt: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Warm-up, then `lr·sqrt(warmup/step)` (inverse square root), floored at the end rate."""
  del total_steps
  pivot = max(opt.warmup_steps, 1)
  floor = end_rate(opt)

  def decay(step):
    step = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)
    value = opt.lr * jnp.sqrt(pivot / jnp.maximum(step, pivot))
    return jnp.maximum(value, floor)

  if opt.warmup_steps <= 0:
    return decay
  # join_schedules passes `step - boundary` to the second schedule; shift it back.
  return optax.join_schedules(
    [_linear_warmup(opt.lr, opt.warmup_steps), lambda s: decay(s + opt.warmup_steps)],
    [opt.warmup_steps],
  )


SCHEDULES: dict[str, Callable[[ml_collections.ConfigDict, int], optax.Schedule]] = {
  "constant": _constant,
  "warmup_cosine": _warmup_cosine,
  "rsqrt": _rsqrt,
}


# ------------------------------------------------------------------------------------------------
# Update directions: opt_config -> GradientTransformation (before weight decay and learning rate).


# A setting's number: from the config, or traced per replica (`ReplicaOptimizer`).
_Value = Callable[[str], Any]


def _sgd_direction(opt: ml_collections.ConfigDict, value: _Value) -> optax.GradientTransformation:
  if opt.momentum <= 0:
    return optax.identity()
  return optax.trace(decay=value("momentum"), nesterov=opt.nesterov)


OPTIMIZERS: dict[
  str, Callable[[ml_collections.ConfigDict, _Value], optax.GradientTransformation]
] = {
  "adamw": lambda opt, value: optax.scale_by_adam(b1=value("b1"), b2=value("b2"), eps=value("eps")),
  "radam": lambda opt, value: optax.scale_by_radam(
    b1=value("b1"), b2=value("b2"), eps=value("eps")
  ),
  "sgd": _sgd_direction,
}


def _upcast(tree: Any) -> Any:
  """`tree` with floating leaves narrower than float32 (bfloat16, float16) as float32."""

  def upcast(x):
    if x is None or not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits >= 32:
      return x
    return jnp.asarray(x, jnp.float32)

  return jax.tree.map(upcast, tree)


def float32_state(
  inner: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
  """`inner` on float32 copies of the gradients and parameters, whatever their dtype.

  Its state is built from float32 parameters (optax's moments take the parameters' dtype, and
  `mu_dtype` covers only Adam's first), and its updates stay float32: `optax.apply_updates` adds
  them to 16-bit parameters in float32 and rounds the sum once, so a step gives the float32
  step's parameters rounded to the parameter dtype. float32 parameters pass through unchanged.
  """

  def init(params):
    return inner.init(_upcast(params))

  def update(updates, state, params=None, **extra_args):
    return inner.update(_upcast(updates), state, _upcast(params), **extra_args)

  return optax.GradientTransformationExtraArgs(init, update)


def weight_decay_mask(params: Any) -> Any:
  """True for the parameters that decay: those of rank ≥ 2 (see the module docstring).

  Args:
    params: a pytree of arrays (or ShapeDtypeStructs), unboxed or boxed in `nn.Partitioned`.

  Returns:
    A pytree of Python bools with the structure of `params`.
  """
  return jax.tree.map(lambda p: p.ndim > 1, params)


def _check(opt: ml_collections.ConfigDict) -> None:
  if not opt.lr > 0:
    raise errors.ConfigError(f"optimizer.lr must be > 0, got {opt.lr}")
  if opt.weight_decay < 0 or opt.grad_clip_norm < 0 or opt.warmup_steps < 0:
    raise errors.ConfigError(
      "optimizer.weight_decay, grad_clip_norm and warmup_steps must be ≥ 0; got "
      f"{opt.weight_decay}, {opt.grad_clip_norm}, {opt.warmup_steps}"
    )


def make_schedule(opt: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Learning-rate schedule `step -> lr` (float32 scalar) named by `opt.schedule`."""
  return errors.lookup(SCHEDULES, opt.schedule, "learning-rate schedule")(opt, total_steps)


def _chain(
  opt: ml_collections.ConfigDict, schedule: optax.Schedule, numbers: Mapping[str, Any]
) -> optax.GradientTransformation:
  """The chain of the module docstring: its links decided by `opt`, their numbers taken from
  `numbers` (traced scalars) where given, else from `opt`."""

  def value(name: str) -> Any:
    return numbers[name] if name in numbers else opt[name]

  direction = errors.lookup(OPTIMIZERS, opt.name, "optimizer")
  chain = []
  if opt.grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(value("grad_clip_norm")))
  chain.append(direction(opt, value))
  if opt.weight_decay > 0:
    chain.append(optax.add_decayed_weights(value("weight_decay"), mask=weight_decay_mask))
  chain.append(optax.scale_by_learning_rate(schedule))
  return float32_state(optax.chain(*chain))


def make_optimizer(
  opt: ml_collections.ConfigDict, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Builds the optimizer chain described in the module docstring.

  Args:
    opt: `config.optimizer`.
    total_steps: number of training steps (the cosine schedule ends there).

  Returns:
    (transformation, schedule); the schedule is returned for logging the learning rate.

  Raises:
    errors.UnknownNameError: unknown optimizer or schedule name.
    errors.ConfigError: lr ≤ 0 or a negative weight decay / clip norm / warm-up.
  """
  errors.lookup(OPTIMIZERS, opt.name, "optimizer")
  _check(opt)
  schedule = make_schedule(opt, total_steps)
  return _chain(opt, schedule, {}), schedule


# ------------------------------------------------------------------------------------------------
# Replicas: several optimizers of one structure in one program.

# Numbers inside the chain that replicas may set apart; the learning-rate schedule's settings (lr,
# end_lr, warmup_steps) differ through each replica's own schedule instead.
CHAIN_NUMBERS = ("grad_clip_norm", "weight_decay", "b1", "b2", "eps", "momentum")

# A number whose zero removes its link from the chain (and its state from the optimizer state).
_LINK_SWITCHES = ("grad_clip_norm", "weight_decay", "momentum")


@dataclasses.dataclass(frozen=True)
class ReplicaOptimizer:
  """The optimizers of replicas trained as one program: one chain structure (that of the first
  replica, which all share), each replica's numbers and learning-rate schedule.

  Attributes:
    structure: `config.optimizer` of the first replica; decides the chain's links.
    schedules: each replica's learning-rate schedule (the same optax code as a run alone).
    hyperparameters: `'replica'` int32 `[R]` (0 … R−1), and float32 `[R]` of each of
      `CHAIN_NUMBERS` whose value differs between replicas (the others stay constants, so a
      single run's program is unchanged).
  """

  structure: ml_collections.ConfigDict
  schedules: tuple[optax.Schedule, ...]
  hyperparameters: dict[str, np.ndarray]

  @property
  def num_replicas(self) -> int:
    return len(self.schedules)

  def transformation(self, replica: Mapping[str, jax.Array]) -> optax.GradientTransformation:
    """The optimizer of one replica, inside the replica map.

    Args:
      replica: `hyperparameters` of one replica: int32 / float32 `[]` (traced).
    """
    index = replica["replica"]
    # lax.switch with one branch calls it directly: a single run's own schedule. Its branches
    # must agree in type (a constant schedule returns a Python float).
    branches = [lambda step, s=s: jnp.asarray(s(step), jnp.float32) for s in self.schedules]

    def schedule(step):
      return jax.lax.switch(index, branches, step)

    numbers = {name: value for name, value in replica.items() if name in CHAIN_NUMBERS}
    return _chain(self.structure, schedule, numbers)


def make_replica_optimizer(
  opts: Sequence[ml_collections.ConfigDict], total_steps: int
) -> ReplicaOptimizer:
  """The `ReplicaOptimizer` of replicas with optimizer configs `opts` (one each).

  Raises:
    errors.ConfigError: the replicas need different chains (a zero and a non-zero weight decay,
      clip norm or SGD momentum), or a config error of `make_optimizer`.
  """
  schedules = tuple(make_optimizer(opt, total_steps)[1] for opt in opts)
  structure = opts[0]
  for name in _LINK_SWITCHES:
    if len({opt[name] > 0 for opt in opts}) > 1:
      raise errors.ConfigError(
        f"replicas with optimizer.{name} 0 and > 0 need different optimizers and cannot train "
        f"as one program; sweep values that are all > 0, or train the 0 run separately"
      )
  hyperparameters = {"replica": np.arange(len(opts), dtype=np.int32)}
  for name in CHAIN_NUMBERS:
    values = [opt[name] for opt in opts]
    if len(set(values)) > 1:
      hyperparameters[name] = np.asarray(values, np.float32)
  return ReplicaOptimizer(structure, schedules, hyperparameters)
