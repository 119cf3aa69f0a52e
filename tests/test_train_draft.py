"""Draft distillation on a tiny random target: training helps, resumes exactly, exports losslessly."""

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_decoder_params
from specjax import checkpoints, metrics
from specjax.decoding import core
from specjax.drafters import expansion
from specjax.drafters.model import ModelDrafter
from specjax.training import teacher, draft_model, trainer
from specjax.checkpoints import hf
from specjax.models import decoder_only

TARGET = decoder_only.SIZES["tiny"]  # vocab 128
SHAPE = draft_model.DraftShape(embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                               mlp_dim=64, head_size=96)
DRAFT = SHAPE.config(TARGET)
SPEC = trainer.TrainSpec(steps=200, tokens_per_batch=512, learning_rate=1e-2, warmup_steps=10,
                             checkpoint_every=50, bucket=16, validation_fraction=0.2)


def _prompts(count, seed):
  rng = np.random.RandomState(seed)
  return [rng.randint(1, 128, rng.randint(3, 12)).tolist() for _ in range(count)]


@functools.lru_cache(maxsize=None)
def _setup():
  """Teacher data of the tiny target, split, with the draft's head, batches and initial params."""
  target_params = random_decoder_params(TARGET, seed=3, scale=0.2)
  prompts = _prompts(60, seed=0)
  seqs = teacher.distil_targets(decoder_only.model(TARGET), target_params, prompts,
                                [str(p) for p in prompts], max_new_tokens=24, samples=1,
                                top_k=16, batch_size=16, eos_id=None, pad_id=0, seed=0)
  train, val = teacher.split_validation(seqs, SPEC.validation_fraction)
  head = draft_model.choose_head_tokens(train, TARGET.vocab_size, SHAPE.head_size)
  index_map = draft_model.head_index_map(TARGET.vocab_size, head)
  batches = lambda s: [draft_model.batch_arrays(s, m, SPEC.bucket, index_map)
                       for m in draft_model.make_batches(s, SPEC.tokens_per_batch, SPEC.bucket)]
  init = draft_model.init_draft_params(DRAFT, TARGET, target_params, head, seed=0)
  return target_params, seqs, train, val, head, batches(train), batches(val), init


