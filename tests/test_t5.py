"""T5: bucket function vs the reference table, Hugging Face parity on random weights (T5 1.0 and
1.1, ragged sources), cache invariants, checkpoint round trips, published sizes, clear errors."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ragged_source, random_t5_params
from specjax import contracts, sharding
from specjax.checkpoints import hf_t5
from specjax.models import t5

TINY_11 = t5.SIZES["tiny"]       # gated GELU, untied unscaled head
TINY_10 = t5.SIZES["tiny-1.0"]   # ReLU, head tied to the embedding and scaled
FLAVOURS = pytest.mark.parametrize("cfg", [TINY_10, TINY_11], ids=["t5-1.0", "t5-1.1"])

# REFERENCE.md section 6: rp = key position - query position -> bucket (32 buckets, distance 128).
BIDIRECTIONAL = {-1: 1, -7: 7, -8: 8, -15: 9, -16: 10, -20: 10, -32: 12, -64: 14, -100: 15,
                 -128: 15, 0: 0, 1: 17, 8: 24, 16: 26, 127: 31}
CAUSAL = {-1: 1, -7: 7, -8: 8, -15: 15, -16: 16, -20: 17, -32: 21, -64: 26, -100: 30, -128: 31,
          **{rp: 0 for rp in range(0, 128)}}

# Every decode below uses these shapes (3 rows, sources of 20 slots, 21 decoder tokens, a cache of
# 24 slots), so each flavour compiles its encoder once and its decoder once per step length T.
# Distances up to 20 reach the log-spaced buckets of both stacks (exact ones stop at 8 and 16).
SOURCE_LENGTHS = (20, 9, 14)  # a ragged batch, right-padded with 0
STEPS = 21
CACHE = 24


def decoder_tokens(cfg, batch=len(SOURCE_LENGTHS), steps=STEPS, seed=1):
  tokens = np.random.RandomState(seed).randint(2, cfg.vocab_size, (batch, steps)).astype(np.int32)
  tokens[:, 0] = cfg.decoder_start_id
  return tokens


@functools.lru_cache(maxsize=None)
def _jitted(cfg):
  """(encode, decode_step) of T5Model(cfg), jitted with traced params as the decoding loops run
  them: the source is encoded once into a context that every decoder step reuses."""
  model = t5.model(cfg)
  encode = jax.jit(lambda params, tokens, lengths: model.encode(
      params, contracts.Source(tokens, lengths)))
  return encode, jax.jit(model.decode_step)


def context_of(cfg, params, source):
  return _jitted(cfg)[0](params, *source)


def full_forward(cfg, params, source, tokens):
  """Logits [B, T, V] of one decoder call over all of `tokens` (an empty cache)."""
  batch, steps = tokens.shape
  positions = np.broadcast_to(np.arange(steps, dtype=np.int32), (batch, steps))
  return _jitted(cfg)[1](params, context_of(cfg, params, source), tokens, positions,
                         t5.init_cache(cfg, batch, CACHE))[0]


def hf_peer(directory):
  import torch  # the peer; part of the test extra
  import transformers
  return transformers.T5ForConditionalGeneration.from_pretrained(
      directory, dtype=torch.float32).eval()


def hf_logits(peer, source, tokens):
  """(encoder output [B, S, E], logits [B, T, V]) of transformers' T5, given the source's padding
  as its attention mask."""
  import torch
  source_tokens, lengths = source
  mask = (np.arange(source_tokens.shape[1]) < lengths[:, None]).astype(np.int64)
  with torch.no_grad():
    out = peer(input_ids=torch.from_numpy(source_tokens).long(),
               attention_mask=torch.from_numpy(mask),
               decoder_input_ids=torch.from_numpy(tokens).long(), use_cache=False)
  return out.encoder_last_hidden_state.numpy(), out.logits.numpy()


def test_bucket_function_matches_reference_table():
  for table, bidirectional in [(BIDIRECTIONAL, True), (CAUSAL, False)]:
    rps = np.array(list(table), np.int32)
    buckets = t5.relative_position_bucket(rps, bidirectional, num_buckets=32, max_distance=128)
    np.testing.assert_array_equal(buckets, [table[int(rp)] for rp in rps],
                                  err_msg=f"bidirectional={bidirectional}")


def test_bucket_function_matches_hugging_face_up_to_300():
  import torch
  from transformers.models.t5.modeling_t5 import T5Attention
  rps = np.arange(-300, 301, dtype=np.int32)
  for bidirectional in (True, False):
    expected = T5Attention._relative_position_bucket(  # pylint: disable=protected-access
        torch.from_numpy(rps).long(), bidirectional=bidirectional, num_buckets=32, max_distance=128)
    np.testing.assert_array_equal(t5.relative_position_bucket(rps, bidirectional), expected.numpy())


@FLAVOURS
def test_matches_hugging_face_on_a_ragged_batch(cfg, tmp_path):
  params = random_t5_params(cfg, seed=1)
  hf_t5.save(tmp_path, cfg, params)
  peer = hf_peer(tmp_path)
  # transformers 5.x forces tie_word_embeddings=True and keys the 1.0 scaling off the saved flag.
  assert peer.config.scale_decoder_outputs == cfg.tie_embeddings
  assert (peer.lm_head.weight is peer.shared.weight) == cfg.tie_embeddings
  source = ragged_source(cfg)
  tokens = decoder_tokens(cfg)
  expected_encoded, expected_logits = hf_logits(peer, source, tokens)
  encoded = np.asarray(t5.encode(cfg, params, contracts.Source(*map(jnp.asarray, source))))
  logits = np.asarray(full_forward(cfg, params, source, tokens))
  assert np.std(expected_logits) > 0.5 and np.abs(expected_logits).max() > 2.0  # not degenerate
  valid = np.arange(source[0].shape[1]) < source[1][:, None]  # padded encoder rows are unspecified
  # Measured over several seeds (float32, outputs of magnitude ~4): encoder max |diff| <= 3.5e-6,
  # logits <= 1.6e-5; the tolerances leave ~3-6x headroom.
  np.testing.assert_allclose(encoded[valid], expected_encoded[valid], atol=2e-5, rtol=0)
  np.testing.assert_allclose(logits, expected_logits, atol=5e-5, rtol=0)


def test_cached_steps_equal_full_forward():
  params = random_t5_params(TINY_11, seed=2)
  source, tokens = ragged_source(TINY_11), decoder_tokens(TINY_11)
  full = full_forward(TINY_11, params, source, tokens)
  context, step = context_of(TINY_11, params, source), _jitted(TINY_11)[1]
  cache = t5.init_cache(TINY_11, 3, CACHE)
  pieces = []  # prefill 16, then 1, then a verification-sized chunk of 4: one code path for any T
  for start, stop in [(0, 16), (16, 17), (17, 21)]:
    positions = np.broadcast_to(np.arange(start, stop, dtype=np.int32), (3, stop - start))
    logits, cache = step(params, context, tokens[:, start:stop], positions, cache)
    pieces.append(logits)
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(cache.lengths, [21, 21, 21])


def test_rollback_then_rewrite_equals_never_written():
  """Rejected drafts left in stale slots are overwritten before any query reads them."""
  params = random_t5_params(TINY_11, seed=3)
  source, tokens = ragged_source(TINY_11), decoder_tokens(TINY_11)
  junk = decoder_tokens(TINY_11, steps=5, seed=9)[:, 1:]
  context, step = context_of(TINY_11, params, source), _jitted(TINY_11)[1]
  at = lambda start, n: np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (3, n))
  cache = t5.init_cache(TINY_11, 3, CACHE)
  _, cache = step(params, context, tokens[:, :16], at(0, 16), cache)
  _, cache = step(params, context, junk, at(16, 4), cache)  # rejected draft tokens at 16..19
  cache = contracts.set_lengths(cache, np.array([16, 16, 16]))
  logits, cache = step(params, context, tokens[:, 16:20], at(16, 4), cache)
  np.testing.assert_allclose(logits, full_forward(TINY_11, params, source, tokens)[:, 16:20],
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(cache.lengths, [20, 20, 20])


def test_rows_with_different_decoder_lengths():
  """Right-padded decoder prefixes of lengths 10, 16, 13, rolled back per row, then each row writes
  4 tokens at its own positions: every row matches its own full forward."""
  params = random_t5_params(TINY_11, seed=4)
  source, tokens = ragged_source(TINY_11), decoder_tokens(TINY_11)
  lengths = np.array([10, 16, 13], np.int32)
  context, step = context_of(TINY_11, params, source), _jitted(TINY_11)[1]
  cache = t5.init_cache(TINY_11, 3, CACHE)
  prefill = np.broadcast_to(np.arange(16, dtype=np.int32), (3, 16))
  _, cache = step(params, context, tokens[:, :16], prefill, cache)  # rows 0, 2 write padding too
  cache = contracts.set_lengths(cache, lengths)
  positions = lengths[:, None] + np.arange(4, dtype=np.int32)
  logits, cache = step(params, context, np.take_along_axis(tokens, positions, axis=1), positions,
                       cache)
  full = np.asarray(full_forward(TINY_11, params, source, tokens))
  np.testing.assert_allclose(logits, np.take_along_axis(full, positions[:, :, None], axis=1),
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(cache.lengths, lengths + 4)


def test_model_meets_the_contract():
  """T5Model is a contracts.Model; open_session (what the loops call) inside jit equals encode +
  decode_step, with a 1x1 mesh turning the activation constraints on."""
  model = t5.model(TINY_11)
  assert isinstance(model, contracts.Model) and model.encoder_decoder
  params = random_t5_params(TINY_11, seed=6)
  source = ragged_source(TINY_11)
  prompt, lengths = t5.decoder_prompt(TINY_11, 3)
  np.testing.assert_array_equal(prompt, np.full((3, 1), TINY_11.decoder_start_id))
  np.testing.assert_array_equal(lengths, [1, 1, 1])
  assert prompt.dtype == jnp.int32 and lengths.dtype == jnp.int32
  expected = full_forward(TINY_11, params, source, np.asarray(prompt))
  mesh = sharding.make_mesh(1, 1, jax.devices()[:1])

  @jax.jit
  def via_session(params, source_tokens, source_lengths):
    session = contracts.open_session(t5.model(TINY_11, mesh), params,
                                     contracts.Source(source_tokens, source_lengths))
    return session.step(prompt, jnp.zeros((3, 1), jnp.int32), session.init_cache(3, CACHE))

  logits, cache = via_session(params, *source)
  np.testing.assert_allclose(logits, expected, atol=1e-6)
  np.testing.assert_array_equal(cache.lengths, [1, 1, 1])


@FLAVOURS
def test_safetensors_round_trip_is_exact(cfg, tmp_path):
  params = random_t5_params(cfg, seed=5)
  hf_t5.save(tmp_path, cfg, params)
  loaded_cfg, loaded = hf_t5.load(tmp_path)
  assert loaded_cfg == cfg
  assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, loaded)


def _hf_written(cfg, directory, untie=True, **save_kwargs):
  """A T5ForConditionalGeneration built and saved by transformers itself (its own random init)."""
  import torch
  import transformers
  torch.manual_seed(0)
  hf_config = transformers.T5Config(**{k: v for k, v in hf_t5.config_to_hf(cfg).items()
                                       if k not in ("architectures", "model_type", "torch_dtype")})
  peer = transformers.T5ForConditionalGeneration(hf_config).eval()
  if untie and not cfg.tie_embeddings:  # transformers 5.x ties every T5 head: untie it by hand
    peer.lm_head.weight = torch.nn.Parameter(torch.randn_like(peer.lm_head.weight) * 0.2)
  peer.save_pretrained(directory, **save_kwargs)
  return peer


@pytest.mark.parametrize("cfg, untie", [(TINY_10, False), (TINY_11, True), (TINY_11, False)],
                         ids=["t5-1.0", "t5-1.1", "t5-1.1-head-left-tied"])
def test_hugging_face_written_directory_loads(cfg, untie, tmp_path):
  """transformers 5.x writes tie_word_embeddings: true for every T5 and scale_decoder_outputs: false
  for 1.1; a 1.1 whose head it left tied has no lm_head.weight (logits_dense = embedding.T)."""
  peer = _hf_written(cfg, tmp_path, untie, max_shard_size="40KB")  # sharded: exercises the index
  assert (tmp_path / "model.safetensors.index.json").is_file()
  loaded_cfg, params = hf_t5.load(tmp_path)
  assert loaded_cfg == cfg
  if not cfg.tie_embeddings:
    tied = np.array_equal(params["decoder"]["logits_dense"]["kernel"],
                          params["token_embedder"]["embedding"].T)
    assert tied != untie
  source, tokens = ragged_source(cfg), decoder_tokens(cfg)
  _, expected = hf_logits(peer, source, tokens)
  assert np.std(expected) > 0.5
  # Measured max |diff| <= 3.1e-6 on transformers' own init.
  np.testing.assert_allclose(full_forward(cfg, params, source, tokens), expected, atol=5e-5, rtol=0)


def test_bfloat16_checkpoint_loads_as_float32(tmp_path):
  import torch
  peer = _hf_written(TINY_11, tmp_path / "f32")
  peer.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
  _, params = hf_t5.load(tmp_path / "bf16")
  _, reference = hf_t5.load(tmp_path / "f32")
  for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reference)):
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want.astype(jnp.bfloat16).astype(np.float32))


def test_published_sizes():
  published = {"t5.1.1-small": 77e6, "t5.1.1-base": 248e6, "t5.1.1-large": 783e6,
               "t5.1.1-xl": 2.85e9, "t5.1.1-xxl": 11.1e9, "t5-small": 60.5e6, "t5-base": 223e6,
               "t5-large": 738e6, "t5-3b": 2.85e9, "t5-11b": 11.3e9}
  for name, count in published.items():  # from shapes via jax.eval_shape: nothing is allocated
    assert abs(t5.num_params(t5.SIZES[name]) / count - 1) < 0.01, name


def test_param_tree_has_logical_axes():
  specs = t5.param_logical_axes(TINY_11)
  attention = specs["encoder"]["layers_0"]["attention"]
  assert tuple(attention["query"]["kernel"]) == ("embed", "heads")
  assert tuple(attention["out"]["kernel"]) == ("heads", "embed")
  assert tuple(specs["decoder"]["logits_dense"]["kernel"]) == ("embed", "vocab")
  assert tuple(specs["token_embedder"]["embedding"]) == ("vocab", "embed")
  assert "logits_dense" not in t5.param_logical_axes(TINY_10)["decoder"]
  assert "wi" in t5.param_shapes(TINY_10)["decoder"]["layers_1"]["mlp"]


def test_open_needs_a_source_that_fits():
  params = random_t5_params(TINY_11)
  with pytest.raises(ValueError, match="encoder-decoder.*source"):
    t5.model(TINY_11).encode(params, None)
  limited = dataclasses.replace(TINY_11, max_source_length=4)
  tokens, lengths = ragged_source(limited, [6])
  with pytest.raises(ValueError, match="6 tokens.*max_source_length=4"):
    t5.model(limited).encode(params, contracts.Source(jnp.asarray(tokens), jnp.asarray(lengths)))


def test_checkpoint_errors_name_file_and_expectation(tmp_path):
  from safetensors.numpy import load_file, save_file
  with pytest.raises(ValueError, match="no config.json"):
    hf_t5.load(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "bart"}))
  with pytest.raises(ValueError, match="config.json.*'bart' is not a T5"):
    hf_t5.load(tmp_path)
  hf_t5.save(tmp_path, TINY_11, random_t5_params(TINY_11))
  weights = tmp_path / "model.safetensors"
  tensors = load_file(str(weights))
  del tensors["decoder.block.1.layer.1.EncDecAttention.v.weight"]
  save_file(tensors, str(weights))
  with pytest.raises(ValueError, match="model.safetensors: missing tensor "
                                       "'decoder.block.1.layer.1.EncDecAttention.v.weight'"):
    hf_t5.load(tmp_path)
  # A scaled (T5 1.0) config with a head of its own: no T5 has it, refuse rather than guess.
  hf_t5.save(tmp_path, TINY_10, random_t5_params(TINY_10))
  tensors = load_file(str(weights))
  save_file({**tensors, "lm_head.weight": tensors["shared.weight"] + 1.0}, str(weights))
  with pytest.raises(ValueError, match="lm_head.weight differs from shared.weight"):
    hf_t5.load(tmp_path)
