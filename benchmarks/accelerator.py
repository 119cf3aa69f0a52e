"""One command that measures a device for speculative decoding: the target's step, its memory floor,
the cost of verifying T tokens, and the speedups the drafters measured on the CPU would give there.

    .venv/bin/python benchmarks/accelerator.py [--shapes smollm2-135m,t5.1.1-small,...]
        [--dtype bfloat16] [--tokens 1,2,3,4,5,8,12,17,24,32] [--repeats 5] [--rounds 3]
        [--prompt 128] [--draft_cost C] [--memory_gib G] [--output DIR] [--tiny]

On the default device of whatever backend JAX finds (CPU, GPU, TPU), for each model shape (random
weights of the real shape; SmolLM2-135M's embedded weights where that asset is installed), in
--dtype (bfloat16 on an accelerator, float32 on a CPU), batch 1 after a --prompt-token prompt (a T5:
a --prompt-token source, its decoder after the start token):

1. the autoregressive ms per token: the target's one-token step timed as the loop runs it
   (timing.chained_timer: steps chained in one program, the cache donated, transform and sampling
   included), the median over --rounds of medians of --repeats calls, every T timed in each round;
2. its memory floor: the bytes one step must read (the weights it touches, the valid KV cache, a
   T5's encoded source) over the device's read bandwidth (timing.read_bandwidth_gbps, the best
   of a probe before the shapes and one after each: a floor takes the fastest reading), and the
   step over that floor;
3. v(T) = the step on T tokens / the step on 1: what verifying T tokens costs, in steps;
4. the speedups specjax.theory predicts with this device's v(T) for the acceptance figures measured
   on the 2-core CPU (ACCEPTANCE: acceptance depends on the models and the text, not on the device).

A shape whose weights and cache would not fit the device's memory is skipped with a line saying so,
checked from its shapes before anything is allocated; on a CPU the 11B and 7B shapes are measured
only when --shapes names them. --tiny is the CI mode: the test shapes, few T and repeats, the same
code otherwise. Writes accelerator-<backend>.{md,json} into --output (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import common
import roofline
from specjax import assets, contracts, loading, models, theory, timing
from specjax.decoding.tree import Tree
from specjax.drafters.model import ModelDrafter
from specjax.models import t5

SHAPES = ("smollm2-135m", "t5.1.1-small", "t5.1.1-xxl", "llama2-7b")
TINY_SHAPES = ("tiny", "t5-tiny")
# Measured on a CPU only when --shapes names them: 11B and 7B parameters take minutes per step there
# and more memory than most hosts have.
CPU_ONLY_WHEN_NAMED = ("t5.1.1-xxl", "llama2-7b")
TOKENS, TINY_TOKENS = "1,2,3,4,5,8,12,17,24,32", "1,2,5,17"
# The share of the free memory a shape's weights, cache and encoded source may take: the rest is for
# the step's activations, the programs' scratch and the copies of the cache the timer donates.
FIT_FRACTION = 0.8
# The shape whose real weights specjax embeds (loading.load_model); every other shape is random.
EMBEDDED_SHAPE = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class Acceptance:
  """One acceptance figure measured on the 2-core CPU, and where it comes from.

  alpha: one figure for a chain drafter (a one-token drafter sampled gamma times: Thm 3.8's i.i.d.
    alpha at that gamma), or the pass chance by depth for a tree drafter (heads reading the target's
    features; their chain:4 is a one-branch tree).
  draft_cost: in target steps, as measured beside it on the CPU: a chain's c (one draft call; an
    iteration makes gamma of them), a tree drafter's whole work per iteration.
  tokens_per_call: the tokens per target call measured with it, where the source gives them.
  """
  drafter: str
  tree: str
  temperature: float
  alpha: tuple[float, ...]
  draft_cost: float
  source: str
  tokens_per_call: float | None = None

  @property
  def kind(self) -> str:
    return "chain" if len(self.alpha) == 1 else "tree"

  @property
  def nodes(self) -> int:
    """T: the tokens the target scores per iteration (gamma + 1 for a chain)."""
    return Tree.from_name(self.tree).size


SPECULATIVE = "benchmarks/results/speculative.md"
ALTERNATIVES = "benchmarks/results/draft_alternatives.md"
TREES = "benchmarks/results/trees.md"
TWELVE = ("docs/results.md, Twelve prompts, three passes (alpha, tokens per call); draft cost "
          "benchmarks/results/trees.md")
DFLASH = "benchmarks/results/dflash-humaneval.md"
# THE acceptance figures the predictions use, all measured with SmolLM2-135M-Instruct as the target
# on held-out HumanEval prompts, each as its source file prints it.
ACCEPTANCE = (
    Acceptance("prompt lookup", "chain:1", 0.0, (0.355,), 0.014, SPECULATIVE),
    Acceptance("prompt lookup", "chain:2", 0.0, (0.426,), 0.014, SPECULATIVE),
    Acceptance("prompt lookup", "chain:3", 0.0, (0.422,), 0.014, SPECULATIVE),
    Acceptance("prompt lookup", "chain:4", 0.0, (0.443,), 0.014, SPECULATIVE),
    Acceptance("prompt lookup", "chain:4", 1.0, (0.329,), 0.014, SPECULATIVE),
    Acceptance("trained draft top8k-d256-L2", "chain:2", 0.0, (0.345,), 0.030, ALTERNATIVES),
    Acceptance("trained draft top8k-d256-L2", "chain:2", 1.0, (0.244,), 0.030, ALTERNATIVES),
    Acceptance("lookup + trained draft", "chain:3", 0.0, (0.546,), 0.035, ALTERNATIVES),
    Acceptance("Medusa heads", "chain:4", 0.0, (0.36, 0.37, 0.34, 0.33), 0.04, TREES, 1.54),
    Acceptance("MTP head", "chain:4", 0.0, (0.52, 0.48, 0.56, 0.61), 0.05, TREES, 1.97),
    Acceptance("MTP head", "spine:4x4", 0.0, (0.71, 0.49, 0.56, 0.67), 0.06, TREES, 2.32),
    Acceptance("lookup + MTP head", "chain:4", 0.0, (0.57, 0.60, 0.74, 0.76), 0.05, TWELVE, 2.28),
    Acceptance("lookup + MTP head", "spine:4x4", 0.0, (0.85, 0.53, 0.73, 0.70), 0.05, TWELVE, 2.80),
    Acceptance("lookup + MTP head", "chain:4", 1.0, (0.32, 0.40, 0.42, 0.65), 0.05, TWELVE, 1.53),
    Acceptance("DFlash block", "chain:4", 0.0, (0.27, 0.21, 0.24, 0.29), 0.08, DFLASH, 1.34),
    Acceptance("DFlash block", "chain:4", 1.0, (0.15, 0.15, 0.07, 1.00), 0.07, DFLASH, 1.18),
)
BLOCK_DRAFTER = ("Block drafter (DFlash: one pass proposes the whole block): its rows above are the "
                 "first 4 positions of a block of 8 (configs/smollm2_dflash.gin, 400 steps on the "
                 "main job's teacher data). A block of B tokens is verified in one call costing "
                 "v(B + 1) steps (the v table): it pays only if it averages more tokens per call "
                 "than that plus its own pass.")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default=None,
                      help=f"comma list of specjax.models.SIZES names (default {','.join(SHAPES)}, "
                      f"or {','.join(TINY_SHAPES)} with --tiny)")
  parser.add_argument("--dtype", default=None, choices=sorted(models.DTYPES),
                      help="default bfloat16 on GPU / TPU, float32 on a CPU")
  parser.add_argument("--tokens", default=None, help="T values for v(T), 1 among them (default "
                      f"{TOKENS}; --tiny {TINY_TOKENS})")
  parser.add_argument("--repeats", type=int, default=None,
                      help="chained calls per median (5; --tiny 2)")
  parser.add_argument("--rounds", type=int, default=None,
                      help="medians per step time (3; --tiny 1)")
  parser.add_argument("--prompt", type=int, default=None,
                      help="prompt tokens, a T5's source tokens (128; --tiny 16)")
  parser.add_argument("--draft_cost", type=float, default=None,
                      help="c in target steps for every figure (a chain's per draft call, a tree "
                      "drafter's per iteration); default each figure's own, measured on the CPU")
  parser.add_argument("--memory_gib", type=float, default=None,
                      help="memory a shape may use instead of what the device reports free")
  parser.add_argument("--output", default=str(common.RESULTS), help="folder for the result files")
  parser.add_argument("--tiny", action="store_true",
                      help="CI mode: the test shapes, few T values and repeats")
  args = parser.parse_args(argv)
  args.named = [] if args.shapes is None else args.shapes.split(",")
  defaults = dict(shapes=",".join(TINY_SHAPES if args.tiny else SHAPES),
                  tokens=TINY_TOKENS if args.tiny else TOKENS, repeats=2 if args.tiny else 5,
                  rounds=1 if args.tiny else 3, prompt=16 if args.tiny else 128)
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.tokens = sorted({int(t) for t in args.tokens.split(",")})
  if args.tokens[0] != 1:
    parser.error("--tokens must include 1: v(T) is the step on T tokens over the step on 1")
  for name in args.shapes.split(","):
    models.config_by_name(name)  # refuses an unknown name, with the known ones
  return args


def say(started: float, message: str) -> None:
  """Progress on stderr (the run takes minutes), with the seconds since the start."""
  print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)


def device_description(device) -> dict:
  """What was measured: the backend, the device kind (on a CPU its model and vector extensions),
  how many devices JAX sees, and the jax / jaxlib versions."""
  backend = jax.default_backend()
  try:
    jaxlib_version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    jaxlib_version = "unknown"
  return {"backend": backend, "device_kind": device.device_kind,
          "device": (f"{roofline.cpu_description()}, {os.cpu_count()} cores" if backend == "cpu"
                     else device.device_kind),
          "devices": jax.device_count(), "jax": jax.__version__, "jaxlib": jaxlib_version,
          "cpus": os.cpu_count()}


def free_memory(device, memory_gib: float | None) -> tuple[int | None, str]:
  """(bytes a shape may use, where that figure comes from): --memory_gib, else the device's
  bytes_limit less what is in use (GPU, TPU), else the host's free memory (a CPU)."""
  if memory_gib is not None:
    return int(memory_gib * 2 ** 30), "--memory_gib"
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), "the device's free memory"
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the host's free memory"
  except (ValueError, OSError, AttributeError):
    return None, "unknown"


