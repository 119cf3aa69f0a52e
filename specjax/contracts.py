"""The contracts between models, drafters and the decoding loops, as types.

Both model families, and the table models of the tests, meet the loops through these protocols; the
loops (`autoregressive.py`, `speculative.py`) import nothing from `specjax.models`.

  Model      `encode(params, source) -> context`: the per-request arrays computed once (an
             encoder-decoder model's cross-attention keys and values of the encoded source; None for a
             decoder-only model, which takes no source); `decode_step(params, context, tokens[B, T],
             positions[B, T], cache) -> (logits[B, T, V] float32, cache)`; `init_cache(batch,
             max_length)`. T = P for a prefill, 1 for a draft step, gamma + 1 for verification: one
             code path. The context is a pytree, so a model draft carries it in its loop state.
  Session    a model bound to its params and context (`open_session`): `step(tokens, positions,
             cache)` and `init_cache(batch, max_length)`, what a loop calls for its target.
  Cache      a pytree of fixed-size buffers plus `lengths[B]` int32, the valid slots of each row.
             Slot s holds position s; rollback is `set_lengths` (nothing is zeroed).
  Drafter    `init / propose / rollback` (see drafters.py for what each returns).
  Tree model a Model that can also verify a token tree (trees.py): `feature_step(params, context,
             tokens, positions, cache, slots, visible) -> (logits, hidden[B, T, E], cache)` writes
             token t at slot slots[:, t] (RoPE at positions[:, t]) and lets it see only the slots
             visible[:, t] allows; slots / visible None = the chain step plus its final hidden states
             (what feature drafters read; XLA drops them when unused). `move_cache(cache, source_slots,
             dest_slots)` compacts an accepted path. `supports_trees(model)` says whether a model has both
             (decoder-only models and T5: for T5 `context` is the encoded source, and its relative
             position bias is taken between positions, not slots).

An encoder-decoder model's decoder starts from its decoder start token: that one token is its
"prompt" (prompt_tokens[B, 1], lengths 1), and the source text goes in as `Source`.

`StepModel` turns a plain step function `step(params, tokens, positions, cache)` plus an empty-cache
factory into a decoder-only Model, which is how `decoder_only` and the tests' table models enter.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp

Params = Any
DrafterState = Any
# logits[B, V] -> probabilities[B, V]: the temperature / top-k / top-p transform shared by the draft
# and the target's verification (sampling.probs_from_logits with the decode's settings bound).
Transform = Callable[[jax.Array], jax.Array]


@runtime_checkable
class Cache(Protocol):
  """Any pytree with `lengths[B]` int32 and a dataclass-style `replace` (flax.struct dataclasses)."""
  lengths: jax.Array

  def replace(self, **updates) -> "Cache": ...


CacheT = TypeVar("CacheT", bound=Cache)


def set_lengths(cache: CacheT, lengths: jax.Array) -> CacheT:
  """THE rollback (and roll-forward): each row keeps `lengths[B]` valid slots; nothing is zeroed, the
  next step overwrites the stale slots."""
  return cache.replace(lengths=jnp.asarray(lengths).astype(jnp.int32))


class StepFn(Protocol):
  """A model's step with its parameters passed in (DESIGN.md contract 1)."""

  def __call__(self, params: Params, tokens: jax.Array, positions: jax.Array,
               cache: Cache) -> tuple[jax.Array, Cache]: ...


class InitCache(Protocol):
  def __call__(self, batch: int, max_length: int) -> Cache: ...


@flax.struct.dataclass
class Source:
  """An encoder-decoder model's input, right-padded like prompts: tokens[B, S] int32, lengths[B]."""
  tokens: jax.Array
  lengths: jax.Array


@dataclasses.dataclass(frozen=True)
class Session:
  """A model bound to its parameters and per-request context: the step a loop calls."""
  step: Callable[[jax.Array, jax.Array, Cache], tuple[jax.Array, Cache]]
  init_cache: InitCache


