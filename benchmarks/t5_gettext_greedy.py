"""Greedy speculative T5 output against the target's own, on every held-out gettext_ende message.

    .venv/bin/python benchmarks/t5_gettext_greedy.py [--out out/t5_gettext/greedy] [--gamma 5]
        [--batch_size 16] [--new_tokens 32]

Needs the embedded T5 experiment trained (scripts/main.sh, out/t5_gettext/). Decodes all held-out
English -> German messages (166, none seen in training in any language) with `python -m specjax.run`'s
generate job: the target alone, then speculatively with each draft, batches of `batch_size` right-padded
sources with ragged acceptance per row. Prints, per draft, how many outputs equal the target's token
for token, the target calls per generated token, and the decode time against the target alone; writes
benchmarks/results/t5_gettext_greedy.md. Runs unchanged on GPU / TPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import gin

from specjax import run

DRAFTS = ("draft_small", "draft_base", "draft_large")


def generate(out: pathlib.Path, name: str, drafter: str | None, args) -> list[dict]:
  gin.clear_config()
  run.parse_gin(["configs/smollm2_generate.gin"], [
      f"generation.Generate.output_dir = '{out / name}'",
      "specs.ModelSpec.checkpoint = 'out/t5_gettext/target/hf'",
      "specs.PromptSpec.name = 'gettext_ende'", "specs.PromptSpec.split = 'heldout'",
      "specs.PromptSpec.limit = None", "specs.PromptSpec.style = 't5'",
      f"specs.PromptSpec.batch_size = {args.batch_size}",
      f"specs.DecodeSpec.max_new_tokens = {args.new_tokens}",
      f"generation.Generate.drafter = {repr(drafter) if drafter else None}",
      f"generation.Generate.gamma = {args.gamma}"])
  gin.get_configurable(run.main)()
  return [json.loads(line) for line in (out / name / "generations.jsonl").read_text().splitlines()]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="out/t5_gettext/greedy")
  parser.add_argument("--gamma", type=int, default=5)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=32)
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  target = {r["key"]: r for r in generate(out, "target", None, args)}
  # Rows of one batch share its wall time and target calls: count each batch once.
  batches = lambda rows: {(r["batch_seconds"], r["target_calls"]) for r in rows}
  seconds = lambda rows: sum(s for s, _ in batches(rows))
  calls = lambda rows: sum(c for _, c in batches(rows))
  lines = [f"Greedy, {len(target)} held-out gettext_ende messages, batch {args.batch_size}, "
           f"gamma {args.gamma}, up to {args.new_tokens} new tokens (python benchmarks/t5_gettext_greedy.py)",
           "", "| decoding | outputs equal to the target's | tokens | target calls (all batches) | "
           "decode seconds | vs target alone |", "|---|---|---|---|---|---|"]
  base_seconds = seconds(target.values())
  tokens = sum(r["num_generated"] for r in target.values())
  lines.append(f"| target alone | - | {tokens} | {calls(target.values())} | {base_seconds:.2f} | "
               "1.00x |")
  for draft in DRAFTS:
    rows = generate(out, draft, f"model:out/t5_gettext/{draft}/hf", args)
    equal = sum(r["new_tokens"] == target[r["key"]]["new_tokens"] for r in rows)
    lines.append(f"| speculative, {draft} | {equal} / {len(rows)} | "
                 f"{sum(r['num_generated'] for r in rows)} | "
                 f"{calls(rows)} | "
                 f"{seconds(rows):.2f} | {base_seconds / seconds(rows):.2f}x |")
  text = "\n".join(lines) + "\n"
  print(text)
  pathlib.Path("benchmarks/results/t5_gettext_greedy.md").write_text(text)


if __name__ == "__main__":
  main()
