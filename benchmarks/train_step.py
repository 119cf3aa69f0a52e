"""A T5 training step against the machine's matrix throughput: how close training comes to it.

    .venv/bin/python benchmarks/train_step.py [--gin_file configs/t5_ende/target.gin] \
        [--widths 8,16,32,64]

1. The step (`seq2seq_steps.Trainer.train_step`: teacher-forced loss, gradient, optimizer update) of
   the config's model and TrainSpec on a random batch of each bucket width (tokens_per_batch // width
   rows): median seconds, the step's FLOPs (XLA's cost analysis), GFLOP/s, and its floor, the FLOPs
   over the throughput XLA reaches on one plain product of the same size ([tokens, width of the
   model] x [width, MLP]).
2. Why dense layers flatten their rows (`layers.dense`): the gradient of one dense layer,
   x[rows, width, E] x kernel[E, MLP], written as a product with two leading dims (as the layers
   were) and with the leading dims flattened into one (as they are), one after the other.

Writes benchmarks/results/train_step.{json,md}. Medians of repeated runs after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np

import common
import roofline
from specjax import timing, train
from specjax.training import seq2seq, seq2seq_steps, trainer


def configured(gin_file: str):
  """(T5 config, TrainSpec) a training config names (its vocabulary size from TaskSpec.vocab_size)."""
  gin.clear_config()
  train.parse_gin([gin_file], [])
  task = gin.get_configurable(seq2seq.TaskSpec)()
  shape = gin.get_configurable(seq2seq.T5Shape)()
  spec = gin.get_configurable(trainer.TrainSpec)()
  return shape.config(task.vocab_size), spec


def random_batch(rows: int, width: int, vocab_size: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  ids = lambda: rng.integers(1, vocab_size, (rows, width)).astype(np.int32)
  return {"inputs": ids(), "input_lengths": np.full((rows,), width, np.int32),
          "decoder_inputs": ids(), "targets": ids(), "mask": np.ones((rows, width), np.float32)}


def step_row(config, spec, width: int, repeats: int) -> dict:
  steps = seq2seq_steps.Trainer(config, spec)
  params = seq2seq_steps.t5_init(config, 0)
  state = {"params": params, "opt_state": steps.optimizer.init(params)}
  batch = random_batch(max(1, spec.tokens_per_batch // width), width, config.vocab_size)

  # One compile: the executable whose cost analysis gives the FLOPs is the one timed.
  compiled = steps.train_step.lower(state["params"], state["opt_state"], batch).compile()
  analysis = compiled.cost_analysis()
  flops = float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])

  def one_step():
    state["params"], state["opt_state"], loss = compiled(state["params"], state["opt_state"], batch)
    loss.block_until_ready()

  seconds, _ = timing.median_seconds(one_step, repeats)
  return {"width": width, "rows": batch["inputs"].shape[0], "seconds": seconds, "gflop": flops / 1e9,
          "gflops_per_s": flops / seconds / 1e9}


def product_gflops(rows: int, inner: int, outer: int, repeats: int) -> float:
  """XLA's throughput on one float32 product [rows, inner] x [inner, outer]."""
  x, w = jnp.ones((rows, inner)), jnp.ones((inner, outer))
  run = jax.jit(lambda x, w: x @ w)
  seconds, _ = timing.median_seconds(lambda: run(x, w).block_until_ready(), repeats)
  return 2 * rows * inner * outer / seconds / 1e9


def dense_gradient_row(rows: int, width: int, inner: int, outer: int, repeats: int) -> dict:
  """Seconds of the gradient (both operands) of x[rows, width, inner] x kernel[inner, outer], with the
  product over two leading dims and with them flattened into one."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((rows, width, inner)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((inner, outer)) * 0.02, jnp.float32)
  two_leading = lambda x, k: jnp.sum(jnp.einsum("bti,io->bto", x, k) ** 2)
  flattened = lambda x, k: jnp.sum((x.reshape(-1, inner) @ k) ** 2)
  out = {"rows": rows, "width": width, "inner": inner, "outer": outer}
  for name, loss in (("two_leading_dims", two_leading), ("flattened", flattened)):
    gradient = jax.jit(jax.grad(loss, argnums=(0, 1)))
    out[f"{name}_ms"] = 1e3 * timing.median_seconds(
        lambda: jax.block_until_ready(gradient(x, kernel)), repeats)[0]
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gin_file", default="configs/t5_ende/target.gin")
  parser.add_argument("--widths", default="8,16,32,64")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="train_step")
  args = parser.parse_args()
  config, spec = configured(args.gin_file)
  widths = [int(w) for w in args.widths.split(",")]
  peak = product_gflops(spec.tokens_per_batch, config.embed_dim, config.mlp_dim, args.repeats)
  rows = []
  for width in widths:
    row = step_row(config, spec, width, args.repeats)
    row["floor_seconds"] = row["gflop"] / peak
    rows.append(row)
    print(f"width {width:3d} x {row['rows']:4d} rows: {row['seconds']:.2f} s per step, "
          f"{row['gflops_per_s']:.0f} GFLOP/s, floor {row['floor_seconds']:.2f} s", flush=True)
  dense = [dense_gradient_row(spec.tokens_per_batch // width, width, config.embed_dim,
                              config.mlp_dim, args.repeats) for width in widths]
  meta = {"date": datetime.date.today().isoformat(), "machine": roofline.cpu_description(),
          "cpus": os.cpu_count(), "jax": jax.__version__, "gin_file": args.gin_file,
          "tokens_per_batch": spec.tokens_per_batch, "product_gflops": peak, "repeats": args.repeats}
  tokens, width, mlp = spec.tokens_per_batch, config.embed_dim, config.mlp_dim
  lines = [f"# T5 training step ({args.gin_file}, float32, {tokens} tokens per batch)", "",
           f"{meta['date']}, {meta['machine']} ({meta['cpus']} cores), jax {meta['jax']}. XLA's "
           f"throughput on one [{tokens}, {width}] x [{width}, {mlp}] product: {peak:.0f} GFLOP/s. "
           f"Medians of {args.repeats} runs after a warm-up.", "",
           "| width | rows | s per step | GFLOP | GFLOP/s | floor (s) | step / floor |",
           "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['width']} | {r['rows']} | {r['seconds']:.2f} | {r['gflop']:.0f} | "
            f"{r['gflops_per_s']:.0f} | {r['floor_seconds']:.2f} | "
            f"{r['seconds'] / r['floor_seconds']:.2f} |" for r in rows]
  lines += ["", "Gradient of one dense layer (both operands), x[rows, width, E] x kernel[E, MLP]:", "",
            "| rows x width | two leading dims (ms) | flattened (ms) | ratio |", "|---|---|---|---|"]
  lines += [f"| {d['rows']} x {d['width']} | {d['two_leading_dims_ms']:.1f} | "
            f"{d['flattened_ms']:.1f} | {d['two_leading_dims_ms'] / d['flattened_ms']:.2f} |"
            for d in dense]
  markdown = "\n".join(lines)
  print(markdown)
  common.write_results(args.out, {"steps": rows, "dense_gradient": dense}, markdown, meta)


if __name__ == "__main__":
  main()
