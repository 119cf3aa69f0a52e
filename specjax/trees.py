"""Token trees: verify many candidate continuations in ONE target call, losslessly, in one jitted loop.

A chain of gamma drafts dies at its first miss. A tree offers several candidates per position: node 0
is the root (the newest committed token), every other node a candidate token whose parent precedes it.
The tree is static (its shape is fixed per compiled program); a tree drafter fills its nodes with
tokens each iteration.

Verification (one target call on all T nodes): the nodes go into the KV cache after the prefix, node i
in slot prefix + i, with its RoPE position prefix + depth(i), and each node attends to the prefix and
its own ancestors only (`attention_inputs`), so its logits are exactly those of its path run as a chain.
An encoder-decoder target (T5) verifies the same way: its source is encoded once, and its relative
position bias is taken between the nodes' positions, not their slots.

Acceptance walk, per row, from the root: draw y from the target's distribution at the current node
(after temperature / top-k / top-p; argmax at temperature 0) with this depth's uniform; if a child of
the node carries y, move to it and repeat; otherwise emit y and stop. Deeper than the tree, the last
node's y is the bonus token. Every emitted token is a draw from the target's own distribution given the
tokens before it, so the output distribution is the target's whatever the tree holds (duplicate
children, tokens the target cannot emit, any drafter).

This is multi-round speculative sampling (SpecInfer) with deterministic candidates: a candidate chosen
without randomness is a one-hot draft, so trying child x means accepting with chance p(x) / 1 and,
after a rejection, continuing with the residual max(0, p - onehot(x)) renormalised = p with x removed,
renormalised. Trying the children in turn that way and drawing from the final residual emits y with
exactly p(y), and accepts child x exactly when y = x: the walk above draws the same thing with one
uniform per depth (tests/test_trees.py checks both forms statistically). The candidates' own draft
probabilities never enter, so candidates may come from any ranking (a chain drafter's top-k, Medusa
heads). Lossy lenience (Leviathan app. A.5) is a property of chain acceptance and is not offered here.

After the walk the accepted path's keys / values are compacted into consecutive slots
(`contracts: move_cache`) and the cache is rolled back to the committed length.

Tree drafters (`candidates` -> [B, depth, width] ranked tokens for the positions after the root) fill
node i with candidates[depth(i) - 1, rank(i)]: the candidate list of a depth is shared by every node at
that depth, as Medusa's heads produce it. tree_drafters.py holds them (`ChainTopK` turns any chain
drafter into one).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Any, Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import contracts, speculative
from specjax.decoding import autoregressive, sampling
from specjax.metrics import SpecOutput, SpecStats


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static candidate tree. Each non-root node is named by its ranks from the root: (0, 2) is the
  third candidate (at depth 2) below the first candidate (at depth 1). Every prefix of a path is a node.
  Nodes are numbered root first, then by depth, then by path, so a parent precedes its children."""
  paths: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    paths = tuple(sorted({tuple(int(r) for r in p) for p in self.paths}, key=lambda p: (len(p), p)))
    if len(paths) != len(self.paths):
      raise ValueError("tree paths must be distinct")
    if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
      raise ValueError("a tree needs at least one node; each path is a non-empty tuple of ranks >= 0")
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in set(paths)]
    if missing:
      raise ValueError(f"tree path {missing[0]} has no parent node {missing[0][:-1]}; add it")
    object.__setattr__(self, "paths", paths)

  @classmethod
  def chain(cls, depth: int) -> "Tree":
    """gamma = depth candidates in a row: the chain as a tree."""
    return cls.spine(depth, 1)

  @classmethod
  def spine(cls, depth: int, width: int) -> "Tree":
    """The top-1 chain of `depth` nodes, with width - 1 alternative siblings at every depth."""
    _check_positive(depth=depth, width=width)
    return cls(tuple((0,) * d + (r,) for d in range(depth) for r in range(width)))

  @classmethod
  def full(cls, widths: Sequence[int]) -> "Tree":
    """Every node at depth d has widths[d] children (a Cartesian product of candidate ranks)."""
    _check_positive(**{f"width_{d}": w for d, w in enumerate(widths)})
    return cls(tuple(p for d in range(1, len(widths) + 1)
                     for p in itertools.product(*[range(w) for w in widths[:d]])))

  @classmethod
  def from_name(cls, name: str) -> "Tree":
    """'chain:4', 'spine:4x3' (depth x width) or 'full:3,2,1' (widths per depth)."""
    kind, _, shape = name.partition(":")
    try:
      if kind == "chain":
        return cls.chain(int(shape))
      if kind == "spine":
        depth, width = re.fullmatch(r"(\d+)x(\d+)", shape).groups()
        return cls.spine(int(depth), int(width))
      if kind == "full":
        return cls.full([int(w) for w in shape.split(",")])
    except (AttributeError, ValueError) as error:
      raise ValueError(f"cannot read tree {name!r}: {error}; write chain:D, spine:DxW or "
                       "full:W1,W2,...") from None
    raise ValueError(f"unknown tree kind {kind!r} in {name!r}; write chain:D, spine:DxW or "
                     "full:W1,W2,...")

  @functools.cached_property
  def name(self) -> str:
    if self == Tree.spine(self.depth, self.width):
      return f"chain:{self.depth}" if self.width == 1 else f"spine:{self.depth}x{self.width}"
    widths = [max(p[-1] for p in self.paths if len(p) == d) + 1 for d in range(1, self.depth + 1)]
    if self == Tree.full(widths):
      return "full:" + ",".join(map(str, widths))
    return f"tree:{self.size}"

  @property
  def size(self) -> int:
    """T: nodes scored per target call, the root included."""
    return len(self.paths) + 1

  @functools.cached_property
  def depth(self) -> int:
    return max(len(p) for p in self.paths)

  @functools.cached_property
  def width(self) -> int:
    """Candidates per depth the drafter must rank (max rank + 1)."""
    return max(max(p) for p in self.paths) + 1

  @functools.cached_property
  def parents(self) -> np.ndarray:
    index = {p: i + 1 for i, p in enumerate(self.paths)}
    return np.asarray([-1] + [index.get(p[:-1], 0) for p in self.paths], np.int32)

  @functools.cached_property
  def depths(self) -> np.ndarray:
    return np.asarray([0] + [len(p) for p in self.paths], np.int32)

  @functools.cached_property
  def ranks(self) -> np.ndarray:
    return np.asarray([0] + [p[-1] for p in self.paths], np.int32)

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """[T, T] bool: ancestors[i, j] when node j is node i or one of its ancestors."""
    out = np.eye(self.size, dtype=bool)
    for i in range(1, self.size):
      out[i] |= out[self.parents[i]]
    return out

  @functools.cached_property
  def children(self) -> np.ndarray:
    """[T, T] bool: children[i, j] when node j's parent is node i."""
    out = np.zeros((self.size, self.size), bool)
    out[self.parents[1:], np.arange(1, self.size)] = True
    return out


