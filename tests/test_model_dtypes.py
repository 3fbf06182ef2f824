"""``config.model.dtype`` / ``param_dtype`` reach every task's model: parameters are stored in
``param_dtype``, every matrix product runs in ``dtype``, and BatchNorm statistics and the logits
stay float32 (tiny models, traced and lowered, nothing compiled)."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from primal_dual.models import EncoderClassifier, SequenceTransformer, ViT
from primal_dual.tasks import _common, synthetic

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
