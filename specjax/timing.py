"""How long decoding takes, timed the way the benchmarks and sweeps share: passes over prompts, the
loop's cost per iteration fitted over them, prefills, single steps chained as the loop runs them,
and one iteration's parts (draft, verify, accept) of the chain and of the tree loop.

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

from specjax import contracts, speculative, trees
from specjax.decoding import autoregressive, sampling


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


def time_prompts(run_one, prompts, repeats: int, warmup: int) -> tuple[np.ndarray, list]:
  """Each prompt's wall time, the median over `repeats` passes over all prompts (after `warmup`
  untimed runs on the first prompt); run_one must block. Returns (seconds[N], the last pass's
  outputs)."""
  for _ in range(warmup):
    run_one(*prompts[0])
  passes, outputs = [], []
  for _ in range(repeats):
    outputs.clear()
    times = []
    for prompt in prompts:
      start = time.perf_counter()
      outputs.append(run_one(*prompt))
      times.append(time.perf_counter() - start)
    passes.append(times)
  return np.median(np.asarray(passes), axis=0), outputs


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


def prefill_seconds(target: contracts.Model, drafter, target_params, draft_params,
                    prompt: tuple[jax.Array, jax.Array], max_length: int, repeats: int,
                    source: contracts.Source | None = None) -> float:
  """Median time of the work before the first token: the target's prefill (+ the drafter's init, when
  a drafter is given), the source's encoding included."""
  def prefill(tp, dp, tokens, lengths, source):
    session = contracts.open_session(target, tp, source)
    out = autoregressive.prefill(session, tokens, lengths, max_length)
    return out if drafter is None else (out, drafter.init(dp, tokens, lengths, max_length, source))
  compiled = jax.jit(prefill).lower(target_params, draft_params, *prompt, source).compile()
  return median_seconds(lambda: jax.block_until_ready(
      compiled(target_params, draft_params, *prompt, source)), repeats)[0]


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


def tree_cost_timer(model: contracts.Model, params, drafter, draft_params, tree, prompt,
                    max_length: int, parts=("draft", "verify", "accept"), source=None):
  """time_parts(temperature, repeats, rounds) -> {part: ms} of one tree iteration's `parts` at batch 1
  after `prompt` (trees.py), each timed like `step_seconds`: `draft` the drafter's candidates for the
  whole tree, `verify` the target scoring the T nodes with the tree mask, `accept` the transform at
  every node (temperature traced, as in the loop), the walk and the cache compaction. Compiled on the
  first call and reused, so a sweep can time the parts again beside each point it measures.

  Every input a part reads (hidden state, history, node logits) rides in the timed loop's state behind
  a select on the step counter that XLA cannot resolve: inputs that stay the same from step to step
  let XLA hoist the whole part out of the timed loop as loop-invariant code, which it did here (a
  stateless drafter's candidates and the walk were computed once per call, not once per step)."""
  tokens, lengths = prompt
  history = jnp.zeros((1, max_length), jnp.int32).at[:, :tokens.shape[1]].set(tokens)
  context = jax.jit(model.encode)(params, source)  # an encoder-decoder target's encoded source
  logits, hidden, cache = model.feature_step(
      params, context, tokens, jnp.arange(tokens.shape[1], dtype=jnp.int32)[None],
      model.init_cache(1, max_length))
  cache = contracts.set_lengths(cache, lengths)
  features = hidden[:, -1].astype(jnp.float32)
  probe = one_token(prompt)
  node_inputs = trees.attention_inputs(tree, lengths, max_length)
  node_logits = jnp.broadcast_to(logits[:, -1:], (1, tree.size, logits.shape[-1]))
  steps = jnp.arange(1, tree.depth + 1, dtype=jnp.int32)

  def draft(params, state, _tokens, _positions):
    drafter_state, features, history, step = state
    candidates, drafter_state = drafter.candidates(
        params, drafter_state, varying(step, history), lengths - 1, varying(step, features),
        tree.depth, tree.width)
    return candidates, (drafter_state, features, history, step + 1)

  def verify(inputs, state, tokens, _positions):
    (params, context), (cache, step) = inputs, state
    node_tokens = varying(step, jnp.broadcast_to(tokens[:, :1], (1, tree.size)))
    logits, _, new_cache = model.feature_step(params, context, node_tokens, node_inputs[0], cache,
                                              *node_inputs[1:])
    return jnp.argmax(logits, axis=-1), (contracts.set_lengths(new_cache, cache.lengths), step + 1)

  def accept(temperature, state, tokens, _positions):
    node_logits, cache, step = state
    node_tokens = varying(step, jnp.broadcast_to(tokens[:, :1], (1, tree.size)))
    uniforms = jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(0), step),
                                  (1, tree.depth + 1))
    probs = sampling.probs_from_logits(varying(step, node_logits), temperature)
    path, accepted, next_token, betas = trees.walk(tree, node_tokens, probs, uniforms)
    cache = model.move_cache(cache, lengths[:, None] + path[:, 1:], lengths[:, None] + steps)
    return next_token + accepted + jnp.sum(betas > 0.5), (node_logits, cache, step + 1)

  zero = jnp.zeros((), jnp.int32)
  timers = {part: chained_timer(fn) for part, fn in
            (("draft", draft), ("verify", verify), ("accept", accept)) if part in parts}
  states = {"draft": lambda: (drafter.init(draft_params, tokens, lengths, max_length, source),
                              features, history, zero),
            "verify": lambda: (cache, zero), "accept": lambda: (node_logits, cache, zero)}

  def time_parts(temperature: float, repeats: int, rounds: int = 1) -> dict[str, float]:
    inputs = {"draft": draft_params, "verify": (params, context),
              "accept": jnp.float32(temperature)}
    # The timers donate their state: each gets a fresh copy.
    return {part: 1000 * timed_rounds(timers[part], inputs[part],
                                      jax.tree_util.tree_map(jnp.copy, states[part]()), *probe,
                                      repeats, rounds) for part in parts}
  return time_parts


