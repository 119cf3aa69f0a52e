"""specjax's CPU kernels, behind `ModelSpec.kernels = "cpu"`: matrix products, attention over the
KV cache, the cache write and RMSNorm as XLA FFI custom calls (csrc/, built into .venv/lib by
scripts/build_cpu_kernels.sh with g++ alone, which scripts/setup.sh runs).

Why not XLA's own kernels on a CPU:
  * Speed. XLA:CPU's products of a few rows cost what they compute, not what they read (a 5-token
    verification of SmolLM2 in float32 costs 1.5-1.9 one-token steps), and it has no fast bfloat16
    product at all. Here weights are packed once at load into panels of 32 columns (`pack_params`)
    that each product streams at about the memory's speed, fetched ahead, split between the cores;
    bfloat16 weights are read as such (half the bytes) and widened in registers (csrc/matmul.cc,
    docs/results.md).
  * Exactness. XLA's products and its attention compute a token's last bits differently depending
    on how many tokens share the call (a product of 1 row is not row 0 of a product of 5) and on the
    cache buffer's length, so a speculative verification of T tokens and the one-token baseline
    disagree in the last bits, and now and then a near-tie flips a greedy token (it did on 3 of 8
    held-out SmolLM2 prompts in bfloat16). Here each row of a product sums over k in one order
    whatever the row count, the attention sums each query over the slots it sees in increasing order
    (csrc/attention.cc) and the norm each row in one order (csrc/rms_norm.cc), so greedy speculative
    output equals greedy autoregressive output token for token, chains and trees, both families,
    both dtypes.

`pack_params` replaces every 2-D kernel of a params tree with a `PackedKernel`; `layers.dense` sends
x x PackedKernel to `matmul`; a model whose kernels are packed also runs its decoder attention
through `attention` and `cache_write` (layers.CachedAttention, the T5 decoder). `argmax` serves
every float32 argmax over a large vocabulary on a one-device CPU (sampling.argmax). A decode on these
kernels keeps its KV cache in float32 (CACHE_DTYPE), and a bfloat16 model its residual stream too
(layers.embed: its products round their rows to bfloat16). The calls share one team of threads, one
per core (SPECJAX_CPU_THREADS sets another count; results do not depend on it). Only for decoding:
packed params are not for training (no gradient) or a mesh of more than one device (the calls run
on one host's CPU).
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

LIBRARY = os.path.join(sys.prefix, "lib", "libspecjax_cpu.so")
TARGETS = {"specjax_cpu_matmul": "SpecjaxCpuMatmul", "specjax_cpu_attention": "SpecjaxCpuAttention",
           "specjax_cpu_cache_write": "SpecjaxCpuCacheWrite", "specjax_cpu_rms_norm": "SpecjaxCpuRmsNorm",
           "specjax_cpu_argmax": "SpecjaxCpuArgmax"}
BUILD_FIX = "bash scripts/build_cpu_kernels.sh builds it (bash scripts/setup.sh runs it)"
SETTING = "ModelSpec.kernels = 'cpu'"


@flax.struct.dataclass
class PackedKernel:
  """A [in, out] bfloat16 or float32 kernel in panels of 32 columns (csrc/matmul.cc): `data` holds
  its bytes."""
  data: jax.Array
  shape: tuple = flax.struct.field(pytree_node=False)
  # Kernels fused side by side into this one (FUSED): ((name, columns), ...); empty for one kernel.
  parts: tuple = flax.struct.field(pytree_node=False, default=())
  dtype: str = flax.struct.field(pytree_node=False, default="bfloat16")

  @property
  def nbytes(self) -> int:
    return self.data.nbytes


@flax.struct.dataclass
class NormScale:
  """An RMSNorm's scale[E], in its own dtype, that pack_params marked: the norm runs through
  rms_norm."""
  data: jax.Array


@functools.cache
def _library():
  """The built library with its FFI target registered, or None when it is not built."""
  if not os.path.exists(LIBRARY):
    return None
  lib = ctypes.CDLL(LIBRARY)
  lib.specjax_cpu_matmul_packed_bytes.restype = ctypes.c_int64
  lib.specjax_cpu_matmul_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
  lib.specjax_cpu_matmul_pack.restype = ctypes.c_int
  lib.specjax_cpu_matmul_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_int, ctypes.c_void_p]
  lib.specjax_cpu_matmul_unpack.restype = ctypes.c_int
  lib.specjax_cpu_matmul_unpack.argtypes = lib.specjax_cpu_matmul_pack.argtypes
  lib.specjax_cpu_matmul_implementation.restype = ctypes.c_char_p
  lib.specjax_cpu_matmul_implementation.argtypes = []
  for target, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  return lib


def available() -> bool:
  return _library() is not None


def implementation() -> str:
  """How this build runs its products: "amx" (bfloat16 products of k a multiple of 32 on AMX's tile
  unit, the rest as "avx512"), "avx512", "avx2" (a CPU without AVX-512: 8-lane registers, two rows
  at a time) or "portable" (std::fma). The last three give the same bits; the tile unit rounds its
  own way, alike at every row count. Requires the library."""
  return require().specjax_cpu_matmul_implementation().decode()


def _is_f32(dtype) -> int:
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"the CPU kernels' products read float32 or bfloat16, not {dtype}")
  return int(dtype == jnp.float32)


def require():
  lib = _library()
  if lib is None:
    raise RuntimeError(f"{SETTING} needs {LIBRARY}, which is not built: {BUILD_FIX}")
  return lib


def pack(kernel, dtype=jnp.bfloat16) -> PackedKernel:
  """A [in, out] kernel, cast to `dtype` (bfloat16 or float32), in panels of 32 columns
  (csrc/matmul.cc), on the host."""
  lib = require()
  k, n = kernel.shape
  f32 = _is_f32(dtype)
  plain = np.ascontiguousarray(np.asarray(jnp.asarray(kernel, dtype)))
  packed = np.empty(lib.specjax_cpu_matmul_packed_bytes(k, n, f32), np.uint8)
  lib.specjax_cpu_matmul_pack(plain.ctypes.data, k, n, f32, packed.ctypes.data)
  return PackedKernel(jnp.asarray(packed), (k, n), dtype=jnp.dtype(dtype).name)


def unpack(kernel: PackedKernel) -> jax.Array:
  """The [in, out] kernel a PackedKernel was packed from, in its dtype."""
  lib = require()
  k, n = kernel.shape
  packed = np.ascontiguousarray(np.asarray(kernel.data))
  plain = np.empty((k, n), jnp.dtype(kernel.dtype))
  lib.specjax_cpu_matmul_unpack(packed.ctypes.data, k, n, _is_f32(kernel.dtype), plain.ctypes.data)
  return jnp.asarray(plain)


def matmul(x: jax.Array, kernel: PackedKernel, out_dtype=jnp.float32) -> jax.Array:
  """x[..., in] x kernel -> [..., out] in `out_dtype`, summed in float32. A float32 kernel reads
  and writes float32; a bfloat16 one reads x as bfloat16 (float32 rows are rounded in the call, to
  nearest, ties to even; subnormals then count as zero, as in XLA's own kernels) and writes float32 or bfloat16."""
  k, n = kernel.shape
  if x.shape[-1] != k:
    raise ValueError(f"x[..., {x.shape[-1]}] against a packed [{k}, {n}] kernel")
  bfloat16 = kernel.dtype == "bfloat16"
  if not bfloat16 or x.dtype not in (jnp.float32, jnp.bfloat16):
    x = x.astype(jnp.float32)
  if not bfloat16:
    out_dtype = jnp.float32
  call = jax.ffi.ffi_call("specjax_cpu_matmul",
                          jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype),
                          vmap_method="sequential")
  return call(x, kernel.data, bfloat16_weights=bfloat16)


