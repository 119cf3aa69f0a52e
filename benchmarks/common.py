"""Shared benchmark plumbing: held-out prompts, fresh drafter states, bandwidth probe, result files.
Timing itself lives in specjax.timing (median_seconds, step_seconds, ...)."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp

from specjax import loading, timing
from specjax.data import prompts as prompt_sets
from specjax.timing import median_seconds  # noqa: F401  (the benchmarks call common.median_seconds)

RESULTS = pathlib.Path(__file__).parent / "results"


def memory_bandwidth_gbps(megabytes: int = 512, repeats: int = 7) -> float:
  """Read bandwidth of the default device as XLA sees it: a sum over a buffer far larger than the
  caches, chained as timing.chained_timer chains steps. A single jitted sum per call would count a
  dispatch per pass: on an accelerator that reads 512 MB in about a tenth of a millisecond, the
  dispatch would be most of the time. Each pass sums the buffer times the pass's number, so XLA
  cannot hoist the sum out of the loop (timing.varying's select ran at 1.5 GB/s on XLA:CPU where a
  product fused into the sum reads at the plain sum's 23-25 GB/s)."""
  data = jnp.ones((megabytes * 1024 * 1024 // 4,), jnp.float32)

  def read(data, step, _tokens, _positions):
    total = jnp.sum(data * (step + 1).astype(data.dtype))
    return (total > 0).astype(jnp.int32), step + 1
  seconds = timing.step_seconds(read, data, jnp.zeros((), jnp.int32), None, None, repeats)
  return data.nbytes / seconds / 1e9


def write_results(name: str, rows: list[dict], markdown: str, meta: dict,
                  directory: pathlib.Path | str = RESULTS) -> pathlib.Path:
  """{name}.json ({"meta", "rows"}) and {name}.md in `directory` (default benchmarks/results)."""
  out = pathlib.Path(directory)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
  (out / f"{name}.md").write_text(markdown + "\n")
  return out


def load_prompts(target: loading.LoadedModel, count: int, name: str = "humaneval",
                 style: str = "chat"):
  """The first `count` held-out prompts of a set as batch-1 (tokens[1, P], lengths[1]) pairs padded to
  one shared length (one compiled program), and their keys."""
  heldout = prompt_sets.load_prompt_set(name, "heldout", limit=count, style=style)
  batch = target.batch(heldout.prompts, bucket=32, max_length=1024)
  return ([(batch.prompt_tokens[i:i + 1], batch.prompt_lengths[i:i + 1])
           for i in range(len(heldout))], list(heldout.keys))


def fresh_state(drafter, params, prompt, max_length: int, source=None):
  """A drafter's state after its prefill on a batch-1 (tokens, lengths) prompt (for an
  encoder-decoder model, the decoder prompt, with the encoder's input as `source`)."""
  tokens, lengths = prompt
  return jax.jit(drafter.init, static_argnums=3)(params, tokens, lengths, max_length, source)
