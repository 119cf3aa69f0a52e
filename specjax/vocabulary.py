"""SentencePiece vocabularies (T5's), behaving as seqio's `SentencePieceVocabulary` does for T5.

specjax has two tokenizer wrappers: tokenizer.py (byte-level BPE, the Llama family) and this one; both
offer encode / decode / eos_id / pad_id / vocab_size to the rest of the library.

T5 ids: pad 0, EOS 1, unk 2, no BOS. The public vocabulary (`cc_all.32000.100extra`) is 32,000
SentencePiece pieces plus 100 extra ids (span-corruption sentinels) = 32,100, inside the model's
32,128 logits. As in seqio, the extra ids are appended to the model as user-defined pieces
"▁<extra_id_k>" in reverse order, so `<extra_id_k>` is id `vocab_size - 1 - k` and the text
"<extra_id_0>" at a word start encodes to that single id.

Differences from seqio, on purpose: `encode` appends EOS (seqio leaves that to its `append_eos`
preprocessor; pass add_eos=False for seqio's ids), and `decode` drops pad and EOS before
detokenizing (seqio keeps EOS, which SentencePiece's decoder drops anyway: the text is the same).

Two backends give the same ids for plain text: a SentencePiece model file (`spiece.model`,
`sentencepiece.model`) through the `sentencepiece` library, or, when only a Hugging Face
`tokenizer.json` (a Unigram model, as T5TokenizerFast saves it) exists, the `tokenizers` library.
transformers writes the sentinels there as added tokens "<extra_id_k>" without the "▁" prefix.
A sentinel standing as a word between spaces gets the same ids from both; elsewhere they differ:
inside a word the model file spells "<extra_id_0>" out in pieces (seqio's documented limitation)
while tokenizer.json isolates it, text glued after a sentinel ("<extra_id_0>.") gets a "▁" prefix
from tokenizer.json only, and tokenizer.json decodes a sentinel without the space before it. unk
decodes as " ⁇ " through sentencepiece and as "<unk>" through tokenizers.
"""

from __future__ import annotations

import io
import json
import pathlib
import re
from typing import Iterable, Sequence

import sentencepiece as spm
import tokenizers
from sentencepiece import sentencepiece_model_pb2

from specjax.checkpoints import t5x

MODEL_FILES = ("spiece.model", "sentencepiece.model")
HF_TOKENIZER_FILE = "tokenizer.json"
_EXTRA_ID = re.compile(r"<extra_id_(\d+)>")


