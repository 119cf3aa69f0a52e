"""What a draft step costs on this CPU, by shape: c = draft step / SmolLM2-135M step, before training.

    .venv/bin/python benchmarks/draft_shapes.py [--repeats 15] [--rounds 3] [--seed 0]

Preparatory measurement for training a Chen-style draft: which draft shapes can reach the goal
c <= 0.1, and what Thm 3.8 then promises at alpha 0.6 / 0.7 / 0.8. Drafts carry random weights
(decoder_only.init_params): a step's cost depends on the shape, not on the values. Every step is timed
as specjax.timing.step_seconds times one for the sweeps and benchmarks: jitted, the state donated and
threaded through, batch 1, T = 1, transform (temperature 1) and sample included, median of `--repeats` after a
compile + warm-up call, from a cache prefilled with the first held-out HumanEval prompt and sized as a
64-token run at gamma 8 would size it. Each shape gets `--rounds` such medians (one compilation) and
reports their median: a sub-millisecond step's single median of 15 moved by 2x between runs here.

Shapes (head_dim 64, GQA 2:1, SwiGLU width 3 d, tied embeddings unless `untied`):
  own d{256,384} L{0,1,2,4}   a narrow own embedding + head over the full 49,152-token vocabulary
                              (option a); L0 is the bare embedding -> norm -> head, the floor
                              every full-vocab shape of that width pays. `untied` rows store the head
                              as its own [d, V] kernel (`x @ lm_head`) beside the input table: a
                              probe found XLA:CPU runs that GEMV faster than the tied
                              [V, d]-contracted einsum, and the input table costs one gathered row.
  top{8k,16k} d{256,384} L{1,2}, top4k d256 L1
                              a head over the K most frequent target tokens only (option c). Emulated
                              by a DecoderConfig with vocab_size K (input ids taken mod K): the real
                              drafter would keep a full-vocabulary input table (a one-row gather, same
                              cost) and scatter its K logits into a -inf row of 49,152 before the
                              shared transform, so the sampled distribution is 0 off the K tokens.
                              That scatter + full-width transform + sample is timed on its own and
                              added to these rows (`+ scatter`); the K-wide transform and sample
                              inside the emulated step are a small overcount.
  target layers{1,2}          the target's first blocks + final norm + tied head (truncate_layers), for
                              reference; layers1 also bounds option b (the target's 576-wide
                              embedding and head around a narrower body costs at least its head).

Columns: params (M); MB read per step = all parameters (a tied head reads the whole table; an untied
model's input table counts one row) + the full KV buffers (attention reads every slot, masked);
step ms; c; then Thm 3.8's best speedup over gamma 1..16 (theory.best_gamma) and the same with the
measured verification cost put in:
expected_tokens(alpha, gamma) / (gamma c + v_gamma), gamma 1..8, v_gamma = target ms at T = gamma + 1
over T = 1, linear between the measured T = 1, 2, 3, 5, 9. `alpha for 2x` is the smallest alpha whose
best v-aware speedup reaches 2.0 (the greedy goal for a trained draft).

Also measured, as information for later work: the target scoring T = 1, 2, 3, 5, 9 tokens, and the
target with its weights cast to bfloat16 (all weights and the cache in bf16, so activations run in
bf16; and blocks in bf16 with a float32 embedding/head and cache, so activations stay float32), at
T = 1 and 2, with the share of the prompt's positions whose argmax matches float32's.

Writes benchmarks/results/draft_shapes.{json,md}. Takes about 2 minutes on 2 quiet cores. The
read bandwidth here varied from 31 to 44 GB/s between runs, and sub-millisecond steps with it: compare
rows within one run.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import common
from common import fresh_state
from specjax import contracts, loading, theory, timing
from specjax.decoding import sampling
from specjax.drafters.model import ModelDrafter
from specjax.timing import draft_step, median_seconds, one_token, step_seconds
from specjax.timing import target_step as timed_target_step
from specjax.models import decoder_only

WIDTHS = (1, 2, 3, 5, 9)  # target scoring T tokens = verifying gamma = T - 1 drafts
ALPHAS = (0.6, 0.7, 0.8)
MAX_V_GAMMA = WIDTHS[-1] - 1  # beyond the widest measured T the v-aware model would extrapolate
NEW_TOKENS = 64  # cache sizing only, as benchmarks/speculative.py's default run


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=15, help="timed steps per round (median)")
  parser.add_argument("--rounds", type=int, default=3, help="medians per shape (their median is kept)")
  parser.add_argument("--seed", type=int, default=0, help="random draft weights")
  parser.add_argument("--out", default="draft_shapes")
  return parser.parse_args()


def own_config(target, width, layers, vocab=None, tied=True):
  heads = width // 64
  return decoder_only.DecoderConfig(
      vocab_size=vocab or target.vocab_size, embed_dim=width, num_layers=layers, num_heads=heads,
      num_kv_heads=heads // 2, head_dim=64, mlp_dim=3 * width, rope_theta=target.rope_theta,
      norm_eps=target.norm_eps, tie_embeddings=tied)


def shapes(target):
  """(name, config, vocab K or None) for every random-weight shape."""
  out = [(f"own d{w} L{n}", own_config(target, w, n), None) for w in (256, 384) for n in (0, 1, 2, 4)]
  out += [(f"own d{w} L{n} untied", own_config(target, w, n, tied=False), None)
          for w in (256, 384) for n in (1, 2, 4)]
  for k in (8192, 16384):
    out += [(f"top{k // 1024}k d{w} L{n}", own_config(target, w, n, k), k)
            for w in (256, 384) for n in (1, 2)]
  out.append(("top4k d256 L1", own_config(target, 256, 1, 4096), 4096))
  return out


def nbytes(tree):
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def size(tree):
  return sum(x.size for x in jax.tree_util.tree_leaves(tree))


def copy_tree(tree):
  # step_seconds donates the state; keep the prefilled original and hand it a copy each time.
  return jax.tree_util.tree_map(jnp.copy, tree)


def rounds_ms(fn, params, prefilled, tokens, positions, args):
  """Median over `args.rounds` of step_seconds' median, in ms. One fn object for every round, so
  jax.jit finds its compiled program again instead of compiling per round."""
  return statistics.median(
      1000 * step_seconds(fn, params, copy_tree(prefilled), tokens, positions, args.repeats)
      for _ in range(args.rounds))


def scatter_seconds(k, vocab, repeats):
  """The full-vocabulary epilogue a top-K head adds to every draft step: scatter K logits into a -inf
  row, the shared transform at temperature 1 and the inverse-CDF sample, jitted, median."""
  ids = jnp.asarray(np.random.default_rng(0).permutation(vocab)[:k], jnp.int32)
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, k)), jnp.float32)

  @jax.jit
  def widen(logits, ids):
    # Logits, not probabilities, go in: softmax over a -inf row gives exactly 0 off the K tokens.
    row = jnp.full((1, vocab), -jnp.inf, jnp.float32).at[:, ids].set(logits)
    probs = sampling.probs_from_logits(row, 1.0)
    return sampling.sample_with_uniform(jnp.full((1,), 0.5), probs)

  # Many repeats: the step is well under a millisecond, where one scheduler hiccup moves a median of 15.
  return median_seconds(lambda: widen(logits, ids).block_until_ready(), max(repeats, 50),
                        warmup=3)[0]


def interpolated_v(target_ms):
  widths = sorted(target_ms)
  ms = [target_ms[w] for w in widths]
  return {g: float(np.interp(g + 1, widths, ms)) / target_ms[1] for g in range(1, MAX_V_GAMMA + 1)}


def best_with_v(alpha, c, v):
  gammas = np.arange(1, MAX_V_GAMMA + 1)
  gains = theory.expected_tokens(alpha, gammas) / (gammas * c + np.array([v[g] for g in gammas]))
  i = int(np.argmax(gains))
  return int(gammas[i]), float(gains[i])


def alpha_for(goal, c, v):
  """Smallest alpha (to 0.001) whose best v-aware speedup reaches `goal`; None if even 0.999 fails."""
  if best_with_v(0.999, c, v)[1] < goal:
    return None
  lo, hi = 0.0, 0.999
  while hi - lo > 1e-3:  # the best speedup rises with alpha, so bisect
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if best_with_v(mid, c, v)[1] < goal else (lo, mid)
  return hi


def prompt_argmax(step, config, params, prompt, cache_dtype):
  """Argmax of the logits at every real position of the prompt (one prefill)."""
  tokens, lengths = prompt
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  cache = decoder_only.init_cache(config, 1, tokens.shape[1], cache_dtype)
  logits, _ = jax.jit(step)(params, tokens, positions, cache)
  real = np.asarray(logits[0, :int(lengths[0])])
  return real.argmax(-1), real


def main():
  args = parse_args()
  started = time.perf_counter()
  loaded = loading.load_model()
  config, params = loaded.config, jax.device_put(loaded.params)
  (prompt,), keys = common.load_prompts(loaded, 1)
  prompt_len = prompt[0].shape[1]
  max_length = prompt_len + NEW_TOKENS + MAX_V_GAMMA + 1
  target_step = decoder_only.make_step(config)
  target = ModelDrafter(loaded.model)
  bandwidth = timing.read_bandwidth_gbps()
  print(f"prompt {keys[0]} padded to {prompt_len}, cache {max_length} slots, read bandwidth "
        f"{bandwidth:.1f} GB/s; setup {time.perf_counter() - started:.0f}s", flush=True)

  # The target scoring T tokens: the c denominator (T = 1) and the verification cost v.
  prefilled = fresh_state(target, params, prompt, max_length)
  scoring = timed_target_step(loaded.model)
  target_ms = {w: rounds_ms(scoring, params, prefilled, *one_token(prompt, w), args)
               for w in WIDTHS}
  print("target ms by T:", {w: round(ms, 1) for w, ms in target_ms.items()}, flush=True)
  v = interpolated_v(target_ms)
  cache_bytes = lambda cfg: 2 * cfg.num_layers * max_length * cfg.num_kv_heads * cfg.head_dim * 4

  def read_bytes(cfg, draft_params):
    table = draft_params["embedding"]
    unread = 0 if cfg.tie_embeddings else table.nbytes - table.nbytes // table.shape[0]
    return nbytes(draft_params) - unread + cache_bytes(cfg)

  def measure(name, cfg, draft_params, vocab_k=None, extra_ms=0.0, kind="own"):
    drafter = ModelDrafter(decoder_only.model(cfg))
    # A top-K emulation's table has K rows: keep its input ids in range (gather cost is the same).
    tokens, lengths = prompt
    small_prompt = (tokens % cfg.vocab_size, lengths)
    token, positions = one_token(small_prompt)
    step_ms = rounds_ms(draft_step(drafter), draft_params,
                        fresh_state(drafter, draft_params, small_prompt, max_length), token,
                        positions, args)
    total_ms = step_ms + extra_ms
    c = total_ms / target_ms[1]
    row = {"shape": name, "kind": kind, "embed_dim": cfg.embed_dim, "num_layers": cfg.num_layers,
           "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "mlp_dim": cfg.mlp_dim,
           "tied": cfg.tie_embeddings, "head_vocab": cfg.vocab_size, "top_k": vocab_k,
           "params_m": size(draft_params) / 1e6,
           "read_mb": read_bytes(cfg, draft_params) / 1e6, "step_ms_model": step_ms,
           "scatter_ms": extra_ms, "step_ms": total_ms, "c": c}
    row["floor_ms"] = row["read_mb"] / bandwidth
    for alpha in ALPHAS:
      row[f"thm38_{alpha}"] = theory.best_gamma(alpha, c)
      row[f"with_v_{alpha}"] = best_with_v(alpha, c, v)
    row["alpha_for_2x_with_v"] = alpha_for(2.0, c, v)
    print(f"{name:>18}: {row['params_m']:6.2f} M params, {row['read_mb']:6.1f} MB, "
          f"{total_ms:6.2f} ms (model {step_ms:.2f} + scatter {extra_ms:.2f}), c {c:.3f}", flush=True)
    return row

  scatter_ms = {k: 1000 * scatter_seconds(k, config.vocab_size, args.repeats)
                for k in (4096, 8192, 16384)}
  print("scatter + full-vocab transform + sample ms:",
        {k: round(ms, 3) for k, ms in scatter_ms.items()}, flush=True)
  rows = []
  for i, (name, cfg, k) in enumerate(shapes(config)):
    draft_params = jax.device_put(decoder_only.init_params(cfg, jax.random.PRNGKey(args.seed + i)))
    rows.append(measure(name if k is None else f"{name} + scatter", cfg, draft_params, k,
                        scatter_ms.get(k, 0.0), "own" if k is None else "top-k"))
  for n in (1, 2):
    cfg, kept = decoder_only.truncate_layers(config, params, n)
    rows.append(measure(f"target layers{n}", cfg, kept, kind="target layers"))

  bf16 = measure_bf16(config, params, target_step, prompt, max_length, target_ms, args)
  total_s = time.perf_counter() - started
  write(args, rows, target_ms, v, scatter_ms, bf16, keys, prompt_len, max_length, bandwidth, total_s)


def measure_bf16(config, params, target_step, prompt, max_length, target_ms, args):
  """The target with bfloat16 weights: step ms at T = 1, 2 and argmax agreement with float32."""
  reference, reference_logits = prompt_argmax(target_step, config, params, prompt, jnp.float32)
  cast = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tree)
  variants = {
      # The embedding's dtype sets the activations' (x = embedding[tokens]), so an all-bf16 tree runs
      # bf16 activations; keeping the embedding (= tied head) float32 keeps them float32, and each
      # block's dot then promotes its bf16 weights to float32.
      "bf16 weights, bf16 activations + cache": (cast(params), jnp.bfloat16),
      "bf16 blocks, f32 embedding/head + activations + cache": (
          {**cast(params), "embedding": params["embedding"]}, jnp.float32),
  }
  out = {}
  for name, (weights, cache_dtype) in variants.items():
    entry = {"weight_mb": nbytes(weights) / 1e6}
    try:
      init = functools.partial(decoder_only.init_cache, config, dtype=cache_dtype)
      model = contracts.StepModel(target_step, init)
      prefilled = fresh_state(ModelDrafter(model), weights, prompt, max_length)
      scoring = timed_target_step(model)
      for w in (1, 2):
        # One round: at 5-10x float32's step time these are not near the noise.
        ms = 1000 * step_seconds(scoring, weights, copy_tree(prefilled), *one_token(prompt, w),
                                 args.repeats)
        entry[f"T{w}_ms"], entry[f"T{w}_over_f32"] = ms, ms / target_ms[w]
      argmax, logits = prompt_argmax(target_step, config, weights, prompt, cache_dtype)
      entry["argmax_agreement"] = float(np.mean(argmax == reference))
      entry["positions"] = int(argmax.size)
      entry["max_abs_logit_diff"] = float(np.max(np.abs(logits - reference_logits)))
      entry["last_position_equal"] = bool(argmax[-1] == reference[-1])
    except Exception as error:  # pylint: disable=broad-except
      # A dtype XLA:CPU cannot run is itself the answer for this variant; report it, keep the rest.
      entry["error"] = f"{type(error).__name__}: {error}"[:300]
    print(f"{name}: {entry}", flush=True)
    out[name] = entry
  return out


def fmt_gain(pair):
  gamma, gain = pair
  return f"{gain:.2f}x (g{gamma})"


def write(args, rows, target_ms, v, scatter_ms, bf16, keys, prompt_len, max_length, bandwidth,
          total_s):
  t1 = target_ms[1]
  lines = [
      f"Draft step cost by shape vs the SmolLM2-135M-Instruct target (float32, batch 1, T = 1, "
      f"random draft weights), {platform.machine()} with {os.cpu_count()} cores, jax "
      f"{jax.__version__}; prompt {keys[0]} padded to {prompt_len} tokens, caches of {max_length} "
      f"slots; jitted steps with the state donated, transform (temperature 1) and sample included, "
      f"median of {args.rounds} medians of {args.repeats}. Read bandwidth {bandwidth:.1f} GB/s. Total run "
      f"{total_s / 60:.1f} min.", "",
      "Target step ms by T (tokens scored): " + ", ".join(
          f"{w}: {ms:.1f}" for w, ms in target_ms.items()) + "; v_gamma = ms(T = gamma + 1) / "
      "ms(T = 1): " + ", ".join(f"{g}: {x:.2f}" for g, x in v.items()) + " (linear between measured T).",
      "",
      "Top-K heads pay a full-vocabulary epilogue (scatter into a -inf row of 49,152, transform, sample): "
      + ", ".join(f"K = {k}: {ms:.3f} ms" for k, ms in scatter_ms.items()) + "; included in their "
      "step ms.", "",
      "Thm 3.8 = best speedup over gamma 1..16 at that c with verification costing one T = 1 step; "
      "with v = the same with the measured cost v_gamma of scoring gamma + 1 tokens (gamma 1..8). "
      "alpha for 2x = the least alpha whose best with-v speedup reaches 2.0.", "",
      "| shape | params (M) | MB read / step | step ms | c | Thm 3.8 a=0.6 | a=0.7 | a=0.8 "
      "| with v a=0.6 | a=0.7 | a=0.8 | alpha for 2x (with v) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    need = r["alpha_for_2x_with_v"]
    lines.append(
        f"| {r['shape']} | {r['params_m']:.2f} | {r['read_mb']:.1f} | {r['step_ms']:.2f} "
        f"| {r['c']:.3f} | " + " | ".join(fmt_gain(r[f"thm38_{a}"]) for a in ALPHAS) + " | "
        + " | ".join(fmt_gain(r[f"with_v_{a}"]) for a in ALPHAS)
        + f" | {'unreachable' if need is None else f'{need:.3f}'} |")
  lines += ["", f"bfloat16 target (float32: T = 1 {t1:.1f} ms, T = 2 {target_ms[2]:.1f} ms; argmax "
            f"agreement over the prompt's real positions, teacher-forced):", ""]
  for name, e in bf16.items():
    if "error" in e:
      lines.append(f"- {name}: failed: {e['error']}")
    else:
      lines.append(
          f"- {name}: weights {e['weight_mb']:.0f} MB; T = 1 {e['T1_ms']:.1f} ms "
          f"({e['T1_over_f32']:.2f}x float32), T = 2 {e['T2_ms']:.1f} ms ({e['T2_over_f32']:.2f}x); "
          f"argmax equal at {100 * e['argmax_agreement']:.1f}% of {e['positions']} positions "
          f"(last position {'equal' if e['last_position_equal'] else 'differs'}), max |logit "
          f"diff| {e['max_abs_logit_diff']:.2f}.")
  markdown = "\n".join(lines)
  print(markdown)
  meta = {"args": vars(args), "prompt_keys": keys, "prompt_length": prompt_len,
          "cache_slots": max_length, "target_step_ms": target_ms, "v": v, "scatter_ms": scatter_ms,
          "bf16": bf16, "read_bandwidth_gbps": bandwidth, "jax": jax.__version__,
          "host": platform.node(), "cpus": os.cpu_count(), "total_s": total_s}
  print("wrote", common.write_results(args.out, rows, markdown, meta))


if __name__ == "__main__":
  main()
