"""Trained draft shapes for SmolLM2-135M, side by side: held-out fit, c, alpha, predicted and measured
speedup on this CPU.

    .venv/bin/python benchmarks/draft_alternatives.py [--shapes top8k-d256-L2,...]
        [--prompts 4] [--new_tokens 64] [--gammas 2,3,4,5]

Every variant is distilled by specjax.training.draft_model with the same teacher data (the library's default
TeacherSpec = configs/smollm2_draft.gin's, cached once under $SPECJAX_CACHE/teacher) and the default
TrainSpec (300 steps of 4,096 tokens) unless its row says otherwise, into
out/draft_alternatives/<name>; `top8k-d256-L2` is the embedded default's draft, so a finished
out/smollm2_draft is copied there instead of trained again. Then one run of benchmarks/speculative.py
measures all of them (and the default behind prompt lookup) together on held-out HumanEval prompts
(batch 1, EOS on, each prompt its own key; baseline, speculative pass and the iteration's parts
timed in turn `--repeats` times, both sides' decode ms/token by one method; c from chained single
steps, alpha from the loop's own statistics, Thm 3.8 with and without the measured verification
cost v). Writes
benchmarks/results/draft_alternatives.{json,md} (fit and best rows per variant) beside the
speculative benchmark's own draft_alternatives_speed.{json,md}.

`full-d256-L2` (a head over all 49,152 tokens) is listed but not in the default run: its training
step costs about 5x the top-8k one here (the head's matmuls dominate), and its step costs c = 0.08-0.09
before training (benchmarks/results/draft_shapes.md), twice the top-8k head's.

Variants (head_dim 64, GQA 2:1, SwiGLU 3d; the head is untied and scores the K tokens with the most
teacher probability, or the whole vocabulary for `full`):
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys
import time

import common
from specjax import specs
from specjax.training import teacher, draft_model, trainer

DEFAULT_STEPS = trainer.TrainSpec().steps
# name -> (shape, training steps)
SHAPES = {
    "top8k-d256-L2": (draft_model.DraftShape(), DEFAULT_STEPS),
    "top8k-d256-L1": (draft_model.DraftShape(num_layers=1), DEFAULT_STEPS),
    "top4k-d256-L2": (draft_model.DraftShape(head_size=4096), DEFAULT_STEPS),
    "top8k-d256-L2-3x": (draft_model.DraftShape(), 3 * DEFAULT_STEPS),
    "top16k-d256-L2": (draft_model.DraftShape(head_size=16384), DEFAULT_STEPS),
    "full-d256-L2": (draft_model.DraftShape(head_size=0), DEFAULT_STEPS),
}
DEFAULT_RUN = ("top8k-d256-L2", "top8k-d256-L1", "top4k-d256-L2", "top8k-d256-L2-3x")
__doc__ += "".join(f"  {name:17s} {steps} steps, {shape}\n" for name, (shape, steps) in SHAPES.items())
ROOT = pathlib.Path(__file__).resolve().parent.parent


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default=",".join(DEFAULT_RUN))
  parser.add_argument("--prompts", type=int, default=4)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--gammas", default="2,3,4,5")
  parser.add_argument("--repeats", type=int, default=3, help="timed passes per point, in turn")
  parser.add_argument("--out_dir", default="out/draft_alternatives")
  return parser.parse_args()


def main():
  args = parse_args()
  started = time.perf_counter()
  names = args.shapes.split(",")
  unknown = set(names) - set(SHAPES)
  if unknown:
    raise SystemExit(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
  fits = {}
  for name in names:
    shape, steps = SHAPES[name]
    out = ROOT / args.out_dir / name
    trained_default = ROOT / "out" / "smollm2_draft"
    if (name == "top8k-d256-L2" and not out.exists()
        and (trained_default / "summary.json").exists()):
      shutil.copytree(trained_default, out)  # the same spec: train_draft finds it finished
    fits[name] = draft_model.train(
        output_dir=str(out), target=specs.ModelSpec(), draft=shape, teacher=teacher.TeacherSpec(),
        training=dataclasses.replace(trainer.TrainSpec(), steps=steps))
  drafters = ",".join([f"model:{args.out_dir}/{name}/hf" for name in names]
                      + [f"lookup+model:{args.out_dir}/{names[0]}/hf"])
  subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speculative.py"), "--drafters", drafters,
                  "--gammas", args.gammas, "--temperatures", "0,1", "--prompts", str(args.prompts),
                  "--new_tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                  "--out", "draft_alternatives_speed",
                  "--no_overhead"], check=True, cwd=ROOT)
  speed = json.loads((ROOT / "benchmarks" / "results" / "draft_alternatives_speed.json").read_text())
  write(args, names, fits, speed, time.perf_counter() - started)


def _best(rows, drafter, temperature):
  mine = [r for r in rows if r.get("drafter") == drafter and r.get("temperature") == temperature]
  return max(mine, key=lambda r: r["decode_speedup"]) if mine else None


def write(args, names, fits, speed, seconds):
  lines = [
      "Trained drafts for the SmolLM2-135M-Instruct target (float32, 2-core x86_64 CPU), same "
      f"teacher data, measured on {args.prompts} held-out HumanEval prompts x {args.new_tokens} "
      f"tokens, batch 1, EOS on, {args.repeats} timed pass(es) per point, gammas {args.gammas}. `.venv/bin/python "
      f"benchmarks/draft_alternatives.py`; {seconds / 60:.0f} min in all (training included).", "",
      "Held-out fit = the validation split of the teacher data (KL from the target's top-32 "
      "coarsened distribution, top-1 agreement, sum min(p, q) over the target's top-32). Speed "
      "columns are each shape's best gamma (by measured decode speedup) at temperature 0 and 1: "
      "alpha, c, Thm 3.8's prediction, the same with the measured verification cost v, and the "
      "measured decode speedup over the autoregressive baseline.", "",
      "| draft | params (M) | steps | train s | KL | top-1 | sum min | T | gamma | alpha | c | "
      "Thm 3.8 | with v | measured |", "|" + "---|" * 14]
  rows = []
  variants = [(name, f"model:{args.out_dir}/{name}/hf") for name in names]
  variants.append((f"lookup+{names[0]}", f"lookup+model:{args.out_dir}/{names[0]}/hf"))
  for name, drafter in variants:
    fit = fits[name.removeprefix("lookup+")]
    after = fit["validation_after"]
    steps = SHAPES[name.removeprefix("lookup+")][1]
    for temperature in (0.0, 1.0):
      best = _best(speed["rows"], drafter, temperature)
      if best is None:
        continue
      rows.append({"shape": name, "temperature": temperature, "gamma": best["gamma"],
                   "alpha": best["alpha"], "c": best["c"], "predicted": best["predicted_speedup"],
                   "predicted_v": best["predicted_speedup_with_verify_cost"],
                   "speedup": best["decode_speedup"],
                   "params_m": fit["draft_parameters"] / 1e6, "steps": steps,
                   "train_seconds": fit["train_seconds"],
                   "kl": after["kl"], "top1": after["top1_agreement"], "overlap": after["overlap"]})
      r = rows[-1]
      lines.append(f"| {name} | {r['params_m']:.1f} | {steps} | {r['train_seconds']:.0f} | {r['kl']:.3f} | "
                   f"{r['top1']:.3f} | {r['overlap']:.3f} | {temperature:g} | {r['gamma']} | "
                   f"{r['alpha']:.3f} | {r['c']:.3f} | {r['predicted']:.2f}x | "
                   f"{r['predicted_v']:.2f}x | {r['speedup']:.2f}x |")
  common.write_results("draft_alternatives", rows, "\n".join(lines),
                       {"args": vars(args), "seconds": seconds})
  print("\n".join(lines))


if __name__ == "__main__":
  main()
