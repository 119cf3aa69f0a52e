"""Plan a run before the pod starts: `python -m specjax.plan --gin_file=configs/X.gin [--topology=v4-8]`.

For a decoding config (a `run.generate` or `speculative_sweep.sweep` job) the plan builds the target
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

Architectures: read from local checkpoints (config only), recognised from the public T5X checkpoint
names on gs:// (flan_t5_xxl, t5_1_1_small, ...), or named in the config (`plan.PlanSpec.target_size`,
`plan.PlanSpec.draft_sizes`, one of `specjax.models.SIZES`) where the weights are not here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import pathlib
import re
import time
from typing import Any

import gin
import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from specjax import (autoregressive, checkpoints, contracts, drafters, loading, models, sharding,
                     speculative)
from specjax.models import decoder_only, kv_cache, t5

GIB = 1024 ** 3
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PlanSpec:
  """What the plan needs beyond the experiment config.

  target_size / draft_sizes: architecture names (specjax.models.SIZES) for checkpoints that cannot be
    read here (placeholders, remote paths); draft_sizes follow the config's model drafters in order.
  topology: a TPU slice ("v4-8", "v5p-64", "v4:2x2x1"); None plans on this machine's devices.
  dtypes: parameter and cache dtypes to plan ("float32", "bfloat16").
  memory_gib: per-device memory to fit in; None takes the TPU's HBM (no verdict on CPU).
  prompt_length: the padded prompt (T5: source) length; None takes the config's max_prompt_length,
    the longest input the run accepts.
  strict_sharding: refuse a dimension the rules cannot split (else it is replicated and listed).
  programs: a subset of PROGRAMS to compile (None: all).
  """
  target_size: str | None = None
  draft_sizes: tuple = ()
  topology: str | None = None
  dtypes: tuple = ("float32", "bfloat16")
  memory_gib: float | None = None
  prompt_length: int | None = None
  strict_sharding: bool = False
  programs: tuple | None = None


PROGRAMS = ("prefill", "draft step", "verify", "decode step", "loop")


@dataclasses.dataclass(frozen=True)
class Workload:
  """What a config decodes, in shapes: the target, its model drafts, the mesh and the batch."""
  target: Any
  drafts: tuple  # ((drafter name, config), ...)
  mesh_shape: tuple
  batch: int
  prompt_length: int  # decoder-only: the padded prompt; encoder-decoder: the padded source
  max_new_tokens: int
  gamma: int  # 0: no model draft, the autoregressive loop is planned
  top_k: int = 0
  skipped: tuple = ()  # drafters without a model (tables, lookup): nothing to plan


# ----------------------------------------------------------------------------------------------------
# Devices: TPU slices through the TPU compiler, or this machine's.

# generation -> (libtpu's name, chip config, HBM GiB per device, TensorCores per chip in the slice name)
_TPU_GENERATIONS = {
    "v4": ("v4", "megacore", 32, 2),
    "v5p": ("v5", "megacore", 95, 2),
    "v5e": ("v5e", "default", 16, 1),
    "v6e": ("v6e", "default", 32, 1),
}
# chips -> the slice's chip grid, as Cloud TPU shapes them
_GRIDS_3D = {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4",
             128: "4x4x8", 256: "4x8x8", 512: "8x8x8"}
_GRIDS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Devices:
  devices: tuple
  description: str
  memory_bytes: int | None  # per device; None: unknown (CPU)
  tpu: bool


def tpu_devices(topology: str) -> Devices:
  """A TPU slice by Cloud name ("v4-8": 8 TensorCores = 4 chips; "v5e-16": 16 chips) or by chip grid
  ("v4:2x2x1"), as devices of the TPU compiler (no TPU needed)."""
  match = re.fullmatch(r"(v4|v5p|v5e|v6e)(?:-(\d+)|:(\d+(?:x\d+){1,2}))", topology)
  known = ", ".join(f"{g}-N" for g in _TPU_GENERATIONS)
  if not match:
    raise ValueError(f"unknown TPU topology {topology!r}; name a slice ({known}, e.g. v4-8, "
                     "v5p-64, v5e-16) or a chip grid (e.g. v4:2x2x1, v5e:4x4)")
  generation, cores, grid = match.groups()
  libtpu_name, chip_config, hbm_gib, cores_per_chip = _TPU_GENERATIONS[generation]
  grids = _GRIDS_2D if generation in ("v5e", "v6e") else _GRIDS_3D
  if grid is None:
    chips, remainder = divmod(int(cores), cores_per_chip)
    if remainder or chips not in grids:
      sizes = ", ".join(f"{generation}-{n * cores_per_chip}" for n in grids)
      raise ValueError(f"unknown TPU topology {topology!r}; {generation} slices here: {sizes}")
    grid = grids[chips]
  if (grid.count("x") == 1) != (generation in ("v5e", "v6e")):
    raise ValueError(f"unknown TPU topology {topology!r}: {generation} chips form a "
                     f"{'2-D' if generation in ('v5e', 'v6e') else '3-D'} grid")
  if importlib.util.find_spec("libtpu") is None:
    raise RuntimeError(f"planning for the TPU topology {topology!r} needs the TPU compiler, the libtpu "
                       "wheel: pip install -e '.[tpu]' (about 700 MB; no TPU needed), or drop "
                       "--topology to plan on this machine's devices")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  # Only the compiler is used, no chip: let several plans (or a plan beside a TPU job) load libtpu at
  # once instead of failing on its lock file.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  chips = math.prod(int(n) for n in grid.split("x"))
  bounds = (1, 1, 1) if chips == 1 else (2, 2, 1)
  description = topologies.get_topology_desc(
      topology_name=f"{libtpu_name}:{grid}", platform="tpu", chip_config_name=chip_config,
      chips_per_host_bounds=bounds, num_slices=1)
  devices = tuple(description.devices)
  return Devices(devices, f"{topology} ({generation}:{grid}, {len(devices)} devices, "
                 f"{hbm_gib} GiB HBM each)", hbm_gib * GIB, True)


def local_devices() -> Devices:
  """This machine's devices; their memory where the runtime says it (GPU, TPU; not CPU)."""
  devices = tuple(jax.devices())
  stats = devices[0].memory_stats() or {}
  return Devices(devices, f"{len(devices)} {devices[0].platform} devices", stats.get("bytes_limit"),
                 False)


