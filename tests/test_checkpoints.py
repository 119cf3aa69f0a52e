"""GGUF reader on a tiny file written like llama.cpp's converter, checked against the same weights
read from Hugging Face safetensors (independent of the embedded model)."""

import dataclasses

import jax
import numpy as np

from conftest import random_decoder_params, write_llama_gguf
from specjax import checkpoints
from specjax.checkpoints import hf, llama_layout
from specjax.models import decoder_only

TINY = dataclasses.replace(decoder_only.SIZES["tiny"], rope_theta=1000.0)


def test_gguf_reader_undoes_the_permutation_and_matches_safetensors(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  for tied in (True, False):
    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    params = random_decoder_params(cfg, seed=7)
    write_llama_gguf(tmp_path / f"tiny-{tied}.gguf", cfg, params)
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
