"""Where the milliseconds of a decode go, by the specjax function that wrote the operations.

    .venv/bin/python benchmarks/step_profile.py [--variants float32,float32-cpu,bfloat16-cpu]
        [--repeats 5] [--new_tokens 32] [--gamma 4]

For each variant (float32 through XLA; float32 or bfloat16 on specjax's CPU kernels,
ModelSpec.kernels = "cpu", when scripts/build_cpu_kernels.sh has built them) and SmolLM2-135M at
batch 1 on one held-out HumanEval prompt, two programs are profiled with jax.profiler: the
autoregressive decode of `--new_tokens` tokens, and the speculative decode of the same tokens with
prompt lookup as a chain of `--gamma` (the loop: draft, verify on gamma + 1 tokens, accept). Every
operation XLA ran is charged to the part of the decode JAX named it after (the flax module path with
the layer number dropped, or the jitted helper, and the primitive: `layers_*/mlp/ffi_call` is the
MLPs' products on the CPU kernels, `layers_*/attn/dot_general` XLA's products in attention,
`layers_*/attn/scatter` the cache writes), and the time per target call is reported by part; an
operation the compiled program leaves unnamed (XLA's own products often are) is reported by its
kind, e.g. `(dot, unnamed)`.

The profiler adds its own cost to every operation, so the totals run above a plain timed run; read the
shares. Writes benchmarks/results/step_profile.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import os
import re
import sys
import tempfile

import jax
from jax.profiler import ProfileData

import common
import roofline
from specjax import loading
from specjax.decoding import autoregressive, core
from specjax.drafters import expansion, lookup
from specjax.models import cpu_kernels

# name: (ModelSpec.dtype, ModelSpec.kernels)
VARIANTS = {"float32": ("float32", "xla"), "float32-cpu": ("float32", "cpu"),
            "bfloat16-cpu": ("bfloat16", "cpu")}
_OP = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def label(op_name: str) -> str:
  """The part of a decode an operation belongs to, from the name JAX gave it: the flax module path
  (layer numbers dropped: all 30 blocks add up) or the jitted helper, then the primitive, e.g.
  `layers_*/attn/dot_general`, `layers_*/mlp/ffi_call` (the CPU kernels' products), `jit(sample_with_uniform)/...`."""
  parts = op_name.split("/")
  if parts and parts[0].startswith("jit("):
    parts = parts[1:]  # the outer program
  parts = [re.sub(r"^layers_\d+$", "layers_*", p) for p in parts
           if p not in ("while", "body", "cond", "DecoderOnly") and not p.startswith("branch_")]
  return "/".join(parts) or "(unnamed)"


def op_labels(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name: label} from a compiled program's text; a custom call's label names its
  target (`.../ffi_call:specjax_cpu_attention`)."""
  labels = {}
  for line in hlo_text.splitlines():
    match = _OP.match(line)
    if match:
      target = _TARGET.search(line)
      labels[match.group(1)] = label(match.group(2)) + (f":{target.group(1)}" if target else "")
  return labels


def profile(compiled, args, repeats: int) -> dict[str, float]:
  """{function: seconds per run} of a compiled program, summed over the operations it ran."""
  owners = op_labels(compiled.as_text())

  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as directory:
    jax.profiler.start_trace(directory)
    for _ in range(repeats):
      jax.block_until_ready(compiled(*args))
    jax.profiler.stop_trace()
    data = ProfileData.from_file(sorted(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True))[-1])
  seconds = collections.defaultdict(float)
  for plane in data.planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      for event in line.events:
        stats = dict(event.stats)
        op = stats.get("hlo_op")
        if op is None or event.name.startswith("ThunkExecutor"):
          continue
        # An operation the compiled text gives no name (XLA's own products often): its kind.
        part = owners.get(op) or f"({op.rsplit('.', 1)[0]}, unnamed)"
        seconds[part] += event.duration_ns * 1e-9 / repeats
  return dict(seconds)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--variants", default="float32,float32-cpu,bfloat16-cpu")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--gamma", type=int, default=4)
  args = parser.parse_args()
  target = loading.load_model()
  (prompt,), keys = common.load_prompts(target, 1)
  tokenizer = target.tokenizer
  results = {}
  for variant in args.variants.split(","):
    dtype_name, kernels = VARIANTS[variant]
    if kernels == "cpu" and not cpu_kernels.available():
      print(f"{variant}: left out ({cpu_kernels.BUILD_FIX})", file=sys.stderr)
      continue
    model, params = common.decoding_variant(target, dtype_name, kernels)
    key = jax.random.PRNGKey(0)
    alone = jax.jit(autoregressive.make_generate(model, autoregressive.DecodeShape(
        args.new_tokens, eos_id=None, pad_id=tokenizer.pad_id)))
    drafter = expansion.SampledChain(lookup.PromptLookupDrafter(target.config.vocab_size), args.gamma)
    speculative = jax.jit(core.make_decode(model, drafter, core.DecodeConfig(
        args.new_tokens, eos_id=None, pad_id=tokenizer.pad_id)))
    programs = {"autoregressive": (alone, (params, *prompt, key, 0.0)),
                f"lookup chain:{args.gamma}": (speculative, (params, None, *prompt, key, 0.0))}
    for name, (fn, call_args) in programs.items():
      out = fn(*call_args)
      calls = int(out.target_calls) + 1 if hasattr(out, "target_calls") else args.new_tokens
      compiled = fn.lower(*call_args).compile()
      seconds = profile(compiled, call_args, args.repeats)
      results[variant, name] = {"target_calls": calls,
                                "ms_per_call": {f: 1000 * s / calls for f, s in seconds.items()}}
      print(f"{variant} {name}: {calls} target calls, "
            f"{sum(results[variant, name]['ms_per_call'].values()):.1f} ms per call", flush=True)

  lines = [f"{datetime.date.today()}, {roofline.cpu_description()}, {os.cpu_count()} cores: "
           f"`python benchmarks/step_profile.py {' '.join(sys.argv[1:])}`", "",
           f"SmolLM2-135M, batch 1, one held-out HumanEval prompt ({keys[0]}), {args.new_tokens} "
           "new tokens, greedy; ms per target call (the speculative loop's calls verify "
           f"{args.gamma + 1} tokens) under the profiler, by the part of the decode "
           f"(median-free sums over {args.repeats} runs):", ""]
  for (variant, name), row in results.items():
    total = sum(row["ms_per_call"].values())
    lines += [f"**{variant}, {name}** ({row['target_calls']} target calls, {total:.1f} ms per call)",
              "", "| part | ms per call | share |", "|---|---|---|"]
    for part, ms in sorted(row["ms_per_call"].items(), key=lambda item: -item[1]):
      if ms >= 0.01 * total:
        lines.append(f"| `{part}` | {ms:.2f} | {100 * ms / total:.0f} % |")
    rest = sum(ms for ms in row["ms_per_call"].values() if ms < 0.01 * total)
    lines += [f"| (each under 1 %) | {rest:.2f} | {100 * rest / total:.0f} % |", ""]
  markdown = "\n".join(lines)
  common.write_results("step_profile", [{"variant": v, "program": n, **r}
                                        for (v, n), r in results.items()], markdown,
                       {"machine": roofline.cpu_description(), "cpus": os.cpu_count(),
                        "jax": jax.__version__, "prompt_keys": keys, "args": vars(args)})
  print(markdown)


if __name__ == "__main__":
  main()