def nbytes(tree) -> int:
  """Bytes of a tree of arrays or jax.ShapeDtypeStruct."""
  return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree_util.tree_leaves(tree))


def weights_read(config, param_shapes) -> int:
  """Bytes of the weights a decode step reads: all but a T5's encoder (run once per request) and an
  untied input embedding (a step gathers one row of it); a tied one is read whole as the head."""
  unread = {"encoder"} | (set() if config.tie_embeddings else {"embedding", "token_embedder"})
  return nbytes({name: tree for name, tree in param_shapes.items() if name not in unread})


def probe_inputs(config, prompt_tokens: int):
  """(decoder prompt (tokens[1, P], lengths[1]), source or None) of the timed step: a P-token prompt
  for a decoder-only model; for a T5 a P-token source and the decoder start token, as a sweep's
  probe (experiments/measure.Bench.probe) gives a T5 target."""
  tokens = jnp.full((1, prompt_tokens), 7, jnp.int32)
  lengths = jnp.asarray([prompt_tokens], jnp.int32)
  if isinstance(config, t5.T5Config):
    return t5.decoder_prompt(config, 1), contracts.Source(tokens, lengths)
  return (tokens, lengths), None


def target_params(name: str, config, dtype, seed: int = 0):
  """(params on the default device in `dtype`, what they are): SmolLM2-135M's embedded weights when
  the asset package is installed, else (and for every other shape) random weights of the shape. A
  step's time does not depend on the values."""
  if name == EMBEDDED_SHAPE:
    try:
      loaded = loading.load_model()
    except assets.MissingAssetError:
      loaded = None
    if loaded is not None and loaded.config == config:
      return jax.device_put(models.cast(loaded.params, dtype)), "embedded SmolLM2-135M-Instruct"
  return models.init_params(config, jax.random.PRNGKey(seed), dtype), "random"


