"""Head redundancy, full-width SH maps, attention FLOPs, the analysis registry and the plots."""

import functools
import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primal_dual import analysis
from primal_dual.analysis import attention_maps
from primal_dual.analysis import flops
from primal_dual.analysis import plots
from primal_dual.analysis import redundancy
from primal_dual.kernels.scaled_head import head_groups, scaled_head_attention
from primal_dual.models import EncoderClassifier, ViT
from primal_dual.training import errors


def _random_maps(rng, shape):
  """Row-stochastic maps of ``shape`` ``[..., kv]``."""
  logits = rng.normal(size=shape)
  weights = np.exp(logits)
  return weights / weights.sum(-1, keepdims=True)


def _brute_force_matrix(weights, query_valid):
  """The docstring's formula written out with the full [B, H, H, Q, K] difference tensor."""
  diff = weights[:, :, None] - weights[:, None, :]
  rows = np.sqrt((diff**2).sum(-1))
  per_example = (rows * query_valid[:, None, None]).sum(-1) / query_valid.sum(-1)[:, None, None]
  return per_example.mean(0)


# ------------------------------------------------------------------------------------------------
# The metric on hand-made maps.


def test_identical_heads_have_zero_distance():
  rng = np.random.default_rng(0)
  one_head = _random_maps(rng, (3, 1, 5, 6))
  weights = np.repeat(one_head, 4, axis=1)
  query_valid = np.array([[True] * 5, [True] * 3 + [False] * 2, [True] + [False] * 4])
  assert redundancy.layer_head_distance(weights, query_valid) == pytest.approx(0.0, abs=1e-12)
  summary = redundancy.redundancy_summary([weights, weights], query_valid)
  assert summary["per_layer"] == pytest.approx([0.0, 0.0], abs=1e-12)


def test_one_hot_heads_on_different_keys_are_sqrt2_apart():
  # Head 0 attends to key 0, head 1 to key 1, head 2 like head 0 on every row.
  weights = np.zeros((1, 3, 4, 4))
  weights[0, 0, :, 0] = 1.0
  weights[0, 1, :, 1] = 1.0
  weights[0, 2, :, 0] = 1.0
  matrix = redundancy.head_distance_matrix(weights)
  np.testing.assert_allclose(matrix, math.sqrt(2) * np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]]))
  # Pairs (0,1), (0,2), (1,2): √2, 0, √2.
  assert redundancy.layer_head_distance(weights) == pytest.approx(2 * math.sqrt(2) / 3)


def test_padded_query_rows_are_ignored():
  rng = np.random.default_rng(1)
  weights = np.repeat(_random_maps(rng, (2, 1, 6, 6)), 2, axis=1)
  query_valid = np.array([[True] * 4 + [False] * 2] * 2)
  weights[:, 1, 4:] = _random_maps(rng, (2, 2, 6))  # heads differ only on padded rows
  assert redundancy.layer_head_distance(weights, query_valid) == pytest.approx(0.0, abs=1e-12)
  assert redundancy.layer_head_distance(weights) > 0.05


def test_pairwise_loop_matches_the_formula_and_streams_over_batches():
  rng = np.random.default_rng(2)
  weights = _random_maps(rng, (5, 4, 7, 9))
  query_valid = rng.random((5, 7)) < 0.7
  query_valid[:, 0] = True
  np.testing.assert_allclose(
    redundancy.head_distance_matrix(weights, query_valid),
    _brute_force_matrix(weights, query_valid),
    rtol=1e-12,
  )
  accumulator = redundancy.RedundancyAccumulator()
  accumulator.add([weights[:2], weights[:2] ** 2], query_valid[:2])
  accumulator.add([weights[2:], weights[2:] ** 2], query_valid[2:])
  whole = redundancy.redundancy_summary([weights, weights**2], query_valid)
  summary = accumulator.summary()
  assert summary["num_examples"] == 5
  np.testing.assert_allclose(summary["per_layer"], whole["per_layer"], rtol=1e-12)
  assert summary["mean"] == pytest.approx(np.mean(whole["per_layer"]))


