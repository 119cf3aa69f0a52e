"""Encoder-decoder decoding in both loops: T5 greedy generation == transformers' generate; speculative
T5 at temperature 0 == target greedy for any draft; the emitted distribution == the target's on an
encoder-decoder table model, for the chain loop and the token-tree loop; clear errors for mixed
families and vocabularies. (T5 under tree attention and greedy tree decoding: tests/test_trees.py.)"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import (BigramDrafter, LengthsCache, bigram_model, ragged_source, random_t5_params,
                      run_check_on_8_devices)
from specjax import contracts
from specjax.decoding import autoregressive, core, sampling
from specjax.decoding.tree import Tree
from specjax.drafters import expansion, lookup, tables
from specjax.drafters.model import ModelDrafter
from specjax.checkpoints import hf_t5
from specjax.models import decoder_only, t5

TARGET = t5.SIZES["tiny"]
DRAFT = t5.T5Config(vocab_size=128, embed_dim=16, num_encoder_layers=1, num_decoder_layers=1,
                    num_heads=2, head_dim=8, mlp_dim=32)
NEW_TOKENS = 16
LENGTHS = (20, 9, 14, 5)  # ragged sources, right-padded with 0


def _source(batch):
  tokens, lengths = ragged_source(TARGET, LENGTHS[:batch], seed=3)
  return contracts.Source(jnp.asarray(tokens), jnp.asarray(lengths))


def _prompt(batch):
  return t5.decoder_prompt(TARGET, batch)


@functools.lru_cache(maxsize=None)
def _target_params():
  return random_t5_params(TARGET, seed=4)


@functools.lru_cache(maxsize=None)
def _eos():
  """An EOS that row 0's free greedy run emits mid-way, so rows end at different points."""
  free = autoregressive.make_generate(t5.model(TARGET), autoregressive.DecodeShape(NEW_TOKENS))(
      _target_params(), *_prompt(4), jax.random.PRNGKey(0), 0.0, 1.0, _source(4))
  return int(free.tokens[0, 6])


@functools.lru_cache(maxsize=None)
def _target_greedy(batch):
  return autoregressive.make_generate(t5.model(TARGET), autoregressive.DecodeShape(
      NEW_TOKENS, eos_id=_eos(), pad_id=0))(_target_params(), *_prompt(batch),
                                             jax.random.PRNGKey(0), 0.0, 1.0, _source(batch))


@pytest.mark.parametrize("cfg", [t5.SIZES["tiny-1.0"], t5.SIZES["tiny"]], ids=["t5-1.0", "t5-1.1"])
def test_greedy_generation_equals_transformers_generate(cfg, tmp_path):
  import torch
  import transformers
  params = random_t5_params(cfg, seed=5)
  hf_t5.save(tmp_path, cfg, params)
  peer = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
  tokens, lengths = ragged_source(cfg, (20, 9, 14), seed=6)
  eos = 7  # a frequent token of these weights' greedy output, so some rows stop early
  out = autoregressive.make_generate(t5.model(cfg), autoregressive.DecodeShape(
      NEW_TOKENS, eos_id=eos, pad_id=0))(params, *t5.decoder_prompt(cfg, 3),
                                         jax.random.PRNGKey(0), 0.0, 1.0,
                                         contracts.Source(tokens, lengths))
  mask = (np.arange(tokens.shape[1]) < lengths[:, None]).astype(np.int64)
  with torch.no_grad():
    theirs = peer.eval().generate(
        input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask),
        do_sample=False, max_new_tokens=NEW_TOKENS, decoder_start_token_id=0, eos_token_id=eos,
        pad_token_id=0).numpy()[:, 1:]  # drop the decoder start token
  theirs = np.pad(theirs, ((0, 0), (0, NEW_TOKENS - theirs.shape[1])))
  np.testing.assert_array_equal(np.asarray(out.tokens), theirs)
  assert len({tuple(row) for row in theirs}) == 3  # the rows really differ