class SentencePieceVocabulary:
  """encode / decode with T5's conventions over a SentencePiece model (or its tokenizer.json).

  pad_id / eos_id / unk_id: the model's (T5: 0 / 1 / 2). vocab_size: pieces + extra_ids.
  """

  def __init__(self, backend, extra_ids: int, source: str):
    self._backend = backend
    self.extra_ids = extra_ids
    self.source = source
    self.pad_id, self.eos_id, self.unk_id = backend.special_ids(source)

  @classmethod
  def from_file(cls, path, extra_ids: int = 0) -> "SentencePieceVocabulary":
    """A SentencePiece model file (local, or a URL such as gs://t5-data/vocabs/cc_all.32000.100extra/
    sentencepiece.model), plus `extra_ids` sentinels at the top of the vocabulary."""
    text = str(path)
    if "://" not in text and not pathlib.Path(text).is_file():
      raise FileNotFoundError(f"no SentencePiece model at {path}")
    return cls(_SentencePieceBackend(t5x.read_file(text), extra_ids, text), extra_ids, text)

  @classmethod
  def from_directory(cls, directory, extra_ids: int | None = None) -> "SentencePieceVocabulary":
    """spiece.model or sentencepiece.model in `directory`, else a Unigram tokenizer.json.

    extra_ids: None reads it from tokenizer_config.json ("extra_ids", as transformers writes it for
    T5) when there is one, else 0, for a model file; a tokenizer.json carries its own sentinels
    (a different explicit count is an error).
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
      raise FileNotFoundError(f"no vocabulary directory at {directory}")
    for name in MODEL_FILES:
      if (directory / name).is_file():
        if extra_ids is None:
          extra_ids = _configured_extra_ids(directory)
        return cls.from_file(directory / name, extra_ids)
    if (directory / HF_TOKENIZER_FILE).is_file():
      backend = _TokenizersBackend(directory / HF_TOKENIZER_FILE)
      if extra_ids is not None and extra_ids != backend.extra_ids:
        raise ValueError(f"{directory / HF_TOKENIZER_FILE} has {backend.extra_ids} extra ids "
                         f"(<extra_id_k> tokens), not the {extra_ids} asked for")
      return cls(backend, backend.extra_ids, str(directory / HF_TOKENIZER_FILE))
    raise FileNotFoundError(f"no SentencePiece vocabulary in {directory}: looked for "
                            f"{', '.join(MODEL_FILES)} and {HF_TOKENIZER_FILE}")

  @property
  def vocab_size(self) -> int:
    """Pieces + extra ids (T5: 32,100), the ids `encode` can produce."""
    return self._backend.size

  def encode(self, text: str, add_eos: bool = True) -> list[int]:
    """Token ids of `text`, then EOS (no BOS)."""
    ids = self._backend.encode(text)
    return ids + [self.eos_id] if add_eos else ids

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
    """Text of `ids` up to the first EOS, pad skipped (always: `skip_special` is accepted for the
    tokenizer.Tokenizer interface). As in seqio, ids outside the vocabulary (e.g. the unused logits
    32,100..32,127 of T5) decode as unk."""
    del skip_special
    clean = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i == self.pad_id:
        continue
      clean.append(i if 0 <= i < self.vocab_size else self.unk_id)
    return self._backend.decode(clean)

  def extra_id(self, k: int) -> int:
    """The id of sentinel `<extra_id_k>`: vocab_size - 1 - k."""
    if not 0 <= k < self.extra_ids:
      raise ValueError(f"<extra_id_{k}> does not exist: {self.source} has {self.extra_ids} extra "
                       "ids")
    return self.vocab_size - 1 - k

  def id_to_piece(self, i: int) -> str:
    return self._backend.id_to_piece(int(i))

  def check_fits(self, model_vocab_size: int) -> None:
    """ValueError when some id of this vocabulary has no logit in a model of `model_vocab_size`."""
    if self.vocab_size > model_vocab_size:
      raise ValueError(
          f"vocabulary {self.source} has {self.vocab_size} ids ({self.vocab_size - self.extra_ids} "
          f"pieces + {self.extra_ids} extra ids) but the model has only {model_vocab_size} logits: "
          f"ids from {model_vocab_size} up could never be predicted nor embedded")

  def __repr__(self) -> str:
    return (f"SentencePieceVocabulary({self.source!r}, vocab_size={self.vocab_size}, "
            f"extra_ids={self.extra_ids})")


def train(texts: Iterable[str], path, vocab_size: int, *, extra_ids: int = 0,
          model_type: str = "unigram", character_coverage: float = 1.0, num_threads: int = 1,
          **trainer_options) -> SentencePieceVocabulary:
  """Train a SentencePiece model with T5's special ids (pad 0, EOS 1, unk 2, no BOS) on `texts`,
  write it to `path` (e.g. <dir>/spiece.model) and return it with `extra_ids` sentinels.

  vocab_size counts the pieces (3 special ones included), not the extra ids. A tiny corpus may not
  support the size asked for: SentencePiece then fails, and so does this (pass
  hard_vocab_limit=False to accept fewer pieces). character_coverage 1.0 keeps every character of
  the corpus, so ASCII text decodes back exactly; num_threads=1 keeps training deterministic.
  """
  sentences = (str(t) for t in texts)
  model = io.BytesIO()
  options = dict(
      vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>",
      unk_piece="<unk>", num_threads=num_threads, minloglevel=2)
  options.update(trainer_options)
  try:
    spm.SentencePieceTrainer.train(sentence_iterator=sentences, model_writer=model, **options)
  except RuntimeError as e:
    raise ValueError(f"SentencePiece training for {path} failed: {e}") from e
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(model.getvalue())
  return SentencePieceVocabulary.from_file(path, extra_ids)


def _configured_extra_ids(directory: pathlib.Path) -> int:
  config = directory / "tokenizer_config.json"
  if not config.is_file():
    return 0
  return int(json.loads(config.read_text()).get("extra_ids", 0) or 0)


class _SentencePieceBackend:
  """The `sentencepiece` library over the model proto, sentinels appended as seqio does."""

  def __init__(self, model: bytes, extra_ids: int, source: str):
    if extra_ids < 0:
      raise ValueError(f"extra_ids must be >= 0, not {extra_ids}")
    if extra_ids:
      proto = sentencepiece_model_pb2.ModelProto.FromString(model)
      user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
      for k in reversed(range(extra_ids)):  # reversed: <extra_id_0> gets the highest id
        proto.pieces.add(piece=f"▁<extra_id_{k}>", score=0.0, type=user_defined)
      model = proto.SerializeToString()
    self.processor = spm.SentencePieceProcessor()
    try:
      self.processor.LoadFromSerializedProto(model)
    except RuntimeError as e:
      raise ValueError(f"{source} is not a SentencePiece model: {e}") from e

  @property
  def size(self) -> int:
    return self.processor.GetPieceSize()

  def special_ids(self, source: str) -> tuple[int, int, int]:
    ids = self.processor.pad_id(), self.processor.eos_id(), self.processor.unk_id()
    return _require_special(ids, source)

  def encode(self, text: str) -> list[int]:
    return list(self.processor.EncodeAsIds(text))

  def decode(self, ids: Sequence[int]) -> str:
    return self.processor.DecodeIds(list(ids))

  def id_to_piece(self, i: int) -> str:
    return self.processor.IdToPiece(i)


class _TokenizersBackend:
  """A Hugging Face tokenizer.json (Unigram) through the `tokenizers` library."""

  def __init__(self, path: pathlib.Path):
    spec = json.loads(path.read_text())
    kind = spec.get("model", {}).get("type")
    if kind != "Unigram":
      raise ValueError(f"{path} holds a {kind} model, not a SentencePiece Unigram model")
    self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
    vocab = self.tokenizer.get_vocab(with_added_tokens=True)
    self.extra_ids = sum(1 for token in vocab if _EXTRA_ID.fullmatch(token))
    self._vocab = vocab

  @property
  def size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def special_ids(self, source: str) -> tuple[int, int, int]:
    ids = tuple(self._vocab.get(token, -1) for token in ("<pad>", "</s>", "<unk>"))
    return _require_special(ids, source)

  def encode(self, text: str) -> list[int]:
    return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=False)

  def id_to_piece(self, i: int) -> str:
    return self.tokenizer.id_to_token(i)


def _require_special(ids: tuple[int, int, int], source: str) -> tuple[int, int, int]:
  for name, i in zip(("pad", "EOS", "unk"), ids):
    if i < 0:
      raise ValueError(f"{source} has no {name} piece; T5 needs pad 0, EOS 1, unk 2 (train with "
                       "pad_id=0, eos_id=1, unk_id=2, bos_id=-1)")
  return ids