def attention(queries: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array,
              bias: jax.Array | None = None, scale: float = 1.0) -> jax.Array:
  """Softmax attention of queries[B, T, H, D] over keys / values[B, S, KV, D] (head h reads kv head
  h // (H // KV)) -> [B, T, H, D] float32. visible: bool [B, T, S], or [B, 1, S] shared by a row's
  queries; bias: float32 [B or 1, H, T, S] added to the scaled scores, or None. Each query's output is
  summed over the slots it sees in increasing order, skipping the rest (csrc/attention.cc): it does
  not depend on the other queries, the buffer's length or where its unseen slots lie."""
  require()  # registers the FFI targets (a program may call the attention before any product)
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  call = jax.ffi.ffi_call("specjax_cpu_attention",
                          jax.ShapeDtypeStruct(queries.shape, jnp.float32),
                          vmap_method="sequential")
  return call(f32(queries), f32(keys), f32(values), jnp.asarray(visible, bool),
              f32(bias) if bias is not None else jnp.zeros((0,), jnp.float32),
              scale=np.float32(scale))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x[..., E] * rsqrt(mean(x * x) + eps) * scale[E] -> float32, each row's sum in one fixed order
  (csrc/rms_norm.cc): XLA's sums rows in another order from 8 rows on than for one."""
  require()
  call = jax.ffi.ffi_call("specjax_cpu_rms_norm", jax.ShapeDtypeStruct(x.shape, jnp.float32),
                          vmap_method="sequential")
  return call(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32), eps=np.float32(eps))


