"""The measured speculative sweep: `python -m specjax.run` with `run.main.job = @speculative_sweep.Sweep()`.

Every point (task x drafter x temperature x lenience x gamma) times the autoregressive baseline and the
speculative run side by side in this process, on the same held-out prompts (batch 1 each, padded to
one length per task; each prompt its own random key, the same for both runs: `prompt_keys`), and
writes one JSONL row (schema: experiments/README.md): alpha, acceptance, tokens per target call, ms
per emitted token of both, the speedup, c measured as draft step / target step on this hardware, Thm
3.8's prediction from the measured alpha and c, and, for greedy lossless points, whether the outputs
equal the baseline's token for token.

ms per token is end to end (prefill included) over the tokens each run emitted (EOS on), so greedy
points compare identical token streams and sampled points compare per-token costs. Decode ms per token
leaves out what each prompt pays once (Thm 3.8 models decoding only): every prompt is timed, and the
loop's cost per iteration is fitted over the prompts (`paired_decode_seconds`, both sides of a ratio by
the same method); the prefill, timed apart, is subtracted instead where there are few prompts, all
ran about as many iterations, a fit's fixed cost comes out negative or its per-iteration cost is
uncertain (timing.loop_seconds). The target's
cost of scoring gamma + 1 tokens, v_gamma in one-token steps, is measured once per sweep, and each row
also carries Thm 3.8 with v_gamma in place of 1 (theory.speedup_with_verify_cost), and the prediction
from one loop iteration's measured parts, draft + verify + accept (timing.chain_cost_timer, timed
in turn with the baseline and speculative passes of the point, `repeats` times), in the baseline's
decode time per token (theory.speedup_from_costs).

Either model family: for an encoder-decoder target (T5) the prompts are its sources, table drafters
are counted on the reference outputs, and model drafts encode the source themselves.

The pieces: `SweepSpec` (the grid), `Setup` (target, drafters, prompts), `StepCosts` (c and v, probed
once; the iteration parts' timers), `Programs` (compiled programs and which have been warmed up) and `measure_point`.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments import plots, tables
from experiments import sweep as resumable
from specjax import (drafters, launch, loading, metrics, outputs, specs, speculative, theory,
                     timing)
from specjax.decoding import autoregressive
from specjax.data import prompts as prompt_sets
from specjax.drafters import ModelDrafter
from specjax.models import decoder_only, t5


@dataclasses.dataclass(frozen=True)
class SweepSpec:
  """The grid. gammas are static (one compile each); temperatures and leniences are traced (no
  recompile). Leniences < 1 are lossy (Leviathan app. A.5) and run only at `lenience_gammas`."""
  tasks: tuple = ("humaneval",)
  drafters: tuple = ("lookup",)
  gammas: tuple = (1, 2, 3, 4)
  temperatures: tuple = (0.0, 1.0)
  leniences: tuple = (1.0,)
  lenience_gammas: tuple = (3,)
  prompts_per_task: int = 4
  repeats: int = 1

  def points(self) -> list[dict]:
    """Every point of the grid, validated before anything is loaded, written or measured: values,
    counts, prompt set names and drafter names (a model drafter's checkpoint must exist)."""
    for name, value in (("prompts_per_task", self.prompts_per_task), ("repeats", self.repeats)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"SweepSpec.{name} = {value!r}: it counts {name.split('_')[0]} and must be "
                         "an integer >= 1")
    if not self.tasks or not self.drafters:
      raise ValueError("SweepSpec.tasks and SweepSpec.drafters need at least one entry each")
    for task in self.tasks:
      prompt_sets.check_prompt_set_name(task)
    for name in self.drafters:
      drafters.draft_checkpoint(name)
    gammas = resumable.validate_gammas(self.gammas)
    for value in (*self.temperatures, *self.leniences):
      float(value)  # a non-number fails here, with its value in the message
    for temperature in self.temperatures:
      speculative.validate_traced(temperature, 1.0, 1.0)
    # Temperature and lenience vary fastest (both are traced): the points of one compiled program
    # (drafter, gamma) run back to back.
    lossless = resumable.grid(task=list(self.tasks), drafter=list(self.drafters), gamma=gammas,
                              lenience=[1.0], temperature=list(self.temperatures))
    lossy = [l for l in self.leniences if l != 1.0]
    for value in lossy:
      speculative.validate_lenience(value)
    lenient = resumable.grid(task=list(self.tasks), drafter=list(self.drafters),
                             gamma=resumable.validate_gammas(self.lenience_gammas), lenience=lossy,
                             temperature=list(self.temperatures)) if lossy else []
    return lossless + lenient

  def all_gammas(self) -> list[int]:
    lossy = any(l != 1.0 for l in self.leniences)
    return sorted(set(self.gammas) | (set(self.lenience_gammas) if lossy else set()))


class Prompt(NamedTuple):
  """One batch-1 decode: prompt_tokens[1, P], prompt_lengths[1], the source (None for a decoder-only
  target) and the prompt's own random key, which the baseline and every drafter's run of it share."""
  tokens: jax.Array
  lengths: jax.Array
  source: object
  key: jax.Array


def prompt_keys(rng: jax.Array, task: str, count: int) -> list[jax.Array]:
  """One key per prompt of a task, folded from the sweep's seed with the task's name and the prompt's
  index: with one key for all, every prompt drew from the same uniforms (their sampled acceptances
  moved together, and one small first uniform drew SmolLM2's low-id EOS for every prompt at once)."""
  task_key = jax.random.fold_in(rng, zlib.crc32(task.encode()) % (2 ** 31))
  return [jax.random.fold_in(task_key, i) for i in range(count)]


def heldout_prompts(target: loading.LoadedModel, task: str, count: int, style: str,
                    rng: jax.Array) -> list[Prompt]:
  """The first `count` held-out prompts of a set as batch-1 inputs padded to one shared length (one
  compiled program per task), each with its own key (`prompt_keys`)."""
  # A prompts file is a test set of its own: all of it counts (the named sets keep their split).
  split = "all" if task.endswith(".jsonl") else "heldout"
  heldout = prompt_sets.load_prompt_set(task, split, limit=count, style=style)
  batch = target.batch(heldout.prompts, bucket=32, max_length=1024)
  rows = lambda array, i: None if array is None else jax.tree_util.tree_map(lambda x: x[i:i + 1],
                                                                            array)
  keys = prompt_keys(rng, task, len(heldout))
  return [Prompt(batch.prompt_tokens[i:i + 1], batch.prompt_lengths[i:i + 1],
                 rows(batch.source, i), keys[i]) for i in range(len(heldout))]


@dataclasses.dataclass
class Setup:
  """What every point shares: the target, the drafters by name and the prompts by task."""
  target: loading.LoadedModel
  drafters: dict
  prompts: dict[str, list[Prompt]]
  spec: SweepSpec
  decode: specs.DecodeSpec

  @classmethod
  def build(cls, target: loading.LoadedModel, spec: SweepSpec, decode: specs.DecodeSpec, seed: int,
            style: str, mesh=None) -> "Setup":
    needs_text = any(drafters.needs_text(name) for name in spec.drafters)
    sequences = (prompt_sets.train_sequences(target.tokenizer, target.encoder_decoder, style)
                 if needs_text else None)
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    made = {name: drafters.make_drafter(name, target.config, target.params, sequences, mesh=mesh)
            for name in spec.drafters}
    prompts = {task: heldout_prompts(target, task, spec.prompts_per_task, style,
                                     jax.random.PRNGKey(seed))
               for task in spec.tasks}
    return cls(target, made, prompts, spec, decode)

  def cache_length(self, prompt: Prompt) -> int:
    """Slots a probe's cache needs after `prompt`: room for the longest verification."""
    return prompt[0].shape[1] + self.decode.max_new_tokens + max(self.spec.all_gammas()) + 2


class StepCosts:
  """Median step times on this hardware, batch 1: the target's and each drafter's single step (for
  c) and the target scoring gamma + 1 tokens (v_gamma, in one-token target steps)."""

  def __init__(self, setup: Setup):
    self.setup = setup
    self.probe_prompt = next(iter(setup.prompts.values()))[0]
    self.target_fn = timing.target_step(setup.target.model)
    self.target_probe = ModelDrafter(setup.target.model)  # only for its prefilled cache and context
    self._part_timers = {}
    self.step_ms = {"target": self._timed(self.target_fn, self.target_probe, setup.target.params, 1)}
    for name, (drafter, draft_params) in setup.drafters.items():
      self.step_ms[name] = self._timed(timing.draft_step(drafter), drafter, draft_params, 1)
    logging.info("step ms: %s", {k: round(v, 2) for k, v in self.step_ms.items()})
    self.verify_cost = {
        gamma: self._timed(self.target_fn, self.target_probe, setup.target.params, gamma + 1)
        / self.step_ms["target"] for gamma in setup.spec.all_gammas()}
    logging.info("verification cost v_gamma (target steps): %s",
                 {k: round(v, 2) for k, v in self.verify_cost.items()})

  def _timed(self, step_fn, drafter, params, width: int) -> float:
    """ms of one jitted step on `width` tokens after the first task's first prompt: the median of 3
    medians of 9 (one median of 9 steps moved v by 0.2 between neighbouring gammas here, and a single
    median of 15 target steps read 0.99 ms where the baseline decoded at 0.6 ms/token)."""
    tokens, lengths, source, _ = self.probe_prompt
    state = jax.jit(drafter.init, static_argnums=3)(params, tokens, lengths,
                                                    self.setup.cache_length(self.probe_prompt),
                                                    source)
    return 1000 * timing.step_seconds(step_fn, params, state,
                                       *timing.one_token((tokens, lengths), width), 9, rounds=3)

  def c(self, drafter_name: str) -> float:
    return self.step_ms[drafter_name] / self.step_ms["target"]

  def part_timer(self, drafter_name: str, gamma: int):
    """timing.chain_cost_timer for (drafter, gamma), built once: measure_point times one loop
    iteration's draft / verify / accept parts with it beside every pass it times."""
    key = (drafter_name, gamma)
    if key not in self._part_timers:
      setup, tok = self.setup, self.setup.target.tokenizer
      tokens, lengths, source, _ = self.probe_prompt
      config = speculative.SpecConfig(gamma, setup.decode.max_new_tokens, setup.decode.top_k,
                                      tok.eos_id, tok.pad_id)
      self._part_timers[key] = timing.chain_cost_timer(
          setup.target.model, setup.target.params, *setup.drafters[drafter_name], config,
          (tokens, lengths), source)
    return self._part_timers[key]


class Programs:
  """Compiled baseline / speculative programs by key, which of them have run once (a program's first
  run is slower, so it gets an untimed warm-up), and prefill times by (task, drafter)."""

  def __init__(self, setup: Setup):
    self.setup = setup
    self._compiled, self._warm, self._prefill_s = {}, set(), {}

  def get(self, key, build):
    if key not in self._compiled:
      self._compiled[key] = build()
    return self._compiled[key]

  def timed(self, key, task: str, run_one):
    """(seconds per prompt, tokens emitted, outputs) of one pass over the task's prompts."""
    warmup = 0 if key in self._warm else 1
    self._warm.add(key)
    seconds, outs = timing.time_prompts(run_one, self.setup.prompts[task], 1, warmup)
    return seconds, sum(int(np.asarray(o.num_generated).sum()) for o in outs), outs

  def prefill_seconds(self, task: str, drafter_name: str | None) -> float:
    """Time before the first token (target prefill, + the drafter's init) on the task's shape."""
    key = (task, drafter_name)
    if key not in self._prefill_s:
      drafter, draft_params = (None, None) if drafter_name is None else self.setup.drafters[
          drafter_name]
      tokens, lengths, source, _ = prompt = self.setup.prompts[task][0]
      self._prefill_s[key] = timing.prefill_seconds(
          self.setup.target.model, drafter, self.setup.target.params, draft_params,
          (tokens, lengths), self.setup.cache_length(prompt), 5, source)
    return self._prefill_s[key]

  def baseline(self, task: str, temperature: float):
    setup, decode = self.setup, self.setup.decode
    tok = setup.target.tokenizer
    generate = self.get(("base", task), lambda: autoregressive.make_generate(
        setup.target.model, autoregressive.DecodeShape(decode.max_new_tokens, decode.top_k,
                                                       tok.eos_id, tok.pad_id)))
    run_one = lambda tokens, lengths, source, key: jax.block_until_ready(generate(
        setup.target.params, tokens, lengths, key, jnp.float32(temperature),
        jnp.float32(decode.top_p), source))
    return self.timed(("base", task), task, run_one)

  def speculative(self, task: str, drafter_name: str, gamma: int, temperature: float,
                  lenience: float):
    setup, decode = self.setup, self.setup.decode
    tok = setup.target.tokenizer
    drafter, draft_params = setup.drafters[drafter_name]
    config = speculative.SpecConfig(gamma, decode.max_new_tokens, decode.top_k, tok.eos_id,
                                    tok.pad_id)
    program = ("spec", task, drafter_name, gamma)
    decode_fn = self.get(program, lambda: speculative.make_speculative_decode(setup.target.model,
                                                                          drafter, config))
    run_one = lambda tokens, lengths, source, key: jax.block_until_ready(decode_fn(
        setup.target.params, draft_params, tokens, lengths, key, temperature, decode.top_p,
        lenience, source))
    return self.timed(program, task, run_one)


def size_name(config) -> str:
  """The named size a config equals (decoder_only / t5 SIZES), else "custom"."""
  for name, size in {**decoder_only.SIZES, **t5.SIZES}.items():
    if size == config:
      return name
  return "custom"


# Prompts a side needs before its loop cost is fitted rather than its prefill subtracted.
MIN_FIT_PROMPTS = 8

# How a row is drawn and timed, in the spec (so in the fingerprint) of this sweep and of the tree
# sweep (tree_sweep.py), which measures the same way: a directory whose rows were measured another way
# is refused rather than resumed into one table with new rows. Change it whenever a change to the
# keys or the timing (either sweep's) would make old and new rows disagree.
MEASUREMENT = ("each prompt its own key; baseline, decode and parts timed in turn; both sides of a "
               "speedup by one method; loop fits refused beyond a standard error of 1/4")


def paired_decode_seconds(*sides) -> list[tuple[float, dict]]:
  """Seconds per decoded token (after each prompt's first, which the prefill gives) and how it was
  found, for each side of a ratio: sides are (seconds per prompt, outputs, tokens, prefill_seconds())
  and all get ONE method. The loop's cost per iteration fitted over the prompts (timing.loop_seconds)
  where every side has MIN_FIT_PROMPTS prompts whose iteration counts spread, a fitted fixed cost
  >= 0 and a per-iteration cost the fit pins down (see loop_seconds); else each total less its
  prefill (timed apart). A ratio of a fit and a subtraction misled: 4
  prompts of one pass fitted fixed costs of -616 to 1,119 ms per prompt where the prefill took 264
  ms, and put the SmolLM2 tree sweep's greedy decode speedups at 1.4-1.9x against end-to-end
  speedups of 0.9-1.5x."""
  fits = [timing.loop_seconds(seconds, [int(np.asarray(o.target_calls)) for o in outs])
          if len(outs) >= MIN_FIT_PROMPTS else None for seconds, outs, _, _ in sides]
  by_fit = all(fit is not None and fit[1] >= 0 for fit in fits)
  results = []
  for (seconds, outs, tokens, prefill_seconds), fit in zip(sides, fits):
    decoded = max(tokens - len(outs), 1)
    if by_fit:
      per_iteration, fixed = fit
      iterations = sum(int(np.asarray(o.target_calls)) for o in outs)
      results.append((per_iteration * iterations / decoded, {
          "method": "fit over prompts", "fixed_ms_per_prompt": 1000 * fixed,
          "ms_per_iteration": 1000 * per_iteration}))
    else:
      prefill_s = prefill_seconds()
      results.append(((float(np.sum(seconds)) - len(outs) * prefill_s) / decoded, {
          "method": "prefill subtracted", "fixed_ms_per_prompt": 1000 * prefill_s}))
  return results


def in_turn(repeats: int, *runs, names: tuple[str, ...] = ()) -> list[list]:
  """Each of `runs` called in turn, `repeats` times (a slow stretch of the machine falls on all of
  them alike, not on whichever ran then): every run's results, in call order. Logs the wall time
  each run took in all, under `names`, so a sweep's log shows where a point's time went."""
  results, spent = [[] for _ in runs], [0.0] * len(runs)
  for _ in range(repeats):
    for i, (out, run_once) in enumerate(zip(results, runs)):
      start = time.perf_counter()
      out.append(run_once())
      spent[i] += time.perf_counter() - start
  names = names or tuple(f"run {i}" for i in range(len(runs)))
  logging.info("timed in turn, %d x: %s", repeats,
               ", ".join(f"{name} {seconds:.1f}s" for name, seconds in zip(names, spent)))
  return results


def median_pass(passes: list) -> tuple:
  """(each prompt's median seconds, tokens, outputs of the last) over Programs passes."""
  return (np.median([p[0] for p in passes], axis=0), *passes[-1][1:])


def measure_point(setup: Setup, costs: StepCosts, programs: Programs, point: dict) -> dict:
  """Time baseline and speculative decoding of one point side by side; -> its measured row."""
  task, name, gamma = point["task"], point["drafter"], point["gamma"]
  temperature, lenience = point["temperature"], point["lenience"]
  # Baseline, speculative and the iteration's parts are timed in turn, `repeats` times: the machine's
  # speed drifts over a sweep (the greedy baseline of one T5 sweep read 0.56-0.61 ms per token, then
  # 0.73-0.94 for a minute), and the prediction divides the baseline's time by the parts' times.
  time_parts = costs.part_timer(name, gamma)
  base_runs, spec_runs, part_runs = in_turn(
      setup.spec.repeats, lambda: programs.baseline(task, temperature),
      lambda: programs.speculative(task, name, gamma, temperature, lenience),
      # 3 medians of 9 in all (a single median of 9 steps moved by 20 % here)
      lambda: time_parts(temperature, 9, rounds=-(-3 // setup.spec.repeats)),
      names=("baseline", "speculative", "parts"))
  (base_each, base_tokens, base_out), (spec_each, spec_tokens, spec_out) = map(
      median_pass, (base_runs, spec_runs))
  parts = {part: float(np.median([p[part] for p in part_runs])) for part in part_runs[0]}
  prompts = len(setup.prompts[task])
  base_s, spec_s = float(np.sum(base_each)), float(np.sum(spec_each))
  (base_decode, base_timing), (spec_decode, spec_timing) = paired_decode_seconds(
      (base_each, base_out, base_tokens, lambda: programs.prefill_seconds(task, None)),
      (spec_each, spec_out, spec_tokens, lambda: programs.prefill_seconds(task, name)))
  base_ms, spec_ms = 1000 * base_s / max(base_tokens, 1), 1000 * spec_s / max(spec_tokens, 1)
  summary = metrics.summarize_outputs(spec_out)
  c, alpha, verify_cost = costs.c(name), summary["alpha_estimate"], costs.verify_cost[gamma]
  match = None
  if temperature == 0.0 and lenience == 1.0:
    match = all(np.array_equal(np.asarray(b.tokens), np.asarray(s.tokens))
                for b, s in zip(base_out, spec_out))
  decode = setup.decode
  return {
      "target": size_name(setup.target.config), "top_k": decode.top_k, "top_p": decode.top_p,
      "alpha": alpha, "acceptance_rate": summary["empirical_alpha"],
      "tokens_per_target_call": summary["tokens_per_target_call"],
      "per_position_acceptance": summary["per_position_acceptance"],
      "acceptance_histogram": summary["acceptance_histogram"],
      "baseline_ms_per_token": base_ms, "speculative_ms_per_token": spec_ms,
      "speedup": base_ms / spec_ms, "baseline_decode_ms_per_token": 1000 * base_decode,
      "speculative_decode_ms_per_token": 1000 * spec_decode,
      "decode_speedup": base_decode / spec_decode, "target_step_ms": costs.step_ms["target"],
      "draft_step_ms": costs.step_ms[name], "c": c,
      "predicted_speedup": float(theory.walltime_improvement(alpha, gamma, c)),
      "verify_cost": verify_cost,
      "predicted_speedup_with_verify_cost": float(
          theory.speedup_with_verify_cost(alpha, gamma, c, verify_cost)),
      "verify_costs": {str(g): v for g, v in costs.verify_cost.items()},
      "iteration_ms": parts, "decode_timing": {"baseline": base_timing, "speculative": spec_timing},
      "predicted_speedup_from_costs": float(theory.speedup_from_costs(
          alpha, gamma, *(parts[k] / (1000 * base_decode) for k in ("draft", "verify", "accept")))),
      "outputs_match_baseline": match, "prompts": prompts,
      "new_tokens": summary["tokens"], "ms_per_128_tokens": 128 * spec_ms,
  }


@dataclasses.dataclass(frozen=True)
class Sweep:
  """Measure every point of `grid` into output_dir/results.jsonl (resumable), then write the papers'
  tables and plots next to it. `prompts` sets the prompt style; `decode` the new-token budget and
  top-k / top-p. Calling it runs the sweep and returns the rows."""
  output_dir: str = "out/smollm2_default"
  target: specs.ModelSpec = specs.ModelSpec()
  prompts: specs.PromptSpec = specs.PromptSpec()
  decode: specs.DecodeSpec = specs.DecodeSpec()
  grid: SweepSpec = SweepSpec()
  mesh_shape: tuple = (1, 1)
  seed: int = 0

  def __call__(self) -> list[dict]:
    grid, decode = self.grid, self.decode
    points = grid.points()  # validates the grid before anything is loaded or written
    spec = {"target": dataclasses.asdict(self.target), "prompts": dataclasses.asdict(self.prompts),
            "decode": dataclasses.asdict(decode), "mesh_shape": list(self.mesh_shape),
            "seed": self.seed, "sweep": dataclasses.asdict(grid), "measurement": MEASUREMENT,
            "content_keys": loading.content_keys(self.target,
                                                 drafters.checkpoints_of(grid.drafters))}
    loaded, mesh = loading.load_target(self.target, self.mesh_shape)
    bench = []  # built on the first point to measure, so a rerun of a finished sweep costs nothing

    def measure(point):
      if not bench:
        start = time.perf_counter()
        setup = Setup.build(loaded, grid, decode, self.seed, self.prompts.style, mesh)
        bench.extend([setup, StepCosts(setup), Programs(setup)])
        logging.info("sweep of %d points; setup %.0fs", len(points), time.perf_counter() - start)
      return measure_point(*bench, point)

    with outputs.RunDirectory(self.output_dir, spec, "results.jsonl", "sweep_fingerprint",
                              launch.operative_config()) as run_dir:
      rows = resumable.run_sweep(points, measure, run_dir.results, desc="sweep", config=spec)
      if jax.process_index() == 0:
        tables.write_all(rows, run_dir.path)
        plots.plot_all(rows, run_dir.path)
    logging.info("sweep done: %d rows in %s", len(rows), self.output_dir)
    return rows
