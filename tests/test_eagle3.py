"""The EAGLE-3 drafter on the tiny trained target of test_heads: drafting along one path scores what
the training-time unroll scored for it, the dynamic tree is the best `nodes` of what was offered and
a tree, training helps and resumes exactly, the drafter knows its target, and the loop is lossless
(greedy token for token, temperature 1 in law)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import contracts
from specjax.decoding import autoregressive, core
from specjax.decoding import tree as trees
from specjax.decoding.tree import Tree
from specjax.drafters import eagle3, heads, registry
from specjax.models import decoder_only
from specjax.training import eagle3 as train_eagle3
from specjax.training import heads as train_heads
from specjax.training import trainer

import test_heads
from test_dflash import _held_out_prompts, assert_follows_targets_law, assert_resumes_exactly
from test_heads import TARGET, cache  # pylint: disable=unused-import  # the fixture

EAGLE = train_eagle3.Eagle3Spec(depth=4, head_size=40, anchors=6, sequence_length=40,
                                prefill_tokens=256, prefill_bucket=16)
SPEC = trainer.TrainSpec(steps=300, tokens_per_batch=640, learning_rate=3e-3, warmup_steps=10,
                         checkpoint_every=100, validation_fraction=0.2)


def _train(output_dir, spec=SPEC, stop_after_step=None):
  params, train, val = test_heads._setup()
  return train_eagle3.train_on_sequences(output_dir, None, TARGET, params, train, val, EAGLE, spec,
                                         seed=0, stop_after_step=stop_after_step)


def _random_drafter(target_params, seed=3, head=slice(0, 40)):
  config = eagle3.Eagle3Config.for_target(TARGET)
  params = jax.tree_util.tree_map(lambda x: x * 10.0 if x.ndim == 2 else x,
                                  eagle3.init_params(config, jax.random.PRNGKey(seed)))
  tokens = jnp.arange(TARGET.vocab_size)[head]
  draft_params = {"eagle3": jax.tree_util.tree_map(jnp.asarray, params),
                  "head_rows": target_params["embedding"][tokens], "head_tokens": tokens,
                  "embed_rows": target_params["embedding"]}
  return config, params, draft_params


def test_feature_blocks_are_low_middle_and_high():
  assert eagle3.feature_blocks(30) == (1, 14, 26)  # SmolLM2: the inputs of layers 2, 15 and 27
  assert eagle3.feature_blocks(32) == (1, 15, 28)  # Llama-3.1-8B's, as EAGLE-3 reads them
  assert eagle3.feature_blocks(2) == (0, 1)


def test_dynamic_tree_names_and_refusals(tmp_path):
  tree = Tree.from_name("dynamic:12,4,3")
  assert (tree.size, tree.depth, tree.top_k, tree.name) == (13, 4, 3, "dynamic:12,4,3")
  assert not tree.is_chain and Tree.dynamic(4, 4, 1) != Tree.chain(4)
  with pytest.raises(ValueError, match="holds 4 to 30 candidates"):
    Tree.dynamic(31, 4, 3)
  with pytest.raises(ValueError, match="dynamic:N,D,K"):
    Tree.from_name("dynamic:12,4")
  with pytest.raises(ValueError, match="grown by a drafter"):
    registry.build("unigram", registry.Target(TARGET, sequences=[[1, 2, 3]]), tree)
  # A sweep's grid refuses each pair no drafter of that kind can draft, before anything loads.
  from experiments import tree_sweep  # pylint: disable=import-outside-toplevel
  for drafters, trees_, match in (((f"mtp:{tmp_path}",), ("chain:3", tree.name), "grown by a drafter"),
                                  ((f"lookup+eagle3:{tmp_path}",), (tree.name,), "grown by a drafter"),
                                  ((f"eagle3:{tmp_path}",), ("spine:3x2",), "grows its own tree"),
                                  ((f"lookup+eagle3:{tmp_path}",), ("spine:3x2",), "drafts a chain")):
    with pytest.raises(ValueError, match=match):
      tree_sweep.TreeSweepSpec(drafters=drafters, trees=trees_).points()
  tree_sweep.TreeSweepSpec(drafters=(f"eagle3:{tmp_path}",), trees=(tree.name, "chain:4")).points()


def test_the_tree_is_the_best_nodes_offered_with_every_parent():
  """Oracle: numpy. Scores are sums of log-probabilities along each offered path (a child never
  above its parent, ties included); the chosen set must be the `nodes` highest scores (ties to the
  earlier offered, so a parent before its child), each node's parent chosen and numbered before
  it, and the depths those of the offer."""
  rng = np.random.default_rng(0)
  k, depth, nodes, batch = 3, 4, 10, 50
  # The offer as Eagle3Drafter.grow lays it out: depth 1's k nodes, then k * k per depth.
  depths = np.concatenate([np.full(k, 1)] + [np.full(k * k, d) for d in range(2, depth + 1)])
  offer = len(depths)
  parents = np.full((batch, offer), -1)
  scores = np.zeros((batch, offer), np.float32)
  scores[:, :k] = np.log(rng.dirichlet(np.ones(k), batch))
  base = k
  for d in range(2, depth + 1):  # each level: k beams (random offered nodes of the level above)
    above = np.flatnonzero(depths == d - 1)
    for b in range(batch):
      beams = rng.choice(above, k, replace=False)
      parents[b, base:base + k * k] = np.repeat(beams, k)
      logp = np.log(rng.dirichlet(np.ones(k) * 0.3, k)).reshape(-1)
      logp[rng.random(k * k) < 0.1] = 0.0  # certain children tie with their parent
      scores[b, base:base + k * k] = scores[b, parents[b, base:base + k * k]] + logp
    base += k * k
  chosen, tree_parents = jax.jit(eagle3.pick_tree, static_argnums=2)(
      jnp.asarray(scores), jnp.asarray(parents, jnp.int32), nodes)
  chosen, tree_parents = np.asarray(chosen), np.asarray(tree_parents)
  for b in range(batch):
    order = np.argsort(-scores[b], kind="stable")[:nodes]  # ties: the lower offer index
    np.testing.assert_array_equal(chosen[b], np.sort(order))
    assert tree_parents[b, 0] == -1
    for i, offered in enumerate(chosen[b], start=1):
      parent = tree_parents[b, i]
      assert 0 <= parent < i
      assert (parents[b, offered] == -1) == (parent == 0)
      if parent:
        assert chosen[b][parent - 1] == parents[b, offered]
    np.testing.assert_array_equal(trees.depths(tree_parents[b])[1:], depths[chosen[b]])


def test_drafting_scores_what_training_scored_for_each_depth():
  """The drafter's top-1 chain, rooted after a prompt whose last entries arrive as a window,
  against the training-time unroll teacher-forced on those very tokens: the same logits at every
  depth (so the training visibility is the drafting one)."""
  target_params, train, _ = test_heads._setup()
  config, params, draft_params = _random_drafter(target_params)
  seq = train.subset(np.arange(1))
  features = train_heads.target_features(TARGET, target_params, seq, 256, 16,
                                         config.features).astype(np.float32)
  depth, window, root, size = 4, 2, 11, 40
  drafter = eagle3.Eagle3Drafter(config, Tree.chain(depth))
  tokens = np.asarray(seq.tokens[:root + 1], np.int32)[None]
  state = drafter.init(draft_params, tokens[:, :root - window + 1],
                       jnp.asarray([root - window + 1]), size,
                       features=features[None, :root - window + 1])
  history = np.zeros((1, size), np.int32)
  history[0, :root + 1] = tokens[0]
  context = contracts.DraftContext(
      history=jnp.asarray(history), position=jnp.asarray([root]),
      features=jnp.asarray(features[None, root - window:root]), feature_count=jnp.asarray([window]))
  drafted, _, _, _ = drafter.grow(draft_params, state, context)
  # Training sees the drafted tokens as the sequence's continuation.
  forced = np.concatenate([tokens[0], np.asarray(drafted[0]), [0]])[None].astype(np.int32)
  frozen = {"head_rows": draft_params["head_rows"], "embed_rows": target_params["embedding"],
            "index_map": np.arange(128, dtype=np.int32)}
  batch = {"tokens": forced, "features": np.pad(features[None, :root + 1],
                                                ((0, 0), (0, forced.shape[1] - root - 1), (0, 0))),
           "lengths": np.array([forced.shape[1]]), "anchors": np.array([[root]], np.int32),
           "valid": np.ones((1, 1), bool)}
  trained, _, _ = train_eagle3.unroll_terms(config, params, frozen, batch, depth)
  assert np.asarray(trained).shape == (1, 1, depth, 40)
  np.testing.assert_array_equal(np.asarray(trained[0, 0]).argmax(-1),
                                np.asarray(drafted[0]) - 0)  # head tokens are 0 .. 39
  # Logits, not only argmaxes: drafting's depth d equals the unroll's.
  cfg, inner = config, draft_params["eagle3"]
  hidden, _ = drafter.root(draft_params, state, context)
  np.testing.assert_allclose(np.asarray(eagle3.logits(cfg, inner, draft_params["head_rows"],
                                                      hidden))[0], np.asarray(trained[0, 0, 0]),
                             atol=1e-4, rtol=1e-4)


def test_training_lowers_held_out_loss_and_the_loop_keeps_its_tokens(tmp_path, cache):
  summary = _train(tmp_path / "eagle3")
  before, after = summary["validation_before"], summary["validation_after"]
  assert after["loss"] < 0.5 * before["loss"], (before, after)
  # The tiny language continues by a fixed permutation 90 % of the time: a trained drafter gets
  # most of its 4 depths right, an untrained one none.
  assert before["tokens_per_call"] < 1.2 and after["tokens_per_call"] > 2.5, (before, after)
  target_params, _, val = test_heads._setup()
  model = decoder_only.model(TARGET)
  prompts, lengths = _held_out_prompts(val)
  expected = autoregressive.make_generate(model, autoregressive.DecodeShape(32))(
      target_params, prompts, lengths, jax.random.PRNGKey(0), 0.0)
  directory = tmp_path / "eagle3" / "eagle3"
  for name, tree in ((f"eagle3:{directory}", Tree.chain(4)),
                     (f"lookup+eagle3:{directory}", Tree.chain(4)),
                     (f"eagle3:{directory}", Tree.dynamic(8, 4, 3))):
    drafter, params = registry.build(name, registry.Target(TARGET, target_params), tree)
    out = core.make_decode(model, drafter, core.DecodeConfig(32))(
        target_params, params, prompts, lengths, jax.random.PRNGKey(0), 0.0)
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    tokens_per_call = (np.asarray(out.num_generated) - 1).sum() / (8 * int(out.target_calls))
    assert tokens_per_call > 3.0, (name, tree.name, tokens_per_call)
  with pytest.raises(ValueError, match="grown by a drafter"):  # lookup in front ranks a static tree
    registry.build(f"lookup+eagle3:{directory}", registry.Target(TARGET, target_params),
                   Tree.dynamic(8, 4, 3))
  with pytest.raises(ValueError, match="grows its own tree"):
    registry.build(f"eagle3:{directory}", registry.Target(TARGET, target_params),
                   Tree.from_name("spine:4x2"))


@pytest.mark.parametrize("tree_name", ["chain:4", "dynamic:8,4,3"])
def test_sampled_output_follows_the_targets_law(tree_name):
  """Temperature 1 with a random (unrelated, so often rejected) drafter: each of the first 6 output
  positions of 3,000 rows against 3,000 rows of the target's own sampling, a two-sample chi-square
  over the tokens either saw (p < 1e-6 fails: 6 positions x 2 trees, false-failure rate < 1.2e-5
  over seeds; the seeds are fixed, so the outcome is too)."""
  target_params = test_heads._setup()[0]
  _, _, draft_params = _random_drafter(target_params, head=slice(16, 56))
  drafter = eagle3.Eagle3Drafter(eagle3.Eagle3Config.for_target(TARGET), Tree.from_name(tree_name))
  assert_follows_targets_law(drafter, draft_params, jax.random.PRNGKey(21))


def test_an_interrupted_run_resumes_to_the_same_drafter(tmp_path, cache):
  assert_resumes_exactly(_train, tmp_path, eagle3.KIND, eagle3.WEIGHTS_FILE)


def test_a_drafter_refuses_a_target_it_was_not_trained_for(tmp_path):
  target_params = test_heads._setup()[0]
  config, params, _ = _random_drafter(target_params)
  directory = eagle3.save(tmp_path / "d", params, config, np.arange(40), TARGET,
                          heads.target_fingerprint(TARGET, target_params))
  eagle3.load(directory, TARGET, target_params, Tree.chain(4))  # its own target: fine
  other = jax.tree_util.tree_map(lambda x: x * 1.01, target_params)
  with pytest.raises(ValueError, match="trained for another target"):
    eagle3.load(directory, TARGET, other, Tree.chain(4))
  with pytest.raises(ValueError, match="holds eagle3 heads.*eagle3:"):
    from specjax.drafters import dflash
    dflash.load(directory, TARGET, target_params, Tree.chain(4))