@runtime_checkable
class Model(Protocol):
  """What the loops decode with. `encoder_decoder` says whether `encode` needs a Source."""
  encoder_decoder: bool

  def encode(self, params: Params, source: Source | None) -> Any:
    """The per-request context (None for a decoder-only model), computed once per decode."""

  def decode_step(self, params: Params, context: Any, tokens: jax.Array, positions: jax.Array,
                  cache: Cache) -> tuple[jax.Array, Cache]:
    """tokens[B, T] at positions[B, T] -> (logits[B, T, V] float32, cache with the T tokens written;
    its lengths = positions[:, -1] + 1)."""

  def init_cache(self, batch: int, max_length: int) -> Cache: ...


def open_session(model: Model, params: Params, source: Source | None = None) -> Session:
  """Encode once, then bind: the Session whose step the loops call for every token."""
  check_source(model, source)
  return bind_session(model, params, model.encode(params, source))


def bind_session(model: Model, params: Params, context: Any) -> Session:
  """The Session of an already encoded context (open_session without the encoding)."""
  return Session(functools.partial(model.decode_step, params, context), model.init_cache)


@dataclasses.dataclass(frozen=True)
class StepModel:
  """A decoder-only Model from a step function with explicit params and an empty-cache factory; with
  `features` (step that also takes slots / visible and returns hidden states) and `move`, a tree model."""
  step: StepFn
  init_cache: InitCache
  features: Callable | None = None
  move: Callable | None = None
  encoder_decoder: bool = dataclasses.field(default=False, init=False)

  def feature_step(self, params, context, tokens, positions, cache, slots=None, visible=None):
    del context
    if self.features is None:
      raise ValueError("this model returns no hidden states and cannot verify token trees; build it "
                       "with specjax.models.decoder_only.model(config)")
    return self.features(params, tokens, positions, cache, slots, visible)

  def move_cache(self, cache, source_slots, dest_slots):
    return self.move(cache, source_slots, dest_slots)

  @property
  def verifies_trees(self) -> bool:
    return self.features is not None and self.move is not None

  def encode(self, params: Params, source: Source | None) -> None:
    if source is not None:
      raise ValueError("this decoder-only model takes no encoder input (source); put the text in the "
                       "prompt, or use an encoder-decoder model")
    return None

  def decode_step(self, params: Params, context: None, tokens: jax.Array, positions: jax.Array,
                  cache: Cache) -> tuple[jax.Array, Cache]:
    del context
    return self.step(params, tokens, positions, cache)


def supports_trees(model) -> bool:
  return bool(getattr(model, "verifies_trees", False))


def check_drafter_family(target: Model, drafter) -> None:
  """A drafter that runs a model (`drafter.encoder_decoder` is True or False) must match the target's
  family; tables and prompt lookup (None) serve either."""
  family = getattr(drafter, "encoder_decoder", None)
  if family is not None and family != target.encoder_decoder:
    kind = lambda flag: "an encoder-decoder" if flag else "a decoder-only"
    raise ValueError(f"the draft is {kind(family)} model but the target is "
                     f"{kind(target.encoder_decoder)} model; speculative decoding needs a draft of the "
                     "target's family (for a T5 target, a smaller T5 sharing its vocabulary)")


def check_source(model: Model, source: Source | None) -> None:
  if model.encoder_decoder and source is None:
    raise ValueError("an encoder-decoder model needs its encoder input: pass source=Source(tokens, "
                     "lengths) (the text to translate or summarise); the prompt is then the decoder "
                     "start token")


@runtime_checkable
class Drafter(Protocol):
  """What proposes the gamma tokens the target verifies (drafters.py). All methods are pure."""

  def init(self, params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
           max_length: int, source: Source | None = None) -> DrafterState:
    """Prefill on the right-padded prompt[B, P] (and encode the source, for a model draft of the
    encoder-decoder family). max_length = P + max_new_tokens + gamma + 1 slots."""

  def propose(self, params: Params, state: DrafterState, tokens: jax.Array, positions: jax.Array,
              transform: Transform) -> tuple[jax.Array, DrafterState]:
    """tokens[B, T] at positions[B, T] -> the distribution [B, V] of the token at
    positions[:, -1] + 1, after `transform`: exactly the distribution the loop samples from."""

  def rollback(self, state: DrafterState, lengths: jax.Array) -> DrafterState:
    """Forget everything at positions >= lengths[B]."""
