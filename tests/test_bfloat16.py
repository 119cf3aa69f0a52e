"""Decoding in bfloat16 (specs.ModelSpec.dtype): lossless within the dtype, through XLA's products
and through oneDNN's (specs.ModelSpec.matmul = "onednn", models/cpu_matmul.py).

The oracle is the target decoding alone at the same dtype and on the same path: the verification of
T tokens scores each as T single steps do, greedy speculative output equals greedy autoregressive
output token for token (chain and tree, both families, ragged batch), and sampled output follows the
bfloat16 target's exact law. oneDNN's products equal XLA's to float32 rounding. Loading, drafts and
the planner read the one setting. The oneDNN cases need scripts/build_cpu_matmul.sh, which
scripts/setup.sh runs: without the library they fail, naming it.
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
from specjax.models import cpu_matmul, decoder_only, t5

BF16 = jnp.bfloat16
CONFIG = decoder_only.SIZES["tiny"]
T5_CONFIG = t5.SIZES["tiny"]


MATMULS = ["xla", "onednn"]


def _on(matmul, config, params):
  """params as ModelSpec.matmul `matmul` decodes with them (oneDNN: packed)."""
  return params if matmul == "xla" else cpu_matmul.pack_params_for(config, params)


def _model(matmul, config):
  """The model as ModelSpec.matmul `matmul` decodes with it (oneDNN: a float32 cache, holding the
  same bfloat16-rounded keys and values)."""
  return models.model_for(config, None, BF16 if matmul == "xla" else cpu_matmul.CACHE_DTYPE)


def _decoder_pair(matmul="xla"):
  """A random tiny decoder-only target in bfloat16 and its first layer as the draft."""
  params = models.cast(random_decoder_params(CONFIG, seed=5), BF16)
  draft_config, draft_params = decoder_only.truncate_layers(CONFIG, params, 1)
  return (_model(matmul, CONFIG), _on(matmul, CONFIG, params),
          _model(matmul, draft_config), _on(matmul, draft_config, draft_params))


def _t5_pair(matmul="xla", config=T5_CONFIG):
  """A random tiny T5 target in bfloat16 and, as the draft, the same with its first decoder layer
  only (its own encoder): a draft that agrees with the target part of the time."""
  params = models.cast(random_t5_params(config, seed=6), BF16)
  draft_config = dataclasses.replace(config, num_decoder_layers=1)
  draft_params = {**params, "decoder": {k: v for k, v in params["decoder"].items() if k != "layers_1"}}
  return (_model(matmul, config), _on(matmul, config, params),
          _model(matmul, draft_config), _on(matmul, draft_config, draft_params))


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


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("family", ["decoder-only", "T5"])
def test_verifying_t_tokens_scores_each_as_its_single_step_does(family, matmul):
  """The logits of 5 tokens scored in one call equal those of 5 one-token calls to float32 rounding
  (the float32 sums of the last product run in another order for another row count): the bfloat16
  activations behind them are the same, since one bfloat16 rounding apart would move the logits by
  about 1e-2. A speculative loop and the target alone then see one distribution at every position."""
  target, params, _, _ = _decoder_pair(matmul) if family == "decoder-only" else _t5_pair(matmul)
  prompt, lengths, source = _prompts(family, batch=1)
  session = contracts.open_session(target, params, source)
  _, cache = jax.jit(functools.partial(autoregressive.prefill, session, max_length=16))(
      prompt, lengths)
  assert {leaf.dtype for leaf in (*cache.keys, *cache.values)} == {
      jnp.dtype(BF16 if matmul == "xla" else cpu_matmul.CACHE_DTYPE)}
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
  f32_params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), cpu_matmul.plain(params))
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


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("family,tree", [("decoder-only", "chain:3"), ("decoder-only", "spine:3x2"),
                                         ("T5", "chain:3"), ("T5 1.0", "spine:3x2")])
def test_greedy_speculative_output_equals_the_targets_own_in_bfloat16(family, tree, matmul):
  if family == "decoder-only":
    target, params, draft, draft_params = _decoder_pair(matmul)
  else:  # T5 1.0 ties its head to the embedding: oneDNN reads the packed transposed table
    target, params, draft, draft_params = _t5_pair(
        matmul, T5_CONFIG if family == "T5" else t5.SIZES["tiny-1.0"])
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


@pytest.mark.parametrize("matmul", MATMULS)
def test_sampled_speculative_output_follows_the_bfloat16_targets_law(matmul):
  """4000 rows from one prompt at temperature 1, a 1-layer draft proposing 2 tokens: each of the 3
  output positions' token counts vs the exact law of the bfloat16 target, enumerated over every
  history (conftest.assert_follows_laws: chi-square p < 1e-6 fails, so the false-failure rate is
  below 3e-6; total variation < 0.06). A draft distribution leaking into the output moves them."""
  config = dataclasses.replace(CONFIG, vocab_size=8)
  params = models.cast(random_decoder_params(config, seed=8, scale=0.3), BF16)
  target = _model(matmul, config)
  draft_config, draft_params = decoder_only.truncate_layers(config, params, 1)
  params, draft_params = _on(matmul, config, params), _on(matmul, draft_config, draft_params)
  from specjax.drafters.model import ModelDrafter  # pylint: disable=import-outside-toplevel
  drafter = expansion.expand(ModelDrafter(_model(matmul, draft_config)),
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


@pytest.mark.parametrize("shape,rows", [((64, 128), (1,)), ((100, 37), (2, 3)), ((576, 1536), (5,))])
def test_onednn_products_equal_xlas_to_float32_rounding(shape, rows):
  """x[..., k] x kernel[k, n] on oneDNN against XLA's bfloat16 product summed in float32, odd shapes
  included (oneDNN pads them in its blocked layout), and the packed kernel unpacks to itself."""
  rng = np.random.RandomState(0)
  kernel = jnp.asarray(rng.standard_normal(shape), BF16)
  x = jnp.asarray(rng.standard_normal((*rows, shape[0])), BF16)
  packed = cpu_matmul.pack(kernel)
  ours = jax.jit(cpu_matmul.matmul)(x, packed)
  xla = jnp.matmul(x, kernel, preferred_element_type=jnp.float32)
  assert ours.shape == xla.shape and ours.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=1e-5,
                             atol=1e-5 * float(np.abs(np.asarray(xla)).max()))
  np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(packed)), np.asarray(kernel))
  # A row count whose product wants another weight layout than the packed one (AMX may) reorders
  # the packed weight on each call: the same product.
  lib = cpu_matmul.require()
  lib.specjax_cpu_matmul_always_reorder(1)
  try:
    reordered = jax.jit(cpu_matmul.matmul)(x, packed)
  finally:
    lib.specjax_cpu_matmul_always_reorder(0)
  np.testing.assert_array_equal(np.asarray(reordered), np.asarray(ours))
  with pytest.raises(ValueError, match=r"x\[\.\.\., 3\] against a packed"):
    cpu_matmul.matmul(jnp.ones((1, 3), BF16), packed)


@pytest.mark.parametrize("family", ["decoder-only", "T5", "T5 1.0"])
def test_onednn_scores_a_prompt_as_xla_does(family):
  """A prefill's logits on the packed params equal XLA's bfloat16 path's to float32 rounding: the
  products are summed in another order, every bfloat16 rounding between them is the same. The
  packed params (fused q / k / v and gate / up kernels, a tied head's transposed copy) unpack to
  the params they were packed from, bit for bit."""
  results, trees = [], []
  for matmul in MATMULS:
    if family == "decoder-only":
      target, params, _, _ = _decoder_pair(matmul)
    else:
      target, params, _, _ = _t5_pair(matmul, T5_CONFIG if family == "T5" else t5.SIZES["tiny-1.0"])
    assert cpu_matmul.is_packed(params) == (matmul == "onednn")
    trees.append(cpu_matmul.plain(params))
    if family == "decoder-only" and matmul == "onednn":  # each block runs 4 products, not 7
      assert set(params["layers_0"]["attn"]) == {"wq+wk+wv", "wo"}
      assert set(params["layers_0"]["mlp"]) == {"w_gate+w_up", "w_down"}
    prompt, lengths, source = _prompts(family.split(" ")[0])
    session = contracts.open_session(target, params, source)
    results.append(np.asarray(jax.jit(functools.partial(
        autoregressive.prefill, session, max_length=16))(prompt, lengths)[0]))
  np.testing.assert_allclose(results[1], results[0], rtol=1e-4, atol=1e-4)
  assert jax.tree_util.tree_structure(trees[1]) == jax.tree_util.tree_structure(trees[0])
  jax.tree_util.tree_map(np.testing.assert_array_equal, trees[1], trees[0])


def test_onednn_setting_is_checked_and_reaches_the_target_and_its_drafts(smollm2_two_blocks,
                                                                        monkeypatch):
  with pytest.raises(ValueError, match=r"ModelSpec.matmul = 'mkl': use 'onednn'"):
    specs.ModelSpec(str(smollm2_two_blocks), dtype="bfloat16", matmul="mkl")
  with pytest.raises(ValueError, match=r"matmul = 'onednn' runs bfloat16 products; set "
                                       r"ModelSpec.dtype = 'bfloat16' \(it is 'float32'\)"):
    specs.ModelSpec(str(smollm2_two_blocks), matmul="onednn")
  spec = specs.ModelSpec(str(smollm2_two_blocks), dtype="bfloat16", matmul="onednn")
  loaded, _ = loading.load_target(spec)
  assert cpu_matmul.is_packed(loaded.params) and cpu_matmul.HEAD in loaded.params  # tied head
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(loaded.model.init_cache(1, 8))
          if jnp.issubdtype(leaf.dtype, jnp.floating)} == {jnp.dtype(cpu_matmul.CACHE_DTYPE)}
  target = registry.Target(loaded.config, loaded.params)
  for name in ("layers1", f"model:{smollm2_two_blocks}"):
    _, draft_params = registry.build(name, target, Tree.chain(2))
    assert cpu_matmul.is_packed(draft_params), name
  # Heads trained for these weights recognise them packed.
  from specjax.drafters import heads  # pylint: disable=import-outside-toplevel
  plain = loading.load_target(dataclasses.replace(spec, matmul=None))[0].params
  assert heads.target_fingerprint(loaded.config, loaded.params) == heads.target_fingerprint(
      loaded.config, plain)
  # Without the library the setting names the script that builds it, before any work.
  monkeypatch.setattr(cpu_matmul, "LIBRARY", "/nonexistent/libspecjax_cpu_matmul.so")
  cpu_matmul._library.cache_clear()  # pylint: disable=protected-access
  try:
    with pytest.raises(RuntimeError, match=r"needs /nonexistent/libspecjax_cpu_matmul.so, which "
                                           r"is not built: bash scripts/build_cpu_matmul.sh"):
      loading.load_target(spec)
  finally:
    cpu_matmul._library.cache_clear()  # pylint: disable=protected-access


def test_onednn_products_run_alone_when_xla_runs_them_concurrently():
  """16 independent products in one program (XLA may run them at once): every one equals XLA's, in
  each of 100 runs. Before the custom call ran one product at a time, about 1 in 1,600 came back
  wrong (oneDNN's shared scratchpad); with the lock the results are deterministic, so this test
  cannot fail by chance."""
  rng = np.random.RandomState(1)
  kernels = [jnp.asarray(rng.standard_normal((64, 96)), BF16) for _ in range(16)]
  packed = [cpu_matmul.pack(kernel) for kernel in kernels]
  x = jnp.asarray(rng.standard_normal((3, 64)), BF16)
  products = jax.jit(lambda x, ks: [cpu_matmul.matmul(x * (i + 1), k) for i, k in enumerate(ks)])
  expected = [np.asarray(jnp.matmul(x * (i + 1), k, preferred_element_type=jnp.float32))
              for i, k in enumerate(kernels)]
  for _ in range(100):
    for ours, theirs in zip(products(x, packed), expected):
      np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-3)
