"""A shared multi-token-prediction (MTP) head, applied recursively on the target's own features.

Medusa heads (heads.py) give every depth its own head on one hidden state, so head d must guess d
tokens ahead without seeing the tokens in between. The MTP head instead predicts the NEXT hidden
state from a hidden state and the token that follows it, and is applied again on its own output:

    z     = h + [h, e(x)] @ W_in + b_in            (h: hidden state at t, x: the token at t + 1)
    h'    = z + SiLU(z @ W_h + b_h)                (h': predicted hidden state at t + 1)
    logits(h') = h' @ U.T                          (U: the target's frozen output rows)

e is the target's frozen input embedding and U its output projection (the tied embedding for
SmolLM2), restricted to a token subset as for the heads. One set of weights serves every depth:
drafting a tree of depth D starts from the target's hidden state at position - 1 and the root token,
and feeds each depth's top-1 candidate back in (the same chain EAGLE drafts from features). With
W_in, W_h and the biases at zero, h' = h: an untrained head repeats the target's next-token guess.

Training (training/heads.py, HeadsSpec.kind = "mtp") unrolls the head over `num_heads` steps of each
teacher sequence with the true tokens as inputs and its OWN predicted hidden states carried forward
(as at draft time), scoring each step's logits against the sequence's next token (cross-entropy)
and its hidden state against the target's (`feature_weight` x mean squared error).

Saved like the heads (heads.json with kind "mtp" and the target's fingerprint; `load_mtp` refuses
another target).
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding import tree as trees
from specjax.decoding.sampling import top_ids
from specjax.drafters import expansion, heads
from specjax.models import cpu_kernels, layers

KIND = "mtp"
WEIGHTS_FILE = "mtp.npz"
TRAIN_COMMAND = "python -m specjax.train --gin_file=configs/smollm2_mtp.gin"
NAMES = ("in_kernel", "in_bias", "kernel", "bias")


def init_mtp(embed_dim: int) -> dict:
  """Zero weights: the head starts as the identity on the hidden state (module docstring).
  W_in and W_h are 2-D leaves, so training.make_optimizer decays them toward that identity."""
  return {"in_kernel": np.zeros((2 * embed_dim, embed_dim), np.float32),
          "in_bias": np.zeros((embed_dim,), np.float32),
          "kernel": np.zeros((embed_dim, embed_dim), np.float32),
          "bias": np.zeros((embed_dim,), np.float32)}


def input_rows(target_config, target_params) -> jax.Array:
  """[V, E]: the target's input embedding (what the head embeds the token with, by layers.embed)."""
  del target_config
  return jnp.asarray(target_params["embedding"])


def next_state(params: dict, hidden: jax.Array, embedded: jax.Array) -> jax.Array:
  """hidden[..., E] (state at t), embedded[..., E] (the token at t + 1) -> the state at t + 1."""
  hidden = hidden.astype(jnp.float32)
  joined = jnp.concatenate([hidden, embedded.astype(jnp.float32)], axis=-1)
  # layers.dense runs kernels drafter_params packed on the CPU kernels (XLA:CPU's one-row products
  # cost what they compute: these two were half of a lookup + MTP draft).
  z = hidden + layers.dense(joined, params["in_kernel"], float32_out=True) + params["in_bias"]
  return z + jax.nn.silu(layers.dense(z, params["kernel"], float32_out=True) + params["bias"])