def predict(figure: Acceptance, tokens, v, draft_cost: float | None = None) -> dict:
  """The speedup `figure` predicts with v(T) measured at `tokens` (linear between them; None beyond
  them): a chain by Thm 3.8 with the verification's cost (theory.speedup_from_costs), a tree by its
  depth-wise pass chances (theory.tree_speedup), each also with drafting free (its ceiling here).
  The accept step is left out (not measured on this device)."""
  row = {"drafter": figure.drafter, "tree": figure.tree, "temperature": figure.temperature,
         "kind": figure.kind, "nodes": figure.nodes,
         "draft_cost": figure.draft_cost if draft_cost is None else draft_cost}
  if not tokens[0] <= figure.nodes <= tokens[-1]:
    return {**row, "v": None, "speedup": None, "reason": f"T = {figure.nodes} was not measured"}
  v_at = float(np.interp(figure.nodes, tokens, v))
  if figure.kind == "chain":
    gamma = figure.nodes - 1
    expected = theory.expected_tokens(figure.alpha[0], gamma)
    speedup = lambda c: theory.speedup_from_costs(figure.alpha[0], gamma, gamma * c, v_at, 0.0)
  else:
    expected = theory.tree_expected_tokens(figure.alpha)
    speedup = lambda c: theory.tree_speedup(figure.alpha, c, v_at)
  return {**row, "v": v_at, "interpolated": figure.nodes not in tokens,
          "tokens_per_call": float(expected), "speedup": float(speedup(row["draft_cost"])),
          "speedup_free_draft": float(speedup(0.0))}


