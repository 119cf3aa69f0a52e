"""How long decoding takes, timed the way the benchmarks and sweeps share: the loop's cost per
iteration fitted over prompts, the work before the first token, single steps chained as
the loop runs them, and one iteration's parts (draft, verify, accept): the very methods of the loop
(decoding/core.py: Loop), whatever the drafter and its tree.

Timing conventions: compile ahead of time, outside the timed region; warm each compiled program up (its
first run is slower); block on results; report medians of repeated runs. Step costs (c = draft step /
target step, and v = the target scoring T tokens / scoring 1) are timed as the loop runs them: jitted,
with the cache donated and threaded through, transform and sampling included.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import contracts
from specjax.decoding import acceptance, autoregressive, core, sampling


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1
                   ) -> tuple[float, list[float]]:
  """Median wall time of fn() over `repeats` runs after `warmup` untimed runs; fn must block."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def read_bandwidth_gbps(megabytes: int = 512, repeats: int = 7) -> float:
  """Read bandwidth of the default device as XLA sees it (the floor of a decode step is its weights'
  bytes over this): a sum over a buffer far larger than the caches, chained as `chained_timer`
  chains steps. A single jitted sum per call would count a dispatch per pass: on an accelerator
  that reads 512 MB in about a tenth of a millisecond, the dispatch would be most of the time. Each
  pass sums the buffer times the pass's number, so XLA cannot hoist the sum out of the loop
  (`varying`'s select ran at 1.5 GB/s on XLA:CPU where a product fused into the sum reads at the
  plain sum's 23-25 GB/s)."""
  data = jnp.ones((megabytes * 1024 * 1024 // 4,), jnp.float32)

  def read(data, step, _tokens, _positions):
    total = jnp.sum(data * (step + 1).astype(data.dtype))
    return (total > 0).astype(jnp.int32), step + 1
  seconds = step_seconds(read, data, jnp.zeros((), jnp.int32), None, None, repeats)
  return data.nbytes / seconds / 1e9


def loop_seconds(seconds, iterations, min_spread: int = 4, max_relative_error: float = 0.25
                 ) -> tuple[float, float] | None:
  """(seconds per loop iteration, fixed seconds per prompt) by least squares over prompts:
  seconds_i = fixed + per_iteration * iterations_i. The fixed part is everything a decode call pays
  once (prefill, the drafter's init, dispatch, copying the outputs back), which subtracting a prefill
  timed apart leaves partly in, so a prompt that stops early at EOS would read as slower per token.
  None when the prompts' iteration counts spread by less than `min_spread` (the two parts cannot be
  told apart) or when the fit leaves the per-iteration cost uncertain: its standard error over
  `max_relative_error` of it, or the cost not positive (one pass over 8 prompts once fitted 5.7 ms
  per iteration and 4.7 s per prompt to a loop of about 100 ms per iteration)."""
  n = np.asarray(iterations, np.float64)
  if len(n) < 3 or n.max() - n.min() < min_spread:
    return None
  t = np.asarray(seconds, np.float64)
  per_iteration, fixed = np.polyfit(n, t, 1)
  residuals = t - (fixed + per_iteration * n)
  standard_error = math.sqrt(residuals @ residuals / (len(n) - 2) / np.sum((n - n.mean()) ** 2))
  if per_iteration <= 0 or standard_error > max_relative_error * per_iteration:
    return None
  return float(per_iteration), float(fixed)


def start_seconds(target: contracts.Model, drafter, config, target_params, draft_params,
                  prompt: tuple[jax.Array, jax.Array], repeats: int,
                  source: contracts.Source | None = None) -> float:
  """Median time of the work before the first token: the source's encoding and the target's prefill,
  with the drafter's init and the first token (core.Loop.start) when a drafter is given (`config`:
  its core.DecodeConfig), else the baseline's prefill of max_new_tokens + 1 slots after the prompt."""
  tokens, lengths = prompt

  def start(tp, dp, tokens, lengths, source):
    if drafter is None:
      session = contracts.open_session(target, tp, source)
      return autoregressive.prefill(session, tokens, lengths,
                                    tokens.shape[1] + config.max_new_tokens + 1)
    return _loop(target, drafter, config, tp, dp, target.encode(tp, source),
                 jnp.float32(0.0)).start(tokens, lengths, source)
  compiled = jax.jit(start).lower(target_params, draft_params, tokens, lengths, source).compile()
  return median_seconds(lambda: jax.block_until_ready(
      compiled(target_params, draft_params, tokens, lengths, source)), repeats)[0]


def chained_timer(step_fn, steps_per_call: int = 1, min_call_seconds: float = 0.02):
  """timer(params, state, tokens, positions, repeats) -> (median seconds of one step, final state):
  at least `steps_per_call` steps of step_fn(params, state, tokens, positions) -> (out, state)
  chained inside one jitted loop (the state donated and threaded through, no cache copies), the
  call's time divided by them. Timing single jitted calls instead adds a dispatch (~0.1-0.3 ms here)
  to every step, which the loop never pays: for a sub-millisecond draft it would count more than the
  step itself and push c towards 1. The step count is traced: a step so short that a call would take
  under `min_call_seconds` gets more steps per call (calls of a few ms moved by 20-40 % from one to
  the next on this shared machine), while a step that long already runs alone (a 60 ms verification
  chained 8 times made every timed point of a sweep cost seconds). Compiled once per timer, so traced
  params (a temperature) reuse it."""

  def chained(params, state, tokens, positions, steps):
    def body(_, carry):
      state, total = carry
      out, state = step_fn(params, state, tokens, positions)
      return state, total + jnp.sum(out)  # keeps every step's output live
    return jax.lax.fori_loop(0, steps, body, (state, jnp.zeros((), jnp.int32)))

  fn = jax.jit(chained, donate_argnums=1)

  def timer(params, state, tokens, positions, repeats: int):
    def call(state, steps):
      start = time.perf_counter()
      state, _ = jax.block_until_ready(fn(params, state, tokens, positions, jnp.int32(steps)))
      return state, time.perf_counter() - start
    # Warmed up and sized again on every call (round): sizing once per timer left one T5 sweep's
    # parts at 2-3x their time (accept 0.5 ms against 0.07-0.14), as if a slow sizing call had fixed
    # the calls at a step or two each, so per-call dispatch counted into every step.
    state, _ = call(state, steps_per_call)  # compile + warm up
    steps = steps_per_call
    for _ in range(3):  # a call of very few short steps is mostly dispatch: grow it in turn
      state, seconds = call(state, steps)
      if seconds >= min_call_seconds or steps >= 256:
        break
      steps = min(256, math.ceil(steps * min_call_seconds / seconds))
    times = []
    for _ in range(repeats):
      state, seconds = call(state, steps)
      times.append(seconds / steps)
    return statistics.median(times), state
  return timer


def step_seconds(step_fn, params, state, tokens: jax.Array, positions: jax.Array,
                 repeats: int, steps_per_call: int = 1, rounds: int = 1) -> float:
  """Median wall time of one step_fn(params, state, tokens, positions) -> (out, state) as the loop
  runs it (`chained_timer`), or the median over `rounds` such medians of one compiled timer (single
  medians of a 40 ms step moved by 20 % here). The state is donated."""
  return timed_rounds(chained_timer(step_fn, steps_per_call), params, state, tokens, positions,
                      repeats, rounds)


def timed_rounds(timer, params, state, tokens, positions, repeats: int, rounds: int) -> float:
  """The median over `rounds` of a `chained_timer`'s median, the state threaded from round to round."""
  medians = []
  for _ in range(rounds):
    seconds, state = timer(params, state, tokens, positions, repeats)
    medians.append(seconds)
  return statistics.median(medians)


def _sampled(logits: jax.Array) -> jax.Array:
  return sampling.probs_from_logits(logits, 1.0)


def draft_step(drafter):
  """One draft step as the loop runs it: propose (transform included), then sample the token."""
  def fn(params, state, tokens, positions):
    probs, state = drafter.propose(params, state, tokens, positions, _sampled)
    return sampling.sample_with_uniform(jnp.full(probs.shape[:-1], 0.5), probs), state
  return fn


def target_step(model: contracts.Model):
  """The target scoring T tokens as verification does: step, transform at every position, sample the
  last. Its state is a drafters.ModelDrafter(model) state (the model's context and cache)."""
  def fn(params, state, tokens, positions):
    logits, cache = model.decode_step(params, state.context, tokens, positions, state.cache)
    probs = _sampled(logits)
    return sampling.sample_with_uniform(jnp.full(probs.shape[:1], 0.5), probs[:, -1]), \
        state.replace(cache=cache)
  return fn


def forward_step(model: contracts.Model):
  """The target's forward on T tokens with the argmax at every position (what a greedy
  verification reads; it keeps every position's logits live): a step before any sampling
  transform, the part of verification the roofline bounds. Same state as `target_step`."""
  def fn(params, state, tokens, positions):
    logits, cache = model.decode_step(params, state.context, tokens, positions, state.cache)
    return jnp.sum(sampling.argmax(logits), axis=-1).astype(jnp.int32), \
        state.replace(cache=cache)
  return fn


def one_token(prompt: tuple[jax.Array, jax.Array], width: int = 1) -> tuple[jax.Array, jax.Array]:
  """tokens[1, width] (the last prompt token repeated) at the positions right after the prompt."""
  tokens, lengths = prompt
  last = int(tokens[0, int(lengths[0]) - 1])
  return (jnp.full((1, width), last, jnp.int32),
          jnp.asarray(int(lengths[0]) + np.arange(width), jnp.int32)[None])


def varying(step: jax.Array, value):
  """`value`, through a select XLA cannot resolve at compile time (step is never negative): inputs
  that stay the same from step to step let XLA hoist a timed part out of the timed loop as
  loop-invariant code."""
  return jax.tree_util.tree_map(lambda x: jnp.where(step < 0, x + 1, x), value)


PARTS = ("draft", "verify", "accept")


def _loop(target, drafter, config, params, draft_params, context, temperature) -> core.Loop:
  settings = acceptance.Settings(temperature, jnp.float32(1.0), jnp.float32(1.0), config.top_k)
  return core.Loop(target, drafter, config, params, draft_params, context, settings,
                   jax.random.PRNGKey(0))


def iteration_timer(target: contracts.Model, params, drafter, draft_params, config, prompt,
                    source=None, parts=PARTS):
  """time_parts(temperature, repeats, rounds) -> {part: ms} of one loop iteration's `parts` at batch
  1 after `prompt`, timing the very methods the loop calls (core.Loop): `draft` (the drafter's
  proposal, with its transform and sampling), `verify` (the target scoring the tree's T nodes) and
  `accept` (Loop.settle: the rule with its transform, the commit, the cache's compaction and
  rollback, the features kept, the statistics). Their sum is one iteration; Thm 3.8 counts only the
  first two, and for a sub-millisecond target the third is not negligible. Each part is timed like
  `step_seconds` (the median over `rounds` of medians of `repeats`), its inputs varied per step
  (`varying`). Compiled on the first call and reused by every later one (the temperature is traced,
  as in the loop), so a sweep can time the parts again beside each point it measures."""
  tokens, lengths = map(jnp.asarray, prompt)

  @jax.jit
  def start(params, draft_params, temperature, source):
    context = target.encode(params, source)
    loop = _loop(target, drafter, config, params, draft_params, context, temperature)
    s = loop.start(tokens, lengths, source)
    uniforms = loop.uniforms(s)
    proposal, draft_state = loop.draft(s, uniforms)
    return context, s, uniforms, proposal, draft_state, loop.verify(s, proposal)

  def draft(inputs, state, _tokens, _positions):
    (params, draft_params, context, temperature, s), (draft_state, step) = inputs, state
    loop = _loop(target, drafter, config, params, draft_params, context, temperature)
    s = varying(step, s).replace(draft_state=draft_state, iteration=step)
    proposal, draft_state = loop.draft(s, loop.uniforms(s))
    return proposal.tokens, (draft_state, step + 1)

  def verify(inputs, state, _tokens, _positions):
    (params, draft_params, context, temperature, s, proposal), (cache, step) = inputs, state
    loop = _loop(target, drafter, config, params, draft_params, context, temperature)
    verified = loop.verify(varying(step, s).replace(target_cache=cache), varying(step, proposal))
    return (sampling.argmax(verified.logits),
            (contracts.set_lengths(verified.cache, s.target_cache.lengths), step + 1))

  def accept(inputs, state, _tokens, _positions):
    (params, draft_params, context, temperature, uniforms, proposal, verified,
     draft_state), (s, step) = inputs, state
    loop = _loop(target, drafter, config, params, draft_params, context, temperature)
    # The verification's cache is the one threaded through (as in the loop, where settle updates
    # the cache verify just wrote, in place): a fixed input cache, or one put through `varying`,
    # would be copied whole in every step and counted as the accept step's.
    proposal, logits, features, uniforms = varying(step, (proposal, verified.logits,
                                                          verified.features, uniforms))
    verified = core.Verified(logits, features, s.target_cache)
    s = loop.settle(s, proposal, verified, uniforms, draft_state)
    return s.num_committed, (s, step + 1)

  timers = {part: chained_timer(fn) for part, fn in
            (("draft", draft), ("verify", verify), ("accept", accept)) if part in parts}
  probe, zero = one_token(prompt), jnp.zeros((), jnp.int32)
  fresh = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)  # the timers donate their state

  def time_parts(temperature: float, repeats: int, rounds: int = 1) -> dict[str, float]:
    t = jnp.float32(temperature)
    context, s, uniforms, proposal, draft_state, verified = start(params, draft_params, t, source)
    inputs_and_state = {
        "draft": ((params, draft_params, context, t, s), (s.draft_state, zero)),
        "verify": ((params, draft_params, context, t, s, proposal), (s.target_cache, zero)),
        "accept": ((params, draft_params, context, t, uniforms, proposal, verified, draft_state),
                   (s, zero))}
    ms = {}
    for part in parts:
      inputs, state = inputs_and_state[part]
      ms[part] = 1000 * timed_rounds(timers[part], inputs, fresh(state), *probe, repeats, rounds)
    return ms
  return time_parts


def iteration_costs(target: contracts.Model, params, drafter, draft_params, config, prompt,
                    repeats: int, temperatures=(0.0,), source=None, parts=PARTS) -> dict:
  """ms of one loop iteration's parts at batch 1 after `prompt` ({temperature: {part: ms}}), each the
  median of 3 medians of `repeats` (`iteration_timer`, compiled once for all temperatures). verify
  and accept hardly depend on the drafter: time them once per tree where the machine is quiet."""
  time_parts = iteration_timer(target, params, drafter, draft_params, config, prompt, source, parts)
  return {float(t): time_parts(t, repeats, rounds=3) for t in temperatures}
