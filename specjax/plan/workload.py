"""What a decoding config runs, in shapes: its target and model drafts as architectures (no weights),
mesh, batch and lengths. specjax.plan compiles it.

Architectures are read from local checkpoints (config only), recognised from the public T5X names on
gs:// (flan_t5_xxl, t5_1_1_small, ...), or named (one of specjax.models.SIZES) where the weights are
not here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any


from specjax import checkpoints, models, specs, validation
from specjax.drafters import registry
from specjax.models import decoder_only, t5


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
  dtype: str = "float32"  # the run's specs.ModelSpec.dtype: what a plan compiles at by default


class MissingCheckpoint(FileNotFoundError, ValueError):
  """A checkpoint path that does not exist: missing (FileNotFoundError), and a config the plan cannot
  read (ValueError, as an unreadable architecture is)."""


# Public T5X checkpoints (gs://t5-data/pretrained_models/t5x/...) by directory name -> architecture.
_PUBLIC_T5X = re.compile(r"(flan_t5|t5_1_1(?:_lm100k)?|t5)_(small|base|large|xl|xxl|3B|11B)(?:/|$)")


def architecture(checkpoint: str, size: str | None = None, role: str = "target"):
  """The config of a checkpoint without its weights: `size` when named, else what the checkpoint
  says (local files), else the public T5X name in its path."""
  if size is not None:
    return models.config_by_name(size)
  if checkpoint == specs.EMBEDDED_SMOLLM2:
    return decoder_only.SIZES["smollm2-135m"]
  named = _PUBLIC_T5X.search(checkpoint)
  if named:
    family, scale = named.groups()
    if family == "t5":
      return t5.SIZES[f"t5-{scale.lower()}"]
    return t5.SIZES[f"t5.1.1-{scale}"]
  fix = (f"name its architecture: plan.PlanSpec.{'target_size' if role == 'target' else 'draft_sizes'}"
         f" (one of {', '.join(sorted(models.SIZES))})")
  if "://" in checkpoint:
    raise ValueError(f"cannot read the architecture of the {role} {checkpoint!r} here; {fix}")
  if not pathlib.Path(checkpoint).expanduser().exists():
    raise MissingCheckpoint(f"the {role} checkpoint {checkpoint!r} does not exist: fix the path in "
                            f"the config, or, to plan for weights that are not on this machine, "
                            f"{fix}")
  return checkpoints.read_config(pathlib.Path(checkpoint).expanduser())


def _draft_label(name: str, config, taken: list) -> str:
  """A short name for a draft in the tables: its architecture's ('t5.1.1-small draft'), else the
  drafter's own name."""
  known = models.size_name(config)
  label = (known if known.endswith("draft") else f"{known} draft") if known else name
  return label if label not in taken else f"{label} #{len(taken) + 1}"


def of_job(job, target_size: str | None = None, draft_sizes: tuple = (),
           prompt_length: int | None = None) -> Workload:
  """The Workload of a decoding job (generation.Generate or speculative_sweep.Sweep: a frozen
  dataclass with target, prompts, decode and mesh_shape). target_size / draft_sizes: architecture
  names for checkpoints not readable here (the draft sizes follow the config's checkpoint drafts in
  order); prompt_length: None takes the config's max_prompt_length, the longest input the run
  accepts."""
  arguments = {field.name: getattr(job, field.name) for field in dataclasses.fields(job)} \
      if dataclasses.is_dataclass(job) else {}
  if not {"target", "prompts", "decode", "mesh_shape"} <= set(arguments):
    raise ValueError(f"a plan covers the decoding jobs (generation.Generate, "
                     f"speculative_sweep.Sweep), not {type(job).__name__}")
  target_spec, prompts, decode = arguments["target"], arguments["prompts"], arguments["decode"]
  mesh_shape = validation.check_mesh_shape(arguments["mesh_shape"],
                                           f"{type(job).__name__}.mesh_shape")
  target = architecture(target_spec.checkpoint, target_size)
  grid = arguments.get("grid")
  if grid is not None:  # a sweep: every drafter at the largest gamma, one prompt at a time
    drafter_names, gamma, batch = tuple(grid.drafters), max(grid.gammas), 1
  else:  # generation.Generate: its batches, with its drafter if it names one
    drafter = arguments.get("drafter")
    drafter_names, gamma, batch = (() if drafter is None else (drafter,), arguments.get("gamma", 0),
                                   prompts.batch_size)
  planned = {name: registry.planned(name, target) for name in drafter_names}
  model_drafters = [name for name in drafter_names
                    if planned[name].config is not None or planned[name].checkpoint is not None]
  checkpoint_drafts = [name for name in model_drafters if planned[name].checkpoint is not None]
  if draft_sizes and len(draft_sizes) != len(checkpoint_drafts):
    raise ValueError(f"plan.PlanSpec.draft_sizes names {len(draft_sizes)} architectures but the "
                     f"config has {len(checkpoint_drafts)} checkpoint drafts: {checkpoint_drafts}")
  sizes = dict(zip(checkpoint_drafts, draft_sizes))
  drafts = []
  for name in model_drafters:
    config = planned[name].config
    if config is None:
      config = architecture(planned[name].checkpoint, sizes.get(name), role=f"draft {name!r}")
    if config.vocab_size != target.vocab_size:
      raise ValueError(f"vocabulary sizes differ: the target has {target.vocab_size} tokens, the draft "
                       f"{name} {config.vocab_size}")
    drafts.append((_draft_label(name, config, [label for label, _ in drafts]), config))
  return Workload(
      target=target, drafts=tuple(drafts), mesh_shape=mesh_shape,
      batch=batch, prompt_length=prompt_length or prompts.max_prompt_length,
      max_new_tokens=decode.max_new_tokens, gamma=gamma if drafts else 0, top_k=decode.top_k,
      skipped=tuple(name for name in drafter_names if name not in model_drafters),
      dtype=target_spec.dtype_name)