def _greedy_drafter(kind):
  """(a one-token step, its params) of the named kind."""
  if kind == "random T5":
    return ModelDrafter(t5.model(DRAFT)), random_t5_params(DRAFT, seed=7)
  if kind == "identical T5":
    return ModelDrafter(t5.model(TARGET)), _target_params()
  if kind == "bigram":
    table = np.random.RandomState(8).randn(128, 128).astype(np.float32)
    return BigramDrafter(), jnp.asarray(table)
  if kind == "unigram":
    return tables.UnigramDrafter(), jnp.asarray(np.random.RandomState(9).randn(128), jnp.float32)
  if kind == "lookup over the source":
    return lookup.PromptLookupDrafter(128, max_ngram=2), None
  inner, params = _greedy_drafter("random T5")
  return lookup.TokenLookupFront(inner, lookup.PromptLookupDrafter(128, 2, 1)), params


@pytest.mark.parametrize("batch", [4, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["random T5", "identical T5", "bigram", "unigram",
                                  "lookup over the source", "lookup then random T5"])
def test_speculative_greedy_equals_target_greedy(kind, batch):
  step, draft_params = _greedy_drafter(kind)
  gamma = 3
  config = core.DecodeConfig(max_new_tokens=NEW_TOKENS, eos_id=_eos(), pad_id=0)
  out = core.make_decode(t5.model(TARGET), expansion.SampledChain(step, gamma), config)(
      _target_params(), draft_params, *_prompt(batch), jax.random.PRNGKey(2), 0.0,
      source=_source(batch))
  expected = _target_greedy(batch)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_generated, expected.num_generated)
  if batch == 4:  # EOS ended row 0 early while another row ran to max_new_tokens
    assert int(out.num_generated[0]) < NEW_TOKENS <= int(out.num_generated.max())
  n = np.asarray(out.stats.num_accepted)
  if kind == "identical T5":
    assert np.all(n[n >= 0] == gamma)


