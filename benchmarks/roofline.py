"""The machine's limits and the target's floor: how close a decode step and a verification come to them.

    .venv/bin/python benchmarks/roofline.py [--tokens 1,2,3,4,5,8,12,17,24,32] [--rows 1,2,4,...]

1. Read bandwidth: a jitted sum over a 512 MB buffer (XLA), and a torch sum over the same bytes (the
   peer's library, in its own process so neither side's threads slow the other); the floors use the
   faster of the two (no step reads faster than the machine can).
2. Matrix throughput by rows M: the target's weight shape streamed the way a step streams it, 90
   products of [M, 576] x [576, 1536] with 90 distinct weight matrices (as many bytes as SmolLM2's
   blocks read), in float32 and bfloat16, through XLA, through torch (MKL / oneDNN; the best library
   on this machine) and through specjax's CPU kernels inside a jitted program (ModelSpec.kernels =
   "cpu", when scripts/build_cpu_kernels.sh has built them): GFLOP/s, and the time of the 90
   products.
3. The ridge point (peak FLOP/s over bytes/s) of each path.
4. The target (SmolLM2-135M, batch 1 after a 128-token prompt), for each decoding variant (float32 on
   XLA's kernels, float32 and bfloat16 on specjax's CPU kernels; `--variants`): the floor of a step
   scoring T tokens, max(bytes it must read / bandwidth, FLOPs / the best throughput measured in that
   dtype), beside the measured forward on T tokens (timing.forward_step, timed as the loop runs it:
   timing.step_seconds), T = 1..32: v(T) = step(T) / step(1), and v's floor.

Writes benchmarks/results/roofline.{json,md}. Medians of repeated runs after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import common
from specjax import contracts, loading, timing
from specjax.drafters.model import ModelDrafter
from specjax.models import cpu_kernels, t5

PRODUCTS, IN, OUT = 90, 576, 1536
DTYPES = ("float32", "bfloat16")


def xla_matmul_seconds(rows: int, dtype: str, repeats: int) -> float:
  """Median seconds of PRODUCTS products [rows, IN] x [IN, OUT], each with its own weights."""
  kind = jnp.dtype(dtype)
  weights = jax.random.normal(jax.random.PRNGKey(0), (PRODUCTS, IN, OUT), jnp.float32).astype(kind)
  x = jnp.ones((rows, IN), kind)

  @jax.jit
  def run(x, weights):
    def body(i, total):
      return total + jnp.sum((x @ weights[i]).astype(jnp.float32))
    return jax.lax.fori_loop(0, PRODUCTS, body, jnp.float32(0.0))
  return timing.median_seconds(lambda: run(x, weights).block_until_ready(), repeats)[0]


def cpu_kernels_matmul_seconds(rows: int, dtype: str, repeats: int) -> float | None:
  """The same products through specjax's CPU kernels (models/cpu_kernels.py, csrc/matmul.cc) on
  weights packed once, unrolled and each reading the last one's output as a step's layers do (XLA
  would otherwise run independent calls side by side, which a step never does); None when the
  library is not built."""
  if not cpu_kernels.available():
    return None
  rng = np.random.default_rng(0)
  weights = [cpu_kernels.pack(rng.standard_normal((IN, OUT), np.float32), dtype)
             for _ in range(PRODUCTS)]
  x = jnp.ones((rows, IN), dtype)

  @jax.jit
  def run(x, weights):
    y = jnp.zeros((rows, OUT), jnp.float32)
    for kernel in weights:
      y = cpu_kernels.matmul(x + (1e-3 * y[:, :IN]).astype(x.dtype), kernel)
    return y
  return timing.median_seconds(lambda: run(x, weights).block_until_ready(), repeats)[0]


PEER = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
rows, repeats = json.loads(sys.argv[2]), int(sys.argv[3])
PRODUCTS, IN, OUT = 90, 576, 1536
out = {}
data = torch.ones(512 * 1024 * 1024 // 4)
def median(fn):
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
  return statistics.median(times)
out["bandwidth_gbps"] = data.numel() * 4 / median(lambda: float(data.sum())) / 1e9
for dtype in ("float32", "bfloat16"):
  kind = getattr(torch, dtype)
  weights = torch.randn(PRODUCTS, IN, OUT).to(kind)
  for m in rows:
    x = torch.ones(m, IN, dtype=kind)
    def run():
      with torch.inference_mode():
        total = 0.0
        for i in range(PRODUCTS):
          total += float((x @ weights[i]).float().sum())
    out[f"{dtype}/{m}"] = median(run)
print(json.dumps(out))
"""


def peer_seconds(rows, repeats: int) -> dict | None:
  """torch's figures from its own process, or None when torch is not installed."""
  try:
    done = subprocess.run([sys.executable, "-c", PEER, str(os.cpu_count()),
                           json.dumps(list(rows)), str(repeats)], capture_output=True, text=True,
                          timeout=1800, check=True)
  except (subprocess.CalledProcessError, FileNotFoundError) as error:
    print(f"torch peer not measured: {error}", file=sys.stderr)
    return None
  return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_description() -> str:
  """The CPU's model name and the matrix / vector extensions that decide bfloat16's speed (AMX,
  AVX-512 BF16, AVX-512, AVX2), from /proc/cpuinfo where there is one."""
  try:
    info = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor() or platform.machine()
  name = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")),
              platform.machine())
  flags = set(next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")),
                   []))
  found = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma") if f in flags]
  return f"{name} ({', '.join(found) or 'no AVX2'})"


