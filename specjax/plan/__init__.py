"""Plan a run before the pod starts: `python -m specjax.plan --gin_file=configs/X.gin [--topology=v4-8]`.

For a decoding config (a `generation.Generate` or sweep job) the plan builds the target
and every model draft from shapes alone (`jax.eval_shape`: no weights allocated, nothing read but
the architecture), shards them on the config's mesh with the rules of `sharding.py`, and compiles
ahead of time the programs a run executes:

  prefill     the target's (and each draft's) prompt pass, encoder included for T5
  draft step  one draft token (T = 1) on the cache the prefill produced
  verify      the target scoring gamma + 1 tokens (the largest gamma of the sweep)
  loop        the whole speculative loop (one jitted while_loop), or the autoregressive loop of a
              target without a model draft

and reports, per device: parameter and KV-cache bytes (from the shardings: exact), the compiled
program's argument / output / temporary bytes (`compiled.memory_analysis()`), its peak, its FLOPs
(`cost_analysis`; for a loop, one iteration), the collectives in its HLO (a loop: per iteration),
the compile time, and whether it fits the per-device memory.

Devices: this machine's (on CPU the plan makes as many simulated devices as the mesh needs), or a
TPU slice (`--topology=v4-8`, `v5p-64`, `v5e-16`, or a raw `v4:2x2x1`) through
`jax.experimental.topologies`, which needs the TPU compiler (`pip install -e '.[tpu]'`, the `libtpu`
wheel): the TPU compiler's own verdict then counts, its out-of-memory error included ("does not fit",
with its figures).

Architectures: specjax.plan.workload (what a config runs, in shapes); devices: specjax.plan.devices. Name an
architecture in the config (`plan.PlanSpec.target_size`, `plan.PlanSpec.draft_sizes`) where the
weights are not here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from specjax import contracts, models, sharding, validation
from specjax.decoding import autoregressive, core
from specjax.drafters import expansion
from specjax.drafters import model as model_drafts
from specjax.plan import report
from specjax.plan import devices as devices_lib
from specjax.plan import workload as workload_lib
from specjax.models import kv_cache, t5

GIB = devices_lib.GIB
DTYPES = models.DTYPES


@dataclasses.dataclass(frozen=True)
class PlanSpec:
  """What the plan needs beyond the experiment config.

  target_size / draft_sizes: architecture names (specjax.models.SIZES) for checkpoints that cannot be
    read here (placeholders, remote paths); draft_sizes follow the config's model drafters in order.
  topology: a TPU slice ("v4-8", "v5p-64", "v4:2x2x1"); None plans on this machine's devices.
  dtypes: parameter, activation and cache dtypes to plan ("float32", "bfloat16"); None plans the
    one the run decodes in (specs.ModelSpec.dtype).
  memory_gib: per-device memory to fit in; None takes the TPU's HBM (no verdict on CPU).
  prompt_length: the padded prompt (T5: source) length; None takes the config's max_prompt_length,
    the longest input the run accepts.
  strict_sharding: refuse a dimension the rules cannot split (else it is replicated and listed).
  programs: a subset of PROGRAMS to compile (None: all).
  """
  target_size: str | None = None
  draft_sizes: tuple = ()
  topology: str | None = None
  dtypes: tuple | None = None
  memory_gib: float | None = None
  prompt_length: int | None = None
  strict_sharding: bool = False
  programs: tuple | None = None

  def __post_init__(self):
    if self.memory_gib is not None:
      validation.finite_number(self.memory_gib, "PlanSpec.memory_gib (--memory_gib)", 1e-9,
                               fix="it is the memory of one device in GiB, e.g. 16; leave it unset "
                                   "to take the TPU's HBM")
    if self.prompt_length is not None:
      validation.whole_number(self.prompt_length, "PlanSpec.prompt_length", 1,
                              validation.MAX_POSITIONS)


PROGRAMS = ("prefill", "draft step", "verify", "decode step", "loop")


# ----------------------------------------------------------------------------------------------------
# Abstract inputs and the compiled programs.


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
             for leaf in jax.tree_util.tree_leaves(tree))


def abstract_params(config, mesh, dtype, strict: bool = False):
  """The params of `config` as sharded ShapeDtypeStructs in `dtype` (integer leaves keep theirs)."""
  shardings = models.param_shardings(config, mesh, strict)
  cast = lambda shape: dtype if jnp.issubdtype(shape.dtype, jnp.floating) else shape.dtype
  return jax.tree_util.tree_map(
      lambda shape, placed: jax.ShapeDtypeStruct(shape.shape, cast(shape), sharding=placed),
      models.param_shapes(config), shardings)


def replicated(name: str, config, mesh, cache) -> list[str]:
  """What the rules leave whole on every device for this model: '<model> <where>: <axes>'. cache: the
  model's abstract KV cache."""
  found = {}
  is_spec = lambda x: isinstance(x, PartitionSpec)
  for axes_, shape in zip(jax.tree_util.tree_leaves(models.param_logical_axes(config), is_leaf=is_spec),
                          jax.tree_util.tree_leaves(models.param_shapes(config))):
    for axis in sharding.replicated_axes(tuple(axes_), shape.shape, mesh):
      found[axis] = found.get(axis, 0) + 1
  notes = [f"{name} params: {axis} in {count} arrays" for axis, count in sorted(found.items())]
  cache_axes = sharding.replicated_axes(kv_cache.LOGICAL_AXES, cache.keys[0].shape, mesh)
  if cache_axes:
    notes.append(f"{name} KV cache: {', '.join(cache_axes)}")
  return notes


