"""Drafters: what proposes the gamma tokens the target verifies (contracts.Drafter).

A drafter is any object with three pure methods (params are passed separately, so tables and weights
are jit arguments, not baked-in constants):

  init(params, prompt_tokens[B, P], prompt_lengths[B], max_length, source=None) -> state
      Prefill on the right-padded prompt (a model draft of the encoder-decoder family also encodes
      the source, once). max_length = P + max_new_tokens + gamma + 1 slots.
  propose(params, state, tokens[B, T], positions[B, T], transform) -> (draft_probs[B, V], state)
      tokens are each row's newest tokens at their positions (T = 2 for the first draft of an
      iteration, 1 after: see speculative.draft); returns the distribution of the token at
      positions[:, -1] + 1, after `transform` (logits[B, V] -> probs[B, V], the very temperature /
      top-k / top-p transform the target's verification uses). The loop samples the draft token
      from exactly this distribution, so draft_probs is the distribution the token was drawn from.
  rollback(state, lengths[B]) -> state
      Forget everything at positions >= lengths (set lengths; stale slots are overwritten later).
A drafter that runs a model says which family it is (`encoder_decoder`); the others serve both.

Drafters here:
  ModelDrafter        any contracts.Model with its own cache (a small decoder_only model, a T5 draft).
  UnigramDrafter      a [V] log-prob table; no state.
  SparseBigramDrafter a bigram for large vocabularies (SmolLM2's 49,152 tokens: a dense table would
                      be 9.6 GB): each token's top-K continuations, backed off to a unigram.
  PromptLookupDrafter matches the last n tokens against the prompt (and an encoder-decoder's source)
                      + generated history and proposes the token that followed the latest earlier
                      match; keeps that history as state.
  LookupThenDrafter   prompt lookup where an n-gram of the context repeats, another drafter (e.g. a
                      trained model) elsewhere.
`make_drafter(name, ...)` builds any of them by name (`lookup`, `bigram`, `model:<path>`, ...).
Table log-probs are treated as logits and go through `transform`, so temperature sharpens or flattens
them like the target's logits and top-k / top-p cut them the same way. Prompt lookup proposes a one-hot,
which every transform leaves unchanged; with no match it falls back to its [V] table (uniform if None).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh

from specjax import checkpoints, contracts, models, sharding
from specjax.decoding import autoregressive
from specjax.contracts import Source, Transform
from specjax.models import decoder_only


@flax.struct.dataclass
class ModelDraftState:
  context: Any  # the draft model's per-request context (its encoded source; None for decoder-only)
  cache: Any


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A model draft (contracts.Model) with its own cache; for an encoder-decoder draft, its own
  encoder too (the paper's T5-small draft encodes the source itself, once per request)."""
  model: contracts.Model

  @property
  def encoder_decoder(self) -> bool:
    return self.model.encoder_decoder

  def init(self, params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, max_length: int,
           source: Source | None = None) -> ModelDraftState:
    contracts.check_source(self.model, source)
    context = self.model.encode(params, source)
    session = contracts.Session(lambda *args: self.model.decode_step(params, context, *args),
                                self.model.init_cache)
    _, cache = autoregressive.prefill(session, prompt_tokens, prompt_lengths, max_length)
    return ModelDraftState(context, cache)

  def propose(self, params, state: ModelDraftState, tokens: jax.Array, positions: jax.Array,
              transform: Transform) -> tuple[jax.Array, ModelDraftState]:
    logits, cache = self.model.decode_step(params, state.context, tokens, positions, state.cache)
    return transform(logits[:, -1]), state.replace(cache=cache)

  def rollback(self, state: ModelDraftState, lengths: jax.Array) -> ModelDraftState:
    return state.replace(cache=contracts.set_lengths(state.cache, lengths))


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


@dataclasses.dataclass(frozen=True)
class LookupThenDrafter:
  """Prompt lookup where the context repeats itself, another drafter everywhere else.

  Where the row's last n >= lookup.min_ngram tokens occurred before, the proposal is one-hot on the
  token that followed (PromptLookupDrafter.match); otherwise it is `inner`'s distribution. Which one
  applies is a function of the context alone, so the returned probabilities are still exactly those
  the token is drawn from and the accept rule stays lossless. params: the inner drafter's.
  State: (inner state, lookup history); both advance and roll back together.
  """
  inner: contracts.Drafter
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


# ----------------------------------------------------------------------------------------------------
# Tables (Leviathan Table 3's unigram / bigram drafts), built on the host from token-id sequences.


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


# ----------------------------------------------------------------------------------------------------
# Drafters by name.

TABLE_DRAFTERS = ("unigram", "bigram", "lookup")  # counted on text: they need `sequences`


def needs_text(name: str) -> bool:
  """Whether drafter `name` is counted on token sequences (`make_drafter(..., sequences=)`)."""
  return name.removeprefix("lookup+") in TABLE_DRAFTERS


