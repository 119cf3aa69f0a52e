"""DFlash ("Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036): a block drafter that
proposes the next B - 1 tokens in ONE forward pass, conditioned on several of the target's own layers.

    context   the residual stream after `feature_blocks` of the target (contracts.FeatureSpec),
              concatenated [n E], projected to E without bias, then RMS-normed: one vector per
              position the target has scored;
    block     the root (the newest committed token, not yet scored by the target) then B - 1 mask
              tokens, embedded by the target's frozen table, at positions root .. root + B - 1;
    layers    plain Llama decoder layers of the target's width. In each, queries come from the block
              only; keys and values from [context ; block] through the layer's own K/V projections,
              RoPE at absolute positions, no causal mask: the block sees every context position
              before the root and all of itself, never a later block;
    output    a final RMSNorm, then the target's frozen output rows (restricted to the `head_size`
              tokens the teacher data uses most, as for the MTP head) at block positions 1 .. B - 1.

At decode time the context's keys and values live in the drafter's own per-layer cache: each
iteration writes those of the positions accepted since the last one (DraftContext.features); the
block's are dropped after the pass. Training (training/dflash.py) scores many blocks of one sequence
in one pass with exactly this visibility (`training_visibility`), which `visibility` reproduces for one
block at decode time.

Two ways to verify it: `DFlashDrafter` offers each position's top-`width` tokens as point masses
(a chain of argmaxes is the released rule: at temperature > 0 a draft token is kept when it equals
the target's own sample; a spine tree adds siblings), and `SampledDFlash` draws each position's token
from the drafter's own distribution, which chain rejection verifies (Leviathan / Chen). Both are
lossless; they differ in how many tokens they keep.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax import contracts
from specjax.contracts import DraftContext, Proposal
from specjax.decoding import sampling
from specjax.decoding import tree as trees
from specjax.decoding.sampling import top_ids
from specjax.drafters import expansion, heads
from specjax.models import cpu_kernels, kv_cache, layers

KIND = "dflash"
WEIGHTS_FILE = "dflash.npz"
TRAIN_COMMAND = "python -m specjax.train --gin_file=configs/smollm2_dflash.gin"
LAYER_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
KERNELS = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def feature_blocks(num_layers: int, count: int = 5) -> tuple[int, ...]:
  """The target blocks (0-based) whose output the drafter reads: `count` spaced evenly from the
  second block to the third-to-last, round(1 + i (L - 4) / (count - 1)) as DFlash picks them (the
  stream AFTER each). Shallow targets get what exists: clipped to 0 .. L - 1, duplicates dropped."""
  if count < 1:
    raise ValueError(f"a DFlash drafter reads at least one target block, got count={count}")
  if count == 1:
    return (min(1, num_layers - 1),)
  picks = [round(1 + i * (num_layers - 4) / (count - 1)) for i in range(count)]
  return tuple(sorted({min(max(p, 0), num_layers - 1) for p in picks}))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """The drafter's shape: the block, its layers (the target's width and attention shape) and what it
  reads. `mask_token`: the id whose (frozen) embedding fills the block after the root."""
  block_size: int
  num_layers: int
  feature_blocks: tuple[int, ...]
  mask_token: int
  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float
  norm_eps: float

  def __post_init__(self):
    object.__setattr__(self, "feature_blocks", tuple(int(b) for b in self.feature_blocks))
    if self.block_size < 2 or self.num_layers < 1:
      raise ValueError(f"a DFlash block holds the root and at least one mask token (block_size >= 2) "
                       f"and the drafter at least one layer; got block_size={self.block_size}, "
                       f"num_layers={self.num_layers}")

  @classmethod
  def for_target(cls, target_config, block_size: int = 8, num_layers: int = 2,
                 num_features: int = 5, mask_token: int = 0) -> "DFlashConfig":
    """A drafter of the target's width and attention shape reading `num_features` of its blocks."""
    if not 0 <= mask_token < target_config.vocab_size:
      raise ValueError(f"mask_token must be a token id of the target (0..{target_config.vocab_size - 1}), "
                       f"got {mask_token}")
    return cls(block_size, num_layers, feature_blocks(target_config.num_layers, num_features),
               mask_token, target_config.embed_dim, target_config.num_heads,
               target_config.num_kv_heads, target_config.head_dim, target_config.mlp_dim,
               target_config.rope_theta, target_config.norm_eps)

  @property
  def features(self) -> contracts.FeatureSpec:
    return contracts.FeatureSpec(blocks=self.feature_blocks)