def step_bytes_and_flops(config, params, cache_length: int, tokens: int,
                         weight_itemsize: int = 4, source_length: int = 0) -> tuple[int, int]:
  """(bytes a step must read: the weights a step reads (cpu_kernels.step_bytes: a T5's decoder
  only) in a dtype of `weight_itemsize` bytes + the valid float32 KV cache (and a T5's
  cross-attention keys and values of `source_length` tokens), FLOPs of scoring `tokens`): the
  matrix products 2 * (parameters touched) per token, the head over the whole vocabulary included,
  and attention 4 * heads * head_dim * (keys attended) per token and layer."""
  as_float32 = jax.tree_util.tree_map(lambda x: np.broadcast_to(np.float32(0), np.shape(x)), params)
  weights = cpu_kernels.step_bytes(as_float32, config) // 4  # the parameters a step reads
  if hasattr(config, "num_decoder_layers"):  # T5: self-attention over the cache, cross over the source
    layers, kv_heads, keys = config.num_decoder_layers, config.num_heads, cache_length + source_length
  else:
    layers, kv_heads, keys = config.num_layers, config.num_kv_heads, cache_length
  kv_bytes = 2 * layers * keys * kv_heads * config.head_dim * 4
  attention = 4 * layers * config.num_heads * config.head_dim * keys
  return weights * weight_itemsize + kv_bytes, tokens * (2 * weights + attention)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokens", default="1,2,3,4,5,6,8,12,17,24,32")
  parser.add_argument("--rows", default="1,2,4,5,8,12,17,24,32,48,64")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--no_peer", action="store_true")
  parser.add_argument("--output", default="roofline")
  parser.add_argument("--variants", default="float32 xla,float32 cpu,bfloat16 cpu")
  parser.add_argument("--checkpoint", default=loading.EMBEDDED_SMOLLM2,
                      help="the target (default the embedded SmolLM2-135M; a T5 checkpoint directory "
                      "such as out/t5_ende/target/hf works too)")
  parser.add_argument("--source_tokens", type=int, default=24,
                      help="a T5 target's encoder input length (its decoder starts from one token)")
  args = parser.parse_args()
  tokens = [int(t) for t in args.tokens.split(",")]
  rows = [int(r) for r in args.rows.split(",")]

  bandwidth = timing.read_bandwidth_gbps(repeats=args.repeats)
  peer = None if args.no_peer else peer_seconds(rows, args.repeats)
  matmul = []
  for dtype in DTYPES:
    for m in rows:
      flops = 2 * PRODUCTS * m * IN * OUT
      xla = xla_matmul_seconds(m, dtype, args.repeats)
      lib = None if peer is None else peer[f"{dtype}/{m}"]
      ours = cpu_kernels_matmul_seconds(m, dtype, args.repeats)
      matmul.append({"dtype": dtype, "rows": m, "xla_ms": 1000 * xla, "xla_gflops": flops / xla / 1e9,
                     "library_ms": None if lib is None else 1000 * lib,
                     "library_gflops": None if lib is None else flops / lib / 1e9,
                     "cpu_kernels_ms": None if ours is None else 1000 * ours,
                     "cpu_kernels_gflops": None if ours is None else flops / ours / 1e9})
  weight_bytes = PRODUCTS * IN * OUT
  ridge = {}
  best_bandwidth = max(bandwidth, peer["bandwidth_gbps"] if peer else 0.0)
  for dtype in DTYPES:
    size = jnp.dtype(dtype).itemsize
    peak = {path: max(r[f"{path}_gflops"] or 0 for r in matmul if r["dtype"] == dtype)
            for path in ("xla", "library", "cpu_kernels")}
    ridge[dtype] = {"xla": peak["xla"] / bandwidth,
                    "library": peak["library"] / peer["bandwidth_gbps"] if peer else np.nan,
                    "cpu_kernels": peak["cpu_kernels"] / best_bandwidth}
    ridge[dtype]["bytes_per_product_set"] = weight_bytes * size

  # The machine's best throughput per dtype, at any row count and through any path: no step computes
  # faster than that, nor reads faster than the best bandwidth.
  peak = {dtype: max(max(r["library_gflops"] or 0, r["xla_gflops"], r["cpu_kernels_gflops"] or 0)
                     for r in matmul if r["dtype"] == dtype) for dtype in DTYPES}

  target = loading.load_model(args.checkpoint)
  config = target.config
  if target.encoder_decoder:  # the encoder's input, and the decoder's start token as its prompt
    source = contracts.Source(jnp.full((1, args.source_tokens), 7, jnp.int32),
                              jnp.asarray([args.source_tokens], jnp.int32))
    prompt, source_length = t5.decoder_prompt(config, 1), args.source_tokens
  else:
    source, source_length = None, 0
    prompt = (jnp.full((1, args.prompt), 7, jnp.int32), jnp.asarray([args.prompt], jnp.int32))
  prompt_length = int(prompt[1][0])
  cache_length = prompt_length + max(tokens) + 2
  verify = []
  for variant in args.variants.split(","):
    dtype_name, kernels = variant.split()
    if kernels == "cpu" and not cpu_kernels.available():
      print(f"{variant}: left out ({cpu_kernels.BUILD_FIX})", file=sys.stderr)
      continue
    model, params = common.decoding_variant(target, dtype_name, kernels)
    state = common.fresh_state(ModelDrafter(model), params, prompt, cache_length, source)
    rows = []
    for t in tokens:
      fresh = jax.tree_util.tree_map(jnp.copy, state)  # the timer donates the state it is given
      ms = 1000 * timing.step_seconds(timing.forward_step(model), params, fresh,
                                      *timing.one_token(prompt, t), args.repeats, rounds=3)
      read, flops = step_bytes_and_flops(config, target.params, prompt_length + t, t,
                                         jnp.dtype(dtype_name).itemsize, source_length)
      floor = max(read / (best_bandwidth * 1e9), flops / (peak[dtype_name] * 1e9))
      rows.append({"variant": variant, "tokens": t, "step_ms": ms, "floor_ms": 1000 * floor,
                   "bandwidth_floor_ms": 1000 * read / (best_bandwidth * 1e9)})
      print(f"{variant} T={t}: {ms:.1f} ms (floor {1000 * floor:.1f})", flush=True)
    for row in rows:
      row["v"] = row["step_ms"] / rows[0]["step_ms"]
      row["v_floor"] = row["floor_ms"] / rows[0]["floor_ms"]
      row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
    verify += rows

  meta = {"machine": cpu_description(), "cpus": os.cpu_count(), "peak_gflops": peak,
          "jax": jax.__version__, "bandwidth_gbps": bandwidth,
          "peer_bandwidth_gbps": None if peer is None else peer["bandwidth_gbps"],
          "floor_bandwidth_gbps": best_bandwidth,
          "ridge_flop_per_byte": ridge, "prompt": prompt_length, "repeats": args.repeats,
          "target": args.checkpoint, "source_tokens": source_length}
  target_name = ("SmolLM2-135M" if args.checkpoint == loading.EMBEDDED_SMOLLM2
                 else f"{args.checkpoint} ({t5.num_params(config) / 1e6:.1f} M parameters)"
                 if target.encoder_decoder else args.checkpoint)
  source_note = f" (its encoder's input {source_length} tokens)" if source is not None else ""
  lines = [f"{datetime.date.today()}, {meta['machine']}, {meta['cpus']} cores: "
           f"`python benchmarks/roofline.py {' '.join(sys.argv[1:])}`", "",
           f"Read bandwidth: XLA {bandwidth:.1f} GB/s"
           + (f", torch {peer['bandwidth_gbps']:.1f} GB/s" if peer else "")
           + f"; the floors use {best_bandwidth:.1f}", "",
           "90 products [M, 576] x [576, 1536], each with its own weights:", "",
           "| dtype | rows | XLA ms | XLA GFLOP/s | torch ms | torch GFLOP/s | CPU kernels ms | "
           "CPU kernels GFLOP/s |", "|---|---|---|---|---|---|---|---|"]
  fmt = lambda v, f: "-" if v is None else f.format(v)
  for r in matmul:
    lines.append(f"| {r['dtype']} | {r['rows']} | {r['xla_ms']:.1f} | {r['xla_gflops']:.0f} | "
                 f"{fmt(r['library_ms'], '{:.1f}')} | {fmt(r['library_gflops'], '{:.0f}')} | "
                 f"{fmt(r['cpu_kernels_ms'], '{:.1f}')} | {fmt(r['cpu_kernels_gflops'], '{:.0f}')} |")
  lines += ["", "Ridge points (peak FLOP/s over read bytes/s): " + "; ".join(
      f"{d} XLA {ridge[d]['xla']:.1f}, torch {ridge[d]['library']:.1f}, CPU kernels "
      f"{ridge[d]['cpu_kernels']:.1f} FLOP/byte" for d in DTYPES),
      "", f"{target_name}, batch 1 after {prompt_length} tokens{source_note}: the forward on T "
      "tokens against its floor", "", "| variant | T | step ms | floor ms | v(T) | v floor | step / floor |",
      "|---|---|---|---|---|---|---|"]
  for r in verify:
    lines.append(f"| {r['variant']} | {r['tokens']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | "
                 f"{r['v']:.2f} | {r['v_floor']:.2f} | {r['step_over_floor']:.2f} |")
  markdown = "\n".join(lines)
  common.write_results(args.output, {"matmul": matmul, "verify": verify}, markdown, meta)
  print(markdown)


if __name__ == "__main__":
  main()