def skip_reason(name: str, config, dtype, args, device, backend: str) -> tuple[str | None, dict]:
  """(why the shape is skipped or None, its sizes), from shapes alone: nothing is allocated."""
  if backend == "cpu" and name in CPU_ONLY_WHEN_NAMED and name not in args.named:
    return "measured on a CPU only when --shapes names it", {}
  model = models.model_for(config, None, dtype)
  params = jax.eval_shape(lambda p: models.cast(p, dtype), models.param_shapes(config))
  prompt, source = probe_inputs(config, args.prompt)
  cache_length = prompt[0].shape[1] + max(args.tokens) + 2
  cache = jax.eval_shape(lambda: model.init_cache(1, cache_length))
  context = jax.eval_shape(model.encode, params, source)  # None for a decoder-only model
  sizes = {"parameters": sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)),
           "weight_bytes": nbytes(params), "weight_bytes_read": weights_read(config, params),
           "kv_bytes_per_token": nbytes((cache.keys, cache.values)) // cache_length,
           "context_bytes": nbytes(context), "cache_length": cache_length,
           "prompt_width": int(prompt[0].shape[1])}
  need = nbytes(params) + len(args.tokens) * (nbytes(cache) + nbytes(context))  # a state per T
  budget, where = free_memory(device, args.memory_gib)
  if budget is not None and need > FIT_FRACTION * budget:
    return (f"does not fit: needs {need / 2 ** 30:.2f} GiB (weights, a KV cache and encoded "
            f"source per T), "
            f"more than {FIT_FRACTION:.0%} of {budget / 2 ** 30:.2f} GiB ({where})"), sizes
  return None, sizes


