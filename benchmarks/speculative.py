"""Speculative decoding side by side with the autoregressive baseline: alpha, c, v, measured speedup
vs Leviathan's Thm 3.8.

    .venv/bin/python benchmarks/speculative.py [--drafters bigram,lookup,layers2] [--gammas 1,2,3,4,5]
        [--temperatures 0,1] [--prompts 8] [--repeats 3] [--new_tokens 64] [--task humaneval]
        [--checkpoint embedded:smollm2] [--dtype float32] [--kernels xla] [--style chat] [--no_overhead]
        [--out speculative]

The speculative sweep's measurement (experiments/speculative_sweep.measure_point on an
experiments/measure.Bench) without a run directory: for every drafter x gamma x temperature, on the
task's first `--prompts` held-out prompts (batch 1, EOS on, each prompt its own random key), the
baseline and the speculative loop are timed side by side prompt by prompt, `--repeats` passes
(measure.side_by_side), one iteration's parts (draft, verify, accept: the loop's own methods,
timing.iteration_timer) three times a pass, and both sides' decode ms per token found by one
method (measure.paired_decode_seconds). Columns:

  alpha         mean beta = sum_x min(target, draft) over reached draft positions; `accept` is the
                empirical acceptance rate;
  c, v          the draft's step over the target's, and the target scoring gamma + 1 tokens over
                scoring 1 (on XLA:CPU a step on several tokens runs matrix products and costs more);
  speedup       baseline decode ms/token over the speculative loop's (end to end in brackets);
  Thm 3.8       theory.walltime_improvement(alpha, gamma, c); `with v` puts the measured v in it;
                `from parts` is theory.speedup_from_costs from the iteration's timed parts.
Then the overhead bound (unless --no_overhead): the target as its own draft (`layers{L}`, all its
layers) at gamma 1, greedy: every draft is accepted, so its decode time per token over the baseline's
is what the loop costs beyond the target's steps. Drafters: any one-token drafter the registry
(specjax.drafters.registry) builds, run as its sampled chain of gamma (`bigram`, `lookup`,
`layers{k}`, `model:<dir>`, `lookup+model:<dir>`). Writes benchmarks/results/{--out}.{json,md};
runs unchanged on GPU / TPU. On 2 CPU cores a point costs its passes (about 2 s per prompt each for
64 tokens from SmolLM2) and about 15 s of timed parts: the defaults (31 points, 8 prompts, 3 passes)
take over an hour; `--prompts 2 --repeats 1 --drafters lookup --gammas 2 --new_tokens 16` about 5
minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

import jax
from tqdm import tqdm

import common
from experiments import measure, speculative_sweep
from specjax import loading, specs


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--drafters", default="bigram,lookup,layers2",
                      help="comma list of drafter names (specjax.drafters.registry)")
  parser.add_argument("--gammas", default="1,2,3,4,5")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3, help="timed passes per point")
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--task", default="humaneval", help="a prompt set of specjax.data.prompts or a .jsonl")
  parser.add_argument("--checkpoint", default=specs.ModelSpec().checkpoint)
  parser.add_argument("--dtype", default="float32", help="specs.ModelSpec.dtype")
  parser.add_argument("--kernels", default=None, help="specs.ModelSpec.kernels: cpu or xla")
  parser.add_argument("--style", default="chat", help="prompt style: chat, or t5 for a T5 target")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no_overhead", action="store_true", help="skip the draft == target bound")
  parser.add_argument("--out", default="speculative")
  return parser.parse_args()


def main():
  args = parse_args()
  started = time.perf_counter()
  names = tuple(args.drafters.split(","))
  grid = speculative_sweep.SweepSpec(
      tasks=(args.task,), drafters=names, gammas=tuple(int(g) for g in args.gammas.split(",")),
      temperatures=tuple(float(t) for t in args.temperatures.split(",")),
      prompts_per_task=args.prompts, repeats=args.repeats)
  points = grid.points()  # validates every name before the target is loaded
  target, _ = loading.load_target(specs.ModelSpec(args.checkpoint, dtype=args.dtype,
                                                  kernels=args.kernels), (1, 1))
  if not args.no_overhead:
    if target.encoder_decoder:
      raise SystemExit("the overhead bound runs the target as its own draft through layers{L}, which "
                       "decoder-only targets have; pass --no_overhead for a T5 target")
    itself = f"layers{target.config.num_layers}"
    grid = dataclasses.replace(grid, drafters=names + (itself,),
                               gammas=tuple(sorted(set(grid.gammas) | {1})))
    points.append({"task": args.task, "drafter": itself, "gamma": 1, "temperature": 0.0,
                   "lenience": 1.0, "overhead_bound": True})
  decode = specs.DecodeSpec(max_new_tokens=args.new_tokens)
  bench = measure.Bench(target, measure.task_prompt_sets(grid.tasks, grid.prompts_per_task, args.style),
                        decode, args.seed, args.style,
                        grid.drafters, largest_tree=max(grid.all_gammas()) + 1)
  costs = speculative_sweep.StepCosts(bench, grid)
  print(f"{len(points)} points; setup {time.perf_counter() - started:.0f}s", flush=True)
  rows = []
  for point in tqdm(points, desc="speculative", unit="point"):
    rows.append({**point, **speculative_sweep.measure_point(bench, costs, grid.repeats, point)})
    r = rows[-1]
    tqdm.write(f"{r['drafter']} T={r['temperature']:g} gamma={r['gamma']}: alpha {r['alpha']:.3f}, "
               f"speedup {r['decode_speedup']:.2f}x, Thm 3.8 {r['predicted_speedup']:.2f}x (with v "
               f"{r['predicted_speedup_with_verify_cost']:.2f}x, from parts "
               f"{r['predicted_speedup_from_costs']:.2f}x)")
  total_s = time.perf_counter() - started
  markdown = table(args, target, rows, costs, len(bench.prompts[args.task]), total_s)
  print(markdown)
  meta = {"args": vars(args), "step_ms": costs.step_ms, "verify_cost": costs.verify_cost,
          "jax": jax.__version__, "host": platform.node(), "cpus": os.cpu_count(),
          "total_s": total_s}
  print("wrote", common.write_results(args.out, rows, markdown, meta))


def table(args, target, rows, costs, prompts: int, total_s: float) -> str:
  lines = [
      f"{measure.size_name(target.config)} target ({args.checkpoint}), batch 1, {prompts} "
      f"held-out {args.task} prompts, {args.new_tokens} new tokens, EOS on, {args.dtype}"
      f"{' on the CPU kernels' if args.kernels == 'cpu' else ''}; {platform.machine()} "
      f"with {os.cpu_count()} cores, jax {jax.__version__}; {args.repeats} timed pass(es) per point, "
      f"{measure.PASSES}. Total run {total_s / 60:.1f} min.", "",
      "Step costs (ms, batch 1): " + ", ".join(f"{n}: {ms:.2f}" for n, ms in costs.step_ms.items())
      + "; v by gamma: " + ", ".join(f"{g}: {v:.2f}" for g, v in costs.verify_cost.items()) + ".", "",
      "| drafter | temp | gamma | alpha | accept | tokens / call | c | v | baseline ms/token "
      "| ms/token | speedup | Thm 3.8 | with v | from parts | measured / from parts | greedy equal |",
      "|" + "---|" * 16]
  own = [r for r in rows if r.get("overhead_bound")]
  for r in rows:
    if r.get("overhead_bound"):
      continue
    lines.append(
        f"| {r['drafter']} | {r['temperature']:g} | {r['gamma']} | {r['alpha']:.3f} "
        f"| {r['acceptance_rate']:.3f} | {r['tokens_per_target_call']:.2f} | {r['c']:.3f} "
        f"| {r['verify_cost']:.2f} | {r['baseline_decode_ms_per_token']:.1f} "
        f"| {r['speculative_decode_ms_per_token']:.1f} | {r['decode_speedup']:.2f}x "
        f"({r['speedup']:.2f}x) | {r['predicted_speedup']:.2f}x "
        f"| {r['predicted_speedup_with_verify_cost']:.2f}x | {r['predicted_speedup_from_costs']:.2f}x "
        f"| {r['decode_speedup'] / r['predicted_speedup_from_costs']:.2f} "
        f"| {'' if r['outputs_match_baseline'] is None else r['outputs_match_baseline']} |")
  for r in own:
    lines += ["", f"Overhead bound (the target as its own draft, gamma 1, greedy; alpha "
              f"{r['alpha']:.3f}, {r['tokens_per_target_call']:.2f} tokens per target call): "
              f"{r['speculative_decode_ms_per_token']:.1f} ms per emitted token against "
              f"{r['baseline_decode_ms_per_token']:.1f} for the baseline = "
              f"{1 / r['decode_speedup']:.3f}x decode ({1 / r['speedup']:.3f}x end to end); each "
              f"iteration runs the draft's step and a verification of 2 tokens (v = "
              f"{costs.verify_cost[1]:.2f}) per 2 tokens."]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
