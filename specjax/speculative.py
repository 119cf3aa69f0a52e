"""Speculative decoding: draft gamma tokens, verify them in one target call, keep a lossless prefix.

The papers name the two distributions oppositely; code here never says p or q:

  here              Leviathan et al. 2022, Alg. 1      Chen et al. 2023, Alg. 2
  target_probs      p(x), from M_p (the target)        q(x), the target
  draft_probs       q(x), from M_q (the approximation) p(x), the draft
  gamma             gamma                              K
  accept_uniforms   r_i ~ U(0, 1)                      r ~ U[0, 1]
  num_accepted      n                                  number of accepted drafts in the iteration
  lenience          l (app. A.5; 1 = lossless)         (not in Chen)

One iteration (Leviathan Alg. 1, Chen Alg. 2), per row of the batch, one named function each:
  1. `draft`: x_1..x_gamma, x_i ~ draft_probs_i (after the same temperature / top-k / top-p transform
     the target uses; the drafter returns the very distribution each token was drawn from);
  2. `verify`: one target call scores tokens [last_token, x_1..x_gamma] at positions [L..L+gamma],
     giving target_probs_1..target_probs_{gamma+1};
  3. `accept_with_uniforms`: accept x_i while r_i < target_probs_i(x_i) / (l draft_probs_i(x_i));
     n = accepted prefix length; the next token comes from normalize(max(0, target_probs_{n+1} -
     l draft_probs_{n+1})) if n < gamma, else the bonus token from target_probs_{gamma+1};
  4. `commit`: append x_1..x_n and the next token, cut after EOS, at max_new_tokens, and for rows that
     were already finished;
  5. `roll_back`: both caches forget the rejected drafts (contracts.set_lengths: nothing is zeroed).

Greedy (temperature == 0, decided per call from the traced temperature, so one compiled program serves
both): accept x_i iff target_probs_i(x_i) >= l * max target_probs_i, emit argmax target_probs_{n+1}. For
argmax lenience target_probs must be the model's soft distribution, not the one-hot that
`sampling.probs_from_logits` returns at temperature 0, so the loop verifies with
`greedy_target_probs(logits)` (softmax at temperature 1, argmax tie-guarded). At l = 1 the output
equals target-only greedy decoding.

Loop conventions mirror `autoregressive.py`: right-padded prompts, the first token from the prefill
logits, tokens[B, max_new_tokens] padded with pad_id, EOS kept and counted, rows finish independently.
The target is any contracts.Model (decoder-only, or encoder-decoder with its `source` encoded once);
this module never imports specjax.models, so tests can hand it table models. Drafters: drafters.py.
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
from specjax.decoding import autoregressive, sampling
from specjax.metrics import SpecOutput, SpecStats

# Residual mass below which normalize(max(0, target - l draft)) is float noise (it is exactly 0 when the
# two distributions are equal, and a rejection then has probability ~0 too). Sampling from
# target_probs_{n+1} instead is exact in the limit and costs at most this much total variation.
RESIDUAL_FLOOR = 1e-5


def validate_gamma(gamma: int) -> None:
  if int(gamma) != gamma or gamma < 1:
    raise ValueError(f"gamma (draft tokens per iteration) must be a whole number >= 1, got {gamma}")


def validate_lenience(lenience: float) -> None:
  if not 0.0 < lenience <= 1.0:  # also rejects NaN
    raise ValueError(f"lenience must lie in (0, 1] (1 is lossless), got {lenience}")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """The settings of one speculative decode that fix the compiled program.

  Every field here is static: changing gamma, max_new_tokens, top_k, eos_id or pad_id changes a shape
  or a branch, so it recompiles. temperature, top_p and lenience are NOT fields: they are traced
  arguments of the compiled function (`make_speculative_decode`), validated on the host at each call,
  so a temperature / top_p / lenience sweep compiles once per gamma.
  """
  gamma: int
  max_new_tokens: int
  top_k: int = 0
  eos_id: int | None = None
  pad_id: int = 0

  def __post_init__(self):
    validate_gamma(self.gamma)
    autoregressive.validate_decode(self.max_new_tokens, self.top_k)


def validate_traced(temperature: float, top_p: float, lenience: float) -> None:
  """Range checks for the traced settings, on the host (inside jit they cannot raise)."""
  sampling.validate_sampling(temperature, 0, top_p)
  validate_lenience(lenience)


# ----------------------------------------------------------------------------------------------------
# The accept rule (DESIGN.md contract 3): pure functions of arrays.


def greedy_target_probs(logits: jax.Array) -> jax.Array:
  """logits[..., V] -> softmax[..., V] (temperature 1) whose argmax is exactly jnp.argmax(logits).

  Distinct logits can round to equal probabilities; such ties with the peak are nudged one ulp below
  it, so greedy verification picks the same token as the baseline's argmax over logits.
  """
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  is_top = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=bool)
  peak = jnp.max(probs, axis=-1, keepdims=True)  # the argmax entry: exp(0) / sum is the largest
  return jnp.where(~is_top & (probs >= peak), jnp.nextafter(peak, 0.0), probs)


def _per_row(value: jax.Array | float | bool, batch: int, dtype) -> jax.Array:
  return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))


def _at_tokens(probs: jax.Array, tokens: jax.Array) -> jax.Array:
  """probs[B, g, V], tokens[B, g] -> probs[b, i, tokens[b, i]] as [B, g]."""
  return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def acceptance_probs(draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                     lenience: jax.Array | float = 1.0,
                     greedy: jax.Array | bool = False) -> jax.Array:
  """Chance that each drafted token passes the test, given its prefix: beta per draft position.

  Sampling: sum_x min(target_probs_i(x) / l, draft_probs_i(x)) (Leviathan's beta, lenient form).
  Greedy: 1 if target_probs_i(x_i) >= l * max target_probs_i else 0.
  Shapes: draft_tokens[B, g], draft_probs[B, g, V], target_probs[B, g(+1), V] -> [B, g] float32.
  """
  batch, gamma = draft_tokens.shape
  target_probs = target_probs[:, :gamma]
  lenience = _per_row(lenience, batch, jnp.float32)[:, None]
  greedy = _per_row(greedy, batch, bool)[:, None]
  soft = jnp.sum(jnp.minimum(target_probs / lenience[..., None], draft_probs), axis=-1)
  hard = _at_tokens(target_probs, draft_tokens) >= lenience * jnp.max(target_probs, axis=-1)
  return jnp.where(greedy, hard.astype(jnp.float32), jnp.minimum(soft, 1.0))


def accept_with_uniforms(accept_uniforms: jax.Array, resample_uniform: jax.Array,
                         draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                         lenience: jax.Array | float = 1.0,
                         greedy: jax.Array | bool = False) -> tuple[jax.Array, jax.Array]:
  """The accept rule with its random numbers given, so a numpy reference can replay them.

  Args:
    accept_uniforms: [B, g] in [0, 1), r_i of Alg. 1.
    resample_uniform: [B] in [0, 1), drives the residual or bonus draw (inverse CDF).
    draft_tokens: [B, g] int32, x_i ~ draft_probs_i.
    draft_probs: [B, g, V], the very distributions the drafts were drawn from.
    target_probs: [B, g + 1, V], the target's distributions after the same transform.
    lenience: scalar or [B] in (0, 1]. greedy: scalar or [B] bool (see the module docstring).
  Returns:
    num_accepted: [B] int32 in 0..g, the accepted prefix length n.
    next_token: [B] int32, the correction (n < g) or bonus (n == g) token emitted after x_1..x_n.
  """
  batch, gamma = draft_tokens.shape
  lenience = _per_row(lenience, batch, jnp.float32)
  greedy = _per_row(greedy, batch, bool)
  target_at_draft = _at_tokens(target_probs[:, :gamma], draft_tokens)
  draft_at_draft = _at_tokens(draft_probs, draft_tokens)
  # r < target / (l draft), multiplied out so that draft == 0 cannot divide by zero; target == 0 never
  # passes (strict <), so a token the target cannot emit is never accepted.
  sampled_ok = accept_uniforms * (lenience[:, None] * draft_at_draft) < target_at_draft
  greedy_ok = target_at_draft >= lenience[:, None] * jnp.max(target_probs[:, :gamma], axis=-1)
  ok = jnp.where(greedy[:, None], greedy_ok, sampled_ok)
  # Stop at the first rejection: n = length of the all-accepted prefix.
  num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

  target_next = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
  # A zero draft row at position gamma + 1 makes the residual of an all-accepted row equal to
  # target_probs_{gamma+1}: the bonus token is the same draw, with no branch.
  draft_padded = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
  draft_next = jnp.take_along_axis(draft_padded, num_accepted[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(target_next - lenience[:, None] * draft_next, 0.0)
  enough_mass = jnp.sum(residual, axis=-1, keepdims=True) > RESIDUAL_FLOOR
  # sample_with_uniform scales by the total mass itself, so the residual needs no normalisation.
  sampled_next = sampling.sample_with_uniform(resample_uniform, jnp.where(enough_mass, residual,
                                                                          target_next))
  next_token = jnp.where(greedy, jnp.argmax(target_next, axis=-1), sampled_next)
  return num_accepted.astype(jnp.int32), next_token.astype(jnp.int32)


def accept(rng: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
           lenience: jax.Array | float = 1.0,
           greedy: jax.Array | bool = False) -> tuple[jax.Array, jax.Array]:
  """`accept_with_uniforms` with its uniforms drawn from rng. Shapes and returns as there."""
  batch, gamma = draft_tokens.shape
  accept_rng, resample_rng = jax.random.split(rng)
  return accept_with_uniforms(jax.random.uniform(accept_rng, (batch, gamma)),
                              jax.random.uniform(resample_rng, (batch,)), draft_tokens, draft_probs,
                              target_probs, lenience, greedy)


# ----------------------------------------------------------------------------------------------------
# The loop.


def first_token_uniform(rng: jax.Array, batch: int) -> jax.Array:
  """[B] uniforms for the first new token, drawn from the prefill logits."""
  return jax.random.uniform(jax.random.fold_in(rng, 0), (batch,))


def iteration_uniforms(rng: jax.Array, iteration: jax.Array | int,
                       batch: int, gamma: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Every random number of loop iteration `iteration` (0-based), so a reference can replay the loop.

  Returns draft_uniforms[B, g], accept_uniforms[B, g], resample_uniform[B].
  """
  u = jax.random.uniform(jax.random.fold_in(rng, iteration + 1), (batch, 2 * gamma + 1))
  return u[:, :gamma], u[:, gamma:2 * gamma], u[:, 2 * gamma]


def draft(drafter: contracts.Drafter, draft_params: Any, draft_state: Any, prev_token: jax.Array,
          last_token: jax.Array, position: jax.Array, draft_uniforms: jax.Array,
          transform: contracts.Transform) -> tuple[jax.Array, jax.Array, Any]:
  """Draft gamma tokens per row: x_i = inverse-CDF(draft_uniforms[:, i], draft_probs_i).

  The first call feeds [prev_token, last_token] at positions [position - 1, position]: after an
  iteration that accepted every draft the drafter never saw x_gamma (now at position - 1), and
  re-feeding an already cached token rewrites the same slot, so one static shape covers both cases.
  Later calls feed one token.
  Args: prev_token, last_token, position [B] int32; draft_uniforms [B, g]; transform: logits[B, V] ->
  probs[B, V].
  Returns draft_tokens[B, g] int32, draft_probs[B, g, V], the drafter's new state.
  """
  probs, draft_state = drafter.propose(draft_params, draft_state,
                                       jnp.stack([prev_token, last_token], axis=1),
                                       jnp.stack([position - 1, position], axis=1), transform)
  token = sampling.sample_with_uniform(draft_uniforms[:, 0], probs)

  def step(carry, uniform):
    state, token, token_position = carry
    probs, state = drafter.propose(draft_params, state, token[:, None], token_position[:, None],
                                   transform)
    new = sampling.sample_with_uniform(uniform, probs)
    return (state, new, token_position + 1), (new, probs)

  (draft_state, _, _), (tokens, rest) = jax.lax.scan(step, (draft_state, token, position + 1),
                                                     draft_uniforms[:, 1:].T)
  draft_tokens = jnp.concatenate([token[:, None], tokens.T], axis=1)
  draft_probs = jnp.concatenate([probs[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
  return draft_tokens, draft_probs, draft_state


def verify(session: contracts.Session, target_cache: contracts.Cache, last_token: jax.Array,
           position: jax.Array, draft_tokens: jax.Array,
           target_transform) -> tuple[jax.Array, contracts.Cache]:
  """One target call on [last_token, x_1..x_gamma] at [position .. position + gamma].

  Returns target_probs[B, g + 1, V] (after `target_transform`, logits -> probs) and the target cache
  with all g + 1 tokens written (the rejected ones are rolled back by `roll_back`).
  """
  tokens = jnp.concatenate([last_token[:, None], draft_tokens], axis=1)
  positions = position[:, None] + jnp.arange(draft_tokens.shape[1] + 1, dtype=jnp.int32)
  logits, target_cache = session.step(tokens, positions, target_cache)
  return target_transform(logits), target_cache


@flax.struct.dataclass
class Commit:
  """What an iteration appends, after the cuts (per row)."""
  committed: jax.Array      # [B, max_new + gamma + 1] the committed tokens so far, this iteration's in
  num_committed: jax.Array  # [B]
  num_emitted: jax.Array    # [B] tokens this iteration appended (0 for a finished row)
  done: jax.Array           # [B] bool: finished now (EOS committed or max_new_tokens reached)


def commit(state: "LoopState", draft_tokens: jax.Array, num_accepted: jax.Array,
           next_token: jax.Array, config: SpecConfig) -> Commit:
  """Append x_1..x_n and next_token to each row: cut after the first EOS, at max_new_tokens, and
  nothing for rows finished earlier. draft_tokens[B, g], num_accepted / next_token [B]."""
  batch, gamma = draft_tokens.shape
  j = jnp.arange(gamma + 1)[None, :]
  n = num_accepted[:, None]
  drafted = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)
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


def roll_back(state: "LoopState", committed: Commit, draft_tokens: jax.Array, num_accepted: jax.Array,
              next_token: jax.Array, target_cache: contracts.Cache, draft_state: Any,
              drafter: contracts.Drafter) -> dict:
  """Rows that go on move to position + n + 1 with next_token as their last token; both caches keep
  only committed positions (the extra verification writes and rejected drafts are dropped). Finished
  rows freeze, so their ignored writes stay inside the buffers. Returns the LoopState fields."""
  go = ~committed.done
  position = jnp.where(go, state.position + num_accepted + 1, state.position)
  rows = jnp.arange(draft_tokens.shape[0])
  newest_draft = draft_tokens[rows, jnp.maximum(num_accepted - 1, 0)]
  prev_token = jnp.where(num_accepted > 0, newest_draft, state.last_token)
  return dict(last_token=jnp.where(go, next_token, state.last_token),
              prev_token=jnp.where(go, prev_token, state.prev_token), position=position,
              target_cache=contracts.set_lengths(target_cache, position),
              draft_state=drafter.rollback(draft_state, position - 1))


@flax.struct.dataclass
class LoopState:
  """The while_loop carry. Invariant at the top of an iteration, per row: `last_token` is the newest
  committed token, at `position`, not yet in the target cache (its length == position); the drafter
  holds positions < position - 1 and is re-fed [prev_token, last_token] at [position - 1, position].
  Finished rows freeze `position`, so their (ignored) writes stay inside the buffers."""
  iteration: jax.Array      # [] int32
  committed: jax.Array      # [B, max_new + gamma + 1] committed tokens; the tail absorbs masked writes
  num_committed: jax.Array  # [B]
  done: jax.Array           # [B] bool
  last_token: jax.Array     # [B]
  prev_token: jax.Array     # [B] the committed (or prompt) token at position - 1
  position: jax.Array       # [B]
  target_cache: Any
  draft_state: Any
  stats: SpecStats


def _check_vocab(target_vocab: int, drafter, draft_params, draft_state, batch: int) -> None:
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  (draft_params, draft_state))
  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  probs = jax.eval_shape(lambda p, s, t: drafter.propose(p, s, t, t, lambda x: x)[0], *shapes, tokens)
  if probs.shape[-1] != target_vocab:
    raise ValueError(f"vocabulary sizes differ: the target has {target_vocab} tokens, the drafter "
                     f"{probs.shape[-1]}; speculative decoding needs one shared vocabulary")


def transforms(temperature: jax.Array, top_p: jax.Array, top_k: int):
  """(draft transform, target transform): logits -> probs at the traced temperature / top-p. The
  lax.conds let greedy decoding skip top-p's sort; the target's greedy transform keeps soft
  probabilities (`greedy_target_probs`) for argmax lenience."""
  greedy = temperature == 0.0
  sampled = functools.partial(sampling.probs_from_logits, temperature=temperature, top_k=top_k,
                              top_p=top_p)

  def transform(logits):  # = sampled(logits)
    return jax.lax.cond(greedy, lambda x: sampling.probs_from_logits(x, 0.0), sampled, logits)

  def target_transform(logits):
    return jax.lax.cond(greedy, greedy_target_probs, sampled, logits)

  return transform, target_transform


def initial_state(session: contracts.Session, drafter: contracts.Drafter, draft_params,
                  config: SpecConfig, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                  rng: jax.Array, transform, source: contracts.Source | None = None) -> "LoopState":
  """Prefill the target and the drafter, draw the first token: the carry of the first iteration."""
  batch, prompt_len = prompt_tokens.shape
  gamma, max_new = config.gamma, config.max_new_tokens
  max_length = prompt_len + max_new + gamma + 1  # a verification write never falls off the end
  prompt_lengths = prompt_lengths.astype(jnp.int32)
  logits, target_cache = autoregressive.prefill(session, prompt_tokens, prompt_lengths, max_length)
  draft_state = drafter.init(draft_params, prompt_tokens, prompt_lengths, max_length, source)
  _check_vocab(logits.shape[-1], drafter, draft_params, draft_state, batch)
  first = sampling.sample_with_uniform(
      first_token_uniform(rng, batch),
      transform(autoregressive.last_prompt_logits(logits, prompt_lengths)))
  return LoopState(
      iteration=jnp.int32(0),
      committed=jnp.full((batch, max_new + gamma + 1), config.pad_id, jnp.int32).at[:, 0].set(first),
      num_committed=jnp.ones((batch,), jnp.int32),
      done=autoregressive.is_eos(first, config.eos_id) | (max_new == 1),
      last_token=first,
      prev_token=prompt_tokens[jnp.arange(batch), prompt_lengths - 1].astype(jnp.int32),
      position=prompt_lengths, target_cache=target_cache,
      draft_state=drafter.rollback(draft_state, prompt_lengths - 1),
      stats=SpecStats.empty(batch, max_new, gamma))


def settle(s: "LoopState", drafter: contracts.Drafter, config: SpecConfig, draft_tokens: jax.Array,
           draft_probs: jax.Array, target_probs: jax.Array, target_cache: contracts.Cache,
           draft_state: Any, accept_uniforms: jax.Array, resample_uniform: jax.Array,
           lenience: jax.Array, greedy: jax.Array) -> "LoopState":
  """Steps 3-5 of an iteration after draft and verify: accept, commit, record the statistics, roll
  back both caches. Returns the next iteration's carry."""
  num_accepted, next_token = accept_with_uniforms(accept_uniforms, resample_uniform, draft_tokens,
                                                  draft_probs, target_probs, lenience, greedy)
  committed = commit(s, draft_tokens, num_accepted, next_token, config)
  stats = s.stats.record(s.iteration, ~s.done, num_accepted, committed.num_emitted,
                         acceptance_probs(draft_tokens, draft_probs, target_probs, lenience, greedy))
  return LoopState(iteration=s.iteration + 1, committed=committed.committed,
                   num_committed=committed.num_committed, done=committed.done, stats=stats,
                   **roll_back(s, committed, draft_tokens, num_accepted, next_token, target_cache,
                               draft_state, drafter))


def speculative_decode(target: contracts.Model, drafter: contracts.Drafter, config: SpecConfig,
                       target_params, draft_params, prompt_tokens: jax.Array,
                       prompt_lengths: jax.Array, rng: jax.Array, temperature=0.0, top_p=1.0,
                       lenience=1.0, source: contracts.Source | None = None) -> SpecOutput:
  """Decode up to config.max_new_tokens tokens per row. Jit with `make_speculative_decode`.

  Args:
    target: the target contracts.Model; drafter: a drafters.py drafter; draft_params its params (or
      None).
    prompt_tokens: [B, P] int32, right-padded; prompt_lengths: [B] int32, each >= 1 (an
      encoder-decoder target: the decoder start token, P = 1).
    rng: a PRNG key; temperature, top_p, lenience: traced scalars (temperature 0 = greedy).
    source: the encoder input of an encoder-decoder target (and of a model draft of that family).
  Returns: SpecOutput (tokens[B, max_new_tokens], num_generated[B], call counts, SpecStats).
  """
  batch = prompt_tokens.shape[0]
  gamma, max_new = config.gamma, config.max_new_tokens
  temperature = jnp.asarray(temperature, jnp.float32)
  lenience = jnp.asarray(lenience, jnp.float32)
  greedy = temperature == 0.0
  transform, target_transform = transforms(temperature, top_p, config.top_k)
  session = contracts.open_session(target, target_params, source)
  state = initial_state(session, drafter, draft_params, config, prompt_tokens, prompt_lengths, rng,
                        transform, source)

  def cond(s: LoopState):
    return (s.iteration < max_new) & ~jnp.all(s.done)

  def body(s: LoopState) -> LoopState:
    draft_u, accept_u, resample_u = iteration_uniforms(rng, s.iteration, batch, gamma)
    draft_tokens, draft_probs, draft_state = draft(drafter, draft_params, s.draft_state, s.prev_token,
                                                   s.last_token, s.position, draft_u, transform)
    target_probs, target_cache = verify(session, s.target_cache, s.last_token, s.position,
                                        draft_tokens, target_transform)
    return settle(s, drafter, config, draft_tokens, draft_probs, target_probs, target_cache,
                  draft_state, accept_u, resample_u, lenience, greedy)

  s = jax.lax.while_loop(cond, body, state)
  return SpecOutput(tokens=s.committed[:, :max_new], num_generated=s.num_committed,
                    target_calls=s.iteration, draft_calls=s.iteration * gamma, stats=s.stats)


def _concrete_floats(*values) -> list[float] | None:
  """Host floats of values known outside jit, or None when any is traced."""
  try:
    return [float(np.asarray(v)) for v in values]
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def make_speculative_decode(target: contracts.Model, drafter: contracts.Drafter, config: SpecConfig,
                            **jit_kwargs):
  """jit(speculative_decode) for one (target, drafter, config).

  Returns fn(target_params, draft_params, prompt_tokens[B, P], prompt_lengths[B], rng,
  temperature=0., top_p=1., lenience=1., source=None) -> SpecOutput. The three floats are validated on
  the host and passed as float32 arrays, so any sweep over them reuses one compiled program
  (`fn.jitted` is the jax.jit object, e.g. for `_cache_size()`). Extra kwargs (in_shardings, ...) go
  to jax.jit.
  """
  contracts.check_drafter_family(target, drafter)
  jitted = jax.jit(functools.partial(speculative_decode, target, drafter, config), **jit_kwargs)

  def run(target_params, draft_params, prompt_tokens, prompt_lengths, rng, temperature=0.0,
          top_p=1.0, lenience=1.0, source=None) -> SpecOutput:
    host = _concrete_floats(temperature, top_p, lenience)
    if host is not None:
      validate_traced(*host)
    as_f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return jitted(target_params, draft_params, prompt_tokens, prompt_lengths, rng,
                  as_f32(temperature), as_f32(top_p), as_f32(lenience), source)

  run.jitted = jitted
  return run