def _collectives(hlo_text: str) -> dict:
  counts = {}
  for op in re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                       r"(?:-start)?\(", hlo_text):
    counts[op] = counts.get(op, 0) + 1
  return counts


_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?required[^(]*\(([\d.]+)(\w)\).*?available[^(]*\(([\d.]+)(\w)\)",
                  re.S)


def _compile(name: str, lower) -> tuple[dict, Any]:
  """Compile and measure one program -> (row, compiled). The TPU compiler's out-of-memory error
  becomes a row that does not fit, with its figures (compiled None)."""
  start = time.perf_counter()
  try:
    compiled = lower().compile()
  except jax.errors.JaxRuntimeError as error:
    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message:
      raise
    figures = _OOM.search(message)
    unit = {"G": GIB, "M": 1024 ** 2, "K": 1024}
    row = {"program": name, "compile_s": time.perf_counter() - start, "fits": False,
           "note": message.strip().splitlines()[0][:300]}
    if figures:
      row["peak"] = int(float(figures.group(1)) * unit.get(figures.group(2), 1))
    return row, None
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
  aliased, temporaries = memory.alias_size_in_bytes, memory.temp_size_in_bytes
  return {"program": name, "compile_s": seconds, "arguments": arguments, "outputs": outputs,
          "aliased": aliased, "temporaries": temporaries,
          "peak": arguments + outputs - aliased + temporaries,
          "flops": cost.get("flops"), "collectives": _collectives(compiled.as_text())}, compiled


class _Planner:
  """Builds and compiles the programs of one Workload on one mesh at one dtype."""

  def __init__(self, workload: workload_lib.Workload, mesh, dtype, strict: bool):
    self.w, self.mesh, self.dtype, self.strict = workload, mesh, dtype, strict
    self.encoder_decoder = isinstance(workload.target, t5.T5Config)
    # T5's decoder prompt is its start token; the text is the source.
    self.prompt_length = 1 if self.encoder_decoder else workload.prompt_length
    # A verification write never falls off the end (decoding/core.py: Loop.start's cache length).
    self.max_length = self.prompt_length + workload.max_new_tokens + workload.gamma + 1
    batch = workload.batch
    rows = sharding.batch_sharding(mesh, batch)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32,
                                   sharding=sharding.batch_sharding(mesh, batch, 1))
    self.inputs = (jax.ShapeDtypeStruct((batch, self.prompt_length), jnp.int32, sharding=rows),
                   lengths)
    self.source = None
    if self.encoder_decoder:
      self.source = contracts.Source(
          jax.ShapeDtypeStruct((batch, workload.prompt_length), jnp.int32, sharding=rows), lengths)
    whole = NamedSharding(mesh, PartitionSpec())
    self.scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=whole)
    self.rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=whole)
    self._params = {}

  def model(self, config):
    return models.model_for(config, self.mesh, self.dtype)

  def params(self, config):
    """Abstract sharded params, built once per model (tracing a 70B init takes seconds)."""
    if config not in self._params:
      self._params[config] = abstract_params(config, self.mesh, self.dtype, self.strict)
    return self._params[config]

  def cache(self, config):
    """The model's empty KV cache as the loop allocates it, laid out by the rules."""
    shape = jax.eval_shape(lambda: self.model(config).init_cache(self.w.batch, self.max_length))
    return jax.tree_util.tree_map(self._placed, shape)

  def _placed(self, leaf):
    """K/V buffers [B, S, heads, D] by the cache's logical axes (strict: refused if they do not split),
    per-row vectors by batch: how the model's constraints lay out a cache or a T5 context."""
    if leaf.ndim == 4:
      layout = NamedSharding(self.mesh, sharding.spec_for(
          kv_cache.LOGICAL_AXES, leaf.shape, self.mesh, self.strict, "the KV cache"))
    else:
      layout = sharding.batch_sharding(self.mesh, self.w.batch, 1)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=layout)

  def prefill(self, config) -> dict:
    """Encode (T5) and score the prompt into a fresh cache: -> (last logits, context, cache), the
    state the steps then read."""
    model, max_length = self.model(config), self.max_length

    def prefill_fn(params, tokens, lengths, source):
      context = model.encode(params, source)
      session = contracts.Session(functools.partial(model.decode_step, params, context),
                                  model.init_cache)
      logits, cache = autoregressive.prefill(session, tokens, lengths, max_length)
      return autoregressive.last_prompt_logits(logits, lengths), context, cache

    return _compile("prefill", lambda: jax.jit(prefill_fn).lower(
        self.params(config), *self.inputs, self.source))[0]

  def decode_state(self, config):
    """The abstract (context, cache) a step reads: the encoded source (T5; None otherwise) and the
    cache, laid out as the model's constraints lay them out."""
    model = self.model(config)
    context = jax.eval_shape(model.encode, self.params(config), self.source)
    return jax.tree_util.tree_map(self._placed, context), self.cache(config)

  def step(self, config, state, steps: int, name: str) -> dict:
    """One decode_step of `steps` tokens on the cache (donated: updated in place, as in the loop)."""
    model = self.model(config)
    context, cache = state
    tokens = jax.ShapeDtypeStruct((self.w.batch, steps), jnp.int32,
                                  sharding=sharding.batch_sharding(self.mesh, self.w.batch))
    step_fn = lambda params, context, cache, tokens, positions: model.decode_step(
        params, context, tokens, positions, cache)
    return _compile(name, lambda: jax.jit(step_fn, donate_argnums=2).lower(
        self.params(config), context, cache, tokens, tokens))[0]

  def loop(self, draft_config=None) -> dict:
    """The whole decode: the speculative loop with this draft, or the autoregressive loop."""
    w, target = self.w, self.model(self.w.target)
    if draft_config is None:
      shape = autoregressive.DecodeShape(w.max_new_tokens, w.top_k)
      fn = jax.jit(functools.partial(autoregressive.generate, target, shape))
      args = (self.params(w.target), *self.inputs, self.rng, self.scalar, self.scalar, self.source)
    else:
      drafter = expansion.SampledChain(model_drafts.ModelDrafter(self.model(draft_config)), w.gamma)
      fn = jax.jit(functools.partial(core.decode, target, drafter,
                                     core.DecodeConfig(w.max_new_tokens, w.top_k)))
      args = (self.params(w.target), self.params(draft_config), *self.inputs, self.rng,
              self.scalar, self.scalar, self.scalar, self.source)
    return _compile("loop", lambda: fn.lower(*args))[0]


