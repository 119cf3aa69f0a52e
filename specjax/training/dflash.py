"""Train a DFlash block drafter (specjax/drafters/dflash.py) on a decoder-only target's own features.

    python -m specjax.train --gin_file=configs/smollm2_dflash.gin

Stages, each kept so that nothing computed is lost (output_dir as in training/heads.py):

1. Teacher data (training/teacher.py, shared with the chain draft and the heads): the target's own
   continuations of TRAIN-split prompts.
2. Features: the residual stream after the drafter's target blocks at every position, by
   teacher-forced prefill passes, cached once per (target, sequences, blocks) under
   $SPECJAX_CACHE/heads_features (float16).
3. Training (training/trainer.py: optax AdamW, warmup + cosine, orbax checkpoints, exact resume):
   each batch holds `rows` sequences (the last `sequence_length` tokens of each) and `anchors` random
   block roots per sequence, drawn afresh for every step from (seed, step), where every following
   token is the target's own (`response_start`: never inside a human-written prompt). Every block
   sees the context strictly before its anchor and itself, never another block
   (dflash.training_visibility); position k of a block (1..B-1) is scored against the sequence's
   token at anchor + k with weight exp(-(k - 1) / decay), and with `distill_weight` also against
   the target's own top-k distribution there (the teacher data's, as the MTP head is). Only the
   drafter's layers, projection and norms train; the embedding and output rows are the target's.
4. Output: dflash/ (dflash.npz + heads.json with the target's fingerprint; `dflash.load` reads it
   back for that target only) and summary.json with held-out loss, top-1 by block position and the
   tokens a greedy block would keep per target call (1 + the expected run of correct top-1 tokens),
   before and after training.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from specjax import outputs
from specjax.drafters import dflash, heads
from specjax.models import layers
from specjax.training import heads as train_heads
from specjax.training import teacher as teacher_data
from specjax.training.draft_model import choose_head_tokens, head_index_map
from specjax.training.teacher import Sequences, TeacherSpec
from specjax.training.trainer import TrainSpec, fit, loss_logger, make_optimizer, make_train_step

# DFlash's loss decay by block size (its paper: 7 for blocks of 16, 5 for 10, 4 for 8).
PAPER_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclasses.dataclass(frozen=True)
class DFlashSpec:
  """The drafter and how its batches are drawn. decay 0: the paper's for the block size (else half
  the block). A batch holds tokens_per_batch // sequence_length sequences. distill_weight: the
  weight of the cross-entropy to the target's top-k distribution beside the token's (0: the
  paper's loss, tokens only)."""
  block_size: int = 8
  num_layers: int = 2
  num_features: int = 5
  mask_token: int = 0
  head_size: int = 4096
  anchors: int = 16
  sequence_length: int = 384
  decay: float = 0.0
  prefill_tokens: int = 2048
  prefill_bucket: int = 128
  distill_weight: float = 0.0

  def __post_init__(self):
    if self.anchors < 1 or self.sequence_length < 2 or self.head_size < 0:
      raise ValueError(f"anchors must be >= 1, sequence_length >= 2 and head_size >= 0; got "
                       f"{self.anchors}, {self.sequence_length}, {self.head_size}")

  @property
  def loss_decay(self) -> float:
    return self.decay or PAPER_DECAY.get(self.block_size, self.block_size / 2)

  def position_weights(self) -> np.ndarray:
    """[B - 1]: the loss weight of block positions 1 .. B - 1."""
    return np.exp(-np.arange(self.block_size - 1) / self.loss_decay).astype(np.float32)


# ---- batches ----------------------------------------------------------------------------------------

def response_start(seqs: Sequences, i: int) -> int:
  """The first position of sequence i from which every following token is the target's own: a
  block rooted there or later is scored against text the target wrote, never a human prompt. A
  sampled continuation names it (loss_from: the last prompt position); a greedy one scores its
  prompt too (loss_from 0), so its start is where the tokens begin to follow the target's argmax
  (teacher_ids[:, 0]) to the end."""
  if seqs.loss_from[i]:
    return int(seqs.loss_from[i])
  start, end = int(seqs.offsets[i]), int(seqs.offsets[i + 1])
  misses = np.flatnonzero(seqs.tokens[start + 1:end] != seqs.teacher_ids[start:end - 1, 0])
  return int(misses[-1]) + 1 if len(misses) else 0


@dataclasses.dataclass
class Windows:
  """The last `length` tokens of each sequence, right-padded: tokens [N, L], features [N, L, F]
  (float16), lengths [N], first [N] (the first position whose block may be an anchor: the
  response's start (`response_start`), at least 1 so that a block always has context), and the
  target's top-k at each position, teacher_ids [N, L, k] and teacher_probs [N, L, k] (float16)."""
  tokens: np.ndarray
  features: np.ndarray
  lengths: np.ndarray
  first: np.ndarray
  teacher_ids: np.ndarray
  teacher_probs: np.ndarray

  @classmethod
  def of(cls, seqs: Sequences, features: np.ndarray, length: int) -> "Windows":
    count = len(seqs)
    tokens = np.zeros((count, length), np.int32)
    window = np.zeros((count, length, features.shape[1]), np.float16)
    lengths, first = np.zeros(count, np.int32), np.zeros(count, np.int32)
    top_k = seqs.teacher_ids.shape[1]
    ids = np.zeros((count, length, top_k), np.int32)
    probs = np.zeros((count, length, top_k), np.float16)
    for i in range(count):
      start, end = int(seqs.offsets[i]), int(seqs.offsets[i + 1])
      cut = max(start, end - length)
      tokens[i, :end - cut] = seqs.tokens[cut:end]
      window[i, :end - cut] = features[cut:end]
      ids[i, :end - cut] = seqs.teacher_ids[cut:end]
      probs[i, :end - cut] = np.exp(seqs.teacher_logp[cut:end])
      lengths[i] = end - cut
      first[i] = max(1, response_start(seqs, i) - (cut - start))
    return cls(tokens, window, lengths, first, ids, probs)

  def anchors(self, rows: np.ndarray, count: int, rng: np.random.Generator):
    """(anchors [R, count], valid [R, count]): distinct random roots in first .. length - 2 of each
    row (a root needs a token after it); rows with fewer candidates repeat them, marked invalid."""
    anchors = np.zeros((len(rows), count), np.int32)
    valid = np.zeros((len(rows), count), bool)
    for r, i in enumerate(rows):
      candidates = np.arange(self.first[i], self.lengths[i] - 1)
      if not len(candidates):
        continue
      picks = rng.permutation(candidates)[:count]
      anchors[r, :len(picks)], valid[r, :len(picks)] = picks, True
      anchors[r, len(picks):] = picks[0]
    return anchors, valid


class Batches:
  """The batch of each step, drawn from (seed, step) alone (so a resumed run trains on what an
  uninterrupted one would): a fresh permutation of the sequences every epoch, fresh anchors every
  step. `fit` calls it with the step."""

  def __init__(self, windows: Windows, rows: int, anchors: int, seed: int):
    self.windows, self.rows, self.count, self.seed = windows, rows, anchors, seed
    self.per_epoch = max(1, len(windows.lengths) // rows)

  def __call__(self, step: int) -> dict:
    epoch, offset = divmod(step, self.per_epoch)
    order = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows.lengths))
    rows = order[offset * self.rows:(offset + 1) * self.rows]
    if len(rows) < self.rows:  # fewer sequences than a batch: repeat them
      rows = np.resize(order, self.rows)
    return batch_of(self.windows, rows, self.count, np.random.default_rng([self.seed, 1 << 20, step]))