# ----------------------------------------------------------------------------------------------------
# The workload of a config.

# Public T5X checkpoints (gs://t5-data/pretrained_models/t5x/...) by directory name -> architecture.
_PUBLIC_T5X = re.compile(r"(flan_t5|t5_1_1(?:_lm100k)?|t5)_(small|base|large|xl|xxl|3B|11B)(?:/|$)")


def architecture(checkpoint: str, size: str | None = None, role: str = "target"):
  """The config of a checkpoint without its weights: `size` when named, else what the checkpoint
  says (local files), else the public T5X name in its path."""
  if size is not None:
    return models.config_by_name(size)
  if checkpoint == loading.EMBEDDED_SMOLLM2:
    return decoder_only.SIZES["smollm2-135m"]
  named = _PUBLIC_T5X.search(checkpoint)
  if named:
    family, scale = named.groups()
    if family == "t5":
      return t5.SIZES[f"t5-{scale.lower()}"]
    return t5.SIZES[f"t5.1.1-{scale}"]
  fix = (f"name its architecture: plan.PlanSpec.{'target_size' if role == 'target' else 'draft_sizes'}"
         f" (one of {', '.join(sorted(models.SIZES))})")
  if "://" in checkpoint or not pathlib.Path(checkpoint).expanduser().exists():
    raise ValueError(f"cannot read the architecture of the {role} {checkpoint!r} here; {fix}")
  return checkpoints.read_config(pathlib.Path(checkpoint).expanduser())


def _draft_label(name: str, config, taken: list) -> str:
  """A short name for a draft in the tables: its architecture's ('t5.1.1-small draft'), else the
  drafter's own name."""
  known = size_name(config)
  label = (known if known.endswith("draft") else f"{known} draft") if known else name
  return label if label not in taken else f"{label} #{len(taken) + 1}"


def size_name(config) -> str | None:
  """The name of a config in specjax.models.SIZES, if it is one of them."""
  return next((name for name, known in models.SIZES.items() if known == config), None)


def _bindings(selector: str, function) -> dict:
  """A gin configurable's arguments: its defaults overridden by the config's bindings."""
  arguments = {name: parameter.default
               for name, parameter in inspect.signature(function).parameters.items()
               if parameter.default is not inspect.Parameter.empty}
  arguments.update(gin.get_bindings(selector, resolve_references=True))
  return arguments


