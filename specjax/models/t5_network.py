"""The T5 network itself (flax modules, T5X parameter names): its config, the sizes specjax knows,
the encoder and decoder stacks, and the T5Context `encode` computes once per request. `models/t5.py`
puts it behind contracts.Model.

Conventions (REFERENCE.md section 6; shared with T5X checkpoints and transformers' T5):
  * Parameter names are T5X's (`token_embedder/embedding`, `encoder/layers_{i}/attention/query/
    kernel`, `decoder/relpos_bias/rel_embedding`, ...), so T5X checkpoints map nearly 1:1. Kernels
    are 2-D [in, out] and layers are unrolled `layers_{i}` modules, for the XLA:CPU reasons given in
    layers.CachedAttention and decoder_only.py.
  * Attention logits are NOT scaled by 1/sqrt(head_dim) (T5 folds that into its init). Each stack
    has one relative position bias table [heads, buckets] added to all its self-attention layers;
    cross-attention has none.
  * Pre-norm residual blocks with float32 RMSNorm, no biases, no embedding scaling. T5 1.0: ReLU MLP
    and a head tied to the embedding, scaled by embed_dim**-0.5; T5 1.1: gated tanh-GELU MLP and an
    untied, unscaled `decoder/logits_dense`.
  * Sources are right-padded: encoder and cross-attention keys at positions >= source.lengths[b]
    are masked; encoder outputs at padded positions are unspecified.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specjax import axes, sharding
from specjax.models import cpu_kernels, kv_cache, layers
from specjax.models.layers import RMSNorm, param


@dataclasses.dataclass(frozen=True)
class T5Config:
  """A T5 architecture. Defaults are T5 1.1's conventions; `gated=False, tie_embeddings=True` is 1.0.

  gated: 1.1's gated tanh-GELU MLP (wi_0, wi_1, wo) instead of 1.0's ReLU MLP (wi, wo).
  tie_embeddings: 1.0's head: logits = y @ embedding.T * embed_dim**-0.5; 1.1 has its own
    `logits_dense` kernel [embed, vocab] and no scaling.
  max_source_length: the longest encoder input this model is configured for (0: unlimited; relative
    position bias has no length limit, but a task's feature length is a promise worth checking).
  """
  vocab_size: int = 32128
  embed_dim: int = 512
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  num_heads: int = 6
  head_dim: int = 64
  mlp_dim: int = 1024
  gated: bool = True
  tie_embeddings: bool = False
  relative_buckets: int = 32
  relative_max_distance: int = 128
  norm_eps: float = 1e-6
  max_source_length: int = 0
  pad_id: int = 0
  eos_id: int = 1
  decoder_start_id: int = 0


_V10 = dict(gated=False, tie_embeddings=True)
SIZES = {
    # T5 1.0 (Raffel et al. 2020): ReLU MLP, head tied to the embedding. 60M / 220M / 770M / 3B / 11B.
    "t5-small": T5Config(embed_dim=512, num_encoder_layers=6, num_decoder_layers=6, num_heads=8,
                         head_dim=64, mlp_dim=2048, **_V10),
    "t5-base": T5Config(embed_dim=768, num_encoder_layers=12, num_decoder_layers=12, num_heads=12,
                        head_dim=64, mlp_dim=3072, **_V10),
    "t5-large": T5Config(embed_dim=1024, num_encoder_layers=24, num_decoder_layers=24, num_heads=16,
                         head_dim=64, mlp_dim=4096, **_V10),
    "t5-3b": T5Config(embed_dim=1024, num_encoder_layers=24, num_decoder_layers=24, num_heads=32,
                      head_dim=128, mlp_dim=16384, **_V10),
    "t5-11b": T5Config(embed_dim=1024, num_encoder_layers=24, num_decoder_layers=24, num_heads=128,
                       head_dim=128, mlp_dim=65536, **_V10),
    # T5 1.1 (and Flan-T5, same shapes): gated GELU, untied head. The sizes Leviathan et al. used.
    "t5.1.1-small": T5Config(embed_dim=512, num_encoder_layers=8, num_decoder_layers=8, num_heads=6,
                             head_dim=64, mlp_dim=1024),
    "t5.1.1-base": T5Config(embed_dim=768, num_encoder_layers=12, num_decoder_layers=12,
                            num_heads=12, head_dim=64, mlp_dim=2048),
    "t5.1.1-large": T5Config(embed_dim=1024, num_encoder_layers=24, num_decoder_layers=24,
                             num_heads=16, head_dim=64, mlp_dim=2816),
    "t5.1.1-xl": T5Config(embed_dim=2048, num_encoder_layers=24, num_decoder_layers=24,
                          num_heads=32, head_dim=64, mlp_dim=5120),
    "t5.1.1-xxl": T5Config(embed_dim=4096, num_encoder_layers=24, num_decoder_layers=24,
                           num_heads=64, head_dim=64, mlp_dim=10240),
    # Small shapes for tests.
    "tiny": T5Config(vocab_size=128, embed_dim=32, num_encoder_layers=2, num_decoder_layers=2,
                     num_heads=4, head_dim=8, mlp_dim=64),
    "tiny-1.0": T5Config(vocab_size=128, embed_dim=32, num_encoder_layers=2, num_decoder_layers=2,
                         num_heads=4, head_dim=8, mlp_dim=64, **_V10),
}


def relative_position_bucket(relative_position, bidirectional: bool, num_buckets: int = 32,
                             max_distance: int = 128) -> jax.Array:
  """relative_position = key position - query position (int array) -> bucket ids, int32, same shape.

  Bidirectional (encoder): half the buckets per sign, keys after the query offset by
  num_buckets // 2. Causal (decoder): keys after the query all fall in bucket 0 (they are masked).
  Distances below max_exact = (buckets per sign) // 2 get a bucket each; longer ones share
  log-spaced buckets up to max_distance, beyond which they are clamped to the last bucket.
  """
  rp = jnp.asarray(relative_position, jnp.int32)
  if bidirectional:
    num_buckets //= 2
    offset = jnp.where(rp > 0, num_buckets, 0)
    distance = jnp.abs(rp)
  else:
    offset = jnp.zeros_like(rp)
    distance = jnp.maximum(-rp, 0)
  max_exact = num_buckets // 2
  # float32 and no epsilon inside the log, like transformers (t5x adds one; the buckets agree for
  # |rp| <= 300). The maximum keeps log(0) out of the branch `where` discards anyway.
  ratio = jnp.maximum(distance, max_exact).astype(jnp.float32) / max_exact
  log_bucket = jnp.log(ratio) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  large = jnp.minimum(max_exact + log_bucket.astype(jnp.int32), num_buckets - 1)
  return offset + jnp.where(distance < max_exact, distance, large)


class _Dense(nn.Module):
  """x[..., in] @ kernel[in, features] (no bias), summed in float32; returned in x's dtype, or in
  float32 with `float32_out` (the logits, which acceptance reads)."""
  features: int
  logical_axes: tuple
  float32_out: bool = False

  @nn.compact
  def __call__(self, x):
    kernel = param(self, "kernel", (x.shape[-1], self.features), self.logical_axes)
    return layers.dense(x, kernel, self.float32_out)


class _Module(nn.Module):
  """A T5 part: its config, and the mesh (optional) whose rules lay out its activations."""
  config: T5Config
  mesh: Mesh | None = None

  def constrain(self, x, logical):
    return sharding.constrain(x, logical, self.mesh)


class _Embedder(_Module):
  def setup(self):
    cfg = self.config
    self.embedding = param(self, "embedding", (cfg.vocab_size, cfg.embed_dim),
                            (axes.VOCAB, axes.EMBED))

  def __call__(self, tokens):
    return self.constrain(layers.embed(self.embedding, tokens), layers.ACTIVATIONS)

  def logits(self, y):
    """T5 1.0's tied head before its scaling: y[B, T, E] x embedding.T, float32."""
    return layers.tied_logits(self, y, self.embedding)


class _RelativePositionBias(_Module):
  """One stack's table rel_embedding[heads, buckets], shared by all its self-attention layers."""
  bidirectional: bool = False

  @nn.compact
  def __call__(self, query_positions, key_positions):
    """query_positions[B, T], key_positions[S] or [B, S] -> additive bias [B, heads, T, S] float32."""
    cfg = self.config
    table = param(self, "rel_embedding", (cfg.num_heads, cfg.relative_buckets), (axes.HEADS, None))
    key_positions = jnp.asarray(key_positions).reshape(-1, key_positions.shape[-1])  # [B or 1, S]
    buckets = relative_position_bucket(key_positions[:, None, :] - query_positions[:, :, None],
                                       self.bidirectional, cfg.relative_buckets,
                                       cfg.relative_max_distance)
    return jnp.moveaxis(jnp.take(table, buckets, axis=1), 0, 1).astype(jnp.float32)


class _Attention(_Module):
  """Multi-head attention with a separate key/value projection: cross-attention K/V are computed
  once per source, self-attention K/V go through the cache first."""

  def setup(self):
    inner = self.config.num_heads * self.config.head_dim
    self.query = _Dense(inner, (axes.EMBED, axes.HEADS))
    self.key = _Dense(inner, (axes.EMBED, axes.HEADS))
    self.value = _Dense(inner, (axes.EMBED, axes.HEADS))
    self.out = _Dense(self.config.embed_dim, (axes.HEADS, axes.EMBED))

  def _heads(self, x):
    x = x.reshape(*x.shape[:-1], self.config.num_heads, self.config.head_dim)
    return self.constrain(x, layers.HEAD_ACTIVATIONS)

  def project_kv(self, x):
    """x[B, S, E] -> (keys, values), each [B, S, heads, head_dim]."""
    return self._heads(self.key(x)), self._heads(self.value(x))

  def on_cpu_kernels(self) -> bool:
    """Whether this model's kernels are packed for specjax's CPU kernels (models/cpu_kernels.py):
    then its attention runs there too."""
    kernel = self.out.variables.get("params", {}).get("kernel")
    return isinstance(kernel, cpu_kernels.PackedKernel)

  def __call__(self, x, keys, values, mask, bias=None):
    """Queries from x[B, T, E] over keys / values [B, S, heads, head_dim] -> [B, T, E].

    mask: bool [B, 1, T or 1, S] (broadcast over heads, and over queries where it has one); bias:
    float32 [B or 1, heads, T, S] or None. No 1/sqrt(head_dim) on the logits: T5 folds it into the
    query init.
    """
    q = self._heads(self.query(x))
    if self.on_cpu_kernels():
      out = cpu_kernels.attention(q, keys, values, mask[:, 0], bias).astype(x.dtype)
      return self.out(out.reshape(*x.shape[:-1], -1))
    scores = jnp.einsum("bthd,bshd->bhts", q, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    if bias is not None:
      scores = scores + bias
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhts,bshd->bthd", weights, values.astype(x.dtype),
                     preferred_element_type=jnp.float32).astype(x.dtype)
    return self.out(out.reshape(*x.shape[:-1], -1))


class _Mlp(_Module):
  @nn.compact
  def __call__(self, x):
    cfg = self.config
    up = lambda name: _Dense(cfg.mlp_dim, (axes.EMBED, axes.MLP), name=name)(x)
    if cfg.gated:
      hidden = jax.nn.gelu(up("wi_0"), approximate=True) * up("wi_1")
    else:
      hidden = jax.nn.relu(up("wi"))
    hidden = self.constrain(hidden, layers.MLP_ACTIVATIONS)
    return _Dense(cfg.embed_dim, (axes.MLP, axes.EMBED), name="wo")(hidden)


class _EncoderLayer(_Module):
  @nn.compact
  def __call__(self, x, mask, bias):
    cfg, mesh = self.config, self.mesh
    attention = _Attention(cfg, mesh, name="attention")
    h = RMSNorm(cfg.norm_eps, name="pre_attention_layer_norm")(x)
    x = x + attention(h, *attention.project_kv(h), mask, bias)
    x = x + _Mlp(cfg, mesh, name="mlp")(RMSNorm(cfg.norm_eps, name="pre_mlp_layer_norm")(x))
    return self.constrain(x, layers.ACTIVATIONS)


class _Encoder(_Module):
  @nn.compact
  def __call__(self, x, lengths):
    """Embedded source x[B, S, E], lengths[B] -> encoded [B, S, E]."""
    cfg = self.config
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)
    bias = _RelativePositionBias(cfg, self.mesh, bidirectional=True, name="relpos_bias")(
        positions[None], positions)
    mask = source_mask(lengths, x.shape[1])
    for i in range(cfg.num_encoder_layers):
      x = _EncoderLayer(cfg, self.mesh, name=f"layers_{i}")(x, mask, bias)
    return RMSNorm(cfg.norm_eps, name="encoder_norm")(x)