def test_prompt_lookup_finds_the_source():
  """The decoder's last tokens matched inside the source propose what followed them there."""
  drafter = lookup.PromptLookupDrafter(vocab_size=50, max_ngram=2)
  source = contracts.Source(jnp.array([[7, 8, 9, 10, 1, 0], [3, 4, 1, 0, 0, 0]], jnp.int32),
                            jnp.array([5, 3]))
  state = drafter.init(None, *t5.decoder_prompt(TARGET, 2), max_length=8, source=source)
  # Row 0 decodes [start, 8, 9]: "8 9" is in the source, followed by 10. Row 1 decodes
  # [start, 5, 6], found nowhere (the source's padding never matches): the uniform fallback.
  probs, state = drafter.propose(None, state, jnp.array([[8, 9], [5, 6]]),
                                 jnp.array([[1, 2], [1, 2]]),
                                 functools.partial(sampling.probs_from_logits, temperature=1.0))
  np.testing.assert_array_equal(probs[0], np.eye(50)[10])
  np.testing.assert_allclose(probs[1], np.full(50, 1 / 50), atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# Losslessness on an encoder-decoder table model: the next token's logits are table[c, previous
# token], where c is the source's first token, so every row's output is a Markov chain whose law is
# known exactly. The draft is another such model (encoding the source itself), or prompt lookup.

ROWS, VOCAB = 4000, 6


@flax.struct.dataclass
class Condition:
  first: jax.Array  # [B] the source's first token


class ConditionalBigram:
  """An encoder-decoder table model: params [V, V, V] logits, table[condition, previous token]."""
  encoder_decoder = True

  def encode(self, params, source):
    contracts.check_source(self, source)
    return Condition(source.tokens[:, 0])

  def decode_step(self, params, context, tokens, positions, cache):
    return params[context.first[:, None], tokens], cache.replace(lengths=positions[:, -1] + 1)

  def init_cache(self, batch, max_length):
    return LengthsCache(jnp.zeros((batch,), jnp.int32))

  # Verifying trees too (decoding/tree.py): a node's logits depend on its own token and the source
  # only; the lengths-only cache has nothing to compact. It has no hidden states to hand a drafter.
  def forward(self, params, context, tokens, positions, cache, slots=None, visible=None,
              features=None):
    if features is not None:
      raise ValueError("the conditional bigram has no hidden states")
    logits, cache = self.decode_step(params, context, tokens,
                                     positions if slots is None else slots, cache)
    return logits, None, cache

  def move_cache(self, cache, source_slots, dest_slots):
    return cache


@functools.lru_cache(maxsize=None)
def _stat_fn(kind, top_k):
  step = (lookup.PromptLookupDrafter(VOCAB, 2, 1) if kind == "lookup over the source"
          else ModelDrafter(ConditionalBigram()))
  return core.make_decode(ConditionalBigram(), expansion.SampledChain(step, 3),
                          core.DecodeConfig(max_new_tokens=5, top_k=top_k))


def _laws(table, condition, temperature, top_k, top_p, steps):
  chain = np.asarray(sampling.probs_from_logits(jnp.asarray(table[condition]), temperature, top_k,
                                                top_p), np.float64)
  law, laws = chain[0], []  # the decoder starts from token 0
  for _ in range(steps):
    laws.append(law)
    law = law @ chain
  return laws


CASES = [("T5-style draft", dict(temperature=1.0)), ("T5-style draft", dict(temperature=0.7,
                                                                              top_p=0.8)),
         ("T5-style draft", dict(temperature=1.2, top_k=3)), ("lookup over the source", {})]


def _run_and_check_laws(decode, kind, transform, seed):
  """Decode ROWS sources (condition 1 or 2 first) with random target / draft tables and compare, per
  condition and output position, the counts with the exact target-only law: chi-square p < 1e-6
  fails, and total variation < 0.08 (sd ~0.007 at 2000 rows per condition). Returns the output."""
  rng = np.random.RandomState(seed)
  target = (2.0 * rng.randn(VOCAB, VOCAB, VOCAB)).astype(np.float32)
  draft = (2.0 * rng.randn(VOCAB, VOCAB, VOCAB)).astype(np.float32)
  temperature, top_k = transform.get("temperature", 1.0), transform.get("top_k", 0)
  top_p = transform.get("top_p", 1.0)
  # Sources: condition 1 or 2 first, then tokens the lookup drafter may copy from.
  conditions = np.repeat([1, 2], ROWS // 2)
  source = np.concatenate([conditions[:, None], rng.randint(0, VOCAB, (ROWS, 5))], 1)
  out = decode(jnp.asarray(target), None if kind.startswith("lookup") else jnp.asarray(draft),
               jnp.zeros((ROWS, 1), jnp.int32), jnp.ones((ROWS,), jnp.int32),
               jax.random.PRNGKey(0), temperature, top_p,
               contracts.Source(jnp.asarray(source, jnp.int32), jnp.full((ROWS,), 6, jnp.int32)))
  tokens = np.asarray(out.tokens)
  for condition in (1, 2):
    rows = tokens[conditions == condition]
    for position, law in enumerate(_laws(target, condition, temperature, top_k, top_p, 5)):
      counts = np.bincount(rows[:, position], minlength=VOCAB)
      support = law > 1e-9
      assert counts[~support].sum() == 0
      if support.sum() > 1:
        assert stats.chisquare(counts[support], law[support] / law[support].sum()
                               * len(rows)).pvalue > 1e-6, (condition, position)
      assert 0.5 * np.abs(counts / len(rows) - law).sum() < 0.08
  return out


@pytest.mark.parametrize("kind,transform", CASES)
def test_emitted_distribution_equals_target(kind, transform):
  """The chain loop (2 conditions x 5 positions x 4 cases: false-failure rate < 4e-5 over seeds)."""
  decode = lambda *args: _stat_fn(kind, transform.get("top_k", 0))(*args[:-1], 1.0, args[-1])
  out = _run_and_check_laws(decode, kind, transform, CASES.index((kind, transform)))
  n = np.asarray(out.stats.num_accepted)
  assert 0 < n[n >= 0].mean() < 3  # both accepts and rejects happened


TREE_CASES = [("T5-style draft", "spine:3x2", dict(temperature=1.0)),
              ("lookup over the source", "full:2,2", dict(temperature=0.7, top_p=0.8))]


@pytest.mark.parametrize("kind,tree_name,transform", TREE_CASES)
def test_tree_emitted_distribution_equals_target(kind, tree_name, transform):
  """The token-tree loop on the encoder-decoder table model, its tree from the draft's top-k (2
  conditions x 5 positions x 2 cases: false-failure rate < 2e-5 over seeds)."""
  step = (lookup.PromptLookupDrafter(VOCAB, 2, 1) if kind.startswith("lookup")
          else ModelDrafter(ConditionalBigram()))
  decode = core.make_decode(ConditionalBigram(), expansion.TopK(step, Tree.from_name(tree_name)),
                            core.DecodeConfig(5))
  run = lambda *args: decode(*args[:-1], source=args[-1])
  out = _run_and_check_laws(run, kind, transform, 10 + TREE_CASES.index((kind, tree_name, transform)))
  n = np.asarray(out.stats.num_accepted)
  assert 0 < n[n >= 0].mean() < Tree.from_name(tree_name).depth  # accepts and misses


def test_sharded_equals_unsharded():
  out = run_check_on_8_devices("sharded_t5_check.py")
  assert out.count("same tokens") == 6, out


def test_mixed_families_and_vocabularies_are_refused():
  config = core.DecodeConfig(max_new_tokens=4)
  chain = lambda step: expansion.SampledChain(step, 2)
  llama = decoder_only.SIZES["tiny"]
  with pytest.raises(ValueError, match="draft is a decoder-only model but the target is an "
                                       "encoder-decoder"):
    core.make_decode(t5.model(TARGET), chain(ModelDrafter(decoder_only.model(llama))), config)
  with pytest.raises(ValueError, match="draft is an encoder-decoder model but the target is a "
                                       "decoder-only"):
    core.make_decode(bigram_model(), chain(ModelDrafter(t5.model(TARGET))), config)
  with pytest.raises(ValueError, match="draft is an encoder-decoder"):  # behind prompt lookup too
    core.make_decode(
        bigram_model(), chain(lookup.TokenLookupFront(ModelDrafter(t5.model(TARGET)),
                                                      lookup.PromptLookupDrafter(128))), config)
  wide = t5.T5Config(vocab_size=256, embed_dim=16, num_encoder_layers=1, num_decoder_layers=1,
                     num_heads=2, head_dim=8, mlp_dim=32)
  fn = core.make_decode(t5.model(TARGET), chain(ModelDrafter(t5.model(wide))), config)
  with pytest.raises(ValueError, match="target has 128 tokens, the drafter 256"):
    fn(_target_params(), random_t5_params(wide), *_prompt(1), jax.random.PRNGKey(0),
       source=_source(1))
  with pytest.raises(ValueError, match="needs its encoder input"):
    autoregressive.make_generate(t5.model(TARGET), autoregressive.DecodeShape(4))(
        _target_params(), *_prompt(1), jax.random.PRNGKey(0), 0.0, 1.0)
  with pytest.raises(ValueError, match="takes no encoder input"):
    autoregressive.make_generate(bigram_model(), autoregressive.DecodeShape(4))(
        jnp.zeros((8, 8)), jnp.ones((1, 2), jnp.int32), jnp.array([2]), jax.random.PRNGKey(0),
        0.0, 1.0, _source(1))
