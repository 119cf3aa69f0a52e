"""Shared benchmark plumbing: held-out prompts, fresh drafter states, bandwidth probe, result files.
Timing itself lives in specjax.timing (median_seconds, step_seconds, ...)."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp

import functools

from specjax import autoregressive, data, loading
from specjax.timing import median_seconds, ms_per_token, prefill_seconds, time_passes


def memory_bandwidth_gbps(megabytes: int = 512, repeats: int = 7) -> float:
  """Read bandwidth as XLA sees it: a jitted sum over a buffer far larger than the caches."""
  data = jnp.ones((megabytes * 1024 * 1024 // 4,), jnp.float32)
  reduce = jax.jit(lambda x: jnp.sum(x))
  seconds, _ = median_seconds(lambda: reduce(data).block_until_ready(), repeats)
  return data.nbytes / seconds / 1e9


def write_results(name: str, rows: list[dict], markdown: str, meta: dict) -> pathlib.Path:
  out = pathlib.Path(__file__).parent / "results"
  out.mkdir(exist_ok=True)
  (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
  (out / f"{name}.md").write_text(markdown + "\n")
  return out


def load_prompts(target: loading.LoadedModel, count: int, name: str = "humaneval",
                 style: str = "chat"):
  """The first `count` held-out prompts of a set as batch-1 (tokens[1, P], lengths[1]) pairs padded to
  one shared length (one compiled program), and their keys."""
  heldout = data.load_prompt_set(name, "heldout", limit=count, style=style)
  batch = target.batch(heldout.prompts, bucket=32, max_length=1024)
  return ([(batch.prompt_tokens[i:i + 1], batch.prompt_lengths[i:i + 1])
           for i in range(len(heldout))], list(heldout.keys))


def fresh_state(drafter, params, prompt, max_length: int):
  """A drafter's state after its prefill on a batch-1 (tokens, lengths) prompt."""
  tokens, lengths = prompt
  return jax.jit(drafter.init, static_argnums=3)(params, tokens, lengths, max_length)


def time_baseline(model, params, prompts, new_tokens: int, pad_id: int, temperatures, repeats: int,
                  warmup: int):
  """The autoregressive baseline at each temperature, EOS off, prefill timed and subtracted.

  Returns ({temperature: {decode_ms, e2e_ms, passes_s, tokens}}, prefill seconds); `tokens` are the
  last pass's outputs per prompt (greedy equality checks compare against them)."""
  generate = autoregressive.make_generate(model, autoregressive.DecodeShape(
      new_tokens, eos_id=None, pad_id=pad_id))
  rng, f32 = jax.random.PRNGKey(0), functools.partial(jnp.asarray, dtype=jnp.float32)
  compiled = generate.lower(params, *prompts[0], rng, f32(0.0), f32(1.0), None).compile()
  prompt_len = prompts[0][0].shape[1]
  prefill = prefill_seconds(model, None, params, None, prompts[0], prompt_len + new_tokens + 1, 3)
  baseline = {}
  for temperature in temperatures:
    run_one = lambda t, l, temp=temperature: jax.block_until_ready(
        compiled(params, t, l, rng, f32(temp), f32(1.0), None))
    seconds, passes, outputs = time_passes(run_one, prompts, repeats,
                                           warmup if temperature == temperatures[0] else 0)
    decode_ms, e2e_ms = ms_per_token(seconds, prefill, len(prompts), new_tokens)
    baseline[temperature] = {"decode_ms": decode_ms, "e2e_ms": e2e_ms, "passes_s": passes,
                             "tokens": [jax.device_get(o.tokens).tolist() for o in outputs]}
    print(f"baseline T={temperature:g}: {decode_ms:.1f} ms/token decode, {e2e_ms:.1f} end-to-end "
          f"(prefill {1000 * prefill:.0f} ms)", flush=True)
  return baseline, prefill
