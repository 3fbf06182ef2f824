"""``config.model.dtype`` / ``param_dtype`` reach every task's model: parameters are stored in
``param_dtype``, every matrix product runs in ``dtype``, and BatchNorm statistics and the logits
stay float32 (tiny models, traced and lowered, nothing compiled); with bfloat16 parameters the
optimizer's state and update are float32."""

import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from primal_dual.models import EncoderClassifier, SequenceTransformer, ViT
from primal_dual.tasks import _common, synthetic
from primal_dual.training import config_lib, optim, steps

SIZES = dict(num_layers=1, model_dim=16, num_heads=2, mlp_dim=32)
BATCH, LENGTH = 4, 6


def _dense_inputs():
  x = np.random.default_rng(0).standard_normal((BATCH, LENGTH, 3), np.float32)
  mask = np.arange(LENGTH)[None, :] < np.array([6, 5, 4, 6])[:, None]
  return x, mask


# name -> (model of the given dtypes, its inputs): the models of the packaged tasks.
MODELS = {
  "uea": (
    lambda **dtypes: EncoderClassifier(
      num_classes=3, norm="batch", pre_norm=False, pooling="flatten", **SIZES, **dtypes
    ),
    _dense_inputs,
  ),
  "listops": (
    lambda **dtypes: EncoderClassifier(
      num_classes=3, input_kind="embed", vocab_size=11, pooling="cls", **SIZES, **dtypes
    ),
    lambda: (np.arange(BATCH * LENGTH).reshape(BATCH, LENGTH) % 11, _dense_inputs()[1]),
  ),
  "sraven": (
    lambda **dtypes: SequenceTransformer(
      num_outputs=5, qkv_features=8, position_buckets="unidirectional", **SIZES, **dtypes
    ),
    lambda: (_dense_inputs()[0], None),
  ),
  "images": (
    lambda **dtypes: ViT(num_classes=3, patch_size=4, **SIZES, **dtypes),
    lambda: (np.random.default_rng(0).standard_normal((BATCH, 8, 8, 1), np.float32), None),
  ),
  "synthetic": (
    lambda **dtypes: synthetic.SyntheticClassifier(hidden=16, use_batch_norm=True, **dtypes),
    _dense_inputs,
  ),
}


RNGS = {"params": jax.random.key(0), "dropout": jax.random.key(1)}


def _functions(name, **dtypes):
  """``(init, apply)`` of model ``name`` built with ``dtypes``: ``init() -> variables``,
  ``apply(variables) -> (training logits, updated batch_stats)``."""
  build, inputs = MODELS[name]
  model = build(**dtypes)
  x, mask = inputs()

  def apply(variables):
    return model.apply(variables, x, mask, train=True, rngs=RNGS, mutable=["batch_stats"])

  return (lambda: model.init(RNGS, x, mask, train=False)), apply


def _dtypes(tree) -> set[str]:
  return {str(x.dtype) for x in jax.tree.leaves(tree)}


MATMUL_OPERANDS = re.compile(
  r"stablehlo\.(?:dot_general|convolution)\b[^\n]*: \((tensor<[^>]*>, tensor<[^>]*>)\)"
)


def _matmul_operand_dtypes(apply, variables) -> set[str]:
  """The element types of the matrix products' operands in ``apply``'s lowered program (traced
  and lowered for the CPU, not compiled)."""
  text = jax.jit(apply).trace(variables).lower().as_text()
  return set(re.findall(r"tensor<(?:\d+x)*(\w+)>", " ".join(MATMUL_OPERANDS.findall(text))))


@pytest.mark.parametrize("name", list(MODELS))
def test_compute_dtype_runs_every_matmul_in_it_with_float32_parameters_and_logits(name):
  init, apply32 = _functions(name)
  init16, apply16 = _functions(name, dtype=jnp.bfloat16)
  variables = jax.eval_shape(init16)
  assert jax.tree.map(lambda x: x.dtype, variables) == jax.tree.map(
    lambda x: x.dtype, jax.eval_shape(init)
  )  # float32 parameters and statistics
  logits, stats = jax.eval_shape(apply16, variables)
  assert logits.dtype == jnp.float32 and _dtypes(stats) <= {"float32"}
  assert _matmul_operand_dtypes(apply16, variables) == {"bf16"}
  assert _matmul_operand_dtypes(apply32, variables) == {"f32"}