def batch_of(windows: Windows, rows, anchors: int, rng) -> dict:
  picked, valid = windows.anchors(np.asarray(rows), anchors, rng)
  return {"tokens": windows.tokens[rows], "features": windows.features[rows],
          "lengths": windows.lengths[rows], "anchors": picked, "valid": valid,
          "teacher_ids": windows.teacher_ids[rows], "teacher_probs": windows.teacher_probs[rows]}


def validation_batches(windows: Windows, rows: int, anchors: int, seed: int) -> list[dict]:
  """Every held-out sequence once, with anchors fixed by the seed (the same before and after)."""
  rng = np.random.default_rng([seed, 2 << 20])
  order = np.arange(len(windows.lengths))
  return [batch_of(windows, np.resize(order[i:i + rows], rows), anchors, rng)
          for i in range(0, len(order), rows)]


# ---- the loss ---------------------------------------------------------------------------------------

def block_terms(config: dflash.DFlashConfig, params: dict, frozen: dict, batch: dict):
  """(logits [N, M, B-1, S], labels as head columns [N, M, B-1] (-1: none or off the head),
  labelled [N, M, B-1]) for a batch's blocks, all of a sequence's blocks in one pass."""
  tokens, anchors = batch["tokens"], batch["anchors"]
  rows, length = tokens.shape
  count, size = anchors.shape[1], config.block_size
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
  context = dflash.project_context(config, params, batch["features"])
  cached = dflash.context_kv(config, params, context, positions)
  roots = jnp.take_along_axis(tokens, anchors, axis=1)
  block = dflash.block_tokens(config, roots).reshape(rows, count * size)
  block_positions = (anchors[:, :, None] + jnp.arange(size)).reshape(rows, count * size)
  context_visible, block_visible = dflash.training_visibility(anchors, size, length)
  hidden = dflash.block_hidden(config, params, layers.embed(frozen["embed_rows"], block),
                               block_positions, cached,
                               context_visible, block_visible)
  logits = dflash.block_logits(config, params, frozen["head_rows"],
                               hidden.reshape(rows, count, size, -1))
  ahead = anchors[:, :, None] + jnp.arange(1, size)                            # [N, M, B-1]
  labelled = (ahead < batch["lengths"][:, None, None]) & batch["valid"][:, :, None]
  labels = jnp.take_along_axis(tokens, jnp.minimum(ahead, length - 1).reshape(rows, -1),
                               axis=1).reshape(ahead.shape)
  columns = jnp.where(labelled, frozen["index_map"][labels], -1)
  return logits, columns, labelled


