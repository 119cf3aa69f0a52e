"""Drafters by name: one frozen spec per drafter, parsed once from the user's string, and one registry
entry per kind that says how to build it, what it reads and how a plan costs it.

    spec = registry.parse("lookup+model:out/smollm2_draft/hf")   # DrafterSpec(kind="model", ...)
    drafter, params = registry.build(spec, registry.Target(config, params), Tree.chain(4))

The names: `<kind>[:<checkpoint>]`, `layers<k>` (the target's first k layers), and `lookup+<name>`
(prompt lookup in front of any of them, one wrapper: drafters/lookup.py). Tables, plans, content
keys and fingerprints read the spec; an unknown kind, or one a plan cannot cost, is refused with the
registered kinds. A new drafter is its module and one `register(Kind(...))` call: the test suite
registers one of its own (tests/test_core.py).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specjax import contracts, loading
from specjax.decoding.tree import Tree
from specjax.drafters import dflash, eagle3, expansion, heads, lookup, model, mtp, tables
from specjax.models import cpu_kernels

LOOKUP_FRONT = "lookup+"


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
  """A drafter as the user named it: its kind, the checkpoint it reads (None for kinds that read
  none), kind options, and whether prompt lookup goes in front of it."""
  kind: str
  checkpoint: str | None = None
  options: tuple[tuple[str, Any], ...] = ()
  lookup_front: bool = False

  @property
  def name(self) -> str:
    """The canonical string: parse(spec.name) == spec."""
    inner = {"layers": lambda: f"layers{self.option('num_layers')}"}.get(
        self.kind, lambda: self.kind + (f":{self.checkpoint}" if self.checkpoint else ""))()
    return (LOOKUP_FRONT if self.lookup_front else "") + inner

  def option(self, key: str, default=None):
    return dict(self.options).get(key, default)

  @property
  def entry(self) -> "Kind":
    return KINDS[self.kind]


@dataclasses.dataclass(frozen=True)
class Target:
  """What a drafter may be built from: the target's config and params, its mesh (more than one
  device: a model draft is sharded by the same rules), and token-id sequences of text like its
  output (what table drafters are counted on; None when no drafter needs them)."""
  config: Any
  params: Any = None
  mesh: Any = None
  sequences: Sequence[Sequence[int]] | None = None

  @property
  def dtype(self):
    """What the target decodes in (its params' floating dtype; float32 without params): model drafts
    decode in it too."""
    floating = [leaf.dtype for leaf in jax.tree_util.tree_leaves(self.params)
                if jnp.issubdtype(leaf.dtype, jnp.floating)]
    return floating[0] if floating else jnp.float32


@dataclasses.dataclass(frozen=True)
class Planned:
  """How a plan costs a drafter: the architecture of the model it runs (`config`), or the checkpoint
  to read it from, or neither (nothing worth compiling: a table, a lookup, heads on the target's
  own features)."""
  config: Any = None
  checkpoint: str | None = None


@dataclasses.dataclass(frozen=True)
class Kind:
  """One kind of drafter.

  build(spec, target, tree, sample) -> (a contracts.Drafter of `tree`, or a one-token step that
    `expansion.expand` turns into one; its params on the device).
  label: the kind in tables ("draft model", "MTP head").
  checkpoint: whether names carry a checkpoint (`kind:<path>`), whose content key enters a run's spec.
  needs_text: counted on token sequences (Target.sequences).
  plan: spec, target config -> Planned; None: a plan cannot cost it (refused by the planner).
  missing: the fix when the checkpoint is not there (a training command).
  decoder_only: it reads a decoder-only target's hidden states (refused for a T5 target).
  per_tree: its build depends on the tree and `sample` (else `build` can reuse one build for every
    tree).
  refuses: spec, tree -> why the drafter cannot draft `tree` (read from what its name and saved
    metadata say, before anything is loaded), or None; unset: any static tree.
  grows_trees: it grows a dynamic tree of its own (Tree.dynamic); other kinds are refused one.
  """
  name: str
  build: Callable
  label: str
  checkpoint: bool = False
  needs_text: bool = False
  plan: Callable[[DrafterSpec, Any], Planned] | None = None
  missing: str = ""
  decoder_only: bool = False
  per_tree: bool = False
  refuses: Callable[[DrafterSpec, Tree], str | None] | None = None
  grows_trees: bool = False


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
  """Add a kind (a new drafter's one registry line). Re-registering a name replaces it."""
  KINDS[kind.name] = kind
  return kind


def _known() -> str:
  return ", ".join(f"{name}{':<checkpoint>' if k.checkpoint else ''}" for name, k in KINDS.items()
                   if name != "layers") + ", layers<k>, lookup+<any of these>"


def parse(name: str) -> DrafterSpec:
  """The spec of a drafter name; an unknown kind or a malformed name is refused with the kinds."""
  if isinstance(name, DrafterSpec):
    return name
  text = str(name)
  front = text.startswith(LOOKUP_FRONT)
  inner = text[len(LOOKUP_FRONT):] if front else text
  layers = re.fullmatch(r"layers(\d+)", inner)
  if layers:
    spec = DrafterSpec("layers", options=(("num_layers", int(layers.group(1))),), lookup_front=front)
  else:
    kind, colon, checkpoint = inner.partition(":")
    if kind not in KINDS or kind == "layers":
      raise ValueError(f"unknown drafter {text!r}; registered kinds: {_known()}")
    if KINDS[kind].checkpoint and not checkpoint:
      raise ValueError(f"drafter {text!r} names no checkpoint: write {kind}:<path>")
    if colon and not KINDS[kind].checkpoint:
      raise ValueError(f"drafter {text!r}: the {kind} drafter reads no checkpoint; write {kind}")
    spec = DrafterSpec(kind, checkpoint or None, lookup_front=front)
  if front and spec.kind == "lookup":
    raise ValueError(f"drafter {text!r}: prompt lookup in front of prompt lookup is prompt lookup")
  return spec


def check(spec: DrafterSpec | str, target_config=None) -> DrafterSpec:
  """Refuse a spec before anything runs: an unknown kind, a missing checkpoint (with the fix), a
  drafter of decoder-only targets' hidden states for an encoder-decoder target."""
  spec = parse(spec)
  if spec.checkpoint and "://" not in spec.checkpoint and not pathlib.Path(
      spec.checkpoint).expanduser().exists():
    raise FileNotFoundError(f"no {spec.entry.label} checkpoint at {spec.checkpoint}; "
                            f"{spec.entry.missing or 'point the drafter at one'}")
  if spec.entry.decoder_only and hasattr(target_config, "num_encoder_layers"):  # a T5Config
    raise ValueError(f"the drafter {spec.name!r} reads a decoder-only target's hidden states and is "
                     "trained for decoder-only targets only; for a T5 target build the tree from a "
                     "model draft's top-k instead, e.g. model:out/t5_gettext/draft_large/hf "
                     "(configs/t5_gettext/trees.gin)")
  return spec


def check_tree(name, tree: Tree) -> None:
  """Refuse a drafter for a tree it cannot draft before anything runs (a sweep checks every pair
  of its grid): a dynamic tree for a kind that ranks candidates for static ones, a tree deeper than
  a trained block, a static tree for a drafter that grows its own."""
  spec = check(name)
  if tree.top_k and not (spec.entry.grows_trees and not spec.lookup_front):
    raise ValueError(f"the {spec.name} drafter ranks candidates for a static tree; the dynamic tree "
                     f"{tree.name} is grown by a drafter that scores its own paths (eagle3:<path>, "
                     "without lookup in front)")
  reason = spec.entry.refuses(spec, tree) if spec.entry.refuses else None
  if reason:
    raise ValueError(f"the {spec.name} drafter cannot draft {tree.name}: {reason}")


def check_vocabulary(names, tokenizer, target_name: str) -> None:
  """Refuse a model draft whose checkpoint ships another vocabulary than the target's `tokenizer`
  (the same size is not enough: loading.check_same_vocabulary), before anything runs."""
  for name in names:
    spec = check(name)
    if spec.kind == "model":
      loading.check_same_vocabulary(
          tokenizer, f"the target {target_name}", spec.checkpoint, f"the draft {name!r}",
          "Speculative decoding needs one vocabulary: pick or train a draft with the target's "
          "tokenizer (configs/smollm2_draft.gin distils one)")


def checkpoints_of(names) -> dict[str, str]:
  """{drafter name: checkpoint path} of the names that read a checkpoint (checked)."""
  return {name: spec.checkpoint for name in names if (spec := check(name)).checkpoint}


def needs_text(names) -> bool:
  """Whether any of the drafters is counted on token sequences (Target.sequences)."""
  return any(parse(name).entry.needs_text for name in names)


def label(name) -> str:
  """The drafter's kind as tables print it, e.g. 'lookup + MTP head'."""
  spec = parse(name)
  return ("lookup + " if spec.lookup_front else "") + spec.entry.label


def planned(name, target_config) -> Planned:
  """How a plan costs the drafter (Kind.plan); refused for a kind a plan cannot cost."""
  spec = parse(name)
  if spec.entry.plan is None:
    costed = ", ".join(k for k, entry in KINDS.items() if entry.plan is not None)
    raise ValueError(f"a plan cannot cost the {spec.kind} drafter of {spec.name!r}: its kind names "
                     f"no architecture (Kind.plan); kinds a plan costs: {costed}")
  return spec.entry.plan(spec, target_config)


def build(name, target: Target, tree: Tree, sample: bool = True, memo: dict | None = None):
  """(a contracts.Drafter of `tree`, its params on the device) for the named drafter. A one-token
  step is expanded: a sampled chain where the tree is a chain and `sample` asks for it, else its
  top-k tree. Prompt lookup goes in front before the expansion (a step's proposal) or around it (a
  drafter of ranked candidates). memo: a dict kept by the caller, so that building one drafter for
  several trees loads its checkpoint once."""
  spec = check(name, target.config)
  check_tree(spec, tree)
  if spec.entry.needs_text and target.sequences is None:
    raise ValueError(f"the {spec.kind} drafter is counted on token sequences; pass "
                     "Target(sequences=...)")
  key = (spec, tree, sample) if spec.entry.per_tree else (spec, None)
  if memo is not None and key in memo:
    made, params = memo[key]
  else:
    made, params = spec.entry.build(spec, target, tree, sample)
    if memo is not None:
      memo[key] = made, params
  if spec.lookup_front:
    made = lookup.lookup_front(made, target.config.vocab_size, spec.option("lookup_ngram", 3),
                               spec.option("lookup_min_ngram", 2))
  if isinstance(made, contracts.TokenDrafter):
    made = expansion.expand(made, tree, sample)
  if made.tree != tree:
    raise ValueError(f"the {spec.name} drafter proposes {made.tree.name}, not {tree.name}")
  return made, params


# ----------------------------------------------------------------------------------------------------
# The kinds shipped with specjax.

_NOTHING = lambda spec, target_config: Planned()  # nothing worth compiling apart
_TRAIN_DRAFT = ("train one first (python -m specjax.train --gin_file=configs/smollm2_draft.gin "
                "writes out/smollm2_draft/hf; scripts/main.sh runs it)")


def _on_device(table) -> Any:
  # On the device once: host (numpy) tables would be copied in on every call of a timed step.
  return jax.device_put(table)


register(Kind(
    "model", label="draft model", checkpoint=True, missing=_TRAIN_DRAFT,
    build=lambda spec, target, tree, sample: model.load_model_draft(
        spec.checkpoint, target.config, target.mesh, target.dtype,
        cpu_kernels.is_packed(target.params)),
    plan=lambda spec, target_config: Planned(checkpoint=spec.checkpoint)))
register(Kind(
    "layers", label="early exit",
    build=lambda spec, target, tree, sample: model.truncated_draft(
        target.config, target.params, spec.option("num_layers"), target.mesh, target.dtype),
    plan=lambda spec, target_config: Planned(config=dataclasses.replace(
        target_config, num_layers=spec.option("num_layers")))))
register(Kind(
    "unigram", label="unigram", needs_text=True, plan=_NOTHING,
    build=lambda spec, target, tree, sample: (tables.UnigramDrafter(), _on_device(
        tables.unigram_table(target.sequences, target.config.vocab_size)))))
register(Kind(
    "bigram", label="bigram", needs_text=True, plan=_NOTHING,
    build=lambda spec, target, tree, sample: (tables.SparseBigramDrafter(), _on_device(
        tables.sparse_bigram(target.sequences, target.config.vocab_size,
                             spec.option("bigram_top_k", 64),
                             spec.option("bigram_concentration", 1.0))))))
register(Kind(
    "lookup", label="prompt lookup", needs_text=True, plan=_NOTHING,
    build=lambda spec, target, tree, sample: (
        lookup.PromptLookupDrafter(target.config.vocab_size, spec.option("lookup_ngram", 3)),
        _on_device(tables.unigram_table(target.sequences, target.config.vocab_size)))))
register(Kind(
    "heads", label="Medusa heads", checkpoint=True, plan=_NOTHING, decoder_only=True, per_tree=True,
    missing="train them first (python -m specjax.train --gin_file=configs/smollm2_heads.gin writes "
            "out/smollm2_heads/heads)",
    build=lambda spec, target, tree, sample: heads.load_heads(
        spec.checkpoint, target.config, target.params, tree)))
register(Kind(
    "mtp", label="MTP head", checkpoint=True, plan=_NOTHING, decoder_only=True, per_tree=True,
    missing="train it first (python -m specjax.train --gin_file=configs/smollm2_mtp.gin writes "
            "out/smollm2_mtp/heads; scripts/main.sh runs it)",
    build=lambda spec, target, tree, sample: mtp.load_mtp(
        spec.checkpoint, target.config, target.params, tree)))

register(Kind(
    "dflash", label="DFlash", checkpoint=True, plan=_NOTHING, decoder_only=True, per_tree=True,
    missing="train it first (python -m specjax.train --gin_file=configs/smollm2_dflash.gin writes "
            "out/smollm2_dflash/dflash)",
    # Sampled from its own distribution where a chain asks for it; point masses (ranked candidates)
    # behind prompt lookup, which fronts ranked candidates only.
    build=lambda spec, target, tree, sample: dflash.load(
        spec.checkpoint, target.config, target.params, tree, sample and not spec.lookup_front),
    refuses=lambda spec, tree: dflash.tree_refusal(spec.checkpoint, tree)))
register(Kind(
    "eagle3", label="EAGLE-3", checkpoint=True, plan=_NOTHING, decoder_only=True, per_tree=True,
    missing="train it first (python -m specjax.train --gin_file=configs/smollm2_eagle3.gin writes "
            "out/smollm2_eagle3/eagle3)",
    build=lambda spec, target, tree, sample: eagle3.load(
        spec.checkpoint, target.config, target.params, tree),
    refuses=lambda spec, tree: eagle3.tree_refusal(tree, spec.lookup_front), grows_trees=True))
