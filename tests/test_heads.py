"""Medusa-1 heads on a tiny random target: training helps, resumes exactly, heads know their target,
and the tree drafter's candidates are the heads' own ranking."""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import random_decoder_params, random_t5_params
from specjax import contracts
from specjax.decoding import autoregressive, core
from specjax.decoding.tree import Tree
from specjax.drafters import heads, mtp
from specjax.training import heads as train_heads
from specjax.training import teacher, trainer
from specjax.models import decoder_only, t5

TARGET = decoder_only.SIZES["tiny"]  # vocab 128, width 64
HEADS = train_heads.HeadsSpec(num_heads=3, head_size=40, top_width=4, prefill_tokens=256,
                              prefill_bucket=16)
SPEC = trainer.TrainSpec(steps=150, tokens_per_batch=256, learning_rate=1e-2, warmup_steps=10,
                          checkpoint_every=50, validation_fraction=0.2)


# The tiny target is trained (a few seconds) on a language whose next token is a fixed permutation of
# 32 tokens, 10 % of the time a random one: its greedy continuations follow the permutation, so the
# token two or more places ahead is predictable from its hidden state, while its own head (what an
# untrained head is) predicts the next token, almost never the one after.
ACTIVE = np.arange(16, 48)


def _language(count, length, permutation, rng, noise=0.1):
  out = np.zeros((count, length), np.int32)
  out[:, 0] = rng.choice(ACTIVE, count)
  for t in range(1, length):
    out[:, t] = np.where(rng.rand(count) < noise, rng.choice(ACTIVE, count),
                         permutation[out[:, t - 1]])
  return out


def _trained_target(steps=100):
  permutation = np.arange(128)
  permutation[ACTIVE] = np.random.RandomState(0).permutation(ACTIVE)
  step = decoder_only.make_step(TARGET)

  def loss_fn(params, tokens):
    rows, width = tokens.shape
    logits, _ = step(params, tokens, jnp.broadcast_to(jnp.arange(width), (rows, width)),
                     decoder_only.init_cache(TARGET, rows, width))
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

  optimizer = optax.adam(1e-2)
  update = trainer.make_train_step(loss_fn, optimizer)
  params = decoder_only.init_params(TARGET, jax.random.PRNGKey(0))
  state, rng = optimizer.init(params), np.random.RandomState(1)
  for _ in range(steps):
    params, state, _ = update(params, state, _language(32, 24, permutation, rng))
  return jax.device_get(params)


@functools.lru_cache(maxsize=None)
def _setup():
  """The trained tiny target's own continuations (greedy and sampled) of prompts in its language,
  split by prompt."""
  target_params = _trained_target()
  rng = np.random.RandomState(2)
  prompts = [rng.choice(ACTIVE, rng.randint(3, 10)).tolist() for _ in range(80)]
  seqs = teacher.distil_targets(decoder_only.model(TARGET), target_params, prompts,
                                [str(p) for p in prompts], max_new_tokens=24, samples=1, top_k=8,
                                batch_size=16, eos_id=None, pad_id=0, seed=0)
  train, val = teacher.split_validation(seqs, SPEC.validation_fraction)
  return target_params, train, val


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  return tmp_path / "cache"


def _train(output_dir, spec=SPEC, heads_spec=HEADS, stop_after_step=None, target_params=None):
  params, train, val = _setup()
  return train_heads.train_on_sequences(output_dir, None, TARGET,
                                        params if target_params is None else target_params, train,
                                        val, heads_spec, spec, seed=0,
                                        stop_after_step=stop_after_step)


def test_hidden_states_are_the_targets_and_untrained_heads_are_its_head():
  target_params, train, _ = _setup()
  features = train_heads.target_features(TARGET, target_params, train, prefill_tokens=256, bucket=16)
  # The teacher's decoding recorded the same states (prompt positions from its prefill, new tokens
  # from its one-token steps) as teacher-forced prefill passes compute them, up to float16 rounding.
  assert train.hidden is not None and train.hidden.shape == features.shape
  np.testing.assert_allclose(train.hidden.astype(np.float32), features.astype(np.float32),
                             atol=2e-2, rtol=2e-3)
  first = slice(train.offsets[0], train.offsets[1])
  tokens = jnp.asarray(train.tokens[first])[None]
  logits, hidden, _ = decoder_only.make_forward(TARGET)(
      target_params, tokens, jnp.arange(tokens.shape[1])[None],
      decoder_only.init_cache(TARGET, 1, tokens.shape[1]),
      features=contracts.FeatureSpec(final_norm=True))
  np.testing.assert_allclose(features[first].astype(np.float32), np.asarray(hidden[0]), atol=2e-2,
                             rtol=2e-3)
  # Zero-initialised heads score exactly what the target scores for the next token.
  drafter_params = heads.drafter_params(heads.init_heads(2, TARGET.embed_dim), None, TARGET,
                                        target_params)
  own = heads.head_logits(drafter_params["heads"], drafter_params["head_rows"], hidden[0])
  for k in range(2):
    np.testing.assert_allclose(np.asarray(own[:, k]), np.asarray(logits[0]), atol=1e-4, rtol=1e-4)


