"""Building blocks shared by the model families: RMSNorm, RoPE, gated MLP, cached GQA attention.

Parameters are created with logical axis names (`specjax/axes.py`) so `sharding.py` can place them;
kernels are 2-D [in, out] (heads * head_dim joined: see CachedAttention). A layer given a mesh also
constrains its activations and cache buffers with the same rules (`sharding.constrain`), so a batched
decode keeps its rows on 'data' and its heads on 'model'; without a mesh nothing is constrained.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax.sharding import Mesh

from specjax import axes, sharding
from specjax.models import cpu_kernels, kv_cache

# Logical layouts of the activations a layer constrains.
ACTIVATIONS = (axes.BATCH, axes.LENGTH, axes.EMBED)
HEAD_ACTIVATIONS = (axes.BATCH, axes.LENGTH, axes.HEADS, axes.HEAD_DIM)
MLP_ACTIVATIONS = (axes.BATCH, axes.LENGTH, axes.MLP)
LOGITS = (axes.BATCH, axes.LENGTH, axes.VOCAB)


def dense(x: jax.Array, kernel, float32_out: bool = False) -> jax.Array:
  """x[..., in] @ kernel[in, out], summed in float32 and returned in x's dtype (or in float32 with
  `float32_out`): bfloat16 activations keep float32 accumulation (in float32 this is the plain
  product). A kernel cpu_kernels.pack_params packed runs on the CPU kernels (cpu_kernels.matmul)."""
  if isinstance(kernel, cpu_kernels.PackedKernel):
    return cpu_kernels.matmul(x, kernel, jnp.float32 if float32_out else x.dtype)
  # One [rows, in] x [in, out] product: XLA:CPU runs a product with several leading dims, and above
  # all its gradient (a contraction over batch and time together), 1.5-1.7x slower than this GEMM.
  product = jnp.matmul(x.reshape(-1, x.shape[-1]), kernel, preferred_element_type=jnp.float32)
  product = product.reshape(*x.shape[:-1], kernel.shape[-1])
  return product if float32_out else product.astype(x.dtype)


def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """table[tokens]: rows of an embedding table [V, E], or of the 16-bit patterns of a bfloat16 one
  (uint16, as cpu_kernels.pack_params stores it) returned as float32 (exactly): on the CPU kernels
  a bfloat16 model's residual stream runs in float32, its products rounding their rows to bfloat16
  themselves, because XLA:CPU's own bfloat16 arithmetic (the adds, activations and rotations between
  products, each a convert to float32 and back) cost 1/4 of a 17-token verification."""
  rows = jnp.take(table, tokens, axis=0)
  if table.dtype != jnp.uint16:
    return rows
  return jax.lax.bitcast_convert_type(rows, jnp.bfloat16).astype(jnp.float32)


def tied_logits(module: nn.Module, x: jax.Array, embedding: jax.Array) -> jax.Array:
  """x[B, T, E] against a tied embedding table[V, E] -> logits[B, T, V] float32; through the packed
  transposed table where cpu_kernels.pack_params put one beside the table (in `module`'s params)."""
  if module.has_variable("params", cpu_kernels.HEAD):
    return cpu_kernels.matmul(x, module.get_variable("params", cpu_kernels.HEAD))
  return jnp.einsum("bte,ve->btv", x, embedding, preferred_element_type=jnp.float32)


def fused_dense(module: nn.Module, x: jax.Array, names: tuple) -> list[jax.Array] | None:
  """x through the kernels `names` as one product, where cpu_kernels.pack_params fused them (one
  output per kernel, in x's dtype); None where they are separate kernels."""
  name = cpu_kernels.fused_name(names)
  if not module.has_variable("params", name):
    return None
  fused = module.get_variable("params", name)
  return cpu_kernels.split(cpu_kernels.matmul(x, fused, x.dtype), fused)


def param(module: nn.Module, name: str, shape, logical_axes, init=None, dtype=jnp.float32):
  """module.param with logical axis names (for sharding.py); normal(0.02) unless `init` says. A
  kernel cpu_kernels.pack_params packed is returned as it is (flax would check its shape)."""
  if module.has_variable("params", name):
    value = module.get_variable("params", name)
    if isinstance(value, (cpu_kernels.PackedKernel, cpu_kernels.NormScale)):
      return value
  init = init or nn.initializers.normal(stddev=0.02)
  return module.param(name, nn.with_logical_partitioning(init, logical_axes), shape, dtype)


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = param(self, "scale", (x.shape[-1],), (axes.EMBED,), nn.initializers.ones)
    if isinstance(scale, cpu_kernels.NormScale):  # the CPU kernels: a sum in one fixed order
      return cpu_kernels.rms_norm(x, scale.data, self.eps).astype(x.dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * scale).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, rotate-half convention (Hugging Face Llama). x[B, T, heads, d], positions[B, T]."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, half]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class GatedMLP(nn.Module):
  """SwiGLU (Llama): down(act(gate(x)) * up(x))."""
  hidden_dim: int
  activation: str = "silu"
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x):
    embed = x.shape[-1]
    fused = fused_dense(self, x, ("w_gate", "w_up"))
    if fused is None:
      w_gate = param(self, "w_gate", (embed, self.hidden_dim), (axes.EMBED, axes.MLP))
      w_up = param(self, "w_up", (embed, self.hidden_dim), (axes.EMBED, axes.MLP))
      fused = dense(x, w_gate), dense(x, w_up)
    w_down = param(self, "w_down", (self.hidden_dim, embed), (axes.MLP, axes.EMBED))
    act = {"silu": jax.nn.silu, "gelu": lambda v: jax.nn.gelu(v, approximate=True)}[self.activation]
    gate, up = fused
    hidden = sharding.constrain(act(gate) * up, MLP_ACTIVATIONS, self.mesh)
    return dense(hidden, w_down)


