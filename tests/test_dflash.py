"""The DFlash block drafter on the tiny trained target of test_heads: the features it reads are the
target's hidden states after the named blocks, the training mask is the inference mask, training
helps and resumes exactly, the drafter knows its target, and the loop stays lossless with either
temperature rule."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import contracts
from specjax.decoding import acceptance, autoregressive, core, sampling
from specjax.decoding.tree import Tree
from specjax.drafters import dflash, heads, registry
from specjax.models import decoder_only
from specjax.training import dflash as train_dflash
from specjax.training import heads as train_heads
from specjax.training import trainer

import test_heads
import test_speculative
from test_heads import TARGET, cache  # pylint: disable=unused-import  # the fixture

DFLASH = train_dflash.DFlashSpec(block_size=5, num_layers=1, num_features=2, mask_token=1,
                                 head_size=40, anchors=6, sequence_length=40, prefill_tokens=256,
                                 prefill_bucket=16, distill_weight=1.0)
SPEC = trainer.TrainSpec(steps=400, tokens_per_batch=640, learning_rate=3e-3, warmup_steps=10,
                         checkpoint_every=100, validation_fraction=0.2)


def _train(output_dir, spec=SPEC, stop_after_step=None, target_params=None):
  params, train, val = test_heads._setup()
  return train_dflash.train_on_sequences(
      output_dir, None, TARGET, params if target_params is None else target_params, train, val,
      DFLASH, spec, seed=0, stop_after_step=stop_after_step)


def test_feature_blocks_follow_the_papers_spacing():
  # SmolLM2's 30 blocks: 1, 7.5 -> 8 (banker's rounding of 7.5 is 8), 14, 20.5 -> 20, 27.
  assert dflash.feature_blocks(30) == (1, 8, 14, 20, 27)
  assert dflash.feature_blocks(36) == (1, 9, 17, 25, 33)   # Qwen3-8B's, as the paper lists them
  assert dflash.feature_blocks(2, 2) == (0, 1)


def test_features_are_the_residual_stream_after_each_named_block():
  """Oracle: the first k + 1 blocks as a model of their own (truncate_layers) end in the final norm
  of the stream after block k, so RMSNorm(feature after block k) must equal that model's final-norm
  state. Reading a block's INPUT instead (one block early) fails this by far."""
  params = test_heads._setup()[0]
  _, train, _ = test_heads._setup()
  seqs = train.subset(np.arange(6))
  after = train_heads.target_features(TARGET, params, seqs, 256, 16,
                                      contracts.FeatureSpec(blocks=(0, 1))).astype(np.float32)
  for block in range(TARGET.num_layers):
    config, kept = decoder_only.truncate_layers(TARGET, params, block + 1)
    final = train_heads.target_features(config, kept, seqs, 256, 16).astype(np.float32)
    stream = after[:, block * TARGET.embed_dim:(block + 1) * TARGET.embed_dim]
    normed = stream / np.sqrt(np.mean(stream ** 2, -1, keepdims=True) + TARGET.norm_eps)
    normed *= np.asarray(params["final_norm"]["scale"])
    np.testing.assert_allclose(normed, final, atol=2e-2, rtol=2e-2)  # both rounded to float16


def test_training_visibility_is_block_diagonal_and_strictly_before_the_anchor():
  context, block = dflash.training_visibility(jnp.asarray([[3, 1]]), 2, 5)
  expected_context = np.array([[1, 1, 1, 0, 0]] * 2 + [[1, 0, 0, 0, 0]] * 2, bool)
  expected_block = np.kron(np.eye(2, dtype=int), np.ones((2, 2), int)).astype(bool)
  np.testing.assert_array_equal(np.asarray(context[0]), expected_context)
  np.testing.assert_array_equal(np.asarray(block[0]), expected_block)


def _random_drafter(seed=3):
  config = dflash.DFlashConfig.for_target(TARGET, DFLASH.block_size, 2, 2, mask_token=1)
  params = jax.tree_util.tree_map(lambda x: x * 10.0 if x.ndim == 2 else x,
                                  dflash.init_params(config, jax.random.PRNGKey(seed)))
  return config, params


