"""Greedy decoding speed of SmolLM2-135M: specjax vs Hugging Face generate, side by side.

    .venv/bin/python benchmarks/autoregressive.py [--batches 1,4,16] [--new_tokens 128] [--repeats 3]
        [--variants "float32 xla,float32 cpu"]

Same weights (the embedded GGUF, dequantized to float32 by each side), the same input ids (the first
`prompt_tokens` tokens of HumanEval prompts; equal lengths, so neither side pads), EOS disabled so
both emit exactly `new_tokens` tokens, end to end (prefill included). specjax decodes in each variant
(ModelSpec.dtype and .kernels; "cpu" needs scripts/build_cpu_kernels.sh), Hugging Face in float32.
Medians of `repeats` runs after one warm-up run. Hugging Face
runs in a process of its own, after specjax's timings (`--peer_only`): in one process torch's and
XLA's thread pools slowed each other. The floor is the bytes one decode step must read (all weights
+ the valid KV cache at the mean length) over the measured read bandwidth. Writes
benchmarks/results/autoregressive.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

import jax
import numpy as np

import common
import roofline
from specjax import assets, loading, models, timing
from specjax.decoding import autoregressive
from specjax.data import prompts as prompt_sets


def peer_only(ids_file: str, out_file: str, new_tokens: int, repeats: int) -> None:
  """Hugging Face generate on the batches in ids_file ({batch: ids}), in this process alone ->
  out_file {batch: {"seconds", "runs_s", "tokens"}}."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(os.cpu_count())
  path = pathlib.Path(assets.smollm2_gguf_path())
  peer = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
  pad_id = loading.load_model().tokenizer.pad_id
  results = {}
  for batch, ids in json.loads(pathlib.Path(ids_file).read_text()).items():
    inputs = torch.tensor(ids, dtype=torch.long)

    def peer_run():
      with torch.no_grad():
        return peer.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad_id)
    seconds, runs = timing.median_seconds(peer_run, repeats)
    results[batch] = {"seconds": seconds, "runs_s": runs,
                      "tokens": peer_run()[:, inputs.shape[1]:].tolist()}
    print(f"Hugging Face, batch {batch}: {seconds:.2f} s", flush=True)
  pathlib.Path(out_file).write_text(json.dumps(results))


