"""How both sweeps measure a point: the autoregressive baseline and the speculative loop side by side in
this process, on the same held-out prompts (batch 1 each, padded to one length per task; each prompt
its own random key, the same for both runs), with one loop iteration's parts timed beside them.

`Bench` holds what every point shares: the target, the prompts by task, the drafters by (name, tree,
sampling), their compiled programs and part timers, and the work before the first token.
`measure(bench, task, drafter, temperature, lenience)` times one point and returns what both sweeps
report; each sweep adds its own columns (speculative_sweep.py: c, v and Thm 3.8; tree_sweep.py:
acceptance by depth).

ms per token is end to end (prefill included) over the tokens each run emitted (EOS on), so greedy
points compare identical token streams and sampled points compare per-token costs. Decode ms per
token leaves out what each prompt pays once (Thm 3.8 models decoding only): every prompt is timed,
and the loop's cost per iteration is fitted over the prompts where the fit pins it down to 5 %
(`paired_decode_seconds`, both sides of a ratio by the same method); elsewhere each side's work
before the first token, timed apart, is subtracted from its prompts' times.

The two sides run side by side prompt by prompt (`side_by_side`): each prompt is decoded by the
baseline and by the loop one after the other, the order alternating, with the loop's parts timed at
three places in every pass. Timing whole passes in turn let a slow stretch of this shared machine
fall on one side: SmolLM2's end-to-end ratio over one point's passes read 1.67-1.79 in turn and
1.67-1.74 prompt by prompt.
"""

from __future__ import annotations

import time
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from specjax import loading, metrics, models, specs, timing, validation
from specjax.data import prompts as prompt_sets
from specjax.decoding import autoregressive, core, sampling
from specjax.decoding.tree import Tree
from specjax.drafters import registry

# How a row is drawn and timed, in the spec (so in the fingerprint) of both sweeps: a directory whose
# rows were measured another way is refused rather than resumed into one table with new rows. Change it
# whenever a change to the keys or the timing would make old and new rows disagree.
MEASUREMENT = ("each prompt its own key from (seed, task, prompt id); baseline and decode side by side "
               "prompt by prompt, alternating, the loop's own parts (draft, verify, settle) timed "
               "three times a pass; both sides of a speedup by one method; loop fits refused beyond "
               "a standard error of 1/20, else the start (median of 9) subtracted")

# How the passes of a point are timed, for the headers of the benchmarks' tables.
PASSES = "side by side with the baseline's prompt by prompt, the parts timed three times a pass"

# Prompts a side needs before its loop cost is fitted rather than its prefill subtracted.
MIN_FIT_PROMPTS = 8
# The largest standard error, relative to the per-iteration cost, of a fit that is used. Most of
# SmolLM2's prompts run within 15 iterations of each other on a side, and fits to them with standard
# errors of 5-13 % (a quarter was the limit before) read the fixed cost per prompt as 62-305 ms where
# the start took 140-170: a point's decode speedup read 1.07-1.26 over four passes by the fit,
# 1.10-1.14 with the start subtracted. A fit that pins its cost down is still used: a T5 decode call
# pays 4-9 ms once, several times its prefill, which subtracting the prefill leaves in.
MAX_FIT_ERROR = 0.05

# Runs of the work before the first token behind each side's start time (a median of 5 moved by
# 10-20 ms in 150 here, an error that each of a point's prompts repeats).
START_REPEATS = 9


class Prompt(NamedTuple):
  """One batch-1 decode: prompt_tokens[1, P], prompt_lengths[1], the source (None for a decoder-only
  target) and the prompt's own random key, which the baseline and every drafter's run of it share."""
  tokens: jax.Array
  lengths: jax.Array
  source: object
  key: jax.Array


def prompt_keys(rng: jax.Array, task: str, ids) -> list[jax.Array]:
  """One key per prompt of a task, folded from the sweep's seed with the task's name and the prompt's
  id (sampling.prompt_key, as generation does): with one key for all, every prompt drew from the
  same uniforms (their sampled acceptances moved together, and one small first uniform drew
  SmolLM2's low-id EOS for every prompt at once); by id, a prompt draws the same whatever else ran."""
  task_key = jax.random.fold_in(rng, zlib.crc32(task.encode()) % (2 ** 31))
  return [sampling.prompt_key(task_key, key) for key in ids]


# The longest prompt a sweep pads to (its prompts run at batch 1, one padded length per task).
MAX_PROMPT_LENGTH = 1024


