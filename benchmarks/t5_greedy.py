"""Greedy speculative T5 output against the target's own on every held-out message, with BLEU / chrF.

    .venv/bin/python benchmarks/t5_greedy.py [--experiment t5_ende|t5_gettext] [--gamma 5]
        [--batch_size 16] [--new_tokens 32] [--kernels xla|cpu] [--limit N]

Needs the experiment trained: `t5_gettext` (the embedded one, scripts/main.sh, out/t5_gettext/; its
166 held-out `gettext_ende` messages, none seen in training in any language) or `t5_ende` (docs/t5.md,
out/t5_ende/; the 2,315 messages of the wagtail, django-allauth and sphinx catalogs, `heldout_catalogs`).
Decodes them with `python -m specjax.run`'s generate job: the target alone, then speculatively with each
draft, batches of `batch_size` right-padded sources with ragged acceptance per row. Prints, per decoding,
how many outputs equal the target's token for token, BLEU and chrF (sacrebleu) against the catalogs'
translations (outputs with their placeholders restored), the target calls, and the decode time
against the target alone; copying the English source is the quality floor. Writes
benchmarks/results/<experiment>_greedy.md. Runs unchanged on GPU / TPU (with --kernels xla).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import gin
import sacrebleu

from specjax import run
from specjax.data import placeholders, prompts

DRAFTS = ("draft_small", "draft_base", "draft_large")
PROMPT_SETS = {"t5_gettext": ("gettext_ende", "heldout"), "t5_ende": ("heldout_catalogs", "all")}


def generate(out: pathlib.Path, name: str, drafter: str | None, args) -> list[dict]:
  prompt_set, split = PROMPT_SETS[args.experiment]
  gin.clear_config()
  run.parse_gin(["configs/smollm2_generate.gin"], [
      f"generation.Generate.output_dir = '{out / name}'",
      f"specs.ModelSpec.checkpoint = 'out/{args.experiment}/target/hf'",
      f"specs.ModelSpec.kernels = '{args.kernels}'",
      f"specs.PromptSpec.name = '{prompt_set}'", f"specs.PromptSpec.split = '{split}'",
      f"specs.PromptSpec.limit = {args.limit}", "specs.PromptSpec.style = 't5'",
      f"specs.PromptSpec.batch_size = {args.batch_size}",
      f"specs.DecodeSpec.max_new_tokens = {args.new_tokens}",
      f"generation.Generate.drafter = {repr(drafter) if drafter else None}",
      f"generation.Generate.gamma = {args.gamma}"])
  gin.get_configurable(run.main)()
  return [json.loads(line) for line in (out / name / "generations.jsonl").read_text().splitlines()]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--experiment", choices=sorted(PROMPT_SETS), default="t5_ende")
  parser.add_argument("--gamma", type=int, default=5)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--kernels", choices=("xla", "cpu"), default="xla")
  parser.add_argument("--limit", type=int, default=None, help="the first N messages only")
  args = parser.parse_args()
  out = pathlib.Path(f"out/{args.experiment}/greedy")
  name, split = PROMPT_SETS[args.experiment]
  messages = prompts.load_prompt_set(name, split, args.limit, "t5")
  reference = dict(zip(messages.keys, messages.references))
  keys = list(messages.keys)
  # Outputs are scored as shipped: the English's placeholders restored (protected prompt sets).
  shipped = lambda rows: [placeholders.restore(rows[k]["text"], placeholders.find(k)) for k in keys]
  quality = lambda texts: (sacrebleu.corpus_bleu(texts, [[reference[k] for k in keys]]).score,
                           sacrebleu.corpus_chrf(texts, [[reference[k] for k in keys]]).score)
  target = {r["key"]: r for r in generate(out, "target", None, args)}
  # Rows of one batch share its wall time and target calls: count each batch once.
  batches = lambda rows: {(r["batch_seconds"], r["target_calls"]) for r in rows}
  seconds = lambda rows: sum(s for s, _ in batches(rows))
  calls = lambda rows: sum(c for _, c in batches(rows))
  lines = [f"Greedy, {len(target)} held-out {name} messages, batch {args.batch_size}, gamma "
           f"{args.gamma}, up to {args.new_tokens} new tokens, {args.kernels} kernels "
           f"(python benchmarks/t5_greedy.py --experiment {args.experiment} --kernels {args.kernels} "
           f"--gamma {args.gamma} --batch_size {args.batch_size} --new_tokens {args.new_tokens}"
           f"{'' if args.limit is None else f' --limit {args.limit}'})",
           "", "| decoding | outputs equal to the target's | BLEU | chrF | tokens | target calls "
           "(all batches) | decode seconds | vs target alone |", "|---|---|---|---|---|---|---|---|"]
  bleu, chrf = quality(keys)  # the English source itself
  lines.append(f"| copying the English source | - | {bleu:.1f} | {chrf:.1f} | - | - | - | - |")
  base_seconds = seconds(target.values())
  bleu, chrf = quality(shipped(target))
  tokens = sum(r["num_generated"] for r in target.values())
  lines.append(f"| target alone | - | {bleu:.1f} | {chrf:.1f} | {tokens} | "
               f"{calls(target.values())} | {base_seconds:.2f} | 1.00x |")
  for draft in DRAFTS:
    rows = {r["key"]: r for r in generate(out, draft, f"model:out/{args.experiment}/{draft}/hf", args)}
    equal = sum(r["new_tokens"] == target[k]["new_tokens"] for k, r in rows.items())
    bleu, chrf = quality(shipped(rows))
    lines.append(f"| speculative, {draft} | {equal} / {len(rows)} | {bleu:.1f} | {chrf:.1f} | "
                 f"{sum(r['num_generated'] for r in rows.values())} | {calls(rows.values())} | "
                 f"{seconds(rows.values()):.2f} | {base_seconds / seconds(rows.values()):.2f}x |")
  text = "\n".join(lines) + "\n"
  print(text)
  pathlib.Path(f"benchmarks/results/{args.experiment}_greedy.md").write_text(text)


if __name__ == "__main__":
  main()