def test_a_decode_time_block_scores_what_training_scored_for_it():
  """Training scores three blocks of one sequence in one pass; the drafter at decode time runs one
  block with its context cache filled from the prompt's features and one window: the same logits
  (so the training mask is the inference mask: nothing of another block or of a later position
  leaks into training)."""
  target_params, train, _ = test_heads._setup()
  config, params = _random_drafter()
  seq = train.subset(np.arange(1))
  features = train_heads.target_features(TARGET, target_params, seq, 256, 16,
                                         config.features).astype(np.float32)
  tokens = seq.tokens[None].astype(np.int32)
  length = tokens.shape[1]
  anchors = np.array([[9, 4, 14]], np.int32)
  frozen = {"head_rows": target_params["embedding"][:40], "embed_rows": target_params["embedding"],
            "index_map": np.arange(128, dtype=np.int32)}
  batch = {"tokens": tokens, "features": features[None], "lengths": np.array([length]),
           "anchors": anchors, "valid": np.ones_like(anchors, bool)}
  trained, _, _ = train_dflash.block_terms(config, params, frozen, batch)
  drafter = dflash.DFlashDrafter(config, Tree.chain(config.block_size - 1))
  draft_params = {"dflash": jax.tree_util.tree_map(jnp.asarray, params), "head_rows":
                  frozen["head_rows"], "head_tokens": jnp.arange(40), "embed_rows":
                  target_params["embedding"]}
  for m, anchor in enumerate(anchors[0]):
    window = 2  # the prompt fills the cache up to anchor - window; the window brings the rest
    state = drafter.init(draft_params, tokens[:, :anchor - window], None, 32,
                         features=features[None, :anchor - window])
    context = contracts.DraftContext(
        history=jnp.asarray(np.pad(tokens, ((0, 0), (0, 32 - length)))),
        position=jnp.asarray([anchor]), features=jnp.asarray(features[None, anchor - window:anchor]),
        feature_count=jnp.asarray([window]))
    logits, _ = drafter.block(draft_params, state, context)
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(trained[0, m]), atol=1e-4,
                               rtol=1e-4)


def test_training_lowers_held_out_loss_and_the_loop_keeps_its_blocks(tmp_path, cache):
  summary = _train(tmp_path / "dflash")
  before, after = summary["validation_before"], summary["validation_after"]
  assert after["loss"] < 0.5 * before["loss"], (before, after)
  # The tiny language continues by a fixed permutation 90 % of the time: a trained block gets most
  # of its 4 tokens right (0.9^k per position at best), an untrained one none.
  assert before["tokens_per_call"] < 1.2 and after["tokens_per_call"] > 2.5, (before, after)
  target_params, _, val = test_heads._setup()
  model = decoder_only.model(TARGET)
  prompts, lengths = _held_out_prompts(val)
  expected = autoregressive.make_generate(model, autoregressive.DecodeShape(32))(
      target_params, prompts, lengths, jax.random.PRNGKey(0), 0.0)
  for sample in (False, True):
    drafter, params = dflash.load(tmp_path / "dflash" / "dflash", TARGET, target_params,
                                  Tree.chain(4), sample=sample)
    assert isinstance(drafter, dflash.SampledDFlash if sample else dflash.DFlashDrafter)
    out = core.make_decode(model, drafter, core.DecodeConfig(32))(
        target_params, params, prompts, lengths, jax.random.PRNGKey(0), 0.0)
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    tokens_per_call = (np.asarray(out.num_generated) - 1).sum() / (8 * int(out.target_calls))
    assert tokens_per_call > 3.0, (sample, tokens_per_call)
  # The registry builds it by name, for a spine tree too.
  spec = f"dflash:{tmp_path / 'dflash' / 'dflash'}"
  made, _ = registry.build(spec, registry.Target(TARGET, target_params), Tree.from_name("spine:4x2"))
  assert isinstance(made, dflash.DFlashDrafter) and made.tree.width == 2
  _replay_sampled_chain(tmp_path / "dflash" / "dflash", target_params, prompts, lengths)


