"""Drafters for large vocabularies: the sparse top-K bigram and the truncated-layer (early-exit)
draft."""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import BigramDrafter, bigram_table, random_decoder_params
from specjax.decoding import autoregressive, core, sampling
from specjax.drafters import expansion, tables
from specjax.drafters.model import ModelDrafter
from specjax.contracts import StepModel
from specjax.models import decoder_only


def _transform(temperature=1.0, top_k=0, top_p=1.0):
  return functools.partial(sampling.probs_from_logits, temperature=temperature, top_k=top_k,
                           top_p=top_p)


def _random_text(vocab, seed, sequences=6, length=40):
  rng = np.random.RandomState(seed)
  # A skewed law, so some continuations are frequent and rows have ties and zeros.
  law = rng.dirichlet(np.full(vocab, 0.3))
  return [rng.choice(vocab, size=rng.randint(1, length), p=law) for _ in range(sequences)]


# ---------------------------------------------------------------------------------------------------
# Sparse bigram: the builder and the proposal.


def test_sparse_bigram_counts_by_hand():
  # Pairs: (0,1) x2, (0,2) x1, (0,3) x1, (1,0) x1, (2,0) x1; token 3 is never followed.
  text = [np.array([0, 1, 0, 2, 0]), np.array([0, 1]), np.array([0, 3])]
  table = tables.sparse_bigram(text, 4, top_k=2, concentration=2.0, smoothing=1.0)
  # Row 0 keeps 1 (count 2) and, of the tied 2 and 3, the lower id 2; 3's count goes to the tail.
  assert np.asarray(table.next_ids[0]).tolist() == [1, 2]
  assert np.asarray(table.next_counts[0]).tolist() == [2.0, 1.0]
  assert np.asarray(table.tail_counts).tolist() == [1.0, 0.0, 0.0, 0.0]
  assert np.asarray(table.next_counts[3]).tolist() == [0.0, 0.0]
  unigram = np.array([6, 3, 2, 2]) / 13.0  # counts 5, 2, 1, 1 plus smoothing 1
  np.testing.assert_allclose(np.exp(table.backoff), unigram, rtol=1e-6)
  probs = np.asarray(tables.sparse_bigram_probs(table, jnp.array([0, 1, 3])))
  # Row 0: n = 4 (tail included), s = 2; the tail count 1 goes to token 3, the only one not kept
  # besides 0, spread like the unigram over {0, 3}.
  tail = np.array([1, 0, 0, 1]) * unigram / (unigram[0] + unigram[3])
  np.testing.assert_allclose(probs[0], (np.array([0, 2, 1, 0]) + 2 * unigram + tail) / 6, rtol=1e-6)
  np.testing.assert_allclose(probs[1], (np.array([1, 0, 0, 0]) + 2 * unigram) / 3, rtol=1e-6)
  np.testing.assert_allclose(probs[2], unigram, rtol=1e-6)  # unseen previous token: the backoff
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_truncation_keeps_the_top_probabilities_of_the_full_estimate():
  vocab, text = 9, _random_text(9, seed=1)
  full = tables.sparse_bigram(text, vocab, top_k=vocab, concentration=1.5)
  cut = tables.sparse_bigram(text, vocab, top_k=3, concentration=1.5)
  previous = jnp.arange(vocab)
  full_probs = np.asarray(tables.sparse_bigram_probs(full, previous))
  cut_probs = np.asarray(tables.sparse_bigram_probs(cut, previous))
  for a in range(vocab):
    kept = np.asarray(cut.next_ids[a])[np.asarray(cut.next_counts[a]) > 0]
    np.testing.assert_allclose(cut_probs[a, kept], full_probs[a, kept], rtol=1e-5)
  np.testing.assert_allclose(cut_probs.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("transform", [dict(), dict(temperature=0.6, top_k=3),
                                       dict(temperature=1.4, top_p=0.7), dict(temperature=0.0)])
def test_sparse_with_k_equal_v_is_the_dense_bigram(transform):
  """K = V, a uniform backoff and s = V * smoothing give the dense add-smoothing table exactly, and
  the drafter proposes what BigramDrafter proposes under every transform."""
  vocab, smoothing = 11, 0.5
  text = _random_text(vocab, seed=2)
  dense = bigram_table(text, vocab, smoothing)
  sparse = tables.sparse_bigram(text, vocab, top_k=vocab, concentration=vocab * smoothing)
  sparse = sparse.replace(backoff=np.full(vocab, -np.log(vocab), np.float32))
  np.testing.assert_allclose(tables.sparse_bigram_probs(sparse, jnp.arange(vocab)), np.exp(dense),
                             rtol=1e-5)
  tokens, positions = jnp.array([[1, 3], [0, 7], [5, 5]]), jnp.array([[4, 5], [1, 2], [0, 1]])
  fn = _transform(**transform)
  got, state = tables.SparseBigramDrafter().propose(sparse, None, tokens, positions, fn)
  want, _ = BigramDrafter().propose(jnp.asarray(dense), None, tokens, positions, fn)
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert state is None and tables.SparseBigramDrafter().rollback(None, jnp.zeros(3)) is None


def test_sparse_bigram_bad_input():
  text = [np.array([0, 1, 2])]
  with pytest.raises(ValueError, match="top_k"):
    tables.sparse_bigram(text, 3, top_k=0)
  assert tables.sparse_bigram(text, 3, top_k=4).next_ids.shape == (3, 3)  # at most V kept
  with pytest.raises(ValueError, match="concentration"):
    tables.sparse_bigram(text, 3, concentration=0.0)
  with pytest.raises(ValueError, match="token ids"):
    tables.sparse_bigram([np.array([0, 3])], 3)


def test_sparse_bigram_is_lossless_in_the_loop():
  """4000 rows on a bigram table target at temperature 1 with a K = 2 sparse draft of another law:
  each output position's token counts vs the exact target-only law, chi-square p < 1e-6 fails (four
  positions: false-failure rate < 4e-6 over seeds)."""
  rows, vocab = 4000, 6
  target = (2.0 * np.random.RandomState(3).randn(vocab, vocab)).astype(np.float32)
  draft = tables.sparse_bigram(_random_text(vocab, seed=4, sequences=20), vocab, top_k=2)

  @flax.struct.dataclass
  class LengthsCache:
    lengths: jax.Array

  step = lambda table, tokens, positions, cache: (table[tokens],
                                                  cache.replace(lengths=positions[:, -1] + 1))
  init = lambda batch, length: LengthsCache(jnp.zeros((batch,), jnp.int32))
  out = core.make_decode(StepModel(step, init),
                         expansion.SampledChain(tables.SparseBigramDrafter(), 3),
                         core.DecodeConfig(max_new_tokens=4))(
      jnp.asarray(target), draft, jnp.full((rows, 1), 2, jnp.int32), jnp.ones((rows,), jnp.int32),
      jax.random.PRNGKey(0), 1.0)
  chain = np.asarray(jax.nn.softmax(target), np.float64)
  law = chain[2]
  for position in range(4):
    counts = np.bincount(np.asarray(out.tokens[:, position]), minlength=vocab)
    assert stats.chisquare(counts, law / law.sum() * rows).pvalue > 1e-6, position
    law = law @ chain
  n = np.asarray(out.stats.num_accepted)
  assert 0 < n[n >= 0].mean() < 3  # some drafts accepted, some rejected: both paths ran


# ---------------------------------------------------------------------------------------------------
# Truncated-layer draft, and both drafters at temperature 0 against target greedy.

CONFIG = decoder_only.DecoderConfig(vocab_size=96, embed_dim=32, num_layers=3, num_heads=2,
                                    num_kv_heads=1, head_dim=16, mlp_dim=64)


def _logits(config, params, tokens):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return decoder_only.make_step(config)(params, tokens, positions,
                                        decoder_only.init_cache(config, *tokens.shape))[0]


def test_truncate_layers_is_the_model_with_later_blocks_removed():
  """Oracle: zeroing a block's two output projections (attention wo, MLP w_down) makes it the
  identity on the residual stream, so the full model with blocks >= k zeroed equals the k-block cut."""
  params = random_decoder_params(CONFIG, seed=5)
  tokens = jnp.asarray(np.random.RandomState(5).randint(0, 96, (2, 6)), jnp.int32)
  config, cut = decoder_only.truncate_layers(CONFIG, params, 1)
  assert config.num_layers == 1 and sorted(cut) == ["embedding", "final_norm", "layers_0"]
  assert cut["embedding"] is params["embedding"]  # shared, not copied
  silenced = jax.tree_util.tree_map(lambda x: x, params)
  for i in (1, 2):
    silenced[f"layers_{i}"]["attn"]["wo"] = np.zeros_like(params[f"layers_{i}"]["attn"]["wo"])
    silenced[f"layers_{i}"]["mlp"]["w_down"] = np.zeros_like(params[f"layers_{i}"]["mlp"]["w_down"])
  np.testing.assert_allclose(_logits(config, cut, tokens), _logits(CONFIG, silenced, tokens),
                             atol=1e-5)
  same_config, same = decoder_only.truncate_layers(CONFIG, params, 3)
  assert same_config == CONFIG and sorted(same) == sorted(params)
  for bad in (0, 4, 1.5):
    with pytest.raises(ValueError, match="num_layers"):
      decoder_only.truncate_layers(CONFIG, params, bad)


@functools.lru_cache(maxsize=None)
def _greedy_setup():
  """Target params, step, cache init, a ragged batch of 3 prompts and its target-only greedy output."""
  params = random_decoder_params(CONFIG, seed=6)
  step = decoder_only.make_step(CONFIG)
  init_cache = functools.partial(decoder_only.init_cache, CONFIG)
  prompt_tokens = jnp.asarray(np.random.RandomState(6).randint(0, 96, (3, 6)), jnp.int32)
  prompt_lengths = jnp.array([6, 2, 4], jnp.int32)
  expected = autoregressive.make_generate(StepModel(step, init_cache), autoregressive.DecodeShape(16))(
      params, prompt_tokens, prompt_lengths, jax.random.PRNGKey(0), 0.0)
  return params, step, init_cache, prompt_tokens, prompt_lengths, expected


@pytest.mark.parametrize("kind", ["sparse bigram", "truncated"])
def test_greedy_with_large_vocab_drafters_equals_target_greedy(kind):
  params, step, init_cache, prompt_tokens, prompt_lengths, expected = _greedy_setup()
  if kind == "sparse bigram":
    # Counted on the target's own greedy text, so some drafts are accepted and some are not.
    text = [np.asarray(row) for row in expected.tokens] + _random_text(96, seed=7)
    drafter, draft_params = tables.SparseBigramDrafter(), tables.sparse_bigram(text, 96, top_k=4)
  else:
    draft_config, draft_params = decoder_only.truncate_layers(CONFIG, params, 1)
    drafter = ModelDrafter(decoder_only.model(draft_config))
  out = core.make_decode(
      StepModel(step, init_cache), expansion.SampledChain(drafter, 3),
      core.DecodeConfig(max_new_tokens=16))(
          params, draft_params, prompt_tokens, prompt_lengths, jax.random.PRNGKey(1), 0.0)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  n = np.asarray(out.stats.num_accepted)
  if kind == "sparse bigram":
    assert n[n >= 0].max() > 0
