"""Token-tree verification (decoding/tree.py, the walk in decoding/acceptance.py, the one loop in
decoding/core.py): tree attention, losslessness, a numpy replay; for
decoder-only and T5 targets (the tree loop's law on an encoder-decoder table model:
tests/test_t5_decoding.py).

Oracles: a node's logits are those of its path run as a chain through the same model; temperature 0
reproduces the target's own greedy decode token for token; sampled outputs follow the exact law of
target-only sampling (chi-square, as tests/test_speculative.py); the loop equals a numpy replay of the
walk with the same uniforms; the walk's law equals explicit multi-round rejection with one-hot drafts.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (BigramDrafter, assert_follows_laws, bigram_cache, bigram_marginals,
                      bigram_step, ragged_source, random_decoder_params, random_t5_params)
from specjax import contracts
from specjax.decoding import autoregressive, core, sampling
from specjax.decoding import tree as trees
from specjax.drafters import expansion, lookup
from specjax.drafters.model import ModelDrafter
from specjax.models import decoder_only, t5

TINY = decoder_only.SIZES["tiny"]
TINY_DRAFT = decoder_only.DecoderConfig(vocab_size=128, embed_dim=32, num_layers=1, num_heads=2,
                                        num_kv_heads=1, head_dim=16, mlp_dim=64)
T5_TARGET = t5.SIZES["tiny"]
T5_DRAFT = t5.T5Config(vocab_size=128, embed_dim=16, num_encoder_layers=1, num_decoder_layers=1,
                       num_heads=2, head_dim=8, mlp_dim=32)


def random_tree(seed: int, nodes: int = 9, max_rank: int = 3) -> trees.Tree:
  """A random tree: each new node hangs below a random existing node with an unused rank."""
  rng = np.random.RandomState(seed)
  paths = [(0,)]
  while len(paths) < nodes:
    parent = [()] + paths
    base = parent[rng.randint(len(parent))]
    used = {p[-1] for p in paths if p[:-1] == base}
    free = [r for r in range(max_rank) if r not in used]
    if free:
      paths.append(base + (int(rng.choice(free)),))
  return trees.Tree(tuple(paths))


def test_tree_shapes():
  tree = trees.Tree.full([2, 2, 1])
  assert tree.size == 11 and tree.depth == 3 and tree.width == 2
  np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6])
  assert trees.Tree.spine(4, 3).size == 13 and trees.Tree.spine(4, 3).name == "spine:4x3"
  assert trees.Tree.from_name("chain:5") == trees.Tree.chain(5)
  assert trees.Tree.from_name("full:3,2") == trees.Tree.full([3, 2])
  assert trees.Tree.full([3, 2, 1]).name == "full:3,2,1" and random_tree(3).name.startswith("tree:")
  # every node's ancestors are exactly its path's prefixes
  tree = random_tree(3, nodes=12)
  for i, path in enumerate(tree.paths, start=1):
    expected = {0} | {tree.paths.index(path[:k]) + 1 for k in range(1, len(path) + 1)}
    assert set(np.flatnonzero(trees.ancestors(tree.parents)[i])) == expected


def assert_tree_logits_equal_chain_logits(model, params, batch, tree_seed, context_of_rows):
  """Every node scored in one tree call has the logits and hidden state of its path run as a chain
  (float32). context_of_rows(rows) -> the model's context for those batch rows (None: decoder-only)."""
  tree = random_tree(tree_seed, nodes=10)
  # one compile per shape, not one per op
  step = jax.jit(functools.partial(model.forward, features=contracts.FeatureSpec(final_norm=True)))
  rng = np.random.RandomState(tree_seed)
  lengths = jnp.asarray([5, 3, 1, 6][:batch], jnp.int32)
  prefix = jnp.asarray(rng.randint(0, 128, (batch, 6)), jnp.int32)
  slots = 6 + tree.size + 2
  positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (batch, 6))
  context = context_of_rows(np.arange(batch))
  _, _, cache = step(params, context, prefix, positions, model.init_cache(batch, slots))
  cache = contracts.set_lengths(cache, lengths)
  tokens = jnp.asarray(rng.randint(0, 128, (batch, tree.size)), jnp.int32)
  positions, slots_, visible = trees.attention_inputs(tree.parents, lengths, slots)
  logits, hidden, _ = step(params, context, tokens, positions, cache, slots_, visible)
  # The oracle: every (row, node) path as its own right-padded chain, all in one causal call.
  chains = [np.concatenate([np.asarray(prefix[b, :lengths[b]]),
                            np.asarray(tokens[b, np.flatnonzero(trees.ancestors(tree.parents)[i])])])
            for b in range(batch) for i in range(tree.size)]
  padded = np.zeros((len(chains), slots), np.int32)
  for row, chain in enumerate(chains):
    padded[row, :len(chain)] = chain
  chain_logits, chain_hidden, _ = step(
      params, context_of_rows(np.repeat(np.arange(batch), tree.size)), jnp.asarray(padded),
      jnp.broadcast_to(jnp.arange(slots), padded.shape), model.init_cache(len(chains), slots))
  last = np.asarray([len(chain) - 1 for chain in chains])
  rows = np.arange(len(chains))
  np.testing.assert_allclose(np.asarray(logits).reshape(len(chains), -1),
                             np.asarray(chain_logits)[rows, last], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(hidden).reshape(len(chains), -1),
                             np.asarray(chain_hidden)[rows, last], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree_seed", [0, 1])
def test_tree_logits_equal_chain_logits(batch, tree_seed):
  assert_tree_logits_equal_chain_logits(decoder_only.model(TINY), random_decoder_params(TINY, seed=0),
                                        batch, tree_seed, lambda rows: None)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree_seed", [0, 1])
def test_t5_tree_logits_equal_chain_logits(batch, tree_seed):
  """T5's decoder under a tree: relative position bias between positions (not slots), with each
  row's own encoded source."""
  model, params = t5.model(T5_TARGET), random_t5_params(T5_TARGET, seed=4)
  tokens, lengths = ragged_source(T5_TARGET, (20, 9, 14, 5)[:batch], seed=3)
  assert_tree_logits_equal_chain_logits(
      model, params, batch, tree_seed,
      lambda rows: model.encode(params, contracts.Source(jnp.asarray(tokens[rows]),
                                                         jnp.asarray(lengths[rows]))))


@functools.lru_cache(maxsize=None)
def _greedy_setup(family):
  """(model, params, prompt, source, eos, pad, max_new, the target's greedy decode): ragged prompts
  (decoder-only) or sources (T5), and an EOS that row 0 emits mid-way, so rows finish at different
  iterations."""
  if family == "decoder-only":
    model, params, source, pad, max_new = (decoder_only.model(TINY),
                                           random_decoder_params(TINY, seed=0), None, -1, 20)
    prompt = (jnp.asarray(np.random.RandomState(0).randint(0, 128, (4, 7)), jnp.int32),
              jnp.array([7, 3, 5, 1], jnp.int32))
  else:
    model, params, pad, max_new = t5.model(T5_TARGET), random_t5_params(T5_TARGET, seed=4), 0, 16
    source = contracts.Source(*map(jnp.asarray, ragged_source(T5_TARGET, (20, 9, 14, 5), seed=3)))
    prompt = t5.decoder_prompt(T5_TARGET, 4)
  generate = lambda shape: autoregressive.make_generate(model, shape)(
      params, *prompt, jax.random.PRNGKey(0), 0.0, 1.0, source)
  eos = int(generate(autoregressive.DecodeShape(max_new)).tokens[0, 8 if source is None else 6])
  expected = generate(autoregressive.DecodeShape(max_new, eos_id=eos, pad_id=pad))
  return model, params, prompt, source, eos, pad, max_new, expected


def _greedy_drafter(kind, model, params):
  return {
      "random model": (ModelDrafter(decoder_only.model(TINY_DRAFT)),
                       random_decoder_params(TINY_DRAFT, seed=1)),
      "random T5": (ModelDrafter(t5.model(T5_DRAFT)), random_t5_params(T5_DRAFT, seed=7)),
      "identical model": (ModelDrafter(model), params),
      "prompt lookup": (lookup.PromptLookupDrafter(128, max_ngram=2), None)}[kind]


@pytest.mark.parametrize("family,kind,tree_name", [
    ("decoder-only", "random model", "chain:4"), ("decoder-only", "random model", "spine:3x3"),
    ("decoder-only", "random model", "full:3,2,2"), ("decoder-only", "identical model", "spine:3x3"),
    ("decoder-only", "prompt lookup", "full:3,2,2"), ("T5", "random T5", "spine:3x3"),
    ("T5", "random T5", "full:3,2,2"), ("T5", "identical model", "spine:3x3"),
    ("T5", "prompt lookup", "full:2,2")])  # T5: lookup over the source
def test_greedy_equals_target_greedy(family, kind, tree_name):
  """At temperature 0 the tree loop emits the target's own greedy tokens, whatever drafts the tree,
  for a decoder-only target and for T5 (its sources encoded once, ragged)."""
  model, params, prompt, source, eos, pad, max_new, expected = _greedy_setup(family)
  drafter, draft_params = _greedy_drafter(kind, model, params)
  tree = trees.Tree.from_name(tree_name)
  out = core.make_decode(model, expansion.TopK(drafter, tree),
                         core.DecodeConfig(max_new, eos_id=eos, pad_id=pad))(
      params, draft_params, *prompt, jax.random.PRNGKey(3), 0.0, source=source)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_generated, expected.num_generated)
  assert int(out.num_generated[0]) < max_new <= int(out.num_generated.max())
  n = np.asarray(out.stats.num_accepted)
  if kind == "identical model":  # the draft's top-1 chain is the target's: every depth accepted
    assert np.all(n[n >= 0] == tree.depth)


