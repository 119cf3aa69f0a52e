"""Drafters: what proposes the gamma tokens the target verifies.

A drafter is any object with three pure methods (speculative.py duck-types them; params are passed
separately so tables and weights are jit arguments, not baked-in constants):

  init(params, prompt_tokens[B, P], prompt_lengths[B], max_length) -> state
      Prefill on the right-padded prompt. max_length = P + max_new_tokens + gamma + 1 slots.
  propose(params, state, tokens[B, T], positions[B, T], transform) -> (draft_probs[B, V], state)
      tokens are each row's newest tokens at their positions (T = 2 for the first draft of an
      iteration, 1 after: see speculative.draft); returns the distribution of the token at
      positions[:, -1] + 1, after `transform` (logits[B, V] -> probs[B, V], the very temperature /
      top-k / top-p transform the target's verification uses). The loop samples the draft token
      from exactly this distribution, so draft_probs is the distribution the token was drawn from.
  rollback(state, lengths[B]) -> state
      Forget everything at positions >= lengths (set lengths; stale slots are overwritten later).

Drafters here:
  ModelDrafter        any step-function model with its own cache (e.g. a small decoder_only model).
  UnigramDrafter      a [V] log-prob table; no state.
  BigramDrafter       a [V, V] log-prob table indexed by the previous token; no state (the previous
                      token arrives in `tokens`).
  SparseBigramDrafter the bigram for large vocabularies (SmolLM2's 49,152 tokens: a dense table would
                      be 9.6 GB): each token's top-K continuations, backed off to a unigram.
  PromptLookupDrafter matches the last n tokens against the prompt + generated history and proposes
                      the token that followed the latest earlier match; keeps that history as state.
  LookupThenDrafter   prompt lookup where an n-gram of the context repeats, another drafter (e.g. a
                      trained model) elsewhere.
Table log-probs are treated as logits and go through `transform`, so temperature sharpens or flattens
them like the target's logits and top-k / top-p cut them the same way. Prompt lookup proposes a one-hot,
which every transform leaves unchanged; with no match it falls back to its [V] table (uniform if None).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.speculative import replace_lengths


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A model behind the step-function contract: step(params, tokens, positions, cache) -> (logits,
  cache), with init_cache(batch, max_length) and a cache carrying lengths[B] (set by `set_lengths`)."""
  step: Callable
  init_cache: Callable
  set_lengths: Callable = replace_lengths

  def init(self, params, prompt_tokens, prompt_lengths, max_length):
    batch, prompt_len = prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    _, cache = self.step(params, prompt_tokens, positions, self.init_cache(batch, max_length))
    return self.set_lengths(cache, prompt_lengths)

  def propose(self, params, state, tokens, positions, transform):
    logits, state = self.step(params, tokens, positions, state)
    return transform(logits[:, -1]), state

  def rollback(self, state, lengths):
    return self.set_lengths(state, lengths)


@dataclasses.dataclass(frozen=True)
class UnigramDrafter:
  """Proposes from one fixed distribution; params: log-probs [V] (see `unigram_table`)."""

  def init(self, params, prompt_tokens, prompt_lengths, max_length):
    return None

  def propose(self, params, state, tokens, positions, transform):
    return transform(jnp.broadcast_to(params, (tokens.shape[0], params.shape[-1]))), state

  def rollback(self, state, lengths):
    return state


@dataclasses.dataclass(frozen=True)
class BigramDrafter:
  """Proposes row params[previous token]; params: log-probs [V, V] (see `bigram_table`)."""

  def init(self, params, prompt_tokens, prompt_lengths, max_length):
    return None

  def propose(self, params, state, tokens, positions, transform):
    return transform(params[tokens[:, -1]]), state

  def rollback(self, state, lengths):
    return state