def test_teacher_data_without_hidden_states_gets_them_from_prefill_once(tmp_path, cache,
                                                                        monkeypatch):
  # Teacher data cached before hidden states were recorded (no .hidden.npy beside the .npz) loads
  # with hidden None; training then computes them by prefill, caches them, and reuses that cache.
  target_params, train, val = _setup()
  path = tmp_path / "task-key.npz"
  train.save(path)
  assert teacher._hidden_path(path).exists()
  loaded = teacher.Sequences.load(path)
  np.testing.assert_array_equal(loaded.hidden, train.hidden)
  np.testing.assert_array_equal(loaded.tokens, train.tokens)
  teacher._hidden_path(path).unlink()
  assert teacher.Sequences.load(path).hidden is None
  bare = lambda s: dataclasses.replace(s, hidden=None)
  prefills = []
  prefill = train_heads.target_features
  monkeypatch.setattr(train_heads, "target_features",
                      lambda *args, **kwargs: prefills.append(1) or prefill(*args, **kwargs))
  for run in ("a", "b"):
    summary = train_heads.train_on_sequences(tmp_path / run, None, TARGET, target_params, bare(train),
                                             bare(val), HEADS, SPEC, seed=0, stop_after_step=2)
    assert summary["stopped_after_step"] == 2
  assert len(prefills) == 1 and len(list((cache / "heads_features").glob("*.npy"))) == 1


def test_position_examples_label_the_token_k_plus_one_ahead():
  seqs = teacher.Sequences(tokens=np.arange(100, 111, dtype=np.int32),
                           teacher_ids=np.zeros((11, 1), np.int32),
                           teacher_logp=np.zeros((11, 1), np.float32),
                           offsets=np.array([0, 6, 11]), loss_from=np.array([0, 2]),
                           group=np.array([1, 2]))
  index, labels = train_heads.position_examples(seqs, 3)
  # Sequence 0 (tokens 100..105): t = 0..3 train head 1; sequence 1 (106..110) from loss_from 2: t = 2.
  np.testing.assert_array_equal(index, [0, 1, 2, 3, 8])
  np.testing.assert_array_equal(labels, [[102, 103, 104], [103, 104, 105], [104, 105, -1],
                                         [105, -1, -1], [110, -1, -1]])


def test_training_lowers_held_out_loss_and_raises_top1(tmp_path, cache):
  summary = _train(tmp_path / "run")
  before, after = summary["validation_before"], summary["validation_after"]
  for name in before:
    assert after[name]["loss"] < 0.5 * before[name]["loss"], (name, before[name], after[name])
    assert before[name]["top1"] < 0.05 and after[name]["top1"] > 0.6, (name, before, after)
    assert after[name]["top4"] >= after[name]["top1"]
  # The hidden states came with the teacher data: no prefill pass cached any; the saved heads load
  # for this very target.
  assert not (cache / "heads_features").exists()
  target_params, _, _ = _setup()
  drafter, params = heads.load_heads(tmp_path / "run" / "heads", TARGET, target_params,
                                     Tree.chain(HEADS.num_heads))
  assert drafter.num_heads == HEADS.num_heads and params["head_tokens"].shape == (40,)
  meta = json.loads((tmp_path / "run" / "heads" / heads.METADATA_FILE).read_text())
  assert meta["validation"]["head_1"]["top1"] == pytest.approx(after["head_1"]["top1"])