# ---------------------------------------------------------------------------------------------------
# Sampling: bigram table models with adversarial trees, 4000 rows per case.

ROWS, VOCAB, MAX_NEW = 4000, 6, 6


def tree_bigram_model():
  """The bigram table model (conftest) as a tree model: a node's logits depend on its own token only,
  its features are empty and the lengths-only cache has nothing to compact."""
  def forward(table, tokens, positions, cache, slots=None, visible=None, features=None):
    lengths = (positions if slots is None else slots)[:, -1] + 1
    tapped = None if features is None else jnp.zeros(tokens.shape + (1,))
    return table[tokens], tapped, cache.replace(lengths=lengths)
  return contracts.StepModel(bigram_step, bigram_cache, forward_fn=forward,
                             move=lambda cache, source, dest: cache)


@dataclasses.dataclass(frozen=True)
class TableTreeDrafter(expansion.Ranked):
  """Candidates looked up by the root token: params[root] is [depth, width] (any tokens at all)."""
  tree: trees.Tree
  features = None
  calls_per_iteration = 1

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None, features=None):
    return None

  def candidates(self, params, state, context, depth, width):
    return params[context.root][:, :depth, :width], state


def _target_table(seed=10, scale=2.0):
  return (scale * np.random.RandomState(seed).randn(VOCAB, VOCAB)).astype(np.float32)


