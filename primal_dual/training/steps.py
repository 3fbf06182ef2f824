"""The pure step functions: one optimisation step, K scanned steps, one evaluation batch.

Nothing here knows about files, meshes or tasks: `setup.build_program` binds the model, the
optimizer and the task's loss and jits them with shardings; benchmarks time these same functions.
"""

from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training (a pytree; checkpointed whole).

  Attributes:
    step: int32 [] completed steps.
    params: the model's 'params' collection (unboxed arrays).
    batch_stats: the 'batch_stats' collection, {} for models without one.
    opt_state: the optax state.
    rng: uint32 [2] base key; step s uses `fold_in(rng, s)` for dropout.
  """

  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array


def model_variables(params: Any, batch_stats: Any) -> dict[str, Any]:
  """The variables dict for `model.apply`, with 'batch_stats' only if the model has any."""
  variables = {"params": params}
  if batch_stats:
    variables["batch_stats"] = batch_stats
  return variables


def _apply_model(model: nn.Module, params, batch_stats, batch, **kwargs):
  return model.apply(
    model_variables(params, batch_stats), batch["inputs"], mask=batch.get("mask"), **kwargs
  )


def train_step(
  state: TrainState,
  batch: Mapping[str, jax.Array],
  *,
  model: nn.Module,
  tx: optax.GradientTransformation,
  loss_fn: Callable,
) -> tuple[TrainState, jax.Array, dict]:
  """One optimisation step (pure; jit it with the keyword arguments bound).

  Args:
    state: the current TrainState.
    batch: the global batch, dict of arrays with leading axis `batch_size`.
    model: the Linen model.
    tx: the optax transformation.
    loss_fn: `task.loss_and_metrics`.

  Returns:
    (new state, float32 [] loss, metrics dict of (sum, count) pairs incl. 'grad_norm').
  """
  dropout_rng = jax.random.fold_in(state.rng, state.step)

  def compute_loss(params):
    outputs, updates = _apply_model(
      model,
      params,
      state.batch_stats,
      batch,
      train=True,
      rngs={"dropout": dropout_rng},
      mutable=["batch_stats"],
    )
    loss, metrics = loss_fn(outputs, batch)
    return loss, (metrics, updates.get("batch_stats", state.batch_stats))

  (loss, (metrics, batch_stats)), grads = jax.value_and_grad(compute_loss, has_aux=True)(
    state.params
  )
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, grad_norm=(gradient_norm(grads), jnp.ones((), jnp.float32)))
  new_state = state.replace(
    step=state.step + 1, params=params, batch_stats=batch_stats, opt_state=opt_state
  )
  return new_state, loss, metrics


def gradient_norm(grads) -> jax.Array:
  """The global L2 norm of ``grads`` in float32 (bfloat16 parameters give bfloat16 gradients,
  whose sum of squares would lose the metric's precision)."""
  return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))


def train_steps(
  state: TrainState,
  batches: Mapping[str, jax.Array] | None,
  stream_arguments: Any = None,
  *,
  num_steps: int,
  model: nn.Module,
  tx: optax.GradientTransformation,
  loss_fn: Callable,
  device_batch: Callable[..., Mapping[str, jax.Array]] | None = None,
  batch_size: int = 0,
  batch_sharding=None,
) -> tuple[TrainState, jax.Array, dict]:
  """`num_steps` calls of `train_step` in one program (`lax.scan`; pure, jit it).

  Args:
    state: the current TrainState.
    batches: dict of `[num_steps, batch_size, ...]` arrays, or None when `device_batch` makes
      each step's batch on the device.
    stream_arguments: the run's arguments of `device_batch` (its seed, its held-out split:
      `task_registry.DeviceTrainStream`).
    num_steps: K, the scan length.
    model, tx, loss_fn: as for `train_step`.
    device_batch: `device_batch(indices uint32 [batch_size], stream_arguments) -> batch`; step s (the
      state's step before the update) trains on records `s·batch_size … s·batch_size + B − 1`
      of the task's train stream, so the data do not depend on K.
    batch_size: the global batch size (with `device_batch`).
    batch_sharding: where a generated batch lives (split over the mesh's `data` axis).

  Returns:
    (new state, float32 [num_steps] losses, metrics: (sum, count) pairs summed over the steps).
  """

  def one_step(state, batch):
    if device_batch is not None:
      indices = state.step.astype(jnp.uint32) * jnp.uint32(batch_size) + jnp.arange(
        batch_size, dtype=jnp.uint32
      )
      batch = device_batch(indices, stream_arguments)
      if batch_sharding is not None:
        batch = jax.lax.with_sharding_constraint(batch, batch_sharding)
    state, loss, metrics = train_step(state, batch, model=model, tx=tx, loss_fn=loss_fn)
    return state, (loss, metrics)

  state, (losses, metrics) = jax.lax.scan(one_step, state, batches, length=num_steps)
  return state, losses, jax.tree.map(lambda x: jnp.sum(x, axis=0), metrics)


def eval_step(
  state: TrainState, batch: Mapping[str, jax.Array], *, model: nn.Module, loss_fn: Callable
) -> dict:
  """Metric (sum, count) pairs of one padded eval batch (rows with `valid` False count 0)."""
  outputs = _apply_model(model, state.params, state.batch_stats, batch, train=False)
  _, metrics = loss_fn(outputs, batch)
  return metrics
