"""The autoregressive baseline: prefill, then one token per target call in one jitted while_loop.

It is the denominator of every speedup, so it gets the same care as the speculative loop: static
shapes, no host round trips, the cache updated in place.

Conventions shared with the speculative loop (`core.py`):
  * Prompts are RIGHT-padded: prompt_tokens[B, P] with prompt_lengths[B]; row b's prompt sits at
    positions 0..len_b-1 and the padding after it is written to the cache during prefill but never
    read (the first generated token overwrites slot len_b; see kv_cache).
  * Output: tokens[B, max_new_tokens] with `pad_id` after each row's end, and num_generated[B]. A row
    ends after emitting `eos_id` (the EOS is kept and counted) or after max_new_tokens tokens.
  * The first new token comes from the prefill logits at each row's last prompt position.
  * The model is any `contracts.Model`. An encoder-decoder model gets its encoder input as `source`
    (encoded once) and its decoder start token as the prompt.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from specjax import contracts, validation
from specjax.decoding import sampling


@flax.struct.dataclass
class GenerateOutput:
  tokens: jax.Array         # [B, max_new_tokens] int32, pad_id past each row's end
  num_generated: jax.Array  # [B] int32, EOS included
  target_calls: jax.Array   # [] int32: step calls after prefill (loop iterations)
  # With DecodeShape.record_top_k = k (teacher data for distillation), the model's top-k log-probs
  # (temperature 1) as (log-probs, ids): at every prompt position [B, P, k], and after every new token
  # [B, max_new_tokens, k] (entry i: the distribution of the token after new token i). None otherwise.
  prompt_top_k: tuple | None = None
  new_top_k: tuple | None = None
  # With DecodeShape.record_features as well, the target's features (contracts.FeatureSpec) float16
  # at every prompt position [B, P, F] and at every new token [B, max_new_tokens, F] (entry i: new
  # token i's), what feature drafters train on. None otherwise.
  prompt_hidden: jax.Array | None = None
  new_hidden: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """What fixes the compiled shapes: changing any of these recompiles."""
  max_new_tokens: int
  top_k: int = 0
  eos_id: int | None = None
  pad_id: int = 0
  max_cache_length: int | None = None  # refuse prompts that would not fit (None: size to the prompt)
  record_top_k: int = 0  # > 0: also return the model's top-k log-probs everywhere (GenerateOutput)
  # with record_top_k: also these features everywhere (GenerateOutput)
  record_features: contracts.FeatureSpec | None = None

  def __post_init__(self):
    validate_decode(self.max_new_tokens, self.top_k)
    if self.record_features is not None and not self.record_top_k:
      raise ValueError("record_features rides on the teacher-data path: set record_top_k >= 1 too")


def validate_decode(max_new_tokens: int, top_k: int = 0) -> None:
  """The static settings every decode shares (this one and core.DecodeConfig)."""
  validation.whole_number(max_new_tokens, "max_new_tokens", 1, validation.MAX_POSITIONS,
                          fix="it bounds the tokens each prompt gets and sizes the cache")
  sampling.validate_sampling(0.0, top_k, 1.0)


def last_prompt_logits(logits: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
  """logits[B, P, V] of a right-padded prefill -> logits[B, V] at each row's last prompt token."""
  return jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]


def check_prompt_fits(prompt_length: int, cache_length: int, needed_after: int) -> None:
  if prompt_length + needed_after > cache_length:
    raise ValueError(
        f"prompt of {prompt_length} tokens plus {needed_after} more does not fit a cache of "
        f"{cache_length} slots; shorten the prompt, lower max_new_tokens, or raise max_cache_length")


def prefill(session: contracts.Session, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
            max_length: int) -> tuple[jax.Array, contracts.Cache]:
  """Score the right-padded prompt[B, P] into a fresh cache of max_length slots.

  Returns (logits[B, P, V], cache rolled back to each row's prompt length: the padding written after a
  shorter prompt is stale and the first new token overwrites it)."""
  logits, _, cache = _prefill(_without_hidden(session), session.init_cache, prompt_tokens,
                              prompt_lengths, max_length)
  return logits, cache


def _prefill(step, init_cache, prompt_tokens, prompt_lengths, max_length):
  """`prefill` with a step -> (logits, hidden states or None, cache)."""
  batch, prompt_len = prompt_tokens.shape
  positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
  logits, hidden, cache = step(prompt_tokens, positions, init_cache(batch, max_length))
  return logits, hidden, contracts.set_lengths(cache, prompt_lengths)


def _without_hidden(session: contracts.Session):
  """session.step as (tokens, positions, cache) -> (logits, None, cache)."""
  def step(tokens, positions, cache):
    logits, cache = session.step(tokens, positions, cache)
    return logits, None, cache
  return step


def _with_features(model, params, context, features: contracts.FeatureSpec):
  """A model's step as (tokens, positions, cache) -> (logits, features float16, cache)."""
  def step(tokens, positions, cache):
    logits, tapped, cache = model.forward(params, context, tokens, positions, cache,
                                          features=features)
    return logits, tapped.astype(jnp.float16), cache
  return step