def teacher_terms(frozen: dict, batch: dict, labelled: jax.Array):
  """The target's top-k for block position k of each block: its distribution at anchor + k - 1,
  the position that predicts the token at anchor + k. -> (head columns [N, M, B-1, k] (-1: off the
  head or no label), probabilities [N, M, B-1, k])."""
  rows, length, top_k = batch["teacher_ids"].shape
  before = jnp.minimum(batch["anchors"][:, :, None] + jnp.arange(labelled.shape[-1]), length - 1)
  take = lambda table: jnp.take_along_axis(table, before.reshape(rows, -1, 1), axis=1).reshape(
      before.shape + (top_k,))
  columns = frozen["index_map"][take(batch["teacher_ids"])]
  columns = jnp.where(labelled[..., None], columns, -1)
  return columns, take(batch["teacher_probs"]).astype(jnp.float32)


class Trainer:
  """The jitted train and eval steps over the frozen embedding and output rows. `terms(config,
  params, frozen, batch) -> (logits [N, M, K, S], head columns [N, M, K], labelled [N, M, K])`
  scores K tokens after each of M anchors (default: DFlash's blocks, `block_terms`; the EAGLE-3
  drafter's unroll shares the rest); `drafter_spec` gives position_weights() [K] and
  distill_weight."""

  def __init__(self, config, frozen: dict, spec: TrainSpec, drafter_spec, terms=None):
    self.spec, self.config = spec, config
    self.frozen = jax.tree_util.tree_map(jnp.asarray, frozen)
    self.optimizer = make_optimizer(spec)
    weights = jnp.asarray(drafter_spec.position_weights())
    distill = drafter_spec.distill_weight
    terms = terms or block_terms

    def cross_entropy(params, batch):
      logits, columns, labelled = terms(config, params, batch["frozen"], batch)
      logq = jax.nn.log_softmax(logits, axis=-1)
      ce = -jnp.take_along_axis(logq, jnp.maximum(columns, 0)[..., None], axis=-1)[..., 0]
      return logits, logq, jnp.where(columns >= 0, ce, 0.0), columns, labelled

    def loss_fn(params, batch):
      _, logq, ce, columns, labelled = cross_entropy(params, batch)
      on_head = (columns >= 0) * weights
      loss = (ce * weights).sum() / jnp.maximum(on_head.sum(), 1.0)
      if distill:
        teacher, probs = teacher_terms(batch["frozen"], batch, labelled)
        logq_k = jnp.take_along_axis(logq, jnp.maximum(teacher, 0), axis=-1)
        soft = -jnp.where(teacher >= 0, probs * logq_k, 0.0).sum(-1)
        loss += distill * (soft * weights).sum() / jnp.maximum((labelled * weights).sum(), 1.0)
      return loss

    def eval_step(params, batch):
      logits, _, ce, columns, labelled = cross_entropy(params, batch)
      right = (jnp.argmax(logits, axis=-1) == columns) & (columns >= 0)
      # A greedy block keeps its tokens up to the first wrong one: the run of right ones.
      run = jnp.cumprod(right.astype(jnp.int32), axis=-1)
      blocks = labelled[..., 0]
      return {"loss_sum": ce.sum((0, 1)), "on_head": (columns >= 0).sum((0, 1)),
              "labelled": labelled.sum((0, 1)), "top1": right.sum((0, 1)),
              "kept": (run.sum(-1) * blocks).sum(), "blocks": blocks.sum()}

    step = make_train_step(loss_fn, self.optimizer)
    self.train_step = lambda params, opt_state, batch: step(params, opt_state,
                                                            {**batch, "frozen": self.frozen})
    self._eval_step = jax.jit(eval_step)

  def evaluate(self, params, batches) -> dict:
    """Held-out cross-entropy and top-1 per block position, and `tokens_per_call`: 1 + the mean run
    of right top-1 tokens from position 1 (what a greedy chain of B - 1 would keep per target call,
    the bonus token included), counted where the whole block has labels or not."""
    totals = {}
    for batch in batches:
      for name, value in self._eval_step(params, {**batch, "frozen": self.frozen}).items():
        totals[name] = totals.get(name, 0) + np.asarray(value, np.float64)
    labelled = np.maximum(totals["labelled"], 1.0)
    return {"loss": float((totals["loss_sum"].sum() / max(totals["on_head"].sum(), 1.0))),
            "top1_by_position": (totals["top1"] / labelled).round(4).tolist(),
            "coverage": float(totals["on_head"].sum() / labelled.sum()),
            "tokens_per_call": float(1.0 + totals["kept"] / max(totals["blocks"], 1.0)),
            "blocks": int(totals["blocks"])}