def draft_checkpoint(name: str) -> str | None:
  """The checkpoint a drafter name reads (`model:<path>`, behind any `lookup+`), else None. Checks
  the name without loading anything, so a sweep refuses a typo before it writes a file."""
  inner = name
  while inner.startswith("lookup+"):
    inner = inner[len("lookup+"):]
  if inner in TABLE_DRAFTERS or (inner.startswith("layers") and inner[6:].isdigit()):
    return None
  if inner.startswith("model:") and inner[len("model:"):]:
    path = inner[len("model:"):]
    if "://" not in path and not pathlib.Path(path).exists():
      raise FileNotFoundError(
          f"no draft checkpoint at {path}; train one first (python -m specjax.train "
          f"--gin_file=configs/smollm2_draft.gin writes out/smollm2_draft/hf; scripts/main.sh runs it)")
    return path
  raise ValueError(f"unknown drafter {name!r}: use unigram, bigram, lookup, layers{{k}} (layers2), "
                   "lookup+<another drafter> or model:<checkpoint path>")


def checkpoints_of(names) -> dict[str, str]:
  """{drafter name: checkpoint path} of the names that read a checkpoint (checked: see
  draft_checkpoint)."""
  return {name: path for name in names if (path := draft_checkpoint(name)) is not None}


def make_drafter(name: str, target_config, target_params=None,
                 sequences: Sequence[Sequence[int]] | None = None, *, bigram_top_k: int = 64,
                 bigram_concentration: float = 1.0, lookup_ngram: int = 3,
                 lookup_min_ngram: int = 2, mesh: Mesh | None = None
                 ) -> tuple[contracts.Drafter, Any]:
  """A drafter by name for a target -> (drafter, its params on the device).

  unigram / bigram: unigram / sparse top-K bigram counted on `sequences` (token-id lists of text like
  the target's output); lookup: prompt lookup backed off to the unigram of `sequences`;
  layers{k}: a decoder-only target's first k layers + final norm + head (needs target_params);
  model:<path>: a checkpoint of the target's family and vocabulary (.gguf, a Hugging Face directory,
  a T5X checkpoint); lookup+<name>: prompt lookup (n-grams of lookup_min_ngram..lookup_ngram tokens)
  in front of any of these, e.g. `lookup+model:out/smollm2_draft/hf`.
  mesh: the target's mesh, when it has more than one device: a model draft's parameters are sharded
  on it by the same rules and its activations laid out likewise (Chen et al.: one mesh for both).
  """
  vocab_size = target_config.vocab_size
  path = draft_checkpoint(name)  # the name checked (and a model path found) before any work
  if name.startswith("lookup+"):
    inner, inner_params = make_drafter(
        name[len("lookup+"):], target_config, target_params, sequences, bigram_top_k=bigram_top_k,
        bigram_concentration=bigram_concentration, lookup_ngram=lookup_ngram, mesh=mesh)
    return (LookupThenDrafter(inner, PromptLookupDrafter(vocab_size, max_ngram=lookup_ngram,
                                                         min_ngram=lookup_min_ngram)), inner_params)
  if name in TABLE_DRAFTERS and sequences is None:
    raise ValueError(f"the {name} drafter is counted on token sequences; pass sequences=")
  if name == "bigram":
    made = (SparseBigramDrafter(),
            sparse_bigram(sequences, vocab_size, bigram_top_k, bigram_concentration))
  elif name == "unigram":
    made = (UnigramDrafter(), unigram_table(sequences, vocab_size))
  elif name == "lookup":
    made = (PromptLookupDrafter(vocab_size, max_ngram=lookup_ngram),
            unigram_table(sequences, vocab_size))
  elif name.startswith("model:"):
    draft_config, draft_params = checkpoints.load(path)
    if draft_config.vocab_size != vocab_size:
      raise ValueError(f"vocabulary sizes differ: the target has {vocab_size} tokens, the draft "
                       f"{name} {draft_config.vocab_size}; speculative decoding needs one vocabulary")
    return _model_draft(draft_config, draft_params, mesh)
  elif name.startswith("layers") and name[6:].isdigit():
    if not isinstance(target_config, decoder_only.DecoderConfig) or target_params is None:
      raise ValueError(f"{name} truncates a decoder-only target's layers; it needs that target's "
                       "DecoderConfig and params")
    draft_config, draft_params = decoder_only.truncate_layers(target_config, target_params,
                                                              int(name[6:]))
    return _model_draft(draft_config, draft_params, mesh)
  # On the device once: host (numpy) tables would be copied in on every call of a timed step.
  return made[0], jax.device_put(made[1])


def _model_draft(config, params, mesh: Mesh | None) -> tuple[ModelDrafter, Any]:
  """A model draft with its params on the device(s): sharded on `mesh` when given."""
  if mesh is None:
    return ModelDrafter(models.model_for(config)), jax.device_put(params)
  return (ModelDrafter(models.model_for(config, mesh)),
          sharding.place(params, models.param_shardings(config, mesh)))
