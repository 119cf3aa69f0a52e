"""Llama-family decoder-only transformer behind the step-function contract.

    step(params, tokens[B, T] int32, positions[B, T] int32, cache) -> (logits[B, T, V] float32, cache)

One code path serves prefill (T = padded prompt length), a draft step (T = 1) and verification
(T = gamma + 1). Layers are separate modules `layers_{i}` unrolled in Python, not stacked under
`nn.scan`: on XLA:CPU the scan sliced (copied) every layer's weights each step, which made a SmolLM2
decode step 2x slower; compiling 30 unrolled layers takes a couple of seconds.

After a step the cache's lengths are set to one past each row's last written position; callers that
wrote padding (a right-padded prefill) or rejected drafts roll back with `kv_cache.set_lengths`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax import axes
from specjax.models import kv_cache
from specjax.models.layers import CachedAttention, GatedMLP, RMSNorm, _param


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads}) for grouped-query attention")


SIZES = {
    # Hugging Face SmolLM2-135M(-Instruct); the embedded default target.
    "smollm2-135m": DecoderConfig(vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9,
                                  num_kv_heads=3, head_dim=64, mlp_dim=1536, rope_theta=100000.0),
    "smollm2-360m": DecoderConfig(vocab_size=49152, embed_dim=960, num_layers=32, num_heads=15,
                                  num_kv_heads=5, head_dim=64, mlp_dim=2560, rope_theta=100000.0),
    "llama2-7b": DecoderConfig(vocab_size=32000, embed_dim=4096, num_layers=32, num_heads=32,
                               num_kv_heads=32, head_dim=128, mlp_dim=11008, tie_embeddings=False),
    "llama3-8b": DecoderConfig(vocab_size=128256, embed_dim=4096, num_layers=32, num_heads=32,
                               num_kv_heads=8, head_dim=128, mlp_dim=14336, rope_theta=500000.0,
                               tie_embeddings=False),
    # Small shapes for tests.
    "tiny": DecoderConfig(vocab_size=128, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=16, mlp_dim=128),
}


class _Block(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, x, positions, keys, values):
    cfg = self.config
    attn_out, keys, values = CachedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             cfg.rope_theta, name="attn")(
        RMSNorm(cfg.norm_eps, name="attn_norm")(x), positions, keys, values)
    x = x + attn_out
    x = x + GatedMLP(cfg.mlp_dim, name="mlp")(RMSNorm(cfg.norm_eps, name="mlp_norm")(x))
    return x, keys, values


class DecoderOnly(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, tokens, positions, cache: kv_cache.KVCache):
    cfg = self.config
    embedding = _param(self, "embedding", (cfg.vocab_size, cfg.embed_dim), (axes.VOCAB, axes.EMBED))
    x = jnp.take(embedding, tokens, axis=0)
    keys, values = list(cache.keys), list(cache.values)
    for i in range(cfg.num_layers):
      x, keys[i], values[i] = _Block(cfg, name=f"layers_{i}")(x, positions, keys[i], values[i])
    x = RMSNorm(cfg.norm_eps, name="final_norm")(x)
    if cfg.tie_embeddings:
      logits = jnp.einsum("bte,ve->btv", x, embedding)
    else:
      lm_head = _param(self, "lm_head", (cfg.embed_dim, cfg.vocab_size), (axes.EMBED, axes.VOCAB))
      logits = x @ lm_head
    lengths = positions[:, -1].astype(jnp.int32) + 1
    return logits.astype(jnp.float32), kv_cache.KVCache(tuple(keys), tuple(values), lengths)


def init_cache(config: DecoderConfig, batch: int, max_length: int, dtype=jnp.float32):
  return kv_cache.init(config.num_layers, batch, max_length, config.num_kv_heads, config.head_dim,
                       dtype)


def make_step(config: DecoderConfig):
  """The step function of DESIGN.md contract 1 for this config (pure; jit it at the call site)."""
  model = DecoderOnly(config)

  def step(params, tokens, positions, cache):
    return model.apply({"params": params}, tokens, positions, cache)

  return step


def _example_inputs(config: DecoderConfig):
  """(tokens, positions, cache) of one token: enough to create every parameter."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return tokens, tokens, init_cache(config, 1, 2)


def _abstract_init(config: DecoderConfig):
  return jax.eval_shape(DecoderOnly(config).init, jax.random.PRNGKey(0), *_example_inputs(config))


def init_params(config: DecoderConfig, rng: jax.Array):
  """Random parameters (normal, std 0.02; norm scales 1), unboxed."""
  variables = jax.jit(DecoderOnly(config).init)(rng, *_example_inputs(config))
  return nn.unbox(variables["params"])


def param_logical_axes(config: DecoderConfig):
  """A tree shaped like the params whose leaves are PartitionSpecs of logical axis names."""
  return nn.get_partition_spec(_abstract_init(config))["params"]


def param_shapes(config: DecoderConfig):
  """A tree of jax.ShapeDtypeStruct shaped like the params (for checkpoint validation)."""
  return nn.unbox(_abstract_init(config))["params"]


def truncate_layers(config: DecoderConfig, params, num_layers: int):
  """An early-exit draft: the first `num_layers` blocks, then the final norm and the (tied) LM head.

  Returns (config with num_layers, params sharing the kept arrays; nothing is copied). Without
  training, the exit after k << L blocks predicts little like the full model (REFERENCE.md section 4),
  but it needs no weights beyond the target's and shares its tokenizer and sharding.
  """
  if int(num_layers) != num_layers or not 1 <= num_layers <= config.num_layers:
    raise ValueError(f"num_layers must be a whole number in 1..{config.num_layers}, got {num_layers}")
  dropped = {f"layers_{i}" for i in range(num_layers, config.num_layers)}
  kept = {name: leaf for name, leaf in params.items() if name not in dropped}
  return dataclasses.replace(config, num_layers=int(num_layers)), kept