def plan(workload: workload_lib.Workload, devices: devices_lib.Devices, dtype_name: str = "float32",
         memory_bytes: int | None = None, strict: bool = False, programs=None) -> dict:
  """Compile every program of the workload at one dtype -> {"rows": [...], "fits": bool | None, ...}.

  memory_bytes: per device (default: the devices' own, None on CPU: no verdict). programs: a subset
  of ("prefill", "draft step", "verify", "decode step", "loop") to compile (default all)."""
  if dtype_name not in DTYPES:
    raise ValueError(f"unknown dtype {dtype_name!r}; plan one of {', '.join(DTYPES)}")
  unknown = set(programs or ()) - set(PROGRAMS)
  if unknown:
    raise ValueError(f"unknown programs {sorted(unknown)}; plan some of {', '.join(PROGRAMS)}")
  dtype = DTYPES[dtype_name]
  mesh = sharding.make_mesh(*workload.mesh_shape, devices=devices.devices)
  memory_bytes = memory_bytes if memory_bytes is not None else devices.memory_bytes
  planner = _Planner(workload, mesh, dtype, strict)
  wanted = lambda name: programs is None or name in programs
  rows, notes = [], []
  total = sum(1 for _ in _program_names(workload) if wanted(_))
  start = time.perf_counter()

  def add(model_name, row, params_bytes, cache_bytes):
    row.update(model=model_name, params=params_bytes, cache=cache_bytes)
    if "fits" not in row:
      row["fits"] = None if memory_bytes is None else row["peak"] <= memory_bytes
    rows.append(row)
    logging.info("[%d/%d] %s %s (%s): compiled in %.1f s, peak %s per device (%.0f s elapsed)",
                 len(rows), total, model_name, row["program"], dtype_name, row["compile_s"],
                 report.bytes_text(row.get("peak")), time.perf_counter() - start)

  def hopeless(program, params_bytes, cache_bytes) -> dict | None:
    """On CPU, where compiling cannot run out of memory, a program whose parameters and cache alone
    exceed the memory is reported without compiling it (a TPU compiles it: its verdict counts)."""
    if devices.tpu or memory_bytes is None or params_bytes + cache_bytes <= memory_bytes:
      return None
    return {"program": program, "compile_s": 0.0, "fits": False,
            "note": f"not compiled: parameters and KV cache alone need "
                    f"{report.bytes_text(params_bytes + cache_bytes)} of "
                    f"{report.bytes_text(memory_bytes)} per device"}

  sized = {}
  for name, config in [("target", workload.target), *workload.drafts]:
    cache = planner.cache(config)
    # The cache's lengths[B] are bookkeeping; its bytes are the K/V buffers.
    sized[name] = (per_device_bytes(planner.params(config)),
                   per_device_bytes((cache.keys, cache.values)))
    notes += replicated(name, config, mesh, cache)
    is_target = name == "target"
    step_name = ("verify" if workload.drafts else "decode step") if is_target else "draft step"
    steps = workload.gamma + 1 if is_target and workload.drafts else 1
    if wanted("prefill"):
      add(name, hopeless("prefill", *sized[name]) or planner.prefill(config), *sized[name])
    if wanted(step_name):
      add(name, hopeless(step_name, *sized[name]) or planner.step(
          config, planner.decode_state(config), steps, step_name), *sized[name])
  if wanted("loop"):
    for name, config in workload.drafts or [(None, None)]:
      model_name = "target" if name is None else f"target + {name}"
      params_bytes = sized["target"][0] + (sized[name][0] if name else 0)
      cache_bytes = sized["target"][1] + (sized[name][1] if name else 0)
      add(model_name, hopeless("loop", params_bytes, cache_bytes) or planner.loop(config),
          params_bytes, cache_bytes)
  verdicts = [row["fits"] for row in rows]
  fits = None if None in verdicts else all(verdicts)
  return {"dtype": dtype_name, "mesh": dict(mesh.shape), "devices": devices.description,
          "memory_per_device": memory_bytes, "max_length": planner.max_length, "rows": rows,
          "fits": fits, "replicated": notes}


