"""Train Medusa-1 heads (specjax/heads.py) or a shared MTP head (specjax/mtp.py, HeadsSpec.kind =
"mtp") on a decoder-only target's own hidden states.

    python -m specjax.train --gin_file=configs/smollm2_heads.gin   (or smollm2_mtp.gin)

Stages, each kept so that nothing computed is lost (output_dir is held by one run at a time and
refused to another spec, the target's weights included, as in specjax/outputs.py):

1. Teacher data (specjax/training/teacher.py, cached under $SPECJAX_CACHE/teacher): the target's
   greedy and sampled continuations of TRAIN-split prompts. A TeacherSpec equal to the draft's
   (training/draft_model.py) reuses its cache.
2. Hidden states: the target's final-norm hidden state at every position of those sequences, float16,
   as the teacher's decoding recorded them (nothing to compute). Teacher data cached before they
   were recorded gets them from teacher-forced prefill passes, cached once under
   $SPECJAX_CACHE/heads_features keyed by the target's fingerprint and the sequences.
3. Training (specjax/training/trainer.py: optax, orbax checkpoints in checkpoints/, exact resume, progress
   with ETA, the loss every 10 steps in train_log.jsonl): each position t is one example, its hidden
   state in and, for head k, the sequence's token at t + k + 1 out (where the sequence has it and t
   is at or past its loss_from). The loss is the heads' summed cross-entropy over the head's tokens,
   plus `distill_weight` times the cross-entropy to the target's own top-k distribution of that token
   (what it predicted at t + k, seeing the true prefix: Medusa-2's self-distillation target).
   Positions are examples of their own (a head sees one hidden state), so a batch is a fixed number
   of positions from all sequences: one compiled shape, no padding. The MTP head (kind "mtp") is
   unrolled num_heads steps from position t with the sequence's tokens at t + 1 .. t + K as inputs;
   step k is scored like head k (the token at t + k + 1) plus `feature_weight` times the squared
   error of its predicted hidden state against the target's at t + k.
4. Output: heads/ (heads.npz or mtp.npz + heads.json with the target's fingerprint;
   `heads.load_heads` / `mtp.load_mtp` read it back for that target only) and summary.json with
   per-head (per-step) held-out cross-entropy, top-1 and top-`top_width` accuracy and coverage
   before (= the target's own next-token head) and after training, and the wall times.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from tqdm import tqdm

from specjax import assets, contracts, launch, loading, outputs, specs
from specjax.drafters import heads, mtp
from specjax.models import decoder_only
from specjax.training import teacher as teacher_data
from specjax.training.teacher import Sequences, TeacherSpec, load_teacher_data, split_validation
from specjax.training.draft_model import choose_head_tokens, head_index_map
from specjax.training.trainer import TrainSpec, fit, loss_logger, make_optimizer, make_train_step


@dataclasses.dataclass(frozen=True)
class HeadsSpec:
  """The heads and what is measured of them. kind "medusa": num_heads heads; kind "mtp": one shared
  head trained unrolled over num_heads steps."""
  num_heads: int = 4
  kind: str = "medusa"
  feature_weight: float = 1.0     # (mtp) weight of the hidden-state squared error
  head_size: int = 4096           # tokens the heads score (0: the whole vocabulary)
  distill_weight: float = 0.0     # weight of the cross-entropy to the target's own top-k
  top_width: int = 4              # held-out accuracy is also reported within each head's top this
  prefill_tokens: int = 2048      # positions per prefill pass computing hidden states
  prefill_bucket: int = 128       # sequences padded to a multiple of this there (one compile each)

  def __post_init__(self):
    if self.num_heads < 1 or self.top_width < 1 or self.head_size < 0:
      raise ValueError("num_heads and top_width must be >= 1 and head_size >= 0, got "
                       f"{self.num_heads}, {self.top_width}, {self.head_size}")
    if self.kind not in ("medusa", "mtp"):
      raise ValueError(f"HeadsSpec.kind must be 'medusa' or 'mtp', got {self.kind!r}")


# ---- 2. the target's hidden states ------------------------------------------------------------------

def target_features(target_config, target_params, seqs: Sequences, prefill_tokens: int = 2048,
                    bucket: int = 128, features: contracts.FeatureSpec = heads.FEATURES) -> np.ndarray:
  """[positions, F] float16: the target's `features` (default: its final-norm hidden state) at every
  position of `seqs`, by causal prefill passes over right-padded batches of similar length (rows
  padded to a fixed count, so each padded length compiles once)."""
  forward = decoder_only.make_forward(target_config)

  @jax.jit
  def hidden(params, tokens):
    rows, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    _, states, _ = forward(params, tokens, positions,
                           decoder_only.init_cache(target_config, rows, width),
                           features=features)
    return states.astype(jnp.float16)

  lengths = seqs.lengths()
  widths = -(-lengths // bucket) * bucket
  out = np.zeros((int(seqs.offsets[-1]), features.width(target_config.embed_dim)), np.float16)
  passes = []
  for width in np.unique(widths):
    members = np.flatnonzero(widths == width)
    rows = max(1, prefill_tokens // int(width))
    passes += [(int(width), rows, members[i:i + rows]) for i in range(0, len(members), rows)]
  for width, rows, members in tqdm(passes, desc="hidden states", unit="pass"):
    tokens = np.zeros((rows, width), np.int32)
    for row, i in enumerate(members):
      tokens[row, :lengths[i]] = seqs.tokens[seqs.offsets[i]:seqs.offsets[i + 1]]
    states = np.asarray(jax.device_get(hidden(target_params, tokens)))
    for row, i in enumerate(members):
      out[seqs.offsets[i]:seqs.offsets[i + 1]] = states[row, :lengths[i]]
  return out


def cached_features(target_config, target_params, fingerprint: str, seqs: Sequences,
                    spec: HeadsSpec, features: contracts.FeatureSpec = heads.FEATURES) -> np.ndarray:
  """target_features, computed once per (target, sequences, features) under
  $SPECJAX_CACHE/heads_features."""
  key = {"target": fingerprint, "format": 1}
  if features != heads.FEATURES:  # the final-norm state keeps the key it was cached under
    key["features"] = dataclasses.asdict(features)
  digest = hashlib.sha256(json.dumps(key).encode())
  digest.update(np.ascontiguousarray(seqs.tokens, np.int32).tobytes())
  digest.update(np.ascontiguousarray(seqs.offsets, np.int64).tobytes())
  path = assets.cache_dir() / "heads_features" / f"{digest.hexdigest()[:16]}.npy"
  if path.exists():
    logging.info("target hidden states: cached at %s", path)
    return np.load(path)
  start = time.perf_counter()
  states = target_features(target_config, target_params, seqs, spec.prefill_tokens,
                           spec.prefill_bucket, features)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp.npy")
  np.save(tmp, states)
  tmp.replace(path)
  logging.info("target hidden states: %d positions in %.0fs -> %s", len(states),
               time.perf_counter() - start, path)
  return states


# ---- 3. examples, batches and the loss --------------------------------------------------------------

def position_examples(seqs: Sequences, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
  """(index[P], labels[P, K]): the flat positions t that train at least head 1 (t >= loss_from and
  t + 2 inside the sequence), and for head k the token at t + k + 1, or -1 past the sequence's end."""
  lengths = seqs.lengths()
  sequence = np.repeat(np.arange(len(seqs)), lengths)
  flat = np.arange(int(seqs.offsets[-1]))
  t = flat - seqs.offsets[:-1][sequence]
  keep = (t >= seqs.loss_from[sequence]) & (t + 2 < lengths[sequence])
  index, t, end = flat[keep], t[keep], lengths[sequence[keep]]
  labels = np.full((len(index), num_heads), -1, np.int32)
  for k in range(1, num_heads + 1):
    inside = t + k + 1 < end
    labels[inside, k - 1] = seqs.tokens[index[inside] + k + 1]
  return index, labels