def test_teacher_data_is_the_targets_own_distribution():
  target_params, seqs, *_ = _setup()
  # Greedy rows: every generated token is the teacher's top-1 at the position before it.
  first = slice(seqs.offsets[0], seqs.offsets[1])
  tokens, top1 = seqs.tokens[first], seqs.teacher_ids[first, 0]
  prompt_len = seqs.loss_from[0]  # the greedy sequence scores its prompt: 0
  assert prompt_len == 0
  generated = len(tokens) - 24
  np.testing.assert_array_equal(tokens[generated:], top1[generated - 1:-1])
  # The stored log-probs are the target's, recomputed here with a plain full forward.
  logits, _ = decoder_only.make_step(TARGET)(
      target_params, jnp.asarray(tokens)[None], jnp.arange(len(tokens))[None],
      decoder_only.init_cache(TARGET, 1, len(tokens)))
  logp = jax.nn.log_softmax(logits[0])
  np.testing.assert_allclose(np.take_along_axis(np.asarray(logp), seqs.teacher_ids[first], 1),
                             seqs.teacher_logp[first], atol=2e-4)
  # Sampled rows score only their continuation; no prompt is split across train and validation.
  assert np.all(seqs.loss_from[len(seqs) // 2:] > 0)
  _, _, train, val, *_ = _setup()
  assert not set(train.group) & set(val.group) and len(val) > 0


def _acceptance(target_params, draft_params, seed):
  """Empirical acceptance of speculative sampling (temperature 1) on fresh prompts."""
  drafter = expansion.SampledChain(ModelDrafter(decoder_only.model(DRAFT)), 3)
  prompts = _prompts(16, seed=seed)
  tokens = np.zeros((16, 12), np.int32)
  for row, p in enumerate(prompts):
    tokens[row, :len(p)] = p
  lengths = np.array([len(p) for p in prompts], np.int32)
  shape = core.DecodeConfig(max_new_tokens=24, pad_id=0)
  out = core.make_decode(decoder_only.model(TARGET), drafter, shape)(
      target_params, draft_params, tokens, lengths, jax.random.PRNGKey(seed), 1.0)
  return metrics.empirical_alpha(out.stats.num_accepted, 3)


def test_distillation_lowers_kl_and_raises_acceptance(tmp_path):
  target_params, _, _, _, _, train_batches, val_batches, init = _setup()
  draft_trainer = draft_model.Trainer(DRAFT, SPEC)
  before = draft_trainer.evaluate(decoder_only.model_params(init), val_batches)
  params, losses = trainer.fit(draft_trainer, decoder_only.model_params(init), train_batches, 0,
                               tmp_path / "ckpt")
  after = draft_trainer.evaluate(params, val_batches)
  assert after["kl"] < 0.5 * before["kl"], (before, after)
  assert after["overlap"] > before["overlap"] + 0.1, (before, after)
  assert losses[-1][1] < losses[0][1]
  trained = {**jax.device_get(params), decoder_only.HEAD_TOKENS: init[decoder_only.HEAD_TOKENS]}
  # Measured in the speculative loop on prompts the draft never saw (seed 7 vs training seed 0).
  untrained_rate, trained_rate = _acceptance(target_params, init, 7), _acceptance(target_params,
                                                                                  trained, 7)
  assert trained_rate > untrained_rate + 0.1, (untrained_rate, trained_rate)


def test_interrupted_run_resumes_to_the_same_parameters(tmp_path):
  _, _, _, _, _, train_batches, _, init = _setup()
  spec = dataclasses.replace(SPEC, steps=30, checkpoint_every=10)
  init = decoder_only.model_params(init)
  straight, _ = trainer.fit(draft_model.Trainer(DRAFT, spec), init, train_batches, 0,
                             tmp_path / "straight")
  _, first = trainer.fit(draft_model.Trainer(DRAFT, spec), init, train_batches, 0,
                          tmp_path / "resumed", stop_after_step=17)
  assert first[-1][0] == 17
  # A new process would rebuild everything: a fresh Trainer, the same initial params and data.
  resumed, second = trainer.fit(draft_model.Trainer(DRAFT, spec), init, train_batches, 0,
                                 tmp_path / "resumed")
  assert second[0][0] == 20 and second[-1][0] == 30  # resumed after 17, not from 0
  for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog):
  """A kill mid-save (orbax's tmp directory left) and a newest checkpoint whose files are garbage:
  the rerun removes the first, moves the second aside with a warning naming it, resumes from the
  checkpoint before it and ends bit-identical to an uninterrupted run."""
  _, _, _, _, _, train_batches, _, init = _setup()
  spec = dataclasses.replace(SPEC, steps=30, checkpoint_every=10)
  init = decoder_only.model_params(init)
  straight, _ = trainer.fit(draft_model.Trainer(DRAFT, spec), init, train_batches, 0,
                             tmp_path / "straight")
  ckpt = tmp_path / "resumed"
  trainer.fit(draft_model.Trainer(DRAFT, spec), init, train_batches, 0, ckpt, stop_after_step=25)
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["20", "25"]
  for path in (ckpt / "25").rglob("*"):
    if path.is_file():
      path.write_bytes(b"\x00garbage" * 7)
  stale = ckpt / "30.orbax-checkpoint-tmp-1234"
  stale.mkdir()
  with caplog.at_level("WARNING"):
    resumed, losses = trainer.fit(draft_model.Trainer(DRAFT, spec), init, train_batches, 0, ckpt)
  assert losses[0][0] == 30 and len(losses) == 1  # steps 21..30 redone from step 20, logged at 30
  assert not stale.exists() and (tmp_path / "resumed.corrupt" / "25").is_dir()
  assert any(f"checkpoint at step 25 ({ckpt / '25'}) does not restore" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]
  for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_batch_order_is_a_permutation_per_epoch():
  order = [trainer.batch_order(7, step, seed=3) for step in range(21)]
  for epoch in range(3):
    assert sorted(order[7 * epoch:7 * epoch + 7]) == list(range(7))
  assert order[:7] != order[7:14]


def _subset_draft():
  params = random_decoder_params(dataclasses.replace(DRAFT, head_size=0, vocab_size=128), seed=5)
  head = np.sort(np.random.RandomState(0).choice(128, DRAFT.head_size, replace=False))
  params["lm_head"] = params["lm_head"][:, :DRAFT.head_size]
  return {**params, decoder_only.HEAD_TOKENS: head.astype(np.int32)}


def _logits(config, params, tokens):
  return np.asarray(decoder_only.make_step(config)(
      params, tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
      decoder_only.init_cache(config, tokens.shape[0], tokens.shape[1]))[0])


def test_subset_head_step_scores_only_its_tokens():
  params = _subset_draft()
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, 128, (2, 9)), jnp.int32)
  logits = _logits(DRAFT, params, tokens)
  head = params[decoder_only.HEAD_TOKENS]
  off = np.setdiff1d(np.arange(128), head)
  assert np.all(np.isneginf(logits[..., off])) and np.all(np.isfinite(logits[..., head]))
  own, _ = decoder_only.head_logits_step(DRAFT)(
      params, tokens, jnp.broadcast_to(jnp.arange(9), tokens.shape),
      decoder_only.init_cache(DRAFT, 2, 9))
  np.testing.assert_array_equal(logits[..., head], np.asarray(own))