def run_peer(batches: dict, new_tokens: int, repeats: int) -> dict:
  """peer_only in a child process (this script again): {batch: its results}."""
  with tempfile.TemporaryDirectory() as tmp:
    ids_file, out_file = pathlib.Path(tmp, "ids.json"), pathlib.Path(tmp, "peer.json")
    ids_file.write_text(json.dumps({str(b): ids.tolist() for b, ids in batches.items()}))
    subprocess.run([sys.executable, __file__, "--peer_only", str(ids_file), str(out_file),
                    "--new_tokens", str(new_tokens), "--repeats", str(repeats)], check=True)
    return {int(b): r for b, r in json.loads(out_file.read_text()).items()}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batches", default="1,4,16")
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--prompt_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no_peer", action="store_true")
  parser.add_argument("--variants", default="float32 xla,float32 cpu",
                      help="specjax's ModelSpec (dtype kernels) pairs, comma-separated")
  parser.add_argument("--peer_only", nargs=2, metavar=("IDS_JSON", "OUT_JSON"),
                      help="internal: time Hugging Face alone in this process")
  args = parser.parse_args()
  if args.peer_only:
    peer_only(*args.peer_only, args.new_tokens, args.repeats)
    return
  batches = [int(b) for b in args.batches.split(",")]

  target = loading.load_model()
  config, tok = target.config, target.tokenizer
  ids = [tok.encode(p) for p in prompt_sets.load_prompt_set("humaneval").prompts]
  ids = [i[:args.prompt_tokens] for i in ids if len(i) >= args.prompt_tokens]

  bandwidth = timing.read_bandwidth_gbps()
  rows = []
  for variant in args.variants.split(","):
    dtype_name, kernels = variant.split()
    model, params = common.decoding_variant(target, dtype_name, kernels)
    weight_bytes = sum(x.size for x in jax.tree_util.tree_leaves(target.params)) * \
        np.dtype(models.DTYPES[dtype_name]).itemsize
    for batch in batches:
      prompts = np.array(ids[:batch], np.int32)
      lengths = np.full((batch,), args.prompt_tokens, np.int32)
      shape = autoregressive.DecodeShape(args.new_tokens, eos_id=None)
      generate = autoregressive.make_generate(model, shape)
      run = lambda: jax.block_until_ready(generate(params, prompts, lengths,
                                                   jax.random.PRNGKey(0), 0.0, 1.0))
      ours_s, ours_all = timing.median_seconds(run, args.repeats)
      ours_tokens = np.asarray(run().tokens)
      mean_length = args.prompt_tokens + args.new_tokens / 2
      cache_bytes = 2 * config.num_layers * batch * mean_length * config.num_kv_heads * \
          config.head_dim * 4
      floor_s = args.new_tokens * (weight_bytes + cache_bytes) / (bandwidth * 1e9)
      row = {"variant": variant, "batch": batch,
             "specjax_tokens_per_s": batch * args.new_tokens / ours_s,
             "specjax_ms_per_step": 1000 * ours_s / args.new_tokens, "specjax_runs_s": ours_all,
             "floor_ms_per_step": 1000 * floor_s / args.new_tokens}
      row["specjax_over_floor"] = row["specjax_ms_per_step"] / row["floor_ms_per_step"]
      rows.append(row)
      row["specjax_tokens"] = ours_tokens
      print({k: v for k, v in row.items() if k != "specjax_tokens"}, flush=True)
  if not args.no_peer:
    peer = run_peer({b: np.array(ids[:b], np.int32) for b in batches}, args.new_tokens,
                    args.repeats)
    for row in rows:
      theirs, seconds = peer[row["batch"]], peer[row["batch"]]["seconds"]
      ours_s = row["specjax_ms_per_step"] * args.new_tokens / 1000
      row.update({"hf_tokens_per_s": row["batch"] * args.new_tokens / seconds,
                  "hf_runs_s": theirs["runs_s"], "speedup_vs_hf": seconds / ours_s,
                  "same_tokens_as_hf": float(np.mean(row["specjax_tokens"] == np.asarray(
                      theirs["tokens"])))})
  for row in rows:
    del row["specjax_tokens"]

  lines = [f"SmolLM2-135M-Instruct greedy, {args.new_tokens} new tokens after {args.prompt_tokens}-token "
           f"prompts, end to end, Hugging Face in float32; {roofline.cpu_description()}, "
           f"{os.cpu_count()} cores; read bandwidth {bandwidth:.1f} GB/s (the floor's). Median of "
           f"{args.repeats} runs.", "",
           "| specjax variant | batch | specjax tok/s | HF tok/s | specjax / HF | ms/step | floor ms/step | / floor | tokens = HF |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['variant']} | {r['batch']} | {r['specjax_tokens_per_s']:.1f} | {r.get('hf_tokens_per_s', float('nan')):.1f} "
                 f"| {r.get('speedup_vs_hf', float('nan')):.2f}x | {r['specjax_ms_per_step']:.1f} "
                 f"| {r['floor_ms_per_step']:.1f} | {r['specjax_over_floor']:.2f}x "
                 f"| {r.get('same_tokens_as_hf', float('nan')):.0%} |")
  markdown = "\n".join(lines)
  print(markdown)
  meta = {"bandwidth_gbps": bandwidth, "machine": roofline.cpu_description(), "jax": jax.__version__,
          "args": vars(args), "host": platform.node(), "cpus": os.cpu_count()}
  common.write_results("autoregressive", rows, markdown, meta)


if __name__ == "__main__":
  main()