def workload_from_config(spec: PlanSpec) -> Workload:
  """The Workload of the parsed gin config's job (run.generate or speculative_sweep.sweep)."""
  try:
    job = gin.query_parameter("run.main.job")
  except ValueError:
    job = None
  if not isinstance(job, gin.config.ConfigurableReference):
    raise ValueError("the config binds no job (run.main.job); a plan covers the decoding jobs "
                     "run.generate and speculative_sweep.sweep")
  arguments = _bindings(job.configurable.selector, job.configurable.wrapped)
  if not {"target", "prompts", "decode", "mesh_shape"} <= set(arguments):
    raise ValueError(f"a plan covers the decoding jobs (run.generate, speculative_sweep.sweep), not "
                     f"{job.configurable.name}")
  target_spec, prompts, decode = arguments["target"], arguments["prompts"], arguments["decode"]
  target = architecture(target_spec.checkpoint, spec.target_size)
  grid = arguments.get("grid")
  if grid is not None:  # a sweep: every drafter at the largest gamma, one prompt at a time
    drafter_names, gamma, batch = tuple(grid.drafters), max(grid.gammas), 1
  else:  # run.generate: its batches, with its drafter if it names one
    drafter = arguments.get("drafter")
    drafter_names, gamma, batch = (() if drafter is None else (drafter,), arguments.get("gamma", 0),
                                   prompts.batch_size)
  inner = {name: re.sub(r"^(lookup\+)+", "", name) for name in drafter_names}  # lookup costs nothing
  model_drafters = [name for name in drafter_names
                    if inner[name].startswith("model:") or re.fullmatch(r"layers\d+", inner[name])]
  checkpoint_drafts = [name for name in model_drafters if inner[name].startswith("model:")]
  if spec.draft_sizes and len(spec.draft_sizes) != len(checkpoint_drafts):
    raise ValueError(f"plan.PlanSpec.draft_sizes names {len(spec.draft_sizes)} architectures but the "
                     f"config has {len(checkpoint_drafts)} checkpoint drafts: {checkpoint_drafts}")
  sizes = dict(zip(checkpoint_drafts, spec.draft_sizes))
  drafts = []
  for name in model_drafters:
    if inner[name].startswith("model:"):
      config = architecture(inner[name][len("model:"):], sizes.get(name), role=f"draft {name!r}")
    else:
      config = dataclasses.replace(target, num_layers=int(inner[name][len("layers"):]))
    if config.vocab_size != target.vocab_size:
      raise ValueError(f"vocabulary sizes differ: the target has {target.vocab_size} tokens, the draft "
                       f"{name} {config.vocab_size}")
    drafts.append((_draft_label(name, config, [label for label, _ in drafts]), config))
  return Workload(
      target=target, drafts=tuple(drafts), mesh_shape=tuple(arguments["mesh_shape"]),
      batch=batch, prompt_length=spec.prompt_length or prompts.max_prompt_length,
      max_new_tokens=decode.max_new_tokens, gamma=gamma if drafts else 0, top_k=decode.top_k,
      skipped=tuple(name for name in drafter_names if name not in model_drafters))


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


def _kv_shape(config, batch: int, max_length: int) -> tuple:
  if isinstance(config, t5.T5Config):
    return (batch, max_length, config.num_heads, config.head_dim)
  return (batch, max_length, config.num_kv_heads, config.head_dim)


