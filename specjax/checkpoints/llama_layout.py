"""The mapping between specjax's decoder_only parameter tree and the per-layer [out, in] matrices
that Hugging Face Llama checkpoints and GGUF files store.

Both readers produce a dict of per-layer numpy matrices in Hugging Face names and orientation; this
module turns them into our tree (`layers_{i}/...`, [in, out] kernels) and back, so the two formats
share one conversion and the exporter is its exact inverse.
"""

from __future__ import annotations

import numpy as np
from flax import traverse_util

from specjax.models.decoder_only import HEAD_TOKENS, DecoderConfig, validate_head_tokens

# Our leaf (under params[f"layers_{i}"]) -> Hugging Face per-layer name.
_LAYER_LEAVES = {
    ("attn", "wq"): "self_attn.q_proj.weight",
    ("attn", "wk"): "self_attn.k_proj.weight",
    ("attn", "wv"): "self_attn.v_proj.weight",
    ("attn", "wo"): "self_attn.o_proj.weight",
    ("mlp", "w_gate"): "mlp.gate_proj.weight",
    ("mlp", "w_up"): "mlp.up_proj.weight",
    ("mlp", "w_down"): "mlp.down_proj.weight",
    ("attn_norm", "scale"): "input_layernorm.weight",
    ("mlp_norm", "scale"): "post_attention_layernorm.weight",
}


def params_from_hf_tensors(get, cfg: DecoderConfig, dtype=np.float32, head_tokens=None) -> dict:
  """Build our param tree. get(hf_name) -> numpy array in HF orientation, or None when absent.
  A subset-head config (cfg.head_size > 0) keeps the `head_tokens` rows of lm_head.weight."""
  params = {
      "embedding": _require(get, "model.embed_tokens.weight").astype(dtype),
      "final_norm": {"scale": _require(get, "model.norm.weight").astype(dtype)},
  }
  for i in range(cfg.num_layers):
    layer = {}
    for path, hf_name in _LAYER_LEAVES.items():
      hf = _require(get, f"model.layers.{i}.{hf_name}")
      # Norm scales are vectors; every matrix flips from HF's [out, in] to our [in, out].
      layer[path] = np.ascontiguousarray((hf if hf.ndim == 1 else hf.T).astype(dtype))
    params[f"layers_{i}"] = traverse_util.unflatten_dict(layer)
  if not cfg.tie_embeddings:
    head = _require(get, "lm_head.weight")
    if cfg.head_size:
      head_tokens = validate_head_tokens(head_tokens, cfg)
      head = head[head_tokens]
      params[HEAD_TOKENS] = head_tokens
    params["lm_head"] = np.ascontiguousarray(head.T.astype(dtype))
  return params


def hf_tensors_from_params(params, cfg: DecoderConfig) -> dict[str, np.ndarray]:
  """The inverse of params_from_hf_tensors: HF-named float32 numpy tensors."""
  out = {"model.embed_tokens.weight": np.asarray(params["embedding"]),
         "model.norm.weight": np.asarray(params["final_norm"]["scale"])}
  for i in range(cfg.num_layers):
    for (module, leaf), hf_name in _LAYER_LEAVES.items():
      ours = np.asarray(params[f"layers_{i}"][module][leaf])
      out[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(ours if ours.ndim == 1 else ours.T)
  if not cfg.tie_embeddings:
    head = np.asarray(params["lm_head"]).T
    if cfg.head_size:
      # HF Llama heads cover the vocabulary and have no bias: rows off the subset are zero, so there
      # those logits are 0, not -inf; `head_tokens` (written beside) says which rows are real.
      full = np.zeros((cfg.vocab_size, cfg.embed_dim), head.dtype)
      full[np.asarray(params[HEAD_TOKENS])] = head
      head = full
    out["lm_head.weight"] = np.ascontiguousarray(head)
  return out


def _require(get, name):
  value = get(name)
  if value is None:
    raise ValueError(f"checkpoint is missing tensor {name!r}: not a Llama-family layout "
                     "specjax can read (expected Hugging Face LlamaForCausalLM names)")
  return np.asarray(value)
