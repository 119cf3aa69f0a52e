"""Where SmolLM2-135M's step on T tokens spends its time: the MLPs against the rest, each beside the
time its weights take to read.

    .venv/bin/python benchmarks/step_parts.py [--tokens 1,2,5,8,17] [--repeats 7] [--rounds 3]

Two programs per T, timed in turn `rounds` times as the loop runs a step (timing.chained_timer): the
whole step, and the step with every block's MLP replaced by the identity. Their difference is what
the MLPs cost; the rest is attention (its projections and the cache), the norms, the embedding and
the head over the whole vocabulary. Each part's floor is the bytes of its weights over the machine's
read bandwidth (all of it bandwidth-bound up to T = 8 on this CPU: benchmarks/roofline.py). Removing
attention instead is not measured: with no attention the step no longer reads the cache, and XLA
hoists the whole step out of the timing loop. Writes benchmarks/results/step_parts.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import jax
import jax.numpy as jnp

import common
import roofline
from specjax import loading, timing
from specjax.drafters.model import ModelDrafter
from specjax.models import decoder_only, layers

PROMPT = 128


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokens", default="1,2,5,8,17")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  tokens = [int(t) for t in args.tokens.split(",")]

  target = loading.load_model()
  params = jax.device_put(target.params)
  prompt = (jnp.full((1, PROMPT), 7, jnp.int32), jnp.asarray([PROMPT], jnp.int32))
  with_mlp = layers.GatedMLP.__call__
  timers = {}
  for variant, call in (("whole step", with_mlp), ("without MLPs", lambda self, x: x)):
    layers.GatedMLP.__call__ = call  # traced now: each timer is compiled while its variant is set
    model = decoder_only.model(target.config)
    state = common.fresh_state(ModelDrafter(model), params, prompt, PROMPT + max(tokens) + 2)
    for t in tokens:
      timer, inputs = timing.chained_timer(timing.target_step(model)), timing.one_token(prompt, t)
      timing.timed_rounds(timer, params, jax.tree_util.tree_map(jnp.copy, state), *inputs, 1, 1)
      timers[variant, t] = (timer, state, inputs)
  layers.GatedMLP.__call__ = with_mlp

  seconds = {key: [] for key in timers}
  for _ in range(args.rounds):
    for key, (timer, state, inputs) in timers.items():
      fresh = jax.tree_util.tree_map(jnp.copy, state)  # the timer donates the state it is given
      seconds[key].append(timing.timed_rounds(timer, params, fresh, *inputs, args.repeats, 1))
  ms = {key: 1000 * statistics.median(values) for key, values in seconds.items()}

  bandwidth = timing.read_bandwidth_gbps(repeats=args.repeats)
  mlp_bytes = sum(leaf.nbytes for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
                  if "mlp" in jax.tree_util.keystr(path))
  all_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
  floor_ms = lambda nbytes: 1000 * nbytes / (bandwidth * 1e9)
  rows = []
  for t in tokens:
    whole, rest = ms["whole step", t], ms["without MLPs", t]
    rows.append({"tokens": t, "step_ms": whole, "mlp_ms": whole - rest, "rest_ms": rest,
                 "mlp_floor_ms": floor_ms(mlp_bytes), "rest_floor_ms": floor_ms(all_bytes - mlp_bytes),
                 "each_ms": {variant: [1000 * s for s in seconds[variant, t]]
                             for variant in ("whole step", "without MLPs")}})
  meta = {"machine": roofline.cpu_description(), "cpus": os.cpu_count(), "jax": jax.__version__,
          "bandwidth_gbps": bandwidth, "mlp_bytes": mlp_bytes, "bytes": all_bytes,
          "prompt": PROMPT, "repeats": args.repeats, "rounds": args.rounds}
  lines = [f"{datetime.date.today()}, {meta['machine']}, {meta['cpus']} cores: "
           f"`python benchmarks/step_parts.py {' '.join(sys.argv[1:])}`", "",
           f"SmolLM2-135M float32, batch 1 after {PROMPT} tokens; read bandwidth {bandwidth:.1f} GB/s; "
           f"median of {args.rounds} rounds in turn", "",
           "| T | step ms | MLPs ms | MLPs floor | MLPs / floor | rest ms | rest floor | rest / floor |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['tokens']} | {r['step_ms']:.1f} | {r['mlp_ms']:.1f} | {r['mlp_floor_ms']:.1f} | "
                 f"{r['mlp_ms'] / r['mlp_floor_ms']:.2f} | {r['rest_ms']:.1f} | "
                 f"{r['rest_floor_ms']:.1f} | {r['rest_ms'] / r['rest_floor_ms']:.2f} |")
  markdown = "\n".join(lines)
  common.write_results("step_parts", rows, markdown, meta)
  print(markdown)


if __name__ == "__main__":
  main()
