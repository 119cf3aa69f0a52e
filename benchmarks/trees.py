"""Token trees on SmolLM2-135M: tokens per target call, where the time goes, measured vs predicted.

    .venv/bin/python benchmarks/trees.py [--drafters lookup,bigram,mtp:out/smollm2_mtp/heads]
        [--trees chain:3,spine:3x3,full:3,2,1] [--temperatures 0,1] [--prompts 8] [--new_tokens 64]

One process, batch 1, held-out HumanEval prompts (never seen by any trained drafter: their training
prompts are the train split), right-padded to one length, EOS off so every run emits `new_tokens`.
For every drafter x tree x temperature, side by side with the autoregressive baseline of the same run:

  tokens/call   committed tokens per tree verification (after the first token);
  alpha_d       conditional pass rate at depth d (passed d / reached d), and `beta_d` its expectation
                (the target's mass on the node's candidate tokens, SpecStats.acceptance_probs);
  draft, verify(T), accept
                the cost of one iteration's parts in autoregressive steps (the baseline's decode
                ms per token at that temperature = 1): the drafter's
                candidates call; the target scoring the T tree nodes (tree mask); the transform at
                every node, the acceptance walk and the cache compaction. Each is timed jitted with
                several calls chained inside one program, its inputs varied from call to call so
                that XLA cannot hoist it out (metrics.tree_step_costs);
  speedup       baseline ms/token / tree ms/token, decode only (prefills timed and subtracted);
  predicted     theory.tree_speedup(beta_d, draft, verify(T), accept).
Drafters: `lookup` (prompt lookup over the prompt + output, unigram fallback), `bigram` (sparse
bigram counted on the train split), `model:<dir>` (a trained chain draft), each as a tree by its
top-k per depth (tree_drafters.ChainTopK); `heads:<dir>` (Medusa heads on the target's hidden states),
`mtp:<dir>` (the shared MTP head applied recursively on them), `lookup+heads:<dir>`, `lookup+mtp:<dir>`.
Writes benchmarks/results/{--out}.{json,md}. Runs unchanged on GPU / TPU (jax picks the device).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import common
from specjax import data, drafters, loading, metrics, theory, tree_drafters, trees
from specjax.metrics import ms_per_token, prefill_seconds, step_seconds, time_passes


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--drafters", default="lookup,bigram")
  parser.add_argument("--trees", default="chain:3,spine:3x3,full:3,2,1",
                      help="comma list; full:W1,W2 shapes use ';' between trees if they hold commas")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--step_repeats", type=int, default=9)
  parser.add_argument("--out", default="trees")
  return parser.parse_args()


def parse_trees(text: str) -> list[trees.Tree]:
  """'chain:3,spine:3x3,full:3,2,1' -> trees: a new tree starts at each 'kind:'."""
  names, current = [], ""
  for part in text.replace(";", ",").split(","):
    if ":" in part and current:
      names.append(current)
      current = part
    else:
      current = f"{current},{part}" if current else part
  names.append(current)
  return [trees.Tree.from_name(name) for name in names]


def main():
  args = parse_args()
  started = time.perf_counter()
  temperatures = [float(t) for t in args.temperatures.split(",")]
  tree_list = parse_trees(args.trees)
  target = loading.load_model()
  tok, model = target.tokenizer, target.model
  params = jax.device_put(target.params)
  prompts, keys = common.load_prompts(target, args.prompts)
  prompt_len = prompts[0][0].shape[1]
  names = args.drafters.split(",")
  for name in names:
    tree_drafters.check_tree_drafter_name(name)
  sequences = (data.train_sequences(tok) if any(map(tree_drafters.tree_drafter_needs_text, names)) else None)
  made = {name: tree_drafters.make_tree_drafter(name, target.config, params, sequences) for name in names}
  max_length = prompt_len + args.new_tokens + max(t.size for t in tree_list)
  print(f"{len(prompts)} prompts padded to {prompt_len} tokens, {args.new_tokens} new tokens; "
        f"drafters {names}; trees {[t.name for t in tree_list]}; setup "
        f"{time.perf_counter() - started:.0f}s", flush=True)

  # Step costs.
  target_probe = drafters.ModelDrafter(model)
  target_ms = 1000 * step_seconds(metrics.target_step(model), params,
                                 common.fresh_state(target_probe, params, prompts[0], max_length),
                                 *metrics.one_token(prompts[0]), args.step_repeats, rounds=3)
  probe = functools.partial(metrics.tree_step_costs, model, params, prompt=prompts[0][:2],
                            max_length=max_length, repeats=args.step_repeats)
  first_drafter, first_params = next(iter(made.values()))
  per_tree = {t.name: probe(first_drafter, first_params, t, parts=("verify", "accept"))
              for t in tree_list}
  costs = {(n, t.name): {**per_tree[t.name], **probe(d, dp, t, parts=("draft",))}
           for n, (d, dp) in made.items() for t in tree_list}
  print(f"target step {target_ms:.1f} ms; tree iteration parts (ms):",
        {f"{n} {t}": {k: round(v, 2) for k, v in c.items()} for (n, t), c in costs.items()},
        flush=True)

  baseline, base_prefill = common.time_baseline(model, params, prompts, args.new_tokens, tok.pad_id,
                                                temperatures, args.repeats, args.warmup)
  rng, f32 = jax.random.PRNGKey(0), functools.partial(jnp.asarray, dtype=jnp.float32)

  rows = []
  bar = tqdm(total=len(made) * len(tree_list) * len(temperatures), desc="trees", unit="run")
  for name, (drafter, draft_params) in made.items():
    tree_prefill = prefill_seconds(model, drafter, params, draft_params, prompts[0], max_length, 3)
    for tree in tree_list:
      fn = trees.make_tree_decode(model, drafter, trees.TreeConfig(
          tree, args.new_tokens, eos_id=None, pad_id=tok.pad_id))
      start = time.perf_counter()
      compiled_tree = fn.jitted.lower(params, draft_params, *prompts[0], rng, f32(0.0),
                                      f32(1.0)).compile()
      compile_s = time.perf_counter() - start
      for i, temperature in enumerate(temperatures):
        run_one = lambda t, l, temp=temperature: jax.block_until_ready(
            compiled_tree(params, draft_params, t, l, rng, f32(temp), f32(1.0)))
        seconds, passes, outputs = time_passes(run_one, prompts, args.repeats,
                                               args.warmup if i == 0 else 0)
        decode_ms, e2e_ms = ms_per_token(seconds, tree_prefill, len(prompts), args.new_tokens)
        rows.append(_row(name, tree, temperature, outputs, decode_ms, e2e_ms, baseline, target_ms,
                         costs[(name, tree.name)], compile_s, passes))
        bar.update()
        r = rows[-1]
        tqdm.write(f"{name} {tree.name} T={temperature:g}: {r['tokens_per_target_call']:.2f} "
                   f"tokens/call, {decode_ms:.1f} ms/token, speedup {r['speedup']:.2f}x, predicted "
                   f"{r['predicted']:.2f}x" + ("" if temperature else
                                               f", greedy equal: {r['greedy_equal']}"))
  bar.close()
  write(args, rows, baseline, target_ms, keys, prompt_len, time.perf_counter() - started)


def _row(name, tree, temperature, outputs, decode_ms, e2e_ms, baseline, target_ms, costs_ms,
         compile_s, passes):
  summary = metrics.summarize_outputs(outputs)
  num_accepted = np.concatenate([np.asarray(o.stats.num_accepted) for o in outputs])
  betas = np.concatenate([np.asarray(o.stats.acceptance_probs) for o in outputs])
  _, conditional = metrics.per_position_acceptance(num_accepted, tree.depth)
  reached = (num_accepted[..., None] >= np.arange(tree.depth)) & (num_accepted[..., None] >= 0)
  beta_d = [float(betas[..., d][reached[..., d]].mean()) if reached[..., d].any() else 0.0
            for d in range(tree.depth)]
  # In autoregressive steps: the baseline's decode ms per token at this temperature is the unit the
  # speedup is relative to (a separately timed target step drifted by 10 % from it over a run).
  costs = {part: ms / baseline[temperature]["decode_ms"] for part, ms in costs_ms.items()}
  row = {"drafter": name, "tree": tree.name, "tree_size": tree.size, "temperature": temperature,
         "tokens_per_target_call": summary["tokens_per_target_call"],
         "alpha_by_depth": [float(x) for x in conditional], "beta_by_depth": beta_d,
         "cost_draft": costs["draft"], "cost_verify": costs["verify"],
         "cost_accept": costs["accept"], "tree_decode_ms": decode_ms, "tree_e2e_ms": e2e_ms,
         "base_decode_ms": baseline[temperature]["decode_ms"],
         "speedup": baseline[temperature]["decode_ms"] / decode_ms,
         "predicted": float(theory.tree_speedup(beta_d, costs["draft"], costs["verify"],
                                                costs["accept"])),
         "predicted_tokens_per_call": float(theory.tree_expected_tokens(beta_d)),
         "compile_s": compile_s, "passes_s": passes, "summary": summary}
  if temperature == 0:
    row["greedy_equal"] = all(np.array_equal(np.asarray(o.tokens), np.asarray(b)) for o, b in
                              zip(outputs, baseline[0.0]["tokens"]))
  row["measured_over_predicted"] = row["speedup"] / row["predicted"]
  return row


def write(args, rows, baseline, target_ms, keys, prompt_len, total_s):
  lines = [
      f"SmolLM2-135M-Instruct target, float32, batch 1, {len(keys)} held-out HumanEval prompts "
      f"({', '.join(keys)}) padded to {prompt_len} tokens, {args.new_tokens} new tokens, EOS off; "
      f"{platform.machine()} with {os.cpu_count()} cores; {args.repeats} timed pass(es) after "
      f"ahead-of-time compilation and {args.warmup} warm-up run(s). Costs in autoregressive steps "
      f"(the baseline's decode ms per token at that temperature; a target step on 1 token timed "
      f"alone: {target_ms:.1f} ms): draft = the drafter's candidates for the whole "
      f"tree, verify = the target scoring the T nodes, accept = transform + walk + compaction. "
      f"alpha_d = passed / reached at depth d; predicted = theory.tree_speedup(beta_d, costs). "
      f"Total run {total_s / 60:.1f} min.", "",
      "Baseline (autoregressive): " + ", ".join(
          f"T={t:g} {b['decode_ms']:.1f} ms/token" for t, b in baseline.items()) + ".", "",
      "| drafter | tree (T) | temp | tokens / call | predicted | alpha by depth | draft | verify(T) "
      "| accept | ms/token | speedup | predicted | measured / predicted | greedy = target |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['drafter']} | {r['tree']} ({r['tree_size']}) | {r['temperature']:g} "
        f"| {r['tokens_per_target_call']:.2f} | {r['predicted_tokens_per_call']:.2f} | "
        + " ".join(f"{a:.2f}" for a in r["alpha_by_depth"])
        + f" | {r['cost_draft']:.2f} | {r['cost_verify']:.2f} | {r['cost_accept']:.2f} "
        f"| {r['tree_decode_ms']:.1f} | {r['speedup']:.2f}x | {r['predicted']:.2f}x "
        f"| {r['measured_over_predicted']:.2f} | {r.get('greedy_equal', '')} |")
  markdown = "\n".join(lines)
  print(markdown)
  meta = {"args": vars(args), "prompt_keys": keys, "prompt_length": prompt_len,
          "baseline": {t: {k: v for k, v in b.items() if k != "tokens"} for t, b in baseline.items()},
          "target_step_ms": target_ms,
          "jax": jax.__version__, "host": platform.node(), "cpus": os.cpu_count(), "total_s": total_s}
  print("wrote", common.write_results(args.out, rows, markdown, meta))


if __name__ == "__main__":
  main()
