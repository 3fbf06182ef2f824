"""Fused Triton HYLA (primal_dual/kernels/hyla/tensorcore.py), its own kernel source run by Triton's
interpreter on the CPU, against the blockwise path, the float64 loop reference and jax.grad; and
its sm_90a compilation (no GPU needed)."""

import functools
import itertools
import sys
import types

import jax
import jax.numpy as jnp
import helpers
import numpy as np
import gpu_dev
import pytest

gpu_dev.require()  # triton and torch: skipped, saying so, without them

from numpy_reference import hyla_ref  # noqa: E402
from primal_dual.kernels import hyla  # noqa: E402
from primal_dual.kernels.hyla import blockwise as hb  # noqa: E402
from primal_dual.kernels.hyla import tensorcore as ht  # noqa: E402

COMBINATIONS = list(itertools.product(ht.NORMALIZATIONS, ht.VALUE_NETWORKS))
HIGHEST = jax.lax.Precision.HIGHEST  # float32 products in the blockwise path too
assert_close = helpers.assert_close
loss_and_grads = functools.partial(helpers.loss_and_grads, precision=HIGHEST)


blockwise = functools.partial(hb.hyla_blockwise_attention, block_size=8)


@pytest.mark.parametrize("case", range(len(COMBINATIONS)))
def test_forward_and_gradients_equal_blockwise_and_float64_reference(case):
  """18 queries, 20 keys (two ragged tiles of 16 each), d_v = 17 (two value chunks of 16); padding
  mask, a bias shared by the batch, causal in both alignments."""
  normalization, value_network = COMBINATIONS[case]
  batch_shape = [(1,), (2, 1)][case % 2]
  alignment = ["top_left", "bottom_right"][case // 3]
  options = dict(
    normalization=normalization,
    value_network=value_network,
    is_causal=case % 3 != 0,
    causal_alignment=alignment,
  )
  rng = np.random.default_rng(case)
  q, k, v = helpers.random_qkv(rng, batch_shape, 18, 20, 2, d=5, d_v=17)
  mask = helpers.padding_mask(rng, batch_shape, 20, min_valid=10)
  bias = rng.normal(size=(2, 18, 20)).astype(np.float32)
  two_chunks = functools.partial(ht.hyla_tensorcore_attention, value_chunk=16)
  out, grads = loss_and_grads(two_chunks, q, k, v, bias, mask, **options)
  ref_out, ref_grads = loss_and_grads(blockwise, q, k, v, bias, mask, **options)
  assert out.shape == ref_out.shape == q.shape[:-1] + (17,) and out.dtype == jnp.float32
  assert_close(out, ref_out)
  for grad, ref_grad in zip(grads, ref_grads, strict=True):
    assert grad.shape == ref_grad.shape and grad.dtype == ref_grad.dtype
    assert_close(grad, ref_grad, floor=max(0.05, float(np.abs(ref_out).max())))
  assert_close(out, hyla_ref(q, k, v, bias, mask, **options)[0], 1e-4)
  assert np.abs(out).max() > 0.1 and all(np.abs(g).max() > 1e-3 for g in grads)


def test_fully_masked_rows_give_zeros_and_finite_gradients():
  """A mask hiding every key from some queries (and all of one example): zeros, no NaN."""
  rng = np.random.default_rng(7)
  q, k, v = helpers.random_qkv(rng, (2,), 17, 9, 3, d=4, d_v=3)
  mask = rng.random((2, 1, 17, 9)) > 0.4
  mask[:, :, 3] = False
  mask[1] = False
  out, grads = loss_and_grads(ht.hyla_tensorcore_attention, q, k, v, None, mask)
  ref_out, ref_grads = loss_and_grads(blockwise, q, k, v, None, mask)
  assert np.all(np.asarray(out)[:, 3] == 0) and np.all(np.asarray(out)[1] == 0)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)
  assert_close(out, ref_out)
  for grad, ref_grad in zip(grads, ref_grads, strict=True):
    assert_close(grad, ref_grad, floor=max(0.05, float(np.abs(ref_out).max())))