class _DecoderLayer(_Module):
  def setup(self):
    cfg, mesh = self.config, self.mesh
    self.pre_self_attention_layer_norm = RMSNorm(cfg.norm_eps)
    self.self_attention = _Attention(cfg, mesh)
    self.pre_cross_attention_layer_norm = RMSNorm(cfg.norm_eps)
    self.encoder_decoder_attention = _Attention(cfg, mesh)
    self.pre_mlp_layer_norm = RMSNorm(cfg.norm_eps)
    self.mlp = _Mlp(cfg, mesh)

  def cross_kv(self, encoded):
    return self.encoder_decoder_attention.project_kv(encoded)

  def __call__(self, x, positions, keys, values, bias, cross_keys, cross_values, cross_mask,
               slots=None, visible=None):
    """x[B, T, E] at positions[B, T]; keys / values: this layer's cache buffers [B, S, H, D]. A chain
    writes token t at slot positions[:, t] and sees the slots up to it; a token tree (decoding/tree.py) gives
    its write slots[B, T] and visible[B, T, S]."""
    h = self.pre_self_attention_layer_norm(x)
    new_keys, new_values = self.self_attention.project_kv(h)
    slots = positions if slots is None else slots
    if self.self_attention.on_cpu_kernels():
      keys, values = cpu_kernels.cache_write(keys, values, new_keys, new_values, slots)
    else:
      keys = self.constrain(kv_cache.write(keys, new_keys, slots), kv_cache.LOGICAL_AXES)
      values = self.constrain(kv_cache.write(values, new_values, slots), kv_cache.LOGICAL_AXES)
    if visible is None:
      visible = kv_cache.attention_mask(positions, keys.shape[1])
    mask = visible[:, None]
    x = x + self.self_attention(h, keys, values, mask, bias)
    x = x + self.encoder_decoder_attention(self.pre_cross_attention_layer_norm(x), cross_keys,
                                           cross_values, cross_mask)
    x = x + self.mlp(self.pre_mlp_layer_norm(x))
    return self.constrain(x, layers.ACTIVATIONS), keys, values