@pytest.mark.parametrize("name", list(MODELS))
def test_param_dtype_stores_parameters_and_keeps_statistics_float32(name):
  init, apply = _functions(name, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  variables = jax.eval_shape(init)
  assert _dtypes(variables["params"]) == {"bfloat16"}
  logits, stats = jax.eval_shape(apply, variables)
  assert _dtypes(variables.get("batch_stats", {})) | _dtypes(stats) <= {"float32"}
  assert logits.dtype == jnp.float32


def test_model_arguments_read_the_dtype_names_of_a_config():
  model = ml_collections.ConfigDict(dict(dtype="bfloat16", param_dtype="float32", attention="sh"))
  arguments = _common.model_arguments(model, ())
  assert arguments["dtype"] == jnp.bfloat16 and arguments["param_dtype"] == jnp.float32
  # A config of an earlier version names no dtype: the models' defaults.
  assert "dtype" not in _common.model_arguments(ml_collections.ConfigDict({"attention": "sh"}), ())


# --- The optimizer state and update stay float32 -------------------------------------------------


def _optimizer(name: str):
  """``config.optimizer`` ``name`` with every link of the chain (clipping, decay, momentum)."""
  opt = config_lib.training_defaults().optimizer
  opt.update(name=name, lr=0.05, weight_decay=0.1, grad_clip_norm=1.0, momentum=0.9)
  return optim.make_optimizer(opt, total_steps=10)[0]


def _parameters_and_gradients(dtype):
  """Two steps' worth of parameters and gradients of several ranks, in ``dtype``."""
  rng = np.random.default_rng(0)
  shapes = {"kernel": (4, 3), "bias": (3,), "scale": ()}
  params = {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}
  grads = [{k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}]
  grads.append({k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()})
  return params, grads


def _steps(tx, params, grads):
  """``(parameters after each step, final state)`` of ``tx`` applied to ``grads`` in turn."""
  state, history = tx.init(params), []
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
  return history, state


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
def test_optimizer_state_is_float32_and_a_step_is_the_float32_step_rounded(name):
  """bfloat16 parameters: every float of the state is float32 (two steps), and a step gives the
  parameters of the same step taken in float32 from float32 copies, rounded to bfloat16."""
  tx = _optimizer(name)
  params, grads = _parameters_and_gradients(jnp.bfloat16)
  history, state = _steps(tx, params, grads)
  floats = {str(x.dtype) for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)}
  assert floats == {"float32"}
  assert _dtypes(history[-1]) == {"bfloat16"}
  upcast = functools.partial(jax.tree.map, lambda x: x.astype(jnp.float32))
  params32, _ = _steps(tx, upcast(params), [upcast(g) for g in grads])
  for got, want in zip(jax.tree.leaves(history[0]), jax.tree.leaves(params32[0])):
    np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))


def test_float32_parameters_take_the_optimizer_unchanged():
  """The float32 chain is optax's own: the wrapper adds nothing to a float32 run's program."""
  opt = config_lib.training_defaults().optimizer
  opt.update(name="adamw", lr=0.05, weight_decay=0.1, grad_clip_norm=1.0)
  tx = _optimizer("adamw")
  inner = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps),
    optax.add_decayed_weights(0.1, mask=optim.weight_decay_mask),
    optax.scale_by_learning_rate(optim.make_schedule(opt, 10)),
  )
  params, grads = _parameters_and_gradients(jnp.float32)
  got, want = _steps(tx, params, grads)[0], _steps(inner, params, grads)[0]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_the_gradient_norm_metric_is_float32_under_bfloat16_parameters():
  _, grads = _parameters_and_gradients(jnp.bfloat16)
  norm = steps.gradient_norm(grads[0])
  assert norm.dtype == jnp.float32
  squares = sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads[0]))
  np.testing.assert_allclose(norm, np.sqrt(squares), rtol=1e-6)
