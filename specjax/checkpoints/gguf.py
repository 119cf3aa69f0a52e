"""Read Llama-family GGUF files (llama.cpp) into specjax parameters.

Quantized tensors are dequantized to float32 with the `gguf` package. llama.cpp stores attn_q / attn_k
rows permuted for its interleaved RoPE; we undo the permutation and use rotate-half RoPE like Hugging
Face, so one model serves both formats. No `output.weight` means the LM head is tied to token_embd.

Dequantizing SmolLM2-135M takes a few seconds; the float32 result is cached as .npy files under
$SPECJAX_CACHE (default ~/.cache/specjax), keyed by the file's size, modification and change times and
inode; a cache entry that does not load is removed and the file dequantized again. The tokenizer's
metadata (`tokenizer_metadata`) is cached the same way, as JSON: parsing 49k token strings and merges
took 3.7 s of every SmolLM2 load, the cached read 0.1 s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import gguf
import numpy as np
from absl import logging
from flax import traverse_util

from specjax import assets
from specjax.checkpoints import llama_layout
from specjax.models.decoder_only import DecoderConfig

# GGUF tensor name (per layer, after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
_GGUF_TO_HF = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


_MAGIC = b"GGUF"


def open_reader(path) -> gguf.GGUFReader:
  """A GGUFReader over `path`, or a ValueError that names the file and what is wrong with it: not a
  GGUF at all, or truncated (with the size its own tensor table says it has)."""
  path = pathlib.Path(path)
  size = path.stat().st_size
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != _MAGIC:
    raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, a GGUF with {_MAGIC!r}; "
                     "point the checkpoint at a .gguf from llama.cpp or at a Hugging Face directory")
  try:
    reader = gguf.GGUFReader(str(path))
  except Exception as error:  # pylint: disable=broad-except  # the reader raises whatever numpy does
    raise ValueError(f"{path} ({size} bytes) is truncated or corrupt: its GGUF header does not parse "
                     f"({type(error).__name__}: {error}); download or copy it again") from None
  expected = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
  if expected > size:
    raise ValueError(f"{path} is truncated: its tensors end at byte {expected} but the file has "
                     f"{size} bytes; download or copy it again")
  return reader


def metadata(reader: gguf.GGUFReader, key: str, default=None):
  """A GGUF metadata field as a Python str / int / float / bool, or a list of them for arrays; `default`
  when the file lacks it. Reads the reader's raw `parts` / `data`, which are stable across gguf
  versions, rather than newer helpers."""
  field = reader.fields.get(key)
  if field is None or not field.types:
    return default
  kinds = gguf.GGUFValueType

  def convert(part, kind):
    if kind == kinds.STRING:
      return bytes(part).decode("utf-8")
    item = part.tolist()[0]
    return bool(item) if kind == kinds.BOOL else item

  if field.types[0] == kinds.ARRAY:
    return [convert(field.parts[i], field.types[-1]) for i in field.data]
  if not field.data:
    return default
  return convert(field.parts[field.data[0]], field.types[0])


def read_config(reader) -> DecoderConfig:
  arch = metadata(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"unknown checkpoint layout: GGUF architecture {arch!r}; specjax reads 'llama' "
                     "GGUF files (Llama, SmolLM2, Mistral-style)")
  heads = int(metadata(reader, "llama.attention.head_count"))
  embed = int(metadata(reader, "llama.embedding_length"))
  names = {t.name for t in reader.tensors}
  vocab = metadata(reader, "llama.vocab_size")
  if vocab is None:
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)  # counted, not decoded (49k strings)
  return DecoderConfig(
      vocab_size=int(vocab), embed_dim=embed, num_layers=int(metadata(reader, "llama.block_count")),
      num_heads=heads, num_kv_heads=int(metadata(reader, "llama.attention.head_count_kv", heads)),
      head_dim=int(metadata(reader, "llama.attention.key_length", embed // heads)),
      mlp_dim=int(metadata(reader, "llama.feed_forward_length")),
      rope_theta=float(metadata(reader, "llama.rope.freq_base", 10000.0)),
      # Metadata floats are float32; print-round them so 1e-5 stays 1e-5.
      norm_eps=float(f'{metadata(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5):.6g}'),
      tie_embeddings="output.weight" not in names)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE layout).

  The converter maps each head's rows (2, head_dim / 2) -> (head_dim / 2, 2); this is its inverse.
  """
  d_out, d_in = w.shape
  return w.reshape(n_head, d_out // n_head // 2, 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def _hf_tensors(reader, cfg: DecoderConfig) -> dict[str, np.ndarray]:
  out = {}
  for tensor in reader.tensors:
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    w = w.reshape([int(n) for n in reversed(tensor.shape)]) if w.ndim != len(tensor.shape) else w
    name = tensor.name
    if name == "token_embd.weight":
      out["model.embed_tokens.weight"] = w
    elif name == "output_norm.weight":
      out["model.norm.weight"] = w
    elif name == "output.weight":
      out["lm_head.weight"] = w
    elif name.startswith("blk."):
      _, layer, rest = name.split(".", 2)
      if rest == "attn_q.weight":
        w = _unpermute(w, cfg.num_heads)
      elif rest == "attn_k.weight":
        w = _unpermute(w, cfg.num_kv_heads)
      if rest in _GGUF_TO_HF:
        out[f"model.layers.{layer}.{_GGUF_TO_HF[rest]}"] = w
  return out


def _cache_entry(path: pathlib.Path, suffix: str) -> pathlib.Path:
  """Where what is read from `path` is cached. Keyed as content keys' memo is
  (checkpoints.content_key): a file swapped in with its old size and a forged mtime has another ctime
  or inode, so it is read again."""
  stat = path.stat()
  key = hashlib.sha1(f"v4:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:"
                     f"{stat.st_ino}".encode()).hexdigest()[:16]
  return assets.cache_dir() / "gguf" / f"{path.stem}-{key}{suffix}"


# The metadata a tokenizer is built from (tokenizer.Tokenizer.from_gguf).
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.chat_template")


def tokenizer_metadata(path, use_cache: bool = True) -> dict:
  """{key: value or None} for TOKENIZER_KEYS. Parsing them takes seconds (49k token strings and as many
  merges), longer than building the tokenizer, so they are cached as JSON beside the dequantized
  weights, under the same key; an entry that does not load is removed and the file read again."""
  path = pathlib.Path(path)
  cached = _cache_entry(path, ".tokenizer.json")
  if use_cache and cached.is_file():
    try:
      fields = json.loads(cached.read_text(encoding="utf-8"))
      if set(fields) == set(TOKENIZER_KEYS):
        return fields
      raise ValueError(f"keys {sorted(fields)}")
    except (OSError, ValueError) as error:
      logging.warning("the tokenizer cache %s of %s does not load (%s: %s); removing it and reading "
                      "the file again", cached, path, type(error).__name__, error)
      cached.unlink(missing_ok=True)
  reader = open_reader(path)
  fields = {key: metadata(reader, key) for key in TOKENIZER_KEYS}
  if use_cache:
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(fields), encoding="utf-8")
    os.replace(tmp, cached)  # atomic, as the weights' entry
  return fields