def replicated(name: str, config, mesh, batch: int, max_length: int) -> list[str]:
  """What the rules leave whole on every device for this model: '<model> <where>: <axes>'."""
  found = {}
  logical = models._family(config).param_logical_axes(config)  # pylint: disable=protected-access
  shapes = models.param_shapes(config)
  is_spec = lambda x: isinstance(x, PartitionSpec)
  for axes_, shape in zip(jax.tree_util.tree_leaves(logical, is_leaf=is_spec),
                          jax.tree_util.tree_leaves(shapes)):
    for axis in sharding.replicated_axes(tuple(axes_), shape.shape, mesh):
      found[axis] = found.get(axis, 0) + 1
  notes = [f"{name} params: {axis} in {count} arrays" for axis, count in sorted(found.items())]
  cache_axes = sharding.replicated_axes(kv_cache.LOGICAL_AXES, _kv_shape(config, batch, max_length),
                                        mesh)
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

  def __init__(self, workload: Workload, mesh, dtype, strict: bool):
    self.w, self.mesh, self.dtype, self.strict = workload, mesh, dtype, strict
    self.encoder_decoder = isinstance(workload.target, t5.T5Config)
    # T5's decoder prompt is its start token; the text is the source.
    self.prompt_length = 1 if self.encoder_decoder else workload.prompt_length
    # A verification write never falls off the end (speculative.speculative_decode's cache length).
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

  def model(self, config):
    return models.model_for(config, self.mesh, self.dtype)

  def params(self, config):
    return abstract_params(config, self.mesh, self.dtype, self.strict)

  def cache_bytes(self, config) -> int:
    """Per device: the KV cache (self-attention; T5's cross-attention K/V sit in the context)."""
    shape = _kv_shape(config, self.w.batch, self.max_length)
    spec = sharding.spec_for(kv_cache.LOGICAL_AXES, shape, self.mesh, self.strict,
                             "the KV cache")
    layers = config.num_decoder_layers if isinstance(config, t5.T5Config) else config.num_layers
    shard = NamedSharding(self.mesh, spec).shard_shape(shape)
    return 2 * layers * math.prod(shard) * jnp.dtype(self.dtype).itemsize

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
    """The abstract (context, cache) a step reads, laid out by the rules as the model's constraints
    lay them out: K/V buffers [B, S, heads, D] by the cache's logical axes, per-row vectors by batch."""
    model = self.model(config)
    context, cache = jax.eval_shape(
        lambda params, source: (model.encode(params, source),
                                model.init_cache(self.w.batch, self.max_length)),
        self.params(config), self.source)
    rows = sharding.batch_sharding(self.mesh, self.w.batch, 1)

    def placed(leaf):
      layout = (NamedSharding(self.mesh, sharding.spec_for(kv_cache.LOGICAL_AXES, leaf.shape,
                                                           self.mesh))
                if leaf.ndim == 4 else rows)
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=layout)

    return jax.tree_util.tree_map(placed, (context, cache))

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
      config = speculative.SpecConfig(w.gamma, w.max_new_tokens, w.top_k)
      fn = jax.jit(functools.partial(speculative.speculative_decode, target,
                                     drafters.ModelDrafter(self.model(draft_config)), config))
      args = (self.params(w.target), self.params(draft_config), *self.inputs, self.rng,
              self.scalar, self.scalar, self.scalar, self.source)
    return _compile("loop", lambda: fn.lower(*args))[0]


def plan(workload: Workload, devices: Devices, dtype_name: str = "float32",
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
                 _gib(row.get("peak")), time.perf_counter() - start)

  def hopeless(program, params_bytes, cache_bytes) -> dict | None:
    """On CPU, where compiling cannot run out of memory, a program whose parameters and cache alone
    exceed the memory is reported without compiling it (a TPU compiles it: its verdict counts)."""
    if devices.tpu or memory_bytes is None or params_bytes + cache_bytes <= memory_bytes:
      return None
    return {"program": program, "compile_s": 0.0, "fits": False,
            "note": f"not compiled: parameters and KV cache alone need "
                    f"{_gib(params_bytes + cache_bytes)} of {_gib(memory_bytes)} per device"}

  sized = {}
  for name, config in [("target", workload.target), *workload.drafts]:
    sized[name] = (per_device_bytes(planner.params(config)), planner.cache_bytes(config))
    notes += replicated(name, config, mesh, workload.batch, planner.max_length)
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


def _program_names(workload: Workload):
  yield "prefill"
  yield "verify" if workload.drafts else "decode step"
  for _ in workload.drafts:
    yield "prefill"
    yield "draft step"
  for _ in workload.drafts or [None]:
    yield "loop"


# ----------------------------------------------------------------------------------------------------
# Reporting.


def _gib(value) -> str:
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
  return f"{name}: {size_name(config) or config} ({count / 1e9:.2f}B params)"