def unroll(params: dict, embed_rows: jax.Array, head_rows: jax.Array, hidden: jax.Array,
           tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Teacher-forced unroll: hidden[B, E] at t, tokens[B, K] (the tokens at t + 1 .. t + K) ->
  (states[B, K, E] predicted at t + 1 .. t + K, logits[B, K, S] over head_rows for t + 2 .. t + K + 1).
  Each step reads the previous step's predicted state, as drafting does."""
  states = []
  state = hidden
  for k in range(tokens.shape[1]):
    state = next_state(params, state, layers.embed(embed_rows, tokens[:, k]))
    states.append(state)
  states = jnp.stack(states, axis=1)
  return states, heads.scored(states, head_rows)


def drafter_params(mtp: dict, head_tokens, target_config, target_params) -> dict:
  """The head's weights, output rows and token ids for drafting; its two kernels packed for the CPU
  kernels where the target's are, in the target's kernel dtype."""
  rows, tokens = heads.drafting_rows(target_config, target_params, head_tokens)
  mtp = jax.tree_util.tree_map(jnp.asarray, mtp)
  if dtype := cpu_kernels.kernel_dtype(target_params):
    mtp = {**mtp, **{name: cpu_kernels.pack(mtp[name], dtype)
                     for name in ("in_kernel", "kernel")}}
  return {"mtp": mtp, "head_rows": rows,
          "head_tokens": tokens, "embed_rows": input_rows(target_config, target_params)}


@dataclasses.dataclass(frozen=True)
class MTPDrafter(expansion.Ranked):
  """The drafter of the MTP head for `tree`: at depth d its top `width` tokens after d applications,
  the chain continuing through each depth's top-1 token. Stateless; `depth` small head applications
  per iteration, on the hidden state the target's verification computed."""
  tree: trees.Tree
  features = heads.FEATURES
  # A drafter of decoder-only targets: contracts.check_drafter_family refuses an encoder-decoder one.
  encoder_decoder: bool = dataclasses.field(default=False, init=False)

  @property
  def calls_per_iteration(self) -> int:
    return self.tree.depth

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    del params, prompt_tokens, prompt_lengths, max_length, features
    if source is not None:
      raise ValueError("the MTP head reads a decoder-only target's hidden states and takes no source")
    return None

  def candidates(self, params, state, context, depth: int, width: int):
    size = params["head_tokens"].shape[0]
    if not 1 <= width <= size:
      raise ValueError(f"width must lie in 1..{size} (the tokens the head scores), got {width}")
    token = context.root
    hidden, ranked = context.newest_features, []
    for _ in range(depth):
      hidden = next_state(params["mtp"], hidden, layers.embed(params["embed_rows"], token))
      logits = heads.scored(hidden, params["head_rows"])
      top = params["head_tokens"][top_ids(logits, width)].astype(jnp.int32)
      ranked.append(top)
      token = top[:, 0]
    return jnp.stack(ranked, axis=1), state


def save_mtp(directory, params: dict, head_tokens, target_config, fingerprint: str,
             num_steps: int, metadata: dict | None = None) -> pathlib.Path:
  """directory/mtp.npz + heads.json (kind "mtp", the steps it was trained over, the target's
  fingerprint, `metadata`), as heads.write_saved writes them."""
  arrays = {name: jax.device_get(params[name]) for name in NAMES}
  return heads.write_saved(directory, WEIGHTS_FILE, arrays, head_tokens, target_config, fingerprint,
                           {"kind": KIND, "num_heads": int(num_steps), **(metadata or {})})


def load_mtp(directory, target_config, target_params, tree: trees.Tree) -> tuple[MTPDrafter, dict]:
  """(MTPDrafter of `tree`, its params) for `target`, after checking the head was trained for it."""
  directory = pathlib.Path(directory)
  meta = heads.read_metadata(directory)
  if meta.get("kind") != KIND:
    raise ValueError(f"{directory} holds Medusa heads, not an MTP head: name it heads:{directory}")
  heads.check_target(meta, target_config, target_params, where=f"the MTP head in {directory}",
                     command=TRAIN_COMMAND)
  with np.load(directory / WEIGHTS_FILE) as arrays:
    params = {name: arrays[name] for name in NAMES}
    head_tokens = arrays["head_tokens"] if "head_tokens" in arrays else None
  return MTPDrafter(tree), drafter_params(params, head_tokens, target_config, target_params)