def _candidate_table(case, depth, width, seed=11):
  rng = np.random.RandomState(seed)
  table = rng.randint(0, VOCAB, (VOCAB, depth, width))
  if case == "duplicate children":
    table[:] = table[:, :, :1]
  elif case == "children the target cannot emit":
    table[:] = 5  # the target table below gives token 5 probability 0
  return table.astype(np.int32)


@functools.lru_cache(maxsize=None)
def _stat_fn(drafter_kind, tree_name, top_k):
  tree = trees.Tree.from_name(tree_name)
  drafter = {"table": TableTreeDrafter(tree),
             "bigram top-k": expansion.TopK(BigramDrafter(), tree),
             "lookup": expansion.TopK(lookup.PromptLookupDrafter(VOCAB, 2, 1), tree)}[drafter_kind]
  return core.make_decode(tree_bigram_model(), drafter, core.DecodeConfig(MAX_NEW, top_k=top_k))


CASES = [("table", "full:3,2,1", "random children", {}),
         ("table", "spine:3x3", "duplicate children", {}),
         ("table", "full:2,2", "children the target cannot emit", {}),
         ("lookup", "spine:3x2", "one-hot drafts", {}),
         ("bigram top-k", "spine:3x2", "draft top-k", dict(temperature=0.7)),
         ("bigram top-k", "full:2,2,2", "draft top-k", dict(top_p=0.8)),
         ("table", "spine:2x3", "random children", dict(temperature=1.3, top_k=3))]


