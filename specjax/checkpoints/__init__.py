"""Checkpoint readers and writers for both model families.

`load(path)` picks the reader from what it finds at `path`, or names what it expected:
  *.gguf file                                    -> gguf (Llama family, dequantized)
  directory with config.json, model_type "t5"    -> hf_t5 (T5 1.0 / 1.1 / Flan-T5)
  directory with config.json, a Llama-family type -> hf (Llama, SmolLM2, Mistral, Qwen2)
  T5X checkpoint directory (a `checkpoint` file)  -> t5x (also gs://... paths tensorstore opens)
"""

from __future__ import annotations

import json
import pathlib

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
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    return hf_t5.load(path) if model_type in _T5_MODEL_TYPES else hf.load(path)
  if path.is_dir() and t5x.is_checkpoint(path):
    return t5x.load(path)
  if not path.exists():
    raise FileNotFoundError(f"no checkpoint at {path}")
  found = "a directory with no config.json and no T5X `checkpoint` file" if path.is_dir() else \
      "a file that is not a .gguf"
  raise ValueError(f"unknown checkpoint layout at {path}: {found}; expected a .gguf file, a Hugging "
                   "Face directory (config.json + model.safetensors) or a T5X checkpoint directory "
                   "(a `checkpoint` msgpack file with its arrays)")