def test_bad_shapes_raise():
  with pytest.raises(ValueError, match="batch, heads, q_len, kv_len"):
    redundancy.head_distance_matrix(np.zeros((2, 3, 4)))
  with pytest.raises(ValueError, match="query_valid"):
    redundancy.head_distance_matrix(np.zeros((2, 3, 4, 4)), np.ones((2, 5), bool))


# ------------------------------------------------------------------------------------------------
# Spreading pooled SH columns back to full width.


def test_expand_pooled_columns_known_values_and_padding():
  pooled = np.array([0.6, 0.4]).reshape(1, 1, 1, 2)
  np.testing.assert_allclose(
    redundancy.expand_pooled_columns(pooled, 2, 3)[0, 0, 0], [0.3, 0.3, 0.4]
  )
  pooled = np.array([0.5, 0.5]).reshape(1, 1, 1, 2)
  key_valid = np.array([[True, True, True, False]])
  np.testing.assert_allclose(
    redundancy.expand_pooled_columns(pooled, 2, 4, key_valid)[0, 0, 0], [0.25, 0.25, 0.5, 0]
  )


def test_window_of_key_matches_the_kernel_windows_and_the_grid_helper():
  for kv_len, ratio in ((7, 2), (9, 3), (5, 8)):
    np.testing.assert_array_equal(
      attention_maps.window_of_key(kv_len, ratio, attention_maps.TokenLayout()),
      np.arange(kv_len) // ratio,
    )
  layout = attention_maps.TokenLayout(num_prefix_tokens=1, grid_shape=(3, 5))
  np.testing.assert_array_equal(
    attention_maps.window_of_key(16, 2, layout), redundancy.grid_window_of_key(2, (3, 5), 1)
  )
  rng = np.random.default_rng(3)
  pooled = _random_maps(rng, (2, 3, 4, 1 + 2 * 3))
  np.testing.assert_allclose(
    redundancy.expand_by_window(pooled, redundancy.grid_window_of_key(2, (3, 5), 1)),
    redundancy.expand_grid_columns(pooled, 2, (3, 5), 1),
  )


