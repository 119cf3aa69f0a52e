"""Greedy decoding speed of SmolLM2-135M: specjax vs Hugging Face generate, side by side.

    .venv/bin/python benchmarks/autoregressive.py [--batches 1,4,16] [--new_tokens 128] [--repeats 3]

Same weights (the embedded GGUF, dequantized to float32 by each side), the same input ids (the first
`prompt_tokens` tokens of HumanEval prompts; equal lengths, so neither side pads), EOS disabled so
both emit exactly `new_tokens` tokens. Medians of `repeats` runs after one warm-up run. The floor is
the bytes one decode step must read (all weights + the valid KV cache at the mean length) over the
measured read bandwidth. Writes benchmarks/results/autoregressive.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform

import jax
import numpy as np

import common
from specjax import assets, loading, timing
from specjax.decoding import autoregressive
from specjax.data import prompts as prompt_sets


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batches", default="1,4,16")
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--prompt_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no_peer", action="store_true")
  args = parser.parse_args()
  batches = [int(b) for b in args.batches.split(",")]

  path = assets.smollm2_gguf_path()
  target = loading.load_model()
  config, tok, params = target.config, target.tokenizer, jax.device_put(target.params)
  ids = [tok.encode(p) for p in prompt_sets.load_prompt_set("humaneval").prompts]
  ids = [i[:args.prompt_tokens] for i in ids if len(i) >= args.prompt_tokens]

  peer = None
  if not args.no_peer:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    torch.set_num_threads(os.cpu_count())
    peer = transformers.AutoModelForCausalLM.from_pretrained(
        pathlib.Path(path).parent, gguf_file=pathlib.Path(path).name, torch_dtype=torch.float32).eval()

  bandwidth = timing.read_bandwidth_gbps()
  weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  rows = []
  for batch in batches:
    prompts = np.array(ids[:batch], np.int32)
    lengths = np.full((batch,), args.prompt_tokens, np.int32)
    shape = autoregressive.DecodeShape(args.new_tokens, eos_id=None)
    generate = autoregressive.make_generate(target.model, shape)
    run = lambda: jax.block_until_ready(generate(params, prompts, lengths, jax.random.PRNGKey(0), 0.0, 1.0))
    ours_s, ours_all = timing.median_seconds(run, args.repeats)
    ours_tokens = np.asarray(run().tokens)
    mean_length = args.prompt_tokens + args.new_tokens / 2
    cache_bytes = (2 * config.num_layers * batch * mean_length * config.num_kv_heads * config.head_dim * 4)
    floor_s = args.new_tokens * (weight_bytes + cache_bytes) / (bandwidth * 1e9)
    row = {"batch": batch, "specjax_tokens_per_s": batch * args.new_tokens / ours_s,
           "specjax_ms_per_step": 1000 * ours_s / args.new_tokens, "specjax_runs_s": ours_all,
           "floor_ms_per_step": 1000 * floor_s / args.new_tokens}
    row["specjax_over_floor"] = row["specjax_ms_per_step"] / row["floor_ms_per_step"]
    if peer is not None:
      import torch  # pylint: disable=import-outside-toplevel
      inputs = torch.from_numpy(prompts).long()
      def peer_run():
        with torch.no_grad():
          return peer.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                               max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               pad_token_id=tok.pad_id)
      peer_s, peer_all = timing.median_seconds(peer_run, args.repeats)
      peer_tokens = peer_run()[:, args.prompt_tokens:].numpy()
      row.update({"hf_tokens_per_s": batch * args.new_tokens / peer_s, "hf_runs_s": peer_all,
                  "speedup_vs_hf": peer_s / ours_s,
                  "same_tokens_as_hf": float(np.mean(ours_tokens == peer_tokens))})
    rows.append(row)
    print(row, flush=True)

  lines = [f"SmolLM2-135M-Instruct greedy, {args.new_tokens} new tokens after {args.prompt_tokens}-token "
           f"prompts, float32, {platform.machine()} with {os.cpu_count()} cores; read bandwidth "
           f"{bandwidth:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB. Median of {args.repeats} runs.",
           "",
           "| batch | specjax tok/s | HF tok/s | specjax / HF | ms/step | floor ms/step | / floor | tokens = HF |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['batch']} | {r['specjax_tokens_per_s']:.1f} | {r.get('hf_tokens_per_s', float('nan')):.1f} "
                 f"| {r.get('speedup_vs_hf', float('nan')):.2f}x | {r['specjax_ms_per_step']:.1f} "
                 f"| {r['floor_ms_per_step']:.1f} | {r['specjax_over_floor']:.2f}x "
                 f"| {r.get('same_tokens_as_hf', float('nan')):.0%} |")
  markdown = "\n".join(lines)
  print(markdown)
  meta = {"bandwidth_gbps": bandwidth, "weight_bytes": weight_bytes, "jax": jax.__version__,
          "args": vars(args), "host": platform.node(), "cpus": os.cpu_count()}
  common.write_results("autoregressive", rows, markdown, meta)


if __name__ == "__main__":
  main()
