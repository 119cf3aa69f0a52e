"""Table drafters (Leviathan et al.'s Table 3 unigram / bigram drafts), one token per call
(contracts.TokenDrafter): built on the host from token-id sequences of text like the target's output.

  UnigramDrafter       a [V] log-prob table; no state.
  SparseBigramDrafter  a bigram for large vocabularies (SmolLM2's 49,152 tokens: a dense table would be
                       9.6 GB): each token's top-K continuations, backed off to a unigram.

Table log-probs are treated as logits and go through `transform`, so temperature sharpens or flattens
them like the target's logits and top-k / top-p cut them the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.contracts import Source, Transform


@dataclasses.dataclass(frozen=True)
class UnigramDrafter:
  """Proposes from one fixed distribution; params: log-probs [V] (see `unigram_table`)."""

  def init(self, params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, max_length: int,
           source: Source | None = None) -> None:
    return None

  def propose(self, params: jax.Array, state: None, tokens: jax.Array, positions: jax.Array,
              transform: Transform) -> tuple[jax.Array, None]:
    return transform(jnp.broadcast_to(params, (tokens.shape[0], params.shape[-1]))), state

  def rollback(self, state: None, lengths: jax.Array) -> None:
    return state



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

  def init(self, params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, max_length: int,
           source: Source | None = None) -> None:
    return None

  def propose(self, params: SparseBigram, state: None, tokens: jax.Array, positions: jax.Array,
              transform: Transform) -> tuple[jax.Array, None]:
    return transform(jnp.log(sparse_bigram_probs(params, tokens[:, -1]))), state

  def rollback(self, state: None, lengths: jax.Array) -> None:
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