def test_export_then_load_gives_identical_logits_here_and_in_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  import transformers  # pylint: disable=import-outside-toplevel
  params = _subset_draft()
  hf.save(tmp_path, DRAFT, params)
  config, loaded = checkpoints.load(tmp_path)
  assert config == DRAFT
  tokens = jnp.asarray(np.random.RandomState(2).randint(0, 128, (2, 11)), jnp.int32)
  ours = _logits(DRAFT, params, tokens)
  np.testing.assert_array_equal(_logits(config, loaded, tokens), ours)
  peer = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = peer(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
  head = params[decoder_only.HEAD_TOKENS]
  np.testing.assert_allclose(theirs[..., head], ours[..., head], atol=2e-4)
  # Off the head the exported rows are zero (Llama heads have no bias); head_tokens.json says which.
  assert np.all(theirs[..., np.setdiff1d(np.arange(128), head)] == 0.0)


def test_training_data_and_draft_errors(tmp_path):
  target_params = random_decoder_params(TARGET, seed=3)
  with pytest.raises(ValueError, match="tokenize to nothing"):
    teacher.distil_targets(decoder_only.model(TARGET), target_params, [[5, 6], []], ["a", ""],
                           max_new_tokens=4, samples=0, top_k=4, batch_size=2, eos_id=None,
                           pad_id=0, seed=0)
  with pytest.raises(ValueError, match="vocabulary"):
    draft_model.check_draft_matches(dataclasses.replace(DRAFT, vocab_size=256, head_size=0), TARGET)
  with pytest.raises(ValueError, match="one entry per task"):
    teacher.TeacherSpec(tasks=("humaneval",), max_new_tokens=(8, 8), samples=(0,),
                        prompts_per_task=(0,))
  with pytest.raises(ValueError, match="tie_embeddings"):
    dataclasses.replace(DRAFT, tie_embeddings=True)
  with pytest.raises(ValueError, match="distinct"):
    decoder_only.validate_head_tokens(np.zeros(DRAFT.head_size), DRAFT)


@pytest.mark.slow
def test_a_draft_of_another_vocabulary_is_refused_before_training(tmp_path):
  other = random_decoder_params(TARGET, seed=0)  # 128 tokens, the embedded target has 49,152
  hf.save(tmp_path / "other", TARGET, other)
  with pytest.raises(ValueError, match="vocabulary of 128 tokens"):
    draft_model.train(output_dir=str(tmp_path / "out"), init_from=str(tmp_path / "other"))


def test_the_embedded_default_draft_config_is_the_library_default():
  """configs/smollm2_draft.gin binds exactly the dataclass defaults, so a library call with defaults
  (benchmarks/draft_alternatives.py) trains the same draft as scripts/main.sh."""
  import gin  # pylint: disable=import-outside-toplevel
  from specjax import run  # pylint: disable=import-outside-toplevel
  gin.clear_config()
  try:
    run.parse_gin([str(pathlib.Path(__file__).parent.parent / "configs" / "smollm2_draft.gin")], [])
    for spec in (draft_model.DraftShape, teacher.TeacherSpec, trainer.TrainSpec):
      assert gin.get_configurable(spec)() == spec(), spec
  finally:
    gin.clear_config()