@pytest.mark.parametrize("drafter_kind,tree_name,case,transform", CASES)
def test_emitted_distribution_equals_target(drafter_kind, tree_name, case, transform):
  """Each output position's token counts vs the exact target-only law: chi-square p < 1e-6 fails
  (6 positions x 7 cases: false-failure rate < 5e-5 over seeds), and total variation < 0.06 (its sd
  here is ~0.005). A walk that accepted a child with the wrong chance, or drew the next token from the
  wrong node, moves these laws by far more."""
  target = _target_table()
  if case == "children the target cannot emit":
    target[:, 5] = -np.inf
  tree = trees.Tree.from_name(tree_name)
  temperature, top_k = transform.get("temperature", 1.0), transform.get("top_k", 0)
  top_p = transform.get("top_p", 1.0)
  draft_params = {"table": lambda: _candidate_table(case, tree.depth, tree.width),
                  "bigram top-k": lambda: (2.0 * np.random.RandomState(12).randn(VOCAB, VOCAB))
                  .astype(np.float32),
                  "lookup": lambda: None}[drafter_kind]()
  seed = CASES.index((drafter_kind, tree_name, case, transform))
  out = _stat_fn(drafter_kind, tree_name, top_k)(
      jnp.asarray(target), draft_params, jnp.full((ROWS, 1), 2, jnp.int32),
      jnp.ones((ROWS,), jnp.int32), jax.random.PRNGKey(seed), temperature, top_p)
  assert_follows_laws(out.tokens, bigram_marginals(target, temperature, top_k, top_p, MAX_NEW), case)
  n = np.asarray(out.stats.num_accepted)
  if case == "children the target cannot emit":
    assert np.all(n[n >= 0] == 0)
  else:
    assert n.max() == tree.depth  # the trees do get walked to the bottom


# ---------------------------------------------------------------------------------------------------
# The loop against a numpy replay with the same random numbers.


def numpy_tree_reference(tree, target, candidate_table, prompts, rng, max_new, temperature, top_k,
                         top_p, eos):
  """The tree loop written plainly per row: fill the tree from the table, walk it with each
  iteration's uniforms (try the current node's children in order against the drawn token), commit
  with the EOS / max_new cuts."""
  probs = np.asarray(sampling.probs_from_logits(jnp.asarray(target), temperature, top_k, top_p))
  batch = len(prompts)
  first_u = np.asarray(core.first_token_uniform(rng, batch))
  outputs = []
  for b in range(batch):
    draw = lambda u, p: int(sampling.sample_with_uniform(jnp.float32(u), jnp.asarray(p)))
    out = [draw(first_u[b], probs[prompts[b][-1]])]
    iteration = 0
    while out[-1] != eos and len(out) < max_new:
      u = np.asarray(jax.random.uniform(jax.random.fold_in(rng, iteration + 1),
                                        (batch, tree.depth + 1)))[b]
      root = out[-1]
      tokens = [root] + [int(candidate_table[root, d - 1, r])
                         for d, r in zip(tree.depths[1:], tree.ranks[1:])]
      node, emitted = 0, []
      for d in range(tree.depth + 1):
        drawn = draw(u[d], probs[tokens[node]])
        child = next((j for j in range(tree.size)
                      if tree.parents[j] == node and tokens[j] == drawn and d < tree.depth), None)
        emitted.append(drawn)
        if child is None:
          break
        node = child
      for token in emitted:
        if len(out) < max_new and out[-1] != eos:
          out.append(token)
      iteration += 1
    outputs.append(out + [-1] * (max_new - len(out)))
  return np.asarray(outputs)