def measure_shape(name: str, config, dtype, sizes: dict, args, started: float) -> dict:
  """The one-token step, v(T) and the bytes a step reads of one shape (batch 1 after the probe
  prompt); `with_floor` adds the floor once the bandwidth is known."""
  model = models.model_for(config, None, dtype)
  probe = ModelDrafter(model)  # only for its prefilled cache and context, as the sweeps' StepCosts
  prompt, source = probe_inputs(config, args.prompt)
  params, weights = target_params(name, config, dtype)
  state = common.fresh_state(probe, params, prompt, sizes["cache_length"], source)
  say(started, f"{name}: {weights} weights, {sizes['parameters'] / 1e6:.1f} M parameters; "
      f"timing T = {', '.join(map(str, args.tokens))}")
  # One timer (one program per T) and one copy of the state per T, which the timer donates and
  # threads through; every round times each T in turn, so a slow stretch of a shared machine falls
  # on all of them rather than on a few T's whole measurement.
  timer = timing.chained_timer(timing.target_step(model))
  inputs = {t: timing.one_token(prompt, t) for t in args.tokens}
  states = {t: jax.tree_util.tree_map(jnp.copy, state) for t in args.tokens}
  del state
  seconds = {t: [] for t in args.tokens}
  for round_ in range(args.rounds):
    for t in args.tokens:
      median, states[t] = timer(params, states[t], *inputs[t], args.repeats)
      seconds[t].append(median)
      if round_ == 0:  # the first round compiles a program per T: say how far it got
        say(started, f"{name}: step on {t} token(s) compiled, {1000 * median:.3f} ms")
    say(started, f"{name}: round {round_ + 1} of {args.rounds}, ms by T: "
        + ", ".join(f"{t}: {1000 * seconds[t][-1]:.3f}" for t in args.tokens))
  del params, states
  gc.collect()
  steps = [{"tokens": t, "step_ms": 1000 * statistics.median(seconds[t]),
            "v": statistics.median(seconds[t]) / statistics.median(seconds[1])}
           for t in args.tokens]
  kv_read = sizes["kv_bytes_per_token"] * (sizes["prompt_width"] + 1)
  read = sizes["weight_bytes_read"] + kv_read + sizes["context_bytes"]
  v = [row["v"] for row in steps]
  return {"shape": name, "status": "measured", "weights": weights, **sizes,
          "kv_bytes_read": kv_read, "bytes_read": read, "ms_per_token": steps[0]["step_ms"],
          "steps": steps,
          "predictions": [predict(f, args.tokens, v, args.draft_cost) for f in ACCEPTANCE]}


def with_floor(row: dict, bandwidth_gbps: float) -> dict:
  """A measured shape's row with its memory floor (the bytes a step reads over the bandwidth) and
  its one-token step over that floor."""
  floor_ms = 1000 * row["bytes_read"] / (bandwidth_gbps * 1e9)
  return {**row, "floor_ms": floor_ms, "step_over_floor": row["ms_per_token"] / floor_ms}


def prediction_cell(p: dict) -> str:
  """'speedup at the drafter's cost / with drafting free (v at T)', * where v is interpolated."""
  if p["speedup"] is None:
    return "-"
  return (f"{p['speedup']:.2f}x / {p['speedup_free_draft']:.2f}x "
          f"(v {p['v']:.2f}{'*' if p['interpolated'] else ''})")


def figure_cells(figure: Acceptance, prediction: dict) -> str:
  """The columns that describe an acceptance figure: drafter, tree (T), temperature, alpha, tokens
  per call (from alpha, and as measured on the CPU where known) and the drafter's cost."""
  expected = prediction.get("tokens_per_call")
  measured = figure.tokens_per_call
  tokens = (f"{'-' if expected is None else f'{expected:.2f}'} "
            f"({'-' if measured is None else f'{measured:.2f}'})")
  return (f"| {figure.drafter} | {figure.tree} ({figure.nodes}) | {figure.temperature:g} | "
          f"{' '.join(f'{a:.2f}' for a in figure.alpha)} | {tokens} | "
          f"{prediction['draft_cost']:.3f} |")