def init_params(config: DFlashConfig, rng) -> dict:
  """Random kernels (normal, std 0.02), norm scales 1; float32 numpy."""
  e, h, kv, d, m = (config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim,
                    config.mlp_dim)
  shapes = {"wq": (e, h * d), "wk": (e, kv * d), "wv": (e, kv * d), "wo": (h * d, e),
            "w_gate": (e, m), "w_up": (e, m), "w_down": (m, e)}
  gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)).astype(np.uint64).tolist())
  normal = lambda shape: (0.02 * gen.standard_normal(shape)).astype(np.float32)
  params = {"fc": normal((len(config.feature_blocks) * e, e)),
            "context_norm": np.ones(e, np.float32), "final_norm": np.ones(e, np.float32)}
  for i in range(config.num_layers):
    layer = {name: normal(shape) for name, shape in shapes.items()}
    params[f"layers_{i}"] = {**layer, "attn_norm": np.ones(e, np.float32),
                             "mlp_norm": np.ones(e, np.float32)}
  return params


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def project_context(config: DFlashConfig, params: dict, features: jax.Array) -> jax.Array:
  """features[..., n E] (the target's, any float dtype) -> the context vectors [..., E] float32."""
  projected = layers.dense(features.astype(jnp.float32), params["fc"], float32_out=True)
  return rms_norm(projected, params["context_norm"], config.norm_eps)


def context_kv(config: DFlashConfig, params: dict, context: jax.Array, positions: jax.Array):
  """context[B, S, E] at positions[B, S] -> per layer (keys, values) [B, S, kv, d], keys rotated."""
  batch, length, _ = context.shape
  shape = (batch, length, config.num_kv_heads, config.head_dim)
  out = []
  for i in range(config.num_layers):
    layer = params[f"layers_{i}"]
    keys = layers.rope(layers.dense(context, layer["wk"], float32_out=True).reshape(shape),
                       positions, config.rope_theta)
    out.append((keys, layers.dense(context, layer["wv"], float32_out=True).reshape(shape)))
  return out


