"""The decoding core's contract, exercised by drafters defined here and nowhere in the library.

  * a drafter of this file ("propose the last token again") plugs in through the registry and runs
    as a sampled chain (chain rejection) and as a top-k tree (the walk), behind prompt lookup too;
  * a dynamic tree (parents per row and round) verifies in the same loop;
  * sampled candidates are verified by multi-round rejection, losslessly;
  * the features a drafter receives are the target's residual stream after the named blocks, at the
    positions accepted since its last call (decoder-only and T5);
  * the registry parses every name once and refuses what it cannot build or plan.

Oracles: target-only greedy decoding (token for token), the exact law of target-only sampling
(chi-square and total variation, conftest.assert_follows_laws), teacher-forced forward passes.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (assert_follows_laws, bigram_cache, bigram_marginals, bigram_step,
                      random_decoder_params, random_t5_params, ragged_source)
from specjax import contracts
from specjax.decoding import acceptance, autoregressive, core, sampling
from specjax.decoding import tree as trees
from specjax.drafters import expansion, registry
from specjax.models import decoder_only, layers, t5

TINY = decoder_only.SIZES["tiny"]
ROWS, VOCAB, MAX_NEW = 4000, 6, 6


@dataclasses.dataclass(frozen=True)
class RepeatLast:
  """A one-token drafter of this test file: it proposes the last token again (a point mass)."""
  vocab_size: int

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None):
    return None

  def propose(self, params, state, tokens, positions, transform):
    return jax.nn.one_hot(tokens[:, -1], self.vocab_size), state

  def rollback(self, state, lengths):
    return state


@pytest.fixture
def repeat_kind():
  """The test drafter as a registered kind, removed afterwards."""
  kind = registry.register(registry.Kind(
      "repeat", label="repeat the last token",
      build=lambda spec, target, tree, sample: (RepeatLast(target.config.vocab_size), None),
      plan=lambda spec, target_config: registry.Planned()))
  yield kind
  registry.KINDS.pop("repeat")


def tree_bigram_model():
  """The bigram table model as a tree model (its cache holds only lengths: nothing to compact)."""
  def forward(table, tokens, positions, cache, slots=None, visible=None, features=None):
    lengths = (positions if slots is None else slots)[:, -1] + 1
    return table[tokens], None, cache.replace(lengths=lengths)
  return contracts.StepModel(bigram_step, bigram_cache, forward_fn=forward,
                             move=lambda cache, source, dest: cache)


def _target_table(seed=10):
  return (2.0 * np.random.RandomState(seed).randn(VOCAB, VOCAB)).astype(np.float32)


def _law_run(model, drafter, draft_params, seed, temperature=1.0):
  fn = core.make_decode(model, drafter, core.DecodeConfig(MAX_NEW))
  target = _target_table()
  out = fn(jnp.asarray(target), draft_params, jnp.full((ROWS, 1), 2, jnp.int32),
           jnp.ones((ROWS,), jnp.int32), jax.random.PRNGKey(seed), temperature)
  return target, out


def _greedy_case():
  params = random_decoder_params(TINY, seed=0)
  prompt = (jnp.asarray(np.random.RandomState(0).randint(0, 128, (4, 7)), jnp.int32),
            jnp.array([7, 3, 5, 1], jnp.int32))
  expected = autoregressive.make_generate(decoder_only.model(TINY), autoregressive.DecodeShape(16))(
      params, *prompt, jax.random.PRNGKey(0), 0.0)
  return params, prompt, expected


@pytest.mark.parametrize("name,tree,sample,rule", [
    ("repeat", "chain:3", True, acceptance.ChainRejection),
    ("repeat", "spine:3x2", False, acceptance.TreeWalk),
    ("lookup+repeat", "chain:3", True, acceptance.ChainRejection),
    ("lookup+repeat", "full:2,2", False, acceptance.TreeWalk)])
def test_a_drafter_of_this_file_plugs_in_through_the_registry(repeat_kind, name, tree, sample, rule):
  """Greedy output equals the target's own on a tiny random decoder (4 ragged rows), and sampled
  output follows target-only sampling's exact law on a bigram table model (4000 rows, 6 positions:
  chi-square p < 1e-6 fails, false-failure rate < 1e-5 per case)."""
  tree = trees.Tree.from_name(tree)
  params, prompt, expected = _greedy_case()
  drafter, draft_params = registry.build(name, registry.Target(TINY, params), tree, sample)
  assert isinstance(acceptance.rule_for(drafter.tree, drafter.sampled), rule)
  out = core.make_decode(decoder_only.model(TINY), drafter, core.DecodeConfig(16))(
      params, draft_params, *prompt, jax.random.PRNGKey(1), 0.0)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  assert registry.label(name).endswith("repeat the last token")

  law_drafter, law_params = registry.build(
      name, registry.Target(types.SimpleNamespace(vocab_size=VOCAB)), tree, sample)
  target, out = _law_run(tree_bigram_model(), law_drafter, law_params, seed=len(name))
  assert_follows_laws(out.tokens, bigram_marginals(target, 1.0, 0, 1.0, MAX_NEW), name)


def test_registry_parses_once_and_refuses_what_it_cannot_build_or_plan(repeat_kind, tmp_path):
  for name in ("lookup", "bigram", "unigram", "layers2", "model:/x/draft", "lookup+model:/x/draft",
               "heads:/x/h", "lookup+mtp:/x/m", "repeat", "lookup+repeat"):
    assert registry.parse(name).name == name
  assert registry.parse("lookup+model:/x/draft") == registry.DrafterSpec("model", "/x/draft",
                                                                          lookup_front=True)
  with pytest.raises(ValueError, match=r"unknown drafter 'medusa'; registered kinds: .*repeat"):
    registry.parse("medusa")
  with pytest.raises(ValueError, match="names no checkpoint"):
    registry.parse("model")
  with pytest.raises(ValueError, match="reads no checkpoint"):
    registry.parse("bigram:/x")
  with pytest.raises(FileNotFoundError, match="configs/smollm2_mtp.gin"):
    registry.check(f"lookup+mtp:{tmp_path}/none")
  with pytest.raises(ValueError, match="decoder-only target's hidden states"):
    registry.check(f"heads:{tmp_path}", t5.SIZES["tiny"])
  assert registry.planned("repeat", TINY) == registry.Planned()
  assert registry.planned("layers1", TINY).config.num_layers == 1
  registry.register(dataclasses.replace(repeat_kind, plan=None))
  with pytest.raises(ValueError, match=r"a plan cannot cost the repeat drafter.*kinds a plan costs: "
                                       r"model, layers"):
    registry.planned("repeat", TINY)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """Point-mass candidates in a tree whose shape changes every round and row: nodes 1..k hang below
  the root, the rest below one of them (k and the parents drawn from the drafter's own uniforms);
  tokens looked up by (root, node) in params[V, T]. tree: the static budget (size and depth)."""
  tree: trees.Tree
  sampled = False
  features = None
  calls_per_iteration = 1

  @property
  def num_uniforms(self) -> int:
    return self.tree.size

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    return None

  def draft(self, params, state, context, uniforms, transform):
    size = self.tree.size
    first_level = 1 + jnp.floor(uniforms[:, 0] * (size - 1)).astype(jnp.int32)  # k in 1..T-1
    node = jnp.arange(1, size)
    below_root = node[None, :] <= first_level[:, None]
    upper = 1 + jnp.floor(uniforms[:, 1:] * first_level[:, None]).astype(jnp.int32)
    parents = jnp.concatenate([jnp.full((uniforms.shape[0], 1), -1, jnp.int32),
                               jnp.where(below_root, 0, upper)], axis=1)
    tokens = params[context.root][:, 1:]
    return contracts.Proposal(tokens, parents=parents), state


def test_a_dynamic_tree_verifies_in_the_same_loop():
  """Greedy: the target's own tokens (tiny decoder, 4 ragged rows); sampled: the exact law (bigram
  table model, 4000 rows, as above)."""
  budget = trees.Tree.full([6])  # 7 nodes, depth at most 2 (the drafter keeps to it)
  budget = trees.Tree(budget.paths + ((0, 0),))
  drafter = DynamicTree(budget)
  params, prompt, expected = _greedy_case()
  table = np.asarray(jnp.argsort(-jax.random.normal(jax.random.PRNGKey(5), (128, 128)), axis=1))
  out = core.make_decode(decoder_only.model(TINY), drafter, core.DecodeConfig(16))(
      params, jnp.asarray(table[:, :budget.size], jnp.int32), *prompt, jax.random.PRNGKey(1), 0.0)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  target = _target_table()
  tokens = np.argsort(-target, axis=1)[:, [0, 0, 1, 2, 0, 1, 3, 0]][:, :budget.size]
  target, out = _law_run(tree_bigram_model(), drafter, jnp.asarray(tokens, jnp.int32), seed=3)
  assert_follows_laws(out.tokens, bigram_marginals(target, 1.0, 0, 1.0, MAX_NEW), "dynamic tree")
  n = np.asarray(out.stats.num_accepted)
  assert n.max() == 2  # walks reach the second level


@dataclasses.dataclass(frozen=True)
class SampledSpine:
  """A spine tree whose candidates at each depth are drawn WITHOUT replacement from the drafter's
  own bigram softmax(params[previous token]) (previous: the root, then the depth's first candidate);
  draft_probs: the distribution each candidate was drawn from (earlier siblings removed)."""
  tree: trees.Tree
  sampled = True
  features = None

  @property
  def num_uniforms(self) -> int:
    return self.tree.size - 1

  @property
  def calls_per_iteration(self) -> int:
    return self.tree.depth

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    return None

  def draft(self, params, state, context, uniforms, transform):
    depth, width = self.tree.depth, self.tree.width
    previous, tokens, probs = context.root, [], []
    for d in range(depth):
      left = jax.nn.softmax(params[previous])
      first = None
      for r in range(width):
        token = sampling.sample_with_uniform(uniforms[:, d * width + r], left)
        tokens.append(token)
        probs.append(left / jnp.sum(left, axis=-1, keepdims=True))
        left = left.at[jnp.arange(left.shape[0]), token].set(0.0)
        first = token if first is None else first
      previous = first
    order = [d * width + r for d, r in zip(self.tree.depths[1:] - 1, self.tree.ranks[1:])]
    return contracts.Proposal(jnp.stack(tokens, 1)[:, order],
                              jnp.stack(probs, 1)[:, order]), state


def test_sampled_candidates_are_verified_by_multi_round_rejection_losslessly():
  """The walk with draft probabilities (multi-round rejection, siblings drawn without replacement):
  the exact law of target-only sampling (4000 rows, as above) at temperature 1 and 0.7, and greedy
  output equal to the target's own; its betas are the chance each depth is passed (|z| < 5)."""
  tree = trees.Tree.spine(3, 3)
  draft = (2.0 * np.random.RandomState(12).randn(VOCAB, VOCAB)).astype(np.float32)
  drafter = SampledSpine(tree)
  assert isinstance(acceptance.rule_for(tree, True), acceptance.TreeWalk)
  for seed, temperature in enumerate((1.0, 0.7)):
    target, out = _law_run(tree_bigram_model(), drafter, jnp.asarray(draft), seed, temperature)
    assert_follows_laws(out.tokens, bigram_marginals(target, temperature, 0, 1.0, MAX_NEW),
                        f"sampled spine at {temperature}")
  n = np.asarray(out.stats.num_accepted)
  betas = np.asarray(out.stats.acceptance_probs)
  reached = (n[..., None] >= np.arange(tree.depth)) & (n[..., None] >= 0)
  passed = (n[..., None] > np.arange(tree.depth)) & reached
  spread = np.sqrt((betas[reached] * (1 - betas[reached])).sum()) / reached.sum()
  assert abs(passed[reached].mean() - betas[reached].mean()) < 5 * spread
  assert n.max() == tree.depth
  greedy = core.make_decode(tree_bigram_model(), drafter, core.DecodeConfig(MAX_NEW))(
      jnp.asarray(target), jnp.asarray(draft), jnp.full((4, 1), 2, jnp.int32),
      jnp.ones((4,), jnp.int32), jax.random.PRNGKey(0), 0.0)
  plain = autoregressive.make_generate(tree_bigram_model(), autoregressive.DecodeShape(MAX_NEW))(
      jnp.asarray(target), jnp.full((4, 1), 2, jnp.int32), jnp.ones((4,), jnp.int32),
      jax.random.PRNGKey(0), 0.0)
  np.testing.assert_array_equal(greedy.tokens, plain.tokens)


def _normed(x, scale, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(scale)


@pytest.mark.parametrize("family", ["decoder-only", "T5"])
def test_features_are_the_residual_stream_after_the_named_blocks(family):
  """FeatureSpec(blocks=(0, 1), final_norm=True) on a 2-block model: block k's stream, put through
  the final norm, is the final-norm state of the model cut after block k (a separate forward pass of
  k + 1 blocks); the final-norm part is that of the whole model."""
  if family == "decoder-only":
    config, params = TINY, random_decoder_params(TINY, seed=3)
    cut = lambda k: decoder_only.truncate_layers(config, params, k + 1)
    model_of = decoder_only.model
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 128, (2, 6)), jnp.int32)
    context_of = lambda model, p: None
    norm, eps = params["final_norm"]["scale"], config.norm_eps
  else:
    config, params = t5.SIZES["tiny"], random_t5_params(t5.SIZES["tiny"], seed=3)

    def cut(k):
      decoder = {name: leaf for name, leaf in params["decoder"].items()
                 if not name.startswith("layers_") or int(name.split("_")[1]) <= k}
      return (dataclasses.replace(config, num_decoder_layers=k + 1),
              {**params, "decoder": decoder})
    model_of = t5.model
    tokens = jnp.asarray(np.random.RandomState(1).randint(2, 128, (2, 6)), jnp.int32)
    source = contracts.Source(*map(jnp.asarray, ragged_source(config, (7, 4), seed=2)))
    context_of = lambda model, p: model.encode(p, source)
    norm, eps = params["decoder"]["decoder_norm"]["scale"], config.norm_eps
  positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), tokens.shape)

  def run(config, params, spec):
    model = model_of(config)
    return model.forward(params, context_of(model, params), tokens, positions,
                         model.init_cache(2, 6), features=spec)[1]

  spec = contracts.FeatureSpec(blocks=(0, 1), final_norm=True)
  tapped = np.asarray(run(config, params, spec))
  width = config.embed_dim
  assert tapped.shape == (2, 6, spec.width(width))
  for k in (0, 1):
    after_k = tapped[..., k * width:(k + 1) * width]
    final_of_cut = run(*cut(k), contracts.FeatureSpec(final_norm=True))
    np.testing.assert_allclose(_normed(after_k, norm, eps), final_of_cut, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(tapped[..., 2 * width:], run(*cut(1), contracts.FeatureSpec(
      final_norm=True)), atol=2e-5, rtol=1e-4)
  with pytest.raises(ValueError, match="blocks \\[2\\] do not exist"):
    run(config, params, contracts.FeatureSpec(blocks=(2,)))


@dataclasses.dataclass(frozen=True)
class Recorder(expansion.Ranked):
  """Top-1-by-table candidates (params[root]) that also records, in its state, every feature vector
  it receives, at the position the context says it belongs to."""
  tree: trees.Tree
  features: contracts.FeatureSpec
  calls_per_iteration = 1

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    batch = prompt_tokens.shape[0]
    return (jnp.zeros((batch, max_length, features.shape[-1])), jnp.zeros((batch, max_length), int))

  def candidates(self, params, state, context, depth, width):
    seen, times = state
    rows = jnp.arange(seen.shape[0])[:, None]
    slots = jnp.arange(context.features.shape[1])[None, :]
    where = context.position[:, None] - context.feature_count[:, None] + slots
    valid = slots < context.feature_count[:, None]
    where = jnp.where(valid, where, seen.shape[1] - 1)  # invalid entries land in the last slot
    seen = seen.at[rows, where].set(jnp.where(valid[..., None], context.features, 0.0))
    times = times.at[rows, where].add(valid.astype(int))
    return params[context.root][:, :depth, :width], (seen, times)


@pytest.mark.parametrize("family", ["decoder-only", "T5"])
def test_the_drafter_receives_the_features_of_the_positions_accepted_since_its_last_call(family):
  """Run the loop (greedy, 3 ragged rows, a spine tree whose candidates the target partly accepts)
  with a drafter that records what it receives; every position from the prompt's last to the one
  before the final root arrives (a row that has finished sees its last window again: the loop still
  calls the drafter for it), nothing past it, and each equals a teacher-forced pass."""
  spec = contracts.FeatureSpec(blocks=(0,), final_norm=True)
  tree = trees.Tree.spine(3, 2)
  if family == "decoder-only":
    config, params, pad = TINY, random_decoder_params(TINY, seed=0), 0
    model = decoder_only.model(config)
    prompt = (jnp.asarray(np.random.RandomState(0).randint(0, 128, (3, 5)), jnp.int32),
              jnp.array([5, 2, 4], jnp.int32))
    source = None
  else:
    config, params, pad = t5.SIZES["tiny"], random_t5_params(t5.SIZES["tiny"], seed=4), 0
    model = t5.model(config)
    source = contracts.Source(*map(jnp.asarray, ragged_source(config, (9, 5, 7), seed=3)))
    prompt = t5.decoder_prompt(config, 3)
  greedy = autoregressive.make_generate(model, autoregressive.DecodeShape(12))(
      params, *prompt, jax.random.PRNGKey(0), 0.0, 1.0, source)
  # Candidates: the target's own next tokens for some roots, another token for the rest.
  table = np.random.RandomState(1).randint(0, 128, (128, tree.depth, tree.width)).astype(np.int32)
  generated = np.asarray(greedy.tokens)
  for row in generated:
    for a, b in zip(row[:-1], row[1:]):
      table[a, 0, 0] = b
  settings = acceptance.Settings(jnp.float32(0.0), jnp.float32(1.0), jnp.float32(1.0))

  @jax.jit
  def run(params, table):
    loop = core.Loop(model, Recorder(tree, spec), core.DecodeConfig(12, pad_id=pad), params,
                     jnp.asarray(table), model.encode(params, source), settings,
                     jax.random.PRNGKey(0))
    return jax.lax.while_loop(loop.cond, loop.body, loop.start(*prompt, source))

  state = run(params, table)
  np.testing.assert_array_equal(state.committed[:, :12], greedy.tokens)
  seen, times = map(np.asarray, state.draft_state)
  full = np.asarray(state.history)
  positions = jnp.broadcast_to(jnp.arange(full.shape[1], dtype=jnp.int32), full.shape)
  forced = np.asarray(model.forward(params, model.encode(params, source), jnp.asarray(full),
                                    positions, model.init_cache(3, full.shape[1]),
                                    features=spec)[1])
  assert np.asarray(state.stats.num_accepted).max() >= 1  # some candidates were accepted
  for b in range(3):
    first, last = int(prompt[1][b]) - 1, int(state.position[b]) - 1
    assert np.all(times[b, first:last + 1] >= 1)
    assert times[b, :first].sum() == 0 and times[b, last + 1:-1].sum() == 0
    np.testing.assert_allclose(seen[b, first:last + 1], forced[b, first:last + 1], atol=5e-5,
                               rtol=1e-4)


def test_layers_tapped_concatenates_in_the_spec_order():
  after = {0: jnp.full((1, 1, 2), 0.0), 3: jnp.full((1, 1, 2), 3.0)}
  out = layers.tapped(contracts.FeatureSpec(blocks=(3, 0), final_norm=True), after,
                      jnp.full((1, 1, 2), 9.0))
  np.testing.assert_array_equal(out[0, 0], [3, 3, 0, 0, 9, 9])