def argmax(scores: jax.Array) -> jax.Array:
  """jnp.argmax(scores, axis=-1) as int32 for float32 scores[..., V] (the first maximum, or the
  first NaN), each row read once (csrc/argmax.cc). No gradient flows through it."""
  require()
  call = jax.ffi.ffi_call("specjax_cpu_argmax", jax.ShapeDtypeStruct(scores.shape[:-1], jnp.int32),
                          vmap_method="broadcast_all")
  return call(jax.lax.stop_gradient(jnp.asarray(scores, jnp.float32)))


def cache_write(keys: jax.Array, values: jax.Array, new_keys: jax.Array, new_values: jax.Array,
                slots: jax.Array) -> tuple[jax.Array, jax.Array]:
  """kv_cache.write for both buffers of a layer at once, in place: new_keys / new_values[B, T, KV, D]
  into keys / values[B, S, KV, D] (float32) at slots[B, T]; a slot outside the buffer is dropped."""
  require()
  call = jax.ffi.ffi_call("specjax_cpu_cache_write",
                          (jax.ShapeDtypeStruct(keys.shape, jnp.float32),
                           jax.ShapeDtypeStruct(values.shape, jnp.float32)),
                          vmap_method="sequential", input_output_aliases={0: 0, 1: 1})
  return call(keys, values, new_keys.astype(jnp.float32), new_values.astype(jnp.float32),
              slots.astype(jnp.int32))


# The params of one decoder-only or T5 network a tied head reads transposed: packed as their own
# leaf (the table itself stays for the embedding lookup).
HEAD = "packed_head"
# Kernels that read the same input, packed side by side as one product (each call costs a wake-up
# of the team's threads: fusing brings SmolLM2's step from 211 products to 121). Layers look for the
# fused kernel under fused_name(names) (layers.fused_dense).
FUSED = (("wq", "wk", "wv"), ("w_gate", "w_up"))


def fused_name(names) -> str:
  return "+".join(names)


def split(y: jax.Array, kernel: PackedKernel) -> list[jax.Array]:
  """A fused product's output [..., sum of columns] -> one array per fused kernel."""
  bounds = np.cumsum([columns for _, columns in kernel.parts])[:-1]
  return jnp.split(y, bounds, axis=-1)