def test_an_interrupted_run_resumes_to_the_same_heads(tmp_path, cache):
  """With the distillation term on, so that its path is trained (and resumed) too."""
  spec = dataclasses.replace(SPEC, steps=30, checkpoint_every=10)
  distilled = dataclasses.replace(HEADS, distill_weight=0.5)
  _train(tmp_path / "straight", spec, distilled)
  assert _train(tmp_path / "resumed", spec, distilled, stop_after_step=17) == {
      "stopped_after_step": 17}
  assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == ["10", "17"]
  _train(tmp_path / "resumed", spec, distilled)  # a new run: same data, resumes after step 17
  straight, tokens_a, _ = heads.read_heads(tmp_path / "straight" / "heads")
  resumed, tokens_b, _ = heads.read_heads(tmp_path / "resumed" / "heads")
  np.testing.assert_array_equal(tokens_a, tokens_b)
  for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_array_equal(a, b)
  assert any(np.any(leaf != 0) for leaf in jax.tree_util.tree_leaves(straight))


def _random_heads(num_heads, seed):
  rng = np.random.RandomState(seed)
  return {heads.head_name(k): {"kernel": (0.3 * rng.randn(64, 64)).astype(np.float32),
                               "bias": (0.3 * rng.randn(64)).astype(np.float32)}
          for k in range(1, num_heads + 1)}


def test_heads_refuse_a_target_they_were_not_trained_for(tmp_path):
  target_params, _, _ = _setup()
  fingerprint = heads.target_fingerprint(TARGET, target_params)
  heads.save_heads(tmp_path / "heads", _random_heads(2, 0), np.arange(10, 70), TARGET, fingerprint,
                   {"target": {"checkpoint": "tiny-seed-3"}})
  tree = Tree.spine(2, 3)
  heads.load_heads(tmp_path / "heads", TARGET, target_params, tree)  # its own target: fine
  other = random_decoder_params(TARGET, seed=4, scale=0.2)
  with pytest.raises(ValueError, match=r"another target \(tiny-seed-3\).*specjax.train"):
    heads.load_heads(tmp_path / "heads", TARGET, other, tree)
  # One weight changed anywhere (not the embedding) is another target too.
  nudged = jax.tree_util.tree_map(np.asarray, target_params)
  nudged["layers_1"]["mlp"] = jax.tree_util.tree_map(lambda x: x * 1.001, nudged["layers_1"]["mlp"])
  assert heads.target_fingerprint(TARGET, nudged) != fingerprint
  wider = dataclasses.replace(TARGET, vocab_size=256)
  with pytest.raises(ValueError, match="vocabulary 128 and width 64"):
    heads.load_heads(tmp_path / "heads", wider, random_decoder_params(wider, seed=0), tree)
  t5_config = t5.SIZES["tiny"]  # an encoder-decoder target: no heads exist for it
  with pytest.raises(ValueError, match="decoder-only targets only.*chain drafter's top-k"):
    heads.load_heads(tmp_path / "heads", t5_config, random_t5_params(t5_config), tree)
  with pytest.raises(FileNotFoundError,
                     match="no trained heads.*specjax.train --gin_file=configs/smollm2_heads.gin"):
    heads.load_heads(tmp_path / "nothing", TARGET, target_params, tree)


def _context(history, position, newest, seed):
  """A DraftContext whose newest features (entry feature_count - 1 of a window of 3, the count
  varying by row) are newest[B, F]; the other entries are noise the drafter must not read."""
  rows = len(position)
  count = 1 + np.arange(rows) % 3
  window = np.random.RandomState(seed).randn(rows, 3, newest.shape[-1]).astype(np.float32)
  window[np.arange(rows), count - 1] = newest
  return contracts.DraftContext(jnp.asarray(history), jnp.asarray(position), jnp.asarray(window),
                                jnp.asarray(count, jnp.int32))