def _replay_sampled_chain(directory, target_params, prompts, lengths, gamma=4, max_new=24):
  """The loop with the trained SampledDFlash at temperature 1 and 0.7 equals a row-by-row replay
  with the loop's uniforms that keeps no cache: every iteration recomputes the target's features
  and probabilities by a teacher-forced pass over the whole sequence, the drafter's block from those
  features, draws the draft by inverse CDF and runs chain rejection (Leviathan Alg. 1) in numpy."""
  drafter, params = dflash.load(directory, TARGET, target_params, Tree.chain(gamma), sample=True)
  config, inner = drafter.config, params["dflash"]
  model = decoder_only.model(TARGET)
  fn = core.make_decode(model, drafter, core.DecodeConfig(max_new, pad_id=-1))
  rows = prompts.shape[0]

  # Both passes run on sequences padded to one length, so each compiles once: the target is causal
  # and the block sees context slots before its root only, so the padding changes nothing they read.
  padded_length = prompts.shape[1] + max_new + gamma + 1

  @jax.jit
  def padded_passes(tokens, root, temperature):
    """tokens[L] (a sequence, zero-padded) -> (the target's probabilities at every position [L, V],
    the drafter's for the block rooted at tokens[root] over the context of every earlier position
    [gamma, V])."""
    positions = jnp.arange(padded_length, dtype=jnp.int32)[None]
    logits, features, _ = model.forward(target_params, None, tokens[None], positions,
                                        model.init_cache(1, padded_length),
                                        features=config.features)
    context = dflash.project_context(config, inner, features)
    cached = dflash.context_kv(config, inner, context, positions)
    block = dflash.block_tokens(config, tokens[root][None])
    context_visible, block_visible = dflash.visibility(root[None], config.block_size,
                                                       padded_length)
    hidden = dflash.block_hidden(config, inner, params["embed_rows"][block],
                                 root + jnp.arange(config.block_size, dtype=jnp.int32)[None],
                                 cached, context_visible, block_visible)
    block_logits = dflash.block_logits(config, inner, params["head_rows"], hidden)[0, :gamma]
    full = jnp.full((gamma, TARGET.vocab_size), -jnp.inf, jnp.float32)
    full = full.at[:, params["head_tokens"]].set(block_logits)
    transform = lambda x: sampling.probs_from_logits(x, temperature=temperature)
    return transform(logits[0]), transform(full)

  def passes(seq, temperature):
    """(target probabilities after each position of seq [len(seq), V], the drafter's block rooted
    at seq[-1] [gamma, V]), float64."""
    tokens = np.zeros(padded_length, np.int32)
    tokens[:len(seq)] = seq
    target, draft = padded_passes(jnp.asarray(tokens), jnp.int32(len(seq) - 1), temperature)
    return np.asarray(target, np.float64)[:len(seq)], np.asarray(draft, np.float64)

  multi_token_calls = 0
  for seed, temperature in enumerate((1.0, 0.7)):
    rng = jax.random.PRNGKey(100 + seed)
    out = fn(target_params, params, prompts, lengths, rng, temperature)
    first_u = np.asarray(core.first_token_uniform(rng, rows))
    draft_u, accept_u, resample_u = (np.asarray(u) for u in test_speculative._all_uniforms(
        rng, jnp.arange(max_new), rows, gamma))
    for b in range(rows):
      seq = prompts[b, :lengths[b]].tolist()
      out_b = [test_speculative._inverse_cdf(first_u[b], passes(seq, temperature)[0][-1])]
      iteration = 0
      while len(out_b) < max_new:
        seq_b = seq + out_b
        q = passes(seq_b, temperature)[1]
        drafts = [test_speculative._inverse_cdf(draft_u[iteration, b, i], q[i])
                  for i in range(gamma)]
        p = passes(seq_b + drafts, temperature)[0][len(seq_b) - 1:]
        n = 0
        while n < gamma and accept_u[iteration, b, n] * q[n][drafts[n]] < p[n][drafts[n]]:
          n += 1
        if n < gamma:
          residual = np.maximum(p[n] - q[n], 0)
          if residual.sum() <= acceptance.RESIDUAL_FLOOR:
            residual = p[n]
          nxt = test_speculative._inverse_cdf(resample_u[iteration, b], residual)
        else:
          nxt = test_speculative._inverse_cdf(resample_u[iteration, b], p[gamma])
        multi_token_calls += n >= 2
        out_b = (out_b + drafts[:n] + [nxt])[:max_new]
        iteration += 1
      got = np.asarray(out.tokens[b])
      assert got.tolist() == out_b, (temperature, b)
  assert multi_token_calls > 0  # the replay covered calls that kept several drafted tokens


def _held_out_prompts(val, rows=8, width=6):
  """The first `width` tokens of held-out sequences (the language's text; every sequence is longer)."""
  prompts = np.stack([val.tokens[val.offsets[row]:val.offsets[row] + width] for row in range(rows)])
  return prompts.astype(np.int32), np.full((rows,), width, np.int32)


