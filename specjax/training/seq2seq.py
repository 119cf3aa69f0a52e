"""`python -m specjax.train --gin_file=configs/...`: train or fine-tune a T5 on a sequence-to-sequence
task, then export it (Hugging Face and T5X) and measure it.

The task is an offline one of `specjax.data.tasks` (gettext catalogs; no TensorFlow) or a
seqio task of `specjax.data.seqio_tasks` (WMT EnDe, CNN/DailyMail, XSum through TFDS; the `tasks` extra).
Training is teacher-forced cross-entropy on the target tokens with `training.fit` (AdamW, warmup +
cosine, clipping; orbax checkpoints; a run killed at any step resumes to bit-identical parameters).
Examples are bucketed by length: a batch holds examples of similar length padded to a multiple of
`TrainSpec.bucket`, so few shapes compile and little compute goes to padding (packing several examples
into one row would need segment-aware attention in the model; buckets give most of the gain here).
Without a vocabulary, one is trained with `sentencepiece` on the task's training text (never on
held-out text) and travels with the model (`spiece.model` in the output and in the HF export).

Outputs in output_dir: spec.json / config.gin (what was asked), train_log.jsonl (loss every 10 steps,
validation loss and accuracy at every checkpoint), training_curve.png (both against the step),
checkpoints/ (orbax), spiece.model, hf/ (config.json + model.safetensors + spiece.model, which
`checkpoints.load` and transformers' T5ForConditionalGeneration read), t5x/checkpoint_<step>/ (msgpack
+ tensorstore, which T5X and `checkpoints.load` read), summary.json (sizes, validation loss before and
after, the loss and validation curves, BLEU and chrF of greedy decoding on the evaluation split, wall times).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np
from absl import logging

from specjax import checkpoints, contracts, launch, loading, models, outputs, sharding
from specjax.decoding import autoregressive
from specjax.data import placeholders, prompts, tasks
from specjax import vocabulary as vocabularies
from specjax.checkpoints import hf_t5, t5x
from specjax.models import t5
from specjax.training.seq2seq_steps import Trainer, load_teacher, t5_init
from specjax.training.trainer import TrainSpec, fit, loss_logger, plot_training_curve

@dataclasses.dataclass(frozen=True)
class T5Shape:
  """The T5 to train: a named size (t5.SIZES, e.g. 't5.1.1-small') or the fields below (T5 1.1 by
  default). The vocabulary size comes from the vocabulary."""
  size: str | None = None
  embed_dim: int = 256
  num_encoder_layers: int = 3
  num_decoder_layers: int = 3
  num_heads: int = 4
  head_dim: int = 64
  mlp_dim: int = 768
  gated: bool = True
  tie_embeddings: bool = False

  def config(self, vocab_size: int) -> t5.T5Config:
    if self.size is not None:
      if self.size not in t5.SIZES:
        raise ValueError(f"unknown T5 size {self.size!r}; known: {sorted(t5.SIZES)}")
      return dataclasses.replace(t5.SIZES[self.size], vocab_size=vocab_size)
    fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "size"}
    return t5.T5Config(vocab_size=vocab_size, **fields)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """What to train on. task: an offline task (tasks.TASKS) or a registered seqio task.
  vocabulary: a SentencePiece model; None trains one of vocab_size pieces on the training text.
  Longer examples are truncated (their EOS kept). evaluation_locale_repeats: in an offline task's
  training split, each example of the evaluation locale (German) appears this many times, which
  weights the evaluation pair in the multilingual mixture. The evaluation split is decoded greedily after
  training for BLEU / chrF (evaluation_limit examples; 0 skips it)."""
  task: str = "gettext_translate"
  train_split: str = "train"
  validation_split: str = "validation"
  vocabulary: str | None = None
  vocab_size: int = 8000
  extra_ids: int = 0
  evaluation_locale_repeats: int = 1
  max_input_length: int = 64
  max_target_length: int = 64
  validation_limit: int = 1024
  evaluation_task: str = "gettext_ende"
  evaluation_split: str = "heldout"
  evaluation_limit: int = 0


# ---- examples -> batches ----------------------------------------------------------------------------

def is_offline(task: str) -> bool:
  return task in tasks.TASKS


def check_task(task: str) -> None:
  """Fail before any work for a task that is neither offline nor (with TensorFlow) a seqio task."""
  if is_offline(task):
    return
  from specjax.data import seqio_tasks  # pylint: disable=import-outside-toplevel  # TensorFlow: only here
  try:
    seqio_tasks.check_registered(task)
  except ValueError as error:
    raise ValueError(f"{error}; or name one of specjax's offline tasks (no TensorFlow needed): "
                     f"{list(tasks.TASKS)}") from None
  if task == seqio_tasks.XSUM:
    seqio_tasks.check_xsum_download()  # TFDS's manual download, named with where it goes


def _truncate(ids: list[int], length: int, eos_id: int) -> list[int]:
  return ids if len(ids) <= length else ids[:length - 1] + [eos_id]


def tokenized(task_spec: TaskSpec, split: str, vocab, vocabulary_path, limit=None, task=None):
  """[(input ids, target ids)] of a split, truncated, EOS-terminated, in the task's order."""
  task = task or task_spec.task
  if is_offline(task):
    examples = tasks.examples(task, split)[:limit]
    if split == task_spec.train_split and task_spec.evaluation_locale_repeats > 1:
      examples = [e for e in examples for _ in range(
          task_spec.evaluation_locale_repeats if e["locale"] == tasks.EVALUATION_LOCALE else 1)]
    pairs = [(vocab.encode(e["inputs"]), vocab.encode(e["targets"])) for e in examples]
  else:
    from specjax.data import seqio_tasks  # pylint: disable=import-outside-toplevel
    examples = seqio_tasks.tokenized_examples(task, split, str(vocabulary_path), limit=limit)
    pairs = [(list(map(int, e["inputs"])), list(map(int, e["targets"]))) for e in examples]
  return [(_truncate(i, task_spec.max_input_length, vocab.eos_id),
           _truncate(o, task_spec.max_target_length, vocab.eos_id)) for i, o in pairs if len(o)]


