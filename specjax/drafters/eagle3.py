"""EAGLE-3 ("Scaling up Inference Acceleration of Large Language Models via Training-Time Test",
arXiv 2503.01840): one decoder layer that reads the target's low, middle and high features and
drafts a dynamic tree (EAGLE-2's), re-grown every round from its own confidences.

    entry q   g_q = [f_low ; f_mid ; f_high]_q @ W_fc  (the target's residual stream after three
              of its blocks at position q, fused to the target width) and the token at q + 1;
    layer     x = [RMSNorm(embed(token)) ; RMSNorm(g)] (2E) -> queries, keys and values (RoPE at
              position q), causal attention over the entries before it, then h = g + attn @ W_o and
              a gated MLP with its own residual: h is the entry's output;
    output    RMSNorm(h) through the target's frozen output rows (restricted to `head_size` tokens,
              as for the MTP head and DFlash) predicts the token at q + 2.

Drafting feeds h back in the place of g: entry (h, the drafted token) one position on predicts the
next token, and so on (training does the same: training/eagle3.py unrolls its own outputs, the
"training-time test"). The entries of committed positions, built from the target's features, stay
in the drafter's key / value cache across rounds; the drafted entries live in one round only.

The dynamic tree (trees.Tree.dynamic(nodes, depth, top_k)): the root entry's top_k tokens are depth
1; at every further depth the top_k nodes of the previous one by the product of draft probabilities
along their path each get an entry (seeing the cache and their own ancestors' entries) and offer
their top_k children; after `depth` levels the `nodes` most probable of all offered nodes form the
tree (a child is never more probable than its parent, so the set holds every chosen node's
parent). Every shape is static, the tree changes every round, and verification (the tree walk over
point masses) keeps the target's distribution at any temperature.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax import contracts
from specjax.contracts import DraftContext, Proposal
from specjax.decoding import tree as trees
from specjax.drafters import dflash, expansion, heads
from specjax.models import cpu_kernels, kv_cache, layers

KIND = "eagle3"
WEIGHTS_FILE = "eagle3.npz"
TRAIN_COMMAND = "python -m specjax.train --gin_file=configs/smollm2_eagle3.gin"
KERNELS = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def feature_blocks(num_layers: int) -> tuple[int, ...]:
  """The blocks (0-based) after which the drafter reads the stream: low, middle, high as EAGLE-3
  picks them (the inputs of layers 2, L // 2 and L - 3: the outputs of blocks 1, L // 2 - 1 and
  L - 4). Shallow targets get what exists, clipped to 0 .. L - 1, duplicates dropped."""
  picks = (2, num_layers // 2, num_layers - 3)
  return tuple(sorted({min(max(p - 1, 0), num_layers - 1) for p in picks}))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """The drafter's layer: the target's width and attention shape, and the blocks it reads."""
  feature_blocks: tuple[int, ...]
  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float
  norm_eps: float

  def __post_init__(self):
    object.__setattr__(self, "feature_blocks", tuple(int(b) for b in self.feature_blocks))

  @classmethod
  def for_target(cls, target_config) -> "Eagle3Config":
    return cls(feature_blocks(target_config.num_layers), target_config.embed_dim,
               target_config.num_heads, target_config.num_kv_heads, target_config.head_dim,
               target_config.mlp_dim, target_config.rope_theta, target_config.norm_eps)

  @property
  def features(self) -> contracts.FeatureSpec:
    return contracts.FeatureSpec(blocks=self.feature_blocks)


def init_params(config: Eagle3Config, rng) -> dict:
  """Random kernels (normal, std 0.02), norm scales 1; float32 numpy."""
  e, h, kv, d, m = (config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim,
                    config.mlp_dim)
  shapes = {"fc": (len(config.feature_blocks) * e, e), "wq": (2 * e, h * d), "wk": (2 * e, kv * d),
            "wv": (2 * e, kv * d), "wo": (h * d, e), "w_gate": (e, m), "w_up": (e, m),
            "w_down": (m, e)}
  gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)).astype(np.uint64).tolist())
  params = {name: (0.02 * gen.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}
  for name in ("input_norm", "hidden_norm", "mlp_norm", "final_norm"):
    params[name] = np.ones(e, np.float32)
  return params


# ---- the layer as pure functions (shared by drafting and training) --------------------------------

_norm = dflash.rms_norm


def fuse(params: dict, features: jax.Array) -> jax.Array:
  """features[..., n E] (the target's, any float dtype) -> g[..., E] float32."""
  return layers.dense(features.astype(jnp.float32), params["fc"], float32_out=True)


def entry(config: Eagle3Config, params: dict, hidden: jax.Array, embedded: jax.Array,
          positions: jax.Array):
  """Entries (hidden g[B, M, E], token embeddings[B, M, E]) at positions[B, M] -> queries
  [B, M, H, d], keys and values [B, M, kv, d] (queries and keys rotated)."""
  batch, count, _ = hidden.shape
  x = jnp.concatenate([_norm(embedded, params["input_norm"], config.norm_eps),
                       _norm(hidden, params["hidden_norm"], config.norm_eps)], axis=-1)
  shape = lambda heads_: (batch, count, heads_, config.head_dim)
  q = layers.rope(layers.dense(x, params["wq"], float32_out=True).reshape(shape(config.num_heads)),
                  positions, config.rope_theta)
  k = layers.rope(layers.dense(x, params["wk"], float32_out=True).reshape(
      shape(config.num_kv_heads)), positions, config.rope_theta)
  v = layers.dense(x, params["wv"], float32_out=True).reshape(shape(config.num_kv_heads))
  return q, k, v


def attend(config: Eagle3Config, q: jax.Array, keys: jax.Array, values: jax.Array,
           visible: jax.Array, path_keys=None, path_values=None, path_visible=None) -> jax.Array:
  """Queries q[B, M, H, d] over the shared keys / values [B, S, kv, d] where visible[B, M, S], and
  each query's own path keys / values [B, M, J, kv, d] where path_visible[B, M, J] -> [B, M, H d]."""
  batch, count, h, d = q.shape
  kv = config.num_kv_heads
  q = q.reshape(batch, count, kv, h // kv, d) * (d ** -0.5)
  scores = jnp.einsum("bmkgd,bskd->bkgms", q, keys)
  masks = [visible]
  if path_keys is not None:
    scores = jnp.concatenate([scores, jnp.einsum("bmkgd,bmjkd->bkgmj", q, path_keys)], axis=-1)
    masks.append(path_visible)
  mask = jnp.concatenate(masks, axis=-1)[:, None, None]
  weights = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
  size = keys.shape[1]
  out = jnp.einsum("bkgms,bskd->bmkgd", weights[..., :size], values)
  if path_keys is not None:
    out = out + jnp.einsum("bkgmj,bmjkd->bmkgd", weights[..., size:], path_values)
  return out.reshape(batch, count, h * d)


def finish(config: Eagle3Config, params: dict, hidden: jax.Array, attended: jax.Array) -> jax.Array:
  """The layer's residual stream after attention and the MLP: the entry's output h [B, M, E]."""
  x = hidden.astype(jnp.float32) + layers.dense(attended, params["wo"], float32_out=True)
  normed = _norm(x, params["mlp_norm"], config.norm_eps)
  gated = jax.nn.silu(layers.dense(normed, params["w_gate"], float32_out=True))
  return x + layers.dense(gated * layers.dense(normed, params["w_up"], float32_out=True),
                          params["w_down"], float32_out=True)


def logits(config: Eagle3Config, params: dict, head_rows, hidden: jax.Array) -> jax.Array:
  """Outputs h[..., E] -> logits over the head rows [..., S]."""
  return heads.scored(_norm(hidden, params["final_norm"], config.norm_eps), head_rows)


def step(config: Eagle3Config, params: dict, hidden, embedded, positions, keys, values, visible,
         path_keys, path_values, depth: int):
  """One drafted level for M entries per row (beams at draft time, anchors in training): each
  entry (hidden, embedded) at `positions` goes into its path at index `depth` (a static int) and
  attends to the shared keys where `visible` and to its path's entries 0 .. depth.
  -> (outputs h [B, M, E], path keys, path values)."""
  q, k, v = entry(config, params, hidden, embedded, positions)
  path_keys, path_values = path_keys.at[:, :, depth].set(k), path_values.at[:, :, depth].set(v)
  path_visible = jnp.broadcast_to(jnp.arange(path_keys.shape[2]) <= depth, q.shape[:2] +
                                  path_keys.shape[2:3])
  attended = attend(config, q, keys, values, visible, path_keys, path_values, path_visible)
  return finish(config, params, hidden, attended), path_keys, path_values


# ---- the dynamic tree -------------------------------------------------------------------------------

def pick_tree(scores: jax.Array, parents: jax.Array, nodes: int):
  """The `nodes` best of the offered nodes -> (their indices into the offer [B, nodes], ascending,
  and the tree's parents [B, nodes + 1]: root -1, a depth-1 node 0, else its parent's node number).

  scores[B, P]: each offered node's summed log-probability; parents[B, P]: its parent's index in
  the offer (-1: the root), the offer ordered by depth. A child's score never exceeds its parent's
  (adding a log-probability rounds down or stays), and lax.top_k puts the lower index first among
  equals, so the chosen set holds every chosen node's parent, and sorting by offer index numbers
  parents before children."""
  _, chosen = jax.lax.top_k(scores, nodes)
  chosen = jnp.sort(chosen, axis=-1)
  rows = jnp.arange(scores.shape[0])[:, None]
  node_of = jnp.full(scores.shape, -1, jnp.int32).at[rows, chosen].set(
      jnp.arange(1, nodes + 1, dtype=jnp.int32))
  parent = jnp.take_along_axis(parents, chosen, axis=1)
  parent_node = jnp.where(parent < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(parent, 0), 1))
  return chosen, jnp.concatenate([jnp.full((scores.shape[0], 1), -1, jnp.int32), parent_node], 1)


def tree_refusal(tree: trees.Tree, lookup_front: bool = False) -> str | None:
  """Why an EAGLE-3 drafter cannot draft `tree`, or None: it grows its own dynamic tree or drafts
  a chain; behind prompt lookup, a chain only (lookup fronts ranked candidates)."""
  if lookup_front and not tree.is_chain:
    return "behind prompt lookup it drafts a chain (chain:D); its own tree is grown without lookup"
  if not (tree.top_k or tree.is_chain):
    return "it grows its own tree every round: name a dynamic tree (dynamic:N,D,K) or a chain"
  return None


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(expansion.Ranked):
  """Drafts `tree`: a dynamic tree (Tree.dynamic), or a chain (its top-1 path; as ranked candidates
  of width 1, prompt lookup can go in front of it). State: the context entries' (keys, values)
  [B, max_length, kv, d]; entry q in slot q."""
  config: Eagle3Config
  tree: trees.Tree
  encoder_decoder: bool = dataclasses.field(default=False, init=False)

  def __post_init__(self):
    reason = tree_refusal(self.tree)
    if reason:
      raise ValueError(f"the EAGLE-3 drafter cannot draft {self.tree.name}: {reason}")

  @property
  def features(self) -> contracts.FeatureSpec:
    return self.config.features

  @property
  def calls_per_iteration(self) -> int:
    return self.tree.depth

  @property
  def top_k(self) -> int:
    return self.tree.top_k or 1

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    if source is not None:
      raise ValueError("the EAGLE-3 drafter reads a decoder-only target's hidden states and takes "
                       "no source")
    if features is None:
      raise ValueError("the EAGLE-3 drafter needs the target's features at the prompt positions")
    batch, length = prompt_tokens.shape
    cfg = self.config
    empty = jnp.zeros((batch, max_length, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    # Entry q pairs the features at q with the token at q + 1: the prompt's last entry waits for
    # the first drafted round (its token is the one the target samples after the prompt).
    following = jnp.concatenate([prompt_tokens[:, 1:], prompt_tokens[:, -1:]], axis=1)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    _, keys, values = self._entries(params, fuse(params["eagle3"], features), following, positions)
    valid = positions + 1 < prompt_lengths[:, None]
    return self._write((empty, empty), keys, values, positions, valid)

  def _entries(self, params, fused, tokens, positions):
    return entry(self.config, params["eagle3"], fused, layers.embed(params["embed_rows"], tokens),
                 positions)

  @staticmethod
  def _write(state, keys, values, positions, valid):
    return (kv_cache.write(state[0], keys, positions, valid),
            kv_cache.write(state[1], values, positions, valid))

  def root(self, params, state, context: DraftContext):
    """Write the entries committed since the last round; -> (the newest entry's output h [B, E],
    state). That entry (features at position - 1, the root token) predicts depth 1."""
    count = context.features.shape[1]
    offsets = jnp.arange(count, dtype=jnp.int32)[None, :]
    positions = jnp.maximum(context.position[:, None] - context.feature_count[:, None] + offsets, 0)
    tokens = jnp.take_along_axis(context.history, positions + 1, axis=1)
    fused = fuse(params["eagle3"], context.features)
    q, keys, values = self._entries(params, fused, tokens, positions)
    state = self._write(state, keys, values, positions, offsets < context.feature_count[:, None])
    newest = (context.feature_count - 1)[:, None, None, None]
    q = jnp.take_along_axis(q, newest, axis=1)
    visible = (jnp.arange(state[0].shape[1]) < context.position[:, None])[:, None, :]
    attended = attend(self.config, q, state[0], state[1], visible)
    g = jnp.take_along_axis(fused, newest[..., 0], axis=1)
    return finish(self.config, params["eagle3"], g, attended)[:, 0], state

  def grow(self, params, state, context: DraftContext):
    """-> (offered tokens [B, P], their summed log-probabilities [B, P], their parents' offer
    indices [B, P] (-1: the root), state). The offer: depth 1's top_k, then top_k^2 per depth."""
    cfg, inner, k = self.config, params["eagle3"], self.top_k
    head_tokens = params["head_tokens"]
    hidden, state = self.root(params, state, context)
    logp = jax.nn.log_softmax(logits(cfg, inner, params["head_rows"], hidden), axis=-1)
    score, column = jax.lax.top_k(logp, k)                                   # [B, k]
    batch = score.shape[0]
    token = head_tokens[column].astype(jnp.int32)
    offer_tokens, offer_scores = [token], [score]
    offer_parents = [jnp.full((batch, k), -1, jnp.int32)]
    beam_index = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))  # into the offer
    hidden = jnp.broadcast_to(hidden[:, None], (batch, k, hidden.shape[-1]))
    levels = self.tree.depth - 1
    path_keys = jnp.zeros((batch, k, max(levels, 1), cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    path_values = path_keys
    visible = jnp.broadcast_to(
        (jnp.arange(state[0].shape[1]) < context.position[:, None])[:, None, :],
        (batch, k, state[0].shape[1]))
    offered = k
    for level in range(levels):
      positions = jnp.broadcast_to((context.position + level)[:, None], (batch, k))
      out, path_keys, path_values = step(cfg, inner, hidden, layers.embed(params["embed_rows"], token),
                                         positions, state[0], state[1], visible, path_keys,
                                         path_values, level)
      logp = jax.nn.log_softmax(logits(cfg, inner, params["head_rows"], out), axis=-1)
      child_score, child_column = jax.lax.top_k(logp, k)                      # [B, k, k]
      child_score = (score[:, :, None] + child_score).reshape(batch, k * k)
      child_token = head_tokens[child_column].astype(jnp.int32).reshape(batch, k * k)
      offer_tokens.append(child_token)
      offer_scores.append(child_score)
      offer_parents.append(jnp.repeat(beam_index, k, axis=1))
      if level + 1 < levels:  # the best top_k children are the next level's beams
        score, best = jax.lax.top_k(child_score, k)
        parent_beam = best // k
        token = jnp.take_along_axis(child_token, best, axis=1)
        beam_index = offered + best
        take = lambda x: jnp.take_along_axis(x, parent_beam.reshape(
            parent_beam.shape + (1,) * (x.ndim - 2)), axis=1)
        hidden, path_keys, path_values = take(out), take(path_keys), take(path_values)
      offered += k * k
    return (jnp.concatenate(offer_tokens, 1), jnp.concatenate(offer_scores, 1),
            jnp.concatenate(offer_parents, 1), state)

  def candidates(self, params, state, context: DraftContext, depth: int, width: int):
    """The chain's tokens as ranked candidates [B, depth, 1] (lookup.TreeLookupFront reads them)."""
    if self.tree.top_k or width != 1 or depth != self.tree.depth:
      raise ValueError("an EAGLE-3 drafter ranks one candidate per depth of its chain; a tree of "
                       "its own is grown by its draft (dynamic:N,D,K), without lookup in front")
    tokens, _, _, state = self.grow(params, state, context)
    return tokens[:, :, None], state

  def draft(self, params, state, context: DraftContext, uniforms, transform):
    del uniforms, transform  # point masses: candidates ranked by the drafter's own probabilities
    tokens, scores, parents, state = self.grow(params, state, context)
    if self.tree.is_chain:  # one beam: the offer is the top-1 chain in order
      return Proposal(tokens), state
    chosen, tree_parents = pick_tree(scores, parents, self.tree.size - 1)
    return Proposal(jnp.take_along_axis(tokens, chosen, axis=1), parents=tree_parents), state


# ---- saved drafters ---------------------------------------------------------------------------------

def drafter_params(eagle: dict, head_tokens, target_config, target_params) -> dict:
  """The layer's weights (kernels packed for the CPU kernels where the target's are, in the target's
  kernel dtype), the target's output rows at the head tokens and its input embedding."""
  rows, tokens = heads.drafting_rows(target_config, target_params, head_tokens)
  eagle = jax.tree_util.tree_map(jnp.asarray, eagle)
  if dtype := cpu_kernels.kernel_dtype(target_params):
    eagle = {name: cpu_kernels.pack(leaf, dtype) if name in KERNELS else leaf
             for name, leaf in eagle.items()}
  return {"eagle3": eagle, "head_rows": rows, "head_tokens": tokens,
          "embed_rows": jnp.asarray(target_params["embedding"])}


def save(directory, params: dict, config: Eagle3Config, head_tokens, target_config,
         fingerprint: str, metadata: dict | None = None) -> pathlib.Path:
  """directory/eagle3.npz + heads.json (kind "eagle3", the config, the target's fingerprint)."""
  return heads.write_saved(directory, WEIGHTS_FILE, jax.device_get(params), head_tokens,
                           target_config, fingerprint,
                           {"kind": KIND, "embed_dim": config.embed_dim,
                            "config": dataclasses.asdict(config), **(metadata or {})})


def load(directory, target_config, target_params, tree: trees.Tree):
  """(the drafter of `tree`, its params) for `target`, after checking it was trained for it."""
  meta, params, head_tokens = heads.read_drafter(directory, KIND, "EAGLE-3 drafter", WEIGHTS_FILE,
                                                 target_config, target_params, TRAIN_COMMAND)
  return Eagle3Drafter(Eagle3Config(**meta["config"]), tree), drafter_params(
      params, head_tokens, target_config, target_params)