@pytest.mark.parametrize(
  "layout",
  [
    attention_maps.TokenLayout(),
    attention_maps.TokenLayout(num_prefix_tokens=1),
    attention_maps.TokenLayout(num_prefix_tokens=1, grid_shape=(3, 3)),
  ],
)
def test_expanded_sh_maps_applied_to_full_values_reproduce_the_kernel(layout):
  """Average pooling: Σ_p w_p mean_{j∈p} v_j = Σ_j expanded_j v_j, a known answer per head."""
  ratios = (1, 2, 3)
  kv_len = 10
  batch, heads, dim = 2, len(ratios), 4
  rng = np.random.default_rng(4)
  q, k, v = (
    jnp.asarray(rng.normal(size=(batch, kv_len, heads, dim)), jnp.float32) for _ in range(3)
  )
  key_valid = np.ones((batch, kv_len), bool)
  if layout.grid_shape is None:
    key_valid[1, 7:] = False  # padding in the second example
  mask = jnp.asarray(key_valid)[:, None, None, :]
  kernel = jax.jit(
    functools.partial(
      scaled_head_attention,
      ratios=ratios,
      return_weights=True,
      grid_shape=layout.grid_shape,
      num_prefix_tokens=layout.num_prefix_tokens,
    )
  )
  out, sown = kernel(q, k, v, mask=mask)
  full = attention_maps.full_width(jax.device_get(sown), ratios, kv_len, layout, key_valid)
  assert full.shape == (batch, heads, kv_len, kv_len)
  np.testing.assert_allclose(full.sum(-1), 1.0, atol=1e-5)
  assert np.all(full[1][..., ~key_valid[1]] == 0)
  expected = np.einsum("bhqk,bkhd->bqhd", full, np.asarray(v, np.float64))
  np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def test_full_width_puts_groups_back_in_head_order():
  ratios = (2, 1, 2)
  groups = head_groups(ratios)
  sown = tuple(np.full((1, len(heads), 2, -(-4 // r)), float(r)) for r, heads in groups)
  full = attention_maps.full_width(
    sown, ratios, 4, attention_maps.TokenLayout(), np.ones((1, 4), bool)
  )
  np.testing.assert_allclose(full[0, 1], 1.0)  # ratio-1 head untouched
  np.testing.assert_allclose(full[0, 0], 1.0)  # ratio 2: value 2 shared by 2 keys
  with pytest.raises(ValueError, match="ratios"):
    attention_maps.full_width(sown, None, 4, attention_maps.TokenLayout(), np.ones((1, 4), bool))


# ------------------------------------------------------------------------------------------------
# Maps collected from models.


def _encoder(attention, options=None, pooling="mean", num_layers=2):
  return EncoderClassifier(
    num_classes=3,
    num_layers=num_layers,
    model_dim=8,
    num_heads=2,
    mlp_dim=8,
    pooling=pooling,
    norm="layer",
    attention=attention,
    attention_options=options or {},
    dropout_rate=0.0,
  )


def _sequence_batch():
  rng = np.random.default_rng(5)
  inputs = rng.normal(size=(2, 6, 3)).astype(np.float32)
  mask = np.array([[True] * 6, [True] * 4 + [False] * 2])
  return inputs, mask


def _check_full_width(maps, valid, num_layers, num_tokens):
  assert len(maps) == num_layers
  for layer in maps:
    assert layer.shape == (2, 2, num_tokens, num_tokens)
    np.testing.assert_allclose(layer.sum(-1), 1.0, atol=1e-5)
    assert np.all(layer[1][..., ~valid[1]] == 0)  # padded keys get nothing


def test_sh_maps_of_an_encoder_with_cls_are_full_width():
  inputs, mask = _sequence_batch()
  model = _encoder("bn_sh", {"ratios": (1, 2)}, pooling="cls", num_layers=1)
  variables = jax.jit(model.init)(jax.random.key(0), inputs, mask=mask)
  maps, valid = attention_maps.collect_layer_maps(model, variables, inputs, mask)
  assert valid.shape == (2, 7) and valid[1].sum() == 5  # CLS + 4 steps
  _check_full_width(maps, valid, num_layers=1, num_tokens=7)


def test_softmax_encoder_maps_and_identical_heads_give_zero_distance():
  inputs, mask = _sequence_batch()
  model = _encoder("softmax", num_layers=2)
  variables = jax.jit(model.init)(jax.random.key(1), inputs, mask=mask)
  params = jax.tree.map(np.array, nn.unbox(variables["params"]))
  apply_fn = attention_maps.make_sow_apply(model)

  def maps_and_distance(params):
    maps, valid = attention_maps.collect_layer_maps(
      model, {"params": params}, inputs, mask, apply_fn=apply_fn
    )
    return maps, valid, redundancy.redundancy_summary(maps, valid)["per_layer"]

  maps, valid, distances = maps_and_distance(params)
  _check_full_width(maps, valid, num_layers=2, num_tokens=6)
  assert min(distances) > 1e-4
  for block, name in itertools.product(("block_0", "block_1"), ("query", "key")):
    projection = params[block]["attention"][name]
    projection["kernel"][:, 1] = projection["kernel"][:, 0]
    projection["bias"][1] = projection["bias"][0]
  assert maps_and_distance(params)[2] == pytest.approx([0.0, 0.0], abs=1e-6)


def test_token_layouts_of_the_models():
  """ViT: CLS + a patch grid (pooled 2-D); encoder: CLS only with CLS pooling; others: none."""
  vit = ViT(
    num_classes=2, patch_size=2, num_heads=2, attention="sh", attention_options={"ratios": (1, 2)}
  )
  images = np.zeros((1, 6, 8, 1), np.float32)
  layout = attention_maps.token_layout(vit, images)
  assert layout == attention_maps.TokenLayout(num_prefix_tokens=1, grid_shape=(3, 4))
  assert attention_maps.num_keys(layout, images) == 13
  sequences = np.zeros((1, 5, 3), np.float32)
  with_cls = attention_maps.token_layout(_encoder("softmax", pooling="cls"), sequences)
  assert with_cls == attention_maps.TokenLayout(num_prefix_tokens=1)
  assert attention_maps.token_layout(_encoder("softmax"), sequences) == attention_maps.TokenLayout()
  assert attention_maps.token_layout(object(), sequences) == attention_maps.TokenLayout()


# ------------------------------------------------------------------------------------------------
# FLOPs.


def test_attention_flops_per_variant():
  model = dict(num_layers=2, model_dim=16, num_heads=4, attention="softmax")
  softmax = flops.attention_flops(model, 32)
  assert softmax["per_layer"] == [4.0 * 32 * 32 * 16] * 2
  assert softmax["relative_to_softmax"] == 1.0
  sh = flops.attention_flops(
    {**model, "attention": "sh", "attention_options": {"ratios": (1, 1, 2, 4)}}, 32
  )
  assert sh["relative_to_softmax"] == pytest.approx((1 + 1 + 1 / 2 + 1 / 4) / 4)
  # 29 keys: ceil(29/2) = 15, ceil(29/4) = 8 pooled keys.
  odd = flops.attention_flops(
    {**model, "attention": "bn_sh", "attention_options": {"ratios": (1, 1, 2, 4)}}, 29
  )
  assert odd["relative_to_softmax"] == pytest.approx((29 + 29 + 15 + 8) / (4 * 29))
  assert flops.attention_flops({**model, "attention": "hyla"}, 8)["relative_to_softmax"] == 1.5
  cls = flops.attention_flops({**model, "pooling": "cls"}, 31)
  assert cls["total"] == softmax["total"]
  with pytest.raises(ValueError, match="unknown attention variant 'nope'"):
    flops.attention_flops({**model, "attention": "nope"}, 8)
  with pytest.raises(ValueError, match="ratios"):
    flops.attention_flops({**model, "attention": "sh"}, 8)


def test_every_registered_variant_has_a_flop_count():
  from primal_dual import registry

  shape = registry.AttentionShape(length=8, heads=2, head_dim=4)
  for name, entry in registry.ATTENTION_REGISTRY.items():
    options = registry.model_options(name, shape.heads)
    assert flops.layer_flops(name, shape, options) > 0, name


# ------------------------------------------------------------------------------------------------
# Registry and plots.


def test_analysis_registry_is_lazy_and_names_the_known_analyses():
  assert analysis.ANALYSES["redundancy"] == "primal_dual.analysis.attention_maps:run_redundancy"
  assert analysis.ANALYSES["latent_code"] == "primal_dual.analysis.latent_code:run"
  assert analysis.get_analysis("redundancy") is attention_maps.run_redundancy
  with pytest.raises(errors.UnknownNameError, match="redundancy"):
    analysis.get_analysis("redundnacy")
  with pytest.raises(ValueError, match="already registered"):
    analysis.register_analysis("redundancy", "x:y")


def test_plots_write_pngs(tmp_path):
  rng = np.random.default_rng(7)
  maps = {"softmax": [_random_maps(rng, (2, 5, 5))] * 2, "bn_sh": [_random_maps(rng, (4, 5, 5))]}
  grid_png = plots.plot_attention_grid(maps, str(tmp_path / "maps.png"), title="t")
  bars_png = plots.plot_redundancy_bars(
    {"JV": {"softmax": (0.2, 0.01), "bn_sh": (0.5, 0.02)}, "BM": {"softmax": (0.3, 0.0)}},
    str(tmp_path / "bars.png"),
  )
  for path in (grid_png, bars_png):
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError):
    plots.plot_attention_grid({}, str(tmp_path / "empty.png"))