def generate(model: contracts.Model, shape: DecodeShape, params, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, rng: jax.Array, temperature=0.0, top_p=1.0,
             source: contracts.Source | None = None) -> GenerateOutput:
  """Decode up to shape.max_new_tokens tokens for every row. Jit with `make_generate`.

  Args:
    model: a contracts.Model (decoder-only or encoder-decoder).
    prompt_tokens: [B, P] int32, right-padded. prompt_lengths: [B] int32, each >= 1.
    rng: a PRNG key, or one per row ([B, 2]: each row draws from its own, whatever its batch).
    temperature, top_p: traced scalars (0 = greedy), so a sweep over them compiles once.
    source: the encoder input of an encoder-decoder model (None for decoder-only).
  """
  batch, prompt_len = prompt_tokens.shape
  max_new = shape.max_new_tokens
  if shape.max_cache_length is not None:
    check_prompt_fits(prompt_len, shape.max_cache_length, max_new + 1)
  contracts.check_source(model, source)
  context = model.encode(params, source)
  session = contracts.bind_session(model, params, context)
  step = (_with_features(model, params, context, shape.record_features)
          if shape.record_features is not None else _without_hidden(session))
  logits, prompt_hidden, cache = _prefill(step, session.init_cache, prompt_tokens, prompt_lengths,
                                          prompt_len + max_new + 1)
  k = shape.record_top_k
  # Recorded distributions (and hidden states) ride in the loop carry only when asked for; the
  # baseline carries nothing.
  records = (jnp.zeros((batch, max_new, k), jnp.float32),
             jnp.zeros((batch, max_new, k), jnp.int32)) if k else ()
  if shape.record_features is not None:
    records += (jnp.zeros((batch, max_new, prompt_hidden.shape[-1]), jnp.float16),)
  prompt_top_k = _top_k_logp(logits, k) if k else None
  probs_fn = functools.partial(sampling.probs_from_logits, temperature=temperature,
                               top_k=shape.top_k, top_p=top_p)
  rng, first_rng = sampling.split(rng)  # one key, or one per row (sampling.per_row)
  first = sampling.sample(first_rng, probs_fn(last_prompt_logits(logits, prompt_lengths)))
  out = jnp.full((batch, max_new), shape.pad_id, jnp.int32).at[:, 0].set(first)
  done = is_eos(first, shape.eos_id) | (max_new == 1)
  num = jnp.ones((batch,), jnp.int32)

  def cond(state):
    i, _, _, done, _, _, _ = state
    return (i < max_new) & ~jnp.all(done)

  def body(state):
    i, out, num, done, cache, rng, records = state
    rng, draw_rng = sampling.split(rng)
    last = out[:, i - 1]
    pos = (prompt_lengths + i - 1).astype(jnp.int32)[:, None]
    logits, hidden, cache = step(last[:, None], pos, cache)
    if k:
      records = tuple(r.at[:, i - 1].set(x) for r, x in zip(records, _recorded(logits, hidden, k)))
    token = sampling.sample(draw_rng, probs_fn(logits[:, 0]))
    token = jnp.where(done, shape.pad_id, token)
    out = out.at[:, i].set(token)
    num = num + (~done).astype(jnp.int32)
    done = done | is_eos(token, shape.eos_id) | (i + 1 >= max_new)
    return i + 1, out, num, done, cache, rng, records

  i, out, num, _, cache, _, records = jax.lax.while_loop(
      cond, body, (jnp.int32(1), out, num, done, cache, rng, records))
  if not k:
    return GenerateOutput(out, num, i - 1)
  # One more step for the distribution after each row's last token (its final position's teacher).
  last = jnp.take_along_axis(out, (num - 1)[:, None], axis=1)
  final, hidden, _ = step(last, (prompt_lengths + num - 1).astype(jnp.int32)[:, None], cache)
  rows = jnp.arange(batch)
  records = tuple(r.at[rows, num - 1].set(x) for r, x in zip(records, _recorded(final, hidden, k)))
  return GenerateOutput(out, num, i - 1, prompt_top_k=prompt_top_k, new_top_k=tuple(records[:2]),
                        prompt_hidden=prompt_hidden, new_hidden=records[2] if hidden is not None
                        else None)


def _recorded(logits, hidden, k):
  """One step's records from its logits[B, 1, V] (and hidden states [B, 1, E] or None): [B, ...] each."""
  return tuple(_top_k_logp(logits[:, 0], k)) + ((hidden[:, 0],) if hidden is not None else ())


def _top_k_logp(logits, k):
  """(log-probs, ids) of the k most likely tokens at temperature 1."""
  return jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), k)


def is_eos(token: jax.Array, eos_id: int | None) -> jax.Array:
  """token[...] -> bool[...]; all False when there is no EOS (eos_id None)."""
  if eos_id is None:
    return jnp.zeros(token.shape, bool)
  return token == eos_id


def make_generate(model: contracts.Model, shape: DecodeShape, **jit_kwargs):
  """jit(generate) for one (model, shape): call as fn(params, prompt_tokens, prompt_lengths, rng,
  temperature, top_p, source=None). Extra kwargs (in_shardings, ...) go to jax.jit."""
  return jax.jit(functools.partial(generate, model, shape), **jit_kwargs)
