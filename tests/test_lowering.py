"""What runs on a GPU or TPU lowers there: programs lowered on this CPU for CUDA and TPU.

``jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))`` builds the device program without
a device. With ``jax.default_backend()`` reported as the device's (``device_backend``), every
``implementation='auto'`` in the library chooses as it would on that device, so these tests see
the failures a user would meet there: a kernel path that does not lower for a platform, a
softmax call that silently leaves cuDNN. Nothing is compiled or run; the arguments are abstract
(``jax.ShapeDtypeStruct``).

* every HYLA implementation that ``implementation='auto'`` may pick on a GPU or a TPU (the
  backend's ``hyla.DEFAULT_ORDER``), forward and gradient, lowers there for small calls (dense,
  blockwise, masked, biased, causal);
* every registered variant in the Linen and NNX layers, forward and gradient, bfloat16, lengths
  256 and 1024, without a mask, with a key-padding mask and causal, lowers for CUDA and TPU; where
  a variant can take the fused softmax path, the CUDA program holds cuDNN's attention calls;
* the trainer's jitted train and evaluation programs of every packaged config (``runlocal``)
  lower for CUDA and TPU;
* in bfloat16 (``bf16``), the train program of every packaged config with softmax, and of the
  default one with BN, SH and BN+SH, one run and two replicas, holds cuDNN's forward and backward
  attention calls, each fed bias and lengths rows of its own queries, and no float32 matrix
  product; it lowers for TPU too.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import custom_partitioning  # names the partitioned cuDNN calls
from jax._src.cudnn import fused_attention_stablehlo  # its cuDNN version check is stubbed

from primal_dual import configs, registry
from primal_dual import nnx as pd_nnx
from primal_dual.kernels import hyla
from primal_dual.layers import MultiHeadAttention
from primal_dual.training import config_lib, setup, sharding

# Lowering platform -> what jax.default_backend() says on such a device.
BACKENDS = {"cuda": "gpu", "tpu": "tpu"}
MOSAIC_GPU_CALL = "mosaic_gpu"  # Mosaic GPU's custom calls are mosaic_gpu and mosaic_gpu_v2
CUDNN_FORWARD, CUDNN_BACKWARD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"
# A cuDNN release the fused attention accepts (the CPU has none to report).
STUB_CUDNN_VERSION = 90800


@pytest.fixture
def device_backend(monkeypatch):
  """``report(platform)``: from then on ``jax.default_backend()`` reports that platform's backend,
  and cuDNN's version check (which asks the CUDA libraries, absent here) reports a release that
  supports fused attention. Caches are cleared on each change of backend and at the end."""
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: STUB_CUDNN_VERSION)

  def report(platform: str) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: BACKENDS[platform])
    # Traces cached under another reported backend would carry that backend's choices.
    jax.clear_caches()

  yield report
  jax.clear_caches()


def lowered_text(fn, args, platform: str) -> str:
  """StableHLO text of ``jax.jit(fn)(*args)`` lowered for ``platform`` (nothing compiled)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def custom_calls(text: str) -> set[str]:
  """Targets of the custom calls in lowered StableHLO text."""
  return set(re.findall(r"custom_call @([^\s(]+)\(", text))


# --- HYLA: every implementation that implementation='auto' may pick --------------------------

HYLA_BATCH, HYLA_HEADS, HYLA_LEN, HYLA_D = 2, 3, 40, 8
# Small bfloat16 calls, one change at a time: the dense path, the blockwise one (ragged against
# the tile), block_size='auto' short (dense) and long (blockwise), masks, a bias and causal.
HYLA_CALLS = {
  "dense": dict(block_size=None),
  "blockwise": dict(block_size=16),
  "auto_short": dict(),
  "auto_long": dict(length=128),
  "key_padding_mask": dict(block_size=16, mask=(HYLA_BATCH, 1, 1, HYLA_LEN)),
  "bias_per_key_causal": dict(block_size=16, bias=(1, HYLA_HEADS, 1, HYLA_LEN), is_causal=True),
  "norm_none_linear_value": dict(block_size=16, normalization="none", value_network="linear"),
  "softmax_dense": dict(normalization="softmax"),
}
HYLA_ORDERS = [
  (platform, name) for platform in BACKENDS for name in hyla.DEFAULT_ORDER[BACKENDS[platform]]
]


