"""The contracts between models, drafters and the decoding loop, as types.

Both model families, the table models of the tests and every drafter meet the loop
(`specjax.decoding.core`) through these; the loop imports nothing from `specjax.models` or
`specjax.drafters`.

  Model       `encode(params, source) -> context`: the per-request arrays computed once (an
              encoder-decoder model's cross-attention keys and values; None for a decoder-only model);
              `decode_step(params, context, tokens[B, T], positions[B, T], cache) -> (logits[B, T, V]
              float32, cache)`: T = P for a prefill, 1 for a draft step, gamma + 1 for a chain's
              verification, one code path; `forward(...)`, the same step that can also verify a tree
              and return the target's features; `move_cache` compacts a tree's accepted path;
              `init_cache(batch, max_length)`.
  Cache       a pytree of fixed-size buffers plus `lengths[B]` int32, the valid slots of each row.
              Slot s holds position s; rollback is `set_lengths` (nothing is zeroed).
  FeatureSpec which of the target's hidden states a drafter reads: the residual stream after listed
              blocks and / or the final-norm state. Computed only when asked (the loop passes None
              otherwise, and XLA drops what nobody reads).
  Drafter     `init(params, prompt_tokens, prompt_lengths, max_length, source, features) -> state`,
              `draft(params, state, context: DraftContext, uniforms, transform) -> (Proposal, state)`:
              given the accepted tokens (and, if it asks, the target's features at the positions
              accepted since its last call), propose candidates arranged as its static `tree` (a
              chain is a tree), with the distribution each was drawn from where it has one.
  TokenDrafter a one-token step (a small model, a table, prompt lookup): `init`, `propose(params,
              state, tokens, positions, transform) -> (probs[B, V], state)`, `rollback`; it becomes
              a Drafter through `specjax.drafters.expansion` (a sampled chain, or its top-k tree).

An encoder-decoder model's decoder starts from its decoder start token: that one token is its
"prompt" (prompt_tokens[B, 1], lengths 1), and the source text goes in as `Source`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp

from specjax.decoding.tree import Tree

Params = Any
DrafterState = Any
# logits[B, V] -> probabilities[B, V]: the temperature / top-k / top-p transform the draft shares with
# the target's verification (acceptance.Settings.draft_transform).
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


@flax.struct.dataclass
class Source:
  """An encoder-decoder model's input, right-padded like prompts: tokens[B, S] int32, lengths[B]."""
  tokens: jax.Array
  lengths: jax.Array


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """The target's hidden states a drafter reads, concatenated in this order on the last axis: the
  residual stream after each listed block (0-based; a T5's decoder blocks), then the final-norm
  state (what the LM head reads). Width (len(blocks) + final_norm) * embed_dim."""
  blocks: tuple[int, ...] = ()
  final_norm: bool = False

  def __post_init__(self):
    object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
    if not self.blocks and not self.final_norm:
      raise ValueError("a FeatureSpec names at least one block or the final norm")

  def width(self, embed_dim: int) -> int:
    return (len(self.blocks) + self.final_norm) * embed_dim

  def check(self, num_layers: int) -> None:
    bad = [b for b in self.blocks if not 0 <= b < num_layers]
    if bad:
      raise ValueError(f"feature blocks {bad} do not exist: this model has blocks 0..{num_layers - 1}")


class StepFn(Protocol):
  """A model's step with its parameters passed in (DESIGN.md contract 1)."""

  def __call__(self, params: Params, tokens: jax.Array, positions: jax.Array,
               cache: Cache) -> tuple[jax.Array, Cache]: ...


class InitCache(Protocol):
  def __call__(self, batch: int, max_length: int) -> Cache: ...


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

  def forward(self, params: Params, context: Any, tokens: jax.Array, positions: jax.Array,
              cache: Cache, slots: jax.Array | None = None, visible: jax.Array | None = None,
              features: FeatureSpec | None = None) -> tuple[jax.Array, jax.Array | None, Cache]:
    """decode_step that can verify a tree and return features: token t is written at slot
    slots[:, t] (RoPE / relative position at positions[:, t]) and sees only the slots visible[:, t]
    [B, T, S] allows (None for both: the chain step). -> (logits, features[B, T, F] per `features`
    or None, cache with lengths (slots or positions)[:, -1] + 1)."""

  def move_cache(self, cache: Cache, source_slots: jax.Array, dest_slots: jax.Array) -> Cache:
    """Copy each row's slots source_slots[B, D] to dest_slots[B, D] (a tree's accepted path)."""

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
  """A decoder-only Model from a step function with explicit params and an empty-cache factory
  (the tests' table models). With `forward_fn(params, tokens, positions, cache, slots, visible,
  features) -> (logits, features, cache)` and `move`, it verifies trees too."""
  step: StepFn
  init_cache: InitCache
  forward_fn: Callable | None = None
  move: Callable | None = None
  encoder_decoder: bool = dataclasses.field(default=False, init=False)

  def encode(self, params: Params, source: Source | None) -> None:
    if source is not None:
      raise ValueError("this decoder-only model takes no encoder input (source); put the text in the "
                       "prompt, or use an encoder-decoder model")
    return None

  def decode_step(self, params: Params, context: None, tokens: jax.Array, positions: jax.Array,
                  cache: Cache) -> tuple[jax.Array, Cache]:
    del context
    return self.step(params, tokens, positions, cache)

  def forward(self, params, context, tokens, positions, cache, slots=None, visible=None,
              features=None):
    if self.forward_fn is not None:
      return self.forward_fn(params, tokens, positions, cache, slots, visible, features)
    if slots is not None or visible is not None or features is not None:
      raise ValueError("this model returns no features and cannot verify token trees; build it "
                       "with specjax.models.decoder_only.model(config)")
    logits, cache = self.decode_step(params, context, tokens, positions, cache)
    return logits, None, cache

  def move_cache(self, cache, source_slots, dest_slots):
    if self.move is None:
      raise ValueError("this model cannot verify token trees (no move_cache)")
    return self.move(cache, source_slots, dest_slots)


