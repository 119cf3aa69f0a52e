"""Speculative decoding of SmolLM2-135M on this CPU: measured speedup vs Leviathan's Thm 3.8.

    .venv/bin/python benchmarks/speculative.py [--drafters bigram,lookup,layers2] [--gammas 1,...,8]
        [--layer_gammas 1,2,3,4] [--temperatures 0,1] [--prompts 4] [--new_tokens 64] [--repeats 1]

One process, batch 1, the first `--prompts` held-out HumanEval prompts (right-padded to one length, so
one compiled program per drafter and gamma), EOS disabled so every run emits exactly `new_tokens`
tokens. Per drafter, gamma and temperature it reports, side by side with the autoregressive baseline:

  ms/token      decode time per token after the first: (run - prefill) / (new_tokens - 1), summed
                over prompts; prefill (target, plus the drafter's own) is timed separately and
                subtracted, since Thm 3.8 models decoding only. End-to-end figures are in the JSON.
  speedup       baseline ms/token / speculative ms/token at the same temperature.
  alpha         mean beta = sum_x min(target_probs, draft_probs) over reached draft positions
                (SpecStats.acceptance_probs, metrics.alpha_estimate); `accept` is the empirical rate.
  c             median jitted draft step / median jitted target step (T = 1, batch 1, transform and
                sample included), measured directly for every drafter, tables and lookup included.
  predicted     theory.walltime_improvement(alpha, gamma, c); `v` is the measured cost of the target
                scoring gamma + 1 tokens over scoring 1, which Thm 3.8 takes to be 1: on XLA:CPU a
                step with T > 1 runs GEMM instead of GEMV and costs more, so `pred_v` =
                expected_tokens / (gamma c + v) is the same model with that cost put in.
Then the overhead bound: draft == target (ModelDrafter on the target), gamma 1, greedy; every draft is
accepted, so its ms per emitted token over the baseline's is the loop's cost beyond the target's.

Drafters: `bigram` is the sparse top-K bigram counted on the train split of the humaneval, news and
ende sets (prompts + references, SmolLM2's tokenizer); `lookup` is prompt lookup with the unigram of
that text as its fallback; `layers{k}` is the target's first k layers + final norm + tied head
(untrained: expect alpha near 0). Compilation is ahead of time and untimed, then `--warmup` untimed
runs on the first prompt warm each compiled program (its first run is slower). Writes
benchmarks/results/{--out}.{json,md}. A full default run takes about 13 minutes on 2 quiet cores;
`--prompts 1 --new_tokens 32 --gammas 1,2,4 --drafters lookup` takes about 1.5.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

import common
from specjax import data, drafters, loading, speculative, theory
from specjax.metrics import summarize_outputs
from specjax.timing import (draft_step, ms_per_token, one_token, prefill_seconds, step_seconds,
                            target_step, time_passes)


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--drafters", default="bigram,lookup,layers2",
                      help="comma list of bigram, lookup, layers{k}")
  parser.add_argument("--gammas", default="1,2,3,4,5,6,7,8")
  parser.add_argument("--layer_gammas", default="1,2,3,4",
                      help="gammas for layers{k} drafts: at alpha ~0 every gamma loses, and a large "
                           "gamma runs k/L of the target per wasted draft step; the 1..8 sweep alone "
                           "costs ~8 minutes here")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--prompts", type=int, default=4, help="held-out HumanEval prompts, batch 1")
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=1, help="timed passes over all prompts (median)")
  parser.add_argument("--warmup", type=int, default=1,
                      help="untimed runs on the first prompt after each compilation (a program's "
                           "first run is ~0.5 s slower here)")
  parser.add_argument("--step_repeats", type=int, default=15, help="timed single steps for c and v")
  parser.add_argument("--bigram_top_k", type=int, default=64)
  parser.add_argument("--bigram_concentration", type=float, default=1.0)
  parser.add_argument("--lookup_ngram", type=int, default=3)
  parser.add_argument("--no_overhead", action="store_true", help="skip the draft == target bound")
  parser.add_argument("--out", default="speculative")
  return parser.parse_args()


def main():
  args = parse_args()
  started = time.perf_counter()
  temperatures = [float(t) for t in args.temperatures.split(",")]
  target = loading.load_model()
  config, tok, model = target.config, target.tokenizer, target.model
  params = jax.device_put(target.params)
  prompts, keys = common.load_prompts(target, args.prompts)
  prompt_len = prompts[0][0].shape[1]
  names = args.drafters.split(",")
  sequences = (data.train_sequences(tok) if any(drafters.needs_text(n) for n in names) else None)
  made = {}
  for name in names:
    drafter, draft_params = drafters.make_drafter(name, config, params, sequences,
                                                  bigram_top_k=args.bigram_top_k,
                                                  bigram_concentration=args.bigram_concentration,
                                                  lookup_ngram=args.lookup_ngram)
    made[name] = (drafter, draft_params,
                  ints(args.layer_gammas if name.startswith("layers") else args.gammas))
  max_gamma = max(max(g) for _, _, g in made.values())
  max_length = prompt_len + args.new_tokens + max_gamma + 1
  print(f"{len(prompts)} prompts padded to {prompt_len} tokens, {args.new_tokens} new tokens; "
        f"drafters {list(made)}; setup {time.perf_counter() - started:.0f}s", flush=True)

  # Step costs: the target scoring T = 1..max_gamma + 1 tokens, and every drafter's single step.
  target_probe = drafters.ModelDrafter(model)  # for its prefilled cache
  target_ms = {}
  for width in range(1, max_gamma + 2):  # a fresh cache each time: the donated one is gone
    target_ms[width] = 1000 * step_seconds(target_step(model), params,
                                           common.fresh_state(target_probe, params, prompts[0], max_length),
                                           *one_token(prompts[0], width), args.step_repeats)
  draft_ms = {name: 1000 * step_seconds(draft_step(d), dp, common.fresh_state(d, dp, prompts[0], max_length),
                                        *one_token(prompts[0]), args.step_repeats)
              for name, (d, dp, _) in made.items()}
  print("target step ms by T:", {t: round(v, 1) for t, v in target_ms.items()},
        "draft step ms:", {n: round(v, 2) for n, v in draft_ms.items()}, flush=True)

  # The baseline, at each temperature.
  baseline, base_prefill = common.time_baseline(model, params, prompts, args.new_tokens, tok.pad_id,
                                                temperatures, args.repeats, args.warmup)
  rng, f32 = jax.random.PRNGKey(0), functools.partial(jnp.asarray, dtype=jnp.float32)

  jobs = [(name, gamma) for name, (_, _, gammas) in made.items() for gamma in gammas]
  if not args.no_overhead:
    jobs.append(("self", 1))
    made["self"] = (drafters.ModelDrafter(model), params, [1])
  rows, prefills = [], {}
  bar = tqdm(total=sum(1 if name == "self" else len(temperatures) for name, _ in jobs),
             desc="speculative", unit="run")
  for name, gamma in jobs:
    drafter, draft_params, _ = made[name]
    if name not in prefills:
      prefills[name] = prefill_seconds(model, drafter, params, draft_params, prompts[0],
                                       max_length, 3)
    fn = speculative.make_speculative_decode(model, drafter, speculative.SpecConfig(
        gamma=gamma, max_new_tokens=args.new_tokens, eos_id=None, pad_id=tok.pad_id))
    start = time.perf_counter()
    compiled = fn.jitted.lower(params, draft_params, *prompts[0], rng, f32(0.0), f32(1.0),
                               f32(1.0), None).compile()
    compile_s = time.perf_counter() - start
    for i, temperature in enumerate([0.0] if name == "self" else temperatures):
      run_one = lambda t, l, temp=temperature: jax.block_until_ready(
          compiled(params, draft_params, t, l, rng, f32(temp), f32(1.0), f32(1.0), None))
      seconds, passes, outputs = time_passes(run_one, prompts, args.repeats,
                                             args.warmup if i == 0 else 0)
      decode_ms, e2e_ms = ms_per_token(seconds, prefills[name], len(prompts), args.new_tokens)
      summary = summarize_outputs(outputs)
      c = draft_ms.get(name, target_ms[1]) / target_ms[1]
      alpha = summary["alpha_estimate"]
      v = target_ms[gamma + 1] / target_ms[1]
      expected = float(theory.expected_tokens(alpha, gamma))
      row = {"drafter": name, "temperature": temperature, "gamma": gamma, "alpha": alpha,
             "empirical_alpha": summary["empirical_alpha"],
             "tokens_per_target_call": summary["tokens_per_target_call"], "c": c,
             "spec_decode_ms": decode_ms, "spec_e2e_ms": e2e_ms,
             "base_decode_ms": baseline[temperature]["decode_ms"],
             "speedup": baseline[temperature]["decode_ms"] / decode_ms,
             "speedup_e2e": baseline[temperature]["e2e_ms"] / e2e_ms,
             "predicted": float(theory.walltime_improvement(alpha, gamma, c)), "v": v,
             "predicted_v": expected / (gamma * c + v), "compile_s": compile_s,
             "prefill_ms": 1000 * prefills[name], "passes_s": passes, "summary": summary}
      row["measured_over_predicted"] = row["speedup"] / row["predicted"]
      row["measured_over_predicted_v"] = row["speedup"] / row["predicted_v"]
      rows.append(row)
      bar.update()
      tqdm.write(f"{name:>8} T={temperature:g} gamma={gamma}: alpha {alpha:.3f} (accept "
                 f"{row['empirical_alpha']:.3f}), {decode_ms:.1f} ms/token, speedup "
                 f"{row['speedup']:.2f}x, predicted {row['predicted']:.2f}x (with v "
                 f"{row['predicted_v']:.2f}x), compile {compile_s:.0f}s")
  bar.close()
  write(args, rows, baseline, target_ms, draft_ms, keys, prompt_len, base_prefill,
        time.perf_counter() - started)


def write(args, rows, baseline, target_ms, draft_ms, keys, prompt_len, base_prefill, total_s):
  lines = [
      f"SmolLM2-135M-Instruct target, float32, batch 1, {len(keys)} held-out HumanEval prompts "
      f"({', '.join(keys)}) padded to {prompt_len} tokens, {args.new_tokens} new tokens, EOS off; "
      f"{platform.machine()} with {os.cpu_count()} cores; {args.repeats} timed pass(es) over the "
      f"prompts after ahead-of-time compilation and {args.warmup} warm-up run(s). ms/token = decode "
      f"time per token after the first (prefill subtracted). alpha = mean sum_x min(target, draft) "
      f"over reached draft positions; accept = empirical acceptance; c = draft step / target step; "
      f"v = target step on gamma + 1 tokens / on 1; predicted = Thm 3.8 from (alpha, gamma, c); "
      f"pred v = the same with the verification costing v target steps. Total run "
      f"{total_s / 60:.1f} min.", "",
      "Baseline (autoregressive): " + ", ".join(
          f"T={t:g} {b['decode_ms']:.1f} ms/token ({b['e2e_ms']:.1f} end-to-end)"
          for t, b in baseline.items()) + f"; prefill {1000 * base_prefill:.0f} ms.", "",
      "Step costs (ms, batch 1): target by T " + ", ".join(
          f"{t}: {ms:.1f}" for t, ms in target_ms.items()) + "; draft steps " + ", ".join(
          f"{n}: {ms:.2f}" for n, ms in draft_ms.items()) + ".", "",
      "| drafter | temp | gamma | alpha | accept | tokens / call | c | ms/token | speedup "
      "| predicted | measured / predicted | v | pred v | measured / pred v |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["drafter"] == "self":
      continue
    lines.append(
        f"| {r['drafter']} | {r['temperature']:g} | {r['gamma']} | {r['alpha']:.3f} "
        f"| {r['empirical_alpha']:.3f} | {r['tokens_per_target_call']:.2f} | {r['c']:.3f} "
        f"| {r['spec_decode_ms']:.1f} | {r['speedup']:.2f}x | {r['predicted']:.2f}x "
        f"| {r['measured_over_predicted']:.2f} | {r['v']:.2f} | {r['predicted_v']:.2f}x "
        f"| {r['measured_over_predicted_v']:.2f} |")
  for r in rows:
    if r["drafter"] == "self":
      lines += ["", f"Overhead bound (draft == target, gamma 1, greedy; alpha {r['alpha']:.3f}, "
                f"{r['tokens_per_target_call']:.2f} tokens per target call): "
                f"{r['spec_decode_ms']:.1f} ms per emitted token vs {r['base_decode_ms']:.1f} for "
                f"a plain target step = {1 / r['speedup']:.3f}x decode "
                f"({1 / r['speedup_e2e']:.3f}x end-to-end; goal <= 1.15x). For reference, the "
                f"target step on T = 2 tokens costs {target_ms[2] / target_ms[1]:.2f}x one on T = 1, "
                f"and one iteration runs two such steps (draft [prev, last], verify) per 2 tokens."]
  markdown = "\n".join(lines)
  print(markdown)
  meta = {"args": vars(args), "prompt_keys": keys, "prompt_length": prompt_len,
          "baseline": {t: {k: v for k, v in b.items() if k != "tokens"} for t, b in baseline.items()},
          "target_step_ms": target_ms, "draft_step_ms": draft_ms, "jax": jax.__version__,
          "host": platform.node(), "cpus": os.cpu_count(), "total_s": total_s}
  print("wrote", common.write_results(args.out, rows, markdown, meta))


def ints(text):
  return [int(x) for x in str(text).split(",") if x]


if __name__ == "__main__":
  main()