def hyla_program(implementation: str, case: dict):
  """``(fn, args)``: ``hyla_attention``'s forward and its gradient w.r.t. q, k, v (and bias)."""
  case = dict(case)
  length = case.pop("length", HYLA_LEN)
  bias_shape, mask_shape = case.pop("bias", None), case.pop("mask", None)
  qkv = jax.ShapeDtypeStruct((HYLA_BATCH, length, HYLA_HEADS, HYLA_D), jnp.bfloat16)
  args = [
    qkv,
    qkv,
    qkv,
    None if bias_shape is None else jax.ShapeDtypeStruct(bias_shape, jnp.float32),
    None if mask_shape is None else jax.ShapeDtypeStruct(mask_shape, jnp.bool_),
  ]
  argnums = (0, 1, 2) if bias_shape is None else (0, 1, 2, 3)

  def loss(q, k, v, bias, mask):
    out = hyla.hyla_attention(q, k, v, bias, mask, implementation=implementation, **case)
    return jnp.sum(out.astype(jnp.float32)), out

  def forward_and_gradient(*args):
    return jax.grad(loss, argnums=argnums, has_aux=True)(*args)

  return forward_and_gradient, args


@pytest.mark.parametrize("platform,implementation", HYLA_ORDERS)
def test_every_hyla_implementation_auto_may_pick_lowers(platform, implementation, device_backend):
  """Each implementation of the backend's order lowers every small call it serves (a refusal is
  the ValueError of a named implementation that cannot serve the call), at least one."""
  device_backend(platform)
  assert hyla.default_order() == hyla.DEFAULT_ORDER[BACKENDS[platform]]
  lowered = []
  for name, case in HYLA_CALLS.items():
    fn, args = hyla_program(implementation, case)
    try:
      text = lowered_text(fn, args, platform)
    except ValueError as error:
      assert "cannot serve this call" in str(error), (name, error)
      continue
    assert "stablehlo" in text, name
    lowered.append(name)
  assert lowered, f"{implementation} lowered no call for {platform}"
  if implementation == "xla":
    assert lowered == list(HYLA_CALLS)  # it serves every call


@pytest.mark.parametrize("platform", list(BACKENDS))
def test_hyla_auto_lowers_for_every_call(platform, device_backend):
  device_backend(platform)
  for name, case in HYLA_CALLS.items():
    fn, args = hyla_program("auto", case)
    assert "stablehlo" in lowered_text(fn, args, platform), name


# --- Every registered variant in the Linen and NNX layers ---------------------------------------

LAYER_BATCH, LAYER_HEADS, LAYER_FEATURES = 2, 4, 64  # head size 16: cuDNN takes it
LENGTHS = (256, 1024)
MASKINGS = ("plain", "key_padding", "causal")


def layer_options(name: str) -> dict:
  """Constructor arguments shared by both layers for variant ``name``."""
  return dict(
    num_heads=LAYER_HEADS,
    attention=name,
    attention_options=registry.model_options(name, LAYER_HEADS),
    dtype=jnp.bfloat16,
  )


def layer_inputs(length: int) -> tuple:
  """Abstract bfloat16 inputs ``[B, length, F]`` and key-validity ``[B, length]``."""
  return (
    jax.ShapeDtypeStruct((LAYER_BATCH, length, LAYER_FEATURES), jnp.bfloat16),
    jax.ShapeDtypeStruct((LAYER_BATCH, length), jnp.bool_),
  )


def constructor_arguments(masking: str) -> dict:
  """Layer attributes of ``masking`` (causal is the layers' ``is_causal``, as a user sets it)."""
  return {"is_causal": True} if masking == "causal" else {}


def call_arguments(masking: str, valid) -> dict:
  """Call arguments of ``masking``: a key-padding mask ``[B, 1, 1, length]`` from ``valid``."""
  return {"mask": valid[:, None, None, :]} if masking == "key_padding" else {}