def test_candidates_are_each_heads_top_tokens():
  target_params, _, _ = _setup()
  trained = _random_heads(3, seed=1)
  head_tokens = np.sort(np.random.RandomState(2).choice(128, 96, replace=False)).astype(np.int32)
  drafter = heads.HeadsDrafter(3, Tree.spine(2, 5))
  params = heads.drafter_params(trained, head_tokens, TARGET, target_params)
  features = np.random.RandomState(3).randn(5, 64).astype(np.float32)
  history, position = np.zeros((5, 16), np.int32), np.full((5,), 7, np.int32)
  state = drafter.init(params, history, position, 16)
  context = _context(history, position, features, seed=4)
  run = jax.jit(drafter.candidates, static_argnums=(3, 4))
  candidates, state = run(params, state, context, 2, 5)
  assert candidates.shape == (5, 2, 5) and candidates.dtype == jnp.int32 and state is None
  rows = np.asarray(target_params["embedding"], np.float64)[head_tokens]
  for d in range(2):
    kernel, bias = (np.asarray(trained[heads.head_name(d + 1)][n], np.float64)
                    for n in ("kernel", "bias"))
    z = features @ kernel + bias
    logits = (features + z / (1.0 + np.exp(-z))) @ rows.T
    ranked = np.argsort(-logits, axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(np.asarray(candidates[:, d]), head_tokens[ranked])
  assert drafter.calls_per_iteration == 1
  with pytest.raises(ValueError, match="depth 4 needs 4 heads"):  # the tree fixes the depth
    heads.HeadsDrafter(3, Tree.chain(4))
  with pytest.raises(ValueError, match="width must lie in 1..96"):
    drafter.candidates(params, state, context, 1, 97)


def test_the_smollm2_heads_config_is_the_library_default():
  """configs/smollm2_heads.gin binds exactly the dataclass defaults, so a library call with defaults
  trains the same heads as the command line."""
  import gin  # pylint: disable=import-outside-toplevel
  from specjax import run  # pylint: disable=import-outside-toplevel
  gin.clear_config()
  try:
    run.parse_gin([str(pathlib.Path(__file__).parent.parent / "configs" / "smollm2_heads.gin")], [])
    assert gin.get_configurable(train_heads.HeadsSpec)() == train_heads.HeadsSpec()
  finally:
    gin.clear_config()


# ---------------------------------------------------------------------------------------------------
# The shared MTP head (specjax/drafters/mtp.py), trained by the same command with HeadsSpec.kind = "mtp".

MTP = dataclasses.replace(HEADS, kind="mtp")


def test_mtp_training_lowers_held_out_loss_and_the_tree_loop_accepts_its_chain(tmp_path, cache):
  summary, directory = _train(tmp_path / "mtp", heads_spec=MTP), tmp_path / "mtp" / "heads"
  before, after = summary["validation_before"], summary["validation_after"]
  for name in before:  # step k of the unrolled head, fed its own predicted states
    assert after[name]["loss"] < 0.5 * before[name]["loss"], (name, before[name], after[name])
    assert before[name]["top1"] < 0.1 and after[name]["top1"] > 0.6, (name, before, after)
  assert after["head_3"]["chain_top1"] > 0.4, after
  target_params, _, val = _setup()
  drafter, params = mtp.load_mtp(directory, TARGET, target_params, Tree.chain(3))
  assert isinstance(drafter, mtp.MTPDrafter) and params["head_tokens"].shape == (40,)
  with pytest.raises(ValueError, match="holds an MTP head.*mtp:"):
    heads.load_heads(directory, TARGET, target_params, Tree.chain(3))
  # In the jitted tree loop on held-out prompts of the tiny language: output equals the target's
  # greedy decode (lossless whatever the drafter), and the head's chain is mostly accepted: 3.75
  # tokens per call of at most 4 (untrained: 1.0; reading the root one position early: 2.1).
  model = decoder_only.model(TARGET)
  # Prompts: the first 6 tokens of held-out sequences (loss_from is 0 here: the prompts are scored).
  prompts = np.stack([val.tokens[val.offsets[row]:val.offsets[row] + 6] for row in range(8)])
  prompts, lengths = prompts.astype(np.int32), np.full((8,), 6, np.int32)
  expected = autoregressive.make_generate(model, autoregressive.DecodeShape(16))(
      target_params, prompts, lengths, jax.random.PRNGKey(0), 0.0)
  out = core.make_decode(model, drafter, core.DecodeConfig(16))(
      target_params, params, prompts, lengths, jax.random.PRNGKey(0), 0.0)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  tokens_per_call = (np.asarray(out.num_generated) - 1).sum() / (8 * int(out.target_calls))
  assert tokens_per_call > 3.0, tokens_per_call


def test_an_interrupted_mtp_run_resumes_to_the_same_head(tmp_path, cache):
  spec = dataclasses.replace(SPEC, steps=20, checkpoint_every=10)
  _train(tmp_path / "straight", spec, MTP)
  assert _train(tmp_path / "resumed", spec, MTP, stop_after_step=13) == {"stopped_after_step": 13}
  _train(tmp_path / "resumed", spec, MTP)
  with np.load(tmp_path / "straight" / "heads" / mtp.WEIGHTS_FILE) as a, \
       np.load(tmp_path / "resumed" / "heads" / mtp.WEIGHTS_FILE) as b:
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
      np.testing.assert_array_equal(a[name], b[name])
    assert np.any(a["kernel"] != 0)


def _random_mtp(seed, width=64):
  rng = np.random.RandomState(seed)
  return {"in_kernel": (0.1 * rng.randn(2 * width, width)).astype(np.float32),
          "in_bias": (0.1 * rng.randn(width)).astype(np.float32),
          "kernel": (0.3 * rng.randn(width, width)).astype(np.float32),
          "bias": (0.3 * rng.randn(width)).astype(np.float32)}


def test_mtp_candidates_follow_the_recursion_and_an_untrained_head_is_the_targets():
  target_params, _, _ = _setup()
  trained = _random_mtp(1)
  head_tokens = np.sort(np.random.RandomState(2).choice(128, 96, replace=False)).astype(np.int32)
  params = mtp.drafter_params(trained, head_tokens, TARGET, target_params)
  features = np.random.RandomState(3).randn(5, 64).astype(np.float32)
  history = np.random.RandomState(4).randint(0, 128, (5, 16)).astype(np.int32)
  position = np.array([7, 3, 9, 0, 15], np.int32)
  drafter = mtp.MTPDrafter(Tree.spine(3, 4))
  context = _context(history, position, features, seed=5)
  run = jax.jit(drafter.candidates, static_argnums=(3, 4))
  candidates, state = run(params, None, context, 3, 4)
  assert candidates.shape == (5, 3, 4) and candidates.dtype == jnp.int32 and state is None
  embedding = np.asarray(target_params["embedding"], np.float64)
  w = {k: np.asarray(v, np.float64) for k, v in trained.items()}
  hidden, token = features.astype(np.float64), history[np.arange(5), position]
  for d in range(3):  # numpy: z = h + [h, e] W_in + b_in; h' = z + silu(z W + b); rank h' U_sub
    z = hidden + np.concatenate([hidden, embedding[token]], -1) @ w["in_kernel"] + w["in_bias"]
    u = z @ w["kernel"] + w["bias"]
    hidden = z + u / (1.0 + np.exp(-u))
    ranked = head_tokens[np.argsort(-(hidden @ embedding[head_tokens].T), axis=-1, kind="stable")]
    np.testing.assert_array_equal(np.asarray(candidates[:, d]), ranked[:, :4])
    token = ranked[:, 0]
  with pytest.raises(ValueError, match="width must lie in 1..96"):
    drafter.candidates(params, None, context, 1, 97)
  # Zero weights: every step scores what the target scores after the hidden state it was given.
  zero = mtp.drafter_params(mtp.init_mtp(64), None, TARGET, target_params)
  states, logits = mtp.unroll(zero["mtp"], zero["embed_rows"], zero["head_rows"], features,
                              history[:, :2])
  np.testing.assert_allclose(np.asarray(states[:, 1]), features, atol=1e-6)
  np.testing.assert_allclose(np.asarray(logits[:, 0]), features @ embedding.T, atol=1e-4, rtol=1e-4)


def test_mtp_refuses_a_target_it_was_not_trained_for(tmp_path):
  target_params, _, _ = _setup()
  fingerprint = heads.target_fingerprint(TARGET, target_params)
  mtp.save_mtp(tmp_path / "mtp", _random_mtp(0), np.arange(10, 70), TARGET, fingerprint, 3,
               {"target": {"checkpoint": "tiny-seed-3"}})
  tree = Tree.chain(3)
  mtp.load_mtp(tmp_path / "mtp", TARGET, target_params, tree)  # its own target: fine
  with pytest.raises(ValueError, match=r"MTP head .* another target \(tiny-seed-3\).*smollm2_mtp.gin"):
    mtp.load_mtp(tmp_path / "mtp", TARGET, random_decoder_params(TARGET, seed=4, scale=0.2),
                 tree)
  heads.save_heads(tmp_path / "medusa", _random_heads(2, 0), None, TARGET, fingerprint)
  with pytest.raises(ValueError, match="holds Medusa heads.*heads:"):
    mtp.load_mtp(tmp_path / "medusa", TARGET, target_params, tree)
  with pytest.raises(ValueError, match="kind must be 'medusa' or 'mtp'"):
    train_heads.HeadsSpec(kind="eagle")
