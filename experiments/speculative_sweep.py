"""The measured speculative sweep: `python -m specjax.run` with `run.main.job = @speculative_sweep.Sweep()`.

Every point (task x drafter x temperature x lenience x gamma) times the autoregressive baseline and the
speculative loop with the drafter's sampled chain of gamma side by side (experiments/measure.py) and
writes one JSONL row (schema: docs/experiments.md): alpha, acceptance, tokens per target call, ms per
emitted token of both, the speedup, c measured as draft step / target step on this hardware, Thm 3.8's
prediction from the measured alpha and c, and, for greedy lossless points, whether the outputs equal
the baseline's token for token. The target's cost of scoring gamma + 1 tokens, v_gamma in one-token
steps, is measured once per sweep, and each row also carries Thm 3.8 with v_gamma in place of 1
(theory.speedup_with_verify_cost), and the prediction from one loop iteration's measured parts
(draft + verify + accept, timed three times in each of the point's passes) in the baseline's decode
time per token (theory.speedup_from_costs).

Either model family: for an encoder-decoder target (T5) the prompts are its sources, table drafters
are counted on the reference outputs, and model drafts encode the source themselves.
"""

from __future__ import annotations

import dataclasses
import time

import jax
from absl import logging

from experiments import measure, plots, tables
from experiments import sweep as resumable
from specjax import launch, loading, outputs, specs, theory, timing, validation
from specjax.data import prompts as prompt_sets
from specjax.decoding import acceptance, core
from specjax.decoding.tree import Tree
from specjax.drafters import registry
from specjax.drafters.model import ModelDrafter
from specjax.models import cpu_kernels


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
    gammas = resumable.validate_gammas(self.gammas)
    lossy = [l for l in self.leniences if l != 1.0]
    lossy_gammas = resumable.validate_gammas(self.lenience_gammas) if lossy else []
    for name in self.drafters:  # a gamma deeper than a trained block is refused now, not mid-sweep
      for gamma in sorted(set(gammas) | set(lossy_gammas)):
        registry.check_tree(name, Tree.chain(gamma))
    for value in (*self.temperatures, *self.leniences):
      float(value)  # a non-number fails here, with its value in the message
    for temperature in self.temperatures:
      core.validate_traced(temperature, 1.0, 1.0)
    # Temperature and lenience vary fastest (both are traced): the points of one compiled program
    # (drafter, gamma) run back to back.
    lossless = resumable.grid(task=list(self.tasks), drafter=list(self.drafters), gamma=gammas,
                              lenience=[1.0], temperature=list(self.temperatures))
    for value in lossy:
      acceptance.validate_lenience(value)
    lenient = resumable.grid(task=list(self.tasks), drafter=list(self.drafters),
                             gamma=lossy_gammas, lenience=lossy,
                             temperature=list(self.temperatures)) if lossy else []
    return lossless + lenient

  def all_gammas(self) -> list[int]:
    lossy = any(l != 1.0 for l in self.leniences)
    return sorted(set(self.gammas) | (set(self.lenience_gammas) if lossy else set()))


class StepCosts:
  """Median bare step times on this hardware, batch 1, on the first task's first prompt: the target's
  and each drafter's single step (for c: the drafter's one-token step, as the loop calls it) and the
  target scoring gamma + 1 tokens (v_gamma, in one-token target steps)."""

  def __init__(self, bench: measure.Bench, grid: SweepSpec):
    self.bench = bench
    target = bench.target
    self.target_fn = timing.target_step(target.model)
    self.target_probe = ModelDrafter(target.model)  # only for its prefilled cache and context
    self.step_ms = {"target": self._timed(self.target_fn, self.target_probe, target.params, 1)}
    for name in grid.drafters:
      drafter, params = bench.drafter(name, Tree.chain(1), True)
      self.step_ms[name] = self._timed(timing.draft_step(drafter.step), drafter.step, params, 1)
    logging.info("step ms: %s", {k: round(v, 2) for k, v in self.step_ms.items()})
    self.verify_cost = {
        gamma: self._timed(self.target_fn, self.target_probe, target.params, gamma + 1)
        / self.step_ms["target"] for gamma in grid.all_gammas()}
    logging.info("verification cost v_gamma (target steps): %s",
                 {k: round(v, 2) for k, v in self.verify_cost.items()})
    # The floor of a target step: its weights' bytes over the read bandwidth measured here (a step
    # scoring up to ~8 tokens is bound by that read on CPUs: docs/results.md, the roofline).
    self.bandwidth_gbps = timing.read_bandwidth_gbps()
    weight_bytes = cpu_kernels.step_bytes(target.params, target.config)
    self.target_floor_ms = 1000 * weight_bytes / (self.bandwidth_gbps * 1e9)
    logging.info("target step %.1f ms, its floor %.1f ms (%.0f MB at %.1f GB/s)",
                 self.step_ms["target"], self.target_floor_ms, weight_bytes / 1e6, self.bandwidth_gbps)

  def _timed(self, step_fn, drafter, params, width: int) -> float:
    """ms of one jitted step on `width` tokens after the probe prompt: the median of 3 medians of 9
    (one median of 9 steps moved v by 0.2 between neighbouring gammas here, and a single median of
    15 target steps read 0.99 ms where the baseline decoded at 0.6 ms/token)."""
    tokens, lengths, source, _ = self.bench.probe
    state = jax.jit(drafter.init, static_argnums=3)(params, tokens, lengths,
                                                    self.bench.cache_length(self.bench.probe),
                                                    source)
    return 1000 * timing.step_seconds(step_fn, params, state,
                                       *timing.one_token((tokens, lengths), width), 9, rounds=3)

  def c(self, drafter_name: str) -> float:
    return self.step_ms[drafter_name] / self.step_ms["target"]