@pytest.mark.parametrize("tree_name,temperature,top_k,top_p", [
    ("full:3,2,1", 1.0, 0, 1.0), ("spine:4x2", 0.6, 0, 0.9), ("spine:2x3", 1.2, 4, 1.0)])
def test_loop_matches_numpy_reference(tree_name, temperature, top_k, top_p):
  tree = trees.Tree.from_name(tree_name)
  vocab = 12
  target = (2.0 * np.random.RandomState(1).randn(vocab, vocab)).astype(np.float32)
  table = np.random.RandomState(2).randint(0, vocab, (vocab, tree.depth, tree.width)).astype(np.int32)
  # children that often match: put the target's two likeliest tokens in front at every depth
  table[:, :, :2] = np.argsort(-target, axis=1)[:, None, :2]
  prompts = [[3], [5], [7], [0], [11], [4]]
  eos, max_new, rng = 9, 14, jax.random.PRNGKey(7)
  out = core.make_decode(tree_bigram_model(), TableTreeDrafter(tree),
                         core.DecodeConfig(max_new, top_k=top_k, eos_id=eos, pad_id=-1))(
      jnp.asarray(target), jnp.asarray(table), jnp.asarray(prompts, jnp.int32),
      jnp.ones((len(prompts),), jnp.int32), rng, temperature, top_p)
  expected = numpy_tree_reference(tree, target, table, prompts, rng, max_new, temperature, top_k,
                                  top_p, eos)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected)
  assert np.asarray(out.stats.num_accepted).max() >= 2  # the replay covered multi-token walks


def test_walk_law_equals_explicit_multi_round():
  """Exact, not sampled: explicit multi-round rejection over deterministic children (accept child x
  with chance residual(x); after a rejection remove x and renormalise; emit from the last residual)
  gives every child and every other token the chance the walk gives it: its target probability, once
  per distinct token."""
  rng = np.random.RandomState(0)
  for trial in range(50):
    p = rng.dirichlet(np.full(8, 0.5))
    p[rng.randint(8)] = 0.0  # a token the target cannot emit, sometimes among the children
    p /= p.sum()
    children = list(rng.randint(0, 8, rng.randint(1, 5)))
    accepted, residual, reach = np.zeros(8), p.copy(), 1.0
    for x in children:
      mass = residual.sum()
      chance = residual[x] / mass if mass > 0 else 0.0
      accepted[x] += reach * chance
      reach *= 1.0 - chance
      residual[x] = 0.0
    emitted = reach * (residual / residual.sum() if residual.sum() > 0 else residual)
    in_children = np.isin(np.arange(8), children)
    np.testing.assert_allclose(accepted, np.where(in_children, p, 0.0), atol=1e-12)
    np.testing.assert_allclose(emitted, np.where(in_children, 0.0, p), atol=1e-12)


