"""Shared benchmark plumbing: timing discipline, bandwidth probe, result files."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp

from experiments.measure import median_seconds


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