def markdown(rows: list[dict], meta: dict, args) -> str:
  """The results as markdown; its first line says the date, the device and the exact command."""
  measured = [r for r in rows if r["status"] == "measured"]
  lines = [f"{meta['date']}, {meta['backend']} backend, {meta['device']} ({meta['devices']} "
           f"device(s), one measured), jax {meta['jax']}, jaxlib {meta['jaxlib']}, "
           f"{meta['dtype']}: `python benchmarks/accelerator.py {meta['command']}`", "",
           f"Backend **{meta['backend']}**, device **{meta['device_kind']}**; read bandwidth "
           f"{meta['bandwidth_gbps']:.1f} GB/s (the best of {len(meta['bandwidth_probes_gbps'])} "
           f"probes, one before the shapes and one after each). Batch 1 after a {args.prompt}-"
           f"token prompt (a T5: a {args.prompt}-token source, its decoder after the start token); "
           f"steps timed as the loop runs them, the median of {args.rounds} medians of "
           f"{args.repeats} chained calls.",
           "", "| shape | weights | parameters (M) | ms / token | MB read / step | floor ms | "
           "step / floor |", "|---|---|---|---|---|---|---|"]
  for r in measured:
    lines.append(f"| {r['shape']} | {r['weights']} | {r['parameters'] / 1e6:.1f} | "
                 f"{r['ms_per_token']:.3f} | {r['bytes_read'] / 1e6:.1f} | {r['floor_ms']:.3f} | "
                 f"{r['step_over_floor']:.2f} |")
  skipped = [f"- {r['shape']}: skipped, {r['reason']}" for r in rows if r["status"] != "measured"]
  lines += [""] + skipped if skipped else []
  if measured:
    lines += ["", "v(T) = the step on T tokens / the step on 1:", "",
              "| shape | " + " | ".join(f"T={t}" for t in args.tokens) + " |",
              "|---|" + "---|" * len(args.tokens)]
    lines += [f"| {r['shape']} | " + " | ".join(f"{s['v']:.2f}" for s in r["steps"]) + " |"
              for r in measured]
    lines += ["", "Predicted speedups with this device's v(T) and the acceptance figures measured "
              "on the 2-core CPU (the table ACCEPTANCE in benchmarks/accelerator.py, each from its "
              "source); each cell: at the drafter's cost c / with drafting free. c is the CPU's "
              "measured cost in target steps unless --draft_cost sets it; the accept step is left "
              "out. Interpolated v marked *.", "",
              "| drafter | tree (T) | temp | alpha | tokens / call (CPU measured) | c | "
              + " | ".join(r["shape"] for r in measured) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(measured)]
    for i, figure in enumerate(ACCEPTANCE):
      lines.append(figure_cells(figure, measured[0]["predictions"][i]) + " "
                   + " | ".join(prediction_cell(r["predictions"][i]) for r in measured) + " |")
    lines += ["", "Sources: " + "; ".join(sorted({f.source for f in ACCEPTANCE}))]
  lines += ["", BLOCK_DRAFTER]
  return "\n".join(lines)


def main(argv=None):
  args = parse_args(argv)
  started = time.perf_counter()
  device = jax.devices()[0]
  meta = device_description(device)
  backend = meta["backend"]
  dtype_name = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
  dtype = models.dtype_named(dtype_name)
  say(started, f"measuring backend {backend}, device {meta['device_kind']} ({meta['device']}), "
      f"jax {meta['jax']}, jaxlib {meta['jaxlib']}, {dtype_name}")
  probes = [timing.read_bandwidth_gbps(repeats=args.repeats)]
  say(started, f"read bandwidth {probes[-1]:.1f} GB/s")
  rows = []
  for name in args.shapes.split(","):
    config = models.config_by_name(name)
    reason, sizes = skip_reason(name, config, dtype, args, device, backend)
    if reason is not None:
      rows.append({"shape": name, "status": "skipped", "reason": reason, **sizes})
      say(started, f"{name}: skipped, {reason}")
      continue
    rows.append(measure_shape(name, config, dtype, sizes, args, started))
    probes.append(timing.read_bandwidth_gbps(repeats=args.repeats))
    say(started, f"{name}: {rows[-1]['ms_per_token']:.3f} ms per token; read bandwidth now "
        f"{probes[-1]:.1f} GB/s")
  bandwidth = max(probes)
  rows = [with_floor(r, bandwidth) if r["status"] == "measured" else r for r in rows]
  meta.update(date=str(datetime.date.today()),
              command=" ".join(sys.argv[1:] if argv is None else argv),
              dtype=dtype_name, bandwidth_gbps=bandwidth, bandwidth_probes_gbps=probes,
              prompt=args.prompt, tokens=args.tokens,
              repeats=args.repeats, rounds=args.rounds, draft_cost=args.draft_cost,
              total_s=time.perf_counter() - started, block_drafter=BLOCK_DRAFTER,
              acceptance=[{**dataclasses.asdict(f), "kind": f.kind, "nodes": f.nodes}
                          for f in ACCEPTANCE])
  text = markdown(rows, meta, args)
  out = common.write_results(f"accelerator-{backend}", rows, text, meta, args.output)
  print(text)
  say(started, f"wrote {out}/accelerator-{backend}.{{md,json}}")


if __name__ == "__main__":
  main()
