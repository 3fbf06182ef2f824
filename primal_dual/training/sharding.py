"""Device mesh, logical-axis rules, train-state placement, batch placement, multi-process start.

Mesh: two axes, `('data', 'model')`, sizes from `config.mesh` (−1 = every device left over). Batches
are split over `data`; parameters annotated with `nn.with_logical_partitioning` are split over
`model` according to `LOGICAL_AXIS_RULES` (Megatron-style tensor parallelism: attention heads and
the MLP hidden layer are split, the residual stream is not). Unannotated parameters are replicated.

Multi-process launches (call `maybe_initialize_distributed` before anything touches a device):

* **Cloud TPU pod slice**: run the same command on every host (`gcloud compute tpus tpu-vm ssh
  ... --worker=all --command='python train.py ...'`). `jax.distributed.initialize()` detects the
  pod from the TPU metadata; this module calls it when `TPU_WORKER_HOSTNAMES` lists more than one
  host or `JAX_COORDINATOR_ADDRESS` is set.
* **SLURM GPU cluster**: `srun --ntasks=<hosts> --ntasks-per-node=1 python train.py ...` (one task
  per host, each seeing all local GPUs) or one task per GPU. JAX reads `SLURM_*` variables; this
  module initialises when `SLURM_NTASKS` (or `SLURM_STEP_NUM_TASKS`) > 1.
* **Manual / localhost**: start N copies with `JAX_COORDINATOR_ADDRESS=host:port`,
  `JAX_NUM_PROCESSES=N`, `JAX_PROCESS_ID=i` (or the `config.distributed.*` fields). On CPU the
  cross-process collectives use gloo (`jax_cpu_collectives_implementation`, jax's default).

Each process loads `batch_size / process_count` examples per step; `shard_batch` stitches the
process-local pieces into one global array split over `data`.
"""

import contextlib
import math
import os
from typing import Any, Mapping

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from primal_dual.training import errors

MESH_AXES = ("data", "model")

# Logical axis name → mesh axis (None = replicated). First matching rule wins (Flax semantics).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
  ("batch", "data"),
  ("heads", "model"),  # q/k/v kernels [embed, heads, kv], out kernel [heads, kv, embed].
  ("mlp", "model"),  # feed-forward [embed, mlp] and [mlp, embed].
  ("embed", None),  # residual stream: replicated (no FSDP).
  ("kv", None),  # per-head feature dimension.
  ("length", None),
  ("vocab", None),
  ("classes", None),
)


def _env_int(name: str) -> int:
  try:
    return int(os.environ.get(name, "") or 0)
  except ValueError:
    return 0


def _launched_multi_process() -> bool:
  """Whether environment variables say this process is one of several."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  if max(_env_int("SLURM_STEP_NUM_TASKS"), _env_int("SLURM_NTASKS")) > 1:
    return True
  hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  return len(hosts) > 1


def maybe_initialize_distributed(config: ml_collections.ConfigDict | None = None) -> bool:
  """Calls `jax.distributed.initialize` when launched as one of several processes.

  Must run before any JAX computation. Arguments come from `config.distributed`
  (coordinator_address, num_processes, process_id; empty / 0 / −1 = unset), then from the
  environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), then from JAX's
  own cluster detection (TPU pods, SLURM, Open MPI).

  Args:
    config: the run config, or None to use the environment only.

  Returns:
    True if the distributed system is (now) initialised, False for a single-process run.
  """
  if jax.distributed.is_initialized():
    return True
  dist = config.get("distributed") if config is not None else None
  dist = dist or {}
  address = dist.get("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  num_processes = dist.get("num_processes") or _env_int("JAX_NUM_PROCESSES") or None
  process_id = dist.get("process_id", -1)
  if process_id is None or process_id < 0:
    process_id = _env_int("JAX_PROCESS_ID") if "JAX_PROCESS_ID" in os.environ else None
  if not (address or num_processes or _launched_multi_process()):
    return False
  jax.distributed.initialize(
    coordinator_address=address, num_processes=num_processes, process_id=process_id
  )
  return True


def mesh_shape(
  mesh_config: Mapping[str, int], num_devices: int, *, allow_subset: bool = False
) -> tuple[int, ...]:
  """Resolves `{'data': d, 'model': m}` (one of them may be −1) to sizes for `num_devices`.

  Args:
    mesh_config: `config.mesh`.
    num_devices: devices available.
    allow_subset: accept explicit sizes using fewer devices than available (single-process
      debugging: e.g. data=1, model=1 on a machine with 8).

  Raises:
    errors.ConfigError: more than one −1, a size < 1, or sizes that do not fit the devices.
  """
  sizes = [int(mesh_config.get(axis, 1)) for axis in MESH_AXES]
  described = dict(zip(MESH_AXES, sizes))
  unknown = [i for i, s in enumerate(sizes) if s == -1]
  if len(unknown) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise errors.ConfigError(f"config.mesh {described}: sizes must be ≥ 1, with at most one −1")
  known = math.prod(s for s in sizes if s != -1)
  if unknown:
    if num_devices % known:
      raise errors.ConfigError(
        f"config.mesh {described}: {num_devices} devices do not divide by {known}"
      )
    sizes[unknown[0]] = num_devices // known
  used = math.prod(sizes)
  if used > num_devices or (used < num_devices and not allow_subset):
    raise errors.ConfigError(
      f"config.mesh {described} uses {used} devices but {num_devices} are available; "
      "set one size to -1 to use them all"
    )
  return tuple(sizes)


def make_mesh(mesh_config: Mapping[str, int], devices: list | None = None) -> Mesh:
  """A `('data', 'model')` mesh over `devices` (default: all global devices).

  In a single-process run, explicit sizes may use only the first `data·model` devices; a
  multi-process run must use every device (each process feeds its own). Axes are
  `AxisType.Auto` (classic GSPMD: the compiler propagates shardings), since the models are
  written without explicit-sharding annotations.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_config, len(devices), allow_subset=jax.process_count() == 1)
  devices = devices[: math.prod(shape)]
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
  )


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over `data`, the rest replicated."""
  return NamedSharding(mesh, PartitionSpec("data"))


def with_leading_axis(shardings: Any, mesh: Mesh) -> Any:
  """The shardings of a pytree stacked on a new, unsplit leading axis (replicas)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(None, *s.spec)), shardings)


