"""Mask helpers on small hand-checked cases."""

import flax.linen as nn
import numpy as np
import pytest

from primal_dual.kernels import (
  causal_mask,
  combine_masks,
  local_mask,
  padding_mask,
  softmax_attention,
  strided_mask,
)


def as_01(mask):
  return np.asarray(mask).astype(int)


def test_causal_mask():
  np.testing.assert_array_equal(as_01(causal_mask(3)), [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
  # Default top_left (Flax, jax.nn): query i sees keys j <= i.
  np.testing.assert_array_equal(as_01(causal_mask(2, 4)), [[1, 0, 0, 0], [1, 1, 0, 0]])
  # bottom_right: the queries are the last two of four positions; the last query sees every key.
  np.testing.assert_array_equal(
    as_01(causal_mask(2, 4, alignment="bottom_right")), [[1, 1, 1, 0], [1, 1, 1, 1]]
  )
  np.testing.assert_array_equal(
    as_01(causal_mask(3, 2, alignment="bottom_right")), [[0, 0], [1, 0], [1, 1]]
  )
  assert causal_mask(3).dtype == np.bool_
  with pytest.raises(ValueError, match="causal_alignment must be one of"):
    causal_mask(2, 4, alignment="middle")


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_mask_matches_is_causal(alignment):
  rng = np.random.default_rng(0)
  query = rng.normal(size=(3, 1, 2)).astype(np.float32)
  key = rng.normal(size=(4, 1, 2)).astype(np.float32)
  value = rng.normal(size=(4, 1, 2)).astype(np.float32)
  np.testing.assert_allclose(
    softmax_attention(query, key, value, mask=causal_mask(3, 4, alignment=alignment)),
    softmax_attention(query, key, value, is_causal=True, causal_alignment=alignment),
    atol=1e-6,
  )


def test_causal_mask_equals_flax_make_causal_mask():
  flax_mask = nn.make_causal_mask(np.zeros((1, 4)))  # float32 [1, 1, 4, 4]
  np.testing.assert_array_equal(flax_mask[0, 0] != 0, causal_mask(4))


def test_local_mask():
  np.testing.assert_array_equal(
    as_01(local_mask(5, 3)),
    [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]],
  )
  # Even window: |i - j| <= 1 as well (window // 2 = 1).
  np.testing.assert_array_equal(local_mask(5, 2), local_mask(5, 3))
  np.testing.assert_array_equal(
    as_01(local_mask(4, 2, causal=True)), [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
  )
  np.testing.assert_array_equal(local_mask(4, 1), np.eye(4, dtype=bool))


def test_strided_mask():
  np.testing.assert_array_equal(
    as_01(strided_mask(5, 2)),
    [[1, 0, 1, 0, 1], [0, 1, 0, 1, 0], [1, 0, 1, 0, 1], [0, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
  )
  np.testing.assert_array_equal(
    as_01(strided_mask(5, 3, causal=True)),
    [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [1, 0, 0, 1, 0], [0, 1, 0, 0, 1]],
  )


def test_union_of_local_and_strided_is_the_sparse_transformer_pattern():
  union = combine_masks(local_mask(5, 2, causal=True), strided_mask(5, 2, causal=True), op="or")
  np.testing.assert_array_equal(
    as_01(union),
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [1, 0, 1, 1, 1]],
  )


def test_combine_masks():
  row = np.array([[True, False, True]])
  column = np.array([[True], [False]])
  np.testing.assert_array_equal(as_01(combine_masks(row, None, column)), [[1, 0, 1], [0, 0, 0]])
  np.testing.assert_array_equal(as_01(combine_masks(row, column, op="or")), [[1, 1, 1], [1, 0, 1]])
  np.testing.assert_array_equal(combine_masks(None, row), row)
  assert combine_masks(None, None) is None
  with pytest.raises(ValueError, match="op must be one of.*'xor'"):
    combine_masks(row, op="xor")
  with pytest.raises(ValueError, match=r"do not broadcast.*\(1, 3\).*\(2,\)"):
    combine_masks(row, np.ones(2, bool))
  # Masks of any dtype: nonzero = may attend (Flax's masks are float32); the result is bool.
  combined = combine_masks(row, np.array([[0.0], [2.0]], np.float32))
  assert combined.dtype == np.bool_
  np.testing.assert_array_equal(as_01(combined), [[0, 0, 0], [1, 0, 1]])


def test_padding_mask():
  key_valid = np.array([[True, True, False], [True, False, False]])
  key_only = padding_mask(key_valid)
  assert key_only.shape == (2, 1, 1, 3)
  np.testing.assert_array_equal(key_only[:, 0, 0], key_valid)

  query_valid = np.array([[True, False], [True, True]])
  both = padding_mask(key_valid, query_valid)
  assert both.shape == (2, 1, 2, 3)
  np.testing.assert_array_equal(as_01(both[0, 0]), [[1, 1, 0], [0, 0, 0]])
  np.testing.assert_array_equal(as_01(both[1, 0]), [[1, 0, 0], [1, 0, 0]])

  assert padding_mask(np.ones((2, 3, 4), bool)).shape == (2, 3, 1, 1, 4)  # two batch dims
  with pytest.raises(ValueError, match="key_valid must be a bool"):
    padding_mask(np.ones((2, 3)))
  with pytest.raises(ValueError, match=r"query_valid.*\(3, 2\).*\(2, 3\)"):
    padding_mask(key_valid, np.ones((3, 2), bool))


@pytest.mark.parametrize(
  "make_mask", [lambda: local_mask(3, 0), lambda: strided_mask(3, 0), lambda: causal_mask(0)]
)
def test_bad_sizes_raise(make_mask):
  with pytest.raises(ValueError, match="must be a positive integer"):
    make_mask()