def make_batches(features: np.ndarray, seqs: Sequences, num_heads: int, index_map: np.ndarray,
                 positions_per_batch: int, seed: int, distill: bool,
                 unrolled: bool = False) -> list[dict]:
  """Batches of `positions_per_batch` examples in a seeded order (the last one padded with examples
  that have no labels). hidden [B, E] float16, labels [B, K] vocab ids (-1: none), columns [B, K]
  (the label's head column, -1 off the head or none); with `distill`, the target's top-k at t + k as
  head columns [B, K, k] and probabilities [B, K, k]; with `unrolled` (MTP), inputs [B, K] (the
  tokens at t + 1 .. t + K, 0 past the end) and next_hidden [B, K, E] float16 (the target's states
  there)."""
  index, labels = position_examples(seqs, num_heads)
  order = np.random.default_rng(seed).permutation(len(index))
  padded = -(-len(order) // positions_per_batch) * positions_per_batch
  order = np.concatenate([order, np.full(padded - len(order), -1, np.int64)])
  batches = []
  for start in range(0, padded, positions_per_batch):
    pick = order[start:start + positions_per_batch]
    real = pick >= 0
    where = index[np.where(real, pick, 0)]
    batch_labels = np.where(real[:, None], labels[np.where(real, pick, 0)], -1)
    batch = {"hidden": features[where],
             "labels": batch_labels.astype(np.int32),
             "columns": np.where(batch_labels >= 0, index_map[np.maximum(batch_labels, 0)],
                                 -1).astype(np.int32)}
    if distill:
      ahead = np.minimum(where[:, None] + np.arange(1, num_heads + 1), len(seqs.tokens) - 1)
      has = (batch_labels >= 0)[..., None]
      batch["teacher_columns"] = np.where(has, index_map[seqs.teacher_ids[ahead]], -1).astype(np.int32)
      batch["teacher_probs"] = np.where(has, np.exp(seqs.teacher_logp[ahead]), 0.0).astype(np.float32)
    if unrolled:
      # Step k's input is the token at t + k, which exists whenever its label (at t + k + 1) does.
      ahead = np.minimum(where[:, None] + np.arange(1, num_heads + 1), len(seqs.tokens) - 1)
      batch["inputs"] = np.where(batch_labels >= 0, seqs.tokens[ahead], 0).astype(np.int32)
      batch["next_hidden"] = features[ahead]
    batches.append(batch)
  return batches


def head_terms(params, head_rows, batch):
  """(logits [B, K, S], per example and head: cross-entropy to the label (0 off the head or with no
  label), and with teacher data the cross-entropy to the target's top-k on the head; for the MTP
  head (batches with inputs) also the squared error of each step's hidden state [B, K])."""
  feature_error = None
  if "inputs" in batch:
    states, logits = mtp.unroll(params, batch["embed_rows"], head_rows, batch["hidden"],
                                batch["inputs"])
    feature_error = jnp.mean(jnp.square(states - batch["next_hidden"].astype(jnp.float32)), -1)
  else:
    logits = heads.head_logits(params, head_rows, batch["hidden"])
  logq = jax.nn.log_softmax(logits, axis=-1)
  columns = batch["columns"]
  hard = -jnp.take_along_axis(logq, jnp.maximum(columns, 0)[..., None], axis=-1)[..., 0]
  hard = jnp.where(columns >= 0, hard, 0.0)
  soft = None
  if "teacher_columns" in batch:
    teacher = batch["teacher_columns"]
    logq_k = jnp.take_along_axis(logq, jnp.maximum(teacher, 0), axis=-1)
    soft = -jnp.where(teacher >= 0, batch["teacher_probs"] * logq_k, 0.0).sum(-1)
  return logits, hard, soft, feature_error


class Trainer:
  """The jitted train and eval steps of K heads over fixed output rows (one compiled shape)."""

  def __init__(self, num_heads: int, head_rows, spec: TrainSpec, heads_spec: HeadsSpec,
               embed_rows=None):
    self.num_heads, self.spec, self.heads_spec = num_heads, spec, heads_spec
    self.head_rows = jnp.asarray(head_rows)
    self.embed_rows = None if embed_rows is None else jnp.asarray(embed_rows)
    self.optimizer = make_optimizer(spec)
    weight = heads_spec.distill_weight

    def loss_fn(params, batch):
      _, hard, soft, feature_error = head_terms(params, batch["head_rows"], batch)
      on_head = (batch["columns"] >= 0).astype(jnp.float32)
      loss = (hard.sum(0) / jnp.maximum(on_head.sum(0), 1.0)).sum()
      if feature_error is not None:
        has = (batch["labels"] >= 0).astype(jnp.float32)
        loss += heads_spec.feature_weight * ((feature_error * has).sum(0)
                                             / jnp.maximum(has.sum(0), 1.0)).sum()
      if soft is not None and weight:
        has = (batch["labels"] >= 0).astype(jnp.float32)
        loss += weight * (soft.sum(0) / jnp.maximum(has.sum(0), 1.0)).sum()
      return loss

    def eval_step(params, batch):
      logits, hard, _, _ = head_terms(params, batch["head_rows"], batch)
      columns, has = batch["columns"], batch["labels"] >= 0
      top = jax.lax.top_k(logits, heads_spec.top_width)[1]
      top1 = (top[..., 0] == columns) & (columns >= 0)
      chain_has = jnp.cumprod(has.astype(jnp.int32), axis=-1)
      return {"loss_sum": hard.sum(0), "on_head": (columns >= 0).sum(0), "labelled": has.sum(0),
              "top1": top1.sum(0),
              "top_width": ((top == columns[..., None]).any(-1) & (columns >= 0)).sum(0),
              "chain": jnp.cumprod(top1.astype(jnp.int32), axis=-1).sum(0),
              "chain_labelled": chain_has.sum(0)}

    step = make_train_step(loss_fn, self.optimizer)
    self.train_step = lambda params, opt_state, batch: step(params, opt_state, self._with_rows(batch))
    self._eval_step = jax.jit(eval_step)

  def _with_rows(self, batch):
    # The frozen output rows go in as an argument (not a constant baked into the program), the same
    # device array every step, so nothing is copied.
    if self.embed_rows is None:
      return {**batch, "head_rows": self.head_rows}
    return {**batch, "head_rows": self.head_rows, "embed_rows": self.embed_rows}

  def evaluate(self, params, batches) -> dict:
    """Per head k: held-out cross-entropy over labels on the head, top-1 and top-`top_width`
    accuracy and coverage over all labels, and chain top-1 (heads 1..k all right: the depth a tree
    of width 1 would reach)."""
    totals = {}
    for batch in batches:
      for name, value in self._eval_step(params, self._with_rows(batch)).items():
        totals[name] = totals.get(name, 0) + np.asarray(value, np.float64)
    report = {}
    for k in range(self.num_heads):
      labelled = max(totals["labelled"][k], 1.0)
      report[heads.head_name(k + 1)] = {
          "loss": totals["loss_sum"][k] / max(totals["on_head"][k], 1.0),
          "top1": totals["top1"][k] / labelled,
          f"top{self.heads_spec.top_width}": totals["top_width"][k] / labelled,
          "chain_top1": totals["chain"][k] / max(totals["chain_labelled"][k], 1.0),
          "coverage": totals["on_head"][k] / labelled, "examples": int(totals["labelled"][k])}
    return report


# ---- the whole run ----------------------------------------------------------------------------------

def train(output_dir: str = "out/smollm2_heads", target=None, heads_spec: HeadsSpec = HeadsSpec(),
          teacher: TeacherSpec = TeacherSpec(), training: TrainSpec = TrainSpec(), seed: int = 0,
          stop_after_step: int | None = None) -> dict:
  """Train heads for `target` (specs.ModelSpec) into output_dir; returns the summary. A finished
  output_dir is reused as is; an interrupted one resumes; one holding another spec is refused."""
  return run_on_teacher_data(
      output_dir, target, ("heads", heads_spec), teacher, training, seed, "heads (Medusa or MTP)",
      functools.partial(train_on_sequences, heads_spec=heads_spec, training=training, seed=seed,
                        stop_after_step=stop_after_step))


def run_on_teacher_data(output_dir, target, named_spec: tuple, teacher: TeacherSpec,
                        training: TrainSpec, seed: int, what: str, train_fn) -> dict:
  """The run every drafter trained on a decoder-only target's teacher data shares: output_dir held
  for this spec (named_spec: (the drafter's name in the spec and its output subdirectory, its spec
  dataclass)), a finished run's summary returned as is, the target loaded and its teacher data split,
  then train_fn(run dir, loss log, target config, target params, train sequences, validation
  sequences, metadata=..., teacher_seconds=...) -> summary, written unless it stopped early."""
  target = target or specs.ModelSpec()
  name, drafter_spec = named_spec
  spec = {"target": dataclasses.asdict(target), name: dataclasses.asdict(drafter_spec),
          "teacher": dataclasses.asdict(teacher), "training": dataclasses.asdict(training),
          "seed": seed, "content_keys": loading.content_keys(target),
          "prompt_digests": teacher_data.prompt_digests(teacher)}
  with outputs.RunDirectory(output_dir, spec, "train_log.jsonl", "spec_fingerprint",
                            launch.operative_config(), other_results=("checkpoints", name),
                            fingerprinted=("checkpoints",)) as run_dir, \
       outputs.RowsFile(run_dir.results, run_dir.fingerprint, "spec_fingerprint",
                        unique_key="step") as loss_log:
    summary_path = run_dir.path / "summary.json"
    if summary_path.exists() and (run_dir.path / name / heads.METADATA_FILE).exists():
      logging.info("trained %s found in %s; nothing to do", name, run_dir.path)
      return json.loads(summary_path.read_text())
    started = time.perf_counter()
    loaded = loading.load_model(target.checkpoint, target.vocabulary)
    if not isinstance(loaded.config, decoder_only.DecoderConfig):
      raise ValueError(f"{what} read a decoder-only (Llama-family) target's hidden states; "
                       f"{target.checkpoint} is an encoder-decoder model")
    loaded = dataclasses.replace(loaded, params=jax.device_put(loaded.params))
    seqs = load_teacher_data({**dataclasses.asdict(target),
                              "content_key": spec["content_keys"]["target"]}, loaded, teacher, seed)
    train_seqs, val_seqs = split_validation(seqs, training.validation_fraction)
    if not len(train_seqs) or not len(val_seqs):
      raise ValueError(f"{len(seqs)} sequences leave {len(train_seqs)} for training and "
                       f"{len(val_seqs)} for validation; add prompts or change validation_fraction")
    summary = train_fn(run_dir.path, loss_log, loaded.config, loaded.params, train_seqs, val_seqs,
                       metadata={"target": {"checkpoint": target.checkpoint,
                                            "content_key": spec["content_keys"]["target"]}},
                       teacher_seconds=time.perf_counter() - started)
    if "stopped_after_step" not in summary:
      summary["total_seconds"] = time.perf_counter() - started
      summary_path.write_text(json.dumps(outputs.jsonable(summary), indent=2) + "\n")
    return summary


def train_on_sequences(output_dir, loss_log: outputs.RowsFile | None, target_config, target_params,
                       train_seqs: Sequences, val_seqs: Sequences, heads_spec: HeadsSpec,
                       training: TrainSpec, seed: int, stop_after_step: int | None = None,
                       metadata: dict | None = None, teacher_seconds: float = 0.0) -> dict:
  """Stages 2-4 for a target already in memory: hidden states, training (checkpoints in
  output_dir/checkpoints), heads saved to output_dir/heads. Returns the summary (not written)."""
  output_dir = pathlib.Path(output_dir)
  started = time.perf_counter()
  fingerprint = heads.target_fingerprint(target_config, target_params)
  both = Sequences.concat([train_seqs, val_seqs])
  if both.hidden is not None:
    features = np.asarray(both.hidden, np.float16)
    logging.info("target hidden states: %d positions, recorded with the teacher data", len(features))
  else:
    features = cached_features(target_config, target_params, fingerprint, both, heads_spec)
  split = int(train_seqs.offsets[-1])
  train_features, val_features = features[:split], features[split:]
  features_seconds = time.perf_counter() - started

  head_tokens = (choose_head_tokens(train_seqs, target_config.vocab_size, heads_spec.head_size)
                 if heads_spec.head_size else None)
  index_map = head_index_map(target_config.vocab_size, head_tokens)
  distill, unrolled = heads_spec.distill_weight > 0, heads_spec.kind == mtp.KIND
  train_batches = make_batches(train_features, train_seqs, heads_spec.num_heads, index_map,
                               training.tokens_per_batch, seed, distill, unrolled)
  val_batches = make_batches(val_features, val_seqs, heads_spec.num_heads, index_map,
                             training.tokens_per_batch, seed, distill=False, unrolled=unrolled)
  rows, _ = heads.head_rows(target_config, target_params, head_tokens)
  trainer = Trainer(heads_spec.num_heads, rows, training, heads_spec,
                    mtp.input_rows(target_config, target_params) if unrolled else None)
  initial = (mtp.init_mtp(target_config.embed_dim) if unrolled
             else heads.init_heads(heads_spec.num_heads, target_config.embed_dim))
  before = trainer.evaluate(initial, val_batches)
  logging.info("held-out before training (the target's own head): %s", before)
  fit_start = time.perf_counter()
  params, _ = fit(trainer, initial, train_batches, seed, output_dir / "checkpoints",
                  stop_after_step=stop_after_step, desc="train heads",
                  on_loss=None if loss_log is None else loss_logger(loss_log))
  if stop_after_step is not None and stop_after_step < training.steps:
    logging.info("stopped after step %d as asked; rerun to resume", stop_after_step)
    return {"stopped_after_step": stop_after_step}
  train_seconds = time.perf_counter() - fit_start
  after = trainer.evaluate(params, val_batches)
  logging.info("held-out after training: %s", after)
  metadata = {**(metadata or {}), "validation": outputs.jsonable(after)}
  if unrolled:
    mtp.save_mtp(output_dir / "heads", params, head_tokens, target_config, fingerprint,
                 heads_spec.num_heads, metadata)
  else:
    heads.save_heads(output_dir / "heads", params, head_tokens, target_config, fingerprint, metadata)
  for name in after:
    logging.info("%s: held-out loss %.3f -> %.3f, top-1 %.3f -> %.3f", name, before[name]["loss"],
                 after[name]["loss"], before[name]["top1"], after[name]["top1"])
  return {"target_fingerprint": fingerprint, "kind": heads_spec.kind, "num_heads": heads_spec.num_heads,
          "head_size": heads_spec.head_size,
          "train_sequences": len(train_seqs), "train_examples": int(sum(
              (b["labels"][:, 0] >= 0).sum() for b in train_batches)),
          "validation_sequences": len(val_seqs), "validation_before": before,
          "validation_after": after,
          "loss_curve": ([] if loss_log is None else sorted(
              (row["step"], row["loss"]) for row in outputs.read_rows(loss_log.path))),
          "teacher_seconds": teacher_seconds, "features_seconds": features_seconds,
          "train_seconds": train_seconds, "heads": str(output_dir / "heads")}

