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
  PromptLookupDrafter matches the last n tokens against the prompt + generated history and proposes
                      the token that followed the latest earlier match; keeps that history as state.
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


def _replace_lengths(cache, lengths):
  return cache.replace(lengths=lengths.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A model behind the step-function contract: step(params, tokens, positions, cache) -> (logits,
  cache), with init_cache(batch, max_length) and a cache carrying lengths[B] (set by `set_lengths`)."""
  step: Callable
  init_cache: Callable
  set_lengths: Callable = _replace_lengths

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
    rows = jnp.arange(tokens.shape[0])[:, None]
    history = state.history.at[rows, positions].set(tokens.astype(jnp.int32))
    proposal, found = lookup(history, positions[:, -1], self.max_ngram, self.min_ngram)
    logits = jnp.zeros((tokens.shape[0], self.vocab_size)) if params is None else jnp.broadcast_to(
        params, (tokens.shape[0], self.vocab_size))
    probs = jnp.where(found[:, None], jax.nn.one_hot(proposal, self.vocab_size), transform(logits))
    return probs, LookupState(history, positions[:, -1] + 1)

  def rollback(self, state, lengths):
    return state.replace(lengths=lengths.astype(jnp.int32))


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