def test_broadcast_bias_gets_its_own_shape_gradient():
  """A bias per example and key (shared by heads and queries) and a mask per query and key: the
  atomic adds of the bias gradient sum over the broadcast axes, as the blockwise path does."""
  rng = np.random.default_rng(11)
  q, k, v = helpers.random_qkv(rng, (2,), 17, 18, 2, d=4, d_v=3)
  bias = rng.normal(size=(2, 1, 1, 18)).astype(np.float32)
  mask = rng.random((1, 1, 17, 18)) > 0.2
  options = dict(is_causal=True, causal_alignment="bottom_right")
  out, grads = loss_and_grads(ht.hyla_tensorcore_attention, q, k, v, bias, mask, **options)
  ref_out, ref_grads = loss_and_grads(blockwise, q, k, v, bias, mask, **options)
  assert grads[3].shape == bias.shape
  assert_close(out, ref_out)
  for grad, ref_grad in zip(grads, ref_grads, strict=True):
    assert_close(grad, ref_grad, floor=max(0.05, float(np.abs(ref_out).max())))


@pytest.mark.parametrize("widen", [False, True])
def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients_close_to_blockwise(widen):
  """The same roundings of a and u as the blockwise path: equal up to float32 summation order and
  one bfloat16 rounding (the interpreter mended to round and multiply bfloat16 as a GPU does),
  whether the 16-bit kernels run or the float32 ones on widened inputs (a GPU's default)."""
  rng = np.random.default_rng(3)
  q, k, v = (
    jnp.asarray(x, jnp.bfloat16) for x in helpers.random_qkv(rng, (1,), 12, 20, 3, d=8, d_v=8)
  )
  mask = helpers.padding_mask(rng, (1,), 20, min_valid=10)
  cotangent = jnp.asarray(rng.normal(size=(1, 12, 3, 8)), jnp.bfloat16)

  def out_and_grads(attention):  # a fixed cotangent: sin(out) would amplify out's rounding
    out, vjp = jax.vjp(lambda *x: attention(*x, None, mask), q, k, v)
    return out, vjp(cotangent)

  tensorcore = functools.partial(ht.hyla_tensorcore_attention, widen_16bit=widen)
  out, grads = jax.jit(lambda: out_and_grads(tensorcore))()
  ref_out, ref_grads = jax.jit(lambda: out_and_grads(blockwise))()
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  assert_close(out, ref_out, 5e-3)
  for grad, ref_grad in zip(grads, ref_grads, strict=True):
    assert_close(grad, ref_grad, 5e-3)


def test_hyla_attention_runs_it_only_when_asked():
  """``implementation='tensorcore'`` runs these kernels; ``'auto'`` never picks them."""
  rng = np.random.default_rng(5)
  q, k, v = helpers.random_qkv(rng, (1,), 6, 7, 2)
  # HIGHEST: float32 products in both (by default a GPU runs TF32 products, each path its own).
  out = hyla.hyla_attention(q, k, v, implementation="tensorcore", block_size=4, precision=HIGHEST)
  ref = hyla.hyla_attention(q, k, v, implementation="xla", block_size=4, precision=HIGHEST)
  assert_close(out, ref, 1e-4)
  jaxpr = str(
    jax.make_jaxpr(lambda *x: hyla.hyla_attention(*x, implementation="tensorcore"))(q, k, v)
  )
  # The kernels ran (Triton's interpreter off GPU, jax-triton's launch on one), not the XLA path;
  # run on a GPU (JAX_PLATFORMS=cuda), these tests check the compiled kernels.
  launch = "triton_kernel_call" if jax.default_backend() == "gpu" else "pure_callback"
  assert launch in jaxpr
  auto = str(jax.make_jaxpr(lambda *x: hyla.hyla_attention(*x, block_size=4))(q, k, v))
  assert launch not in auto