def _check_positive(**values) -> None:
  for name, value in values.items():
    if int(value) != value or value < 1:
      raise ValueError(f"tree {name} must be a whole number >= 1, got {value}")


def node_tokens(tree: Tree, root: jax.Array, candidates: jax.Array) -> jax.Array:
  """root[B], candidates[B, depth, width] -> the tokens of the tree's nodes [B, T]."""
  filled = candidates[:, tree.depths[1:] - 1, tree.ranks[1:]]
  return jnp.concatenate([root[:, None], filled], axis=1).astype(jnp.int32)


def attention_inputs(tree: Tree, position: jax.Array, max_length: int):
  """position[B] (the root's position = the cache length) -> positions, slots [B, T] and
  visible [B, T, S]: node i at position + depth(i) in slot position + i, seeing slots before the
  root's and its own ancestors' slots."""
  size = tree.size
  positions = position[:, None] + jnp.asarray(tree.depths)
  slots = position[:, None] + jnp.arange(size, dtype=jnp.int32)
  offset = jnp.arange(max_length, dtype=jnp.int32)[None, :] - position[:, None]  # [B, S]
  in_tree = (offset >= 0) & (offset < size)
  ancestor = jnp.moveaxis(jnp.asarray(tree.ancestors)[:, jnp.clip(offset, 0, size - 1)], 0, 1)
  visible = (offset < 0)[:, None, :] | (in_tree[:, None, :] & ancestor)
  return positions, slots, visible


def walk(tree: Tree, tokens: jax.Array, target_probs: jax.Array, uniforms: jax.Array):
  """The acceptance walk (module docstring) with its random numbers given.

  tokens[B, T] the nodes' tokens; target_probs[B, T, V] the target's distribution after each node
  (transformed; one-hot at temperature 0); uniforms[B, depth + 1], one per depth.
  Returns path[B, depth + 1] (node index at each depth; entries past the accepted depth repeat the
  deepest accepted node), num_accepted[B], next_token[B], and betas[B, depth]: the chance that the
  walk passes each depth given it reached it (target mass on the node's distinct child tokens; 0
  where not reached), the tree's analogue of Leviathan's beta.
  """
  batch, _, vocab = target_probs.shape
  rows = jnp.arange(batch)
  children = jnp.asarray(tree.children)
  node = jnp.zeros((batch,), jnp.int32)
  going = jnp.ones((batch,), bool)
  num_accepted = jnp.zeros((batch,), jnp.int32)
  next_token = jnp.zeros((batch,), jnp.int32)
  path, betas = [node], []
  for d in range(tree.depth + 1):
    probs = target_probs[rows, node]
    drawn = sampling.sample_with_uniform(uniforms[:, d], probs)
    if d == tree.depth:
      next_token = jnp.where(going, drawn, next_token)
      break
    is_child = children[node]  # [B, T]
    child_tokens = jnp.zeros((batch, vocab), bool).at[rows[:, None], tokens].max(is_child)
    betas.append(jnp.where(going, jnp.sum(jnp.where(child_tokens, probs, 0.0), axis=-1), 0.0))
    match = is_child & (tokens == drawn[:, None])
    found = going & jnp.any(match, axis=1)
    next_token = jnp.where(going & ~found, drawn, next_token)
    node = jnp.where(found, jnp.argmax(match, axis=1).astype(jnp.int32), node)
    num_accepted = num_accepted + found
    going = found
    path.append(node)
  return jnp.stack(path, axis=1), num_accepted, next_token, jnp.stack(betas, axis=1)


# ----------------------------------------------------------------------------------------------------
# The tree drafter contract (implementations: tree_drafters.py).


class TreeDrafter(Protocol):
  """What fills a tree. All methods are pure; depth and width are static."""

  def init(self, params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, max_length: int,
           source: contracts.Source | None = None) -> Any: ...

  def candidates(self, params, state, history: jax.Array, position: jax.Array, features: jax.Array,
                 depth: int, width: int) -> tuple[jax.Array, Any]:
    """history[B, S]: the token at every decoder position up to `position`[B] (the root, the newest
    committed token); features[B, E]: the target's final hidden state at position - 1. Returns ranked
    candidates[B, depth, width] for positions position + 1 .. position + depth, and the new state."""

  def calls_per_iteration(self, depth: int) -> int: ...


# ----------------------------------------------------------------------------------------------------
# The loop.


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """The static settings of a tree decode (temperature and top_p are traced, as in SpecConfig)."""
  tree: Tree
  max_new_tokens: int
  top_k: int = 0
  eos_id: int | None = None
  pad_id: int = 0

  def __post_init__(self):
    autoregressive.validate_decode(self.max_new_tokens, self.top_k)

  def as_spec(self) -> speculative.SpecConfig:
    """The chain config whose commit rule (EOS / max_new cuts) the tree loop shares."""
    return speculative.SpecConfig(self.tree.depth, self.max_new_tokens, self.top_k, self.eos_id,
                                  self.pad_id)


@flax.struct.dataclass
class TreeState:
  """The while_loop carry. Per row at the top of an iteration: `last_token` (the root) is committed
  at `position` and not yet in the target cache (its length == position); history[:, :position + 1]
  holds every token so far; `features` is the target's hidden state at position - 1."""
  iteration: jax.Array
  committed: jax.Array
  num_committed: jax.Array
  done: jax.Array
  last_token: jax.Array
  position: jax.Array
  history: jax.Array
  features: jax.Array
  target_cache: Any
  draft_state: Any
  stats: SpecStats


def check_tree_target(target) -> None:
  if not contracts.supports_trees(target):
    raise ValueError("this target cannot verify token trees (it has no feature_step / move_cache); "
                     "build it with specjax.models.decoder_only.model(config) or t5.model(config)")