def markdown(workload: Workload, result: dict) -> str:
  """One plan (one dtype) as a markdown table with its header lines."""
  fits = {True: "yes", False: "NO", None: "-"}
  memory = result["memory_per_device"]
  lines = [f"### {result['dtype']} on {result['devices']}, mesh {result['mesh']}",
           "",
           f"- models: {'; '.join(_describe_model(n, c) for n, c in [('target', workload.target), *workload.drafts])}",
           f"- batch {workload.batch}, {'source' if isinstance(workload.target, t5.T5Config) else 'prompt'}"
           f" {workload.prompt_length} tokens, {workload.max_new_tokens} new tokens"
           + (f", gamma {workload.gamma}" if workload.drafts else "")
           + f"; cache {result['max_length']} slots",
           f"- per-device memory: {_gib(memory) if memory else 'not given (no verdict)'}; "
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
    lines.append(
        f"| {row['model']} | {row['program']} | {_gib(row['params'])} | {_gib(row['cache'])} | "
        f"{_gib(row.get('arguments'))} | {_gib(row.get('outputs'))} | {_gib(row.get('temporaries'))} | "
        f"{_gib(row.get('peak'))} | {'-' if flops is None else f'{flops / 1e9:.1f}'} | "
        f"{_collective_text(row.get('collectives'))} | {row['compile_s']:.1f} | {fits[row['fits']]} |")
    if row.get("note"):
      lines.append(f"|  | ({row['note']}) |  |  |  |  |  |  |  |  |  |  |")
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------
# The command.


def _simulate_cpu_devices(count: int) -> None:
  """On CPU, make `count` simulated devices for the mesh, if jax has not started its backends yet."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" in xla_flags or xla_bridge.backends_are_initialized():
    return
  os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={count}".strip()


def run_plan(spec: PlanSpec = PlanSpec(), output_dir: str | None = None) -> list[dict]:
  """Plan the parsed config's job at every dtype of `spec`; print the tables; write plan.md and
  plan.json to output_dir (process 0)."""
  workload = workload_from_config(spec)
  if spec.topology:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    if not xla_bridge.backends_are_initialized():
      jax.config.update("jax_platforms", "cpu")  # the TPU compiler needs no local TPU
    devices = tpu_devices(spec.topology)
  else:
    _simulate_cpu_devices(math.prod(workload.mesh_shape))
    devices = local_devices()
  memory = None if spec.memory_gib is None else int(spec.memory_gib * GIB)
  results, text = [], []
  for dtype_name in spec.dtypes:
    result = plan(workload, devices, dtype_name, memory, spec.strict_sharding, spec.programs)
    results.append(result)
    text.append(markdown(workload, result))
    print(text[-1], flush=True)
  if output_dir and jax.process_index() == 0:
    path = pathlib.Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "plan.md").write_text("\n".join(text))
    (path / "plan.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    logging.info("wrote %s", path / "plan.md")
  return results


def main(argv=None):
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from specjax import run  # pylint: disable=import-outside-toplevel

  flags.DEFINE_multi_string("gin_file", [], "The experiment config(s) to plan (configs/*.gin).")
  flags.DEFINE_multi_string("gin_bindings", [], "Extra bindings, e.g. \"plan.PlanSpec.dtypes = "
                            "('bfloat16',)\".")
  flags.DEFINE_string("topology", None, "A TPU slice (v4-8, v5p-64, v5e-16, v4:2x2x1); default: this "
                      "machine's devices (simulated on CPU).")
  flags.DEFINE_multi_string("dtype", [], "Parameter / cache dtypes to plan (float32, bfloat16).")
  flags.DEFINE_float("memory_gib", None, "Per-device memory to fit in (default: the TPU's HBM).")
  flags.DEFINE_string("output_dir", None, "Where plan.md / plan.json go (default out/plan/<config>).")
  flags.DEFINE_bool("strict_sharding", None, "Refuse dimensions the mesh axis does not divide.")
  flags.DEFINE_multi_string("program", [], f"Programs to compile (default all): {', '.join(PROGRAMS)}.")

  def plan_entry(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS.gin_file:
      raise app.UsageError("pass --gin_file=configs/<experiment>.gin (see configs/)")
    run.parse_gin(flags.FLAGS.gin_file, flags.FLAGS.gin_bindings)
    spec = PlanSpec()  # with the config's plan.PlanSpec bindings, then the flags
    overrides = {"topology": flags.FLAGS.topology, "memory_gib": flags.FLAGS.memory_gib,
                 "strict_sharding": flags.FLAGS.strict_sharding,
                 "dtypes": tuple(flags.FLAGS.dtype) or None,
                 "programs": tuple(flags.FLAGS.program) or None}
    spec = dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    output_dir = flags.FLAGS.output_dir or str(
        pathlib.Path("out/plan") / (pathlib.Path(flags.FLAGS.gin_file[-1]).stem
                                    + (f"-{spec.topology}" if spec.topology else "")))
    run_plan(spec, output_dir)

  app.run(plan_entry, argv)


if __name__ == "__main__":
  from specjax import plan as _module  # pylint: disable=import-self
  _module.main()
