"""Shared benchmark plumbing: held-out prompts, fresh drafter states, result files.
Timing itself lives in specjax.timing (median_seconds, step_seconds, read_bandwidth_gbps, ...)."""

from __future__ import annotations

import json
import pathlib

import jax

from specjax import loading, models
from specjax.models import cpu_kernels
from specjax.data import prompts as prompt_sets

RESULTS = pathlib.Path(__file__).parent / "results"


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


def decoding_variant(target: loading.LoadedModel, dtype_name: str, kernels: str | None):
  """(model, params on the device) of a loaded target as specs.ModelSpec(dtype=dtype_name,
  kernels=kernels) decodes it: cast, and on the CPU kernels packed, with their float32 cache."""
  dtype = models.DTYPES[dtype_name]
  params = jax.device_put(models.cast(target.params, dtype))
  if kernels == "cpu":
    params = cpu_kernels.pack_params_for(target.config, params)
  return models.model_for(target.config, None,
                          cpu_kernels.CACHE_DTYPE if kernels == "cpu" else dtype), params