def block_hidden(config: DFlashConfig, params: dict, x: jax.Array, positions: jax.Array,
                 cached: list, context_visible: jax.Array, block_visible: jax.Array) -> jax.Array:
  """The drafter's layers over block embeddings x[B, Q, E] at positions[B, Q] (one block or many).

  cached: per layer the context's (keys, values) [B, S, kv, d]; context_visible[B, Q, S] and
  block_visible[B, Q, Q] say which context slots and which block tokens each query sees.
  -> the final-normed hidden states [B, Q, E] float32."""
  batch, steps, _ = x.shape
  h, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
  visible = jnp.concatenate([context_visible, block_visible], axis=-1)[:, None, None]
  x = x.astype(jnp.float32)
  for i, (context_keys, context_values) in enumerate(cached):
    layer = params[f"layers_{i}"]
    normed = rms_norm(x, layer["attn_norm"], config.norm_eps)
    q = layers.rope(layers.dense(normed, layer["wq"], float32_out=True).reshape(batch, steps, h, d),
                    positions, config.rope_theta)
    k = layers.rope(layers.dense(normed, layer["wk"], float32_out=True).reshape(batch, steps, kv, d),
                    positions, config.rope_theta)
    v = layers.dense(normed, layer["wv"], float32_out=True).reshape(batch, steps, kv, d)
    keys = jnp.concatenate([context_keys, k], axis=1)
    values = jnp.concatenate([context_values, v], axis=1)
    q = q.reshape(batch, steps, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys) * (d ** -0.5)
    weights = jax.nn.softmax(jnp.where(visible, scores, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, values).reshape(batch, steps, h * d)
    x = x + layers.dense(out, layer["wo"], float32_out=True)
    normed = rms_norm(x, layer["mlp_norm"], config.norm_eps)
    gated = jax.nn.silu(layers.dense(normed, layer["w_gate"], float32_out=True))
    x = x + layers.dense(gated * layers.dense(normed, layer["w_up"], float32_out=True),
                         layer["w_down"], float32_out=True)
  return rms_norm(x, params["final_norm"], config.norm_eps)


def block_tokens(config: DFlashConfig, roots: jax.Array) -> jax.Array:
  """roots[...] -> [..., B]: each root followed by B - 1 mask tokens."""
  masks = jnp.full(roots.shape + (config.block_size - 1,), config.mask_token, jnp.int32)
  return jnp.concatenate([roots[..., None].astype(jnp.int32), masks], axis=-1)


def training_visibility(anchors: jax.Array, block_size: int, context_length: int):
  """anchors[B, M] (each block's root position) -> (context_visible [B, M*bs, S], block_visible
  [B, M*bs, M*bs]): a block's tokens see the context strictly before its anchor and their own block
  (both ways), never another block."""
  owner = jnp.repeat(anchors, block_size, axis=1)                                   # [B, Q]
  context_visible = jnp.arange(context_length)[None, None, :] < owner[:, :, None]
  block_id = jnp.arange(anchors.shape[1] * block_size) // block_size
  block_visible = jnp.broadcast_to(block_id[:, None] == block_id[None, :],
                                   (anchors.shape[0],) + (block_id.size,) * 2)
  return context_visible, block_visible


def visibility(position: jax.Array, block_size: int, context_length: int):
  """One block per row at root `position[B]`: `training_visibility` of a single anchor."""
  return training_visibility(position[:, None], block_size, context_length)


def block_logits(config: DFlashConfig, params: dict, head_rows, hidden: jax.Array) -> jax.Array:
  """hidden[..., B, E] of whole blocks -> logits[..., B - 1, S] over the head rows for block positions
  1 .. B - 1 (the tokens after the root)."""
  return heads.scored(hidden[..., 1:, :], head_rows)


# ---- the drafter ----------------------------------------------------------------------------------

def _full_vocabulary(logits: jax.Array, head_tokens: jax.Array, vocab_size: int) -> jax.Array:
  """Head-column logits [..., S] -> [..., V] with -inf off the head (probability 0 after any
  transform; chain rejection stays lossless, its residual covering those tokens)."""
  full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
  return full.at[..., head_tokens].set(logits, mode="promise_in_bounds")


@dataclasses.dataclass(frozen=True)
class _Block:
  """What both DFlash drafters share: the context cache (state: per layer (keys, values)
  [B, max_length, kv, d]) and one block pass per iteration."""
  config: DFlashConfig
  encoder_decoder: bool = dataclasses.field(default=False, init=False)

  @property
  def features(self) -> contracts.FeatureSpec:
    return self.config.features

  @property
  def calls_per_iteration(self) -> int:
    return 1

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    del prompt_lengths  # padded positions are written too, then overwritten before anyone sees them
    if source is not None:
      raise ValueError("the DFlash drafter reads a decoder-only target's hidden states and takes no "
                       "source")
    if features is None:
      raise ValueError("the DFlash drafter needs the target's features at the prompt positions")
    batch, length = prompt_tokens.shape
    cfg = self.config
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    empty = jnp.zeros((batch, max_length, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    state = tuple((empty, empty) for _ in range(cfg.num_layers))
    return self._write(params, state, features, positions, jnp.ones((batch, length), bool))

  def _write(self, params, state, features, positions, valid):
    """The context's keys and values at positions[B, K] where valid[B, K] (others dropped)."""
    context = project_context(self.config, params["dflash"], features)
    return tuple((kv_cache.write(keys, k, positions, valid), kv_cache.write(values, v, positions, valid))
                 for (keys, values), (k, v) in zip(state, context_kv(self.config, params["dflash"],
                                                                    context, positions)))

  def block(self, params, state, context: DraftContext):
    """-> (logits [B, B - 1, S] over the head rows, state with the new context written)."""
    cfg = self.config
    count = context.features.shape[1]
    offsets = jnp.arange(count, dtype=jnp.int32)[None, :]
    positions = context.position[:, None] - context.feature_count[:, None] + offsets
    state = self._write(params, state, context.features, jnp.maximum(positions, 0),
                        offsets < context.feature_count[:, None])
    tokens = block_tokens(cfg, context.root)
    block_positions = context.position[:, None] + jnp.arange(cfg.block_size, dtype=jnp.int32)
    context_visible, block_visible = visibility(context.position, cfg.block_size, state[0][0].shape[1])
    hidden = block_hidden(cfg, params["dflash"], layers.embed(params["embed_rows"], tokens),
                          block_positions, list(state), context_visible, block_visible)
    return block_logits(cfg, params["dflash"], params["head_rows"], hidden), state


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(_Block, expansion.Ranked):
  """Each block position's top-`width` head tokens as point masses, arranged as `tree` (depth at most
  B - 1): a chain of argmaxes is DFlash's own rule, verified by the tree walk."""
  tree: trees.Tree = trees.Tree.chain(7)

  def candidates(self, params, state, context, depth: int, width: int):
    if depth > self.config.block_size - 1:
      raise ValueError(f"this DFlash drafter proposes {self.config.block_size - 1} tokens per block; "
                       f"a tree of depth {depth} needs a drafter trained with block_size >= {depth + 1}")
    logits, state = self.block(params, state, context)
    ranked = jnp.stack([params["head_tokens"][top_ids(logits[:, d], width)] for d in range(depth)],
                       axis=1)
    return ranked.astype(jnp.int32), state


@dataclasses.dataclass(frozen=True)
class SampledDFlash(_Block):
  """A chain of `gamma` tokens, each drawn from the drafter's own distribution at its block position
  (after the loop's temperature / top-k / top-p transform), verified by chain rejection."""
  gamma: int = 7
  vocab_size: int = 0
  sampled = True

  def __post_init__(self):
    if not 1 <= self.gamma <= self.config.block_size - 1:
      raise ValueError(f"this DFlash drafter proposes at most {self.config.block_size - 1} tokens, "
                       f"got gamma={self.gamma}")

  @property
  def tree(self) -> trees.Tree:
    return trees.Tree.chain(self.gamma)

  @property
  def num_uniforms(self) -> int:
    return self.gamma

  def draft(self, params, state, context: DraftContext, uniforms, transform):
    logits, state = self.block(params, state, context)
    full = _full_vocabulary(logits[:, :self.gamma], params["head_tokens"], self.vocab_size)
    batch = full.shape[0]
    probs = transform(full.reshape(batch * self.gamma, -1)).reshape(batch, self.gamma, -1)
    tokens = jax.vmap(sampling.sample_with_uniform, in_axes=(1, 1), out_axes=1)(uniforms, probs)
    return Proposal(tokens.astype(jnp.int32), probs), state


# ---- saved drafters ---------------------------------------------------------------------------------

def drafter_params(dflash: dict, head_tokens, target_config, target_params) -> dict:
  """The drafter's weights (its kernels packed for the CPU kernels where the target's are, in the
  target's kernel dtype), the target's output rows at its head tokens and its input embedding."""
  rows, tokens = heads.drafting_rows(target_config, target_params, head_tokens)
  dflash = jax.tree_util.tree_map(jnp.asarray, dflash)
  if dtype := cpu_kernels.kernel_dtype(target_params):
    pack = lambda tree: {name: (cpu_kernels.pack(leaf, dtype) if name in KERNELS else
                                pack(leaf) if isinstance(leaf, dict) else leaf)
                         for name, leaf in tree.items()}
    dflash = pack(dflash)
  return {"dflash": dflash, "head_rows": rows, "head_tokens": tokens,
          "embed_rows": jnp.asarray(target_params["embedding"])}


def flatten(params: dict) -> dict:
  """{"layers_0/wq": array, "fc": array, ...}: the npz names."""
  flat = {}
  for name, leaf in params.items():
    if isinstance(leaf, dict):
      flat.update({f"{name}/{inner}": value for inner, value in leaf.items()})
    else:
      flat[name] = leaf
  return flat


def unflatten(flat: dict) -> dict:
  params = {}
  for name, value in flat.items():
    outer, _, inner = name.partition("/")
    if inner:
      params.setdefault(outer, {})[inner] = value
    else:
      params[outer] = value
  return params


def save(directory, params: dict, config: DFlashConfig, head_tokens, target_config,
         fingerprint: str, metadata: dict | None = None) -> pathlib.Path:
  """directory/dflash.npz + heads.json (kind "dflash", the drafter's config, the target's
  fingerprint, `metadata`); heads.json is written last, so a directory holding it is complete."""
  return heads.write_saved(directory, WEIGHTS_FILE, flatten(jax.device_get(params)), head_tokens,
                           target_config, fingerprint,
                           {"kind": KIND, "embed_dim": config.embed_dim,
                            "config": dataclasses.asdict(config), **(metadata or {})})


def tree_refusal(directory, tree: trees.Tree) -> str | None:
  """Why the DFlash drafter saved in `directory` cannot draft `tree`, or None: a block of B tokens
  proposes B - 1, so the tree may be at most B - 1 deep (read from heads.json, nothing loaded)."""
  block_size = heads.read_metadata(directory)["config"]["block_size"]
  if tree.depth > block_size - 1:
    return (f"it was trained with block_size={block_size} and proposes {block_size - 1} tokens per "
            f"block; draft a tree of depth <= {block_size - 1}, or train one with "
            f"dflash.DFlashSpec.block_size >= {tree.depth + 1}")
  return None


def load(directory, target_config, target_params, tree: trees.Tree, sample: bool = False):
  """(the drafter of `tree`, its params) for `target`, after checking it was trained for it: a
  SampledDFlash where `sample` asks for it and the tree is a chain, else a DFlashDrafter."""
  meta, flat, head_tokens = heads.read_drafter(directory, KIND, "DFlash drafter", WEIGHTS_FILE,
                                               target_config, target_params, TRAIN_COMMAND)
  config = DFlashConfig(**meta["config"])
  params = drafter_params(unflatten(flat), head_tokens, target_config, target_params)
  if sample and tree.is_chain:
    return SampledDFlash(config, tree.depth, target_config.vocab_size), params
  return DFlashDrafter(config, tree), params
