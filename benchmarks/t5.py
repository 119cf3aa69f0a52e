"""Greedy T5 decoding: specjax vs Hugging Face `generate`, side by side, on the same weights and ids.

    .venv/bin/python benchmarks/t5.py [--sizes t5-small,t5.1.1-small] [--batches 1,4]
        [--source_tokens 48] [--new_tokens 64] [--repeats 5]

Random weights of the named T5 shape (T5 1.0 small: ReLU, tied head; T5 1.1 small: gated GELU, untied),
written once as a Hugging Face directory that both sides load, so the weights are identical. The same
source ids (random ids from the 32k vocabulary, no padding) for both; EOS off (min_new_tokens on the
peer) so both emit exactly new_tokens tokens. Time is end to end: encoding the source and decoding,
median of `repeats` runs after one warm-up run (specjax compiles ahead of time, outside the timing).
Writes benchmarks/results/t5.{json,md}. Runs unchanged on GPU / TPU (the peer runs on CPU torch).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile

import jax
import numpy as np

import common
from specjax import contracts, timing
from specjax.decoding import autoregressive
from specjax.checkpoints import hf_t5
from specjax.models import t5


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="t5-small,t5.1.1-small")
  parser.add_argument("--batches", default="1,4")
  parser.add_argument("--source_tokens", type=int, default=48)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--no_peer", action="store_true")
  args = parser.parse_args()
  import torch  # the peer (test extra): pinned CPU wheel
  import transformers
  torch.set_num_threads(os.cpu_count())

  rows = []
  for size in args.sizes.split(","):
    config = t5.SIZES[size]
    params = jax.device_get(t5.init_params(config, jax.random.PRNGKey(0)))
    with tempfile.TemporaryDirectory() as directory:
      hf_t5.save(directory, config, params)
      peer = transformers.T5ForConditionalGeneration.from_pretrained(
          directory, dtype=torch.float32).eval()
    params = jax.device_put(params)
    for batch in [int(b) for b in args.batches.split(",")]:
      rng = np.random.RandomState(batch)
      source = rng.randint(2, 32000, (batch, args.source_tokens)).astype(np.int32)
      lengths = np.full((batch,), args.source_tokens, np.int32)
      prompt = t5.decoder_prompt(config, batch)
      generate = autoregressive.make_generate(
          t5.model(config), autoregressive.DecodeShape(args.new_tokens, eos_id=None))
      inputs = (params, *prompt, jax.random.PRNGKey(0), 0.0, 1.0,
                contracts.Source(source, lengths))
      compiled = generate.lower(*inputs).compile()
      ours = lambda: jax.block_until_ready(compiled(*inputs))
      ours_s, ours_runs = timing.median_seconds(ours, args.repeats)
      ours_tokens = np.asarray(ours().tokens)
      row = {"size": size, "batch": batch, "specjax_tokens_per_s": batch * args.new_tokens / ours_s,
             "specjax_runs_s": ours_runs}
      if not args.no_peer:
        ids = torch.from_numpy(source).long()

        def peer_run():
          with torch.no_grad():
            return peer.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, decoder_start_token_id=0,
                                 pad_token_id=0, eos_token_id=1)
        peer_s, peer_runs = timing.median_seconds(peer_run, args.repeats)
        peer_tokens = peer_run()[:, 1:].numpy()
        row.update(hf_tokens_per_s=batch * args.new_tokens / peer_s, hf_runs_s=peer_runs,
                   speedup=peer_s / ours_s,
                   tokens_equal=float(np.mean(peer_tokens == ours_tokens)))
      rows.append(row)
      print(row, flush=True)
  write(args, rows)


def write(args, rows):
  lines = [f"Random-weight T5 shapes, greedy, {args.source_tokens}-token sources, {args.new_tokens} "
           f"new tokens (EOS off), float32, end to end (encoder + decoder); {platform.machine()} "
           f"with {os.cpu_count()} cores, jax backend {jax.default_backend()}; median of "
           f"{args.repeats} runs after a warm-up.", "",
           "| shape | batch | specjax tok/s | HF tok/s | specjax / HF | tokens = HF |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['size']} | {r['batch']} | {r['specjax_tokens_per_s']:.1f} | "
                 f"{r.get('hf_tokens_per_s', float('nan')):.1f} | {r.get('speedup', float('nan')):.2f}x"
                 f" | {100 * r.get('tokens_equal', float('nan')):.0f}% |")
  markdown = "\n".join(lines)
  print(markdown)
  print("wrote", common.write_results("t5", rows, markdown, {"args": vars(args),
                                                             "jax": jax.__version__,
                                                             "host": platform.node()}))


if __name__ == "__main__":
  main()
