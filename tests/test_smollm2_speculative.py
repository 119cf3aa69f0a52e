"""Speculative greedy decoding with the real SmolLM2-135M target equals its target-only greedy output,
for prompt lookup and the large-vocabulary drafters: one batch, its target-only output computed once."""

import functools

import jax
import numpy as np
import pytest

from specjax.decoding import autoregressive, core
from specjax.drafters import expansion, lookup, tables
from specjax.drafters.model import ModelDrafter
from specjax.data import prompts
from specjax.contracts import StepModel
from specjax.models import decoder_only

pytestmark = pytest.mark.slow

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def batch_and_expected(smollm2):
  """Three real held-out prompts of mixed lengths (code, translation, news) in one right-padded batch,
  and the target-only greedy continuation of each."""
  config, params, tok = smollm2
  texts = (list(prompts.load_prompt_set("humaneval", "heldout", limit=2).prompts)
           + list(prompts.load_prompt_set("ende", "heldout", limit=1).prompts))
  ids = [tok.encode(text) for text in texts]
  assert len({len(i) for i in ids}) == len(ids)  # really ragged
  tokens, lengths = prompts.make_batch(ids, tok.pad_id, bucket=32)
  step = decoder_only.make_step(config)
  init_cache = functools.partial(decoder_only.init_cache, config)
  expected = autoregressive.make_generate(StepModel(step, init_cache), autoregressive.DecodeShape(
      NEW_TOKENS, eos_id=tok.eos_id, pad_id=tok.pad_id))(
          params, tokens, lengths, jax.random.PRNGKey(0), 0.0)
  return tokens, lengths, expected


def _drafter(kind, config, params, tok):
  if kind == "prompt lookup":
    return lookup.PromptLookupDrafter(config.vocab_size), None
  if kind == "sparse bigram":
    train = prompts.load_prompt_set("humaneval", "train")
    text = [tok.encode(p + r) for p, r in zip(train.prompts, train.references)]
    return tables.SparseBigramDrafter(), tables.sparse_bigram(text, config.vocab_size, top_k=32)
  draft_config, draft_params = decoder_only.truncate_layers(config, params, 2)
  return ModelDrafter(decoder_only.model(draft_config)), draft_params


@pytest.mark.parametrize("kind", ["prompt lookup", "sparse bigram", "truncated 2 layers"])
def test_greedy_equals_target_greedy(smollm2, batch_and_expected, kind):
  config, params, tok = smollm2
  tokens, lengths, expected = batch_and_expected
  drafter, draft_params = _drafter(kind, config, params, tok)
  out = core.make_decode(
      decoder_only.model(config), expansion.SampledChain(drafter, 3),
      core.DecodeConfig(max_new_tokens=NEW_TOKENS, eos_id=tok.eos_id, pad_id=tok.pad_id))(
          params, draft_params, tokens, lengths, jax.random.PRNGKey(0), 0.0)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_generated, expected.num_generated)
  n = np.asarray(out.stats.num_accepted)
  print(kind, "mean accepted per iteration", n[n >= 0].mean(), "iterations", int(out.target_calls))