def test_betas_match_acceptance():
  """The recorded beta at a reached depth is the exact chance of passing it; their mean over reached
  depths matches the observed pass rate (normal approximation, |z| < 5: false-failure < 6e-7)."""
  tree = trees.Tree.from_name("spine:3x2")
  target = _target_table()
  out = _stat_fn("table", "spine:3x2", 0)(
      jnp.asarray(target), _candidate_table("random children", tree.depth, tree.width),
      jnp.full((ROWS, 1), 2, jnp.int32), jnp.ones((ROWS,), jnp.int32), jax.random.PRNGKey(99),
      1.0, 1.0)
  n = np.asarray(out.stats.num_accepted)
  betas = np.asarray(out.stats.acceptance_probs)
  depth = np.arange(tree.depth)
  reached = (n[..., None] >= depth) & (n[..., None] >= 0)
  passed = (n[..., None] > depth) & reached
  mean_beta = betas[reached].mean()
  rate = passed[reached].mean()
  spread = np.sqrt((betas[reached] * (1 - betas[reached])).sum()) / reached.sum()
  assert abs(rate - mean_beta) < 5 * spread + 1e-9, (rate, mean_beta)


def test_bad_input():
  model = decoder_only.model(TINY)
  with pytest.raises(ValueError, match="spine:DxW"):
    trees.Tree.from_name("spine:4")
  with pytest.raises(ValueError, match="no parent node"):
    trees.Tree(((0,), (1, 0)))
  with pytest.raises(ValueError, match="width must be"):
    trees.Tree.spine(3, 0)
  prompt = jnp.ones((1, 3), jnp.int32)
  spine = trees.Tree.spine(2, 2)
  plain = core.make_decode(contracts.StepModel(bigram_step, bigram_cache), TableTreeDrafter(spine),
                           core.DecodeConfig(4))
  with pytest.raises(ValueError, match="cannot verify token trees"):
    plain(jnp.zeros((VOCAB, VOCAB)), jnp.zeros((VOCAB, 2, 2), jnp.int32), prompt, jnp.array([3]),
          jax.random.PRNGKey(0))
  decode = core.make_decode(model, expansion.TopK(lookup.PromptLookupDrafter(128), spine),
                            core.DecodeConfig(4))
  with pytest.raises(ValueError, match="lenience .* is a property of chain rejection"):
    decode(random_decoder_params(TINY), None, prompt, jnp.array([3]), jax.random.PRNGKey(0), 1.0,
           1.0, 0.5)
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    decode(random_decoder_params(TINY), None, prompt, jnp.array([3]), jax.random.PRNGKey(0), -1.0)
  with pytest.raises(ValueError, match="top_p must lie in"):
    decode(random_decoder_params(TINY), None, prompt, jnp.array([3]), jax.random.PRNGKey(0), 1.0,
           1.5)


def test_top_ids_equal_lax_top_k():
  scores = jax.random.normal(jax.random.PRNGKey(0), (5, 300))
  scores = scores.at[:, 7].set(scores[:, 3])  # a tie: the lower id first, as lax.top_k
  for width in (1, 3, 6):
    np.testing.assert_array_equal(sampling.top_ids(scores, width), jax.lax.top_k(scores, width)[1])


def test_lookup_in_front_copies_the_repeated_span():
  """Where the context repeats, prompt lookup puts the tokens that followed the earlier occurrence at
  rank 0 of each depth and the inner drafter's candidates behind them; elsewhere only the inner's."""
  inner = TableTreeDrafter(trees.Tree.full([3, 3, 3]))
  table = np.tile(np.arange(3, 6, dtype=np.int32)[None, None, :], (VOCAB, 3, 1))  # ranks 3, 4, 5
  drafter = lookup.TreeLookupFront(inner, max_ngram=2, min_ngram=2)
  history = jnp.asarray([[0, 1, 2, 0, 1, 0, 0, 0], [5, 4, 3, 2, 1, 0, 0, 0]], jnp.int32)
  position = jnp.asarray([4, 4], jnp.int32)  # row 0 ends with "0 1", seen at 0..1 followed by 2, 0, 1
  context = contracts.DraftContext(history, position)
  candidates, _ = drafter.candidates(jnp.asarray(table), None, context, 3, 3)
  np.testing.assert_array_equal(candidates[0], [[2, 3, 4], [0, 3, 4], [1, 3, 4]])
  np.testing.assert_array_equal(candidates[1], [[3, 4, 5]] * 3)