@flax.struct.dataclass
class LookupState:
  history: jax.Array  # [B, max_length] int32 token at each position; -1 where nothing was written
  lengths: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter:
  """Prompt-lookup n-gram drafting (as in HF's prompt lookup and vLLM's n-gram proposer).

  For n = max_ngram down to min_ngram, find the LATEST earlier position whose n tokens equal the row's
  last n tokens and propose the token that followed it (latest, because recent text repeats most).
  params: fallback log-probs [V] used where nothing matches, or None for uniform.
  """
  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

  def init(self, params, prompt_tokens, prompt_lengths, max_length):
    batch, prompt_len = prompt_tokens.shape
    in_prompt = jnp.arange(prompt_len)[None, :] < prompt_lengths[:, None]
    history = jnp.full((batch, max_length), -1, jnp.int32)
    history = history.at[:, :prompt_len].set(jnp.where(in_prompt, prompt_tokens, -1))
    return LookupState(history, prompt_lengths.astype(jnp.int32))

  def propose(self, params, state, tokens, positions, transform):
    proposal, found, state = self.match(state, tokens, positions)
    logits = jnp.zeros((tokens.shape[0], self.vocab_size)) if params is None else jnp.broadcast_to(
        params, (tokens.shape[0], self.vocab_size))
    probs = jnp.where(found[:, None], jax.nn.one_hot(proposal, self.vocab_size), transform(logits))
    return probs, state

  def match(self, state, tokens, positions):
    """Record the new tokens; -> (proposal[B], found[B], state) of the latest longest match."""
    rows = jnp.arange(tokens.shape[0])[:, None]
    history = state.history.at[rows, positions].set(tokens.astype(jnp.int32))
    proposal, found = lookup(history, positions[:, -1], self.max_ngram, self.min_ngram)
    return proposal, found, LookupState(history, positions[:, -1] + 1)

  def rollback(self, state, lengths):
    return state.replace(lengths=lengths.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class LookupThenDrafter:
  """Prompt lookup where the context repeats itself, another drafter everywhere else.

  Where the row's last n >= lookup.min_ngram tokens occurred before, the proposal is one-hot on the
  token that followed (PromptLookupDrafter.match); otherwise it is `inner`'s distribution. Which one
  applies is a function of the context alone, so the returned probabilities are still exactly those
  the token is drawn from and the accept rule stays lossless. params: the inner drafter's.
  State: (inner state, lookup history); both advance and roll back together.
  """
  inner: object
  lookup: PromptLookupDrafter

  def init(self, params, prompt_tokens, prompt_lengths, max_length):
    return (self.inner.init(params, prompt_tokens, prompt_lengths, max_length),
            self.lookup.init(None, prompt_tokens, prompt_lengths, max_length))

  def propose(self, params, state, tokens, positions, transform):
    inner_probs, inner_state = self.inner.propose(params, state[0], tokens, positions, transform)
    proposal, found, lookup_state = self.lookup.match(state[1], tokens, positions)
    probs = jnp.where(found[:, None], jax.nn.one_hot(proposal, inner_probs.shape[-1],
                                                     dtype=inner_probs.dtype), inner_probs)
    return probs, (inner_state, lookup_state)

  def rollback(self, state, lengths):
    return self.inner.rollback(state[0], lengths), self.lookup.rollback(state[1], lengths)


def lookup(history, pos, max_ngram: int, min_ngram: int = 1):
  """The continuation of the latest earlier occurrence of each row's last n tokens, longest n first.

  Args: history[B, S] int32 (tokens at positions 0..pos valid), pos[B] int32 the newest position.
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
      match &= shifted == key
    end = jnp.max(jnp.where(match, ends, -1), axis=1)
    follower = jnp.take_along_axis(history, jnp.clip(end + 1, 0, length - 1)[:, None], axis=1)[:, 0]
    proposal = jnp.where(~found & (end >= 0), follower, proposal)
    found = found | (end >= 0)
  return proposal, found


# ----------------------------------------------------------------------------------------------------
# Tables (Leviathan Table 3's unigram / bigram drafts), built on the host.


def _log_normalize(counts: np.ndarray) -> np.ndarray:
  return (np.log(counts) - np.log(counts.sum(-1, keepdims=True))).astype(np.float32)


def unigram_table(sequences: Iterable, vocab_size: int, smoothing: float = 1.0) -> np.ndarray:
  """Token-id sequences (iterable of 1-D int arrays) -> log-probs [V], add-`smoothing` counts."""
  if smoothing <= 0:
    raise ValueError(f"smoothing must be > 0 so every token keeps some probability, got {smoothing}")
  counts = np.full((vocab_size,), float(smoothing))
  for seq in sequences:
    np.add.at(counts, np.asarray(seq, np.int64), 1.0)
  return _log_normalize(counts)


def bigram_table(sequences: Iterable, vocab_size: int, smoothing: float = 1.0) -> np.ndarray:
  """Token-id sequences -> log-probs [V, V], row a = log P(next | previous = a), add-`smoothing`."""
  if smoothing <= 0:
    raise ValueError(f"smoothing must be > 0 so every token keeps some probability, got {smoothing}")
  counts = np.full((vocab_size, vocab_size), float(smoothing))
  for seq in sequences:
    seq = np.asarray(seq, np.int64)
    np.add.at(counts, (seq[:-1], seq[1:]), 1.0)
  return _log_normalize(counts)


def bigram_from_step(step: Callable, init_cache: Callable, params, vocab_size: int,
                     chunk: int = 1024) -> np.ndarray:
  """A target's own bigram: log-softmax of its logits after each single token at position 0.

  Runs the step on every token id as a one-token prompt, `chunk` at a time. Returns [V, V] float32.
  Unigram from a model: sample text from it (autoregressive.generate) and call `unigram_table`.
  """
  run = jax.jit(lambda p, tokens: step(p, tokens, jnp.zeros_like(tokens),
                                       init_cache(tokens.shape[0], 1))[0][:, 0])
  chunk = min(chunk, vocab_size)
  rows = []
  for start in range(0, vocab_size, chunk):
    ids = np.arange(start, min(start + chunk, vocab_size), dtype=np.int32)
    padded = np.pad(ids, (0, chunk - len(ids)))  # one compiled shape for every chunk
    rows.append(np.asarray(jax.nn.log_softmax(run(params, padded[:, None])))[:len(ids)])
  return np.concatenate(rows).astype(np.float32)


# ----------------------------------------------------------------------------------------------------
# Large vocabularies: a sparse bigram (SmolLM2's 49,152 x 49,152 float32 table would be 9.6 GB).


@flax.struct.dataclass
class SparseBigram:
  """Params of SparseBigramDrafter: each previous token's top-K continuations plus a unigram backoff.

  The proposal after previous token a is the Dirichlet-smoothed (posterior-mean) bigram with the
  unigram as the prior's base and s (the concentration) as its weight:
      kept x:     (counts_a(x) + s * unigram(x)) / (n_a + s)
      other x:    (s * unigram(x) + tail_a * unigram(x) / unigram(not kept)) / (n_a + s)
  with counts_a the kept top-K continuation counts, tail_a the total count of the continuations not
  kept and n_a = sum(counts_a) + tail_a. The tail's mass goes to the tokens it came from, spread like
  the unigram, so the top-K probabilities are exactly those of the untruncated estimate and only the
  tail is approximated. An unseen a gets the unigram itself. With K = V and a uniform base this is the
  dense add-(s / V) `bigram_table`.
  """
  next_ids: jax.Array       # [V, K] int32 continuation ids (0 with count 0 in unused slots)
  next_counts: jax.Array    # [V, K] float32 their counts
  tail_counts: jax.Array    # [V] float32 count of every continuation of a beyond the top K
  backoff: jax.Array        # [V] float32 unigram log-probs (finite: every token keeps some mass)
  concentration: jax.Array  # [] float32 s > 0, the prior's weight (traced: tuning never recompiles)


def sparse_bigram_probs(params: SparseBigram, previous: jax.Array) -> jax.Array:
  """previous[B] int32 -> the mixture above as dense probs[B, V] float32, built on the fly.

  Costs a few [B, V] passes (scale the unigram, scatter-add K entries), not a [V, V] table in memory.
  """
  ids, counts = params.next_ids[previous], params.next_counts[previous]  # [B, K]
  tail = params.tail_counts[previous]                                     # [B]
  unigram = jnp.exp(params.backoff)
  kept_unigram = jnp.where(counts > 0, unigram[ids], 0.0)                 # unused slots count 0
  # Weight of the unigram spread of the tail over the tokens not kept; 0 when nothing was dropped.
  # The floor only guards the division: tail > 0 means some token was dropped, and it has mass.
  tail_weight = tail / jnp.maximum(1.0 - jnp.sum(kept_unigram, axis=-1), 1e-12)
  prior = (params.concentration + tail_weight)[:, None] * unigram[None, :]
  rows = jnp.arange(previous.shape[0])[:, None]
  mixed = prior.at[rows, ids].add(counts - tail_weight[:, None] * kept_unigram)
  return mixed / (jnp.sum(counts, axis=-1) + tail + params.concentration)[:, None]


@dataclasses.dataclass(frozen=True)
class SparseBigramDrafter:
  """Proposes `sparse_bigram_probs` of the previous token; params: SparseBigram (`sparse_bigram`).

  Like the other tables, the log of the mixture is treated as logits and goes through the target's
  transform. No state: the previous token arrives in `tokens`.
  """

  def init(self, params, prompt_tokens, prompt_lengths, max_length):
    return None

  def propose(self, params, state, tokens, positions, transform):
    return transform(jnp.log(sparse_bigram_probs(params, tokens[:, -1]))), state

  def rollback(self, state, lengths):
    return state


def sparse_bigram(sequences: Iterable, vocab_size: int, top_k: int = 64, concentration: float = 1.0,
                  smoothing: float = 1.0) -> SparseBigram:
  """Token-id sequences (iterable of 1-D int arrays) -> SparseBigram.

  Counts every adjacent pair, keeps the top_k most frequent continuations of each previous token
  (count ties go to the lower id, so the result is deterministic; top_k > V keeps all V) and an
  add-`smoothing` unigram over the same text as the backoff. Memory is O(V * top_k + distinct pairs),
  never O(V^2).
  """
  if int(top_k) != top_k or top_k < 1:
    raise ValueError(f"top_k must be a whole number >= 1, got {top_k}")
  top_k = min(int(top_k), vocab_size)
  if not concentration > 0:
    raise ValueError(f"concentration must be > 0 (unseen continuations keep mass), got {concentration}")
  sequences = [np.asarray(seq, np.int64).ravel() for seq in sequences]
  if any(seq.size and (seq.min() < 0 or seq.max() >= vocab_size) for seq in sequences):
    raise ValueError(f"token ids must lie in 0..{vocab_size - 1}")
  prev = np.concatenate([seq[:-1] for seq in sequences] + [np.zeros(0, np.int64)])
  nxt = np.concatenate([seq[1:] for seq in sequences] + [np.zeros(0, np.int64)])
  pairs, counts = np.unique(prev * vocab_size + nxt, return_counts=True)
  first, second = pairs // vocab_size, pairs % vocab_size
  order = np.lexsort((second, -counts, first))  # by previous token, then count down, then id up
  first, second, counts = first[order], second[order], counts[order].astype(np.float64)
  rank = np.arange(len(first)) - np.searchsorted(first, first, side="left")  # rank within its row
  kept = rank < top_k
  next_ids = np.zeros((vocab_size, top_k), np.int32)
  next_counts = np.zeros((vocab_size, top_k), np.float32)
  next_ids[first[kept], rank[kept]] = second[kept]
  next_counts[first[kept], rank[kept]] = counts[kept]
  tail = np.bincount(first[~kept], weights=counts[~kept], minlength=vocab_size)
  return SparseBigram(next_ids=next_ids, next_counts=next_counts,
                      tail_counts=tail.astype(np.float32),
                      backoff=unigram_table(sequences, vocab_size, smoothing),
                      concentration=np.float32(concentration))