class CachedAttention(nn.Module):
  """Grouped-query self-attention that writes its keys/values into this layer's cache buffers.

  __call__(x[B, T, E], positions[B, T], keys, values, slots=None, visible=None) -> (y[B, T, E], keys,
  values), with keys / values this layer's [B, S, kv, d] buffers. A chain writes token t at slot
  positions[:, t] and sees the slots up to its position. A token tree (decoding/tree.py) passes its own write
  `slots[B, T]` and `visible[B, T, S]`: a node sits at position prefix + depth (its RoPE angle) but in
  slot prefix + node index, and sees the prefix and its ancestors only.

  Kernels are 2-D ([embed, heads * head_dim]): on XLA:CPU a dot against a 3-D [embed, heads, head_dim]
  kernel lowered to a transposing copy of the weights every step, doubling a decode step's time.
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x, positions, keys, values, slots=None, visible=None):
    batch, steps, embed = x.shape
    h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
    fused = fused_dense(self, x, ("wq", "wk", "wv"))
    if fused is None:
      wq = param(self, "wq", (embed, h * d), (axes.EMBED, axes.HEADS))
      wk = param(self, "wk", (embed, kv * d), (axes.EMBED, axes.KV_HEADS))
      wv = param(self, "wv", (embed, kv * d), (axes.EMBED, axes.KV_HEADS))
      fused = dense(x, wq), dense(x, wk), dense(x, wv)
    wo = param(self, "wo", (h * d, embed), (axes.HEADS, axes.EMBED))
    q, k, v = fused
    q = rope(q.reshape(batch, steps, h, d), positions, self.rope_theta)
    k = rope(k.reshape(batch, steps, kv, d), positions, self.rope_theta)
    v = v.reshape(batch, steps, kv, d)
    slots = positions if slots is None else slots
    if visible is None:
      visible = kv_cache.attention_mask(positions, keys.shape[1])
    if isinstance(wo, cpu_kernels.PackedKernel):  # the CPU kernels (cpu_kernels.py): fixed-order sums
      keys, values = cpu_kernels.cache_write(keys, values, k, v, slots)
      out = cpu_kernels.attention(q, keys, values, visible, scale=d ** -0.5).astype(x.dtype)
      return dense(out.reshape(batch, steps, h * d), wo), keys, values
    q = sharding.constrain(q, HEAD_ACTIVATIONS, self.mesh)
    keys = sharding.constrain(kv_cache.write(keys, k, slots), kv_cache.LOGICAL_AXES, self.mesh)
    values = sharding.constrain(kv_cache.write(values, v, slots), kv_cache.LOGICAL_AXES, self.mesh)
    q = q.reshape(batch, steps, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys.astype(x.dtype),
                        preferred_element_type=jnp.float32) * (d ** -0.5)
    mask = visible[:, None, None]
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, values.astype(x.dtype),
                     preferred_element_type=jnp.float32).astype(x.dtype)
    return dense(out.reshape(batch, steps, h * d), wo), keys, values


def tapped(features, after: dict, final: jax.Array) -> jax.Array:
  """The features a drafter reads (contracts.FeatureSpec), concatenated on the last axis: the residual
  stream after each listed block (`after[block]`), then the final-norm state `final`."""
  return jnp.concatenate([after[b] for b in features.blocks] + ([final] if features.final_norm else []),
                         axis=-1)
