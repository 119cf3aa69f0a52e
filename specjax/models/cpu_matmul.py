"""bfloat16 matrix products on the CPU's matrix units (oneDNN), behind `ModelSpec.matmul`.

XLA:CPU has no fast bfloat16 product: on a 2-core AMD EPYC with AVX-512 BF16, 90 products of
[M, 576] x [576, 1536] (SmolLM2's MLP shape) take XLA 126 / 160 / 173 ms in bfloat16 at M = 1 / 5 /
17 (14 / 19 / 30 in float32), and this custom call on weights packed once 8.8 / 8.8 / 11.9 ms
(docs/results.md). So a decode in bfloat16 on such a CPU runs its products here: `pack_params`
replaces every 2-D kernel of a params tree with a `PackedKernel` (oneDNN's blocked layout, reordered
once at load) and `layers.dense` sends x[..., in] x PackedKernel to the custom call
(csrc/onednn_matmul.cc, built into .venv/lib by scripts/build_cpu_matmul.sh). Sums are float32 as in
XLA's path; only their order differs, so tokens can differ from XLA's bfloat16 path at near-ties.
Each product is the same row by row whatever its row count; a bfloat16 decode as a whole is not
yet, on this path or XLA's: greedy speculative output left its baseline's on 3 of 8 held-out
SmolLM2 prompts on both (docs/results.md).

Only for decoding: packed params are not for training (no gradient) or for a mesh of more than one
device (the custom call runs on one host's CPU).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

LIBRARY = os.path.join(sys.prefix, "lib", "libspecjax_cpu_matmul.so")
TARGET = "specjax_cpu_matmul"
BUILD_FIX = "bash scripts/build_cpu_matmul.sh builds it (bash scripts/setup.sh runs it)"


@flax.struct.dataclass
class PackedKernel:
  """A [in, out] bfloat16 kernel in oneDNN's blocked layout: `data` holds its bytes."""
  data: jax.Array
  shape: tuple = flax.struct.field(pytree_node=False)
  # Kernels fused side by side into this one (FUSED): ((name, columns), ...); empty for one kernel.
  parts: tuple = flax.struct.field(pytree_node=False, default=())

  @property
  def nbytes(self) -> int:
    return self.data.nbytes


@functools.cache
def _library():
  """The built library with its FFI target registered, or None when it is not built."""
  if not os.path.exists(LIBRARY):
    return None
  lib = ctypes.CDLL(LIBRARY)
  lib.specjax_cpu_matmul_packed_bytes.restype = ctypes.c_int64
  lib.specjax_cpu_matmul_packed_bytes.argtypes = [ctypes.c_int64] * 2
  lib.specjax_cpu_matmul_pack.restype = ctypes.c_int
  lib.specjax_cpu_matmul_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_void_p]
  lib.specjax_cpu_matmul_unpack.restype = ctypes.c_int
  lib.specjax_cpu_matmul_unpack.argtypes = lib.specjax_cpu_matmul_pack.argtypes
  lib.specjax_cpu_matmul_always_reorder.argtypes = [ctypes.c_int]
  lib.specjax_cpu_matmul_implementation.restype = ctypes.c_char_p
  lib.specjax_cpu_matmul_implementation.argtypes = [ctypes.c_int64, ctypes.c_int64]
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecjaxCpuMatmul), platform="cpu")
  return lib


def available() -> bool:
  return _library() is not None


def implementation(k: int = 576, n: int = 1536) -> str:
  """oneDNN's kernel for a [k, n] product on this CPU, e.g. 'brg:avx512_core_bf16' (AVX-512 BF16)
  or 'brg:avx512_core_amx' (AMX); requires the library."""
  return require().specjax_cpu_matmul_implementation(k, n).decode()


def require():
  lib = _library()
  if lib is None:
    raise RuntimeError(f"ModelSpec.matmul = 'onednn' needs {LIBRARY}, which is not built: "
                       f"{BUILD_FIX}")
  return lib


def pack(kernel) -> PackedKernel:
  """A [in, out] kernel (any float dtype, cast to bfloat16) in oneDNN's layout, on the host."""
  lib = require()
  k, n = kernel.shape
  plain = np.ascontiguousarray(np.asarray(jnp.asarray(kernel, jnp.bfloat16)))
  packed = np.empty(lib.specjax_cpu_matmul_packed_bytes(k, n), np.uint8)
  if lib.specjax_cpu_matmul_pack(plain.ctypes.data, k, n, packed.ctypes.data):
    raise RuntimeError(f"oneDNN could not pack a [{k}, {n}] bfloat16 kernel")
  return PackedKernel(jnp.asarray(packed), (k, n))


def unpack(kernel: PackedKernel) -> jax.Array:
  """The [in, out] bfloat16 kernel a PackedKernel was packed from."""
  lib = require()
  k, n = kernel.shape
  packed = np.ascontiguousarray(np.asarray(kernel.data))
  plain = np.empty((k, n), jnp.bfloat16)
  if lib.specjax_cpu_matmul_unpack(packed.ctypes.data, k, n, plain.ctypes.data):
    raise RuntimeError(f"oneDNN could not unpack a [{k}, {n}] bfloat16 kernel")
  return jnp.asarray(plain)