def stacked_batch_sharding(mesh: Mesh) -> NamedSharding:
  """``[steps, batch, ...]`` batches of several steps: the batch axis split over `data`."""
  return NamedSharding(mesh, PartitionSpec(None, "data"))


def variable_shardings(abstract_variables: Any, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Any:
  """NamedShardings for a (possibly boxed) variables tree, in the *unboxed* tree structure.

  Args:
    abstract_variables: output of `jax.eval_shape(model.init, ...)`; leaves boxed by
      `nn.with_logical_partitioning` get their logical sharding, other leaves are replicated.
    mesh: the device mesh.
    rules: logical → mesh axis rules.
  """
  logical_specs = nn.get_partition_spec(abstract_variables)
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def check_divisible(
  abstract_tree: Any, shardings: Any, mesh: Mesh, what: str = "parameter"
) -> None:
  """Raises a ConfigError naming the first array whose sharded dimension the mesh cannot split.

  Without this, a head count or hidden width not divisible by `config.mesh.model` fails deep
  inside XLA.
  """
  leaves = jax.tree_util.tree_leaves_with_path(abstract_tree)
  for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings)):
    for dim, axes in zip(leaf.shape, sharding.spec):
      axes = (axes,) if isinstance(axes, str) else (axes or ())
      parts = math.prod(mesh.shape[a] for a in axes)
      if dim % parts:
        raise errors.ConfigError(
          f"{what} {jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)} has a dimension "
          f"of {dim} split over mesh axes {axes} of total size {parts}; choose config.mesh sizes "
          "that divide it (e.g. model=1)"
        )


def _path_key(entry) -> Any:
  for attribute in ("key", "name", "idx"):
    if hasattr(entry, attribute):
      return getattr(entry, attribute)
  return str(entry)


def shardings_following(tree: Any, reference: Any, reference_shardings: Any, mesh: Mesh) -> Any:
  """Shardings for `tree` (e.g. an optimizer state) copied from the parameters they mirror.

  A leaf of `tree` whose key path ends with the key path of a `reference` leaf of the same shape
  takes that leaf's sharding (Adam's `mu`/`nu`, momentum traces, masked states); every other leaf
  (step counters, scalars) is replicated. Matching by path keeps this independent of which
  optax transformations the chain holds.
  """
  ref_leaves = jax.tree_util.tree_leaves_with_path(reference)
  ref_shardings = jax.tree.leaves(reference_shardings)
  by_path = {
    tuple(_path_key(e) for e in path): (leaf.shape, sharding)
    for (path, leaf), sharding in zip(ref_leaves, ref_shardings)
  }
  lengths = sorted({len(p) for p in by_path}, reverse=True)

  def pick(path, leaf):
    keys = tuple(_path_key(e) for e in path)
    for length in lengths:
      match = by_path.get(keys[-length:]) if length <= len(keys) else None
      if match is not None and tuple(match[0]) == tuple(np.shape(leaf)):
        return match[1]
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(pick, tree)


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Places a host-local batch onto the global `data` axis.

  Args:
    batch: dict of NumPy arrays with leading axis `batch_size / process_count` (this process's
      share of the global batch).
    mesh: the device mesh.

  Returns:
    Dict of global `jax.Array`s with leading axis `batch_size`, split over `data`.
  """
  sharding = batch_sharding(mesh)
  return {
    name: jax.make_array_from_process_local_data(sharding, np.asarray(value))
    for name, value in batch.items()
  }


def shard_stacked_batch(batches: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Like `shard_batch` for this process's batches of several steps, `[steps, local batch, ...]`.

  Returns:
    Dict of global `jax.Array`s `[steps, batch_size, ...]`, the batch axis split over `data`.
  """
  sharding = stacked_batch_sharding(mesh)
  return {
    name: jax.make_array_from_process_local_data(sharding, np.asarray(value))
    for name, value in batches.items()
  }


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """`mesh` and the logical axis rules in context, so `nn.with_logical_constraint` in models and
  the unboxing of `nn.LogicallyPartitioned` parameters resolve to this mesh while tracing."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield
