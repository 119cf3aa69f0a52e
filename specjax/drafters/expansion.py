"""One-token steps as drafters: a step (contracts.TokenDrafter: a small model, a table, prompt
lookup) proposes the distribution of the next token; an expansion turns it into a Drafter of a
static tree.

  SampledChain  gamma tokens drawn one at a time from the step's own distribution, with the
                distributions they were drawn from: Leviathan's and Chen's draft, verified by chain
                rejection (lossless for any temperature).
  TopK          the step's top-1 chain of `depth` tokens, offering its top-`width` tokens at every
                depth: candidates chosen deterministically (point masses), verified by the tree walk.
  `expand(step, tree, sample)` picks one. `Ranked` is what every drafter of ranked candidates per
  depth shares (TopK, Medusa heads, the MTP head): its `draft` fills the tree from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import contracts
from specjax.contracts import DraftContext, Proposal
from specjax.decoding import sampling
from specjax.decoding import tree as trees
from specjax.decoding.sampling import top_ids


class Ranked:
  """A drafter whose candidates are a ranked list per depth, shared by every node at that depth:
  `candidates(params, state, context, depth, width) -> (candidates[B, depth, width], state)`. Its
  proposals are point masses (never sampled), drawing no uniforms."""
  sampled = False
  num_uniforms = 0

  def draft(self, params, state, context: DraftContext, uniforms, transform):
    del uniforms, transform
    candidates, state = self.candidates(params, state, context, self.tree.depth, self.tree.width)
    return Proposal(trees.fill(self.tree, candidates)), state


def _ranking(logits: jax.Array) -> jax.Array:
  """Candidates are ranked by the step's own softmax: which tokens go in a tree never affects
  losslessness, and a temperature-0 one-hot would leave no order below its top token."""
  return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True)
class _OfStep:
  """A drafter made of a one-token step: its family and prefill are the step's."""
  step: Any
  features = None

  @property
  def encoder_decoder(self):
    return getattr(self.step, "encoder_decoder", None)

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    del features
    return self.step.init(params, prompt_tokens, prompt_lengths, max_length, source)


@dataclasses.dataclass(frozen=True)
class SampledChain(_OfStep):
  """gamma tokens drawn from a one-token step: x_i = inverse-CDF(uniforms[:, i], draft_probs_i).

  The first call feeds [history[position - 1], root] at [position - 1, position] (the step first
  forgets everything from position - 1 on): after an iteration that accepted every draft the step
  never saw x_gamma (now at position - 1), and re-feeding an already cached token rewrites the same
  slot, so one static shape covers both cases. Later calls feed one token."""
  gamma: int
  sampled = True

  def __post_init__(self):
    trees.Tree.chain(self.gamma)  # refuses a gamma that is not a whole number >= 1

  @property
  def tree(self) -> trees.Tree:
    return trees.Tree.chain(self.gamma)

  @property
  def num_uniforms(self) -> int:
    return self.gamma

  @property
  def calls_per_iteration(self) -> int:
    return self.gamma

  def draft(self, params, state, context: DraftContext, uniforms, transform):
    """-> Proposal(tokens[B, g], draft_probs[B, g, V]), the step's new state."""
    position = context.position
    prev = jnp.take_along_axis(context.history, (position - 1)[:, None], axis=1)[:, 0]
    state = self.step.rollback(state, position - 1)
    probs, state = self.step.propose(params, state, jnp.stack([prev, context.root], axis=1),
                                     jnp.stack([position - 1, position], axis=1), transform)
    token = sampling.sample_with_uniform(uniforms[:, 0], probs)

    def step(carry, uniform):
      state, token, token_position = carry
      probs, state = self.step.propose(params, state, token[:, None], token_position[:, None],
                                       transform)
      new = sampling.sample_with_uniform(uniform, probs)
      return (state, new, token_position + 1), (new, probs)

    (state, _, _), (tokens, rest) = jax.lax.scan(step, (state, token, position + 1),
                                                 uniforms[:, 1:self.gamma].T)
    draft_tokens = jnp.concatenate([token[:, None], tokens.T], axis=1)
    draft_probs = jnp.concatenate([probs[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
    return Proposal(draft_tokens, draft_probs), state


@dataclasses.dataclass(frozen=True)
class TopK(_OfStep, Ranked):
  """A one-token step's top-1 chain of `depth` tokens, with its top-`width` tokens at each depth.

  Each iteration re-feeds the last depth + 1 committed tokens at their positions, so the step's cache
  holds the committed text whichever branch was accepted (re-feeding a cached token rewrites the same
  slot; positions before 0 are clipped to 0 and repeat the first token)."""
  tree: trees.Tree

  @property
  def calls_per_iteration(self) -> int:
    return self.tree.depth

  def candidates(self, params, state, context: DraftContext, depth: int, width: int):
    position = context.position
    window = jnp.maximum(position[:, None] - depth + jnp.arange(depth + 1, dtype=jnp.int32), 0)
    tokens = jnp.take_along_axis(context.history, window, axis=1)
    probs, state = self.step.propose(params, state, tokens, window, _ranking)
    ranked = []
    for d in range(depth):
      top = top_ids(probs, width)
      ranked.append(top)
      if d + 1 < depth:
        probs, state = self.step.propose(params, state, top[:, :1], (position + 1 + d)[:, None],
                                         _ranking)
    return jnp.stack(ranked, axis=1), state


def expand(step: contracts.TokenDrafter, tree: trees.Tree, sample: bool = True):
  """A one-token step as a Drafter of `tree`: a sampled chain where the tree is a chain and `sample`
  asks for it (Leviathan's draft), else its top-k tree (point masses)."""
  if sample and tree.is_chain:
    return SampledChain(step, tree.depth)
  return TopK(step, tree)