def layer_program(apply_layer, params):
  """``(fn, args)``: the layer's summed outputs and their gradient w.r.t. the parameters and the
  inputs, over every length and masking, as one program. ``apply_layer(params, masking, x,
  **call_arguments)`` runs the layer."""

  def loss(params, xs, valids):
    return sum(
      jnp.sum(
        apply_layer(params, masking, x, **call_arguments(masking, valids[length])).astype(
          jnp.float32
        )
      )
      for length, x in xs.items()
      for masking in MASKINGS
    )

  xs = {length: layer_inputs(length)[0] for length in LENGTHS}
  valids = {length: layer_inputs(length)[1] for length in LENGTHS}
  return jax.value_and_grad(loss, argnums=(0, 1)), (params, xs, valids)


def linen_program(name: str):
  modules = {
    m: MultiHeadAttention(**layer_options(name), **constructor_arguments(m)) for m in MASKINGS
  }
  x = layer_inputs(LENGTHS[0])[0]
  params = jax.eval_shape(
    lambda: nn.unbox(modules["plain"].init(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))
  )

  def apply_layer(params, masking, x, **kwargs):
    return modules[masking].apply(params, x, **kwargs)

  return layer_program(apply_layer, params)


def nnx_program(name: str):
  graphdefs, states = {}, {}
  for masking in MASKINGS:
    module = nnx.eval_shape(
      lambda m=masking: pd_nnx.MultiHeadAttention(
        in_features=LAYER_FEATURES,
        rngs=nnx.Rngs(0),
        **layer_options(name),
        **constructor_arguments(m),
      )
    )
    graphdefs[masking], states[masking] = nnx.split(module)

  def apply_layer(state, masking, x, **kwargs):
    return nnx.merge(graphdefs[masking], state)(x, **kwargs)

  return layer_program(apply_layer, states["plain"])


LAYER_PROGRAMS = {"linen": linen_program, "nnx": nnx_program}


def takes_fused_softmax(name: str) -> bool:
  """Whether variant ``name`` can run its product through ``jax.nn.dot_product_attention``: its
  layer accepts ``implementation='fused'`` for an unmasked bfloat16 call."""
  module = MultiHeadAttention(
    num_heads=LAYER_HEADS,
    attention=name,
    attention_options={**registry.model_options(name, LAYER_HEADS), "implementation": "fused"},
    dtype=jnp.bfloat16,
  )
  x = jnp.zeros((1, 8, LAYER_FEATURES), jnp.bfloat16)
  try:
    jax.eval_shape(lambda: module.init_with_output(jax.random.key(0), x))
  except (ValueError, TypeError):
    return False
  return True


@pytest.mark.parametrize("platform", list(BACKENDS))
@pytest.mark.parametrize("layer", list(LAYER_PROGRAMS))
@pytest.mark.parametrize("name", sorted(registry.ATTENTION_REGISTRY))
def test_every_variant_layer_lowers_for_cuda_and_tpu(name, layer, platform, device_backend):
  """Forward and gradient, bfloat16, lengths 256 and 1024, unmasked / key padding / causal."""
  device_backend(platform)
  fn, args = LAYER_PROGRAMS[layer](name)
  calls = custom_calls(lowered_text(fn, args, platform))
  assert not any(MOSAIC_GPU_CALL in call for call in calls), calls
  if platform == "cuda" and takes_fused_softmax(name):
    # Unmasked and causal calls at head size 16 in bfloat16 are cuDNN's.
    assert {CUDNN_FORWARD, CUDNN_BACKWARD} <= calls, calls


# --- The trainer's programs of every packaged config --------------------------------------------


@pytest.fixture(scope="module")
def runlocal_program(tmp_path_factory):
  """``get(name, arg='runlocal', fields={})``: the trainer's Program of packaged config ``name``
  with the config argument ``arg`` and the dotted ``fields`` set (as ``--config.<field>``), built
  once (its data are generated or shipped; a TFDS preparation goes to a temporary folder)."""
  built = {}
  data_dir = tmp_path_factory.mktemp("tfds")

  def get(name: str, arg: str = "runlocal", fields: dict | None = None) -> setup.Program:
    key = (name, arg, tuple(sorted((fields or {}).items())))
    if key not in built:
      config = config_lib.with_fields(configs.load(name, arg), fields or {})
      if "data_dir" in config.data:
        config.data.data_dir = str(data_dir)
      built[key] = setup.build_program(setup.resolve_config(config))
    return built[key]

  return get


