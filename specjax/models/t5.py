"""T5 encoder-decoder (T5 1.0 and T5 1.1 / Flan-T5) behind contracts.Model.

    model = t5.model(config)  # a T5Model
    context = model.encode(params, Source(tokens[B, S], lengths[B]))
    logits[B, T, V], cache = model.decode_step(params, context, tokens[B, T], positions[B, T],
                                               cache)

`encode` runs the encoder once per request and projects every decoder layer's cross-attention keys
and values (the T5Context); `decode_step` runs only the decoder. As in decoder_only.py, one step
writes any number T of tokens into the decoder's self-attention cache at `positions` (prefill T = P,
draft T = 1, verification T = gamma + 1) and returns the cache with lengths = positions[:, -1] + 1;
callers roll back with contracts.set_lengths. The decoder's prompt is its start token
(`decoder_prompt`). Given a mesh, activations and caches are laid out by sharding.py's rules.

The network and its conventions (T5X names, unscaled attention logits, relative position bias,
T5 1.0 vs 1.1) are in `models/t5_network.py`; its config and sizes are re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax import contracts
from specjax.models import kv_cache
from specjax.models.t5_network import (  # noqa: F401  (re-exported: the family's public names)
    SIZES, Network, T5Config, T5Context, relative_position_bucket)


def init_cache(config: T5Config, batch: int, max_length: int,
               dtype=jnp.float32) -> kv_cache.KVCache:
  """The decoder's empty self-attention cache (cross-attention K/V live in the T5Context)."""
  return kv_cache.init(config.num_decoder_layers, batch, max_length, config.num_heads,
                       config.head_dim, dtype)


def decoder_prompt(config: T5Config, batch: int):
  """(tokens[B, 1] int32 = decoder_start_id, lengths[B] = 1): what the loops prefill for T5."""
  return jnp.full((batch, 1), config.decoder_start_id, jnp.int32), jnp.ones((batch,), jnp.int32)


def encode(config: T5Config, params, source: contracts.Source) -> jax.Array:
  """The encoder output [B, S, E] of a right-padded source (rows past its lengths unspecified)."""
  return Network(config).apply({"params": params}, source.tokens, source.lengths, method=Network.encode)


@dataclasses.dataclass(frozen=True)
class T5Model:
  """contracts.Model of a T5: `encode` once per request, then `decode_step` for every token."""
  config: T5Config
  mesh: Mesh | None = None
  cache_dtype: Any = jnp.float32
  encoder_decoder: bool = dataclasses.field(default=True, init=False)

  def encode(self, params, source: contracts.Source | None) -> T5Context:
    """Run the encoder on the right-padded source[B, S] and project every decoder layer's
    cross-attention keys and values: the context `decode_step` closes over."""
    cfg = self.config
    if source is None:
      raise ValueError("T5 is an encoder-decoder model: it needs source=Source(tokens, lengths), "
                       "the encoder input; its decoder prompt is decoder_prompt(config, batch)")
    source_length = source.tokens.shape[1]
    if cfg.max_source_length and source_length > cfg.max_source_length:
      raise ValueError(f"the source is {source_length} tokens long but this T5 is configured for "
                       f"at most max_source_length={cfg.max_source_length}; truncate the source to "
                       f"{cfg.max_source_length} tokens or raise config.max_source_length")
    return Network(cfg, self.mesh).apply({"params": params}, source.tokens, source.lengths,
                                     method=Network.context)

  def decode_step(self, params, context: T5Context, tokens, positions, cache):
    """tokens[B, T] at positions[B, T] -> (logits[B, T, V] float32, cache with lengths
    positions[:, -1] + 1). Any T: prefill, one draft token, or a verification chunk."""
    logits, _, cache = self.forward(params, context, tokens, positions, cache)
    return logits, cache

  def forward(self, params, context: T5Context, tokens, positions, cache, slots=None, visible=None,
              features=None):
    """decode_step that can verify a token tree and return the features a drafter reads
    (contracts.Model.forward): (logits, features[B, T, F] or None, cache)."""
    if features is not None:
      features.check(self.config.num_decoder_layers)
    logits, cache, tapped = Network(self.config, self.mesh).apply(
        {"params": params}, tokens, positions, cache, context, slots, visible, features,
        method=Network.decode)
    return logits, tapped, cache

  def move_cache(self, cache, source_slots, dest_slots):
    return kv_cache.move(cache, source_slots, dest_slots)

  def init_cache(self, batch: int, max_length: int) -> kv_cache.KVCache:
    return init_cache(self.config, batch, max_length, self.cache_dtype)

  def open(self, params, source: contracts.Source | None = None) -> contracts.Session:
    """Encode once and bind: contracts.open_session(self, params, source)."""
    return contracts.open_session(self, params, source)


def model(config: T5Config, mesh: Mesh | None = None, cache_dtype=jnp.float32) -> T5Model:
  return T5Model(config, mesh, cache_dtype)


def _example_inputs(config: T5Config):
  """(source tokens, source lengths, tokens, positions, cache) of one token: creates every param."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return tokens, jnp.ones((1,), jnp.int32), tokens, tokens, init_cache(config, 1, 2)


@functools.lru_cache(maxsize=32)
def _abstract_init(config: T5Config):
  """eval_shape of init (boxed: shapes and logical axes), cached: tracing a 24+24-layer T5 takes
  seconds."""
  return jax.eval_shape(Network(config).init, jax.random.PRNGKey(0), *_example_inputs(config))


def init_params(config: T5Config, rng: jax.Array):
  """Random parameters (normal, std 0.02; norm scales 1), unboxed."""
  return nn.unbox(jax.jit(Network(config).init)(rng, *_example_inputs(config))["params"])


def param_shapes(config: T5Config):
  """A tree of jax.ShapeDtypeStruct shaped like the params (nothing is allocated)."""
  return nn.unbox(_abstract_init(config))["params"]


def param_logical_axes(config: T5Config):
  """A tree shaped like the params whose leaves are PartitionSpecs of logical axis names."""
  return nn.get_partition_spec(_abstract_init(config))["params"]


def num_params(config: T5Config) -> int:
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(param_shapes(config)))
