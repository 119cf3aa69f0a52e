"""Medusa-1 heads: draft tokens from the target's own final hidden state, no draft model to run.

Head k (k = 1..K) reads the target's final-norm hidden state h_t and scores the token at t + k + 1
(the target itself scores t + 1):

    h'_k = h_t + SiLU(h_t @ W_k + b_k)        logits_k = h'_k @ U.T

U is the target's own output projection (its tied embedding for SmolLM2), frozen and never copied
into the heads: only W_k, b_k are trained, so a head costs E * (E + 1) parameters. W_k and b_k start
at zero, which makes an untrained head exactly the target's next-token head (h' = h): training starts
from "the token after next looks like the next one" and can only improve on it.

A subset head scores only `head_tokens` (U's rows at those ids; every other token is never proposed):
SmolLM2's 49,152 x 576 projection per head would cost about a fifth of a target step on CPU, while the
few thousand tokens with the most target probability carry nearly all of it (training/heads.py picks
them; 4,096 by default cover 89 % of SmolLM2's held-out labels).

Heads are tied to the weights of the target they were trained on (they read its hidden states), so a
saved set carries the target's fingerprint (`target_fingerprint`) and `load_heads` refuses any other
target. `HeadsDrafter` is a drafter of ranked candidates per depth: at depth d, head d + 1's top
`width` tokens, all from one call on the hidden state the target's verification already computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax import contracts
from specjax.decoding import tree as trees
from specjax.drafters import expansion
from specjax.models import cpu_kernels

FORMAT = 1
WEIGHTS_FILE = "heads.npz"
METADATA_FILE = "heads.json"
TRAIN_COMMAND = "python -m specjax.train --gin_file=configs/smollm2_heads.gin"
# What heads read: the target's final-norm hidden state (the state its own LM head reads).
FEATURES = contracts.FeatureSpec(final_norm=True)


# ---- the heads as pure functions --------------------------------------------------------------------

def head_name(k: int) -> str:
  return f"head_{k}"


def init_heads(num_heads: int, embed_dim: int) -> dict:
  """{'head_k': {'kernel': [E, E], 'bias': [E]}} at zero: each head starts as the target's own.

  One entry per head (not one stacked [K, E, E] array) so that training.make_optimizer decays the
  kernels (its mask decays 2-D leaves) toward zero, i.e. toward the target's own head."""
  if num_heads < 1:
    raise ValueError(f"num_heads must be >= 1, got {num_heads}")
  return {head_name(k): {"kernel": np.zeros((embed_dim, embed_dim), np.float32),
                         "bias": np.zeros((embed_dim,), np.float32)}
          for k in range(1, num_heads + 1)}


def num_heads_of(heads: dict) -> int:
  count = len(heads)
  if sorted(heads) != sorted(head_name(k) for k in range(1, count + 1)):
    raise ValueError(f"heads must be named head_1..head_{count}, got {sorted(heads)}")
  return count


def head_states(heads: dict, hidden: jax.Array, count: int | None = None) -> jax.Array:
  """hidden[..., E] -> h'[..., count, E] of heads 1..count (default all): h + SiLU(h @ W_k + b_k)."""
  count = num_heads_of(heads) if count is None else count
  hidden = hidden.astype(jnp.float32)
  kernels = jnp.stack([heads[head_name(k)]["kernel"] for k in range(1, count + 1)])
  biases = jnp.stack([heads[head_name(k)]["bias"] for k in range(1, count + 1)])
  update = jnp.einsum("...e,kef->...kf", hidden, kernels) + biases
  return hidden[..., None, :] + jax.nn.silu(update)


def head_logits(heads: dict, head_rows: jax.Array, hidden: jax.Array,
                count: int | None = None) -> jax.Array:
  """hidden[..., E] -> logits[..., count, S] float32 over the S rows of the frozen output projection
  `head_rows[S, E]` (column j scores head_tokens[j])."""
  return scored(head_states(heads, hidden, count), head_rows)


def scored(states: jax.Array, rows) -> jax.Array:
  """states[..., E] against output rows[S, E] -> logits[..., S] float32. Rows drafter_params packed
  for the CPU kernels run there: XLA:CPU's one-row bfloat16 product took longer than a target step."""
  if isinstance(rows, cpu_kernels.PackedKernel):
    return cpu_kernels.matmul(states, rows)
  return jnp.einsum("...e,se->...s", states.astype(rows.dtype), rows,
                    preferred_element_type=jnp.float32)