def abstract_batch(source, rows: int, *, leading=(), valid: bool = False) -> dict:
  """Abstract ``[*leading, rows, ...]`` batch of ``source``'s records (plus eval's ``valid``)."""
  batch = {
    field: jax.ShapeDtypeStruct((*leading, rows, *np.shape(value)), np.asarray(value).dtype)
    for field, value in source[0].items()
  }
  if valid:
    batch["valid"] = jax.ShapeDtypeStruct((*leading, rows), jnp.bool_)
  return batch


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def trainer_programs(program: setup.Program) -> dict:
  """``{'train' | 'eval': (jitted program, abstract args)}``: the program the trainer runs for
  ``steps_per_call`` steps (``StepRunner``) and the evaluation step."""
  runner = program.run_steps
  state = jax.eval_shape(program.init.__wrapped__)
  train_source = program.splits["train"]
  steps = runner.steps_per_call
  if runner.device_data:
    train_args = (state, None, abstract(runner.stream_arguments), abstract(runner.hyperparameters))
  elif steps == 1:
    train_args = (
      state,
      abstract_batch(train_source, program.config.batch_size),
      abstract(runner.hyperparameters),
    )
  else:
    batches = abstract_batch(train_source, program.config.batch_size, leading=(steps,))
    train_args = (
      state,
      batches,
      abstract(runner.stream_arguments),
      abstract(runner.hyperparameters),
    )
  eval_source = program.splits[program.eval_splits[0]]
  eval_args = (state, abstract_batch(eval_source, program.eval_batch_size, valid=True))
  return {
    # The trainer's programs run inside the mesh context (setup._in_mesh); lower the jitted ones.
    "train": (runner._compile(steps).__wrapped__, train_args),
    "eval": (program.eval_step.__wrapped__, eval_args),
  }


@pytest.mark.parametrize("platform", list(BACKENDS))
@pytest.mark.parametrize("name", configs.packaged_names())
def test_every_packaged_config_trains_and_evaluates_on_cuda_and_tpu(
  name, platform, device_backend, runlocal_program
):
  program = runlocal_program(name)
  device_backend(platform)
  with sharding.mesh_context(program.mesh):
    for step, (jitted, args) in trainer_programs(program).items():
      calls = custom_calls(jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text())
      assert not any(MOSAIC_GPU_CALL in call for call in calls), (step, calls)


# --- bfloat16 train programs reach cuDNN --------------------------------------------------------

# The variants whose product can go to cuDNN's fused attention (kernels.fused).
FUSED_VARIANTS = ("softmax", "bn", "sh", "bn_sh")
# A sweep of two replicas (jax.vmap over the steps), which share each batch's padding mask.
TWO_REPLICAS = {"sweep.optimizer.lr": (1e-3, 3e-4)}
# sRAVEN's and logic's presets drop attention weights out in training (the HYLA paper's 0.1), which
# only the kernels' own path serves (jax.nn.dot_product_attention takes no dropout): their
# training reaches cuDNN without it, their evaluation with it.
NO_WEIGHT_DROPOUT = {"model.attention_dropout_rate": 0.0}
# The tasks whose batches are padded (their padding should reach cuDNN as lengths).
PADDED_TASKS = ("uea", "listops")
BF16_PROGRAMS = [
  *((name, "softmax") for name in configs.packaged_names()),
  *(("default", variant) for variant in FUSED_VARIANTS[1:]),
]
MATMUL = re.compile(
  r"stablehlo\.(dot_general|convolution)\b[^\n]*: \(tensor<([^>]*)>, tensor<([^>]*)>\)"
)
CUDNN_PARTITIONS = {
  "_dot_product_attention_fwd_partition": "forward",
  "_dot_product_attention_bwd_partition": "backward",
}


CALL_LINE = re.compile(r"custom_call @([^\s(]+)\([^\n]*: \(([^)]*)\)")
CALLBACK_KEY = re.compile(r'backend_config = "(\d+)"')


def cudnn_attention_operands(text: str) -> list[tuple[str, list[str]]]:
  """``('forward' | 'backward', operand shapes such as '6x30x2x8')`` of each cuDNN attention
  call of lowered StableHLO ``text``: the custom calls themselves (``__cudnn$fmha…``, with or
  without the bias cuDNN makes of a mask), or, in a program of several partitions (the trainer's
  mesh), the ``CustomSPMDPartitioning`` calls that become them when compiled, named by their
  partitioning callback. ``text`` must come from a ``Lowered`` that is still alive (the
  callbacks are held weakly)."""
  found = []
  for call in CALL_LINE.finditer(text):
    target, operands = call.groups()
    key = CALLBACK_KEY.search(call.group(0))
    if target.startswith("__cudnn$fmha"):
      direction = "backward" if target.endswith("Backward") else "forward"
    elif target == "CustomSPMDPartitioning" and key:
      callback = custom_partitioning._sharding_callbacks[key[1].encode()].partition.__name__
      direction = CUDNN_PARTITIONS.get(callback)
      if direction is None:
        continue
    else:
      continue
    found.append((direction, re.findall(r"tensor<([\dx]*)x\w+>", operands)))
  return found


def cudnn_attention_calls(text: str) -> tuple[int, int]:
  """(forward, backward) counts of ``cudnn_attention_operands``."""
  directions = [direction for direction, _ in cudnn_attention_operands(text)]
  return directions.count("forward"), directions.count("backward")


def forward_bias_and_lengths(text: str) -> set[tuple[bool, bool]]:
  """``(bias?, lengths?)`` of each forward cuDNN attention call of ``text``
  (``cudnn_attention_operands``, partitioned calls included): whether an operand after q, k and v
  is a bias ``[B, H | 1, T, S]`` or lengths ``[B]`` (0: an absent operand's placeholder)."""
  kinds = set()
  for direction, shapes in cudnn_attention_operands(text):
    extra = [shape.split("x") for shape in shapes[3:] if shape and shape != "0"]
    if direction == "forward":
      kinds.add((any(len(s) == 4 for s in extra), any(len(s) == 1 for s in extra)))
  return kinds


def unpaired_cudnn_operands(text: str) -> list[list[str]]:
  """The cuDNN attention calls of ``text`` with an operand whose leading (batch) axis is neither
  the queries' nor 1 (0: the placeholder of an absent operand): a bias or lengths of other rows
  than the queries' (under vmap, jax 0.10.2's batching rule pairs a shared mask's rows so)."""
  unpaired = []
  for _, shapes in cudnn_attention_operands(text):
    rows = shapes[0].split("x")[0]
    if any(shape and shape.split("x")[0] not in ("0", "1", rows) for shape in shapes):
      unpaired.append(shapes)
  return unpaired


DIM_NAMES = ("batching_dims", "contracting_dims")
BF16_ALGORITHM = "lhs_precision_type = bf16, rhs_precision_type = bf16"


def _dims(line: str, name: str) -> tuple[list[int], list[int]]:
  """The lhs and rhs axes of ``name = [..] x [..]`` in a ``dot_general`` line (none if absent)."""
  found = re.search(name + r" = \[([\d, ]*)\] x \[([\d, ]*)\]", line)
  if not found:
    return [], []
  return tuple([int(d) for d in side.split(",") if d.strip()] for side in found.groups())


def float32_matmuls(text: str) -> list[str]:
  """The float32 matrix products of lowered StableHLO text: ``dot_general``s and convolutions
  with a float32 operand (unless their algorithm rounds both operands to bfloat16, as XLA's
  attention on a TPU does), both of whose operands keep a free axis (neither batched nor
  contracted). Statistics are excepted: weighted sums over the keys (a weights vector: no free
  axis) and their gradients (outer products: nothing contracted), e.g. Attention-BN's key means."""
  found = []
  for match in MATMUL.finditer(text):
    op, lhs, rhs = match.groups()
    if "f32" not in lhs + rhs or BF16_ALGORITHM in match.group(0):
      continue
    if op == "dot_general":
      line = match.group(0)
      (batch_l, batch_r), (contract_l, contract_r) = (_dims(line, name) for name in DIM_NAMES)
      free_l = lhs.count("x") - len(batch_l) - len(contract_l)
      free_r = rhs.count("x") - len(batch_r) - len(contract_r)
      if not contract_l or not free_l or not free_r:
        continue
    found.append(match.group(0)[:200])
  return found


