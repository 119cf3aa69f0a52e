"""Decoding in bfloat16 (specs.ModelSpec.dtype): lossless within the dtype, on XLA's kernels and on
specjax's CPU kernels (specs.ModelSpec.kernels = "cpu", models/cpu_kernels.py; tests/test_cpu_kernels.py
checks those kernels themselves, in both dtypes).

The oracle is the target decoding alone at the same dtype and on the same kernels: the verification
of T tokens scores each as T single steps do, greedy speculative output equals greedy autoregressive
output token for token (chain and tree, both families, ragged batch), and sampled output follows the
bfloat16 target's exact law. Loading, drafts and the planner read the one setting. The CPU kernels'
cases need scripts/build_cpu_kernels.sh, which scripts/setup.sh runs: without the library they fail,
naming it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_follows_laws, random_decoder_params, random_t5_params
from specjax import contracts, loading, models, specs
from specjax.decoding import autoregressive, core
from specjax.decoding.tree import Tree
from specjax.drafters import expansion, registry
from specjax.models import cpu_kernels, decoder_only, t5

BF16 = jnp.bfloat16
CONFIG = decoder_only.SIZES["tiny"]
T5_CONFIG = t5.SIZES["tiny"]


KERNELS = ["xla", "cpu"]


def _on(kernels, config, params):
  """params as ModelSpec.kernels `kernels` decodes with them (the CPU kernels: packed)."""
  return params if kernels == "xla" else cpu_kernels.pack_params_for(config, params)


def _model(kernels, config):
  """The model as ModelSpec.kernels `kernels` decodes with it (the CPU kernels: a float32 cache,
  holding the same bfloat16-rounded keys and values)."""
  return models.model_for(config, None, BF16 if kernels == "xla" else cpu_kernels.CACHE_DTYPE)


def _decoder_pair(kernels="xla"):
  """A random tiny decoder-only target in bfloat16 and its first layer as the draft."""
  params = models.cast(random_decoder_params(CONFIG, seed=5), BF16)
  draft_config, draft_params = decoder_only.truncate_layers(CONFIG, params, 1)
  return (_model(kernels, CONFIG), _on(kernels, CONFIG, params),
          _model(kernels, draft_config), _on(kernels, draft_config, draft_params))


def _t5_pair(kernels="xla", config=T5_CONFIG):
  """A random tiny T5 target in bfloat16 and, as the draft, the same with its first decoder layer
  only (its own encoder): a draft that agrees with the target part of the time."""
  params = models.cast(random_t5_params(config, seed=6), BF16)
  draft_config = dataclasses.replace(config, num_decoder_layers=1)
  draft_params = {**params, "decoder": {k: v for k, v in params["decoder"].items() if k != "layers_1"}}
  return (_model(kernels, config), _on(kernels, config, params),
          _model(kernels, draft_config), _on(kernels, draft_config, draft_params))


def _prompts(family: str, batch: int = 2):
  """Right-padded prompts of different lengths (decoder-only), or sources of different lengths
  (T5, whose decoder starts from its start token)."""
  rng = np.random.RandomState(3)
  lengths = np.asarray([7, 4, 6, 5][:batch], np.int32)
  tokens = np.zeros((batch, 8), np.int32)
  for row, length in enumerate(lengths):
    tokens[row, :length] = rng.randint(3, 100, length)
  if family == "decoder-only":
    return jnp.asarray(tokens), jnp.asarray(lengths), None
  prompt, prompt_lengths = t5.decoder_prompt(T5_CONFIG, batch)
  return prompt, prompt_lengths, contracts.Source(jnp.asarray(tokens), jnp.asarray(lengths))


def _step(target, params, source):
  """jit(tokens, positions, cache -> (logits, cache)) of the target bound to its source."""
  return jax.jit(lambda t, pos, cache: contracts.open_session(target, params, source).step(
      t, pos, cache))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("family", ["decoder-only", "T5"])
def test_verifying_t_tokens_scores_each_as_its_single_step_does(family, kernels):
  """The logits of 5 tokens scored in one call equal those of 5 one-token calls to float32 rounding
  (the float32 sums of the last product run in another order for another row count): the bfloat16
  activations behind them are the same, since one bfloat16 rounding apart would move the logits by
  about 1e-2. A speculative loop and the target alone then see one distribution at every position."""
  target, params, _, _ = _decoder_pair(kernels) if family == "decoder-only" else _t5_pair(kernels)
  prompt, lengths, source = _prompts(family, batch=1)
  session = contracts.open_session(target, params, source)
  _, cache = jax.jit(functools.partial(autoregressive.prefill, session, max_length=16))(
      prompt, lengths)
  assert {leaf.dtype for leaf in (*cache.keys, *cache.values)} == {
      jnp.dtype(BF16 if kernels == "xla" else cpu_kernels.CACHE_DTYPE)}
  tokens = jnp.asarray([[5, 17, 9, 42, 3]], jnp.int32)
  positions = jnp.arange(5, dtype=jnp.int32)[None] + lengths[:, None]
  step = _step(target, params, source)
  together, _ = step(tokens, positions, cache)
  one_by_one = []
  for t in range(5):
    logits, cache = step(tokens[:, t:t + 1], positions[:, t:t + 1], cache)
    one_by_one.append(logits)
  assert together.dtype == jnp.float32  # what acceptance reads
  np.testing.assert_allclose(np.asarray(together), np.asarray(jnp.concatenate(one_by_one, 1)),
                             rtol=1e-5, atol=1e-5)
  # The dtype is in effect: the same weights in float32 score close to, not exactly, the same.
  f32_target = models.model_for(CONFIG if family == "decoder-only" else T5_CONFIG)
  f32_params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), cpu_kernels.plain(params))
  f32_session = contracts.open_session(f32_target, f32_params, source)
  f32_logits, _ = jax.jit(functools.partial(autoregressive.prefill, f32_session, max_length=16))(
      prompt, lengths)
  bf16_logits, _ = jax.jit(functools.partial(autoregressive.prefill, session, max_length=16))(
      prompt, lengths)
  difference = np.abs(np.asarray(f32_logits) - np.asarray(bf16_logits)).max()
  assert 0 < difference < 0.05 * np.abs(np.asarray(f32_logits)).max(), difference


def _decode(target, params, drafter, draft_params, prompt, lengths, source, temperature, new=12,
            seed=0):
  config = core.DecodeConfig(max_new_tokens=new)
  return core.make_decode(target, drafter, config)(params, draft_params, prompt, lengths,
                                                   jax.random.PRNGKey(seed), temperature, 1.0, 1.0,
                                                   source)


def _generate(target, params, prompt, lengths, source, temperature, new=12, seed=0):
  return autoregressive.make_generate(target, autoregressive.DecodeShape(new))(
      params, prompt, lengths, jax.random.PRNGKey(seed), temperature, 1.0, source)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("family,tree", [("decoder-only", "chain:3"), ("decoder-only", "spine:3x2"),
                                         ("T5", "chain:3"), ("T5 1.0", "spine:3x2")])
def test_greedy_speculative_output_equals_the_targets_own_in_bfloat16(family, tree, kernels):
  if family == "decoder-only":
    target, params, draft, draft_params = _decoder_pair(kernels)
  else:  # T5 1.0 ties its head to the embedding: the CPU kernels read the packed transposed table
    target, params, draft, draft_params = _t5_pair(
        kernels, T5_CONFIG if family == "T5" else t5.SIZES["tiny-1.0"])
  prompt, lengths, source = _prompts(family)
  tree = Tree.from_name(tree)
  from specjax.drafters.model import ModelDrafter  # pylint: disable=import-outside-toplevel
  drafter = expansion.expand(ModelDrafter(draft), tree, sample=True)
  out = _decode(target, params, drafter, draft_params, prompt, lengths, source, 0.0)
  expected = _generate(target, params, prompt, lengths, source, 0.0)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_generated, expected.num_generated)
  n = np.asarray(out.stats.num_accepted)
  assert n[n >= 0].max() > 0  # drafts were accepted: the verification's logits were read


@pytest.mark.parametrize("kernels", KERNELS)
def test_sampled_speculative_output_follows_the_bfloat16_targets_law(kernels):
  """4000 rows from one prompt at temperature 1, a 1-layer draft proposing 2 tokens: each of the 3
  output positions' token counts vs the exact law of the bfloat16 target, enumerated over every
  history (conftest.assert_follows_laws: chi-square p < 1e-6 fails, so the false-failure rate is
  below 3e-6; total variation < 0.06). A draft distribution leaking into the output moves them."""
  config = dataclasses.replace(CONFIG, vocab_size=8)
  params = models.cast(random_decoder_params(config, seed=8, scale=0.3), BF16)
  target = _model(kernels, config)
  draft_config, draft_params = decoder_only.truncate_layers(config, params, 1)
  params, draft_params = _on(kernels, config, params), _on(kernels, draft_config, draft_params)
  from specjax.drafters.model import ModelDrafter  # pylint: disable=import-outside-toplevel
  drafter = expansion.expand(ModelDrafter(_model(kernels, draft_config)),
                             Tree.chain(2), sample=True)
  rows = 4000
  prompt, lengths = jnp.full((rows, 1), 2, jnp.int32), jnp.ones((rows,), jnp.int32)
  out = _decode(target, params, drafter, draft_params, prompt, lengths, None, 1.0, new=3, seed=1)
  n = np.asarray(out.stats.num_accepted)
  assert 0 < n[n >= 0].mean() < 2  # drafts both accepted and rejected

  # Every history x0, x1 after the prompt, scored at once: p(x0), p(x1 | x0), p(x2 | x0, x1).
  vocab = config.vocab_size
  histories = np.stack(np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij"), -1)
  tokens = np.concatenate([np.full((vocab * vocab, 1), 2), histories.reshape(-1, 2)], 1)
  session = contracts.open_session(target, params)
  logits, _ = jax.jit(functools.partial(autoregressive.prefill, session, max_length=4))(
      jnp.asarray(tokens, jnp.int32), jnp.full((vocab * vocab,), 3, jnp.int32))
  probs = np.asarray(jax.nn.softmax(logits, -1), np.float64)
  first = probs[0, 0]
  second = probs[::vocab, 1]  # [x0, x1]
  third = probs[:, 2].reshape(vocab, vocab, vocab)  # [x0, x1, x2]
  laws = [first, first @ second, np.einsum("a,ab,abc->c", first, second, third)]
  assert_follows_laws(out.tokens, laws, "bfloat16 chain")


def test_the_setting_reaches_the_target_its_drafts_and_the_heads_check(smollm2_two_blocks):
  with pytest.raises(ValueError, match=r"ModelSpec.dtype = 'float16': decode in one of 'float32', "
                                       r"'bfloat16'"):
    specs.ModelSpec(str(smollm2_two_blocks), dtype="float16")
  loaded, _ = loading.load_target(specs.ModelSpec(str(smollm2_two_blocks), dtype="bfloat16"))
  floating = lambda tree: {leaf.dtype for leaf in jax.tree_util.tree_leaves(tree)
                           if jnp.issubdtype(leaf.dtype, jnp.floating)}
  assert floating(loaded.params) == {jnp.dtype(BF16)}
  assert floating(loaded.model.init_cache(1, 8)) == {jnp.dtype(BF16)}
  target = registry.Target(loaded.config, loaded.params)
  assert target.dtype == BF16 and registry.Target(loaded.config).dtype == jnp.float32
  for name in ("layers1", f"model:{smollm2_two_blocks}"):  # a checkpoint draft is cast on loading
    _, draft_params = registry.build(name, target, Tree.chain(2))
    assert floating(draft_params) == {jnp.dtype(BF16)}, name
  # Heads trained on the float32 weights belong to the same weights in bfloat16.
  from specjax.drafters import heads  # pylint: disable=import-outside-toplevel
  float32 = loading.load_target(specs.ModelSpec(str(smollm2_two_blocks)))[0].params
  assert floating(float32) == {jnp.dtype(jnp.float32)}
  assert heads.target_fingerprint(loaded.config, float32) == heads.target_fingerprint(
      loaded.config, loaded.params)
