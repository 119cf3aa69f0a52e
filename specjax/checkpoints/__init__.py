"""Checkpoint readers: GGUF and Hugging Face safetensors for decoder-only models.

`load_decoder(path)` picks the reader from what it finds at `path`, or names what it expected.
"""

from __future__ import annotations

import pathlib


def load_decoder(path):
  """A .gguf file or a Hugging Face model directory -> (DecoderConfig, params as numpy arrays)."""
  from specjax.checkpoints import gguf, hf  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(path)
  if path.is_file() and path.suffix == ".gguf":
    return gguf.load(path)
  if path.is_dir():
    return hf.load(path)
  if not path.exists():
    raise FileNotFoundError(f"no checkpoint at {path}")
  raise ValueError(f"unknown checkpoint layout at {path}: expected a .gguf file or a directory with "
                   "config.json + model.safetensors")
