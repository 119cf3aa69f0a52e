"""One device mesh, one rules table: logical axis names -> mesh axes ('data', 'model').

Target and draft share the mesh and the rules (Chen et al.: a wide, shallow draft shares the target's
topology). Parameters are placed with `jax.device_put` (`tree_shardings`), and a model built with a
mesh constrains its activations and KV cache with the same rules (`constrain`): the batch and the
cache's rows over 'data', heads, MLP hidden units and the vocabulary over 'model'. Everything else is
`jax.jit` (pjit is jax.jit today); there is no partitioner object. A logical axis whose size does not
divide the mesh axis is replicated instead (SmolLM2's 3 KV heads on a 2-way model axis, say), so any
model runs on any mesh.

Multi-host: call `jax.distributed.initialize()` first; `make_mesh` then spans every process's devices.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax import axes

MESH_AXES = ("data", "model")

# The rules table. Batch goes over 'data'; every axis that splits a matmul's output (heads, MLP hidden,
# vocabulary) goes over 'model' (Megatron-style); embed, lengths and head_dim stay whole.
RULES: dict[str, str | None] = {
    axes.BATCH: "data",
    axes.CACHE_BATCH: "data",
    axes.HEADS: "model",
    axes.KV_HEADS: "model",
    axes.CACHE_KV_HEADS: "model",
    axes.MLP: "model",
    axes.VOCAB: "model",
    axes.EMBED: None,
    axes.LENGTH: None,
    axes.HEAD_DIM: None,
    axes.CACHE_LENGTH: None,
    axes.CACHE_HEAD_DIM: None,
}


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
  """A ('data', 'model') mesh. model=None takes every device not used by `data`. The mesh's size must
  divide the device count (a mesh over some of the devices is allowed, e.g. 1x1 anywhere)."""
  devices = list(devices if devices is not None else jax.devices())
  if model is None:
    if len(devices) % data:
      raise ValueError(f"data={data} does not divide the {len(devices)} devices")
    model = len(devices) // data
  if data < 1 or model < 1:
    raise ValueError(f"mesh axes must be >= 1, got data={data}, model={model}")
  if data * model > len(devices):
    raise ValueError(f"a {data}x{model} mesh needs {data * model} devices; {len(devices)} are visible "
                     "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)")
  if len(devices) % (data * model):
    raise ValueError(f"a {data}x{model} mesh ({data * model} devices) does not divide the "
                     f"{len(devices)} devices; pick data x model among the divisors of "
                     f"{len(devices)} ({', '.join(map(str, _divisors(len(devices))))})")
  return Mesh(np.array(devices[:data * model]).reshape(data, model), MESH_AXES)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


class UnshardableError(ValueError):
  """A dimension the rules map to a mesh axis that does not divide it (strict sharding only)."""


def spec_for(logical: tuple, shape: tuple, mesh: Mesh, strict: bool = False,
             where: str = "an array") -> PartitionSpec:
  """Logical axis names + array shape -> a PartitionSpec. A dimension whose size the mesh axis does
  not divide is replicated, or with strict=True refused (UnshardableError naming the axis)."""
  mesh_axes = []
  for name, size in zip(logical, shape):
    mesh_axis = RULES.get(name) if name is not None else None
    if mesh_axis is not None and size % mesh.shape[mesh_axis]:
      if strict:
        raise UnshardableError(
            f"the {name!r} axis of {where} (size {size}, shape {tuple(shape)}) cannot be split over "
            f"the {mesh_axis!r} mesh axis of size {mesh.shape[mesh_axis]}; pick a {mesh_axis!r} size "
            f"that divides {size} ({', '.join(map(str, _divisors(size)[:12]))}), or allow "
            "replication (non-strict sharding replicates that axis on every device)")
      mesh_axis = None
    mesh_axes.append(mesh_axis)
  return PartitionSpec(*mesh_axes)


def replicated_axes(logical: tuple, shape: tuple, mesh: Mesh) -> list[str]:
  """The logical axes of an array that the rules would shard but the mesh axis does not divide."""
  return [name for name, size in zip(logical, shape)
          if name is not None and RULES.get(name) and size % mesh.shape[RULES[name]]]


def tree_shardings(logical_tree, shape_tree, mesh: Mesh, strict: bool = False):
  """Trees of logical PartitionSpecs and of arrays (or ShapeDtypeStructs) -> NamedShardings."""
  is_spec = lambda x: isinstance(x, PartitionSpec)
  return jax.tree_util.tree_map_with_path(
      lambda path, logical, leaf: NamedSharding(mesh, spec_for(
          tuple(logical), leaf.shape, mesh, strict, f"parameter {jax.tree_util.keystr(path)}")),
      logical_tree, shape_tree, is_leaf=is_spec)


def constrain(x: jax.Array, logical: tuple, mesh: Mesh | None) -> jax.Array:
  """x laid out by the rules on `mesh` (a sharding constraint inside jit); x itself without a mesh."""
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(logical, x.shape, mesh)))


def batch_sharding(mesh: Mesh, batch: int, ndim: int = 2) -> NamedSharding:
  """Rows over 'data' (replicated when the batch does not divide it)."""
  data = "data" if batch % mesh.shape["data"] == 0 else None
  return NamedSharding(mesh, PartitionSpec(data, *([None] * (ndim - 1))))


def place(tree, shardings):
  """Host arrays -> arrays laid out by `shardings`. Across processes every process passes the same
  host values and keeps the shards on its own devices."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  return jax.tree_util.tree_map(
      lambda value, placed: jax.make_array_from_callback(
          np.shape(value), placed, lambda index: np.asarray(value)[index]), tree, shardings)


def to_host(x) -> np.ndarray:
  """A (possibly multi-process) array as one numpy array on every process."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def describe(mesh: Mesh) -> str:
  return (f"mesh {dict(mesh.shape)} over {math.prod(mesh.devices.shape)} "
          f"{mesh.devices.flat[0].platform} devices")
