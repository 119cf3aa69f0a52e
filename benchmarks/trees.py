"""Token trees side by side with the autoregressive baseline: tokens per target call, where the time
goes, measured vs predicted speedup.

    .venv/bin/python benchmarks/trees.py [--drafters lookup,bigram,mtp:out/smollm2_mtp/heads]
        [--trees "chain:3;spine:3x3;full:3,2,1"] [--temperatures 0,1] [--prompts 8] [--repeats 3]
        [--new_tokens 64] [--task humaneval] [--checkpoint embedded:smollm2] [--dtype float32]
        [--kernels xla] [--out trees]

The tree sweep's measurement (experiments/tree_sweep.measure_point on an experiments/measure.Bench)
without a run directory: for every drafter x tree x temperature, on the task's first `--prompts`
held-out prompts (batch 1, EOS on, each prompt its own random key), the baseline and the tree loop
are timed side by side prompt by prompt, `--repeats` passes (measure.side_by_side), one iteration's
parts (draft, verify(T), accept: the loop's own methods, timing.iteration_timer) three times a pass,
and both sides' decode ms per token found by one method (measure.paired_decode_seconds). Columns,
as in trees.md of the sweep:

  tokens / call   committed tokens per tree verification (after the first token);
  alpha by depth  conditional pass rate at depth d (passed d / reached d);
  draft, verify(T), accept
                  one iteration's parts in autoregressive steps (the baseline's decode ms per token
                  at that temperature): the drafter's candidates, the target scoring the T nodes,
                  the walk (transform at every node) with the commit and the cache compaction;
  speedup         baseline decode ms/token over the tree loop's; predicted = theory.tree_speedup.
Drafters: any registered drafter name (specjax.drafters.registry): `lookup`, `bigram`, `model:<dir>`
(a one-token drafter as a tree of its top-k), `heads:<dir>`, `mtp:<dir>`, `lookup+heads:<dir>`,
`lookup+mtp:<dir>`, `dflash:<dir>`; the kind column is registry.label (with `--sampled`, "own q,
rejection" marks a chain drawn from the drafter's distribution). Writes benchmarks/results/{--out}.{json,md};
runs unchanged on GPU / TPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
from tqdm import tqdm

import common
from experiments import measure, plots, tree_sweep
from specjax import loading, specs
from specjax.decoding.tree import Tree
from specjax.drafters import registry


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--drafters", default="lookup,bigram")
  parser.add_argument("--trees", default="chain:3,spine:3x3,full:3,2,1",
                      help="comma list; full:W1,W2 shapes use ';' between trees if they hold commas")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3, help="timed passes per point")
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--task", default="humaneval", help="a prompt set of specjax.data.prompts or a .jsonl")
  parser.add_argument("--checkpoint", default=specs.ModelSpec().checkpoint)
  parser.add_argument("--dtype", default=None, help="specs.ModelSpec.dtype: float32 or bfloat16")
  parser.add_argument("--kernels", default=None, help="specs.ModelSpec.kernels: cpu or xla")
  parser.add_argument("--style", default="chat", help="prompt style: chat, or t5 for a T5 target")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sampled", action="store_true",
                      help="also measure every chain at temperature > 0 drawn from the drafter's own "
                           "distribution and verified by chain rejection (drafters that have one: "
                           "dflash); by default candidates are point masses, verified by the walk")
  parser.add_argument("--out", default="trees")
  return parser.parse_args()


def parse_trees(text: str) -> list[str]:
  """'chain:3,spine:3x3,full:3,2,1' -> tree names: a new tree starts at each 'kind:'."""
  names, current = [], ""
  for part in text.replace(";", ",").split(","):
    if ":" in part and current:
      names.append(current)
      current = part
    else:
      current = f"{current},{part}" if current else part
  names.append(current)
  return [Tree.from_name(name).name for name in names]


def main():
  args = parse_args()
  started = time.perf_counter()
  grid = tree_sweep.TreeSweepSpec(
      tasks=(args.task,), drafters=tuple(args.drafters.split(",")),
      trees=tuple(parse_trees(args.trees)),
      temperatures=tuple(float(t) for t in args.temperatures.split(",")),
      prompts_per_task=args.prompts, repeats=args.repeats)
  points = grid.points()  # validates every name before the target is loaded
  target, _ = loading.load_target(specs.ModelSpec(args.checkpoint, dtype=args.dtype,
                                                  kernels=args.kernels), (1, 1))
  for name in grid.drafters:  # as the sweep: heads / MTP are refused for a T5 target, with the fix
    registry.check(name, target.config)
  bench = measure.Bench(target, measure.task_prompt_sets(grid.tasks, grid.prompts_per_task, args.style),
                        specs.DecodeSpec(max_new_tokens=args.new_tokens), args.seed, args.style,
                        grid.drafters, largest_tree=max(Tree.from_name(t).size for t in grid.trees))
  if args.sampled:  # only drafters that have a distribution of their own to draw a chain from
    points += [{**point, "sampled": True} for point in points
               if point["temperature"] > 0 and Tree.from_name(point["tree"]).is_chain
               and bench.drafter(point["drafter"], Tree.from_name(point["tree"]), True)[0].sampled]
  print(f"{len(points)} points; setup {time.perf_counter() - started:.0f}s", flush=True)
  rows = []
  for point in tqdm(points, desc="trees", unit="point"):
    rows.append({**point, **tree_sweep.measure_point(bench, grid.repeats, point)})
    r = rows[-1]
    tqdm.write(f"{r['drafter']}{' (own q)' if r.get('sampled') else ''} {r['tree']} "
               f"T={r['temperature']:g}: "
               f"{r['tokens_per_target_call']:.2f} tokens/call, speedup {r['decode_speedup']:.2f}x, "
               f"predicted {r['predicted_speedup']:.2f}x"
               + ("" if r["temperature"] else f", greedy equal: {r['outputs_match_baseline']}"))
  total_s = time.perf_counter() - started
  header = (f"{measure.size_name(target.config)} target ({args.checkpoint}), "
            f"{args.dtype or 'float32'} on {'the CPU' if args.kernels == 'cpu' else 'XLA'}'s "
            f"kernels, batch 1, {len(bench.prompts[args.task])} held-out {args.task} prompts, "
            f"{args.new_tokens} new tokens, EOS on; {platform.machine()} with {os.cpu_count()} "
            f"cores, jax {jax.__version__}; {args.repeats} timed pass(es) per point, "
            f"{measure.PASSES}. Total run {total_s / 60:.1f} min.")
  markdown = header + "\n\n" + tree_sweep.tree_table(rows).markdown()
  print(markdown)
  meta = {"args": vars(args), "jax": jax.__version__, "host": platform.node(),
          "cpus": os.cpu_count(), "total_s": total_s}
  print("wrote", common.write_results(args.out, rows, markdown, meta))
  print("wrote", plots.accepted_per_call(rows, common.RESULTS / f"{args.out}-accepted.png"))


if __name__ == "__main__":
  main()