def chain_step_costs(model: contracts.Model, params, drafter, draft_params, config, prompt,
                     repeats: int, temperatures=(0.0,), source=None,
                     parts=("draft", "verify", "accept")) -> dict:
  """ms of one speculative iteration's parts at batch 1 after `prompt` ({temperature: {part: ms}}),
  each the median of 3 medians of `repeats` (`chain_cost_timer`, compiled once for all temperatures).
  verify and accept do not depend on the drafter: time them once per gamma where the machine is quiet."""
  time_parts = chain_cost_timer(model, params, drafter, draft_params, config, prompt, source, parts)
  return {float(t): time_parts(t, repeats, rounds=3) for t in temperatures}


def chain_cost_timer(model: contracts.Model, params, drafter, draft_params, config, prompt,
                     source=None, parts=("draft", "verify", "accept")):
  """time_parts(temperature, repeats, rounds) -> {part: ms} for one speculative iteration's `parts`
  at batch 1 after `prompt`, as speculative_decode runs them with `config` (a speculative.SpecConfig):
  `draft` = speculative.draft (gamma drafter calls with transform and sampling), `verify` =
  speculative.verify (the target scoring gamma + 1 tokens, transform included), `accept` =
  speculative.settle (accept, commit, statistics, roll back). Their sum is one iteration; Thm 3.8
  counts only the first two, and for a sub-millisecond target the third is not negligible. Each part
  is timed like `step_seconds` (the median over `rounds` of medians of `repeats`), its inputs varied
  per step (`varying`). Compiled on the first call and reused by every later one (the temperature is
  traced, as in the loop), so a sweep can time the parts again beside each point it measures."""
  tokens, lengths = map(jnp.asarray, prompt)
  rng, gamma = jax.random.PRNGKey(0), config.gamma

  def transforms(temperature):
    return speculative.transforms(temperature, jnp.float32(1.0), config.top_k)

  @jax.jit
  def start(params, draft_params, temperature, source):
    context = model.encode(params, source)
    transform, target_transform = transforms(temperature)
    session = contracts.bind_session(model, params, context)
    s = speculative.initial_state(session, drafter, draft_params, config, tokens, lengths, rng,
                                  transform, source)
    if tuple(parts) == ("draft",):  # the draft's own inputs are in the state
      return context, s, None
    draft_uniforms = speculative.iteration_uniforms(rng, 0, 1, gamma)[0]
    draft_tokens, draft_probs, _ = speculative.draft(drafter, draft_params, s.draft_state,
                                                     s.prev_token, s.last_token, s.position,
                                                     draft_uniforms, transform)
    target_probs, _ = speculative.verify(session, s.target_cache, s.last_token, s.position,
                                         draft_tokens, target_transform)
    return context, s, (draft_tokens, draft_probs, target_probs)

  def draft(inputs, state, _tokens, _positions):
    (draft_params, temperature, s), (draft_state, step) = inputs, state
    prev, last, position = varying(step, (s.prev_token, s.last_token, s.position))
    drafted, _, draft_state = speculative.draft(
        drafter, draft_params, draft_state, prev, last, position,
        speculative.iteration_uniforms(rng, step, 1, gamma)[0], transforms(temperature)[0])
    return drafted, (draft_state, step + 1)

  def verify(inputs, state, _tokens, _positions):
    (params, context, temperature, s, drafted), (cache, step) = inputs, state
    last, position, drafted = varying(step, (s.last_token, s.position, drafted))
    session = contracts.bind_session(model, params, context)
    probs, cache = speculative.verify(session, cache, last, position, drafted,
                                      transforms(temperature)[1])
    return jnp.argmax(probs, axis=-1), (contracts.set_lengths(cache, s.position), step + 1)

  def accept(inputs, state, _tokens, _positions):
    (temperature, drafted), (s, step) = inputs, state
    _, accept_uniforms, resample_uniform = speculative.iteration_uniforms(rng, step, 1, gamma)
    s = speculative.settle(s, drafter, config, *varying(step, drafted), s.target_cache, s.draft_state,
                           accept_uniforms, resample_uniform, jnp.float32(1.0), temperature == 0.0)
    return s.num_committed, (s, step + 1)

  fresh = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)  # the timers donate their state
  timers = {part: chained_timer(fn) for part, fn in
            (("draft", draft), ("verify", verify), ("accept", accept)) if part in parts}
  probe, zero = one_token(prompt), jnp.zeros((), jnp.int32)

  def time_parts(temperature: float, repeats: int, rounds: int = 1) -> dict[str, float]:
    t = jnp.float32(temperature)
    context, s, drafted = start(params, draft_params, t, source)
    inputs_and_state = {"draft": ((draft_params, t, s), (s.draft_state, zero)),
                        "verify": ((params, context, t, s, drafted[0] if drafted else None),
                                   (s.target_cache, zero)),
                        "accept": ((t, drafted), (s, zero))}
    ms = {}
    for part in parts:
      inputs, state = inputs_and_state[part]
      ms[part] = 1000 * timed_rounds(timers[part], inputs, fresh(state), *probe, repeats, rounds)
    return ms
  return time_parts