def test_auto_never_selects_it_on_a_gpu_backend(monkeypatch):
  """No backend's order names it yet ('tensorcore' runs only by name), and a call the tiles cannot
  serve is refused by name before any kernel is built (nothing runs here)."""
  assert all("tensorcore" not in order for order in hyla.DEFAULT_ORDER.values())
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert hyla.default_order() == ("xla",)
  q, k, v = helpers.random_qkv(np.random.default_rng(39), (1,), 128, 128, 2)
  for options, reason in (
    (dict(normalization="softmax"), r"\(normalization='softmax'\)"),
    (dict(block_size=None), r"\(block_size=None asks for the dense path\)"),
    (dict(return_weights=True), r"\(return_weights=True\)"),
  ):
    with pytest.raises(
      ValueError, match="implementation='tensorcore' cannot serve this call " + reason
    ):
      hyla.hyla_attention(q, k, v, implementation="tensorcore", **options)


def test_16bit_inputs_widen_on_a_gpu_by_default_and_round_as_their_dtype(monkeypatch):
  """A GPU call widens 16-bit inputs until a device run shows the 16-bit kernels right, and then
  still under the Triton versions with the fault; the interpreter runs the 16-bit kernels; the
  kernels round a and u as the inputs' dtype."""
  assert not ht.NATIVE_16BIT_ON_GPU
  assert ht.widens_16bit(None, interpret=False) and not ht.widens_16bit(None, interpret=True)
  assert ht.widens_16bit(True, interpret=True) and not ht.widens_16bit(False, interpret=False)
  monkeypatch.setattr(ht, "NATIVE_16BIT_ON_GPU", True)
  assert ht.widens_16bit(None, interpret=False, triton_version="3.7.1")
  assert not ht.widens_16bit(None, interpret=False, triton_version="3.8.0")
  assert not ht.widens_16bit(None, interpret=False, triton_version="3.10.0+git8f1e2d")
  assert ht.triton_version_tuple("3.6.0") == (3, 6)
  assert [ht.value_rounding(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)] == [
    "bf16",
    "fp16",
    "fp32",
  ]


def test_widened_16bit_inputs_give_the_16bit_kernels_function():
  """Float32 kernels on widened bfloat16 inputs, a and u rounded to bfloat16, equal the bfloat16
  kernels up to float32 summation order (float32 outputs; without the rounding they differ by
  about 1e-3)."""
  rng = np.random.default_rng(4)
  q, k, v = (
    jnp.asarray(x, jnp.bfloat16) for x in helpers.random_qkv(rng, (1,), 12, 20, 3, d=8, d_v=20)
  )
  mask = helpers.padding_mask(rng, (1,), 20, min_valid=10)
  outs = {
    widen: jax.jit(
      functools.partial(ht.hyla_tensorcore_attention, dtype=jnp.float32, widen_16bit=widen)
    )(q, k, v, None, mask)
    for widen in (False, True)
  }
  assert outs[True].dtype == jnp.float32
  assert_close(outs[True], outs[False], 1e-5)
  unrounded = blockwise(*(x.astype(jnp.float32) for x in (q, k, v)), None, mask)
  assert np.abs(np.asarray(unrounded) - np.asarray(outs[False])).max() > 1e-3


