"""Speculative decoding: draft gamma tokens, verify them in one target call, keep a lossless prefix.

The papers name the two distributions oppositely; code here never says p or q:

  here              Leviathan et al. 2022, Alg. 1      Chen et al. 2023, Alg. 2
  target_probs      p(x), from M_p (the target)        q(x), the target
  draft_probs       q(x), from M_q (the approximation) p(x), the draft
  gamma             gamma                              K
  accept_uniforms   r_i ~ U(0, 1)                      r ~ U[0, 1]
  num_accepted      n                                  number of accepted drafts in the iteration
  lenience          l (app. A.5; 1 = lossless)         (not in Chen)

One iteration (Leviathan Alg. 1, Chen Alg. 2), per row of the batch:
  1. draft x_1..x_gamma, x_i ~ draft_probs_i (after the same temperature / top-k / top-p transform the
     target uses; `draft` returns the very distribution each token was drawn from);
  2. one target call scores tokens [last_committed, x_1..x_gamma] at positions [L..L+gamma], giving
     target_probs_1..target_probs_{gamma+1};
  3. accept x_i while r_i < target_probs_i(x_i) / (l draft_probs_i(x_i)); n = accepted prefix length;
  4. emit x_1..x_n and one more token: from normalize(max(0, target_probs_{n+1} - l draft_probs_{n+1}))
     if n < gamma, else the bonus token from target_probs_{gamma+1};
  5. roll both caches back to the committed length (kv_cache: set lengths, nothing is zeroed).

Greedy (temperature == 0, decided per call from the traced temperature, so one compiled program serves
both): accept x_i iff target_probs_i(x_i) >= l * max target_probs_i, emit argmax target_probs_{n+1}. For
argmax lenience target_probs must be the model's soft distribution, not the one-hot that
`sampling.probs_from_logits` returns at temperature 0, so the loop passes `greedy_target_probs(logits)`
(softmax at temperature 1, argmax tie-guarded). At l = 1 the output equals target-only greedy decoding.

Loop conventions mirror `autoregressive.py`: right-padded prompts, the first token from the prefill
logits, tokens[B, max_new_tokens] padded with pad_id, EOS kept and counted, rows finish independently.
The target is any step function (DESIGN.md contract 1) with a cache carrying `lengths[B]`; this module
never imports specjax.models, so tests can hand it table models. Drafters: see drafters.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import autoregressive, sampling

StepFn = Callable  # (params, tokens[B, T], positions[B, T], cache) -> (logits[B, T, V], cache)

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
class SpecShape:
  """The static part of a speculative decode: changing any field recompiles (it fixes a shape)."""
  gamma: int
  max_new_tokens: int
  top_k: int = 0
  eos_id: int | None = None
  pad_id: int = 0

  def __post_init__(self):
    validate_gamma(self.gamma)
    if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a whole number >= 1, got {self.max_new_tokens}")
    sampling.validate_sampling(0.0, self.top_k, 1.0)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """One speculative-decoding setting.

  gamma, max_new_tokens, top_k, eos_id and pad_id are static (`.shape`; they change compiled shapes).
  temperature, top_p and lenience are traced arguments of the compiled function (`.traced`), so a
  temperature / top_p / lenience sweep compiles once per gamma.
  """
  gamma: int = 4
  max_new_tokens: int = 64
  top_k: int = 0
  eos_id: int | None = None
  pad_id: int = 0
  temperature: float = 0.0
  top_p: float = 1.0
  lenience: float = 1.0

  def __post_init__(self):
    validate_gamma(self.gamma)
    sampling.validate_sampling(self.temperature, self.top_k, self.top_p)
    validate_lenience(self.lenience)
    _ = self.shape  # validates max_new_tokens

  @property
  def shape(self) -> SpecShape:
    return SpecShape(self.gamma, self.max_new_tokens, self.top_k, self.eos_id, self.pad_id)

  @property
  def traced(self) -> dict:
    return dict(temperature=self.temperature, top_p=self.top_p, lenience=self.lenience)


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


def _per_row(value, batch: int, dtype) -> jax.Array:
  return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))


def _at_tokens(probs: jax.Array, tokens: jax.Array) -> jax.Array:
  """probs[B, g, V], tokens[B, g] -> probs[b, i, tokens[b, i]] as [B, g]."""
  return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def acceptance_probs(draft_tokens, draft_probs, target_probs, lenience=1.0, greedy=False):
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


def accept_with_uniforms(accept_uniforms, resample_uniform, draft_tokens, draft_probs, target_probs,
                         lenience=1.0, greedy=False):
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


def accept(rng, draft_tokens, draft_probs, target_probs, lenience=1.0, greedy=False):
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


def iteration_uniforms(rng: jax.Array, iteration, batch: int, gamma: int):
  """Every random number of loop iteration `iteration` (0-based), so a reference can replay the loop.

  Returns draft_uniforms[B, g], accept_uniforms[B, g], resample_uniform[B].
  """
  u = jax.random.uniform(jax.random.fold_in(rng, iteration + 1), (batch, 2 * gamma + 1))
  return u[:, :gamma], u[:, gamma:2 * gamma], u[:, 2 * gamma]


def draft(drafter, draft_params, draft_state, prev, last, pos, draft_uniforms, transform):
  """Draft gamma tokens per row: x_i = inverse-CDF(draft_uniforms[:, i], draft_probs_i).

  The first call feeds [prev, last] at positions [pos - 1, pos]: after an iteration that accepted
  every draft the drafter never saw x_gamma (now at pos - 1), and re-feeding an already cached token
  rewrites the same slot, so one static shape covers both cases. Later calls feed one token.
  Args: prev, last, pos [B] int32; draft_uniforms [B, g]; transform: logits[B, V] -> probs[B, V].
  Returns draft_tokens[B, g] int32, draft_probs[B, g, V], the drafter's new state.
  """
  probs, draft_state = drafter.propose(draft_params, draft_state, jnp.stack([prev, last], axis=1),
                                       jnp.stack([pos - 1, pos], axis=1), transform)
  token = sampling.sample_with_uniform(draft_uniforms[:, 0], probs)

  def step(carry, uniform):
    state, token, position = carry
    probs, state = drafter.propose(draft_params, state, token[:, None], position[:, None], transform)
    new = sampling.sample_with_uniform(uniform, probs)
    return (state, new, position + 1), (new, probs)

  (draft_state, _, _), (tokens, rest) = jax.lax.scan(step, (draft_state, token, pos + 1),
                                                     draft_uniforms[:, 1:].T)
  draft_tokens = jnp.concatenate([token[:, None], tokens.T], axis=1)
  draft_probs = jnp.concatenate([probs[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
  return draft_tokens, draft_probs, draft_state


@flax.struct.dataclass
class SpecStats:
  """Per row and iteration (I = max_new_tokens slots; the loop runs at most max_new_tokens - 1)."""
  num_accepted: jax.Array      # [B, I] int32 drafts accepted (raw n, before EOS / max_new cuts); -1 idle
  num_emitted: jax.Array       # [B, I] int32 tokens committed (after the cuts); 0 when idle
  acceptance_probs: jax.Array  # [B, I, g] float32 beta per drafted position (`acceptance_probs`);
  #                              meaningful where the position was reached: index i <= num_accepted

  @property
  def target_calls(self) -> jax.Array:
    """[B] verification calls each row took part in (prefill not counted)."""
    return jnp.sum(self.num_accepted >= 0, axis=-1)

  @property
  def draft_calls(self) -> jax.Array:
    """[B] drafter calls each row took part in (gamma per verification; drafter prefill not counted)."""
    return self.target_calls * self.acceptance_probs.shape[-1]


@flax.struct.dataclass
class SpecOutput:
  tokens: jax.Array         # [B, max_new_tokens] int32, pad_id past each row's end
  num_generated: jax.Array  # [B] int32, EOS included
  target_calls: jax.Array   # [] int32 target step calls after prefill (loop iterations)
  draft_calls: jax.Array    # [] int32 drafter calls after its prefill (gamma per iteration)
  stats: SpecStats


@flax.struct.dataclass
class LoopState:
  """The while_loop carry. Invariant at the top of an iteration, per row: `last` is the newest
  committed token, at position `pos`, not yet in the target cache (target length == pos); the drafter
  holds positions < pos - 1 and is re-fed [prev, last] at [pos - 1, pos]. Finished rows freeze pos, so
  their (ignored) writes stay inside the buffers."""
  iteration: jax.Array  # [] int32
  out: jax.Array        # [B, max_new + gamma + 1] committed tokens; the tail absorbs masked writes
  num: jax.Array        # [B] committed tokens
  done: jax.Array       # [B] bool
  last: jax.Array       # [B]
  prev: jax.Array       # [B] the token at pos - 1
  pos: jax.Array        # [B]
  target_cache: Any
  draft_state: Any
  stats: SpecStats


def replace_lengths(cache, lengths):
  """The default rollback: any cache with a `lengths[B]` field (kv_cache.set_lengths for ours)."""
  return cache.replace(lengths=lengths.astype(jnp.int32))


def _check_vocab(target_vocab, drafter, draft_params, draft_state, batch):
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  (draft_params, draft_state))
  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  probs = jax.eval_shape(lambda p, s, t: drafter.propose(p, s, t, t, lambda x: x)[0], *shapes, tokens)
  if probs.shape[-1] != target_vocab:
    raise ValueError(f"vocabulary sizes differ: the target has {target_vocab} tokens, the drafter "
                     f"{probs.shape[-1]}; speculative decoding needs one shared vocabulary")


def speculative_decode(target_step: StepFn, target_init_cache, drafter, shape: SpecShape,
                       target_params, draft_params, prompt_tokens, prompt_lengths, rng,
                       temperature=0.0, top_p=1.0, lenience=1.0, *,
                       set_lengths=replace_lengths) -> SpecOutput:
  """Decode up to shape.max_new_tokens tokens per row. Jit with `make_speculative_decode`.

  Args:
    target_step: the target's step function; target_init_cache: (batch, max_length) -> empty cache.
    drafter: a drafters.py drafter (init / propose / rollback); draft_params its params (or None).
    prompt_tokens: [B, P] int32, right-padded; prompt_lengths: [B] int32, each >= 1.
    rng: a PRNG key; temperature, top_p, lenience: traced scalars (temperature 0 = greedy).
    set_lengths: (cache, lengths[B]) -> cache, the target cache's rollback.
  Returns: SpecOutput (tokens[B, max_new_tokens], num_generated[B], call counts, SpecStats).
  """
  batch, prompt_len = prompt_tokens.shape
  gamma, max_new, pad = shape.gamma, shape.max_new_tokens, shape.pad_id
  max_length = prompt_len + max_new + gamma + 1  # kv_cache.required_length: verify writes never spill
  temperature = jnp.asarray(temperature, jnp.float32)
  lenience = jnp.asarray(lenience, jnp.float32)
  greedy = temperature == 0.0
  sampled = functools.partial(sampling.probs_from_logits, temperature=temperature,
                              top_k=shape.top_k, top_p=top_p)

  def transform(logits):  # = sampled(logits); the cond lets greedy decoding skip top-p's sort
    return jax.lax.cond(greedy, lambda x: sampling.probs_from_logits(x, 0.0), sampled, logits)

  prompt_lengths = prompt_lengths.astype(jnp.int32)
  rows = jnp.arange(batch)

  positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
  logits, target_cache = target_step(target_params, prompt_tokens, positions,
                                     target_init_cache(batch, max_length))
  target_cache = set_lengths(target_cache, prompt_lengths)
  draft_state = drafter.init(draft_params, prompt_tokens, prompt_lengths, max_length)
  _check_vocab(logits.shape[-1], drafter, draft_params, draft_state, batch)
  first = sampling.sample_with_uniform(
      first_token_uniform(rng, batch),
      transform(autoregressive.last_prompt_logits(logits, prompt_lengths)))

  stats = SpecStats(jnp.full((batch, max_new), -1, jnp.int32), jnp.zeros((batch, max_new), jnp.int32),
                    jnp.zeros((batch, max_new, gamma), jnp.float32))
  state = LoopState(
      iteration=jnp.int32(0),
      out=jnp.full((batch, max_new + gamma + 1), pad, jnp.int32).at[:, 0].set(first),
      num=jnp.ones((batch,), jnp.int32), done=autoregressive.is_eos(first, shape.eos_id) | (max_new == 1),
      last=first, prev=prompt_tokens[rows, prompt_lengths - 1].astype(jnp.int32), pos=prompt_lengths,
      target_cache=target_cache, draft_state=drafter.rollback(draft_state, prompt_lengths - 1),
      stats=stats)

  def cond(s: LoopState):
    return (s.iteration < max_new) & ~jnp.all(s.done)

  def body(s: LoopState) -> LoopState:
    draft_u, accept_u, resample_u = iteration_uniforms(rng, s.iteration, batch, gamma)
    # Alg. 1 lines 2-4: gamma draft steps.
    draft_tokens, draft_probs, draft_state = draft(drafter, draft_params, s.draft_state, s.prev,
                                                   s.last, s.pos, draft_u, transform)
    # Line 5: one target call on gamma + 1 positions.
    verify_tokens = jnp.concatenate([s.last[:, None], draft_tokens], axis=1)
    verify_positions = s.pos[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)
    logits, target_cache = target_step(target_params, verify_tokens, verify_positions,
                                       s.target_cache)
    target_probs = jax.lax.cond(greedy, greedy_target_probs, sampled, logits)
    # Lines 6-9: accepted prefix and the correction / bonus token.
    n, next_token = accept_with_uniforms(accept_u, resample_u, draft_tokens, draft_probs,
                                         target_probs, lenience, greedy)

    # Commit x_1..x_n, next_token; cut after EOS, at max_new_tokens, and for finished rows.
    j = jnp.arange(gamma + 1)[None, :]
    drafted = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)
    candidates = jnp.where(j < n[:, None], drafted, next_token[:, None])
    eos = autoregressive.is_eos(candidates, shape.eos_id) & (j <= n[:, None])
    before_eos = (jnp.cumsum(eos, axis=1) - eos) == 0  # up to and including the first EOS
    keep = ((j <= n[:, None]) & before_eos & (s.num[:, None] + j < max_new) & ~s.done[:, None])
    out = s.out.at[rows[:, None], s.num[:, None] + j].set(jnp.where(keep, candidates, pad))
    emitted = jnp.sum(keep, axis=1).astype(jnp.int32)
    num = s.num + emitted
    done = s.done | jnp.any(keep & eos, axis=1) | (num >= max_new)

    # Rollback (line 5's extra writes are dropped): slots < new pos hold committed tokens.
    go = ~done
    pos = jnp.where(go, s.pos + n + 1, s.pos)
    prev = jnp.where(n > 0, drafted[rows, jnp.maximum(n - 1, 0)], s.last)
    active = ~s.done
    stats = SpecStats(
        s.stats.num_accepted.at[:, s.iteration].set(jnp.where(active, n, -1)),
        s.stats.num_emitted.at[:, s.iteration].set(emitted),
        s.stats.acceptance_probs.at[:, s.iteration].set(jnp.where(
            active[:, None], acceptance_probs(draft_tokens, draft_probs, target_probs, lenience,
                                              greedy), 0.0)))
    return LoopState(
        iteration=s.iteration + 1, out=out, num=num, done=done,
        last=jnp.where(go, next_token, s.last), prev=jnp.where(go, prev, s.prev), pos=pos,
        target_cache=set_lengths(target_cache, pos),
        draft_state=drafter.rollback(draft_state, pos - 1), stats=stats)

  s = jax.lax.while_loop(cond, body, state)
  return SpecOutput(tokens=s.out[:, :max_new], num_generated=s.num, target_calls=s.iteration,
                    draft_calls=s.iteration * gamma, stats=s.stats)


def _validate_concrete(temperature, top_p, lenience) -> None:
  """Range checks for values known on the host (traced values cannot raise inside jit)."""
  try:
    values = [float(np.asarray(v)) for v in (temperature, top_p, lenience)]
  except (TypeError, jax.errors.ConcretizationTypeError):
    return
  sampling.validate_sampling(values[0], 0, values[1])
  validate_lenience(values[2])


def make_speculative_decode(target_step: StepFn, target_init_cache, drafter, shape,
                            *, set_lengths=replace_lengths, **jit_kwargs):
  """jit(speculative_decode) for one (target, drafter, shape); shape is a SpecShape or SpecConfig.

  Returns fn(target_params, draft_params, prompt_tokens[B, P], prompt_lengths[B], rng,
  temperature=0., top_p=1., lenience=1.) -> SpecOutput. The three floats are validated on the host
  and passed as float32 arrays, so any sweep over them reuses one compiled program (`fn.jitted` is the
  jax.jit object, e.g. for `_cache_size()`). Extra kwargs (in_shardings, ...) go to jax.jit.
  """
  if isinstance(shape, SpecConfig):
    shape = shape.shape
  jitted = jax.jit(functools.partial(speculative_decode, target_step, target_init_cache, drafter,
                                     shape, set_lengths=set_lengths), **jit_kwargs)

  def run(target_params, draft_params, prompt_tokens, prompt_lengths, rng, temperature=0.0,
          top_p=1.0, lenience=1.0) -> SpecOutput:
    _validate_concrete(temperature, top_p, lenience)
    as_f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return jitted(target_params, draft_params, prompt_tokens, prompt_lengths, rng,
                  as_f32(temperature), as_f32(top_p), as_f32(lenience))

  run.jitted = jitted
  return run