# ---- the whole run ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Anchored:
  """A drafter trained on anchors of the teacher sequences with `Trainer` (DFlash here, EAGLE-3 in
  training/eagle3.py): its kind (also its output subdirectory), what the progress bar calls it,
  its config for a target and its spec, its initial params, its `terms` and its `save`."""
  kind: str
  label: str
  make_config: Callable
  init_params: Callable
  terms: Callable
  save: Callable


DFLASH = Anchored(
    dflash.KIND, "DFlash",
    lambda target_config, spec: dflash.DFlashConfig.for_target(
        target_config, spec.block_size, spec.num_layers, spec.num_features, spec.mask_token),
    dflash.init_params, block_terms, dflash.save)


def train(output_dir: str = "out/smollm2_dflash", target=None, dflash_spec: DFlashSpec = DFlashSpec(),
          teacher: TeacherSpec = TeacherSpec(), training: TrainSpec = TrainSpec(), seed: int = 0,
          stop_after_step: int | None = None) -> dict:
  """Train a DFlash drafter for `target` (specs.ModelSpec) into output_dir; returns the summary. A
  finished output_dir is reused as is; an interrupted one resumes; one holding another spec is
  refused."""
  return train_heads.run_on_teacher_data(
      output_dir, target, (dflash.KIND, dflash_spec), teacher, training, seed, "a DFlash drafter",
      functools.partial(train_on_sequences, dflash_spec=dflash_spec, training=training, seed=seed,
                        stop_after_step=stop_after_step))


