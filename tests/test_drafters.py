"""Drafters: stated distributions, table builders, prompt lookup, rollback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import (BigramDrafter, bigram_from_step, bigram_model, bigram_table,
                      random_decoder_params)
from specjax import contracts
from specjax.decoding import core, sampling
from specjax.drafters import expansion, lookup, tables
from specjax.drafters.model import ModelDrafter
from specjax.models import decoder_only


def _transform(temperature=1.0, top_k=0, top_p=1.0):
  return functools.partial(sampling.probs_from_logits, temperature=temperature, top_k=top_k,
                           top_p=top_p)


def test_table_builders_count_text():
  text = [np.array([0, 0, 1]), np.array([2, 0])]
  unigram = tables.unigram_table(text, 3, smoothing=1.0)
  np.testing.assert_allclose(np.exp(unigram), np.array([4, 2, 2]) / 8, rtol=1e-6)
  bigram = bigram_table(text, 3, smoothing=0.5)
  # Pairs: (0,0), (0,1), (2,0); row 0 counts [1.5, 1.5, 0.5], row 1 uniform, row 2 [1.5, .5, .5].
  np.testing.assert_allclose(np.exp(bigram), [[1.5 / 3.5, 1.5 / 3.5, 0.5 / 3.5], [1 / 3] * 3,
                                              [1.5 / 2.5, 0.5 / 2.5, 0.5 / 2.5]], rtol=1e-6)
  with pytest.raises(ValueError, match="smoothing"):
    tables.unigram_table(text, 3, smoothing=0.0)


def test_bigram_from_step_is_the_models_own_bigram():
  table = np.random.RandomState(0).randn(7, 7).astype(np.float32)
  got = bigram_from_step(bigram_model(), jnp.asarray(table), 7, chunk=3)
  np.testing.assert_allclose(got, jax.nn.log_softmax(table), atol=1e-6)


@pytest.mark.parametrize("transform", [dict(), dict(temperature=0.5, top_k=2),
                                       dict(temperature=1.5, top_p=0.6), dict(temperature=0.0)])
def test_table_drafters_apply_the_target_transform(transform):
  rng = np.random.RandomState(1)
  unigram, bigram = rng.randn(5).astype(np.float32), rng.randn(5, 5).astype(np.float32)
  tokens, positions = jnp.array([[1, 3], [0, 2]]), jnp.array([[4, 5], [1, 2]])
  fn = _transform(**transform)
  probs, state = tables.UnigramDrafter().propose(unigram, None, tokens, positions, fn)
  np.testing.assert_allclose(probs, np.broadcast_to(fn(unigram), (2, 5)), atol=1e-7)
  probs, state = BigramDrafter().propose(bigram, None, tokens, positions, fn)
  np.testing.assert_allclose(probs, fn(bigram[np.array([3, 2])]), atol=1e-7)
  assert state is None and BigramDrafter().rollback(None, jnp.zeros(2)) is None


def test_drafts_are_drawn_from_the_returned_probs():
  """20k rows through a sampled chain of 3 (expansion.SampledChain.draft) with a bigram drafter
  under top-k: position 1's tokens vs draft_probs_1, and position 2's given position 1 (chi-square
  p < 1e-6 fails; three tests, false failure rate < 3e-6 over seeds)."""
  rows, vocab = 20_000, 5
  table = jnp.asarray(np.random.RandomState(2).randn(vocab, vocab).astype(np.float32))
  fn = _transform(temperature=0.8, top_k=4)
  # The root (token 3) at position 1, after token 0 at position 0.
  history = jnp.tile(jnp.array([[0, 3]], jnp.int32), (rows, 1))
  position = jnp.ones((rows,), jnp.int32)
  uniforms = jax.random.uniform(jax.random.PRNGKey(0), (rows, 3))
  chain = expansion.SampledChain(BigramDrafter(), gamma=3)
  proposal, _ = jax.jit(lambda table, history, position, uniforms: chain.draft(
      table, None, contracts.DraftContext(history, position), uniforms, fn))(
          table, history, position, uniforms)
  tokens, probs = np.asarray(proposal.tokens), np.asarray(proposal.draft_probs, np.float64)
  np.testing.assert_allclose(probs[:, 1], np.asarray(fn(table))[tokens[:, 0]], atol=1e-7)
  first = probs[0, 0]
  counts = np.bincount(tokens[:, 0], minlength=vocab)
  assert counts[first == 0].sum() == 0  # top-k removed one token; it is never drafted
  assert stats.chisquare(counts[first > 0], first[first > 0] * rows).pvalue > 1e-6
  for given in range(2):
    rows_given = tokens[:, 0] == given
    law = probs[rows_given][0, 1]
    counts = np.bincount(tokens[rows_given, 1], minlength=vocab)
    assert stats.chisquare(counts[law > 0], law[law > 0] / law[law > 0].sum()
                           * rows_given.sum()).pvalue > 1e-6


def test_lookup_finds_latest_longest_match():
  history = jnp.array([
      [5, 6, 7, 8, 5, 6, -1, -1],   # last two [5, 6] seen at 0..1 -> 7
      [1, 2, 9, 1, 2, 4, 1, 2],     # [1, 2] seen twice; the latest (3..4) wins -> 4
      [3, 1, 4, 1, 5, -1, -1, -1],  # [1, 5] and [5] unseen -> no match
      [7, 3, 4, 9, 3, 5, 7, 3],     # [5, 7, 3] unseen; [7, 3] at 0..1 -> 4 beats the later [3] -> 5
  ], jnp.int32)
  pos = jnp.array([5, 7, 4, 7])
  proposal, found = lookup.lookup(history, pos, max_ngram=3)
  assert np.asarray(found).tolist() == [True, True, False, True]
  assert np.asarray(proposal)[[0, 1, 3]].tolist() == [7, 4, 4]
  # Tokens after pos are stale (rolled back) and never matched.
  stale = history.at[2, 5:].set(jnp.array([1, 5, 9]))
  assert not bool(lookup.lookup(stale, pos, max_ngram=2)[1][2])
  # A longer n-gram overrides the latest shorter one: [2, 3] -> 8 beats [3] -> 5.
  proposal, _ = lookup.lookup(jnp.array([[2, 3, 8, 0, 3, 5, 2, 3]]), jnp.array([7]), 2)
  assert int(proposal[0]) == 8


def test_prompt_lookup_drafter_one_hot_and_fallback():
  drafter = lookup.PromptLookupDrafter(vocab_size=10, max_ngram=2)
  prompt = jnp.array([[4, 5, 6, 7, 4, 0], [1, 2, 3, 0, 0, 0]], jnp.int32)
  state = drafter.init(None, prompt, jnp.array([5, 3]), max_length=12)
  fn = _transform(0.7)
  # Row 0: feeding [4, 5] at [4, 5] makes the history end 4, 5 -> propose 6. Row 1 has no match.
  probs, state = drafter.propose(None, state, jnp.array([[4, 5], [3, 8]]), jnp.array([[4, 5], [2, 3]]),
                                 fn)
  np.testing.assert_array_equal(probs[0], np.eye(10)[6])
  np.testing.assert_allclose(probs[1], np.full(10, 0.1), atol=1e-7)  # uniform fallback
  fallback = jnp.asarray(np.random.RandomState(0).randn(10).astype(np.float32))
  probs, _ = drafter.propose(fallback, state, jnp.array([[6], [9]]), jnp.array([[6], [4]]), fn)
  np.testing.assert_array_equal(probs[0], np.eye(10)[7])  # the chain continues: 4 5 6 -> 7
  np.testing.assert_allclose(probs[1], fn(fallback), atol=1e-7)
  assert np.asarray(state.lengths).tolist() == [6, 4]
  assert np.asarray(drafter.rollback(state, jnp.array([2, 2])).lengths).tolist() == [2, 2]
  with pytest.raises(ValueError, match="ngram"):
    lookup.PromptLookupDrafter(10, max_ngram=1, min_ngram=2)


def test_prompt_lookup_in_the_loop_accepts_a_repeated_pattern():
  # A deterministic target that cycles 0 -> 1 -> ... -> 5 -> 0; the prompt shows the cycle once, so
  # every lookup proposal is right and every drafted token is accepted.
  vocab, gamma = 6, 3
  cycle = np.where(np.eye(vocab)[np.roll(np.arange(vocab), -1)] > 0, 0.0, -30.0).astype(np.float32)
  fn = core.make_decode(bigram_model(),
                        expansion.SampledChain(lookup.PromptLookupDrafter(vocab), gamma),
                        core.DecodeConfig(max_new_tokens=13))
  out = fn(jnp.asarray(cycle), None, jnp.array([[0, 1, 2, 3, 4, 5, 0]]), jnp.array([7]),
           jax.random.PRNGKey(0), 1.0)
  assert np.asarray(out.tokens[0]).tolist() == [(1 + i) % vocab for i in range(13)]
  n = np.asarray(out.stats.num_accepted[0])
  assert np.all(n[n >= 0] == gamma) and int(out.target_calls) == 3


def test_model_drafter_rollback_matches_a_fresh_forward():
  """Draft, roll back past some drafts, draft again: the probabilities equal a cache-free forward of
  the committed sequence (stale slots never leak)."""
  config = decoder_only.DecoderConfig(vocab_size=32, embed_dim=32, num_layers=2, num_heads=2,
                                      num_kv_heads=1, head_dim=16, mlp_dim=64)
  params = random_decoder_params(config, seed=3)
  step = decoder_only.make_step(config)
  init_cache = functools.partial(decoder_only.init_cache, config)
  drafter = ModelDrafter(decoder_only.model(config))
  fn = _transform(1.0)
  prompt = jnp.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0]], jnp.int32)
  lengths = jnp.array([5, 3])
  rows = jnp.arange(2)

  @jax.jit
  def drafted_then_redrafted(params):
    state = drafter.rollback(drafter.init(params, prompt, lengths, 12), lengths - 1)
    last = prompt[rows, lengths - 1]
    _, state = drafter.propose(params, state, jnp.stack([last, jnp.full(2, 7)], 1),
                               jnp.stack([lengths - 1, lengths], 1), fn)  # draft a after 7
    for i, token in enumerate([11, 12]):  # two drafts that will be rejected
      _, state = drafter.propose(params, state, jnp.full((2, 1), token), (lengths + 1 + i)[:, None],
                                 fn)
    # Only 7 was accepted and 20 is the correction at lengths + 1: roll back and re-feed [7, 20].
    state = drafter.rollback(state, lengths)
    probs, state = drafter.propose(params, state, jnp.stack([jnp.full(2, 7), jnp.full(2, 20)], 1),
                                   jnp.stack([lengths, lengths + 1], 1), fn)
    return probs, state

  probs, state = drafted_then_redrafted(params)
  assert np.asarray(state.cache.lengths).tolist() == [7, 5]
  # Right-padded committed sequences; causal attention makes row 1's padding irrelevant.
  sequences = jnp.array([[3, 1, 4, 1, 5, 7, 20], [9, 2, 6, 7, 20, 0, 0]], jnp.int32)
  logits, _ = jax.jit(step)(params, sequences, jnp.broadcast_to(jnp.arange(7), (2, 7)),
                            init_cache(2, 7))
  np.testing.assert_allclose(probs, fn(logits[rows, lengths + 1]), atol=1e-5)