def lowered_train_program(program: setup.Program, platform: str):
  """The ``Lowered`` train program of ``program`` for ``platform``."""
  with sharding.mesh_context(program.mesh):
    jitted, args = trainer_programs(program)["train"]
    return jitted.trace(*args).lower(lowering_platforms=(platform,))


def bf16_train_program(runlocal_program, name, variant, replicas, platform):
  """The ``Lowered`` bfloat16 (``bf16``) train program of packaged config ``name``
  (``runlocal``) with ``variant``, one run or ``TWO_REPLICAS``, for ``platform``."""
  fields = {**NO_WEIGHT_DROPOUT, **(TWO_REPLICAS if replicas == 2 else {})}
  program = runlocal_program(name, f"runlocal,bf16,attention={variant}", fields)
  return lowered_train_program(program, platform)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("name, variant", BF16_PROGRAMS)
def test_bfloat16_train_programs_call_cudnn_and_no_float32_matmul(
  name, variant, replicas, device_backend, runlocal_program
):
  """Every packaged config with softmax, and the default one with BN, SH and BN+SH, single and
  as two replicas (the vmap whose old batching rule needs ``kernels.fused``'s workaround). The
  tasks that pad (UEA, ListOps) give their padding as lengths: every forward cuDNN call of their
  program takes lengths and no bias."""
  device_backend("cuda")
  lowered = bf16_train_program(runlocal_program, name, variant, replicas, "cuda")
  text = lowered.as_text()
  forward, backward = cudnn_attention_calls(text)
  assert forward and backward, custom_calls(text)
  assert not unpaired_cudnn_operands(text)
  assert not float32_matmuls(text)
  if name in PADDED_TASKS:
    assert forward_bias_and_lengths(text) == {(False, True)}


def test_float32_train_programs_have_float32_matmuls_and_no_cudnn(device_backend, runlocal_program):
  """What the bfloat16 test tells apart: the float32 run (the default) keeps XLA's attention."""
  device_backend("cuda")
  lowered = lowered_train_program(runlocal_program("default"), "cuda")
  text = lowered.as_text()
  assert cudnn_attention_calls(text) == (0, 0)
  assert float32_matmuls(text)


@pytest.mark.parametrize("replicas", [1, 2])
def test_bfloat16_train_programs_lower_for_tpu(replicas, device_backend, runlocal_program):
  device_backend("tpu")
  lowered = bf16_train_program(runlocal_program, "default", "bn_sh", replicas, "tpu")
  text = lowered.as_text()
  assert cudnn_attention_calls(text) == (0, 0)
  assert not float32_matmuls(text)


# --- Which cuDNN call each (variant, masking) gets ----------------------------------------------

