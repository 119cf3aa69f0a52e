"""`specjax.training.seq2seq`: a tiny T5 on the offline gettext task learns, resumes exactly, exports losslessly
(T5X and Hugging Face), fine-tunes, and refuses bad input with the fix in the message."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from specjax import checkpoints
from specjax.data import tasks
from specjax.training import seq2seq_steps, seq2seq, trainer
from specjax import vocabulary as vocabularies
from specjax.models import t5

SHAPE = seq2seq.T5Shape(embed_dim=32, num_encoder_layers=1, num_decoder_layers=1, num_heads=2,
                      head_dim=16, mlp_dim=64)
SPEC = trainer.TrainSpec(steps=30, tokens_per_batch=512, learning_rate=1e-2, warmup_steps=5,
                          checkpoint_every=10, bucket=16)


@pytest.fixture(scope="module")
def vocabulary_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("vocab") / "spiece.model"
  vocabularies.train(tasks.texts_for_vocabulary("gettext_ende"), path, 400)
  return str(path)


def _task(vocabulary_path, **overrides):
  fields = dict(task="gettext_ende", vocabulary=vocabulary_path, max_input_length=32,
                max_target_length=32)
  return seq2seq.TaskSpec(**{**fields, **overrides})


def _train(output_dir, vocabulary_path, spec=SPEC, **kwargs):
  kwargs.setdefault("task", _task(vocabulary_path))
  kwargs.setdefault("model", SHAPE)
  return seq2seq.train(output_dir=str(output_dir), training=spec, **kwargs)


def test_batches_hold_every_example_once_in_few_shapes():
  pairs = [([5] * n, [6] * (n % 7 + 1)) for n in range(1, 60)]
  batches = seq2seq.make_batches(pairs, tokens_per_batch=256, bucket=16)
  assert {b["inputs"].shape for b in batches} <= {(16, 16), (8, 32), (5, 48), (4, 64)}
  # Each example once: the mask counts its target tokens, the input lengths its source tokens.
  assert sum(b["mask"].sum() for b in batches) == sum(len(o) for _, o in pairs)
  assert sorted(l for b in batches for l, m in zip(b["input_lengths"], b["mask"]) if m.any()) == \
      sorted(len(i) for i, _ in pairs)
  first = batches[0]  # decoder inputs are the targets shifted right behind the start token
  row = int(np.argmax(first["mask"].sum(1)))
  n = int(first["mask"][row].sum())
  assert first["decoder_inputs"][row, 0] == 0
  np.testing.assert_array_equal(first["decoder_inputs"][row, 1:n], first["targets"][row, :n - 1])


def test_training_lowers_validation_loss_and_exports(tmp_path, vocabulary_path):
  summary = _train(tmp_path / "run", vocabulary_path,
                   task=_task(vocabulary_path, evaluation_limit=16))
  before, after = summary["validation_before"], summary["validation_after"]
  assert after["loss"] < before["loss"] - 1.0, (before, after)
  assert summary["evaluation"]["examples"] == 16 and 0.0 <= summary["evaluation"]["chrf"] <= 100
  # The validation curve: before training, then at every checkpoint; its end is the final model's.
  curve = summary["validation_curve"]
  assert [step for step, _ in curve] == [0, 10, 20, 30]
  assert curve[0][1] == before["loss"] and curve[-1][1] == pytest.approx(after["loss"], rel=1e-6)
  assert curve[-1][1] < curve[0][1] - 1.0
  assert open(summary["training_curve_plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  # Export round trip: the HF and T5X exports load to the same parameters as the last checkpoint.
  hf_config, hf_params = checkpoints.load(tmp_path / "run" / "hf")
  t5x_config, t5x_params = checkpoints.load(summary["t5x_export"])
  assert hf_config == t5x_config == t5.T5Config(**summary["config"])
  from specjax.training.trainer import _checkpoint_manager  # the orbax state training ended with
  manager = _checkpoint_manager(tmp_path / "run" / "checkpoints", SPEC)
  final = manager.restore(SPEC.steps)["params"]
  for exported in (hf_params, t5x_params):
    jax.tree_util.tree_map(np.testing.assert_array_equal, exported, jax.device_get(final))
  assert (tmp_path / "run" / "hf" / "spiece.model").read_bytes() == open(vocabulary_path, "rb").read()
  # A finished directory is reused: nothing retrains.
  assert _train(tmp_path / "run", vocabulary_path,
                task=_task(vocabulary_path, evaluation_limit=16)) == summary


def test_hf_export_runs_in_transformers(tmp_path, vocabulary_path):
  torch = pytest.importorskip("torch")
  from transformers import T5ForConditionalGeneration
  _train(tmp_path / "run", vocabulary_path, spec=dataclasses.replace(SPEC, steps=10))
  config, params = checkpoints.load(tmp_path / "run" / "hf")
  model = T5ForConditionalGeneration.from_pretrained(tmp_path / "run" / "hf").eval()
  vocab = vocabularies.SentencePieceVocabulary.from_file(vocabulary_path)
  pair = seq2seq.tokenized(_task(vocabulary_path), "validation", vocab, vocabulary_path, limit=1)[0]
  batch = seq2seq.make_batches([pair], 64, 16)[0]
  logits = seq2seq_steps.teacher_forced_logits(t5.model(config), params, batch)
  ours = np.asarray(logits)[0, :len(pair[1])]
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor([pair[0]]),
                   decoder_input_ids=torch.tensor(batch["decoder_inputs"][:1, :len(pair[1])])).logits
  np.testing.assert_allclose(ours, theirs[0].numpy(), atol=2e-4, rtol=2e-4)


def test_interrupted_training_resumes_to_identical_parameters(tmp_path, vocabulary_path):
  whole = _train(tmp_path / "whole", vocabulary_path)
  assert _train(tmp_path / "cut", vocabulary_path, stop_after_step=20) == {"stopped_after_step": 20}
  resumed = _train(tmp_path / "cut", vocabulary_path)
  _, a = checkpoints.load(tmp_path / "whole" / "hf")
  _, b = checkpoints.load(tmp_path / "cut" / "hf")
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)  # bit-identical
  assert whole["loss_curve"] == resumed["loss_curve"]
  assert whole["validation_curve"] == resumed["validation_curve"]  # the cut run's step 20 included


def test_adafactor_steps_relative_to_each_parameter_and_trains_and_resumes(tmp_path,
                                                                            vocabulary_path):
  """T5's optimizer: a step moves each parameter by about learning_rate times its own RMS (AdamW:
  by about learning_rate, whatever the parameter's scale), and a tiny T5 trained with it learns and
  resumes bit for bit."""
  rng = np.random.default_rng(0)
  # Both at least 128 x 128, so Adafactor factors their second moments, as it does the target's.
  params = {"embedding": rng.standard_normal((256, 128)).astype(np.float32),        # std 1
            "kernel": 0.02 * rng.standard_normal((128, 256)).astype(np.float32)}    # std 0.02
  grads = jax.tree_util.tree_map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params)
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
  for optimizer, expected in ((None, {"embedding": 1e-3, "kernel": 1e-3 / 0.02}),
                              ("adafactor", {"embedding": 1e-3, "kernel": 1e-3})):
    spec = trainer.TrainSpec(steps=10, learning_rate=1e-3, warmup_steps=0, weight_decay=0.0,
                             clip_norm=1e9, optimizer=optimizer)
    tx = trainer.make_optimizer(spec)
    updates, _ = tx.update(grads, tx.init(params), params)
    relative = {name: rms(updates[name]) / rms(params[name]) for name in params}
    for name, value in expected.items():  # within 30 %: factored second moments are estimates
      assert relative[name] == pytest.approx(value, rel=0.3), (optimizer, relative)
  with pytest.raises(ValueError, match="adafactor"):
    trainer.TrainSpec(optimizer="sgd")

  adafactor = dataclasses.replace(SPEC, optimizer="adafactor", learning_rate=3e-2)
  # Width 128: the embedding and MLP kernels have factored state, which must checkpoint and resume.
  wide = dataclasses.replace(SHAPE, embed_dim=128, mlp_dim=128)
  whole = _train(tmp_path / "whole", vocabulary_path, spec=adafactor, model=wide)
  assert whole["validation_after"]["loss"] < whole["validation_before"]["loss"] - 1.0
  assert _train(tmp_path / "cut", vocabulary_path, spec=adafactor, model=wide,
                stop_after_step=20) == {"stopped_after_step": 20}
  _train(tmp_path / "cut", vocabulary_path, spec=adafactor, model=wide)
  _, a = checkpoints.load(tmp_path / "whole" / "hf")
  _, b = checkpoints.load(tmp_path / "cut" / "hf")
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def test_fine_tuning_starts_from_the_checkpoint(tmp_path, vocabulary_path):
  _train(tmp_path / "base", vocabulary_path, spec=dataclasses.replace(SPEC, steps=10))
  tuned = _train(tmp_path / "tuned", vocabulary_path, spec=dataclasses.replace(SPEC, steps=10),
                 init_checkpoint=str(tmp_path / "base" / "hf"))
  scratch = json.loads((tmp_path / "base" / "summary.json").read_text())
  # It starts where the base model ended, not from a random init.
  assert tuned["validation_before"]["loss"] == pytest.approx(scratch["validation_after"]["loss"],
                                                             rel=1e-5)


def test_bad_input_is_refused_with_the_fix(tmp_path, vocabulary_path):
  with pytest.raises(ValueError, match="not registered|unknown|offline tasks"):
    _train(tmp_path / "a", vocabulary_path, task=_task(vocabulary_path, task="wmt_klingon"))
  assert not (tmp_path / "a").exists()  # refused before the directory was touched
  _train(tmp_path / "base", vocabulary_path, spec=dataclasses.replace(SPEC, steps=10))
  base = str(tmp_path / "base" / "hf")
  # A checkpoint of another size than the config fine-tunes.
  with pytest.raises(ValueError, match=r"not the T5 this config fine-tunes: embed_dim 32 \(asked 512"):
    seq2seq.train(output_dir=str(tmp_path / "b"), task=_task(vocabulary_path),
                model=seq2seq.T5Shape(size="t5.1.1-small"), training=SPEC, init_checkpoint=base)
  # Another vocabulary (here one with more ids than the model has logits), refused up front by the
  # check every path shares (loading.check_same_vocabulary).
  bigger = tmp_path / "bigger.model"
  vocabularies.train(tasks.texts_for_vocabulary("gettext_ende"), bigger, 600)
  with pytest.raises(ValueError, match=r"init_checkpoint .* was trained with another vocabulary "
                                       r"\(.*400 pieces\) than TaskSpec.vocabulary .*600 pieces"):
    _train(tmp_path / "c", vocabulary_path, task=_task(str(bigger)), init_checkpoint=base)
  with pytest.raises(FileNotFoundError, match="no SentencePiece model"):
    _train(tmp_path / "d", vocabulary_path, task=_task(str(tmp_path / "missing.model")))


def _agreement_with(teacher_dir, student_dir, vocabulary_path) -> float:
  """Share of validation target positions where the student's argmax is the teacher's."""
  vocab = vocabularies.SentencePieceVocabulary.from_file(vocabulary_path)
  task = _task(vocabulary_path)
  pairs = seq2seq.tokenized(task, task.validation_split, vocab, vocabulary_path, limit=200)
  (tc, tp), (sc, sp) = (checkpoints.load(d / "hf") for d in (teacher_dir, student_dir))
  agree = total = 0.0
  for batch in seq2seq.make_batches(pairs, 512, 16):
    argmax = [np.argmax(seq2seq_steps.teacher_forced_logits(t5.model(c), p, batch), -1)
              for c, p in ((tc, tp), (sc, sp))]
    agree += float(((argmax[0] == argmax[1]) * batch["mask"]).sum())
    total += float(batch["mask"].sum())
  return agree / total


def test_distilled_draft_agrees_more_with_its_teacher(tmp_path, vocabulary_path):
  """A draft distilled from a teacher (seq2seq_steps.Teacher) matches the teacher's argmax on held-out
  positions more often than the same draft trained on the references alone (same seed, steps and
  batches: deterministic on CPU, so no false failures); a teacher of another vocabulary is refused."""
  _train(tmp_path / "teacher", vocabulary_path, spec=dataclasses.replace(SPEC, steps=60))
  small = seq2seq.T5Shape(embed_dim=16, num_encoder_layers=1, num_decoder_layers=1, num_heads=2,
                        head_dim=8, mlp_dim=32)
  common = dict(task=_task(vocabulary_path), model=small, training=SPEC, seed=1)
  seq2seq.train(output_dir=str(tmp_path / "plain"), **common)
  distilled = seq2seq.train(output_dir=str(tmp_path / "distilled"), **common,
                          teacher=str(tmp_path / "teacher" / "hf"), teacher_weight=0.9)
  plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
  agreement = {name: _agreement_with(tmp_path / "teacher", tmp_path / name, vocabulary_path)
               for name in ("plain", "distilled")}
  assert agreement["distilled"] > agreement["plain"] + 0.03, agreement
  # Validation stays the plain cross-entropy on the references: both are comparable and learned.
  for summary in (plain, distilled):
    assert summary["validation_after"]["loss"] < summary["validation_before"]["loss"] - 1.0
  other = tmp_path / "other.model"
  vocabularies.train(tasks.texts_for_vocabulary("gettext_ende"), other, 300)
  with pytest.raises(ValueError, match="another vocabulary .* set TaskSpec.vocabulary to .* the vocabulary the teacher was trained with"):
    seq2seq.train(output_dir=str(tmp_path / "mismatch"), **{**common, "task": _task(str(other))},
                teacher=str(tmp_path / "teacher" / "hf"))


def test_sharded_training_matches_one_device():
  from conftest import run_check_on_8_devices
  assert "losses" in run_check_on_8_devices("sharded_train_check.py")


def test_seqio_task_trains_like_the_offline_one(tmp_path, vocabulary_path):
  pytest.importorskip("seqio")
  summary = _train(tmp_path / "seqio", vocabulary_path, spec=dataclasses.replace(SPEC, steps=2),
                   task=_task(vocabulary_path, task="specjax_gettext_ende"))
  offline = seq2seq.tokenized(_task(vocabulary_path), "train",
                            vocabularies.SentencePieceVocabulary.from_file(vocabulary_path),
                            vocabulary_path)
  assert summary["train_examples"] == len(offline) == 666