def task_prompts(task: str, count: int, style: str) -> prompt_sets.PromptSet:
  """The first `count` held-out prompts of a named set, or of a prompts file all of it counts (a
  file is a test set of its own), refused when a run could not use them."""
  split = "all" if task.endswith(".jsonl") else "heldout"
  return prompt_sets.prompt_set_for_run(task, split, count, style, "the sweep's task")


def task_prompt_sets(tasks, count: int, style: str) -> dict[str, prompt_sets.PromptSet]:
  """{task: its prompts (`task_prompts`)}: read once, then checked, digested and measured."""
  return {task: task_prompts(task, count, style) for task in tasks}


def check_tasks(target: loading.LoadedModel, prompts: dict, decode: specs.DecodeSpec,
                largest_tree: int, names: str) -> None:
  """Before a sweep writes anything: every prompt of every task tokenizes to 1..MAX_PROMPT_LENGTH
  tokens (named by its id), and the largest decode fits this machine."""
  for task, prompt_set in prompts.items():
    encoded = [target.tokenizer.encode(text) for text in prompt_set.prompts]
    validation.check_token_lists(encoded, prompt_set.keys, task, MAX_PROMPT_LENGTH)
    width = 1 if target.encoder_decoder else min(-(-max(map(len, encoded)) // 32) * 32,
                                                 MAX_PROMPT_LENGTH)
    validation.check_decode_fits(target.model, target.config.vocab_size, 1, width,
                                 decode.max_new_tokens, largest_tree, names)


def heldout_prompts(target: loading.LoadedModel, task: str, heldout: prompt_sets.PromptSet,
                    rng: jax.Array) -> list[Prompt]:
  """A task's prompts (`task_prompts`, read and checked once by the sweep) as batch-1 inputs padded
  to one shared length (one compiled program per task), each with its own key (`prompt_keys`)."""
  batch = target.batch_ids([target.tokenizer.encode(text) for text in heldout.prompts], bucket=32,
                           max_length=MAX_PROMPT_LENGTH, names=heldout.keys)
  rows = lambda array, i: None if array is None else jax.tree_util.tree_map(lambda x: x[i:i + 1],
                                                                            array)
  keys = prompt_keys(rng, task, heldout.keys)
  return [Prompt(batch.prompt_tokens[i:i + 1], batch.prompt_lengths[i:i + 1],
                 rows(batch.source, i), keys[i]) for i in range(len(heldout))]


class Bench:
  """What every point of a sweep shares: the target, the prompts by task, the drafters by (name, tree,
  sample), compiled programs (and which have run once: a program's first run is slower, so it gets an
  untimed warm-up), part timers and the work before the first token by (task, drafter)."""

  def __init__(self, target: loading.LoadedModel, task_sets: dict,
               decode: specs.DecodeSpec, seed: int, style: str, drafter_names, mesh=None,
               largest_tree: int = 1):
    self.target, self.decode = target, decode
    self.prompts = {task: heldout_prompts(target, task, prompt_set, jax.random.PRNGKey(seed))
                    for task, prompt_set in task_sets.items()}
    sequences = (prompt_sets.train_sequences(target.tokenizer, target.encoder_decoder, style)
                 if registry.needs_text(drafter_names) else None)
    self.build_target = registry.Target(target.config, target.params,
                                        mesh if mesh is not None and mesh.size > 1 else None,
                                        sequences)
    tok = target.tokenizer
    self.config = core.DecodeConfig(decode.max_new_tokens, decode.top_k, tok.eos_id, tok.pad_id)
    self.largest_tree = largest_tree
    self.probe = next(iter(self.prompts.values()))[0]
    self._drafters, self._compiled, self._warm, self._start_s, self._timers = {}, {}, set(), {}, {}
    self._built = {}  # the registry's memo: one checkpoint load per drafter, whatever the trees

  def cache_length(self, prompt: Prompt) -> int:
    """Slots a probe's cache needs after `prompt`: room for the largest verification."""
    return prompt.tokens.shape[1] + self.decode.max_new_tokens + self.largest_tree + 1

  def drafter(self, name: str, tree: Tree, sample: bool):
    """(drafter, params) built once per (name, tree, sample)."""
    key = (name, tree, sample)
    if key not in self._drafters:
      self._drafters[key] = registry.build(name, self.build_target, tree, sample, self._built)
    return self._drafters[key]

  def compiled(self, key, build):
    if key not in self._compiled:
      self._compiled[key] = build()
    return self._compiled[key]

  def warm(self, key, task: str, run_one):
    """run_one, after one untimed run on the task's first prompt where the program has not run yet
    (a program's first run is slower)."""
    if key not in self._warm:
      self._warm.add(key)
      run_one(*self.prompts[task][0])
    return run_one

  def baseline(self, task: str, temperature: float):
    """run_one(tokens, lengths, source, key) -> outputs of autoregressive decoding, blocking."""
    decode, tok = self.decode, self.target.tokenizer
    generate = self.compiled(("base", task), lambda: autoregressive.make_generate(
        self.target.model, autoregressive.DecodeShape(decode.max_new_tokens, decode.top_k,
                                                      tok.eos_id, tok.pad_id)))
    run_one = lambda tokens, lengths, source, key: jax.block_until_ready(generate(
        self.target.params, tokens, lengths, key, jnp.float32(temperature),
        jnp.float32(decode.top_p), source))
    return self.warm(("base", task), task, run_one)

  def speculative(self, task: str, drafter_key: tuple, temperature: float, lenience: float):
    """run_one(tokens, lengths, source, key) -> outputs of the speculative loop, blocking."""
    drafter, draft_params = self.drafter(*drafter_key)
    program = ("decode", task, *drafter_key)
    decode_fn = self.compiled(program, lambda: core.make_decode(self.target.model, drafter,
                                                                self.config))
    run_one = lambda tokens, lengths, source, key: jax.block_until_ready(decode_fn(
        self.target.params, draft_params, tokens, lengths, key, temperature, self.decode.top_p,
        lenience, source))
    return self.warm(program, task, run_one)

  def start_seconds(self, task: str, drafter_key: tuple | None) -> float:
    """Time before the first token (the target's prefill, + the drafter's init) on the task's shape."""
    key = (task, drafter_key)
    if key not in self._start_s:
      drafter, draft_params = (None, None) if drafter_key is None else self.drafter(*drafter_key)
      tokens, lengths, source, _ = self.prompts[task][0]
      self._start_s[key] = timing.start_seconds(self.target.model, drafter, self.config,
                                                self.target.params, draft_params, (tokens, lengths),
                                                5, source)
    return self._start_s[key]

  def part_timer(self, drafter_key: tuple):
    """timing.iteration_timer for a drafter, built once: `measure` times one loop iteration's parts
    with it beside every pass it times."""
    if drafter_key not in self._timers:
      tokens, lengths, source, _ = self.probe
      self._timers[drafter_key] = timing.iteration_timer(
          self.target.model, self.target.params, *self.drafter(*drafter_key), self.config,
          (tokens, lengths), source)
    return self._timers[drafter_key]


def paired_decode_seconds(*sides) -> list[tuple[float, dict]]:
  """Seconds per decoded token (after each prompt's first, which the prefill gives) and how it was
  found, for each side of a ratio: sides are (seconds per prompt, outputs, tokens, start_seconds())
  and all get ONE method. The loop's cost per iteration fitted over the prompts (timing.loop_seconds)
  where every side has MIN_FIT_PROMPTS prompts whose iteration counts spread, a fitted fixed cost
  >= 0 and a per-iteration cost the fit pins down to MAX_FIT_ERROR (see loop_seconds); else each
  total less its start (timed apart), or, where that is not positive on some side, each whole
  total. A ratio of a fit and a subtraction misled: 4 prompts of one pass fitted fixed costs of -616
  to 1,119 ms per prompt where the prefill took 264 ms."""
  fits = [timing.loop_seconds(seconds, [int(np.asarray(o.target_calls)) for o in outs],
                              max_relative_error=MAX_FIT_ERROR)
          if len(outs) >= MIN_FIT_PROMPTS else None for seconds, outs, _, _ in sides]
  by_fit = all(fit is not None and fit[1] >= 0 for fit in fits)
  if by_fit:
    results = []
    for (seconds, outs, tokens, _), (per_iteration, fixed) in zip(sides, fits):
      iterations = sum(int(np.asarray(o.target_calls)) for o in outs)
      results.append((per_iteration * iterations / max(tokens - len(outs), 1), {
          "method": "fit over prompts", "fixed_ms_per_prompt": 1000 * fixed,
          "ms_per_iteration": 1000 * per_iteration}))
    return results
  starts = [start_seconds() for *_, start_seconds in sides]
  decode = [float(np.sum(seconds)) - len(outs) * start_s
            for (seconds, outs, _, _), start_s in zip(sides, starts)]
  if all(seconds > 0 for seconds in decode):
    return [(seconds / max(tokens - len(outs), 1), {
        "method": "prefill subtracted", "fixed_ms_per_prompt": 1000 * start_s})
        for seconds, (_, outs, tokens, _), start_s in zip(decode, sides, starts)]
  # A start timed apart that outlasts a whole decode (tiny models on a busy machine) would make a
  # negative time: every side then counts its whole decode, prefill included.
  return [(float(np.sum(seconds)) / max(tokens, 1), {
      "method": "whole decode (the start timed apart outlasted a decode)",
      "fixed_ms_per_prompt": 1000 * start_s})
      for (seconds, _, tokens, _), start_s in zip(sides, starts)]


def side_by_side(prompts: list, runs, repeats: int, between=None, times_between: int = 3,
                 clock=time.perf_counter):
  """Every prompt run by each of `runs` (run(*prompt) -> outputs, blocking) one after the other,
  `repeats` passes over the prompts, the order of the runs reversed from one prompt to the next and
  from one pass to the next (a machine slowing down or speeding up falls on every run alike), and
  `between()` called at `times_between` evenly spaced places in every pass (the loop's parts timed
  beside the decodes). -> (seconds[run, pass, prompt], the last pass's outputs by run,
  what `between` returned, in call order)."""
  seconds = np.zeros((len(runs), repeats, len(prompts)))
  outputs = [[None] * len(prompts) for _ in runs]
  marks = {len(prompts) * (k + 1) // times_between - 1 for k in range(times_between)}
  between_results = []
  for r in range(repeats):
    for i, prompt in enumerate(prompts):
      order = range(len(runs)) if (r + i) % 2 == 0 else reversed(range(len(runs)))
      for j in order:
        start = clock()
        outputs[j][i] = runs[j](*prompt)
        seconds[j, r, i] = clock() - start
      if between is not None and i in marks:
        between_results.append(between())
  return seconds, outputs, between_results


def measure(bench: Bench, task: str, drafter_key: tuple, temperature: float, lenience: float,
            repeats: int) -> dict:
  """Time baseline and speculative decoding of one point side by side, prompt by prompt
  (`side_by_side`), and one iteration's parts at three places in every pass: the machine's speed
  drifts (the greedy baseline of one T5 sweep read 0.56-0.61 ms per token, then 0.73-0.94 for a
  minute), and predictions divide the baseline's time by the parts'. -> the columns both sweeps
  report, and the outputs."""
  time_parts = bench.part_timer(drafter_key)
  runs = (bench.baseline(task, temperature),
          bench.speculative(task, drafter_key, temperature, lenience))
  started = time.perf_counter()
  seconds, (base_out, spec_out), part_runs = side_by_side(
      bench.prompts[task], runs, repeats,
      # medians of 9 steps, 3 a pass (a single median of 9 steps moved by 20 % here)
      lambda: time_parts(temperature, 9, rounds=1))
  logging.info("timed side by side, %d x: baseline %.1fs, speculative %.1fs, all %.1fs", repeats,
               seconds[0].sum(), seconds[1].sum(), time.perf_counter() - started)
  base_each, spec_each = np.median(seconds, axis=1)
  count = lambda outs: sum(int(np.asarray(o.num_generated).sum()) for o in outs)
  base_tokens, spec_tokens = count(base_out), count(spec_out)
  parts = {part: float(np.median([p[part] for p in part_runs])) for part in part_runs[0]}
  (base_decode, base_timing), (spec_decode, spec_timing) = paired_decode_seconds(
      (base_each, base_out, base_tokens, lambda: bench.start_seconds(task, None)),
      (spec_each, spec_out, spec_tokens, lambda: bench.start_seconds(task, drafter_key)))
  base_ms = 1000 * float(np.sum(base_each)) / max(base_tokens, 1)
  spec_ms = 1000 * float(np.sum(spec_each)) / max(spec_tokens, 1)
  match = None
  if temperature == 0.0 and lenience == 1.0:
    match = all(np.array_equal(np.asarray(b.tokens), np.asarray(s.tokens))
                for b, s in zip(base_out, spec_out))
  return {
      "summary": metrics.summarize_outputs(spec_out), "outputs": spec_out, "parts_ms": parts,
      "baseline_ms_per_token": base_ms, "speculative_ms_per_token": spec_ms,
      "speedup": base_ms / spec_ms, "baseline_decode_ms_per_token": 1000 * base_decode,
      "speculative_decode_ms_per_token": 1000 * spec_decode,
      "decode_speedup": base_decode / spec_decode,
      "decode_timing": {"baseline": base_timing, "speculative": spec_timing},
      "outputs_match_baseline": match, "prompts": len(bench.prompts[task]),
  }


def size_name(config) -> str:
  """The named size a config equals (specjax.models.SIZES), else "custom"."""
  return models.size_name(config) or "custom"