def tree_decode(target: contracts.Model, drafter: TreeDrafter, config: TreeConfig, target_params,
                draft_params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, rng: jax.Array,
                temperature=0.0, top_p=1.0, source: contracts.Source | None = None) -> SpecOutput:
  """Decode up to max_new_tokens per row, verifying config.tree each iteration. Conventions (padding,
  EOS, per-row finishing, SpecOutput with gamma = tree depth, `source` for an encoder-decoder target:
  encoded once, and given to the drafter's init) as speculative.speculative_decode; the stats'
  acceptance_probs hold the walk's betas per depth. Jit with `make_tree_decode`."""
  tree, max_new = config.tree, config.max_new_tokens
  batch, prompt_len = prompt_tokens.shape
  max_length = prompt_len + max_new + tree.size  # the tree's writes never fall off the end
  transform = functools.partial(sampling.probs_from_logits, temperature=temperature,
                                top_k=config.top_k, top_p=top_p)
  prompt_lengths = prompt_lengths.astype(jnp.int32)
  rows = jnp.arange(batch)
  positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
  contracts.check_source(target, source)
  context = target.encode(target_params, source)
  logits, hidden, cache = target.feature_step(target_params, context, prompt_tokens, positions,
                                              target.init_cache(batch, max_length))
  first = sampling.sample_with_uniform(
      speculative.first_token_uniform(rng, batch),
      transform(autoregressive.last_prompt_logits(logits, prompt_lengths)))
  history = jnp.zeros((batch, max_length), jnp.int32).at[:, :prompt_len].set(prompt_tokens)
  state = TreeState(
      iteration=jnp.int32(0),
      committed=jnp.full((batch, max_new + tree.depth + 1), config.pad_id, jnp.int32)
      .at[:, 0].set(first),
      num_committed=jnp.ones((batch,), jnp.int32),
      done=autoregressive.is_eos(first, config.eos_id) | (max_new == 1),
      last_token=first, position=prompt_lengths,
      history=history.at[rows, prompt_lengths].set(first),
      features=hidden[rows, prompt_lengths - 1].astype(jnp.float32),
      target_cache=contracts.set_lengths(cache, prompt_lengths),
      draft_state=drafter.init(draft_params, prompt_tokens, prompt_lengths, max_length, source),
      stats=SpecStats.empty(batch, max_new, tree.depth))

  def cond(s: TreeState):
    return (s.iteration < max_new) & ~jnp.all(s.done)

  def body(s: TreeState) -> TreeState:
    uniforms = jax.random.uniform(jax.random.fold_in(rng, s.iteration + 1), (batch, tree.depth + 1))
    candidates, draft_state = drafter.candidates(draft_params, s.draft_state, s.history, s.position,
                                                 s.features, tree.depth, tree.width)
    tokens = node_tokens(tree, s.last_token, candidates)
    positions, slots, visible = attention_inputs(tree, s.position, max_length)
    logits, hidden, cache = target.feature_step(target_params, context, tokens, positions,
                                                s.target_cache, slots, visible)
    path, num_accepted, next_token, betas = walk(tree, tokens, transform(logits), uniforms)
    path_tokens = jnp.take_along_axis(tokens, path[:, 1:], axis=1)  # [B, depth]
    committed = speculative.commit(s, path_tokens, num_accepted, next_token, config.as_spec())
    go = ~committed.done
    position = jnp.where(go, s.position + num_accepted + 1, s.position)
    steps = jnp.arange(1, tree.depth + 1, dtype=jnp.int32)
    cache = target.move_cache(cache, s.position[:, None] + path[:, 1:], s.position[:, None] + steps)
    deepest = path[rows, num_accepted]
    written = jnp.where(steps[None, :] <= num_accepted[:, None], path_tokens, next_token[:, None])
    history = s.history.at[rows[:, None], s.position[:, None] + steps].set(written)
    history = history.at[rows, s.position + num_accepted + 1].set(next_token)
    return TreeState(
        iteration=s.iteration + 1, committed=committed.committed,
        num_committed=committed.num_committed, done=committed.done,
        last_token=jnp.where(go, next_token, s.last_token), position=position,
        history=jnp.where(go[:, None], history, s.history),
        features=jnp.where(go[:, None], hidden[rows, deepest].astype(jnp.float32), s.features),
        target_cache=contracts.set_lengths(cache, position), draft_state=draft_state,
        stats=s.stats.record(s.iteration, ~s.done, num_accepted, committed.num_emitted, betas))

  s = jax.lax.while_loop(cond, body, state)
  return SpecOutput(tokens=s.committed[:, :max_new], num_generated=s.num_committed,
                    target_calls=s.iteration,
                    draft_calls=s.iteration * drafter.calls_per_iteration(tree.depth), stats=s.stats)


def make_tree_decode(target: contracts.Model, drafter: TreeDrafter, config: TreeConfig,
                     **jit_kwargs):
  """jit(tree_decode) for one (target, drafter, config): fn(target_params, draft_params,
  prompt_tokens[B, P], prompt_lengths[B], rng, temperature=0., top_p=1., source=None) -> SpecOutput;
  temperature and top_p are validated on the host and traced, so a sweep over them compiles once."""
  check_tree_target(target)
  contracts.check_drafter_family(target, drafter)
  jitted = jax.jit(functools.partial(tree_decode, target, drafter, config), **jit_kwargs)

  def run(target_params, draft_params, prompt_tokens, prompt_lengths, rng, temperature=0.0,
          top_p=1.0, source=None) -> SpecOutput:
    host = speculative._concrete_floats(temperature, top_p)  # pylint: disable=protected-access
    if host is not None:
      sampling.validate_sampling(host[0], 0, host[1])
    as_f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return jitted(target_params, draft_params, prompt_tokens, prompt_lengths, rng,
                  as_f32(temperature), as_f32(top_p), source)

  run.jitted = jitted
  return run