def load(path, use_cache: bool = True):
  """A .gguf file -> (DecoderConfig, params as float32 numpy arrays)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no GGUF file at {path}")
  cached = _cache_entry(path, ".npz")
  if use_cache and cached.is_file():
    # Parsing the GGUF metadata alone takes seconds (49k vocabulary strings), so the config is cached too.
    try:
      with np.load(cached) as data:
        flat = dict(data)
      cfg = DecoderConfig(**json.loads(str(flat.pop(_CONFIG_KEY))))
      return cfg, traverse_util.unflatten_dict(flat, sep="/")
    except Exception as error:  # pylint: disable=broad-except  # BadZipFile, EOFError, KeyError, ...
      # A cache entry is only ever a copy: a corrupt one (a disk error, a copy cut short) is
      # dropped and the GGUF dequantized again.
      logging.warning("the dequantized cache %s of %s does not load (%s: %s); removing it and "
                      "dequantizing again", cached, path, type(error).__name__, error)
      cached.unlink(missing_ok=True)
  reader = open_reader(path)
  cfg = read_config(reader)
  params = llama_layout.params_from_hf_tensors(_hf_tensors(reader, cfg).get, cfg)
  if use_cache:
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.stem}.tmp{os.getpid()}.npz")
    np.savez(tmp, **traverse_util.flatten_dict(params, sep="/"),
             **{_CONFIG_KEY: np.array(json.dumps(dataclasses.asdict(cfg)))})
    os.replace(tmp, cached)  # atomic: a concurrent or killed writer never leaves a torn cache
  return cfg, params


_CONFIG_KEY = "__config_json__"

