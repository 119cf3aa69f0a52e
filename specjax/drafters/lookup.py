"""Prompt lookup: propose the token that followed the latest earlier occurrence of the context's last
n-gram (as in HF's prompt lookup and vLLM's n-gram proposer), alone or in front of another drafter.

  PromptLookupDrafter  a one-token step (contracts.TokenDrafter) over the prompt (and an
                       encoder-decoder's source) + the generated history; with no match it falls back to
                       its [V] table (uniform if None). It proposes a one-hot, which every transform
                       leaves unchanged.
  lookup_front(inner)  prompt lookup in front of any drafter: of a one-token step, a step that
                       proposes the lookup's token where the context repeats and the inner step's
                       distribution elsewhere (`TokenLookupFront`); of a drafter of ranked candidates
                       per depth (a top-k tree, Medusa heads, the MTP head), the lookup's copied
                       continuation at rank 0 of each depth (`TreeLookupFront`). Either way which
                       tokens are proposed never affects losslessness.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import contracts
from specjax.contracts import Source, Transform
from specjax.drafters import expansion


@flax.struct.dataclass
class LookupState:
  """history[b, offset + p] is the token at decoder position p; history[b, :offset] holds the source
  of an encoder-decoder decode (offset = its padded width; 0 without one). -1 where nothing is."""
  history: jax.Array  # [B, offset + max_length] int32
  lengths: jax.Array  # [B] int32 decoder positions recorded
  offset: int = flax.struct.field(pytree_node=False, default=0)


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter:
  """Prompt-lookup n-gram drafting (as in HF's prompt lookup and vLLM's n-gram proposer).

  For n = max_ngram down to min_ngram, find the LATEST earlier position whose n tokens equal the row's
  last n tokens and propose the token that followed it (latest, because recent text repeats most).
  For an encoder-decoder decode the source comes first in the history, so names and numbers the
  output copies from the source are found there (prompt lookup over the source).
  params: fallback log-probs [V] used where nothing matches, or None for uniform.
  """
  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

  def init(self, params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, max_length: int,
           source: Source | None = None) -> LookupState:
    batch, prompt_len = prompt_tokens.shape
    history = _valid_or_minus_one(prompt_tokens, prompt_lengths)
    if source is not None:
      history = jnp.concatenate([_valid_or_minus_one(source.tokens, source.lengths), history], axis=1)
    offset = 0 if source is None else source.tokens.shape[1]
    history = jnp.pad(history, ((0, 0), (0, max_length - prompt_len)), constant_values=-1)
    return LookupState(history, prompt_lengths.astype(jnp.int32), offset)

  def propose(self, params, state: LookupState, tokens: jax.Array, positions: jax.Array,
              transform: Transform) -> tuple[jax.Array, LookupState]:
    proposal, found, state = self.match(state, tokens, positions)
    logits = jnp.zeros((tokens.shape[0], self.vocab_size)) if params is None else jnp.broadcast_to(
        params, (tokens.shape[0], self.vocab_size))
    probs = jnp.where(found[:, None], jax.nn.one_hot(proposal, self.vocab_size), transform(logits))
    return probs, state

  def match(self, state: LookupState, tokens: jax.Array, positions: jax.Array):
    """Record the new tokens; -> (proposal[B], found[B], state) of the latest longest match."""
    rows = jnp.arange(tokens.shape[0])[:, None]
    history = state.history.at[rows, positions + state.offset].set(tokens.astype(jnp.int32))
    proposal, found = lookup(history, positions[:, -1] + state.offset, self.max_ngram,
                             self.min_ngram)
    return proposal, found, state.replace(history=history, lengths=positions[:, -1] + 1)

  def rollback(self, state: LookupState, lengths: jax.Array) -> LookupState:
    return state.replace(lengths=lengths.astype(jnp.int32))


def _valid_or_minus_one(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """tokens[B, P] with every slot at or past lengths[b] set to -1 (never matches a token)."""
  valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
  return jnp.where(valid, tokens, -1).astype(jnp.int32)



def lookup(history: jax.Array, pos: jax.Array, max_ngram: int,
           min_ngram: int = 1) -> tuple[jax.Array, jax.Array]:
  """The continuation of the latest earlier occurrence of each row's last n tokens, longest n first.

  Args: history[B, S] int32 (tokens at positions 0..pos; -1 marks an empty slot, which never
    matches), pos[B] int32 the newest position.
  Returns: proposal[B] int32 (history[e + 1] for the latest match ending at e < pos), found[B] bool.
  """
  batch, length = history.shape
  ends = jnp.arange(length)[None, :]
  proposal = jnp.zeros((batch,), jnp.int32)
  found = jnp.zeros((batch,), bool)
  for n in range(max_ngram, min_ngram - 1, -1):
    match = (ends < pos[:, None]) & (ends >= n - 1) & (pos[:, None] >= n - 1)
    for k in range(n):  # compare the token k before each candidate end with the token k before pos
      key = jnp.take_along_axis(history, jnp.maximum(pos - k, 0)[:, None], axis=1)
      shifted = jnp.pad(history, ((0, 0), (k, 0)), constant_values=-1)[:, :length]
      match &= (shifted == key) & (key >= 0)
    end = jnp.max(jnp.where(match, ends, -1), axis=1)
    follower = jnp.take_along_axis(history, jnp.clip(end + 1, 0, length - 1)[:, None], axis=1)[:, 0]
    proposal = jnp.where(~found & (end >= 0), follower, proposal)
    found = found | (end >= 0)
  return proposal, found


@dataclasses.dataclass(frozen=True)
class TokenLookupFront:
  """Prompt lookup where the context repeats itself, another drafter everywhere else.

  Where the row's last n >= lookup.min_ngram tokens occurred before, the proposal is one-hot on the
  token that followed (PromptLookupDrafter.match); otherwise it is `inner`'s distribution. Which one
  applies is a function of the context alone, so the returned probabilities are still exactly those
  the token is drawn from and the accept rule stays lossless. params: the inner drafter's.
  State: (inner state, lookup history); both advance and roll back together.
  """
  inner: contracts.TokenDrafter
  lookup: PromptLookupDrafter

  @property
  def encoder_decoder(self) -> bool | None:
    return getattr(self.inner, "encoder_decoder", None)

  def init(self, params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, max_length: int,
           source: Source | None = None):
    return (self.inner.init(params, prompt_tokens, prompt_lengths, max_length, source),
            self.lookup.init(None, prompt_tokens, prompt_lengths, max_length, source))

  def propose(self, params, state, tokens: jax.Array, positions: jax.Array,
              transform: Transform) -> tuple[jax.Array, Any]:
    inner_probs, inner_state = self.inner.propose(params, state[0], tokens, positions, transform)
    proposal, found, lookup_state = self.lookup.match(state[1], tokens, positions)
    probs = jnp.where(found[:, None], jax.nn.one_hot(proposal, inner_probs.shape[-1],
                                                     dtype=inner_probs.dtype), inner_probs)
    return probs, (inner_state, lookup_state)

  def rollback(self, state, lengths: jax.Array):
    return self.inner.rollback(state[0], lengths), self.lookup.rollback(state[1], lengths)


@dataclasses.dataclass(frozen=True)
class TreeLookupFront(expansion.Ranked):
  """Prompt lookup in front of a drafter of ranked candidates per depth. Where the context's last
  n-gram (n = max_ngram down to min_ngram) occurred before, the tokens that followed it are copied,
  one per depth (each found by looking up again after the copied token), and take rank 0 at their
  depth; the inner drafter's candidates fill the other ranks. Elsewhere the inner drafter's candidates
  stand alone. params: the inner drafter's."""
  inner: Any
  max_ngram: int = 3
  min_ngram: int = 2

  @property
  def tree(self):
    return self.inner.tree

  @property
  def features(self):
    return self.inner.features

  @property
  def calls_per_iteration(self) -> int:
    return self.inner.calls_per_iteration

  @property
  def encoder_decoder(self):
    return getattr(self.inner, "encoder_decoder", None)

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    return self.inner.init(params, prompt_tokens, prompt_lengths, max_length, source, features)

  def candidates(self, params, state, context: contracts.DraftContext, depth: int, width: int):
    inner, state = self.inner.candidates(params, state, context, depth, width)
    history, position = context.history, context.position
    rows = jnp.arange(history.shape[0])
    found_so_far = jnp.ones(position.shape, bool)
    merged = []
    for d in range(depth):
      copied, found = lookup(history, position + d, self.max_ngram, self.min_ngram)
      found_so_far &= found
      with_copy = jnp.concatenate([copied[:, None], inner[:, d, :width - 1]], axis=1)
      merged.append(jnp.where(found_so_far[:, None], with_copy, inner[:, d]))
      history = history.at[rows, position + d + 1].set(copied)
    return jnp.stack(merged, axis=1).astype(jnp.int32), state


def lookup_front(inner, vocab_size: int, max_ngram: int = 3, min_ngram: int = 2):
  """Prompt lookup (n-grams of min_ngram..max_ngram tokens) in front of `inner`: a one-token step
  (TokenLookupFront) or a drafter of ranked candidates per depth (TreeLookupFront)."""
  if isinstance(inner, contracts.TokenDrafter):
    return TokenLookupFront(inner, PromptLookupDrafter(vocab_size, max_ngram, min_ngram))
  if isinstance(inner, expansion.Ranked):
    return TreeLookupFront(inner, max_ngram, min_ngram)
  raise ValueError(f"prompt lookup goes in front of a one-token drafter or of ranked candidates per "
                   f"depth (a top-k tree, heads, an MTP head), not {type(inner).__name__}")