def make_batches(pairs, tokens_per_batch: int, bucket: int, decoder_start_id: int = 0,
                 seed: int = 0) -> list[dict]:
  """Length-bucketed batches: examples grouped by their longer side's padded width L (a multiple of
  `bucket`), in a seeded random order within a width (a task lists its examples grouped, e.g. by
  language: batches must mix them), cut into batches of tokens_per_batch // L rows, the last batch
  of a width padded with empty rows (mask 0), so every width compiles once."""
  width_of = lambda i: -(-max(map(len, pairs[i])) // bucket) * bucket
  shuffled = np.random.default_rng(seed).permutation(len(pairs))
  order = sorted(range(len(pairs)), key=lambda i: (width_of(i), shuffled[i]))
  batches, start = [], 0
  while start < len(order):
    width = width_of(order[start])
    rows = max(1, tokens_per_batch // width)
    members = [i for i in order[start:start + rows] if width_of(i) == width]
    start += len(members)
    batches.append(_batch_arrays([pairs[i] for i in members], rows, width, decoder_start_id))
  return batches


def _batch_arrays(members, rows: int, width: int, decoder_start_id: int) -> dict:
  inputs = np.zeros((rows, width), np.int32)
  targets = np.zeros((rows, width), np.int32)
  decoder_inputs = np.zeros((rows, width), np.int32)
  input_lengths = np.ones((rows,), np.int32)  # an empty row still encodes one (pad) token
  mask = np.zeros((rows, width), np.float32)
  for row, (source, target) in enumerate(members):
    inputs[row, :len(source)] = source
    input_lengths[row] = len(source)
    targets[row, :len(target)] = target
    decoder_inputs[row, 0] = decoder_start_id
    decoder_inputs[row, 1:len(target)] = target[:-1]
    mask[row, :len(target)] = 1.0
  return {"inputs": inputs, "input_lengths": input_lengths, "decoder_inputs": decoder_inputs,
          "targets": targets, "mask": mask}


# ---- vocabulary, initial parameters (the loss and the steps: specjax.training.seq2seq_steps) -----------------

def obtain_vocabulary(task_spec: TaskSpec, output_dir: pathlib.Path):
  """-> (vocabulary, its path): the given one, or one trained on the training text into
  output_dir/spiece.model (kept across resumes: the trained file is reused)."""
  if task_spec.vocabulary is not None and "://" in task_spec.vocabulary:
    local = output_dir / "spiece.model"  # a copy, which travels with the model's exports
    if not local.is_file():
      local.write_bytes(t5x.read_file(task_spec.vocabulary))
    return vocabularies.SentencePieceVocabulary.from_file(local, task_spec.extra_ids), local
  if task_spec.vocabulary is not None:
    path = pathlib.Path(task_spec.vocabulary)
    return vocabularies.SentencePieceVocabulary.from_file(path, task_spec.extra_ids), path
  path = output_dir / "spiece.model"
  if path.is_file():
    vocab = vocabularies.SentencePieceVocabulary.from_file(path, task_spec.extra_ids)
    whole = [symbol in map(vocab.id_to_piece, vocab.encode(symbol, add_eos=False))
             for symbol in tasks.vocabulary_symbols(task_spec.task)]
    if not all(whole):
      raise ValueError(f"{path} was trained without the {task_spec.task} task's placeholder "
                       "symbols (<ph0> ...): delete it and its run's checkpoints, and train again")
    return vocab, path
  if not is_offline(task_spec.task):
    raise ValueError(f"the seqio task {task_spec.task} needs TaskSpec.vocabulary (a SentencePiece "
                     "model, e.g. T5's gs://t5-data/vocabs/cc_all.32000/sentencepiece.model): a "
                     "vocabulary is trained only for specjax's offline tasks")
  texts = tasks.texts_for_vocabulary(task_spec.task)
  logging.info("training a %d-piece SentencePiece vocabulary on %d texts of %s/train",
               task_spec.vocab_size, len(texts), task_spec.task)
  symbols = tasks.vocabulary_symbols(task_spec.task)  # whole pieces, e.g. placeholder symbols
  return vocabularies.train(texts, path, task_spec.vocab_size, extra_ids=task_spec.extra_ids,
                            character_coverage=0.9995, input_sentence_size=200_000,
                            shuffle_input_sentence=False,
                            **({"user_defined_symbols": list(symbols)} if symbols else {})), path


def initial_params(shape: T5Shape, vocab, init_checkpoint: str | None, seed: int):
  """-> (config, params): a fresh T5 of `shape`, or the checkpoint to fine-tune, which must be the
  shape asked for and hold the vocabulary."""
  if init_checkpoint is None:
    config = shape.config(vocab.vocab_size)
    return config, t5_init(config, seed)
  config, params = checkpoints.load(init_checkpoint)
  if not isinstance(config, t5.T5Config):
    raise ValueError(f"{init_checkpoint} is a decoder-only checkpoint; specjax.training.seq2seq fine-tunes T5")
  wanted = shape.config(config.vocab_size)
  if config != wanted:
    differ = [f"{f.name} {getattr(config, f.name)} (asked {getattr(wanted, f.name)})"
              for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(wanted, f.name)]
    raise ValueError(f"the checkpoint {init_checkpoint} is not the T5 this config fine-tunes: "
                     f"{', '.join(differ)}. Point init_checkpoint at a {shape.size or 'matching'} "
                     "checkpoint, or set T5Shape to the checkpoint's size")
  vocab.check_fits(config.vocab_size)
  return config, params


# ---- the run ----------------------------------------------------------------------------------------

def train(output_dir: str = "out/t5_gettext/target", task: TaskSpec = TaskSpec(),
          model: T5Shape = T5Shape(), training: TrainSpec = TrainSpec(),
          init_checkpoint: str | None = None, seed: int = 0, mesh_shape: tuple = (1, 1),
          stop_after_step: int | None = None, teacher: str | None = None,
          teacher_weight: float = 0.8) -> dict:
  """Train (or fine-tune from init_checkpoint) a T5 into output_dir; returns the summary. A finished
  output_dir is reused as is; an interrupted one resumes; one holding another spec is refused.
  mesh_shape: (data, model) devices; parameters and optimizer state are sharded over 'model' by the
  sharding rules (the ones decoding uses) and batch rows over 'data', e.g. (1, 8) on a v4-8 or v5p-8
  to fine-tune T5-XXL. teacher: a trained T5 (same vocabulary) to distil from, its share of the
  training loss `teacher_weight` (`t5_training.Teacher`), e.g. the experiment's target for its drafts."""
  check_task(task.task)  # a task that does not exist fails before the directory is touched
  if teacher is not None and not 0.0 < teacher_weight <= 1.0:
    raise ValueError(f"teacher_weight = {teacher_weight}: the teacher's share of the loss must be "
                     "in (0, 1]")
  if teacher is not None and "://" not in teacher and not pathlib.Path(teacher).exists():
    raise FileNotFoundError(f"no teacher checkpoint at {teacher}: train it first (the gettext "
                            "drafts distil from python -m specjax.train "
                            "--gin_file=configs/t5_gettext/target.gin) or point teacher at a T5")
  if task.evaluation_limit:
    check_task(task.evaluation_task)
  remote = task.vocabulary is not None and "://" in task.vocabulary
  if task.vocabulary is not None and not remote and not pathlib.Path(task.vocabulary).is_file():
    raise FileNotFoundError(f"no SentencePiece model at {task.vocabulary}; give TaskSpec.vocabulary "
                            "an existing file, or None to train one on the task's training text")
  _check_vocabularies(task, init_checkpoint, teacher)
  spec = {"task": dataclasses.asdict(task), "model": dataclasses.asdict(model),
          "training": dataclasses.asdict(training), "init_checkpoint": init_checkpoint, "seed": seed,
          "mesh_shape": list(mesh_shape),
          "content_keys": {name: checkpoints.content_key(path) for name, path in
                           (("vocabulary", None if remote else task.vocabulary),
                            ("init_checkpoint", init_checkpoint), ("teacher", teacher))
                           if path is not None}}
  if teacher is not None:  # absent otherwise, so models trained before distillation existed resume
    spec |= {"teacher": teacher, "teacher_weight": teacher_weight}
  with outputs.RunDirectory(output_dir, spec, "train_log.jsonl", "spec_fingerprint",
                            launch.operative_config(), other_results=("checkpoints", "hf", "t5x"),
                            fingerprinted=("checkpoints",)) as run_dir, \
       outputs.RowsFile(run_dir.results, run_dir.fingerprint, "spec_fingerprint",
                        unique_key="step") as loss_log:
    return _train(run_dir.path, loss_log, task, model, training, init_checkpoint, seed,
                  sharding.make_mesh(*mesh_shape), stop_after_step, teacher, teacher_weight)


def _check_vocabularies(task: TaskSpec, init_checkpoint: str | None, teacher: str | None) -> None:
  """Before anything is written: the checkpoint to fine-tune and the teacher must speak the task's
  vocabulary (loading.check_same_vocabulary, the check every path shares). A checkpoint that
  ships a vocabulary cannot be fine-tuned with one trained here (TaskSpec.vocabulary None); the
  teacher is checked against a trained vocabulary when it exists (seq2seq_steps.load_teacher)."""
  local = task.vocabulary is not None and "://" not in task.vocabulary
  expected = (vocabularies.SentencePieceVocabulary.from_file(task.vocabulary, task.extra_ids)
              if local else None)
  for role, checkpoint in (("init_checkpoint", init_checkpoint), ("the teacher", teacher)):
    if checkpoint is None or "://" in checkpoint:
      continue
    shipped = loading.shipped_vocabulary(checkpoint)
    if shipped is None:
      continue
    fix = f"set TaskSpec.vocabulary to {shipped[1]}, the vocabulary {role} was trained with"
    if expected is not None:
      loading.check_same_vocabulary(expected, f"TaskSpec.vocabulary {task.vocabulary}",
                                       checkpoint, role, fix)
    elif task.vocabulary is None and role == "init_checkpoint":
      raise ValueError(f"init_checkpoint {checkpoint} ships its vocabulary ({shipped[1]}) but "
                       "TaskSpec.vocabulary is None, which trains another one on the task's text: "
                       f"its ids would mean other pieces to the checkpoint; {fix}")


def _train(output_dir: pathlib.Path, loss_log, task: TaskSpec, shape: T5Shape, training: TrainSpec,
           init_checkpoint, seed, mesh, stop_after_step, teacher_path=None,
           teacher_weight=0.8) -> dict:
  summary_path = output_dir / "summary.json"
  if summary_path.exists() and (output_dir / "hf" / "config.json").exists():
    logging.info("trained model found in %s; nothing to do", output_dir)
    return json.loads(summary_path.read_text())
  started = time.perf_counter()
  vocab, vocab_path = obtain_vocabulary(task, output_dir)
  config, params = initial_params(shape, vocab, init_checkpoint, seed)
  teacher = (None if teacher_path is None else
             load_teacher(teacher_path, teacher_weight, config, vocab_path))
  train_pairs = tokenized(task, task.train_split, vocab, vocab_path)
  val_pairs = tokenized(task, task.validation_split, vocab, vocab_path, limit=task.validation_limit)
  if not train_pairs or not val_pairs:
    raise ValueError(f"{task.task} gave {len(train_pairs)} training and {len(val_pairs)} validation "
                     "examples; both splits need some")
  train_batches = make_batches(train_pairs, training.tokens_per_batch, training.bucket,
                               config.decoder_start_id, seed)
  val_batches = make_batches(val_pairs, training.tokens_per_batch, training.bucket,
                             config.decoder_start_id)
  data_seconds = time.perf_counter() - started
  logging.info("%s: %d parameters; %d training examples in %d batches, %d validation examples "
               "(%.0f s to prepare)", "T5",
               t5.num_params(config), len(train_pairs), len(train_batches), len(val_pairs),
               data_seconds)
  if mesh.size > 1:
    params = sharding.place(params, models.param_shardings(config, mesh))
    rows_over_data = lambda batch: sharding.place(batch, {
        name: sharding.batch_sharding(mesh, value.shape[0], value.ndim) for name, value in batch.items()})
    train_batches = [rows_over_data(b) for b in train_batches]
    val_batches = [rows_over_data(b) for b in val_batches]
  trainer = Trainer(config, training, mesh if mesh.size > 1 else None, teacher)
  before = trainer.evaluate(params, val_batches)
  fit_start = time.perf_counter()
  params, _ = fit(trainer, params, train_batches, seed, output_dir / "checkpoints",
                  stop_after_step=stop_after_step, desc=f"train {output_dir.name}",
                  on_loss=loss_logger(loss_log), validate=lambda params: {
                      name: value for name, value in trainer.evaluate(params, val_batches).items()
                      if name in ("loss", "accuracy")})
  if stop_after_step is not None and stop_after_step < training.steps:
    logging.info("stopped after step %d as asked; rerun to resume", stop_after_step)
    return {"stopped_after_step": stop_after_step}
  train_seconds = time.perf_counter() - fit_start
  after = trainer.evaluate(params, val_batches)
  logging.info("validation loss %.3f -> %.3f, accuracy %.3f -> %.3f", before["loss"],
               after["loss"], before["accuracy"], after["accuracy"])
  params = jax.device_get(params)
  export_path = output_dir / "hf.partial"  # renamed when complete: hf/ is the finished mark
  hf_t5.save(export_path, config, params, vocab_path)
  t5x_path = t5x.save(output_dir / "t5x" / f"checkpoint_{training.steps}", config, params,
                      step=training.steps)
  evaluation = (evaluate_generation(config, params, vocab, task)
                if task.evaluation_limit else None)
  log_rows = outputs.read_rows(loss_log.path)
  loss_curve = sorted((row["step"], row["loss"]) for row in log_rows)
  validation_curve = [(0, before["loss"])] + sorted(
      (row["step"], row["validation_loss"]) for row in log_rows if "validation_loss" in row)
  curve_path = plot_training_curve(loss_curve, validation_curve, output_dir / "training_curve.png")
  summary = {
      "config": dataclasses.asdict(config), "parameters": t5.num_params(config),
      "vocabulary": str(vocab_path), "train_examples": len(train_pairs),
      "train_target_tokens": int(sum(len(o) for _, o in train_pairs)),
      "validation_examples": len(val_pairs), "validation_before": before,
      "validation_after": after,
      "loss_curve": loss_curve, "validation_curve": validation_curve,
      "training_curve_plot": str(curve_path),
      "evaluation": evaluation, "data_seconds": data_seconds, "train_seconds": train_seconds,
      "total_seconds": time.perf_counter() - started, "hf_export": str(output_dir / "hf"),
      "t5x_export": str(t5x_path),
  }
  summary_path.write_text(json.dumps(summary, indent=2) + "\n")
  export_path.rename(output_dir / "hf")
  logging.info("T5 written to %s and %s", output_dir / "hf", t5x_path)
  return json.loads(summary_path.read_text())  # what a rerun returns, to the letter


def evaluate_generation(config, params, vocab, task: TaskSpec, batch_size: int = 32) -> dict:
  """Greedy decoding of the evaluation split's sources: BLEU and chrF (sacrebleu) against the
  references, with a few examples. Outputs and references are compared with their placeholders
  restored (an example's 'placeholders' table), as the messages are shipped."""
  import sacrebleu  # pylint: disable=import-outside-toplevel  # only after training
  if is_offline(task.evaluation_task):
    examples = tasks.examples(task.evaluation_task, task.evaluation_split)
    examples = examples[:task.evaluation_limit]
    sources = [e["inputs"] for e in examples]
    tables = [e.get("placeholders", ()) for e in examples]  # what restores a protected text
    references = [placeholders.restore(e["targets"], table) for e, table in zip(examples, tables)]
  else:
    raise ValueError("evaluation by generation reads the offline tasks' text; for seqio tasks set "
                     "TaskSpec.evaluation_limit = 0 and evaluate with seqio's evaluator")
  model = t5.model(config)
  shape = autoregressive.DecodeShape(task.max_target_length, 0, vocab.eos_id, vocab.pad_id)
  program = autoregressive.make_generate(model, shape)
  hypotheses = []
  for start in range(0, len(sources), batch_size):
    chunk = sources[start:start + batch_size]
    ids = [_truncate(vocab.encode(text), task.max_input_length, vocab.eos_id) for text in chunk]
    ids += [[vocab.eos_id]] * (batch_size - len(ids))  # one batch shape: one compile
    tokens, lengths = prompts.make_batch(ids, vocab.pad_id, bucket=task.max_input_length)
    prompt, prompt_lengths = t5.decoder_prompt(config, batch_size)
    out = program(params, prompt, prompt_lengths, jax.random.PRNGKey(0), np.float32(0.0),
                  np.float32(1.0), contracts.Source(tokens, lengths))
    generated = np.asarray(out.num_generated)
    hypotheses += [placeholders.restore(
        vocab.decode(np.asarray(out.tokens)[row, :generated[row]].tolist()), tables[start + row])
                   for row in range(len(chunk))]
  return {"task": task.evaluation_task, "split": task.evaluation_split,
          "examples": len(sources),
          "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
          "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
          "exact_match": float(np.mean([h == r for h, r in zip(hypotheses, references)])),
          "samples": [{"source": s, "reference": r, "output": h}
                      for s, r, h in list(zip(sources, references, hypotheses))[:8]]}