class _Decoder(_Module):
  def setup(self):
    cfg = self.config
    self.relpos_bias = _RelativePositionBias(cfg, self.mesh, bidirectional=False)
    self.layers = [_DecoderLayer(cfg, self.mesh) for _ in range(cfg.num_decoder_layers)]
    self.decoder_norm = RMSNorm(cfg.norm_eps)
    if not cfg.tie_embeddings:
      self.logits_dense = _Dense(cfg.vocab_size, (axes.EMBED, axes.VOCAB), float32_out=True)

  def cross_kv(self, encoded):
    """encoded[B, S, E] -> (keys, values): tuples with one [B, S, H, D] array per layer."""
    pairs = [layer.cross_kv(encoded) for layer in self.layers]
    return tuple(k for k, _ in pairs), tuple(v for _, v in pairs)

  def __call__(self, x, positions, cache, context, tied_head, slots=None, visible=None,
               features=None):
    """Embedded x[B, T, E] -> (logits[B, T, V] float32, cache, the features a drafter reads
    (contracts.FeatureSpec over the decoder's blocks) [B, T, F] or None)."""
    cfg = self.config
    # Causal bias of each query position against every cache slot; slots after the query are
    # masked in the layers, so their bucket (0) never counts. Slot s holds position s, except a
    # token tree's: its nodes sit at positions[:, t] in slots[:, t], and the bias is by position.
    key_positions = jnp.arange(cache.max_length, dtype=jnp.int32)
    if slots is not None:
      rows = jnp.arange(positions.shape[0])[:, None]
      key_positions = jnp.broadcast_to(key_positions, (positions.shape[0], cache.max_length))
      key_positions = key_positions.at[rows, slots].set(positions.astype(jnp.int32))
    bias = self.relpos_bias(positions, key_positions)
    cross_mask = source_mask(context.source_lengths, context.keys[0].shape[1])
    keys, values = list(cache.keys), list(cache.values)
    after = {}  # the residual stream after each block a drafter reads
    for i, layer in enumerate(self.layers):
      x, keys[i], values[i] = layer(x, positions, keys[i], values[i], bias, context.keys[i],
                                    context.values[i], cross_mask, slots, visible)
      if features is not None and i in features.blocks:
        after[i] = x
    y = self.decoder_norm(x)
    if cfg.tie_embeddings:
      logits = tied_head(y) * cfg.embed_dim ** -0.5
    else:
      logits = self.logits_dense(y)
    logits = self.constrain(logits.astype(jnp.float32), layers.LOGITS)
    lengths = (positions if slots is None else slots)[:, -1].astype(jnp.int32) + 1
    tapped = None if features is None else layers.tapped(features, after, y)
    return logits, kv_cache.KVCache(tuple(keys), tuple(values), lengths), tapped