def output_rows(target_config, target_params) -> jax.Array:
  """[V, E]: the target's output projection as rows, logits = hidden @ rows.T (its tied embedding,
  or its untied lm_head transposed)."""
  if getattr(target_config, "head_size", 0):
    raise ValueError("heads read a full-vocabulary target's output projection; this model has a "
                     "subset head (a draft), which is not a target")
  if target_config.tie_embeddings:
    return cpu_kernels.embedding_table(jnp.asarray(target_params["embedding"]))
  head = target_params["lm_head"]
  return (cpu_kernels.unpack(head) if isinstance(head, cpu_kernels.PackedKernel)
          else jnp.asarray(head)).T


def head_rows(target_config, target_params, head_tokens=None) -> tuple[jax.Array, jax.Array]:
  """(rows[S, E], token ids[S] int32): the output rows the heads score, the target's rows at
  head_tokens or all of them when head_tokens is None."""
  rows = output_rows(target_config, target_params)
  if head_tokens is None:
    return rows, jnp.arange(target_config.vocab_size, dtype=jnp.int32)
  tokens = jnp.asarray(head_tokens, jnp.int32)
  return rows[tokens], tokens


def drafting_rows(target_config, target_params, head_tokens=None) -> tuple:
  """head_rows for drafting: packed for the CPU kernels ([E, S], `scored` runs them there) where the
  target's own kernels are packed."""
  rows, tokens = head_rows(target_config, target_params, head_tokens)
  if cpu_kernels.is_packed(target_params):
    rows = cpu_kernels.pack(rows.T, rows.dtype)
  return rows, tokens


def drafter_params(heads: dict, head_tokens, target_config, target_params) -> dict:
  """The params HeadsDrafter.candidates takes: the heads, the output rows they score and the token
  id of each row."""
  rows, tokens = drafting_rows(target_config, target_params, head_tokens)
  return {"heads": jax.tree_util.tree_map(jnp.asarray, heads), "head_rows": rows,
          "head_tokens": tokens}


@dataclasses.dataclass(frozen=True)
class HeadsDrafter(expansion.Ranked):
  """The drafter of K trained heads for `tree`: candidates[b, d] = the top `width` tokens of head
  d + 1 applied to the target's final-norm hidden state at position - 1. No state, no model of its
  own to run: the hidden state comes from the target's own verification."""
  num_heads: int
  tree: trees.Tree
  features = FEATURES
  calls_per_iteration = 1  # every head runs in the same call, on a state the target computed
  # A drafter of decoder-only targets: contracts.check_drafter_family refuses an encoder-decoder one.
  encoder_decoder: bool = dataclasses.field(default=False, init=False)

  def __post_init__(self):
    if self.tree.depth > self.num_heads:
      raise ValueError(f"a tree of depth {self.tree.depth} needs {self.tree.depth} heads (head d "
                       f"scores the token d places past the next), but these heads number "
                       f"{self.num_heads}: use depth <= {self.num_heads}, or train more heads "
                       "(heads.HeadsSpec.num_heads)")

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    del params, prompt_tokens, prompt_lengths, max_length, features
    if source is not None:
      raise ValueError("Medusa heads read a decoder-only target's hidden states and take no source")
    return None

  def candidates(self, params, state, context, depth: int, width: int):
    """-> (candidates[B, depth, width] int32, state); rank 0 = the head's most likely token."""
    size = params["head_tokens"].shape[0]
    if not 1 <= width <= size:
      raise ValueError(f"width must lie in 1..{size} (the tokens the heads score), got {width}")
    logits = head_logits(params["heads"], params["head_rows"], context.newest_features, depth)
    _, columns = jax.lax.top_k(logits, width)
    return params["head_tokens"][columns].astype(jnp.int32), state


# ---- which target the heads belong to ---------------------------------------------------------------