def matmul(x: jax.Array, kernel: PackedKernel, out_dtype=jnp.float32) -> jax.Array:
  """x[..., in] x kernel -> [..., out] in `out_dtype` (float32 or bfloat16), summed in float32."""
  k, n = kernel.shape
  if x.shape[-1] != k:
    raise ValueError(f"x[..., {x.shape[-1]}] against a packed [{k}, {n}] kernel")
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype),
                          vmap_method="sequential")
  return call(x.astype(jnp.bfloat16), kernel.data)


# The params of one decoder-only or T5 network a tied head reads transposed: packed as their own
# leaf (the table itself stays for the embedding lookup).
HEAD = "packed_head"
# Kernels that read the same input, packed side by side as one product (each call costs oneDNN's
# fork and join: fusing brings SmolLM2's step from 211 products to 121). Layers look for the fused
# kernel under fused_name(names) (layers.fused_dense).
FUSED = (("wq", "wk", "wv"), ("w_gate", "w_up"))


def fused_name(names) -> str:
  return "+".join(names)


def split(y: jax.Array, kernel: PackedKernel) -> list[jax.Array]:
  """A fused product's output [..., sum of columns] -> one array per fused kernel."""
  bounds = np.cumsum([columns for _, columns in kernel.parts])[:-1]
  return jnp.split(y, bounds, axis=-1)


def pack_params(params, tied_head: bool):
  """Every 2-D kernel of a model's params packed for oneDNN, the FUSED groups side by side as one.
  Embedding tables stay (the lookup gathers rows); with `tied_head` (a head that reads the table
  transposed) each gains a packed transposed copy at HEAD beside it. Leaves that are not kernels
  (norm scales, relative position tables, token id lists) stay as they are."""
  def walk(tree):
    out = {}
    tree = dict(tree)
    for names in FUSED:
      if all(getattr(tree.get(name), "ndim", 0) == 2 for name in names):
        kernels = [tree.pop(name) for name in names]
        fused = pack(jnp.concatenate([jnp.asarray(k, jnp.bfloat16) for k in kernels], axis=1))
        out[fused_name(names)] = fused.replace(
            parts=tuple((name, k.shape[1]) for name, k in zip(names, kernels)))
    for name, value in tree.items():
      if isinstance(value, dict):
        out[name] = walk(value)
      elif name == "embedding" and getattr(value, "ndim", 0) == 2:
        out[name] = value
        if tied_head:
          out[HEAD] = pack(jnp.asarray(value).T)
      elif getattr(value, "ndim", 0) == 2 and jnp.issubdtype(value.dtype, jnp.floating) \
          and name not in ("rel_embedding",):
        out[name] = pack(value)
      else:
        out[name] = value
    return out
  return walk(params)


# The KV cache of a decode whose products run here: float32. Its keys and values are the same
# bfloat16-rounded values a bfloat16 cache holds (they come out of bfloat16 products and RoPE), so
# the tokens are the same; but the attention reads them in float32 (XLA:CPU's bfloat16 products are
# slow) and a bfloat16 cache would be converted whole in every layer of every step.
CACHE_DTYPE = jnp.float32


def pack_params_for(config, params, devices: int = 1):
  """A decoder-only or T5 model's params packed (pack_params, its head tied or not), after checking
  what the custom call needs: the library, JAX on the CPU, one device."""
  require()
  if jax.default_backend() != "cpu":
    raise ValueError(f"ModelSpec.matmul = 'onednn' runs on the CPU; JAX runs on "
                     f"{jax.default_backend()} here: leave matmul unset (XLA)")
  if devices > 1:
    raise ValueError(f"ModelSpec.matmul = 'onednn' runs on one device; the mesh has {devices}: "
                     "leave matmul unset (XLA) or use a (1, 1) mesh")
  return pack_params(params, tied_head=bool(getattr(config, "tie_embeddings", False)))


def plain(params):
  """A params tree as it was before pack_params (what reads the weights themselves, e.g. a
  fingerprint of the target, sees the same tree from a packed target as from an unpacked one)."""
  if not is_packed(params):
    return params
  def walk(tree):
    out = {}
    for name, value in tree.items():
      if name == HEAD:
        continue
      if isinstance(value, dict):
        out[name] = walk(value)
      elif isinstance(value, PackedKernel) and value.parts:
        out.update(zip([part for part, _ in value.parts], split(unpack(value), value)))
      elif isinstance(value, PackedKernel):
        out[name] = unpack(value)
      else:
        out[name] = value
    return out
  return walk(params)


def is_packed(params) -> bool:
  """Whether a params tree holds packed kernels (a draft of a packed target is packed too)."""
  return any(isinstance(leaf, PackedKernel) for leaf in jax.tree_util.tree_leaves(
      params, is_leaf=lambda x: isinstance(x, PackedKernel)))
