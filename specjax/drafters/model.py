"""A model draft (contracts.Model) as a one-token step (contracts.TokenDrafter), with its own cache;
for an encoder-decoder draft, its own encoder too (the paper's T5-small draft encodes the source
itself, once per request). `expansion` makes it a sampled chain or a top-k tree.

A draft of either family comes from a checkpoint (`load_model_draft`) or from the target's first
layers (`truncated_draft`, an early exit that needs no weights of its own); on a device mesh its
parameters are sharded by the target's rules (Chen et al.: one mesh for both).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specjax import checkpoints, contracts, models, sharding
from specjax.contracts import Source, Transform
from specjax.decoding import autoregressive
from specjax.models import cpu_kernels, decoder_only


@flax.struct.dataclass
class ModelDraftState:
  context: Any  # the draft model's per-request context (its encoded source; None for decoder-only)
  cache: Any


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A model draft (contracts.Model) with its own cache; for an encoder-decoder draft, its own
  encoder too (the paper's T5-small draft encodes the source itself, once per request)."""
  model: contracts.Model

  @property
  def encoder_decoder(self) -> bool:
    return self.model.encoder_decoder

  def init(self, params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, max_length: int,
           source: Source | None = None) -> ModelDraftState:
    contracts.check_source(self.model, source)
    context = self.model.encode(params, source)
    session = contracts.Session(lambda *args: self.model.decode_step(params, context, *args),
                                self.model.init_cache)
    _, cache = autoregressive.prefill(session, prompt_tokens, prompt_lengths, max_length)
    return ModelDraftState(context, cache)

  def propose(self, params, state: ModelDraftState, tokens: jax.Array, positions: jax.Array,
              transform: Transform) -> tuple[jax.Array, ModelDraftState]:
    logits, cache = self.model.decode_step(params, state.context, tokens, positions, state.cache)
    return transform(logits[:, -1]), state.replace(cache=cache)

  def rollback(self, state: ModelDraftState, lengths: jax.Array) -> ModelDraftState:
    return state.replace(cache=contracts.set_lengths(state.cache, lengths))



def load_model_draft(path: str, target_config, mesh: Mesh | None = None, dtype=jnp.float32,
                     packed: bool = False) -> tuple[ModelDrafter, Any]:
  """The draft checkpoint at `path` (.gguf, a Hugging Face directory, a T5X checkpoint) for a target
  of `target_config`'s vocabulary -> (ModelDrafter, params on the device(s) in `dtype`, packed for
  the CPU kernels with `packed`)."""
  draft_config, draft_params = checkpoints.load(path)
  if draft_config.vocab_size != target_config.vocab_size:
    raise ValueError(f"vocabulary sizes differ: the target has {target_config.vocab_size} tokens, "
                     f"the draft {path} {draft_config.vocab_size}; speculative decoding needs one "
                     "vocabulary")
  return placed(draft_config, draft_params, mesh, dtype, packed)


def truncated_draft(target_config, target_params, num_layers: int, mesh: Mesh | None = None,
                    dtype=jnp.float32) -> tuple[ModelDrafter, Any]:
  """A decoder-only target's first `num_layers` blocks + final norm + head as a draft."""
  if not isinstance(target_config, decoder_only.DecoderConfig) or target_params is None:
    raise ValueError(f"layers{num_layers} truncates a decoder-only target's layers; it needs that "
                     "target's DecoderConfig and params")
  return placed(*decoder_only.truncate_layers(target_config, target_params, num_layers), mesh,
                dtype)


def placed(config, params, mesh: Mesh | None, dtype=jnp.float32, packed: bool = False
           ) -> tuple[ModelDrafter, Any]:
  """A model draft decoding in `dtype` with its params on the device(s): sharded on `mesh` when
  given; with `packed` (a target whose products run on the CPU kernels) its kernels packed the same way."""
  params = models.cast(params, dtype)
  if cpu_kernels.is_packed(params):  # a truncated packed target
    packed = True
  elif packed:
    params = cpu_kernels.pack_params_for(config, params)
  if mesh is None:
    cache_dtype = cpu_kernels.CACHE_DTYPE if packed else dtype
    return ModelDrafter(models.model_for(config, None, cache_dtype)), jax.device_put(params)
  return (ModelDrafter(models.model_for(config, mesh, dtype)),
          sharding.place(params, models.param_shardings(config, mesh)))