def target_fingerprint(target_config, target_params, samples_per_leaf: int = 1024,
                       rounded: bool = True) -> str:
  """A digest of the target's architecture and weights: per parameter (in path order) its shape,
  exact sum and `samples_per_leaf` evenly spaced values, of the weights rounded to bfloat16, so one
  checkpoint gives one fingerprint whether it decodes in float32 or bfloat16 (specs.ModelSpec.dtype).
  Any retrained, fine-tuned or other checkpoint changes it; the same weights give it whatever path
  they were loaded from. Costs one read of the weights (a fraction of a second for SmolLM2).
  rounded=False: the float32 digest of heads trained before (their dtype and unrounded values)."""
  digest = hashlib.sha256(json.dumps(dataclasses.asdict(target_config), sort_keys=True).encode())
  leaves = jax.tree_util.tree_flatten_with_path(cpu_kernels.plain(target_params))[0]
  for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(item[0])):
    values = np.asarray(leaf)
    if rounded and jnp.issubdtype(values.dtype, jnp.floating):
      values = values.astype(jnp.bfloat16).astype(np.float32)
    flat = values.reshape(-1)
    picks = np.unique(np.linspace(0, max(flat.size - 1, 0), min(flat.size, samples_per_leaf)
                                  ).astype(np.int64))
    described = [jax.tree_util.keystr(path), list(values.shape)] + ([] if rounded else [str(values.dtype)])
    digest.update(json.dumps(described + [repr(float(np.sum(flat, dtype=np.float64)))]).encode())
    digest.update(np.ascontiguousarray(flat[picks].astype(np.float32)).tobytes())
  return digest.hexdigest()[:16]


# ---- saved heads ------------------------------------------------------------------------------------

def save_heads(directory, heads: dict, head_tokens, target_config, fingerprint: str,
               metadata: dict | None = None) -> pathlib.Path:
  """directory/heads.npz (kernel [K, E, E], bias [K, E], head_tokens [S]) + heads.json (num_heads,
  embed_dim, vocab_size, head_size, target_fingerprint, and `metadata`)."""
  count = num_heads_of(heads)
  heads = jax.device_get(heads)
  arrays = {"kernel": np.stack([heads[head_name(k)]["kernel"] for k in range(1, count + 1)]),
            "bias": np.stack([heads[head_name(k)]["bias"] for k in range(1, count + 1)])}
  return write_saved(directory, WEIGHTS_FILE, arrays, head_tokens, target_config, fingerprint,
                     {"num_heads": count, **(metadata or {})})


