"""Train a Chen-style draft for a decoder-only target by distillation; export it for peers.

    python -m specjax.train --gin_file=configs/smollm2_draft.gin

Stages, each kept in `output_dir` so that nothing computed is lost (the directory is held by one run
at a time and refused to another spec, the target's weights included, as in specjax/outputs.py):

1. Teacher data (specjax/training/teacher.py; cached under $SPECJAX_CACHE/teacher, one file per prompt set,
   reused by any rerun with the same target and data spec): the target's greedy and sampled
   continuations of the TRAIN-split prompts with its top-`teacher_top_k` log-probabilities at every
   position.
2. The head's tokens: the `head_size` target tokens with the most teacher probability mass in the
   training sequences. The draft scores only those; every other token gets draft probability 0, which
   keeps speculative sampling exact (the residual covers them) and cuts the 49,152-token head that
   dominates a small model's step.
3. Training (specjax/training/trainer.py; orbax checkpoints in checkpoints/, every `checkpoint_every` steps
   and at the end, exact resume from the newest checkpoint that restores; the loss every 10 steps in
   train_log.jsonl, kept across resumes): forward KL from the target's distribution to the draft's, both
   coarsened to {each teacher top-k token inside the head} + {everything else}.
4. Export: hf/ holds config.json + model.safetensors (transformers' LlamaForCausalLM loads it) +
   head_tokens.json; `checkpoints.load_decoder(output_dir/hf)` loads it back as a subset-head draft and
   experiments name it `model:<output_dir>/hf`. summary.json reports held-out KL, top-1 agreement and
   sum_x min(p, q) (a single-token acceptance estimate) before and after training.

Initialisation: the draft's input embedding and head start from the target's embedding table projected
on its top `embed_dim` principal directions, so tokens rare in the training data still start somewhere
sensible.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from specjax import checkpoints, launch, loading, outputs, specs
from specjax.checkpoints import hf
from specjax.models import cpu_kernels, decoder_only
from specjax.training import teacher as teacher_data
from specjax.training.teacher import Sequences, TeacherSpec, load_teacher_data, split_validation
from specjax.training.trainer import (TrainSpec, fit, loss_logger, make_optimizer, make_train_step,
                              per_position)


@dataclasses.dataclass(frozen=True)
class DraftShape:
  """The draft's architecture (Llama block: RMSNorm, RoPE, GQA attention, SwiGLU)."""
  embed_dim: int = 256
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  mlp_dim: int = 768
  head_size: int = 8192  # tokens the head scores (0: the whole vocabulary)

  def config(self, target: decoder_only.DecoderConfig) -> decoder_only.DecoderConfig:
    return decoder_only.DecoderConfig(
        vocab_size=target.vocab_size, embed_dim=self.embed_dim, num_layers=self.num_layers,
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        mlp_dim=self.mlp_dim, rope_theta=target.rope_theta, norm_eps=target.norm_eps,
        tie_embeddings=False, head_size=self.head_size)


# ---- 2. the head's tokens and the initial draft -----------------------------------------------------

def choose_head_tokens(seqs: Sequences, vocab_size: int, head_size: int) -> np.ndarray:
  """The `head_size` ids with the most teacher probability mass over the sequences (ties: lower id),
  in ascending id order."""
  mass = np.zeros(vocab_size, np.float64)
  np.add.at(mass, seqs.teacher_ids.ravel(), np.exp(seqs.teacher_logp.ravel().astype(np.float64)))
  order = np.lexsort((np.arange(vocab_size), -mass))  # by mass descending, then id ascending
  return np.sort(order[:head_size]).astype(np.int32)


def head_coverage(seqs: Sequences, head_tokens) -> float:
  """Share of the teacher's top-k probability mass that falls on head tokens."""
  p = np.exp(seqs.teacher_logp.astype(np.float64))
  inside = np.isin(seqs.teacher_ids, head_tokens)
  return float((p * inside).sum() / p.sum())


def _principal_directions(matrix: np.ndarray, dims: int, rng: np.random.Generator) -> np.ndarray:
  """[D, dims]: the top right-singular directions of matrix[N, D] (random orthonormal past D)."""
  matrix = np.asarray(matrix, np.float64)
  eigvals, eigvecs = np.linalg.eigh(matrix.T @ matrix)
  basis = eigvecs[:, ::-1][:, :dims]
  if dims > basis.shape[1]:
    extra = rng.normal(size=(matrix.shape[1], dims - basis.shape[1])) / np.sqrt(matrix.shape[1])
    basis = np.concatenate([basis, extra], axis=1)
  return basis