@pytest.mark.parametrize(
  "dtype, widen, causal, operand_bits",
  [
    (jnp.float32, None, False, 32),
    (jnp.bfloat16, None, True, 32),  # a GPU call widens by default
    (jnp.bfloat16, False, False, 16),
    (jnp.bfloat16, False, True, 16),
  ],
)
def test_gpu_launches_take_the_default_tuning_of_their_operands(
  monkeypatch, dtype, widen, causal, operand_bits
):
  """Each jax-triton launch gets the value chunk, warps and pipelining stages of
  ``default_tuning`` for the operands it is given (the settings the compile report checks;
  jax-triton's own default is 3 stages), recorded here by a stand-in for jax-triton."""
  launches = []

  def triton_call(*inputs, kernel, out_type, grid, num_warps, num_stages, **constants):
    operands = {x.dtype for x in inputs[:3]}
    launches.append((grid, num_warps, num_stages, constants["BV"], operands))
    assert out_type == () and "zeroed_outputs" not in constants  # outputs: the zeroed refs
    return ()

  monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_call))
  q, k, v = (
    jnp.asarray(x, dtype)
    for x in helpers.random_qkv(np.random.default_rng(0), (1,), 40, 40, 8, d=64, d_v=64)
  )
  attend = functools.partial(
    ht.hyla_tensorcore_attention, is_causal=causal, interpret=False, widen_16bit=widen
  )
  out, vjp = jax.vjp(attend, q, k, v)
  vjp(out)
  operand_dtype = jnp.float32 if operand_bits == 32 else jnp.bfloat16
  chunk, warps, stages = ht.default_tuning(operand_dtype, causal)
  assert [launch[1:] for launch in launches] == [
    (getattr(warps, name), stages, chunk, {jnp.dtype(operand_dtype)})
    for name in ("forward", "dq_dk", "dv")
  ]
  assert launches[0][0] == (1, 3, 64 // chunk)  # forward grid: example, query tiles, chunks


@pytest.mark.parametrize("api", ["0.4", "0.3"])
def test_gpu_launches_use_the_installed_jax_triton_api(monkeypatch, api):
  """jax-triton 0.4's API: ``out_type`` and the outputs as zeroed ``jax.Ref`` arguments the kernel
  writes (``out_shape`` and ``zeroed_outputs`` deprecated); 0.3's (the device image's): those two.
  A stand-in of each signature writes ones into every output (refs: the dq_dk launch's atomic
  adds into zeros); the call returns them."""
  calls = []

  def current(*args, kernel, out_type, grid, num_warps, num_stages, **constants):
    refs = [a for a in args if isinstance(a, jax.Ref)]  # after the inputs: out; dq, dk, dv, dbias
    assert out_type == () and args[len(args) - len(refs) :] == tuple(refs)
    assert len(refs) == (1 if kernel is ht.forward_kernel else 4)
    for ref in refs:
      ref[...] += 1
    calls.append(("out_type", kernel))
    return ()

  def previous(*inputs, kernel, out_shape, zeroed_outputs, grid, num_warps, num_stages, **consts):
    assert zeroed_outputs == tuple(range(len(out_shape)))
    calls.append(("out_shape", kernel))
    return tuple(jnp.ones(s.shape, s.dtype) for s in out_shape)

  triton_call = current if api == "0.4" else previous
  assert ht.jax_triton_uses_refs(triton_call) == (api == "0.4")
  monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_call))
  q, k, v = helpers.random_qkv(np.random.default_rng(0), (1,), 20, 20, 2, d=4)
  attend = functools.partial(ht.hyla_tensorcore_attention, interpret=False)
  out, vjp = jax.vjp(jax.jit(attend), q, k, v)
  grads = vjp(out)
  keyword = "out_type" if api == "0.4" else "out_shape"
  assert set(calls) == {(keyword, ht.forward_kernel), (keyword, ht.dkv_kernel)}
  assert np.all(np.asarray(out) == 1) and all(np.all(np.asarray(g) == 1) for g in grads)


