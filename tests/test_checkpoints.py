"""GGUF reader on a tiny file written like llama.cpp's converter, checked against the same weights
read from Hugging Face safetensors (independent of the embedded model)."""

import dataclasses

import gguf
import jax
import numpy as np

from conftest import random_decoder_params
from specjax import checkpoints
from specjax.checkpoints import hf, llama_layout
from specjax.models import decoder_only

TINY = dataclasses.replace(decoder_only.SIZES["tiny"], rope_theta=1000.0)


def _llama_cpp_permute(w, n_head):
  """What llama.cpp's converter does to q/k rows (written from its documented layout)."""
  d_out, d_in = w.shape
  return w.reshape(n_head, 2, d_out // n_head // 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def _write_gguf(path, cfg, params, tied=True):
  tensors = llama_layout.hf_tensors_from_params(params, cfg)
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(cfg.num_layers)
  writer.add_embedding_length(cfg.embed_dim)
  writer.add_feed_forward_length(cfg.mlp_dim)
  writer.add_head_count(cfg.num_heads)
  writer.add_head_count_kv(cfg.num_kv_heads)
  writer.add_rope_freq_base(cfg.rope_theta)
  writer.add_layer_norm_rms_eps(cfg.norm_eps)
  writer.add_vocab_size(cfg.vocab_size)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  per_layer = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight"}
  for name, value in tensors.items():
    if name.startswith("model.layers."):
      _, _, layer, rest = name.split(".", 3)
      if rest == "self_attn.q_proj.weight":
        value = _llama_cpp_permute(value, cfg.num_heads)
      elif rest == "self_attn.k_proj.weight":
        value = _llama_cpp_permute(value, cfg.num_kv_heads)
      out_name = f"blk.{layer}.{per_layer[rest]}"
    else:
      out_name = names[name]
    writer.add_tensor(out_name, np.ascontiguousarray(value, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_gguf_reader_undoes_the_permutation_and_matches_safetensors(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  for tied in (True, False):
    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    params = random_decoder_params(cfg, seed=7)
    _write_gguf(tmp_path / f"tiny-{tied}.gguf", cfg, params)
    for _ in range(2):  # the second load comes from the dequantized cache
      loaded_cfg, loaded = checkpoints.load(tmp_path / f"tiny-{tied}.gguf")
      assert loaded_cfg == cfg
      jax.tree_util.tree_map(np.testing.assert_array_equal, params, loaded)


def test_hf_directory_with_sharded_index(tmp_path):
  import json  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  params = random_decoder_params(TINY, seed=8)
  tensors = llama_layout.hf_tensors_from_params(params, TINY)
  names = sorted(tensors)
  half = len(names) // 2
  weight_map = {}
  for shard, chunk in enumerate([names[:half], names[half:]]):
    filename = f"model-0000{shard + 1}-of-00002.safetensors"
    save_file({n: tensors[n] for n in chunk}, str(tmp_path / filename))
    weight_map.update({n: filename for n in chunk})
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(TINY)))
  cfg, loaded = checkpoints.load(tmp_path)
  assert cfg == TINY
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, loaded)
