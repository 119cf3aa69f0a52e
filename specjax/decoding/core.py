"""THE speculative decoding loop: prefill, then draft -> verify -> accept -> settle in ONE jitted
`lax.while_loop`, for both model families, any drafter and any batch whose rows accept different counts.

One iteration, per row (each step a method of `Loop`, which the timers call too):
  1. `draft`: the drafter proposes candidates arranged as its static tree (a chain is a tree), with
     the distribution each was drawn from where it has one (contracts.Drafter);
  2. `verify`: ONE target call scores [root, candidates] at [position + depth]: a chain's nodes sit
     at consecutive positions (the plain causal step), a tree's each in its own cache slot, seeing
     the prefix and its ancestors (decoding/tree.py); the target also hands back the features the
     drafter reads, if it reads any;
  3. `settle`: the acceptance rule (decoding/acceptance.py: chain rejection for a sampled chain, the
     tree walk otherwise) keeps a path and draws the next token; commit it (cut after EOS, at
     max_new_tokens, nothing for rows already finished), compact a tree's accepted path in the cache,
     roll the cache back to the committed length (contracts.set_lengths: nothing is zeroed), keep the
     features of the accepted positions for the drafter, record the statistics.

Random numbers: iteration i draws one [B, n] block of uniforms from fold_in(rng, i + 1): the
drafter's first (a sampled chain: one per draft), then the rule's (chain rejection: one per draft
and one for the residual; the walk: one per depth), so a numpy reference can replay the loop. The
first new token uses fold_in(rng, 0). rng may also be one key per row ([B, 2]): row b then draws
its n uniforms from fold_in(rng[b], i + 1), whatever batch it is in (generation gives each prompt
its own key, sampling.prompt_key, so a resumed run draws what an uninterrupted one did).

Conventions mirror `autoregressive.py`: right-padded prompts, the first token from the prefill
logits, tokens[B, max_new_tokens] padded with pad_id, EOS kept and counted, rows finish independently
and freeze. The target is any contracts.Model (decoder-only, or encoder-decoder with its `source`
encoded once); this module imports neither specjax.models nor specjax.drafters, so tests hand it
table models and drafters of their own.

Static vs traced (`DecodeConfig` holds what is static): the drafter's tree, max_new_tokens, top_k,
eos_id and pad_id fix the program; temperature, top_p and lenience are traced arguments, validated on
the host at each call, so a temperature / top-p / lenience sweep compiles once per drafter and tree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import contracts
from specjax.decoding import acceptance, autoregressive, sampling
from specjax.decoding import tree as trees
from specjax.metrics import SpecOutput, SpecStats


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """The static settings of a decode (with the drafter's tree, what fixes the compiled program):
  changing any recompiles. temperature, top_p and lenience are NOT here: they are traced arguments
  of `make_decode`'s function."""
  max_new_tokens: int
  top_k: int = 0
  eos_id: int | None = None
  pad_id: int = 0

  def __post_init__(self):
    autoregressive.validate_decode(self.max_new_tokens, self.top_k)


def validate_traced(temperature: float, top_p: float, lenience: float, lenient: bool = True) -> None:
  """Range checks for the traced settings, on the host (inside jit they cannot raise)."""
  sampling.validate_sampling(temperature, 0, top_p)
  acceptance.validate_lenience(lenience)
  if lenience != 1.0 and not lenient:
    raise ValueError(f"lenience {lenience} is a property of chain rejection (Leviathan app. A.5); "
                     "this drafter's proposals are verified by the tree walk, which is lossless "
                     "only: use lenience 1, or a sampled chain")


def first_token_uniform(rng: jax.Array, batch: int) -> jax.Array:
  """[B] uniforms for the first new token, drawn from the prefill logits (rng: one key, or one per
  row: sampling.per_row)."""
  return sampling.uniforms(sampling.fold_in(rng, 0), batch)


def iteration_uniforms(rng: jax.Array, iteration: jax.Array | int, batch: int,
                       count: int) -> jax.Array:
  """[B, count]: every random number of loop iteration `iteration` (0-based), drafter's first."""
  return sampling.uniforms(sampling.fold_in(rng, iteration + 1), batch, (count,))


@flax.struct.dataclass
class Commit:
  """What an iteration appends, after the cuts (per row)."""
  committed: jax.Array      # [B, max_new + depth + 1] the committed tokens so far, this iteration's in
  num_committed: jax.Array  # [B]
  num_emitted: jax.Array    # [B] tokens this iteration appended (0 for a finished row)
  done: jax.Array           # [B] bool: finished now (EOS committed or max_new_tokens reached)


def commit(state: "LoopState", path_tokens: jax.Array, num_accepted: jax.Array,
           next_token: jax.Array, config: DecodeConfig) -> Commit:
  """Append the n accepted candidates and next_token to each row: cut after the first EOS, at
  max_new_tokens, and nothing for rows finished earlier. path_tokens[B, depth] (the accepted path's
  tokens; entries past n are ignored), num_accepted / next_token [B]."""
  batch, depth = path_tokens.shape
  j = jnp.arange(depth + 1)[None, :]
  n = num_accepted[:, None]
  drafted = jnp.concatenate([path_tokens, jnp.zeros_like(path_tokens[:, :1])], axis=1)
  candidates = jnp.where(j < n, drafted, next_token[:, None])
  eos = autoregressive.is_eos(candidates, config.eos_id) & (j <= n)
  before_eos = (jnp.cumsum(eos, axis=1) - eos) == 0  # up to and including the first EOS
  keep = ((j <= n) & before_eos & (state.num_committed[:, None] + j < config.max_new_tokens)
          & ~state.done[:, None])
  rows = jnp.arange(batch)[:, None]
  committed = state.committed.at[rows, state.num_committed[:, None] + j].set(
      jnp.where(keep, candidates, config.pad_id))
  num_emitted = jnp.sum(keep, axis=1).astype(jnp.int32)
  num_committed = state.num_committed + num_emitted
  done = (state.done | jnp.any(keep & eos, axis=1) | (num_committed >= config.max_new_tokens))
  return Commit(committed, num_committed, num_emitted, done)


@flax.struct.dataclass
class LoopState:
  """The while_loop carry. Invariant at the top of an iteration, per row: history[:, position] is
  the root, the newest committed token, not yet in the target cache (its length == position);
  history[:, :position + 1] holds every token so far; `features` holds the target's features at the
  `feature_count` positions before `position` (contracts.DraftContext). Finished rows freeze, so their
  (ignored) writes stay inside the buffers."""
  iteration: jax.Array      # [] int32
  committed: jax.Array      # [B, max_new + depth + 1]; the tail absorbs masked writes
  num_committed: jax.Array  # [B]
  done: jax.Array           # [B] bool
  position: jax.Array       # [B]
  history: jax.Array        # [B, S] int32, S = the cache length
  features: jax.Array | None       # [B, depth + 1, F], or None when the drafter reads none
  feature_count: jax.Array | None  # [B]
  target_cache: Any
  draft_state: Any
  stats: SpecStats

  def context(self) -> contracts.DraftContext:
    return contracts.DraftContext(self.history, self.position, self.features, self.feature_count)


@flax.struct.dataclass
class Verified:
  """The target's verification: logits[B, T, V], features[B, T, F] (or None), the cache with all T
  nodes written."""
  logits: jax.Array
  features: jax.Array | None
  cache: Any


@dataclasses.dataclass(frozen=True)
class Loop:
  """One decode's parts, bound to its models, parameters, encoded source and settings (built inside
  the trace; the timers build one too and time its parts)."""
  target: contracts.Model
  drafter: contracts.Drafter
  config: DecodeConfig
  target_params: Any
  draft_params: Any
  context: Any  # the target's encoded source (None for a decoder-only target)
  settings: acceptance.Settings
  rng: jax.Array

  @property
  def tree(self) -> trees.Tree:
    return self.drafter.tree

  @functools.cached_property
  def rule(self):
    return acceptance.rule_for(self.tree, self.drafter.sampled)

  @property
  def num_uniforms(self) -> int:
    return self.drafter.num_uniforms + self.rule.num_uniforms(self.tree)

  def start(self, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
            source: contracts.Source | None = None) -> LoopState:
    """Prefill the target (with the drafter's features) and the drafter, draw the first token."""
    tree, config = self.tree, self.config
    batch, prompt_len = prompt_tokens.shape
    max_length = prompt_len + config.max_new_tokens + tree.size  # writes never fall off the end
    prompt_lengths = prompt_lengths.astype(jnp.int32)
    rows = jnp.arange(batch)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    logits, features, cache = self.target.forward(
        self.target_params, self.context, prompt_tokens, positions,
        self.target.init_cache(batch, max_length), features=self.drafter.features)
    draft_state = self.drafter.init(self.draft_params, prompt_tokens, prompt_lengths, max_length,
                                    source, features)
    first = sampling.sample_with_uniform(
        first_token_uniform(self.rng, batch),
        self.settings.draft_transform(autoregressive.last_prompt_logits(logits, prompt_lengths)))
    history = jnp.zeros((batch, max_length), jnp.int32).at[:, :prompt_len].set(prompt_tokens)
    window = count = None
    if features is not None:  # the prompt's last position, until the first verification
      window = jnp.zeros((batch, tree.depth + 1, features.shape[-1]), features.dtype)
      window = window.at[:, 0].set(features[rows, prompt_lengths - 1])
      count = jnp.ones((batch,), jnp.int32)
    state = LoopState(
        iteration=jnp.int32(0),
        committed=jnp.full((batch, config.max_new_tokens + tree.depth + 1), config.pad_id,
                           jnp.int32).at[:, 0].set(first),
        num_committed=jnp.ones((batch,), jnp.int32),
        done=autoregressive.is_eos(first, config.eos_id) | (config.max_new_tokens == 1),
        position=prompt_lengths, history=history.at[rows, prompt_lengths].set(first),
        features=window, feature_count=count,
        target_cache=contracts.set_lengths(cache, prompt_lengths), draft_state=draft_state,
        stats=SpecStats.empty(batch, config.max_new_tokens, tree.depth))
    self._check_vocab(logits.shape[-1], state)
    return state

  def _check_vocab(self, target_vocab: int, state: LoopState) -> None:
    proposal = jax.eval_shape(lambda s: self.draft(s, jnp.zeros((s.position.shape[0],
                                                                   self.num_uniforms)))[0], state)
    if proposal.draft_probs is not None and proposal.draft_probs.shape[-1] != target_vocab:
      raise ValueError(f"vocabulary sizes differ: the target has {target_vocab} tokens, the "
                       f"drafter {proposal.draft_probs.shape[-1]}; speculative decoding needs one "
                       "shared vocabulary")

  def uniforms(self, state: LoopState) -> jax.Array:
    return iteration_uniforms(self.rng, state.iteration, state.position.shape[0], self.num_uniforms)

  def draft(self, state: LoopState, uniforms: jax.Array) -> tuple[contracts.Proposal, Any]:
    """-> (the drafter's Proposal, its new state)."""
    return self.drafter.draft(self.draft_params, state.draft_state, state.context(),
                              uniforms[:, :self.drafter.num_uniforms],
                              self.settings.draft_transform)

  def verify(self, state: LoopState, proposal: contracts.Proposal) -> Verified:
    """One target call on [root, candidates]: a chain at consecutive positions, a tree by its
    attention inputs."""
    tokens = self.node_tokens(state, proposal)
    if self.tree.is_chain and proposal.parents is None:
      positions = state.position[:, None] + jnp.arange(self.tree.size, dtype=jnp.int32)
      slots = visible = None
    else:
      parents = self.tree.parents if proposal.parents is None else proposal.parents
      positions, slots, visible = trees.attention_inputs(parents, state.position,
                                                         state.history.shape[1])
    logits, features, cache = self.target.forward(
        self.target_params, self.context, tokens, positions, state.target_cache, slots, visible,
        features=self.drafter.features)
    return Verified(logits, features, cache)

  @staticmethod
  def node_tokens(state: LoopState, proposal: contracts.Proposal) -> jax.Array:
    root = jnp.take_along_axis(state.history, state.position[:, None], axis=1)
    return jnp.concatenate([root, proposal.tokens], axis=1).astype(jnp.int32)

  def settle(self, state: LoopState, proposal: contracts.Proposal, verified: Verified,
             uniforms: jax.Array, draft_state: Any) -> LoopState:
    """Accept, commit, compact and roll back, keep the accepted features, record the statistics:
    the next iteration's carry."""
    tree, s = self.tree, state
    tokens = self.node_tokens(s, proposal)
    verdict = self.rule(tree, tokens, proposal.draft_probs, verified.logits,
                        uniforms[:, self.drafter.num_uniforms:], self.settings, proposal.parents)
    n, next_token = verdict.num_accepted, verdict.next_token
    path_tokens = jnp.take_along_axis(tokens, verdict.path[:, 1:], axis=1)  # [B, depth]
    committed = commit(s, path_tokens, n, next_token, self.config)
    go = ~committed.done
    position = jnp.where(go, s.position + n + 1, s.position)
    steps = jnp.arange(1, tree.depth + 1, dtype=jnp.int32)
    cache = verified.cache
    if not (tree.is_chain and proposal.parents is None):  # the accepted path into consecutive slots
      cache = self.target.move_cache(cache, s.position[:, None] + verdict.path[:, 1:],
                                     s.position[:, None] + steps)
    rows = jnp.arange(tokens.shape[0])
    written = jnp.where(steps[None, :] <= n[:, None], path_tokens, next_token[:, None])
    history = s.history.at[rows[:, None], s.position[:, None] + steps].set(written)
    history = history.at[rows, s.position + n + 1].set(next_token)
    features, count = s.features, s.feature_count
    if verified.features is not None:  # the accepted positions' features, for the next draft
      accepted = jnp.take_along_axis(verified.features, verdict.path[:, :, None], axis=1)
      features = jnp.where(go[:, None, None], accepted.astype(features.dtype), features)
      count = jnp.where(go, n + 1, count)
    return LoopState(
        iteration=s.iteration + 1, committed=committed.committed,
        num_committed=committed.num_committed, done=committed.done, position=position,
        history=jnp.where(go[:, None], history, s.history), features=features,
        feature_count=count, target_cache=contracts.set_lengths(cache, position),
        draft_state=draft_state,
        stats=s.stats.record(s.iteration, ~s.done, n, committed.num_emitted, verdict.betas))

  def body(self, state: LoopState) -> LoopState:
    uniforms = self.uniforms(state)
    proposal, draft_state = self.draft(state, uniforms)
    return self.settle(state, proposal, self.verify(state, proposal), uniforms, draft_state)

  def cond(self, state: LoopState) -> jax.Array:
    return (state.iteration < self.config.max_new_tokens) & ~jnp.all(state.done)


def decode(target: contracts.Model, drafter: contracts.Drafter, config: DecodeConfig, target_params,
           draft_params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, rng: jax.Array,
           temperature=0.0, top_p=1.0, lenience=1.0,
           source: contracts.Source | None = None) -> SpecOutput:
  """Decode up to config.max_new_tokens tokens per row. Jit with `make_decode`.

  Args:
    target: the target contracts.Model; drafter: a contracts.Drafter; draft_params its params.
    prompt_tokens: [B, P] int32, right-padded; prompt_lengths: [B] int32, each >= 1 (an
      encoder-decoder target: the decoder start token, P = 1).
    rng: a PRNG key, or one per row ([B, 2]); temperature, top_p, lenience: traced scalars (temperature 0 = greedy).
    source: the encoder input of an encoder-decoder target (and of a model draft of that family).
  Returns: SpecOutput (tokens[B, max_new_tokens], num_generated[B], call counts, SpecStats with
  gamma = the tree's depth).
  """
  contracts.check_source(target, source)
  settings = acceptance.Settings(jnp.asarray(temperature, jnp.float32),
                                 jnp.asarray(top_p, jnp.float32),
                                 jnp.asarray(lenience, jnp.float32), config.top_k)
  loop = Loop(target, drafter, config, target_params, draft_params,
              target.encode(target_params, source), settings, rng)
  s = jax.lax.while_loop(loop.cond, loop.body, loop.start(prompt_tokens, prompt_lengths, source))
  return SpecOutput(tokens=s.committed[:, :config.max_new_tokens], num_generated=s.num_committed,
                    target_calls=s.iteration,
                    draft_calls=s.iteration * drafter.calls_per_iteration, stats=s.stats)


def _concrete_floats(*values) -> list[float] | None:
  """Host floats of values known outside jit, or None when any is traced."""
  try:
    return [float(np.asarray(v)) for v in values]
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def make_decode(target: contracts.Model, drafter: contracts.Drafter, config: DecodeConfig,
                **jit_kwargs):
  """jit(decode) for one (target, drafter, config).

  Returns fn(target_params, draft_params, prompt_tokens[B, P], prompt_lengths[B], rng,
  temperature=0., top_p=1., lenience=1., source=None) -> SpecOutput. The three floats are validated on
  the host and passed as float32 arrays, so any sweep over them reuses one compiled program
  (`fn.jitted` is the jax.jit object, e.g. to lower it ahead of time). Extra kwargs (in_shardings,
  ...) go to jax.jit.
  """
  contracts.check_drafter_family(target, drafter)
  lenient = acceptance.rule_for(drafter.tree, drafter.sampled).lenient
  jitted = jax.jit(functools.partial(decode, target, drafter, config), **jit_kwargs)

  def run(target_params, draft_params, prompt_tokens, prompt_lengths, rng, temperature=0.0,
          top_p=1.0, lenience=1.0, source=None) -> SpecOutput:
    host = _concrete_floats(temperature, top_p, lenience)
    if host is not None:
      validate_traced(*host, lenient=lenient)
    as_f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return jitted(target_params, draft_params, prompt_tokens, prompt_lengths, rng,
                  as_f32(temperature), as_f32(top_p), as_f32(lenience), source)

  run.jitted = jitted
  return run