@pytest.mark.parametrize(
  "call, message",
  [
    (lambda q, k, v: ht.hyla_tensorcore_attention(q, k[:, :, :1], v), r"\(1, 5, 1, 4\)"),
    (lambda q, k, v: ht.hyla_tensorcore_attention(q, k, v, normalization="softmax"), "softmax"),
    (lambda q, k, v: ht.hyla_tensorcore_attention(q, k, v, value_chunk=0), "value_chunk"),
    (lambda q, k, v: ht.hyla_tensorcore_attention(q, k, v, num_stages=1.5), "num_stages must"),
    (lambda q, k, v: ht.hyla_tensorcore_attention(q, k, v, block_size=0), "block_size"),
    (lambda q, k, v: ht.hyla_tensorcore_attention(q, k, v, mask=np.ones((3, 4))), "mask"),
  ],
)
def test_bad_input_raises_value_error_naming_it(call, message):
  q, k, v = helpers.random_qkv(np.random.default_rng(0), (1,), 4, 5, 2, d=4)
  with pytest.raises(ValueError, match=message):
    call(q, k, v)


@pytest.mark.parametrize("launch", ["forward", "dq_dk", "dv"])
def test_masked_16bit_products_keep_operand_widths_within_k(launch, tmp_path):
  """With a key-padding mask (as in lease 7's failing test), Triton 3.6 and 3.7 give the
  forward's head-coupled bfloat16 products operands of kWidth 8 at K = 16, which an H100
  computed wrong; the installed Triton must keep them within K / 4 (Triton 3.8 and 3.9: 4)."""
  from tools.device import gpu_compile

  family = gpu_compile.FAMILIES["tensorcore"]
  setting = gpu_compile.tensorcore_default_setting()
  job = gpu_compile.tensorcore_job(setting, family.shape, launch)
  masked = gpu_compile.tensorcore_config(setting, family.shape)._replace(
    mask_shape=(1, 1, 1, family.shape.length)
  )
  # The launch's WANT_DK kept.
  constants = {**job.source["constants"], **ht.kernel_constants(masked)}
  job = job._replace(source={**job.source, "constants": constants})
  figures = gpu_compile.compile_kernel(job, tmp_path, memory_cap_gib=6, timeout_s=300)
  assert figures["status"] == "ok", figures
  widths = figures["dot_operands"]
  assert widths and all(w["fits"] for w in widths), widths


@pytest.mark.parametrize(  # dq_dk: the most registers; causal: its own default value chunk;
  "operands, launch, causal",  # fp32: float32 inputs, and 16-bit ones a GPU call widens
  [
    ("bf16", "forward", False),
    ("bf16", "dq_dk", False),
    ("bf16", "dq_dk", True),
    ("fp32", "dq_dk", False),
    ("fp32", "dq_dk", True),
    ("fp32", "dv", False),
  ],
)
def test_default_kernels_compile_for_sm90a_without_spills_on_matrix_units(
  operands, launch, causal, tmp_path
):
  """At the issue's shape (bfloat16 values, H = 8, d = 64) and the default tuning of the
  operands: no spills, shared memory within an H100 block, the loop's products on mma (more of
  them than FFMAs)."""
  from tools.device import gpu_compile

  family = gpu_compile.FAMILIES["tensorcore"]
  setting = gpu_compile.tensorcore_default_setting(operands, causal)
  assert setting in family.settings()
  job = gpu_compile.tensorcore_job(setting, family.shape, launch)
  figures = gpu_compile.compile_kernel(job, tmp_path, memory_cap_gib=6, timeout_s=300)
  assert figures["status"] == "ok", figures
  assert figures["spill_store_bytes"] == figures["spill_load_bytes"] == 0, figures
  assert figures["shared_bytes"] <= gpu_compile.SHARED_MEMORY_LIMIT_BYTES
  loop = figures["sass_loop"]
  assert loop["hmma"] + loop["hgmma"] > loop["ffma"], loop
  # The 16-bit products (the forward's; the backward multiplies float32 outside mix_heads) with
  # operands of at most a quarter of K per thread: the Triton 3.6 fault of lease 7 is absent.
  widths = figures["dot_operands"]
  assert all(w["fits"] for w in widths) and (launch != "forward" or len(widths) == 3), widths
  assert figures["meets_targets"], figures["targets"]
