"""Llama-family decoder-only transformer behind the step-function contract.

    step(params, tokens[B, T] int32, positions[B, T] int32, cache) -> (logits[B, T, V] float32, cache)

One code path serves prefill (T = padded prompt length), a draft step (T = 1) and verification
(T = gamma + 1). Layers are separate modules `layers_{i}` unrolled in Python, not stacked under
`nn.scan`: on XLA:CPU the scan sliced (copied) every layer's weights each step, which made a SmolLM2
decode step 2x slower; compiling 30 unrolled layers takes a couple of seconds.

After a step the cache's lengths are set to one past each row's last written position; callers that
wrote padding (a right-padded prefill) or rejected drafts roll back with `contracts.set_lengths`.
`model(config)` is the contracts.Model the decoding loops take.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh

from specjax import axes, contracts, sharding
from specjax.models import kv_cache, layers
from specjax.models.layers import CachedAttention, GatedMLP, RMSNorm, param


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
  # 0: the LM head scores the whole vocabulary. K > 0: an untied head over K chosen tokens only (a
  # draft's subset head; the ids are params[HEAD_TOKENS]); every other token gets logit -inf.
  head_size: int = 0

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads}) for grouped-query attention")
    if not 0 <= self.head_size <= self.vocab_size:
      raise ValueError(f"head_size must lie in 0..vocab_size ({self.vocab_size}), got {self.head_size}")
    if self.head_size and self.tie_embeddings:
      raise ValueError("a subset head (head_size > 0) is its own [embed, head_size] kernel; set "
                       "tie_embeddings=False")


# The params entry of a subset-head model: int32 [head_size] vocabulary ids its head columns score.
HEAD_TOKENS = "head_tokens"


SIZES = {
    # Hugging Face SmolLM2-135M(-Instruct); the embedded default target.
    "smollm2-135m": DecoderConfig(vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9,
                                  num_kv_heads=3, head_dim=64, mlp_dim=1536, rope_theta=100000.0),
    "smollm2-360m": DecoderConfig(vocab_size=49152, embed_dim=960, num_layers=32, num_heads=15,
                                  num_kv_heads=5, head_dim=64, mlp_dim=2560, rope_theta=100000.0),
    "llama2-7b": DecoderConfig(vocab_size=32000, embed_dim=4096, num_layers=32, num_heads=32,
                               num_kv_heads=32, head_dim=128, mlp_dim=11008, tie_embeddings=False),
    # Llama 2 70B: the 70B-class target of Chen et al.'s Table 1 in this family (Chinchilla 70B is not
    # public; same width and depth, grouped-query attention, a 32k vocabulary).
    "llama2-70b": DecoderConfig(vocab_size=32000, embed_dim=8192, num_layers=80, num_heads=64,
                                num_kv_heads=8, head_dim=128, mlp_dim=28672, tie_embeddings=False),
    # Chen et al.'s 4B draft: d_model 6144, 48 heads, 8 layers, the target's vocabulary. Their MLP is
    # 4 x d_model ungated; the gated MLP here has 2/3 of that width, the same parameter count.
    "chen-4b-draft": DecoderConfig(vocab_size=32000, embed_dim=6144, num_layers=8, num_heads=48,
                                   num_kv_heads=48, head_dim=128, mlp_dim=16384,
                                   tie_embeddings=False),
    "llama3-8b": DecoderConfig(vocab_size=128256, embed_dim=4096, num_layers=32, num_heads=32,
                               num_kv_heads=8, head_dim=128, mlp_dim=14336, rope_theta=500000.0,
                               tie_embeddings=False),
    # Small shapes for tests.
    "tiny": DecoderConfig(vocab_size=128, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=16, mlp_dim=128),
}


class _Block(nn.Module):
  config: DecoderConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x, positions, keys, values, slots=None, visible=None):
    cfg = self.config
    attn_out, keys, values = CachedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             cfg.rope_theta, self.mesh, name="attn")(
        RMSNorm(cfg.norm_eps, name="attn_norm")(x), positions, keys, values, slots, visible)
    x = x + attn_out
    x = x + GatedMLP(cfg.mlp_dim, mesh=self.mesh, name="mlp")(
        RMSNorm(cfg.norm_eps, name="mlp_norm")(x))
    return sharding.constrain(x, layers.ACTIVATIONS, self.mesh), keys, values


class DecoderOnly(nn.Module):
  """The Llama-family network; `mesh` (optional) turns on the activation and cache constraints.

  `slots` / `visible` (optional) verify a token tree (layers.CachedAttention); `features` (a
  contracts.FeatureSpec) also returns the target features drafters read: the residual stream after
  the listed blocks and / or the final-norm state, concatenated [B, T, F].
  """
  config: DecoderConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, tokens, positions, cache: kv_cache.KVCache, slots=None, visible=None,
               features: contracts.FeatureSpec | None = None):
    cfg = self.config
    embedding = param(self, "embedding", (cfg.vocab_size, cfg.embed_dim), (axes.VOCAB, axes.EMBED))
    x = sharding.constrain(layers.embed(embedding, tokens), layers.ACTIVATIONS, self.mesh)
    keys, values = list(cache.keys), list(cache.values)
    after = {}  # the residual stream after each block a drafter reads
    for i in range(cfg.num_layers):
      x, keys[i], values[i] = _Block(cfg, self.mesh, name=f"layers_{i}")(
          x, positions, keys[i], values[i], slots, visible)
      if features is not None and i in features.blocks:
        after[i] = x
    x = RMSNorm(cfg.norm_eps, name="final_norm")(x)
    if cfg.tie_embeddings:
      logits = layers.tied_logits(self, x, embedding)
    else:
      lm_head = param(self, "lm_head", (cfg.embed_dim, cfg.head_size or cfg.vocab_size),
                       (axes.EMBED, axes.VOCAB))
      logits = layers.dense(x, lm_head, float32_out=True)
    lengths = (positions if slots is None else slots)[:, -1].astype(jnp.int32) + 1
    logits = sharding.constrain(logits.astype(jnp.float32), layers.LOGITS, self.mesh)
    cache = kv_cache.KVCache(tuple(keys), tuple(values), lengths)
    if features is None:
      return logits, cache
    return logits, cache, layers.tapped(features, after, x)


def init_cache(config: DecoderConfig, batch: int, max_length: int, dtype=jnp.float32):
  return kv_cache.init(config.num_layers, batch, max_length, config.num_kv_heads, config.head_dim,
                       dtype)


def make_step(config: DecoderConfig, mesh: Mesh | None = None):
  """The step function of DESIGN.md contract 1 for this config (pure; jit it at the call site). With
  a mesh, activations and the cache are laid out by the sharding rules.

  A subset-head model (config.head_size > 0) returns full-vocabulary logits too: its K logits land at
  params[HEAD_TOKENS] and every other token gets -inf, i.e. probability 0 after any transform. The
  speculative accept rule stays lossless, since the residual max(p - q, 0) covers those tokens.
  """
  head_step = head_logits_step(config, mesh)
  if not config.head_size:
    return head_step

  def step(params, tokens, positions, cache):
    head_logits, cache = head_step(params, tokens, positions, cache)
    full = jnp.full(head_logits.shape[:-1] + (config.vocab_size,), -jnp.inf, head_logits.dtype)
    return full.at[..., params[HEAD_TOKENS]].set(head_logits, mode="promise_in_bounds"), cache

  return step


def model(config: DecoderConfig, mesh: Mesh | None = None,
          cache_dtype=jnp.float32) -> contracts.StepModel:
  """The contracts.Model of this config: its step, its forward (tree verification and features;
  full-vocabulary models only: a subset-head draft verifies nothing) and empty-cache factory."""
  return contracts.StepModel(make_step(config, mesh),
                             functools.partial(init_cache, config, dtype=cache_dtype),
                             forward_fn=None if config.head_size else make_forward(config, mesh),
                             move=kv_cache.move)


def make_forward(config: DecoderConfig, mesh: Mesh | None = None):
  """forward(params, tokens, positions, cache, slots=None, visible=None, features=None) -> (logits,
  features[B, T, F] or None, cache): the step of `make_step` that can verify a token tree and return
  the features a drafter reads (contracts.Model.forward). Full-vocabulary models only."""
  if config.head_size:
    raise ValueError("a subset-head model is a draft; token trees are verified by a full-vocabulary "
                     "target")
  network = DecoderOnly(config, mesh)

  def forward(params, tokens, positions, cache, slots=None, visible=None, features=None):
    if features is None:
      logits, cache = network.apply({"params": model_params(params)}, tokens, positions, cache,
                                    slots, visible)
      return logits, None, cache
    features.check(config.num_layers)
    logits, cache, tapped = network.apply({"params": model_params(params)}, tokens, positions,
                                          cache, slots, visible, features)
    return logits, tapped, cache

  return forward


def model_params(params):
  """The flax parameters of a model (without a subset head's token ids)."""
  return {name: leaf for name, leaf in params.items() if name != HEAD_TOKENS}


def head_logits_step(config: DecoderConfig, mesh: Mesh | None = None):
  """step -> (logits over the head's own columns [B, T, head_size or V], cache): what training uses."""
  network = DecoderOnly(config, mesh)
  return lambda params, tokens, positions, cache: network.apply(
      {"params": model_params(params)}, tokens, positions, cache)


def _example_inputs(config: DecoderConfig):
  """(tokens, positions, cache) of one token: enough to create every parameter."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return tokens, tokens, init_cache(config, 1, 2)


@functools.lru_cache(maxsize=32)
def _abstract_init(config: DecoderConfig):
  """eval_shape of init (boxed: shapes and logical axes), cached: tracing an 80-layer model takes
  seconds, and shapes, shardings and plans all ask for it."""
  return jax.eval_shape(DecoderOnly(config).init, jax.random.PRNGKey(0), *_example_inputs(config))


def init_params(config: DecoderConfig, rng: jax.Array, head_tokens=None):
  """Random parameters (normal, std 0.02; norm scales 1), unboxed. A subset head scores
  `head_tokens` (default: ids 0..head_size-1)."""
  variables = jax.jit(DecoderOnly(config).init)(rng, *_example_inputs(config))
  params = nn.unbox(variables["params"])
  if config.head_size:
    ids = np.arange(config.head_size) if head_tokens is None else np.asarray(head_tokens)
    params = {**params, HEAD_TOKENS: jnp.asarray(validate_head_tokens(ids, config), jnp.int32)}
  return params


def validate_head_tokens(ids, config: DecoderConfig) -> np.ndarray:
  ids = np.asarray(ids)
  if ids.shape != (config.head_size,) or len(np.unique(ids)) != ids.size:
    raise ValueError(f"head tokens must be {config.head_size} distinct ids, got shape {ids.shape} "
                     f"with {len(np.unique(ids))} distinct")
  if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
    raise ValueError(f"head tokens must lie in 0..{config.vocab_size - 1}")
  return ids.astype(np.int32)


def param_logical_axes(config: DecoderConfig):
  """A tree shaped like the params whose leaves are PartitionSpecs of logical axis names."""
  tree = dict(nn.get_partition_spec(_abstract_init(config))["params"])
  if config.head_size:
    tree[HEAD_TOKENS] = jax.sharding.PartitionSpec(None)  # replicated: every shard scatters all K
  return tree


def param_shapes(config: DecoderConfig):
  """A tree of jax.ShapeDtypeStruct shaped like the params (for checkpoint validation)."""
  tree = dict(nn.unbox(_abstract_init(config))["params"])
  if config.head_size:
    tree[HEAD_TOKENS] = jax.ShapeDtypeStruct((config.head_size,), jnp.int32)
  return tree


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
