"""Checkpoint readers and writers for both model families.

`load(path)` picks the reader from what it finds at `path`, or names what it expected:
  *.gguf file                                    -> gguf (Llama family, dequantized)
  directory with config.json, model_type "t5"    -> hf_t5 (T5 1.0 / 1.1 / Flan-T5)
  directory with config.json, a Llama-family type -> hf (Llama, SmolLM2, Mistral, Qwen2)
  T5X checkpoint directory (a `checkpoint` file)  -> t5x (also gs://... paths tensorstore opens)

`read_config(path)` is the architecture alone (no arrays read, except from a T5X checkpoint, whose
shapes live with its arrays). `content_key(path)` names what a checkpoint holds, not where: results
are tied to it, so weights that change behind a path make "a different config".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

from specjax import assets
from specjax.checkpoints import gguf, hf, hf_t5, t5x

_T5_MODEL_TYPES = ("t5",)  # config.json model_type of T5 1.0 / 1.1 / Flan-T5 directories


def load(path):
  """A checkpoint of either family -> (config, params as numpy arrays)."""
  text = str(path)
  if "://" in text:
    return t5x.load(text)
  path = pathlib.Path(path)
  if path.is_file() and path.suffix == ".gguf":
    return gguf.load(path)
  if path.is_dir() and (path / "config.json").is_file():
    model_type = hf.read_config(path).get("model_type")
    return hf_t5.load(path) if model_type in _T5_MODEL_TYPES else hf.load(path)
  if path.is_dir() and t5x.is_checkpoint(path):
    return t5x.load(path)
  if not path.exists():
    raise FileNotFoundError(f"no checkpoint at {path}")
  found = "a directory with no config.json and no T5X `checkpoint` file" if path.is_dir() else \
      "a file that is not a .gguf"
  raise ValueError(f"unknown checkpoint layout at {path}: {found}; expected a .gguf file, a "
                   "Hugging Face directory (config.json + model.safetensors) or a T5X checkpoint "
                   "directory (a `checkpoint` msgpack file with its arrays)")


def read_config(path):
  """The config of a checkpoint of either family without reading its weights (a plan needs shapes
  only); a T5X checkpoint is read whole (its shapes are stored with the arrays)."""
  text = str(path)
  path = pathlib.Path(path)
  if "://" not in text and path.is_file() and path.suffix == ".gguf":
    return gguf.read_config(gguf.open_reader(path))
  if "://" not in text and path.is_dir() and (path / "config.json").is_file():
    config = hf.read_config(path)
    if config.get("model_type") in _T5_MODEL_TYPES:
      return hf_t5.config_from_hf(config)
    decoder = hf.config_from_hf(config)
    if (path / hf.HEAD_TOKENS_FILE).is_file():
      head = hf.read_json(path / hf.HEAD_TOKENS_FILE)
      decoder = dataclasses.replace(decoder, head_size=len(head))
    return decoder
  return load(path)[0]


# Files of a T5X / orbax checkpoint that change whenever its arrays do (the step, the parameter
# metadata, orbax's manifest); a remote checkpoint is keyed by these alone: hashing 44 GB over the
# network to start a run is not cheap.
_REMOTE_KEY_FILES = ("checkpoint", "_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt")


def content_key(path) -> str:
  """A digest of what a checkpoint holds: sha256 over every file of a local file or directory
  (hidden files left out), cached per file by (path, size, mtime, ctime, inode) under
  $SPECJAX_CACHE, so a 500 MB model costs about a second once and nothing after; for a URL (gs://...), a digest of its metadata
  files (`_REMOTE_KEY_FILES`)."""
  text = str(path)
  if "://" in text:
    found = []
    for name in _REMOTE_KEY_FILES:
      try:
        data = t5x.read_file(f"{text.rstrip('/')}/{name}")
      except FileNotFoundError:
        continue
      found.append((name, hashlib.sha256(data).hexdigest()))
    if not found:
      raise FileNotFoundError(
          f"no checkpoint at {text}: none of {', '.join(_REMOTE_KEY_FILES)} there")
    return _digest(found)
  path = pathlib.Path(path)
  if path.is_file():
    return _digest([(path.name, _file_sha256(path))])
  if not path.is_dir():
    raise FileNotFoundError(f"no checkpoint at {path}")
  files = sorted(p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts))
  return _digest([(p.relative_to(path).as_posix(), _file_sha256(p)) for p in files])


def _digest(pairs) -> str:
  return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def _file_sha256(path: pathlib.Path) -> str:
  stat = path.stat()
  # The memo is keyed by what changes when the bytes can have changed: size, modification time and
  # the inode's change time and number. A file swapped in with its old size and a forged mtime
  # (touch -d) still has a new ctime (which no user call sets back) or inode, so it is hashed again.
  memo_key = hashlib.sha1(
      f"v2:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}"
      .encode()).hexdigest()
  memo = assets.cache_dir() / "content_keys" / memo_key
  if memo.is_file():
    return memo.read_text().strip()
  sha = hashlib.sha256()  # by hand: hashlib.file_digest needs Python 3.11, pyproject allows 3.10
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      sha.update(block)
  memo.parent.mkdir(parents=True, exist_ok=True)
  tmp = memo.with_name(f"{memo_key}.tmp{os.getpid()}")
  tmp.write_text(sha.hexdigest())
  os.replace(tmp, memo)  # atomic: concurrent runs never read half a digest
  return sha.hexdigest()