def train_on_sequences(output_dir, loss_log: outputs.RowsFile | None, target_config, target_params,
                       train_seqs: Sequences, val_seqs: Sequences, dflash_spec, training: TrainSpec,
                       seed: int, stop_after_step: int | None = None, metadata: dict | None = None,
                       teacher_seconds: float = 0.0, drafter: Anchored = DFLASH) -> dict:
  """Stages 2-4 for a target already in memory (`dflash_spec`: the drafter's spec, a DFlashSpec
  or what `drafter` takes). Returns the summary (not written)."""
  output_dir = pathlib.Path(output_dir)
  started = time.perf_counter()
  config = drafter.make_config(target_config, dflash_spec)
  fingerprint = heads.target_fingerprint(target_config, target_params)
  both = Sequences.concat([train_seqs, val_seqs])
  features = train_heads.cached_features(target_config, target_params, fingerprint, both,
                                         dflash_spec, config.features)
  split = int(train_seqs.offsets[-1])
  train_windows = Windows.of(train_seqs, features[:split], dflash_spec.sequence_length)
  val_windows = Windows.of(val_seqs, features[split:], dflash_spec.sequence_length)
  features_seconds = time.perf_counter() - started

  head_tokens = (choose_head_tokens(train_seqs, target_config.vocab_size, dflash_spec.head_size)
                 if dflash_spec.head_size else None)
  rows, _ = heads.head_rows(target_config, target_params, head_tokens)
  frozen = {"head_rows": rows, "embed_rows": target_params["embedding"],
            "index_map": head_index_map(target_config.vocab_size, head_tokens)}
  per_batch = max(1, training.tokens_per_batch // dflash_spec.sequence_length)
  batches = Batches(train_windows, per_batch, dflash_spec.anchors, seed)
  held_out = validation_batches(val_windows, per_batch, dflash_spec.anchors, seed)
  trainer = Trainer(config, frozen, training, dflash_spec, drafter.terms)
  initial = drafter.init_params(config, jax.random.PRNGKey(seed))
  before = trainer.evaluate(initial, held_out)
  logging.info("held-out before training: %s", before)
  fit_start = time.perf_counter()
  params, _ = fit(trainer, initial, batches, seed, output_dir / "checkpoints",
                  stop_after_step=stop_after_step, desc=f"train {drafter.label}",
                  on_loss=None if loss_log is None else loss_logger(loss_log),
                  validate=lambda p: {"loss": trainer.evaluate(p, held_out)["loss"]})
  if stop_after_step is not None and stop_after_step < training.steps:
    logging.info("stopped after step %d as asked; rerun to resume", stop_after_step)
    return {"stopped_after_step": stop_after_step}
  train_seconds = time.perf_counter() - fit_start
  after = trainer.evaluate(params, held_out)
  logging.info("held-out after training: %s", after)
  drafter.save(output_dir / drafter.kind, params, config, head_tokens, target_config, fingerprint,
               {**(metadata or {}), "validation": outputs.jsonable(after)})
  return {"target_fingerprint": fingerprint, "kind": drafter.kind,
          "config": dataclasses.asdict(config),
          "train_sequences": len(train_seqs), "validation_sequences": len(val_seqs),
          "validation_before": before, "validation_after": after,
          "loss_curve": ([] if loss_log is None else sorted(
              (row["step"], row["loss"]) for row in outputs.read_rows(loss_log.path))),
          "teacher_seconds": teacher_seconds, "features_seconds": features_seconds,
          "train_seconds": train_seconds, drafter.kind: str(output_dir / drafter.kind)}