@pytest.mark.parametrize("sample", [False, True])
def test_sampled_output_follows_the_targets_law(sample):
  """Temperature 1 with a random (unrelated, so often rejected) drafter: each of the first 6 output
  positions of 3,000 rows against 3,000 rows of the target's own sampling, a two-sample chi-square
  over the tokens either saw (p < 1e-6 fails: 6 positions x 2 rules, false-failure rate < 1.2e-5
  over seeds; the seeds are fixed, so the outcome is too). The released rule (point masses, the
  tree walk) and rejection with the drafter's own distribution must both give the target's law."""
  target_params, _, val = test_heads._setup()
  config, params = _random_drafter()
  draft_params = {"dflash": jax.tree_util.tree_map(jnp.asarray, params),
                  "head_rows": target_params["embedding"][16:56], "head_tokens": jnp.arange(16, 56),
                  "embed_rows": target_params["embedding"]}
  drafter = (dflash.SampledDFlash(config, 4, TARGET.vocab_size) if sample
             else dflash.DFlashDrafter(config, Tree.chain(4)))
  assert_follows_targets_law(drafter, draft_params, jax.random.PRNGKey(11 + sample))


def assert_follows_targets_law(drafter, draft_params, key, rows=3000, steps=6):
  """The loop at temperature 1 from one held-out prompt, `rows` times: each of the first `steps`
  output positions against `rows` of the target's own sampling, a two-sample chi-square over the
  tokens either saw (p < 1e-6 fails)."""
  target_params, _, val = test_heads._setup()
  prompt, length = _held_out_prompts(val, 1)
  prompts, lengths = np.repeat(prompt, rows, 0), np.repeat(length, rows)
  model = decoder_only.model(TARGET)
  out = core.make_decode(model, drafter, core.DecodeConfig(steps))(
      target_params, draft_params, prompts, lengths, jax.random.split(key, rows), 1.0)
  plain = autoregressive.make_generate(model, autoregressive.DecodeShape(steps))(
      target_params, prompts, lengths, jax.random.split(jax.random.PRNGKey(99), rows), 1.0)
  accepted = np.asarray(out.stats.num_accepted)
  assert accepted.max() >= 1  # the drafter's tokens do get kept sometimes
  for position in range(steps):
    a = np.bincount(np.asarray(out.tokens)[:, position], minlength=TARGET.vocab_size)
    b = np.bincount(np.asarray(plain.tokens)[:, position], minlength=TARGET.vocab_size)
    seen = (a + b) > 0
    if seen.sum() > 1:
      assert stats.chi2_contingency(np.stack([a[seen], b[seen]])).pvalue > 1e-6, position


def test_an_interrupted_run_resumes_to_the_same_drafter(tmp_path, cache):
  assert_resumes_exactly(_train, tmp_path, dflash.KIND, dflash.WEIGHTS_FILE)


def assert_resumes_exactly(train, tmp_path, kind, weights_file):
  """20 steps straight against 13, stopped, then resumed: the same saved weights, bit for bit."""
  spec = dataclasses.replace(SPEC, steps=20, checkpoint_every=10)
  train(tmp_path / "straight", spec)
  assert train(tmp_path / "resumed", spec, stop_after_step=13) == {"stopped_after_step": 13}
  train(tmp_path / "resumed", spec)
  with np.load(tmp_path / "straight" / kind / weights_file) as a, \
       np.load(tmp_path / "resumed" / kind / weights_file) as b:
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
      np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_drafter_refuses_a_target_it_was_not_trained_for(tmp_path):
  target_params = test_heads._setup()[0]
  config, params = _random_drafter()
  directory = dflash.save(tmp_path / "d", params, config, np.arange(40), TARGET,
                          heads.target_fingerprint(TARGET, target_params))
  dflash.load(directory, TARGET, target_params, Tree.chain(4))  # its own target: fine
  other = jax.tree_util.tree_map(lambda x: x * 1.01, target_params)
  with pytest.raises(ValueError, match="trained for another target"):
    dflash.load(directory, TARGET, other, Tree.chain(4))
  with pytest.raises(ValueError, match="holds a dflash drafter.*dflash:"):
    heads.load_heads(directory, TARGET, target_params, Tree.chain(2))


