"""The measured sweep behind `python -m specjax.run` when a config binds `run.run.sweep`.

Every point (task x drafter x temperature x lenience x gamma) times the autoregressive baseline and the
speculative run side by side in this process, on the same held-out prompts (batch 1 each, padded to
one length per task) and the same seeds, and writes one JSONL row (schema: experiments/README.md):
alpha, acceptance, tokens per target call, ms per emitted token of both, the speedup, c measured as
draft step / target step on this hardware, Thm 3.8's prediction from the measured alpha and c, and,
for greedy lossless points, whether the outputs equal the baseline's token for token.

ms per token is end to end (prefill included) over the tokens each run emitted (EOS on), so greedy
points compare identical token streams and sampled points compare per-token costs. Decode ms per token
leaves out the prefill (timed apart per task and drafter; Thm 3.8 models decoding only). The target's
cost of scoring gamma + 1 tokens, v_gamma in one-token steps, is measured once per sweep, and each row
also carries Thm 3.8 with v_gamma in place of 1 (theory.speedup_with_verify_cost).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments import measure, sweep
from specjax import autoregressive, speculative, theory
from specjax.models import decoder_only


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
    gammas = sweep.validate_gammas(self.gammas)
    lossless = sweep.grid(task=list(self.tasks), drafter=list(self.drafters),
                          temperature=list(self.temperatures), lenience=[1.0], gamma=gammas)
    lossy = [l for l in self.leniences if l != 1.0]
    for value in lossy:
      speculative.validate_lenience(value)
    lenient = sweep.grid(task=list(self.tasks), drafter=list(self.drafters),
                         temperature=list(self.temperatures), lenience=lossy,
                         gamma=sweep.validate_gammas(self.lenience_gammas)) if lossy else []
    return lossless + lenient


class _Bench:
  """What points share: the target, drafters, prompts, compiled programs and step costs."""

  def __init__(self, config, params, tokenizer, spec: SweepSpec, max_new_tokens, top_k, top_p, seed,
               style):
    self.config, self.params, self.tok, self.spec = config, params, tokenizer, spec
    self.max_new, self.top_k, self.top_p = max_new_tokens, top_k, top_p
    self.rng = jax.random.PRNGKey(seed)
    self.target_step = decoder_only.make_step(config)
    self.target_init = functools.partial(decoder_only.init_cache, config)
    tables = {"unigram", "bigram", "lookup"}  # drafters counted on the train split's text
    needs_text = any(n in tables or n.startswith("lookup+") and n[len("lookup+"):] in tables
                     for n in spec.drafters)
    sequences = measure.train_sequences(tokenizer) if needs_text else None
    self.drafters = {n: measure.make_drafter(n, config, params, sequences) for n in spec.drafters}
    self.prompts = {t: measure.load_prompts(tokenizer, spec.prompts_per_task, t, style)[0]
                    for t in spec.tasks}
    self._compiled = {}
    self._warm = set()  # programs that have run once: a program's first run is slower
    self.step_ms = self._step_costs()
    self.verify_cost = self._verify_costs()
    self._prefill_s = {}

  def _timed_step_ms(self, step_fn, drafter, params, width, repeats):
    """ms of one jitted step on `width` tokens after the first task's first prompt, batch 1."""
    prompt = next(iter(self.prompts.values()))[0]
    length = prompt[0].shape[1] + self.max_new + max(self.spec.gammas) + 2
    return 1000 * measure.step_seconds(step_fn, params,
                                       measure.fresh_state(drafter, params, prompt, length),
                                       *measure.one_token(prompt, width), repeats)

  def _step_costs(self) -> dict:
    """Median single-step times (batch 1, T = 1) of the target and every drafter, for c."""
    self._target_fn = measure.target_step_fn(self.target_step)
    self._target_cache = measure.model_drafter(self.config)  # only for its prefilled cache
    costs = {"target": self._timed_step_ms(self._target_fn, self._target_cache, self.params, 1, 15)}
    for name, (drafter, draft_params) in self.drafters.items():
      costs[name] = self._timed_step_ms(measure.draft_step(drafter), drafter, draft_params, 1, 15)
    logging.info("step ms: %s", {k: round(v, 2) for k, v in costs.items()})
    return costs

  def _verify_costs(self) -> dict:
    """gamma -> the target scoring gamma + 1 tokens in target steps of one token (v_gamma)."""
    costs = {}
    lossy = any(l != 1.0 for l in self.spec.leniences)
    for gamma in sorted(set(self.spec.gammas) | (set(self.spec.lenience_gammas) if lossy else set())):
      # Median of 3 medians: one median of 9 steps moved v by 0.2 between neighbouring gammas here.
      ms = statistics.median(self._timed_step_ms(self._target_fn, self._target_cache, self.params,
                                                 gamma + 1, 9) for _ in range(3))
      costs[gamma] = ms / self.step_ms["target"]
    logging.info("verification cost v_gamma (target steps): %s",
                 {k: round(v, 2) for k, v in costs.items()})
    return costs

  def prefill_seconds(self, task, drafter_name):
    """Time before the first token (target prefill, + the drafter's init) on the task's shape, with
    caches sized for the largest gamma (one compile per task and drafter)."""
    key = (task, drafter_name)
    if key not in self._prefill_s:
      drafter, draft_params = (None, None) if drafter_name is None else self.drafters[drafter_name]
      prompt = self.prompts[task][0]
      length = prompt[0].shape[1] + self.max_new + max(self.spec.gammas) + 2
      self._prefill_s[key] = measure.prefill_seconds(self.target_step, self.target_init, drafter,
                                                     self.params, draft_params, prompt, length, 5)
    return self._prefill_s[key]

  def _program(self, key, build):
    if key not in self._compiled:
      self._compiled[key] = build()
    return self._compiled[key]

  def baseline(self, task, temperature):
    shape = autoregressive.DecodeShape(self.max_new, self.top_k, self.tok.eos_id, self.tok.pad_id)
    generate = self._program(("base", task), lambda: autoregressive.make_generate(
        self.target_step, self.target_init, shape))
    run = lambda tokens, lengths: jax.block_until_ready(generate(
        self.params, tokens, lengths, self.rng, jnp.float32(temperature), jnp.float32(self.top_p)))
    return self._timed(("base", task), task, run)

  def speculative(self, task, drafter_name, gamma, temperature, lenience):
    drafter, draft_params = self.drafters[drafter_name]
    shape = speculative.SpecShape(gamma, self.max_new, self.top_k, self.tok.eos_id, self.tok.pad_id)
    decode = self._program(("spec", task, drafter_name, gamma), lambda: speculative.make_speculative_decode(
        self.target_step, self.target_init, drafter, shape))
    run = lambda tokens, lengths: jax.block_until_ready(decode(
        self.params, draft_params, tokens, lengths, self.rng, temperature, self.top_p, lenience))
    return self._timed(("spec", task, drafter_name, gamma), task, run)

  def _timed(self, program, task, run):
    """(seconds, tokens emitted, outputs) over the task's prompts; a program's first use gets one
    untimed warm-up run (compilation happens there too)."""
    warmup = 0 if program in self._warm else 1
    self._warm.add(program)
    seconds, _, outputs = measure.time_passes(run, self.prompts[task], self.spec.repeats, warmup)
    return seconds, sum(int(np.asarray(o.num_generated).sum()) for o in outputs), outputs

  def measure_point(self, point: dict) -> dict:
    task, name, gamma = point["task"], point["drafter"], point["gamma"]
    temperature, lenience = point["temperature"], point["lenience"]
    base_s, base_tokens, base_out = self.baseline(task, temperature)
    spec_s, spec_tokens, spec_out = self.speculative(task, name, gamma, temperature, lenience)
    prompts = len(self.prompts[task])
    # Decode time: the first token of every prompt comes from the prefill, which is timed apart.
    base_decode = (base_s - prompts * self.prefill_seconds(task, None)) / max(
        base_tokens - prompts, 1)
    spec_decode = (spec_s - prompts * self.prefill_seconds(task, name)) / max(
        spec_tokens - prompts, 1)
    base_ms, spec_ms = 1000 * base_s / max(base_tokens, 1), 1000 * spec_s / max(spec_tokens, 1)
    summary = measure.summarize_outputs(spec_out)
    c = self.step_ms[name] / self.step_ms["target"]
    alpha = summary["alpha_estimate"]
    verify_cost = self.verify_cost[gamma]
    match = None
    if temperature == 0.0 and lenience == 1.0:
      match = all(np.array_equal(np.asarray(b.tokens), np.asarray(s.tokens))
                  for b, s in zip(base_out, spec_out))
    return {
        "target": "smollm2-135m" if self.config == decoder_only.SIZES["smollm2-135m"] else "custom",
        "top_k": self.top_k, "top_p": self.top_p, "alpha": alpha,
        "acceptance_rate": summary["empirical_alpha"],
        "tokens_per_target_call": summary["tokens_per_target_call"],
        "per_position_acceptance": summary["per_position_acceptance"],
        "acceptance_histogram": summary["acceptance_histogram"],
        "baseline_ms_per_token": base_ms, "speculative_ms_per_token": spec_ms,
        "speedup": base_ms / spec_ms, "baseline_decode_ms_per_token": 1000 * base_decode,
        "speculative_decode_ms_per_token": 1000 * spec_decode,
        "decode_speedup": base_decode / spec_decode, "target_step_ms": self.step_ms["target"],
        "draft_step_ms": self.step_ms[name], "c": c,
        "predicted_speedup": float(theory.walltime_improvement(alpha, gamma, c)),
        "verify_cost": verify_cost,
        "predicted_speedup_with_verify_cost": float(
            theory.speedup_with_verify_cost(alpha, gamma, c, verify_cost)),
        "verify_costs": {str(g): v for g, v in self.verify_cost.items()},
        "outputs_match_baseline": match, "prompts": len(self.prompts[task]),
        "new_tokens": summary["tokens"], "ms_per_128_tokens": 128 * spec_ms,
    }


def run_speculative_sweep(output_dir, config, params, tokenizer, spec: SweepSpec, *, max_new_tokens,
                          top_k, top_p, seed, fingerprint: dict, style="chat") -> list[dict]:
  """Measure every point of `spec` into output_dir/results.jsonl (resumable), then write the tables
  and plots next to it. Returns the rows."""
  from experiments import plots, tables  # pylint: disable=import-outside-toplevel
  points = spec.points()
  bench = []  # built on the first point to measure, so a rerun of a finished sweep costs nothing

  def measure_point(point):
    if not bench:
      start = time.perf_counter()
      bench.append(_Bench(config, params, tokenizer, spec, max_new_tokens, top_k, top_p, seed, style))
      logging.info("sweep of %d points; setup %.0fs", len(points), time.perf_counter() - start)
    return bench[0].measure_point(point)

  rows = sweep.run_sweep(points, measure_point, f"{output_dir}/results.jsonl", desc="sweep",
                         config=fingerprint)
  if jax.process_index() == 0:
    tables.write_all(rows, output_dir)
    plots.plot_all(rows, output_dir)
  return rows