def init_draft_params(draft_config, target_config, target_params, head_tokens, seed: int):
  """Random blocks; embedding and head from the target's tables projected on their principal
  directions (so draft logits start as a low-rank copy of the target's embedding similarities)."""
  params = jax.device_get(decoder_only.init_params(draft_config, jax.random.PRNGKey(seed),
                                                   head_tokens))
  rng = np.random.default_rng(seed)
  table = np.asarray(cpu_kernels.embedding_table(target_params["embedding"]), np.float32)
  head = table if target_config.tie_embeddings else np.asarray(target_params["lm_head"]).T
  params["embedding"] = (table @ _principal_directions(table, draft_config.embed_dim, rng)
                         ).astype(np.float32)
  rows = head if not draft_config.head_size else head[np.asarray(head_tokens)]
  params["lm_head"] = np.ascontiguousarray(
      (rows @ _principal_directions(head, draft_config.embed_dim, rng)).T.astype(np.float32))
  return params


# ---- 3. training ------------------------------------------------------------------------------------

def make_batches(seqs: Sequences, tokens_per_batch: int, bucket: int) -> list[np.ndarray]:
  """Sequence indices per batch: sequences of one padded length (a multiple of `bucket`) together, as
  many rows as fit `tokens_per_batch` (at least one). Deterministic."""
  padded = -(-seqs.lengths() // bucket) * bucket
  batches = []
  for width in np.unique(padded):
    members = np.flatnonzero(padded == width)
    rows = max(1, tokens_per_batch // int(width))
    batches += [members[i:i + rows] for i in range(0, len(members), rows)]
  return batches


def head_index_map(vocab_size: int, head_tokens) -> np.ndarray:
  """vocab id -> its column in the head, -1 off the head (identity for a full-vocabulary head)."""
  if head_tokens is None:
    return np.arange(vocab_size, dtype=np.int32)
  index = np.full(vocab_size, -1, np.int32)
  index[np.asarray(head_tokens)] = np.arange(len(head_tokens), dtype=np.int32)
  return index


def batch_arrays(seqs: Sequences, members, bucket: int, index_map: np.ndarray) -> dict:
  """Right-padded arrays of the given sequences: tokens [B, L], loss mask [B, L], the teacher's top-k
  as head columns (-1 off the head) [B, L, k], its probabilities [B, L, k], its top-1 vocab id [B, L]."""
  lengths = seqs.lengths()[members]
  width = int(-(-lengths.max() // bucket) * bucket)
  k = seqs.teacher_ids.shape[1]
  out = {"tokens": np.zeros((len(members), width), np.int32),
         "mask": np.zeros((len(members), width), np.float32),
         "teacher_columns": np.full((len(members), width, k), -1, np.int32),
         "teacher_probs": np.zeros((len(members), width, k), np.float32),
         "teacher_top1": np.zeros((len(members), width), np.int32)}
  for row, i in enumerate(members):
    span = slice(seqs.offsets[i], seqs.offsets[i + 1])
    n = seqs.offsets[i + 1] - seqs.offsets[i]
    out["tokens"][row, :n] = seqs.tokens[span]
    out["mask"][row, seqs.loss_from[i]:n] = 1.0
    out["teacher_columns"][row, :n] = index_map[seqs.teacher_ids[span]]
    out["teacher_probs"][row, :n] = np.exp(seqs.teacher_logp[span])
    out["teacher_top1"][row, :n] = seqs.teacher_ids[span, 0]
  return out


def distill_terms(head_logits, batch):
  """Per-position forward KL(teacher || draft) over {each teacher top-k token on the head} + {rest},
  the draft's top-1 == teacher's top-1, and sum min(p, q) over the teacher's top-k on the head."""
  logq = jax.nn.log_softmax(head_logits.astype(jnp.float32), axis=-1)
  columns = batch["teacher_columns"]
  on_head = columns >= 0
  logq_k = jnp.take_along_axis(logq, jnp.maximum(columns, 0), axis=-1)
  p = jnp.where(on_head, batch["teacher_probs"], 0.0)
  q = jnp.where(on_head, jnp.exp(logq_k), 0.0)
  p_rest = jnp.clip(1.0 - p.sum(-1), 1e-6, 1.0)
  q_rest = jnp.clip(1.0 - q.sum(-1), 1e-6, 1.0)
  kl = (jnp.where(on_head, p * (jnp.log(jnp.maximum(p, 1e-30)) - logq_k), 0.0).sum(-1)
        + p_rest * (jnp.log(p_rest) - jnp.log(q_rest)))
  draft_top1_column = jnp.argmax(head_logits, axis=-1)
  top1_column = columns[..., 0]
  agree = ((top1_column >= 0) & (draft_top1_column == top1_column)).astype(jnp.float32)
  overlap = jnp.minimum(p, q).sum(-1)
  return kl, agree, overlap


def _forward(head_step, config, params, tokens):
  batch, width = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  logits, _ = head_step(params, tokens, positions, decoder_only.init_cache(config, batch, width))
  return logits


class Trainer:
  """The jitted train and eval steps of one draft config (one compile per padded length)."""

  def __init__(self, config, spec: TrainSpec):
    self.config, self.spec = config, spec
    self.optimizer = make_optimizer(spec)
    head_step = decoder_only.head_logits_step(config)
    forward = functools.partial(_forward, head_step, config)

    def loss_fn(params, batch):
      kl, _, _ = distill_terms(forward(params, batch["tokens"]), batch)
      return (kl * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1.0)

    def eval_step(params, batch):
      kl, agree, overlap = distill_terms(forward(params, batch["tokens"]), batch)
      mask = batch["mask"]
      return {"kl": (kl * mask).sum(), "top1_agreement": (agree * mask).sum(),
              "overlap": (overlap * mask).sum(), "positions": mask.sum()}

    self.train_step = make_train_step(loss_fn, self.optimizer)
    self.eval_step = jax.jit(eval_step)

  def evaluate(self, params, batches) -> dict:
    return per_position(self.eval_step, params, batches)


# ---- the whole run ----------------------------------------------------------------------------------

def check_draft_matches(draft_config, target_config):
  if draft_config.vocab_size != target_config.vocab_size:
    raise ValueError(f"the draft has a vocabulary of {draft_config.vocab_size} tokens, the target "
                     f"{target_config.vocab_size}: speculative decoding needs the target's vocabulary; "
                     "start from a draft that shares the target's tokenizer, or from DraftShape")


def train(output_dir: str = "out/smollm2_draft", target=None, draft: DraftShape = DraftShape(),
          teacher: TeacherSpec = TeacherSpec(), training: TrainSpec = TrainSpec(),
          init_from: str | None = None, seed: int = 0, stop_after_step: int | None = None) -> dict:
  """Distil a draft for `target` (specs.ModelSpec) into output_dir; returns the summary.

  init_from: a decoder-only checkpoint (HF directory or .gguf) to start from instead of DraftShape; it
  must share the target's vocabulary. A finished output_dir is reused as is (nothing is recomputed);
  an interrupted one resumes; one holding another spec is refused.
  """
  target = target or specs.ModelSpec()
  spec = {"target": dataclasses.asdict(target), "draft": dataclasses.asdict(draft),
          "teacher": dataclasses.asdict(teacher), "training": dataclasses.asdict(training),
          "init_from": init_from, "seed": seed, "content_keys": loading.content_keys(target),
          "prompt_digests": teacher_data.prompt_digests(teacher)}
  if init_from:
    spec["content_keys"]["init_from"] = checkpoints.content_key(init_from)
    if target.vocabulary is None:  # the draft to start from must speak the target's vocabulary
      shipped = loading.shipped_vocabulary(loading.checkpoint_path(target.checkpoint))
      if shipped is not None:
        loading.check_same_vocabulary(
            shipped[0], f"the target {target.checkpoint}", init_from, "init_from",
            "start from a draft that shares the target's tokenizer, or from DraftShape")
  # The directory is held for the whole run (one run at a time); its results are the loss log (one
  # row per 10 steps, which also keeps the whole curve across resumes), the checkpoints and hf/.
  with outputs.RunDirectory(output_dir, spec, "train_log.jsonl", "spec_fingerprint",
                            launch.operative_config(), other_results=("checkpoints", "hf"),
                            fingerprinted=("checkpoints",)) as run_dir, \
       outputs.RowsFile(run_dir.results, run_dir.fingerprint, "spec_fingerprint",
                        unique_key="step") as loss_log:
    return _train(run_dir.path, loss_log, spec, target, draft, teacher, training, init_from, seed,
                  stop_after_step)


def _train(output_dir: pathlib.Path, loss_log: outputs.RowsFile, spec: dict, target, draft, teacher,
           training, init_from, seed, stop_after_step) -> dict:
  summary_path = output_dir / "summary.json"
  if summary_path.exists() and (output_dir / "hf" / "config.json").exists():
    logging.info("trained draft found in %s; nothing to do", output_dir)
    return json.loads(summary_path.read_text())
  started = time.perf_counter()
  loaded = loading.load_model(target.checkpoint, target.vocabulary)
  target_config = loaded.config
  if not isinstance(target_config, decoder_only.DecoderConfig):
    raise ValueError(f"draft_model.train distils decoder-only (Llama-family) targets; {target.checkpoint} "
                     "is an encoder-decoder model")
  if init_from:
    draft_config, init_params = checkpoints.load(init_from)
    check_draft_matches(draft_config, target_config)
  else:
    draft_config, init_params = draft.config(target_config), None
  loaded = dataclasses.replace(loaded, params=jax.device_put(loaded.params))
  target_params = loaded.params
  seqs = load_teacher_data({**dataclasses.asdict(target),
                           "content_key": spec["content_keys"]["target"]}, loaded, teacher, seed)
  teacher_seconds = time.perf_counter() - started
  train_seqs, val_seqs = split_validation(seqs, training.validation_fraction)
  if not len(train_seqs) or not len(val_seqs):
    raise ValueError(f"{len(seqs)} sequences leave {len(train_seqs)} for training and "
                     f"{len(val_seqs)} for validation; add prompts or change validation_fraction")

  if draft_config.head_size:
    head_tokens = (np.asarray(init_params[decoder_only.HEAD_TOKENS]) if init_params is not None
                   and decoder_only.HEAD_TOKENS in init_params
                   else choose_head_tokens(train_seqs, target_config.vocab_size,
                                           draft_config.head_size))
  else:
    head_tokens = None
  if init_params is None:
    init_params = init_draft_params(draft_config, target_config, target_params, head_tokens, seed)
  index_map = head_index_map(target_config.vocab_size, head_tokens)
  to_arrays = lambda members, s: batch_arrays(s, members, training.bucket, index_map)
  train_batches = [to_arrays(m, train_seqs) for m in make_batches(train_seqs,
                                                                  training.tokens_per_batch,
                                                                  training.bucket)]
  val_batches = [to_arrays(m, val_seqs) for m in make_batches(val_seqs, training.tokens_per_batch,
                                                              training.bucket)]
  trainer = Trainer(draft_config, training)
  before = trainer.evaluate(decoder_only.model_params(init_params), val_batches)
  logging.info("held-out before training: %s", before)
  fit_start = time.perf_counter()
  params, _ = fit(trainer, decoder_only.model_params(init_params), train_batches, seed,
                  output_dir / "checkpoints", stop_after_step=stop_after_step,
                  desc="train draft", on_loss=loss_logger(loss_log))
  if stop_after_step is not None and stop_after_step < training.steps:
    logging.info("stopped after step %d as asked; rerun to resume", stop_after_step)
    return {"stopped_after_step": stop_after_step}
  after = trainer.evaluate(params, val_batches)
  logging.info("held-out after training: %s", after)
  params = jax.device_get(params)
  if head_tokens is not None:
    params = {**params, decoder_only.HEAD_TOKENS: head_tokens}
  hf.save(output_dir / "hf", draft_config, params)
  summary = {
      "draft_config": dataclasses.asdict(draft_config),
      "draft_parameters": int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params))),
      "train_sequences": len(train_seqs), "train_positions": int(train_seqs.offsets[-1]),
      "validation_sequences": len(val_seqs), "validation_positions": int(val_seqs.offsets[-1]),
      "head_coverage_validation": (head_coverage(val_seqs, head_tokens)
                                   if head_tokens is not None else 1.0),
      "validation_before": before, "validation_after": after,
      "loss_curve": sorted((row["step"], row["loss"]) for row in outputs.read_rows(loss_log.path)),
      "teacher_seconds": teacher_seconds,
      "train_seconds": time.perf_counter() - fit_start,
      "total_seconds": time.perf_counter() - started, "hf_export": str(output_dir / "hf"),
  }
  summary_path.write_text(json.dumps(summary, indent=2) + "\n")
  logging.info("draft written to %s (held-out KL %.3f -> %.3f, top-1 agreement %.3f -> %.3f)",
               output_dir / "hf", before["kl"], after["kl"], before["top1_agreement"],
               after["top1_agreement"])
  return summary

