"""A plan's report (`specjax.plan`): one table per dtype with its header lines, bytes in binary units."""

from __future__ import annotations

import math

import jax

from specjax import models
from specjax.plan import devices as devices_lib
from specjax.plan import workload as workload_lib
from specjax.models import t5

GIB = devices_lib.GIB


def bytes_text(value) -> str:
  """Bytes in the largest binary unit that keeps them >= 1 (GiB at most)."""
  if value is None:
    return "-"
  for unit, size in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
    if value >= size:
      return f"{value / size:.2f} {unit}"
  return f"{value} B"


def _collective_text(counts: dict | None) -> str:
  if not counts:
    return "none" if counts is not None else "-"
  return ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))


def _describe_model(name: str, config) -> str:
  count = sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(models.param_shapes(config)))
  return f"{name}: {models.size_name(config) or config} ({count / 1e9:.2f}B params)"


def markdown(workload: workload_lib.Workload, result: dict) -> str:
  """One plan (one dtype) as a markdown table with its header lines."""
  fits = {True: "yes", False: "NO", None: "-"}
  memory = result["memory_per_device"]
  lines = [f"### {result['dtype']} on {result['devices']}, mesh {result['mesh']}",
           "",
           "- models: " + "; ".join(_describe_model(name, config)
                                    for name, config in [("target", workload.target), *workload.drafts]),
           f"- batch {workload.batch}, {'source' if isinstance(workload.target, t5.T5Config) else 'prompt'}"
           f" {workload.prompt_length} tokens, {workload.max_new_tokens} new tokens"
           + (f", gamma {workload.gamma}" if workload.drafts else "")
           + f"; cache {result['max_length']} slots",
           f"- per-device memory: {bytes_text(memory) if memory else 'not given (no verdict)'}; "
           f"fits: {fits[result['fits']]}"]
  if result["replicated"]:
    lines.append(f"- replicated (the mesh axis does not divide them): {'; '.join(result['replicated'])}")
  if workload.skipped:
    lines.append(f"- not planned (no model): {', '.join(workload.skipped)}")
  lines += ["", "| model | program | params/dev | KV cache/dev | arguments | outputs | temporaries | "
            "peak/dev | GFLOP | collectives | compile s | fits |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for row in result["rows"]:
    flops = row.get("flops")
    cells = [row["model"], row["program"], bytes_text(row["params"]), bytes_text(row["cache"]),
             *(bytes_text(row.get(key)) for key in ("arguments", "outputs", "temporaries", "peak")),
             "-" if flops is None else f"{flops / 1e9:.1f}", _collective_text(row.get("collectives")),
             f"{row['compile_s']:.1f}", fits[row["fits"]]]
    lines.append("| " + " | ".join(cells) + " |")
    if row.get("note"):
      lines.append(f"|  | ({row['note']}) |  |  |  |  |  |  |  |  |  |  |")
  return "\n".join(lines) + "\n"
