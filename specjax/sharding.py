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
  """A ('data', 'model') mesh. model=None takes every device not used by `data`."""
  devices = list(devices if devices is not None else jax.devices())
  if model is None:
    if len(devices) % data:
      raise ValueError(f"data={data} does not divide the {len(devices)} devices")
    model = len(devices) // data
  if data * model > len(devices):
    raise ValueError(f"a {data}x{model} mesh needs {data * model} devices; {len(devices)} are visible "
                     "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)")
  return Mesh(np.array(devices[:data * model]).reshape(data, model), MESH_AXES)


def spec_for(logical: tuple, shape: tuple, mesh: Mesh) -> PartitionSpec:
  """Logical axis names + array shape -> a PartitionSpec, replicating axes that do not divide evenly."""
  mesh_axes = []
  for name, size in zip(logical, shape):
    mesh_axis = RULES.get(name) if name is not None else None
    if mesh_axis is not None and size % mesh.shape[mesh_axis]:
      mesh_axis = None
    mesh_axes.append(mesh_axis)
  return PartitionSpec(*mesh_axes)


def tree_shardings(logical_tree, shape_tree, mesh: Mesh):
  """Trees of logical PartitionSpecs and of arrays (or ShapeDtypeStructs) -> NamedShardings."""
  is_spec = lambda x: isinstance(x, PartitionSpec)
  return jax.tree_util.tree_map(
      lambda logical, leaf: NamedSharding(mesh, spec_for(tuple(logical), leaf.shape, mesh)),
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
  return jax.device_put(tree, shardings)


def describe(mesh: Mesh) -> str:
  return (f"mesh {dict(mesh.shape)} over {math.prod(mesh.devices.shape)} "
          f"{mesh.devices.flat[0].platform} devices")