def write_saved(directory, weights_file: str, arrays: dict, head_tokens, target_config,
                fingerprint: str, metadata: dict) -> pathlib.Path:
  """Write float32 `arrays` (+ head_tokens int32) to directory/weights_file, then heads.json (format,
  embed_dim from arrays["kernel"] or metadata, vocab_size, head_size, target_fingerprint, `metadata`). Each
  file is written aside and renamed; heads.json comes last, so a directory with it is complete."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  arrays = {name: np.asarray(value, np.float32) for name, value in arrays.items()}
  if head_tokens is not None:
    arrays["head_tokens"] = np.asarray(head_tokens, np.int32)
  # The width: the heads' kernel's, or metadata's "embed_dim" for a drafter without one.
  meta = {"format": FORMAT, "embed_dim": int(metadata.get("embed_dim") or arrays["kernel"].shape[-1]),
          "vocab_size": int(target_config.vocab_size),
          "head_size": 0 if head_tokens is None else int(len(arrays["head_tokens"])),
          "target_fingerprint": fingerprint, **metadata}
  tmp = directory / (weights_file + ".tmp.npz")
  np.savez(tmp, **arrays)
  tmp.replace(directory / weights_file)
  tmp = directory / (METADATA_FILE + ".tmp")
  tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
  tmp.replace(directory / METADATA_FILE)
  return directory


def read_metadata(directory) -> dict:
  """heads.json of a saved directory (Medusa heads or an MTP head: its "kind")."""
  directory = pathlib.Path(directory)
  if not (directory / METADATA_FILE).is_file():
    raise FileNotFoundError(f"no trained heads in {directory} ({METADATA_FILE} missing); train them "
                            f"with `{TRAIN_COMMAND}` (they land in <output_dir>/heads)")
  meta = json.loads((directory / METADATA_FILE).read_text())
  if meta.get("format") != FORMAT:
    raise ValueError(f"{directory} holds heads of format {meta.get('format')}; this version reads "
                     f"format {FORMAT}: retrain them with `{TRAIN_COMMAND}`")
  return meta


def read_heads(directory) -> tuple[dict, np.ndarray | None, dict]:
  """(heads, head_tokens or None, metadata) of a saved directory, without checking the target."""
  directory = pathlib.Path(directory)
  meta = read_metadata(directory)
  if meta.get("kind", "medusa") != "medusa":
    kind = meta["kind"]
    raise ValueError(f"{directory} holds {'an MTP head' if kind == 'mtp' else f'a {kind} drafter'}, "
                     f"not Medusa heads: name it {kind}:{directory}")
  with np.load(directory / WEIGHTS_FILE) as arrays:
    kernel, bias = arrays["kernel"], arrays["bias"]
    head_tokens = arrays["head_tokens"] if "head_tokens" in arrays else None
  heads = {head_name(k): {"kernel": kernel[k - 1], "bias": bias[k - 1]}
           for k in range(1, kernel.shape[0] + 1)}
  return heads, head_tokens, meta


def check_target(meta: dict, target_config, target_params, where="these heads",
                 command: str = TRAIN_COMMAND) -> None:
  """Refuse a target the heads were not trained for, naming the fix."""
  if hasattr(target_config, "num_encoder_layers"):  # a T5Config
    raise ValueError(f"{where} read a decoder-only target's hidden states, and heads are trained for "
                     "decoder-only targets only (python -m specjax.train); for a T5 target "
                     "build the tree from a chain drafter's top-k instead, e.g. "
                     "model:out/t5_gettext/draft_large/hf (configs/t5_gettext/trees.gin)")
  if (meta["vocab_size"], meta["embed_dim"]) != (target_config.vocab_size, target_config.embed_dim):
    raise ValueError(f"{where} were trained for a target with vocabulary {meta['vocab_size']} and "
                     f"width {meta['embed_dim']}; this target has {target_config.vocab_size} and "
                     f"{target_config.embed_dim}. Heads read their own target's hidden states: train "
                     f"heads for this target with `{command}` and "
                     "specs.ModelSpec.checkpoint bound to its checkpoint")
  found = target_fingerprint(target_config, target_params)
  if found != meta["target_fingerprint"] and (
      target_fingerprint(target_config, target_params, rounded=False) != meta["target_fingerprint"]):
    named = meta.get("target", {}).get("checkpoint")
    trained_for = f" ({named})" if named else ""
    raise ValueError(f"{where} were trained for another target{trained_for}: its fingerprint is "
                     f"{meta['target_fingerprint']}, this target's is {found}. Heads read the hidden "
                     "states of the exact weights they were trained on, so they would propose noise "
                     f"here: train heads for this target with `{command}` and "
                     "specs.ModelSpec.checkpoint bound to its checkpoint, or load this target's own")


def read_drafter(directory, kind: str, label: str, weights_file: str, target_config, target_params,
                 command: str) -> tuple[dict, dict, np.ndarray | None]:
  """(heads.json, the weights by name, head_tokens or None) of a saved drafter of `kind` (label:
  how errors name it), after checking the directory holds that kind, trained for this target."""
  directory = pathlib.Path(directory)
  meta = read_metadata(directory)
  if meta.get("kind") != kind:
    raise ValueError(f"{directory} holds {meta.get('kind', 'Medusa')} heads, not {label}: name it "
                     f"{meta.get('kind', 'heads')}:{directory}")
  check_target(meta, target_config, target_params, where=f"the {label} in {directory}",
               command=command)
  with np.load(directory / weights_file) as arrays:
    weights = {name: arrays[name] for name in arrays.files if name != "head_tokens"}
    head_tokens = arrays["head_tokens"] if "head_tokens" in arrays.files else None
  return meta, weights, head_tokens


def load_heads(directory, target_config, target_params, tree: trees.Tree
               ) -> tuple[HeadsDrafter, dict]:
  """(HeadsDrafter of `tree`, its params) for `target`, after checking the heads were trained for
  it."""
  heads, head_tokens, meta = read_heads(directory)
  check_target(meta, target_config, target_params, where=f"the heads in {directory}")
  return (HeadsDrafter(meta["num_heads"], tree),
          drafter_params(heads, head_tokens, target_config, target_params))