def pack_params(params, tied_head: bool):
  """Every 2-D kernel of a model's params packed for `matmul` in its own dtype (float32 or bfloat16),
  the FUSED groups side by side as one. Embedding tables stay (the lookup gathers rows); with
  `tied_head` (a head that reads the table transposed) each gains a packed transposed copy at HEAD
  beside it; a bfloat16 table is stored as its 16-bit patterns (table_bits). RMSNorm scales become
  NormScale (the norm then sums in a fixed order). Leaves that are not kernels (relative position
  tables, token id lists) stay as they are."""
  def walk(tree):
    out = {}
    tree = dict(tree)
    for names in FUSED:
      if all(getattr(tree.get(name), "ndim", 0) == 2 for name in names):
        kernels = [tree.pop(name) for name in names]
        fused = pack(jnp.concatenate(kernels, axis=1), kernels[0].dtype)
        out[fused_name(names)] = fused.replace(
            parts=tuple((name, k.shape[1]) for name, k in zip(names, kernels)))
    for name, value in tree.items():
      if isinstance(value, dict):
        out[name] = walk(value)
      elif name == "embedding" and getattr(value, "ndim", 0) == 2:
        out[name] = table_bits(value)
        if tied_head:
          out[HEAD] = pack(jnp.asarray(value).T, value.dtype)
      elif getattr(value, "ndim", 0) == 2 and jnp.issubdtype(value.dtype, jnp.floating) \
          and name not in ("rel_embedding",):
        out[name] = pack(value, value.dtype)
      elif name == "scale" and getattr(value, "ndim", 0) == 1:
        out[name] = NormScale(value)
      else:
        out[name] = value
    return out
  return walk(params)


# The KV cache of a decode on these kernels: float32, which the attention reads. In a bfloat16 decode
# it holds the same bfloat16-rounded keys and values a bfloat16 cache would (they come out of
# bfloat16 products and RoPE), so the tokens are the same.
CACHE_DTYPE = jnp.float32


def pack_params_for(config, params, devices: int = 1):
  """A decoder-only or T5 model's params packed (pack_params, its head tied or not), after checking
  what the custom call needs: the library, JAX on the CPU, one device."""
  require()
  if jax.default_backend() != "cpu":
    raise ValueError(f"{SETTING} runs on the CPU; JAX runs on {jax.default_backend()} here: "
                     "leave ModelSpec.kernels unset (XLA's)")
  if devices > 1:
    raise ValueError(f"{SETTING} runs on one device; the mesh has {devices}: leave "
                     "ModelSpec.kernels unset (XLA's) or use a (1, 1) mesh")
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
      elif isinstance(value, NormScale):
        out[name] = value.data
      elif name == "embedding":
        out[name] = embedding_table(value)
      else:
        out[name] = value
    return out
  return walk(params)


def table_bits(table) -> jax.Array:
  """A bfloat16 embedding table as its 16-bit patterns (uint16; layers.embed gathers those): XLA:CPU
  gathers no bfloat16, so inside a decode loop it converted the whole table to float32 before the
  loop (SmolLM2: 57 MB read, 113 MB written per decode call). Other tables stay as they are."""
  if table.dtype != jnp.bfloat16:
    return table
  return jnp.asarray(np.asarray(table).view(np.uint16))


def embedding_table(table) -> jax.Array:
  """An embedding table in its own dtype, whether table_bits stored it as bit patterns or not."""
  if table.dtype != jnp.uint16:
    return table
  return jnp.asarray(np.asarray(table).view(jnp.bfloat16))


def step_bytes(params, config) -> int:
  """The bytes of weights one decode step of the model `config` describes reads: every leaf, except
  what runs once per request (a T5's encoder, and its decoder's cross-attention key / value kernels,
  which project the encoded source before the first step) and an embedding table the head does not
  read (the lookup gathers a few rows): one with a packed transposed copy (HEAD) beside it, or any
  table of a model whose head is its own kernel (config.tie_embeddings False)."""
  tied_head = config.tie_embeddings
  def walk(tree, path):
    total = 0
    for name, value in tree.items():
      if path == () and name == "encoder":
        continue
      if path[-1:] == ("encoder_decoder_attention",) and name in ("key", "value"):
        continue
      if isinstance(value, dict):
        total += walk(value, path + (name,))
      elif not (name == "embedding" and (HEAD in tree or not tied_head)):
        total += sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(value))
    return total
  return walk(params, ())


def kernel_dtype(params) -> str | None:
  """The dtype of a params tree's packed kernels ("bfloat16" or "float32"), None where it holds
  none: what a drafter beside it packs its own kernels in, so a bfloat16 decode reads no float32
  drafter."""
  for leaf in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, PackedKernel)):
    if isinstance(leaf, PackedKernel):
      return leaf.dtype
  return None


def is_packed(params) -> bool:
  """Whether a params tree holds packed kernels (a draft of a packed target is packed too)."""
  return kernel_dtype(params) is not None
