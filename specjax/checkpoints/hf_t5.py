"""Hugging Face T5 checkpoints (T5ForConditionalGeneration): `config.json` + `model.safetensors`.

`load` reads T5 1.0 / 1.1 / Flan-T5 directories (float32 or bfloat16, single file or sharded index)
into specjax.models.t5 parameters; `save` writes them back so transformers loads them.

Layout differences handled here: torch Linear weights are [out, in] (ours [in, out]); the relative
position bias lives in block 0 only as [buckets, heads] (ours one [heads, buckets] per stack). Which
head a directory has: transformers up to 4.x writes `tie_word_embeddings: false` for T5 1.1;
transformers 5.x always writes `true` and records the (lack of) head scaling as
`scale_decoder_outputs`. The scaling decides: scaled means T5 1.0's tied head, unscaled means 1.1's
`lm_head` (tied to `shared` when the file has no lm_head.weight, as transformers does).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from specjax.checkpoints import hf
from specjax.models.t5 import T5Config, param_shapes

_FEED_FORWARD = {"relu": False, "gated-gelu": True}  # feed_forward_proj -> T5Config.gated


def config_from_hf(hf: dict) -> T5Config:
  if hf.get("model_type") != "t5":
    raise ValueError(f"config.json model_type {hf.get('model_type')!r} is not a T5 checkpoint "
                     "(expected model_type 't5': T5 1.0, T5 1.1 or Flan-T5)")
  projection = hf.get("feed_forward_proj", "relu")
  if projection not in _FEED_FORWARD:
    raise ValueError(f"config.json feed_forward_proj {projection!r} is not supported; expected one "
                     f"of {sorted(_FEED_FORWARD)}")
  scaled = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
  return T5Config(
      vocab_size=hf["vocab_size"], embed_dim=hf["d_model"], num_encoder_layers=hf["num_layers"],
      num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
      num_heads=hf["num_heads"],
      head_dim=hf["d_kv"], mlp_dim=hf["d_ff"], gated=_FEED_FORWARD[projection],
      tie_embeddings=bool(scaled),
      relative_buckets=hf.get("relative_attention_num_buckets", 32),
      relative_max_distance=hf.get("relative_attention_max_distance", 128),
      norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)), pad_id=hf.get("pad_token_id", 0),
      eos_id=hf.get("eos_token_id", 1), decoder_start_id=hf.get("decoder_start_token_id", 0))


def config_to_hf(cfg: T5Config) -> dict:
  return {
      "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
      "vocab_size": cfg.vocab_size, "d_model": cfg.embed_dim, "d_kv": cfg.head_dim,
      "d_ff": cfg.mlp_dim, "num_layers": cfg.num_encoder_layers,
      "num_decoder_layers": cfg.num_decoder_layers, "num_heads": cfg.num_heads,
      "relative_attention_num_buckets": cfg.relative_buckets,
      "relative_attention_max_distance": cfg.relative_max_distance,
      "layer_norm_epsilon": cfg.norm_eps,
      "feed_forward_proj": "gated-gelu" if cfg.gated else "relu",
      "tie_word_embeddings": cfg.tie_embeddings, "is_encoder_decoder": True,
      "pad_token_id": cfg.pad_id, "eos_token_id": cfg.eos_id,
      "decoder_start_token_id": cfg.decoder_start_id, "dropout_rate": 0.0, "torch_dtype": "float32",
  }


def _layout(cfg: T5Config):
  """(HF tensor name, our param path, transpose?) for every parameter of `cfg`."""
  attention = {"q": "query", "k": "key", "v": "value", "o": "out"}
  mlp = ("wi_0", "wi_1", "wo") if cfg.gated else ("wi", "wo")
  entries = [("shared.weight", ("token_embedder", "embedding"), False)]
  stacks = [("encoder", cfg.num_encoder_layers, [("SelfAttention", "attention",
                                                  "pre_attention_layer_norm")]),
            ("decoder", cfg.num_decoder_layers, [("SelfAttention", "self_attention",
                                                  "pre_self_attention_layer_norm"),
                                                 ("EncDecAttention", "encoder_decoder_attention",
                                                  "pre_cross_attention_layer_norm")])]
  for stack, num_layers, attentions in stacks:
    entries.append((f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                    (stack, "relpos_bias", "rel_embedding"), True))
    for i in range(num_layers):
      block, ours = f"{stack}.block.{i}.layer", (stack, f"layers_{i}")
      for sub, (hf_name, name, norm) in enumerate(attentions):
        entries.append((f"{block}.{sub}.layer_norm.weight", ours + (norm, "scale"), False))
        entries += [(f"{block}.{sub}.{hf_name}.{p}.weight", ours + (name, q, "kernel"), True)
                    for p, q in attention.items()]
      ff = len(attentions)
      entries.append((f"{block}.{ff}.layer_norm.weight", ours + ("pre_mlp_layer_norm", "scale"),
                      False))
      entries += [(f"{block}.{ff}.DenseReluDense.{w}.weight", ours + ("mlp", w, "kernel"), True)
                  for w in mlp]
    norm = "encoder_norm" if stack == "encoder" else "decoder_norm"
    entries.append((f"{stack}.final_layer_norm.weight", (stack, norm, "scale"), False))
  if not cfg.tie_embeddings:
    entries.append(("lm_head.weight", ("decoder", "logits_dense", "kernel"), True))
  return entries


def load(directory):
  """A T5 directory -> (T5Config, params: nested dict of float32 numpy arrays)."""
  directory = pathlib.Path(directory)
  config_path = directory / "config.json"
  try:
    cfg = config_from_hf(hf.read_config(directory))
  except ValueError as error:
    raise ValueError(f"{config_path}: {error}") from None
  tensors, source = hf.read_safetensors(directory)
  if not cfg.tie_embeddings and "lm_head.weight" not in tensors:
    tensors["lm_head.weight"] = tensors.get("shared.weight")  # transformers ties a missing head
  if (cfg.tie_embeddings and "lm_head.weight" in tensors and "shared.weight" in tensors
      and not np.array_equal(tensors["lm_head.weight"], tensors["shared.weight"])):
    raise ValueError(f"{source}: lm_head.weight differs from shared.weight but config.json asks "
                     "for the scaled, tied head of T5 1.0; an untied head must be unscaled (set "
                     "tie_word_embeddings / scale_decoder_outputs to false)")
  shapes = traverse_util.flatten_dict(param_shapes(cfg))
  flat = {}
  for hf_name, path, transpose in _layout(cfg):
    stored = tensors.pop(hf_name, None)  # popped: frees each stored copy once converted
    if stored is None:
      raise ValueError(f"{source}: missing tensor {hf_name!r}, which a T5 with {cfg} must have")
    value = np.asarray(stored).astype(np.float32)
    value = value.T if transpose else value
    expected = shapes[path].shape
    if value.shape != expected:
      as_stored = lambda shape: shape[::-1] if transpose else shape
      raise ValueError(f"{source}: {hf_name} has shape {as_stored(value.shape)}, expected "
                       f"{as_stored(expected)} for {cfg}")
    flat[path] = np.ascontiguousarray(value)
  return cfg, traverse_util.unflatten_dict(flat)


def save(directory, cfg: T5Config, params, vocabulary=None) -> pathlib.Path:
  """Write config.json + model.safetensors (float32) that T5ForConditionalGeneration loads, and the
  SentencePiece model file `vocabulary` (when given) as spiece.model, where loaders look for it."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  flat, tensors = traverse_util.flatten_dict(params), {}
  for hf_name, path, transpose in _layout(cfg):
    value = np.asarray(flat[path], np.float32)
    tensors[hf_name] = np.ascontiguousarray(value.T if transpose else value)
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  (directory / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
  if vocabulary is not None:
    shutil.copyfile(vocabulary, directory / "spiece.model")
  return directory
