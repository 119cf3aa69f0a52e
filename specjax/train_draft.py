"""Train a Chen-style draft for a decoder-only target by distillation; export it for peers.

    python -m specjax.train_draft --gin_file=configs/smollm2_draft.gin

Stages, each kept in `output_dir` so that nothing computed is lost:

1. Teacher data (teacher-<hash>.npz, one file per prompt set, reused by any rerun with the same target
   and data spec). For every TRAIN-split prompt of the chosen sets (the held-out split that the
   experiments measure is never seen), the target's greedy continuation and `samples` continuations
   sampled at temperature 1, decoded in batches by the baseline's jitted while_loop, which also records
   the target's top-`teacher_top_k` log-probabilities (temperature 1) at every prompt and generated
   position (DecodeShape.record_top_k). The target runs once per sequence; its distributions are
   never recomputed.
2. The head's tokens: the `head_size` target tokens with the most teacher probability mass in the
   training sequences. The draft scores only those; every other token gets draft probability 0, which
   keeps speculative sampling exact (the residual covers them) and cuts the 49,152-token head that
   dominates a small model's step.
3. Training (orbax checkpoints in checkpoints/, every `checkpoint_every` steps and at the end): forward
   KL from the target's distribution to the draft's, both coarsened to {each teacher top-k token inside
   the head} + {everything else}, optax AdamW with warmup + cosine decay and global-norm clipping. Batches
   are drawn in a seeded order fixed by the step number, so an interrupted run resumes from its latest
   checkpoint to the very parameters an uninterrupted run reaches.
4. Export: hf/ holds config.json + model.safetensors (transformers' LlamaForCausalLM loads it) +
   head_tokens.json; `checkpoints.load_decoder(output_dir/hf)` loads it back as a subset-head draft and
   experiments name it `model:<output_dir>/hf`. summary.json reports held-out KL, top-1 agreement and
   sum_x min(p, q) (a single-token acceptance estimate) before and after training.

Initialisation: the draft's input embedding and head start from the target's embedding table projected
on its top `embed_dim` principal directions, so tokens rare in the training data still start somewhere
sensible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import pathlib
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from tqdm import tqdm

from specjax import autoregressive, data
from specjax.models import decoder_only

PROMPT_SETS = ("humaneval", "news", "ende")


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


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
  """What the target is asked to write, per prompt set (train split only)."""
  tasks: tuple = PROMPT_SETS
  max_new_tokens: tuple = (96, 64, 48)   # per task, in `tasks` order
  samples: tuple = (1, 0, 0)             # temperature-1 continuations per prompt, per task
  prompts_per_task: tuple = (0, 100, 0)  # 0: all train prompts of the set
  max_prompt_tokens: int = 320           # longer prompts are skipped (counted in the log)
  style: str = "chat"
  teacher_top_k: int = 32
  batch_size: int = 16

  def __post_init__(self):
    for field in ("max_new_tokens", "samples", "prompts_per_task"):
      if len(getattr(self, field)) != len(self.tasks):
        raise ValueError(f"TeacherSpec.{field} needs one entry per task {self.tasks}, got "
                         f"{getattr(self, field)}")
    unknown = set(self.tasks) - set(PROMPT_SETS)
    if unknown:
      raise ValueError(f"unknown prompt sets {sorted(unknown)}; known: {PROMPT_SETS}")
    if self.teacher_top_k < 1:
      raise ValueError(f"teacher_top_k must be >= 1, got {self.teacher_top_k}")


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  steps: int = 300
  tokens_per_batch: int = 4096
  learning_rate: float = 3e-3
  warmup_steps: int = 30
  weight_decay: float = 0.01
  clip_norm: float = 1.0
  validation_fraction: float = 0.05  # of the training sequences, chosen by a hash of their prompt
  checkpoint_every: int = 100
  bucket: int = 64                   # sequences are padded to a multiple of this (few compiles)

  def __post_init__(self):
    if self.steps < 1 or self.tokens_per_batch < 1 or self.checkpoint_every < 1:
      raise ValueError("steps, tokens_per_batch and checkpoint_every must be >= 1")
    if not 0.0 < self.validation_fraction < 1.0:
      raise ValueError(f"validation_fraction must lie in (0, 1), got {self.validation_fraction}")


# ---- 1. teacher data --------------------------------------------------------------------------------

@dataclasses.dataclass
class Sequences:
  """Token sequences with the target's top-k next-token log-probs at each position, concatenated.

  tokens[N], teacher_ids[N, k], teacher_logp[N, k]; sequence i spans offsets[i]:offsets[i + 1]; its
  loss covers positions >= loss_from[i] (prompt positions are scored once per prompt, not per
  continuation); group[i] names its prompt (validation is split by prompt, never within one)."""
  tokens: np.ndarray
  teacher_ids: np.ndarray
  teacher_logp: np.ndarray
  offsets: np.ndarray
  loss_from: np.ndarray
  group: np.ndarray  # a stable 63-bit hash of the prompt text

  def __len__(self):
    return len(self.offsets) - 1

  def lengths(self):
    return np.diff(self.offsets)

  def save(self, path):
    tmp = pathlib.Path(str(path) + ".tmp.npz")
    np.savez(tmp, **dataclasses.asdict(self))
    tmp.replace(path)

  @classmethod
  def load(cls, path):
    with np.load(path) as f:
      return cls(**{field.name: f[field.name] for field in dataclasses.fields(cls)})

  @classmethod
  def concat(cls, parts):
    parts = [p for p in parts if len(p)]
    if not parts:
      raise ValueError("no training sequences: every prompt was empty or skipped")
    shifts = np.cumsum([0] + [p.offsets[-1] for p in parts[:-1]])
    return cls(tokens=np.concatenate([p.tokens for p in parts]),
               teacher_ids=np.concatenate([p.teacher_ids for p in parts]),
               teacher_logp=np.concatenate([p.teacher_logp for p in parts]),
               offsets=np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]),
               loss_from=np.concatenate([p.loss_from for p in parts]),
               group=np.concatenate([p.group for p in parts]))

  def subset(self, index):
    index = np.asarray(index)
    pieces = [np.arange(self.offsets[i], self.offsets[i + 1]) for i in index]
    flat = np.concatenate(pieces) if pieces else np.zeros((0,), np.int64)
    return Sequences(self.tokens[flat], self.teacher_ids[flat], self.teacher_logp[flat],
                     np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64),
                     self.loss_from[index], self.group[index])


def stable_hash(text: str) -> int:
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def teacher_sequences(target_config, target_params, tokenizer, task: str, spec: TeacherSpec,
                      seed: int) -> Sequences:
  """The target's continuations of one prompt set's train split, with its top-k everywhere."""
  index = spec.tasks.index(task)
  prompt_set = data.load_prompt_set(task, "train", spec.prompts_per_task[index] or None, spec.style)
  encoded = [tokenizer.encode(p) for p in prompt_set.prompts]
  kept = [i for i, ids in enumerate(encoded) if len(ids) <= spec.max_prompt_tokens]
  if len(kept) < len(encoded):
    logging.info("%s: skipping %d prompts longer than max_prompt_tokens=%d", task,
                 len(encoded) - len(kept), spec.max_prompt_tokens)
  return distil_targets(
      decoder_only.make_step(target_config),
      functools.partial(decoder_only.init_cache, target_config), target_params,
      [encoded[i] for i in kept], [prompt_set.prompts[i] for i in kept],
      max_new_tokens=spec.max_new_tokens[index], samples=spec.samples[index],
      top_k=spec.teacher_top_k, batch_size=spec.batch_size, eos_id=tokenizer.eos_id,
      pad_id=tokenizer.pad_id, seed=seed, desc=f"teacher {task}")


def distil_targets(step, init_cache, params, encoded, names, *, max_new_tokens: int, samples: int,
                   top_k: int, batch_size: int, eos_id, pad_id, seed: int,
                   desc: str = "teacher") -> Sequences:
  """The target (any step function) continues every prompt greedily and `samples` times at
  temperature 1; returns the sequences with its top-k log-probs at every position.

  encoded: token-id lists; names: one text per prompt (its hash groups the prompt's sequences)."""
  empty = [name for name, ids in zip(names, encoded) if len(ids) == 0]
  if empty:
    raise ValueError(f"{len(empty)} of {len(encoded)} prompts tokenize to nothing (first: "
                     f"{empty[0]!r}); the target needs at least one token to continue: drop those "
                     "prompts or give them text")
  order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths batch together
  decode = autoregressive.make_generate(step, init_cache, autoregressive.DecodeShape(
      max_new_tokens, eos_id=eos_id, pad_id=pad_id, record_top_k=top_k))
  runs = [(0.0, 0)] + [(1.0, s + 1) for s in range(samples)]
  batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
  parts = []
  with tqdm(total=len(batches) * len(runs), desc=desc, unit="batch") as bar:
    for temperature, sample in runs:
      for b, batch in enumerate(batches):
        tokens, lengths = data.make_batch([encoded[i] for i in batch], pad_id, bucket=32)
        rng = jax.random.fold_in(jax.random.PRNGKey(seed), 1000 * sample + b)
        out = jax.device_get(decode(params, tokens, lengths, rng, jnp.float32(temperature),
                                    jnp.float32(1.0)))
        parts.append(_rows_to_sequences(out, tokens, lengths, [names[i] for i in batch],
                                        score_prompt=sample == 0))
        bar.update()
  return Sequences.concat(parts)


def _rows_to_sequences(out, prompt_tokens, lengths, prompts, score_prompt: bool) -> Sequences:
  (prompt_logp, prompt_ids), (new_logp, new_ids) = out.prompt_top_k, out.new_top_k
  tokens, ids, logp, sizes, loss_from = [], [], [], [], []
  for row, (length, count) in enumerate(zip(lengths, out.num_generated)):
    tokens.append(np.concatenate([prompt_tokens[row, :length], out.tokens[row, :count]]))
    ids.append(np.concatenate([prompt_ids[row, :length], new_ids[row, :count]]))
    logp.append(np.concatenate([prompt_logp[row, :length], new_logp[row, :count]]))
    sizes.append(length + count)
    # Position length - 1 predicts the first new token: always scored.
    loss_from.append(0 if score_prompt else length - 1)
  return Sequences(np.concatenate(tokens).astype(np.int32), np.concatenate(ids).astype(np.int32),
                   np.concatenate(logp).astype(np.float32),
                   np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                   np.asarray(loss_from, np.int64),
                   np.asarray([stable_hash(p) for p in prompts], np.int64))


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
  table = np.asarray(target_params["embedding"], np.float32)
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


def make_optimizer(spec: TrainSpec):
  schedule = optax.warmup_cosine_decay_schedule(0.0, spec.learning_rate, spec.warmup_steps,
                                                max(spec.steps, spec.warmup_steps + 1),
                                                end_value=spec.learning_rate * 0.1)
  # Decay matrices only; the embedding's unseen rows keep their (projected) start.
  decay = lambda params: {name: jax.tree_util.tree_map(lambda x: x.ndim == 2 and name != "embedding",
                                                       leaf) for name, leaf in params.items()}
  return optax.chain(optax.clip_by_global_norm(spec.clip_norm),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=spec.weight_decay,
                                 mask=decay))


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

    def train_step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    def eval_step(params, batch):
      kl, agree, overlap = distill_terms(forward(params, batch["tokens"]), batch)
      mask = batch["mask"]
      return {"kl": (kl * mask).sum(), "top1_agreement": (agree * mask).sum(),
              "overlap": (overlap * mask).sum(), "positions": mask.sum()}

    self.train_step = jax.jit(train_step, donate_argnums=(0, 1))
    self.eval_step = jax.jit(eval_step)

  def evaluate(self, params, batches) -> dict:
    totals = {}
    for batch in batches:
      for name, value in self.eval_step(params, batch).items():
        totals[name] = totals.get(name, 0.0) + float(value)
    positions = max(totals.pop("positions"), 1.0)
    return {name: value / positions for name, value in totals.items()} | {"positions": positions}