@flax.struct.dataclass
class T5Context:
  """What `encode` computes once per request: every decoder layer's cross-attention keys and values
  (tuples of [B, S, heads, head_dim]) and the source lengths[B] that mask their padded slots."""
  keys: tuple
  values: tuple
  source_lengths: jax.Array


class Network(_Module):
  """The whole T5: one embedder shared by an encoder and a decoder."""
  def setup(self):
    self.token_embedder = _Embedder(self.config, self.mesh)
    self.encoder = _Encoder(self.config, self.mesh)
    self.decoder = _Decoder(self.config, self.mesh)

  def encode(self, source_tokens, source_lengths):
    return self.encoder(self.token_embedder(source_tokens), source_lengths)

  def context(self, source_tokens, source_lengths):
    keys, values = self.decoder.cross_kv(self.encode(source_tokens, source_lengths))
    return T5Context(keys, values, jnp.asarray(source_lengths, jnp.int32))

  def decode(self, tokens, positions, cache, context, slots=None, visible=None, features=None):
    return self.decoder(self.token_embedder(tokens), positions, cache, context,
                        self.token_embedder.logits, slots, visible, features)

  def __call__(self, source_tokens, source_lengths, tokens, positions, cache):
    """The whole model in one call (creates every parameter at init)."""
    return self.decode(tokens, positions, cache, self.context(source_tokens, source_lengths))[:2]


def source_mask(lengths, source_length: int) -> jax.Array:
  """lengths[B] -> bool [B, 1, 1, S]: the valid (non-padding) keys of each right-padded source."""
  return (jnp.arange(source_length) < jnp.asarray(lengths)[:, None])[:, None, None, :]