# Each masking of a kernel call: its keyword arguments from lengths [B], a key-padding mask
# [B, 1, 1, N] and a general mask [B, 1, N, N] (abstract: their values are data).
PATH_MASKINGS = {
  "none": lambda lengths, padding, general: {},
  "lengths": lambda lengths, padding, general: {"key_value_seq_lengths": lengths},
  "query_and_key_lengths": lambda lengths, padding, general: {
    "key_value_seq_lengths": lengths,
    "query_seq_lengths": lengths,
  },
  "lengths_and_causal": lambda lengths, padding, general: {
    "key_value_seq_lengths": lengths,
    "is_causal": True,
  },
  "padding_mask": lambda lengths, padding, general: {"mask": padding},
  "general_mask": lambda lengths, padding, general: {"mask": general},
}
# (variant, masking) -> the forward cuDNN call of a bfloat16 call on CUDA: (target after
# '__cudnn$fmha', cuDNN's mask type). 'ScaleBias…' carries a bias [B, 1, N, N] made of a mask;
# 'PADDING' takes the lengths themselves. float32 calls take XLA's path (no cuDNN call).
# Attention-SH sends its ratio groups in one launch with each row's pooled key length: PADDING
# even unmasked, and a bias beside it under a mask or a causal constraint. Softmax and BN look at a
# mask given alone inside the program (fused.attend): a lax.cond holds both calls, the lengths it
# implies when it is padding, the mask as a bias otherwise (tests/test_padding_mask_as_lengths.py).
BY_LENGTHS, BY_BIAS = ("Softmax", "PADDING"), ("ScaleBiasSoftmax", "NO_MASK")
BY_BIAS_AND_LENGTHS = ("ScaleBiasSoftmax", "PADDING")
CUDNN_PATHS = {
  **{
    (variant, masking): path
    for variant in ("softmax", "bn")
    for masking, path in {
      "none": {("Softmax", "NO_MASK")},
      "lengths": {BY_LENGTHS},
      "query_and_key_lengths": {BY_LENGTHS},
      "lengths_and_causal": {("Softmax", "PADDING_CAUSAL")},
      "padding_mask": {BY_LENGTHS, BY_BIAS},
      "general_mask": {BY_LENGTHS, BY_BIAS},
    }.items()
  },
  **{
    (variant, masking): path
    for variant in ("sh", "bn_sh")
    for masking, path in {
      "none": {BY_LENGTHS},
      "lengths": {BY_LENGTHS},
      "query_and_key_lengths": {BY_LENGTHS},
      "lengths_and_causal": {BY_BIAS_AND_LENGTHS},
      "padding_mask": {BY_BIAS_AND_LENGTHS},
      "general_mask": {BY_BIAS_AND_LENGTHS},
    }.items()
  },
}
PATH_B, PATH_N, PATH_H, PATH_D = 2, 64, 4, 16
MASK_TYPE = re.compile(r"mask_type\\22: \\22(\w+)\\22")


def cudnn_paths(text: str) -> set[tuple[str, str]]:
  """``(target after '__cudnn$fmha', mask type)`` of the forward cuDNN attention calls of lowered
  StableHLO ``text``."""
  return {
    (target, MASK_TYPE.search(line)[1])
    for target, line in re.findall(r"custom_call @__cudnn\$fmha(\w+)\(([^\n]*)", text)
    if not target.endswith("Backward")
  }


def kernel_program(variant: str, masking: str, dtype):
  """``(fn, args)``: the gradient of a ``variant`` call with ``masking`` w.r.t. q, k and v."""
  kernel = registry.make_attention_fn(variant, registry.model_options(variant, PATH_H))

  def loss(q, k, v, lengths, padding, general):
    options = PATH_MASKINGS[masking](lengths, padding, general)
    return jnp.sum(kernel(q, k, v, **options).astype(jnp.float32))

  args = (
    *[jax.ShapeDtypeStruct((PATH_B, PATH_N, PATH_H, PATH_D), dtype)] * 3,
    jax.ShapeDtypeStruct((PATH_B,), jnp.int32),
    jax.ShapeDtypeStruct((PATH_B, 1, 1, PATH_N), jnp.bool_),
    jax.ShapeDtypeStruct((PATH_B, 1, PATH_N, PATH_N), jnp.bool_),
  )
  return jax.grad(loss, argnums=(0, 1, 2)), args


@pytest.mark.parametrize("masking", list(PATH_MASKINGS))
@pytest.mark.parametrize("variant", FUSED_VARIANTS)
def test_each_variant_and_masking_takes_its_cudnn_path(variant, masking, device_backend):
  """bfloat16 forward and backward on CUDA: lengths reach cuDNN as lengths (no bias), a mask as
  a bias or, for softmax and BN, as the lengths it implies when it is padding; float32 stays on
  XLA."""
  device_backend("cuda")
  text = lowered_text(*kernel_program(variant, masking, jnp.bfloat16), "cuda")
  assert cudnn_paths(text) == CUDNN_PATHS[variant, masking]
  assert cudnn_attention_calls(text)[1], "no backward cuDNN call"
  assert cudnn_attention_calls(
    lowered_text(*kernel_program(variant, masking, jnp.float32), "cuda")
  ) == (0, 0)