def test_a_tree_deeper_than_the_block_is_refused_before_any_work(tmp_path):
  """A drafter trained with blocks of 5 proposes 4 tokens: a deeper tree or gamma is refused by the
  registry, by both sweeps' grids and by generation before anything is loaded or written."""
  from experiments import speculative_sweep, tree_sweep  # pylint: disable=import-outside-toplevel
  from specjax import generation  # pylint: disable=import-outside-toplevel
  config, params = _random_drafter()
  assert config.block_size == 5
  name = f"dflash:{dflash.save(tmp_path / 'd', params, config, np.arange(40), TARGET, 'any')}"
  registry.check_tree(name, Tree.chain(4))
  registry.check_tree(name, Tree.from_name("spine:4x3"))
  output_dir = tmp_path / "generate"
  for refused in (
      lambda: registry.check_tree(name, Tree.chain(5)),
      lambda: tree_sweep.TreeSweepSpec(drafters=(name,), trees=("chain:4", "spine:5x2")).points(),
      lambda: speculative_sweep.SweepSpec(drafters=(name,), gammas=(2, 5)).points(),
      lambda: speculative_sweep.SweepSpec(drafters=(name,), gammas=(2,), leniences=(1.0, 0.5),
                                          lenience_gammas=(6,)).points(),
      lambda: generation.Generate(output_dir=str(output_dir), drafter=name, gamma=5)()):
    with pytest.raises(ValueError, match=r"trained with block_size=5 and proposes 4 tokens per "
                                         r"block; draft a tree of depth <= 4"):
      refused()
  assert not output_dir.exists()


def test_blocks_are_rooted_only_where_the_target_wrote_what_follows():
  """A greedy sequence scores its prompt too (loss_from 0): its response starts where the tokens
  begin to follow the target's own argmax to the end, at or before the prompt's last token; a
  sampled one names its start. Every anchor the batches draw lies there or later."""
  _, train, _ = test_heads._setup()
  for i in range(len(train)):
    start = train_dflash.response_start(train, i)
    lo, hi = int(train.offsets[i]), int(train.offsets[i + 1])
    following = train.tokens[lo + 1:hi] == train.teacher_ids[lo:hi - 1, 0]
    if train.loss_from[i]:  # sampled: the last prompt token roots the first block
      assert start == train.loss_from[i], i
    else:  # greedy: the longest run that follows the argmax to the end, reaching into the prompt
      assert following[start:].all() and (start == 0 or not following[start - 1]), i
      assert start <= 9, i  # the prompts hold 3-9 tokens
  windows = train_dflash.Windows.of(train, np.zeros((int(train.offsets[-1]), 1), np.float16), 40)
  batch = train_dflash.Batches(windows, 4, 6, seed=0)(3)
  first = np.asarray([windows.first[np.flatnonzero((windows.tokens == row).all(1))[0]]
                      for row in batch["tokens"]])
  assert (batch["anchors"] >= first[:, None]).all()
  assert (batch["anchors"] < batch["lengths"][:, None] - 1).all()


def test_the_distilled_label_of_a_block_position_is_the_targets_distribution_before_it():
  """Block position k is distilled towards the target's top-k at anchor + k - 1 (the position that
  predicts the token at anchor + k). In a greedy sequence's response every token IS the target's
  argmax there, so the teacher's most probable column must equal the token's column at every
  labelled position; one position off, it would not."""
  _, train, _ = test_heads._setup()
  greedy = np.flatnonzero(train.loss_from == 0)[:4]
  assert len(greedy) == 4
  windows = train_dflash.Windows.of(train.subset(greedy),
                                    np.zeros((int(train.offsets[-1]), 1), np.float16), 40)
  batch = train_dflash.batch_of(windows, np.arange(4), 6, np.random.default_rng(0))
  index_map = jnp.arange(TARGET.vocab_size, dtype=jnp.int32)  # every token on the head
  frozen = {"index_map": index_map}
  ahead = batch["anchors"][:, :, None] + np.arange(1, DFLASH.block_size)
  labelled = (ahead < batch["lengths"][:, None, None]) & batch["valid"][:, :, None]
  columns, probs = train_dflash.teacher_terms(frozen, batch, jnp.asarray(labelled))
  best = np.take_along_axis(np.asarray(columns), np.asarray(probs).argmax(-1)[..., None], -1)[..., 0]
  tokens = np.take_along_axis(batch["tokens"], np.minimum(ahead, 39).reshape(4, -1), 1).reshape(
      ahead.shape)
  assert labelled.sum() > 50
  np.testing.assert_array_equal(best[labelled], tokens[labelled])
  assert (np.asarray(columns)[~labelled] == -1).all()
  mass = np.asarray(probs).sum(-1)[labelled]  # the target's top-k: most of its probability
  assert (mass > 0.5).all() and (mass <= 1.001).all()
