"""Hugging Face Llama-family checkpoints: `config.json` + `model.safetensors` (or a sharded index).

`load` reads LlamaForCausalLM-style directories into specjax parameters; `save` writes specjax
decoder_only parameters back in the same layout, so a draft trained here runs in transformers too.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
from safetensors.numpy import load_file, save_file

from specjax.checkpoints import llama_layout
from specjax.models.decoder_only import DecoderConfig

_LLAMA_TYPES = ("llama", "mistral", "smollm2", "smollm3", "qwen2")
# A subset-head draft also writes the vocabulary ids its head scores (JSON list, head order). Peers
# running the exported model in transformers mask every other logit to -inf to get the same draft.
HEAD_TOKENS_FILE = "head_tokens.json"


def config_from_hf(hf: dict) -> DecoderConfig:
  model_type = hf.get("model_type")
  if model_type not in _LLAMA_TYPES:
    raise ValueError(f"unknown checkpoint layout: config.json model_type {model_type!r}; specjax's "
                     f"decoder_only reads {', '.join(_LLAMA_TYPES)}")
  if hf.get("rope_scaling"):
    raise ValueError(f"rope_scaling {hf['rope_scaling']!r} is not supported; only plain RoPE")
  heads = hf["num_attention_heads"]
  return DecoderConfig(
      vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=float(hf.get("rope_theta", 10000.0)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def config_to_hf(cfg: DecoderConfig) -> dict:
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.embed_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim, "rope_theta": cfg.rope_theta,
      "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
      "max_position_embeddings": 8192, "torch_dtype": "float32",
  }


def read_safetensors(directory: pathlib.Path) -> tuple[dict[str, np.ndarray], str]:
  """Every tensor of a Hugging Face directory (model.safetensors or a sharded index) -> (tensors,
  the files read, for messages)."""
  index = directory / "model.safetensors.index.json"
  if index.is_file():
    files = sorted(set(read_json(index)["weight_map"].values()))
  elif (directory / "model.safetensors").is_file():
    files = ["model.safetensors"]
  else:
    raise ValueError(f"unknown checkpoint layout at {directory}: config.json but no "
                     "model.safetensors or model.safetensors.index.json (PyTorch .bin checkpoints "
                     "are not read; convert them to safetensors)")
  tensors = {}
  for name in files:
    try:
      tensors.update(load_file(str(directory / name)))
    except FileNotFoundError:
      raise FileNotFoundError(f"{directory / name} is missing (named by {index}); copy the "
                              "checkpoint's every shard there") from None
    except Exception as error:  # pylint: disable=broad-except  # safetensors' SafetensorError, OSError
      raise ValueError(f"{directory / name} is truncated or corrupt ({type(error).__name__}: "
                       f"{error}); copy or download the checkpoint again, or export it again "
                       "(checkpoints.hf.save)") from None
  return tensors, ", ".join(str(directory / name) for name in files)


def read_json(path: pathlib.Path):
  """A checkpoint's JSON file, or ValueError naming the file and the fix when it does not parse."""
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except (ValueError, UnicodeDecodeError) as error:
    raise ValueError(f"{path} is not valid JSON ({error}): the file is truncated or was edited; "
                     "restore it from the checkpoint's source (or export the checkpoint again)"
                     ) from None


def read_config(directory: pathlib.Path) -> dict:
  """The config.json of a Hugging Face directory, or a clear error naming what was expected."""
  config_path = directory / "config.json"
  if not config_path.is_file():
    raise ValueError(f"unknown checkpoint layout at {directory}: no config.json (expected a Hugging "
                     "Face model directory, a .gguf file, or a T5X checkpoint)")
  return read_json(config_path)


def load(directory):
  """A directory with config.json and model.safetensors (or model.safetensors.index.json)."""
  directory = pathlib.Path(directory)
  cfg = config_from_hf(read_config(directory))
  tensors, _ = read_safetensors(directory)
  if cfg.tie_embeddings and "lm_head.weight" in tensors:
    tensors.pop("lm_head.weight")  # some exporters store the tied head twice
  head_tokens = None
  if (directory / HEAD_TOKENS_FILE).is_file():
    head_tokens = np.asarray(read_json(directory / HEAD_TOKENS_FILE), np.int32)
    cfg = dataclasses.replace(cfg, head_size=len(head_tokens))
  return cfg, llama_layout.params_from_hf_tensors(
      lambda key: None if key not in tensors else tensors[key].astype(np.float32), cfg,
      head_tokens=head_tokens)


def save(directory, cfg: DecoderConfig, params) -> pathlib.Path:
  """Write config.json + model.safetensors (float32) that transformers' LlamaForCausalLM loads (+
  head_tokens.json for a subset head)."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tensors = llama_layout.hf_tensors_from_params(params, cfg)
  save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()},
            str(directory / "model.safetensors"), metadata={"format": "pt"})
  (directory / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
  if cfg.head_size:
    (directory / HEAD_TOKENS_FILE).write_text(
        json.dumps([int(i) for i in np.asarray(params[llama_layout.HEAD_TOKENS])]) + "\n")
  return directory
