"""Tree drafters (trees.TreeDrafter): what fills a token tree's nodes with ranked candidates.

  ChainTopK        any chain drafter (drafters.py) as a tree: its top-1 chain, its top-k per depth;
  LookupThenTree   prompt lookup's copied continuation at rank 0 of each depth, another tree
                   drafter's candidates behind it;
  heads.HeadsDrafter  Medusa heads on the target's hidden state (heads.py);
  mtp.MTPDrafter      the shared MTP head applied recursively on it (mtp.py).
`make_tree_drafter(name)` builds any of them by name. Which tokens fill a tree never affects
losslessness (trees.py), so any ranking will do.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from specjax import drafters, heads, mtp
from specjax.decoding.sampling import top_ids


def _ranking(logits: jax.Array) -> jax.Array:
  """Candidates are ranked by the drafter's own softmax: which tokens go in the tree never affects
  losslessness, and a temperature-0 one-hot would leave no order below its top token."""
  return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True)
class ChainTopK:
  """A chain drafter (drafters.py) as a tree drafter: it drafts its top-1 chain of `depth` tokens and
  offers its top-`width` tokens at each depth.

  Each iteration re-feeds the last depth + 1 committed tokens at their positions, so the drafter's
  cache holds the committed text whichever tree branch was accepted (re-feeding a cached token
  rewrites the same slot; positions before 0 are clipped to 0 and repeat the first token)."""
  drafter: Any

  @property
  def encoder_decoder(self):
    return getattr(self.drafter, "encoder_decoder", None)

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None):
    return self.drafter.init(params, prompt_tokens, prompt_lengths, max_length, source)

  def candidates(self, params, state, history, position, features, depth: int, width: int):
    del features
    window = jnp.maximum(position[:, None] - depth + jnp.arange(depth + 1, dtype=jnp.int32), 0)
    tokens = jnp.take_along_axis(history, window, axis=1)
    probs, state = self.drafter.propose(params, state, tokens, window, _ranking)
    ranked = []
    for d in range(depth):
      top = top_ids(probs, width)
      ranked.append(top)
      if d + 1 < depth:
        probs, state = self.drafter.propose(params, state, top[:, :1], (position + 1 + d)[:, None],
                                            _ranking)
    return jnp.stack(ranked, axis=1), state

  def calls_per_iteration(self, depth: int) -> int:
    return depth


@dataclasses.dataclass(frozen=True)
class LookupThenTree:
  """Prompt lookup in front of any tree drafter. Where the context's last n-gram (n = max_ngram down
  to min_ngram) occurred before, the tokens that followed it are copied, one per depth (each found by
  looking up again after the copied token), and take rank 0 at their depth; the inner drafter's
  candidates fill the other ranks. Elsewhere the inner drafter's candidates stand alone. Which tokens
  fill the tree never affects losslessness."""
  inner: Any
  max_ngram: int = 3
  min_ngram: int = 2

  @property
  def encoder_decoder(self):
    return getattr(self.inner, "encoder_decoder", None)

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None):
    return self.inner.init(params, prompt_tokens, prompt_lengths, max_length, source)

  def candidates(self, params, state, history, position, features, depth: int, width: int):
    inner, state = self.inner.candidates(params, state, history, position, features, depth, width)
    rows = jnp.arange(history.shape[0])
    found_so_far = jnp.ones(position.shape, bool)
    merged = []
    for d in range(depth):
      copied, found = drafters.lookup(history, position + d, self.max_ngram, self.min_ngram)
      found_so_far &= found
      with_copy = jnp.concatenate([copied[:, None], inner[:, d, :width - 1]], axis=1)
      merged.append(jnp.where(found_so_far[:, None], with_copy, inner[:, d]))
      history = history.at[rows, position + d + 1].set(copied)
    return jnp.stack(merged, axis=1).astype(jnp.int32), state

  def calls_per_iteration(self, depth: int) -> int:
    return self.inner.calls_per_iteration(depth)


HEADS_PREFIX = "heads:"
MTP_PREFIX = "mtp:"
FEATURE_PREFIXES = (HEADS_PREFIX, MTP_PREFIX)


def make_tree_drafter(name: str, target_config, target_params, sequences=None):
  """A tree drafter by name -> (drafter, params): `heads:<dir>` (Medusa heads trained for this target,
  heads.py), `mtp:<dir>` (an MTP head, mtp.py), `lookup+heads:<dir>` / `lookup+mtp:<dir>` (prompt
  lookup in front of them), or any drafters.make_drafter name as a tree by its top-k (ChainTopK),
  e.g. `model:out/smollm2_draft/hf`, `lookup`."""
  if name.startswith("lookup+") and name[len("lookup+"):].startswith(FEATURE_PREFIXES):
    inner, params = make_tree_drafter(name[len("lookup+"):], target_config, target_params)
    return LookupThenTree(inner), params
  if name.startswith(HEADS_PREFIX):
    return heads.load_heads(name[len(HEADS_PREFIX):], target_config, target_params)
  if name.startswith(MTP_PREFIX):
    return mtp.load_mtp(name[len(MTP_PREFIX):], target_config, target_params)
  drafter, params = drafters.make_drafter(name, target_config, target_params, sequences)
  return ChainTopK(drafter), params


def feature_directory(name: str) -> str | None:
  """The directory of a `heads:` / `mtp:` drafter name (behind `lookup+` or not), else None."""
  inner = name.removeprefix("lookup+")
  prefix = next((p for p in FEATURE_PREFIXES if inner.startswith(p)), None)
  return inner[len(prefix):] if prefix else None


def tree_drafter_needs_text(name: str) -> bool:
  return not any(prefix in name for prefix in FEATURE_PREFIXES) and drafters.needs_text(name)


def check_tree_drafter_name(name: str) -> None:
  """Refuse an unknown name or a missing checkpoint before anything runs (as drafters.draft_checkpoint)."""
  directory = feature_directory(name)
  if directory is not None:
    if not directory or not (pathlib.Path(directory) / "heads.json").exists():
      is_mtp = name.removeprefix("lookup+").startswith(MTP_PREFIX)
      config = "smollm2_mtp" if is_mtp else "smollm2_heads"
      raise FileNotFoundError(f"no trained heads at {directory!r}; train them first (python -m "
                              f"specjax.training.heads --gin_file=configs/{config}.gin writes "
                              f"out/{config}/heads; scripts/main.sh runs it)")
    return
  drafters.draft_checkpoint(name)