def batch_order(num_batches: int, step: int, seed: int) -> int:
  """The batch that `step` trains on: a fresh seeded permutation every epoch, fixed by the step."""
  epoch, offset = divmod(step, num_batches)
  return int(np.random.default_rng([seed, epoch]).permutation(num_batches)[offset])


@contextlib.contextmanager
def _quiet_absl():
  level = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)
  try:
    yield
  finally:
    logging.set_verbosity(level)


def _checkpoint_manager(directory, spec: TrainSpec):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  return ocp.CheckpointManager(
      pathlib.Path(directory).absolute(),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=spec.checkpoint_every,
                                           enable_async_checkpointing=False))


def fit(trainer: Trainer, params, train_batches, seed: int, checkpoint_dir, *,
        stop_after_step: int | None = None):
  """Train trainer.spec.steps steps from the latest checkpoint in checkpoint_dir (or from `params`).

  train_batches: the list of batch dicts. stop_after_step: return after that step as an interruption
  would (the checkpoint written there lets a rerun resume). Returns (params, losses of this run)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  spec = trainer.spec
  params = jax.tree_util.tree_map(jnp.asarray, decoder_only.model_params(params))
  state = {"params": params, "opt_state": trainer.optimizer.init(params)}
  with _quiet_absl():
    manager = _checkpoint_manager(checkpoint_dir, spec)
    start = manager.latest_step() or 0
    if start:
      state = manager.restore(start, args=ocp.args.StandardRestore(
          jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)))
    logging.info("resumed from the checkpoint at step %d", start)
  end = spec.steps if stop_after_step is None else min(spec.steps, stop_after_step)
  losses = []
  params, opt_state = state["params"], state["opt_state"]
  with tqdm(total=spec.steps, initial=start, desc="train draft", unit="step") as bar:
    for step in range(start, end):
      batch = train_batches[batch_order(len(train_batches), step, seed)]
      params, opt_state, loss = trainer.train_step(params, opt_state, batch)
      if (step + 1) % 10 == 0 or step + 1 == end:
        losses.append((step + 1, float(loss)))
        bar.set_postfix(kl=f"{losses[-1][1]:.3f}")
      if (step + 1) % spec.checkpoint_every == 0 or step + 1 == end:
        with _quiet_absl():  # orbax logs every save at INFO, dozens of lines
          manager.save(step + 1, args=ocp.args.StandardSave({"params": params,
                                                             "opt_state": opt_state}), force=True)
      bar.update()
  with _quiet_absl():
    manager.wait_until_finished()
  return params, losses


# ---- the whole run ----------------------------------------------------------------------------------

def _cache_dir() -> pathlib.Path:
  from specjax.checkpoints import gguf  # pylint: disable=import-outside-toplevel
  return gguf.cache_dir() / "teacher"


def load_teacher_data(target_spec, config, params, tokenizer, spec: TeacherSpec, seed: int):
  """Every task's teacher sequences, each computed once and cached under $SPECJAX_CACHE/teacher."""
  parts = []
  for task in spec.tasks:
    key = json.dumps({"target": dataclasses.asdict(target_spec), "config": dataclasses.asdict(config),
                      "teacher": dataclasses.asdict(spec), "task": task, "seed": seed,
                      "format": 1}, sort_keys=True)
    path = _cache_dir() / f"{task}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    if path.exists():
      parts.append(Sequences.load(path))
      logging.info("teacher data for %s: cached at %s", task, path)
      continue
    start = time.perf_counter()
    seqs = teacher_sequences(config, params, tokenizer, task, spec, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    seqs.save(path)
    logging.info("teacher data for %s: %d sequences, %d positions in %.0fs -> %s", task, len(seqs),
                 seqs.offsets[-1], time.perf_counter() - start, path)
    parts.append(seqs)
  return Sequences.concat(parts)


def split_validation(seqs: Sequences, fraction: float):
  """(train, validation) by a hash of each sequence's prompt, so no prompt is in both."""
  held = (seqs.group % 10_000) < fraction * 10_000
  return seqs.subset(np.flatnonzero(~held)), seqs.subset(np.flatnonzero(held))


def check_draft_matches(draft_config, target_config):
  if draft_config.vocab_size != target_config.vocab_size:
    raise ValueError(f"the draft has a vocabulary of {draft_config.vocab_size} tokens, the target "
                     f"{target_config.vocab_size}: speculative decoding needs the target's vocabulary; "
                     "start from a draft that shares the target's tokenizer, or from DraftShape")


@gin.configurable
def train(output_dir: str = "out/smollm2_draft", target=None, draft: DraftShape = DraftShape(),
          teacher: TeacherSpec = TeacherSpec(), training: TrainSpec = TrainSpec(),
          init_from: str | None = None, seed: int = 0, stop_after_step: int | None = None) -> dict:
  """Distil a draft for `target` (run.ModelSpec) into output_dir; returns the summary.

  init_from: a decoder-only checkpoint (HF directory or .gguf) to start from instead of DraftShape; it
  must share the target's vocabulary. A finished output_dir is reused as is (nothing is recomputed);
  an interrupted one resumes; one holding another spec is refused.
  """
  from specjax import checkpoints, run  # pylint: disable=import-outside-toplevel
  from specjax.checkpoints import hf  # pylint: disable=import-outside-toplevel
  target = target or run.ModelSpec()
  output_dir = pathlib.Path(output_dir)
  spec = {"target": dataclasses.asdict(target), "draft": dataclasses.asdict(draft),
          "teacher": dataclasses.asdict(teacher), "training": dataclasses.asdict(training),
          "init_from": init_from, "seed": seed}
  summary_path = output_dir / "summary.json"
  run._prepare_output_dir(output_dir, spec)  # pylint: disable=protected-access
  if summary_path.exists() and (output_dir / "hf" / "config.json").exists():
    logging.info("trained draft found in %s; nothing to do", output_dir)
    return json.loads(summary_path.read_text())
  (output_dir / "config.gin").write_text(gin.config_str())

  started = time.perf_counter()
  target_config, target_params, tokenizer = run.load_model(target)
  if init_from:
    draft_config, init_params = checkpoints.load_decoder(init_from)
    check_draft_matches(draft_config, target_config)
  else:
    draft_config, init_params = draft.config(target_config), None
  target_params = jax.device_put(target_params)
  seqs = load_teacher_data(target, target_config, target_params, tokenizer, teacher, seed)
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
  params, losses = fit(trainer, init_params, train_batches, seed, output_dir / "checkpoints",
                       stop_after_step=stop_after_step)
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
      "loss_curve": losses, "teacher_seconds": teacher_seconds,
      "train_seconds": time.perf_counter() - fit_start,
      "total_seconds": time.perf_counter() - started, "hf_export": str(output_dir / "hf"),
  }
  summary_path.write_text(json.dumps(summary, indent=2) + "\n")
  logging.info("draft written to %s (held-out KL %.3f -> %.3f, top-1 agreement %.3f -> %.3f)",
               output_dir / "hf", before["kl"], after["kl"], before["top1_agreement"],
               after["top1_agreement"])
  return summary


def cli():
  from specjax import run  # pylint: disable=import-outside-toplevel
  run.gin_cli(train, "configs/smollm2_draft.gin")


if __name__ == "__main__":
  # Configs import `specjax.train_draft`; run that module, not this __main__ copy (see specjax/run.py).
  from specjax import train_draft as _module  # pylint: disable=import-self
  _module.cli()