def measure_point(bench: measure.Bench, costs: StepCosts, repeats: int, point: dict) -> dict:
  """Time baseline and speculative decoding of one point side by side; -> its measured row."""
  name, gamma = point["drafter"], point["gamma"]
  measured = measure.measure(bench, point["task"], (name, Tree.chain(gamma), True),
                             point["temperature"], point["lenience"], repeats)
  summary, parts = measured["summary"], measured["parts_ms"]
  c, alpha, verify_cost = costs.c(name), summary["alpha_estimate"], costs.verify_cost[gamma]
  base_decode = measured["baseline_decode_ms_per_token"]
  decode = bench.decode
  return {
      "target": measure.size_name(bench.target.config), "top_k": decode.top_k,
      "top_p": decode.top_p, "alpha": alpha, "acceptance_rate": summary["empirical_alpha"],
      "tokens_per_target_call": summary["tokens_per_target_call"],
      "per_position_acceptance": summary["per_position_acceptance"],
      "acceptance_histogram": summary["acceptance_histogram"],
      **{key: measured[key] for key in (
          "baseline_ms_per_token", "speculative_ms_per_token", "speedup",
          "baseline_decode_ms_per_token", "speculative_decode_ms_per_token", "decode_speedup",
          "decode_timing", "outputs_match_baseline", "prompts")},
      "target_step_ms": costs.step_ms["target"], "draft_step_ms": costs.step_ms[name], "c": c,
      "target_step_floor_ms": costs.target_floor_ms, "read_bandwidth_gbps": costs.bandwidth_gbps,
      "predicted_speedup": float(theory.walltime_improvement(alpha, gamma, c)),
      "verify_cost": verify_cost,
      "predicted_speedup_with_verify_cost": float(
          theory.speedup_with_verify_cost(alpha, gamma, c, verify_cost)),
      "verify_costs": {str(g): v for g, v in costs.verify_cost.items()},
      "iteration_ms": parts,
      "predicted_speedup_from_costs": float(theory.speedup_from_costs(
          alpha, gamma, *(parts[k] / base_decode for k in ("draft", "verify", "accept")))),
      "new_tokens": summary["tokens"],
      "ms_per_128_tokens": 128 * measured["speculative_ms_per_token"],
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
    mesh_shape = validation.check_mesh_shape(self.mesh_shape, "Sweep.mesh_shape")
    validation.whole_number(self.seed, "Sweep.seed", 0)
    task_prompts = measure.task_prompt_sets(grid.tasks, grid.prompts_per_task, self.prompts.style)
    spec = {"target": dataclasses.asdict(self.target), "prompts": dataclasses.asdict(self.prompts),
            "decode": dataclasses.asdict(decode), "mesh_shape": list(self.mesh_shape),
            "seed": self.seed, "sweep": dataclasses.asdict(grid),
            "measurement": measure.MEASUREMENT,
            "prompt_digests": {task: validation.prompt_digest(prompt_set)
                               for task, prompt_set in task_prompts.items()},
            "content_keys": loading.content_keys(self.target,
                                                 registry.checkpoints_of(grid.drafters))}
    loaded, mesh = loading.load_target(self.target, mesh_shape)
    registry.check_vocabulary(grid.drafters, loaded.tokenizer, self.target.checkpoint)
    measure.check_tasks(loaded, task_prompts, decode, max(grid.all_gammas()) + 1,
                        f"DecodeSpec.max_new_tokens={decode.max_new_tokens}, SweepSpec.gammas="
                        f"{tuple(grid.all_gammas())}")
    bench = []  # built on the first point to measure, so a rerun of a finished sweep costs nothing

    def measure_one(point):
      if not bench:
        start = time.perf_counter()
        shared = measure.Bench(loaded, task_prompts, decode, self.seed, self.prompts.style,
                               grid.drafters, mesh, max(grid.all_gammas()) + 1)
        bench.extend([shared, StepCosts(shared, grid)])
        logging.info("sweep of %d points; setup %.0fs", len(points), time.perf_counter() - start)
      return measure_point(*bench, grid.repeats, point)

    with outputs.RunDirectory(self.output_dir, spec, "results.jsonl", "sweep_fingerprint",
                              launch.operative_config()) as run_dir:
      rows = resumable.run_sweep(points, measure_one, run_dir.results, desc="sweep", config=spec)
      if jax.process_index() == 0:
        tables.write_all(rows, run_dir.path)
        plots.plot_all(rows, run_dir.path)
    logging.info("sweep done: %d rows in %s", len(rows), self.output_dir)
    return rows