def check_source(model: Model, source: Source | None) -> None:
  if model.encoder_decoder and source is None:
    raise ValueError("an encoder-decoder model needs its encoder input: pass source=Source(tokens, "
                     "lengths) (the text to translate or summarise); the prompt is then the decoder "
                     "start token")


def check_drafter_family(target: Model, drafter) -> None:
  """A drafter that runs a model (`drafter.encoder_decoder` is True or False) must match the target's
  family; tables and prompt lookup (None) serve either."""
  family = getattr(drafter, "encoder_decoder", None)
  if family is not None and family != target.encoder_decoder:
    kind = lambda flag: "an encoder-decoder" if flag else "a decoder-only"
    raise ValueError(f"the draft is {kind(family)} model but the target is "
                     f"{kind(target.encoder_decoder)} model; speculative decoding needs a draft of the "
                     "target's family (for a T5 target, a smaller T5 sharing its vocabulary)")


# ----------------------------------------------------------------------------------------------------
# Drafters.


@flax.struct.dataclass
class DraftContext:
  """What a drafter sees at the start of an iteration, per row.

  history[B, S]: the token at every decoder position; valid up to and including `position`.
  position[B]: the root's position: the newest committed token, not yet scored by the target.
  features[B, K, F] (None unless the drafter asks): the target's features at positions
    position - feature_count .. position - 1 (entry j at position - feature_count + j): those
    accepted since the drafter's last call (after the prefill: the prompt's last position). A row
    that has finished keeps its last window (the loop still calls the drafter for it, and ignores
    what it proposes), so a drafter that writes features at their positions writes the same again.
  feature_count[B]: how many entries of `features` are valid (>= 1).
  """
  history: jax.Array
  position: jax.Array
  features: jax.Array | None = None
  feature_count: jax.Array | None = None

  @property
  def root(self) -> jax.Array:
    """[B] the newest committed token (the root of this iteration's tree)."""
    return jnp.take_along_axis(self.history, self.position[:, None], axis=1)[:, 0]

  @property
  def newest_features(self) -> jax.Array:
    """[B, F] the target's features at position - 1."""
    return jnp.take_along_axis(self.features, (self.feature_count - 1)[:, None, None], axis=1)[:, 0]


@flax.struct.dataclass
class Proposal:
  """A drafter's candidates for the positions after the root, arranged as its tree.

  tokens[B, N] int32: node i + 1's token (node 0 is the root; N = tree.size - 1).
  draft_probs[B, N, V] or None: the distribution each token was drawn from (None: chosen
    deterministically, a point mass: top-k, lookup, heads, a block's argmax).
  parents[B, N + 1] or None: a dynamic tree's parents per row (root -1); None: the static tree's.
  """
  tokens: jax.Array
  draft_probs: jax.Array | None = None
  parents: jax.Array | None = None


@runtime_checkable
class Drafter(Protocol):
  """What proposes the candidates the target verifies. Methods are pure; attributes are static.

  tree: the shape of every proposal (Tree.chain(gamma) for a chain of gamma).
  sampled: whether proposals carry draft_probs (candidates drawn from the drafter's distribution).
  features: the target features it reads (None: none).
  num_uniforms: uniforms per iteration it draws from (a sampled chain: gamma).
  calls_per_iteration: its forward passes per iteration (statistics).
  """
  tree: Tree
  sampled: bool
  features: FeatureSpec | None
  num_uniforms: int
  calls_per_iteration: int

  def init(self, params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
           max_length: int, source: Source | None = None,
           features: jax.Array | None = None) -> DrafterState:
    """Prefill on the right-padded prompt[B, P] (and encode the source, for a model draft of the
    encoder-decoder family); features[B, P, F]: the target's at every prompt position, if asked."""

  def draft(self, params: Params, state: DrafterState, context: DraftContext, uniforms: jax.Array,
            transform: Transform) -> tuple[Proposal, DrafterState]:
    """The iteration's candidates; uniforms[B, num_uniforms]; transform: logits -> probabilities,
    the very transform the target's verification uses."""


@runtime_checkable
class TokenDrafter(Protocol):
  """A one-token step (drafters/model.py, tables.py, lookup.py); `expansion` makes it a Drafter."""

  def init(self, params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
           max_length: int, source: Source | None = None) -> DrafterState:
    """Prefill on the right-padded prompt[B, P]. max_length: the cache slots the loop needs."""

  def propose(self, params: Params, state: DrafterState, tokens: jax.Array, positions: jax.Array,
              transform: Transform) -> tuple[jax.Array, DrafterState]:
    """tokens[B, T] at positions[B, T] -> the distribution [B, V] of the token at
    positions[:, -1] + 1, after `transform`: exactly the distribution the loop samples from."""

  def rollback(self, state: DrafterState, lengths: jax.Array) -> DrafterState:
    """Forget everything at positions >= lengths[B]."""
