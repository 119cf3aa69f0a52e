"""SmolLM2-135M decoding in float32 and bfloat16, on XLA's kernels and on specjax's CPU kernels
(specs.ModelSpec.dtype and .kernels), side by side.

    .venv/bin/python benchmarks/dtypes.py [--tokens 1,5,17] [--repeats 5] [--rounds 3] [--prompts 3]

The target's step on T tokens after a 128-token prompt (T = 1: an autoregressive step; T = gamma + 1:
a chain's verification), each variant timed in turn `rounds` times (a slow stretch of the machine
falls on all) and the median taken; then, in each variant, greedy decoding of held-out HumanEval
prompts by the target alone and with prompt lookup (chain:4): the speculative tokens must equal the
target's own in the same variant (guaranteed on the CPU kernels, likely on XLA's), and the first
new token where they part is reported. The variants' outputs are compared with float32 on XLA's too
(they may differ: bfloat16 rounds the weights, the kernels sum in other orders). The CPU kernels'
variants need scripts/build_cpu_kernels.sh (run by scripts/setup.sh); without it they are left out.
`--variants` picks some, e.g. "float32 xla,float32 cpu". Writes benchmarks/results/dtypes.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import common
import roofline
from specjax import loading, timing
from specjax.decoding import autoregressive, core
from specjax.drafters import expansion, lookup
from specjax.drafters.model import ModelDrafter
from specjax.models import cpu_kernels

# (name, ModelSpec.dtype, ModelSpec.kernels)
VARIANTS = (("float32 xla", "float32", "xla"), ("bfloat16 xla", "bfloat16", "xla"),
            ("float32 cpu", "float32", "cpu"), ("bfloat16 cpu", "bfloat16", "cpu"))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokens", default="1,5,17")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=3)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--variants", default=",".join(name for name, _, _ in VARIANTS))
  args = parser.parse_args()
  tokens = [int(t) for t in args.tokens.split(",")]

  target = loading.load_model()
  prompt = (jnp.full((1, 128), 7, jnp.int32), jnp.asarray([128], jnp.int32))
  built = {}
  wanted = args.variants.split(",")
  variants = [v for v in VARIANTS if v[0] in wanted and (v[2] == "xla" or cpu_kernels.available())]
  names = [name for name, _, _ in variants]
  for name, dtype_name, kernels in variants:
    model, params = common.decoding_variant(target, dtype_name, kernels)
    state = common.fresh_state(ModelDrafter(model), params, prompt, 128 + max(tokens) + 2)
    built[name] = (model, params, state)

  step_ms = {(name, t): [] for name in names for t in tokens}
  for _ in range(args.rounds):
    for name in names:
      model, params, state = built[name]
      for t in tokens:
        fresh = jax.tree_util.tree_map(jnp.copy, state)  # the timer donates the state it is given
        step_ms[name, t].append(1000 * timing.step_seconds(
            timing.target_step(model), params, fresh, *timing.one_token(prompt, t), args.repeats))
        print(f"{name} T={t}: {step_ms[name, t][-1]:.1f} ms", flush=True)
  steps = [{"dtype": name, "tokens": t, "step_ms": statistics.median(step_ms[name, t]),
            "each_ms": step_ms[name, t]} for name in names for t in tokens]

  prompts, keys = common.load_prompts(target, args.prompts)
  config = core.DecodeConfig(args.new_tokens, eos_id=target.tokenizer.eos_id,
                             pad_id=target.tokenizer.pad_id)
  shape = autoregressive.DecodeShape(args.new_tokens, eos_id=target.tokenizer.eos_id,
                                     pad_id=target.tokenizer.pad_id)
  outputs = {}
  for name in names:
    model, params, _ = built[name]
    alone = autoregressive.make_generate(model, shape)
    drafter = expansion.SampledChain(lookup.PromptLookupDrafter(target.config.vocab_size), 4)
    speculative = core.make_decode(model, drafter, config)
    key = jax.random.PRNGKey(0)
    outputs[name] = [(np.asarray(alone(params, *p, key, 0.0).tokens),
                      np.asarray(speculative(params, None, *p, key, 0.0).tokens)) for p in prompts]
  checks = [{"dtype": name, "prompts": len(prompts), "new_tokens": args.new_tokens,
             "speculative_equals_target": all(np.array_equal(a, s) for a, s in outputs[name]),
             "first_difference": [first_difference(a, s) for a, s in outputs[name]]}
            for name in names]
  agree = {name: float(np.mean([np.mean(a32 == other) for (a32, _), (other, _) in
                               zip(outputs[names[0]], outputs[name])])) for name in names[1:]}

  meta = {"machine": roofline.cpu_description(), "cpus": os.cpu_count(), "jax": jax.__version__,
          "repeats": args.repeats, "rounds": args.rounds, "prompt_keys": keys,
          "token_agreement_with_float32": agree,
          "cpu_kernels": cpu_kernels.implementation() if cpu_kernels.available() else None}
  lines = [f"{datetime.date.today()}, {meta['machine']}, {meta['cpus']} cores: "
           f"`python benchmarks/dtypes.py {' '.join(sys.argv[1:])}`", "",
           "SmolLM2-135M, batch 1 after 128 tokens: the target's step on T tokens (median of "
           f"{args.rounds} rounds, each the median of {args.repeats} chained calls)", "",
           "| T | " + " | ".join(f"{name} ms" for name in names) + " | " +
           " | ".join(f"{name} / {names[0]}" for name in names[1:]) + " |",
           "|---|" + "---|" * (2 * len(names) - 1)]
  by = {(r["dtype"], r["tokens"]): r["step_ms"] for r in steps}
  for t in tokens:
    lines.append(f"| {t} | " + " | ".join(f"{by[name, t]:.1f}" for name in names) + " | " +
                 " | ".join(f"{by[name, t] / by[names[0], t]:.2f}" for name in names[1:]) + " |")
  lines += ["", f"Greedy, {len(prompts)} held-out HumanEval prompts x {args.new_tokens} tokens, "
            "prompt lookup chain:4 against the target alone:", ""]
  lines += [f"- {c['dtype']}: speculative output equals the target's own: "
            f"{c['speculative_equals_target']}" + (
                "" if c["speculative_equals_target"] else
                f" (first new token that differs, per prompt: {c['first_difference']})")
            for c in checks]
  lines += [f"- {name}: the same tokens as {names[0]} at {100 * share:.0f} % of positions"
            for name, share in agree.items()]
  if meta["cpu_kernels"]:
    lines.append(f"- the CPU kernels' products on this CPU: {meta['cpu_kernels']}")
  markdown = "\n".join(lines)
  common.write_results("dtypes", {"steps": steps, "greedy": checks}, markdown, meta)
  print(markdown)


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
  """The first position where two token arrays differ (None where they are equal)."""
  differs = np.flatnonzero(np.asarray(a).ravel() != np.asarray(b).ravel())
  return int(differs[0]) if differs.size else None


if __name__ == "__main__":
  main()