def _program_names(workload: workload_lib.Workload):
  yield "prefill"
  yield "verify" if workload.drafts else "decode step"
  for _ in workload.drafts:
    yield "prefill"
    yield "draft step"
  for _ in workload.drafts or [None]:
    yield "loop"


# ----------------------------------------------------------------------------------------------------
# The command.


def run_plan(job, spec: PlanSpec = PlanSpec(), output_dir: str | None = None) -> list[dict]:
  """Plan a decoding job (a config's `run.main.job`) at every dtype of `spec`; print the tables;
  write plan.md and plan.json to output_dir (process 0)."""
  workload = workload_lib.of_job(job, spec.target_size, spec.draft_sizes, spec.prompt_length)
  if spec.topology:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    if not xla_bridge.backends_are_initialized():
      jax.config.update("jax_platforms", "cpu")  # the TPU compiler needs no local TPU
    devices = devices_lib.tpu_devices(spec.topology)
  else:
    devices_lib.simulate_cpu_devices(math.prod(workload.mesh_shape))
    devices = devices_lib.local_devices()
  memory = None if spec.memory_gib is None else int(spec.memory_gib * GIB)
  results, text = [], []
  for dtype_name in spec.dtypes or (workload.dtype,):
    result = plan(workload, devices, dtype_name, memory, spec.strict_sharding, spec.programs)
    results.append(result)
    text.append(report.markdown(workload, result))
    print(text[-1], flush=True)
  if output_dir and jax.process_index() == 0:
    path = pathlib.Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "plan.md").write_text("\n".join(text))
    (path / "plan.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    logging.info("wrote %s", path / "plan.md")
  return results
