"""Decoder-only model: Hugging Face parity on random weights, cache invariants, checkpoint round trip."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_decoder_params
from specjax import checkpoints, contracts
from specjax.decoding import autoregressive
from specjax.checkpoints import hf
from specjax.models import decoder_only

TINY = decoder_only.SIZES["tiny"]
TINY_UNTIED = dataclasses.replace(TINY, tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6)


def _full_forward(cfg, params, tokens):
  batch, steps = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(steps), (batch, steps))
  step = jax.jit(decoder_only.make_step(cfg))
  return step(params, tokens, positions, decoder_only.init_cache(cfg, batch, steps + 1))[0]


@pytest.mark.parametrize("cfg", [TINY, TINY_UNTIED], ids=["tied", "untied"])
def test_logits_match_hugging_face_llama(cfg, tmp_path):
  import torch  # the peer; part of the test extra
  import transformers
  params = random_decoder_params(cfg, seed=1)
  hf.save(tmp_path, cfg, params)
  peer = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 11)).astype(np.int32)
  with torch.no_grad():
    expected = peer(torch.from_numpy(tokens).long()).logits.numpy()
  ours = np.asarray(_full_forward(cfg, params, jnp.asarray(tokens)))
  assert np.abs(expected).max() > 1.0  # the weights are not degenerate
  np.testing.assert_allclose(ours, expected, atol=2e-4, rtol=2e-4)


def test_safetensors_round_trip_is_exact(tmp_path):
  params = random_decoder_params(TINY_UNTIED, seed=2)
  hf.save(tmp_path, TINY_UNTIED, params)
  cfg, loaded = checkpoints.load(tmp_path)
  assert cfg == TINY_UNTIED
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, loaded)


def test_cached_steps_equal_full_forward():
  params = random_decoder_params(TINY, seed=3)
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, TINY.vocab_size, (3, 9)), jnp.int32)
  full = _full_forward(TINY, params, tokens)
  step = jax.jit(decoder_only.make_step(TINY))
  cache = decoder_only.init_cache(TINY, 3, 16)
  # Prefill 4 tokens, then 1, then a verification-sized chunk of 4: one code path for every T.
  pieces = []
  for start, stop in [(0, 4), (4, 5), (5, 9)]:
    positions = jnp.broadcast_to(jnp.arange(start, stop), (3, stop - start))
    logits, cache = step(params, tokens[:, start:stop], positions, cache)
    pieces.append(logits)
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(cache.lengths, [9, 9, 9])


def test_rollback_then_rewrite_equals_never_written():
  """Stale slots past a rolled-back length are overwritten before anything reads them."""
  params = random_decoder_params(TINY, seed=4)
  rng = np.random.RandomState(2)
  tokens = jnp.asarray(rng.randint(0, TINY.vocab_size, (1, 8)), jnp.int32)
  junk = jnp.asarray(rng.randint(0, TINY.vocab_size, (1, 3)), jnp.int32)
  step = jax.jit(decoder_only.make_step(TINY))
  cache = decoder_only.init_cache(TINY, 1, 12)
  _, cache = step(params, tokens[:, :5], jnp.arange(5)[None], cache)
  _, cache = step(params, junk, jnp.arange(5, 8)[None], cache)  # rejected draft tokens
  cache = contracts.set_lengths(cache, jnp.array([5]))
  logits, _ = step(params, tokens[:, 5:], jnp.arange(5, 8)[None], cache)
  np.testing.assert_allclose(logits, _full_forward(TINY, params, tokens)[:, 5:], atol=1e-5)


def test_mixed_prompt_lengths_decode_like_single_rows():
  params = random_decoder_params(TINY, seed=5)
  shape = autoregressive.DecodeShape(max_new_tokens=12, eos_id=None)
  generate = autoregressive.make_generate(decoder_only.model(TINY), shape)
  lengths = np.array([7, 2, 5, 4], np.int32)
  rng = np.random.RandomState(3)
  prompts = np.zeros((4, 8), np.int32)
  for row, length in enumerate(lengths):
    prompts[row, :length] = rng.randint(0, TINY.vocab_size, length)
  batched = generate(params, prompts, lengths, jax.random.PRNGKey(0), 0.0, 1.0)
  assert len({tuple(r) for r in np.asarray(batched.tokens)}) == 4  # rows really differ
  for row, length in enumerate(lengths):
    alone = generate(params, prompts[row:row + 1, :length], lengths[row:row + 1],
                     jax.random.PRNGKey(0), 0.0, 1.0)
    np.testing.assert_array_equal(batched.tokens[row], alone.tokens[0])
  # Greedy tokens agree with the argmax of a full forward over prompt + generated tokens.
  row = 1
  sequence = np.concatenate([prompts[row, :lengths[row]], np.asarray(batched.tokens[row])])
  logits = _full_forward(TINY, params, jnp.asarray(sequence[None]))
  np.testing.assert_array_equal(np.argmax(logits[0, lengths[row] - 1:-1], -1), sequence[lengths[row]:])


def test_eos_ends_each_row_and_pads_after():
  params = random_decoder_params(TINY, seed=5)
  model = decoder_only.model(TINY)
  prompts = np.array([[5, 9, 11, 3], [17, 2, 0, 0]], np.int32)
  lengths = np.array([4, 2], np.int32)
  free = autoregressive.make_generate(model, autoregressive.DecodeShape(10))(
      params, prompts, lengths, jax.random.PRNGKey(0), 0.0, 1.0)
  eos = int(free.tokens[0, 3])  # make the 4th token of row 0 the EOS
  out = autoregressive.make_generate(model, autoregressive.DecodeShape(10, eos_id=eos, pad_id=-1))(
      params, prompts, lengths, jax.random.PRNGKey(0), 0.0, 1.0)
  first_eos = [int(np.argmax(np.asarray(r) == eos)) if eos in np.asarray(r) else 10
               for r in free.tokens]
  for row in range(2):
    n = min(first_eos[row] + 1, 10)
    assert int(out.num_generated[row]) == n
    np.testing.assert_array_equal(out.tokens[row, :n], free.tokens[row, :n])
    assert np.all(np.asarray(out.tokens[row, n:]) == -1)


def test_unknown_layouts_get_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="unknown checkpoint layout.*no config.json"):
    checkpoints.load(tmp_path)
  (tmp_path / "config.json").write_text('{"model_type": "bert"}')
  with pytest.raises(ValueError, match="unknown checkpoint layout.*bert"):
    checkpoints.load(tmp_path)
  weird = tmp_path / "weights.bin"
  weird.write_bytes(b"\0")
  with pytest.raises(ValueError, match="unknown checkpoint layout"):
    checkpoints.load(weird)
  with pytest.raises(FileNotFoundError):
    checkpoints.load(tmp_path / "missing.gguf")


def test_prompt_longer_than_cache_is_refused():
  shape = autoregressive.DecodeShape(max_new_tokens=8, max_cache_length=16)
  generate = autoregressive.make_generate(
      decoder_only.model(TINY), shape)
  prompts = np.ones((1, 12), np.int32)
  with pytest.raises(ValueError, match="prompt of 12 tokens plus 9 more does not fit a cache of 16"):
    generate(random_decoder_params(TINY), prompts, np.array([12], np.int32), jax.random.PRNGKey(0),
             0.0, 1.0)
