"""Teacher data for distillation: the target's own continuations with its top-k at every position.

For every TRAIN-split prompt of the chosen sets (the held-out split that the experiments measure is
never seen), the target's greedy continuation and `samples` continuations sampled at temperature 1,
decoded in batches by the baseline's jitted while_loop, which also records the target's top-k
log-probabilities (temperature 1) at every prompt and generated position
(autoregressive.DecodeShape.record_top_k) and, for a target that returns them, its final-norm hidden
states there (record_features), which the MTP and Medusa heads train on. The target runs once per
sequence; its distributions and hidden states are never recomputed. Each prompt set's result is cached
once under $SPECJAX_CACHE/teacher (the hidden states in a .hidden.npy beside the .npz, read lazily),
keyed by the target, the spec and the seed, so any rerun or another draft shape reuses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from tqdm import tqdm

from specjax import assets, contracts, loading, validation
from specjax.decoding import autoregressive
from specjax.data import prompts

# The sets a target may be taught on (their train splits). `stdlib` never is: it is held out, code
# from a source no training set reads.
PROMPT_SETS = ("humaneval", "news", "ende", "pycode")


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
  """What the target is asked to write, per prompt set (train split only)."""
  tasks: tuple = ("humaneval", "news", "ende")
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


@dataclasses.dataclass
class Sequences:
  """Token sequences with the target's top-k next-token log-probs at each position, concatenated.

  tokens[N], teacher_ids[N, k], teacher_logp[N, k]; sequence i spans offsets[i]:offsets[i + 1]; its
  loss covers positions >= loss_from[i] (prompt positions are scored once per prompt, not per
  continuation); group[i] names its prompt (validation is split by prompt, never within one).
  hidden[N, E] float16: the target's final-norm hidden state at every position, or None (a target
  that returns none, or teacher data cached before they were recorded)."""
  tokens: np.ndarray
  teacher_ids: np.ndarray
  teacher_logp: np.ndarray
  offsets: np.ndarray
  loss_from: np.ndarray
  group: np.ndarray  # a stable 63-bit hash of the prompt text
  hidden: np.ndarray | None = None

  ARRAYS = ("tokens", "teacher_ids", "teacher_logp", "offsets", "loss_from", "group")

  def __len__(self):
    return len(self.offsets) - 1

  def lengths(self):
    return np.diff(self.offsets)

  def save(self, path):
    if self.hidden is not None:  # first, so a finished .npz always has its hidden states beside it
      tmp = pathlib.Path(str(path) + ".tmp.npy")
      np.save(tmp, self.hidden)
      tmp.replace(_hidden_path(path))
    tmp = pathlib.Path(str(path) + ".tmp.npz")
    np.savez(tmp, **{name: getattr(self, name) for name in self.ARRAYS})
    tmp.replace(path)

  @classmethod
  def load(cls, path):
    hidden_path = _hidden_path(path)
    # Memory-mapped: a draft that never reads them pays nothing for ~2 KB per position.
    hidden = np.load(hidden_path, mmap_mode="r") if hidden_path.exists() else None
    with np.load(path) as f:
      return cls(**{name: f[name] for name in cls.ARRAYS}, hidden=hidden)

  @classmethod
  def concat(cls, parts):
    parts = [p for p in parts if len(p)]
    if not parts:
      raise ValueError("no training sequences: every prompt was empty or skipped")
    shifts = np.cumsum([0] + [p.offsets[-1] for p in parts[:-1]])
    hidden = (np.concatenate([p.hidden for p in parts])
              if all(p.hidden is not None for p in parts) else None)
    return cls(tokens=np.concatenate([p.tokens for p in parts]),
               teacher_ids=np.concatenate([p.teacher_ids for p in parts]),
               teacher_logp=np.concatenate([p.teacher_logp for p in parts]),
               offsets=np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]),
               loss_from=np.concatenate([p.loss_from for p in parts]),
               group=np.concatenate([p.group for p in parts]), hidden=hidden)

  def subset(self, index):
    index = np.asarray(index)
    pieces = [np.arange(self.offsets[i], self.offsets[i + 1]) for i in index]
    flat = np.concatenate(pieces) if pieces else np.zeros((0,), np.int64)
    return Sequences(self.tokens[flat], self.teacher_ids[flat], self.teacher_logp[flat],
                     np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64),
                     self.loss_from[index], self.group[index],
                     None if self.hidden is None else self.hidden[flat])


def _hidden_path(path) -> pathlib.Path:
  path = pathlib.Path(path)
  return path.with_name(path.stem + ".hidden.npy")


def stable_hash(text: str) -> int:
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def task_prompts(spec: TeacherSpec, task: str) -> prompts.PromptSet:
  """The prompts the target continues for one task: its train split, the first prompts_per_task."""
  index = spec.tasks.index(task)
  return prompts.prompt_set_for_run(task, "train", spec.prompts_per_task[index] or None, spec.style,
                                    "TeacherSpec.tasks")


def prompt_digests(spec: TeacherSpec) -> dict:
  """{task: validation.prompt_digest of the prompts used}: in the trainers' specs and the teacher
  data's cache keys, so prompts that change (another package version) are another run."""
  return {task: validation.prompt_digest(task_prompts(spec, task)) for task in spec.tasks}


def teacher_sequences(target: loading.LoadedModel, task: str, spec: TeacherSpec,
                      seed: int) -> Sequences:
  """The target's continuations of one prompt set's train split, with its top-k everywhere."""
  index = spec.tasks.index(task)
  prompt_set = task_prompts(spec, task)
  tokenizer = target.tokenizer
  encoded = [tokenizer.encode(p) for p in prompt_set.prompts]
  kept = [i for i, ids in enumerate(encoded) if len(ids) <= spec.max_prompt_tokens]
  if len(kept) < len(encoded):
    logging.info("%s: skipping %d prompts longer than max_prompt_tokens=%d", task,
                 len(encoded) - len(kept), spec.max_prompt_tokens)
  return distil_targets(
      target.model, target.params, [encoded[i] for i in kept], [prompt_set.prompts[i] for i in kept],
      max_new_tokens=spec.max_new_tokens[index], samples=spec.samples[index],
      top_k=spec.teacher_top_k, batch_size=spec.batch_size, eos_id=tokenizer.eos_id,
      pad_id=tokenizer.pad_id, seed=seed, desc=f"teacher {task}")


def distil_targets(model: contracts.Model, params, encoded, names, *, max_new_tokens: int,
                   samples: int, top_k: int, batch_size: int, eos_id, pad_id, seed: int,
                   desc: str = "teacher") -> Sequences:
  """The target (a decoder-only contracts.Model) continues every prompt greedily and `samples` times
  at temperature 1; returns the sequences with its top-k log-probs at every position, and its
  final-norm hidden states there.

  encoded: token-id lists; names: one text per prompt (its hash groups the prompt's sequences)."""
  empty = [name for name, ids in zip(names, encoded) if len(ids) == 0]
  if empty:
    raise ValueError(f"{len(empty)} of {len(encoded)} prompts tokenize to nothing (first: "
                     f"{empty[0]!r}); the target needs at least one token to continue: drop those "
                     "prompts or give them text")
  order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths batch together
  decode = autoregressive.make_generate(model, autoregressive.DecodeShape(
      max_new_tokens, eos_id=eos_id, pad_id=pad_id, record_top_k=top_k,
      record_features=contracts.FeatureSpec(final_norm=True)))
  runs = [(0.0, 0)] + [(1.0, s + 1) for s in range(samples)]
  batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
  parts = []
  with tqdm(total=len(batches) * len(runs), desc=desc, unit="batch") as bar:
    for temperature, sample in runs:
      for b, batch in enumerate(batches):
        tokens, lengths = prompts.make_batch([encoded[i] for i in batch], pad_id, bucket=32)
        rng = jax.random.fold_in(jax.random.PRNGKey(seed), 1000 * sample + b)
        out = jax.device_get(decode(params, tokens, lengths, rng, jnp.float32(temperature),
                                    jnp.float32(1.0)))
        parts.append(_rows_to_sequences(out, tokens, lengths, [names[i] for i in batch],
                                        score_prompt=sample == 0))
        bar.update()
  return Sequences.concat(parts)


def _rows_to_sequences(out, prompt_tokens, lengths, prompts, score_prompt: bool) -> Sequences:
  (prompt_logp, prompt_ids), (new_logp, new_ids) = out.prompt_top_k, out.new_top_k
  with_hidden = out.prompt_hidden is not None
  tokens, ids, logp, hidden, sizes, loss_from = [], [], [], [], [], []
  for row, (length, count) in enumerate(zip(lengths, out.num_generated)):
    tokens.append(np.concatenate([prompt_tokens[row, :length], out.tokens[row, :count]]))
    ids.append(np.concatenate([prompt_ids[row, :length], new_ids[row, :count]]))
    logp.append(np.concatenate([prompt_logp[row, :length], new_logp[row, :count]]))
    if with_hidden:
      hidden.append(np.concatenate([out.prompt_hidden[row, :length], out.new_hidden[row, :count]]))
    sizes.append(length + count)
    # Position length - 1 predicts the first new token: always scored.
    loss_from.append(0 if score_prompt else length - 1)
  return Sequences(np.concatenate(tokens).astype(np.int32), np.concatenate(ids).astype(np.int32),
                   np.concatenate(logp).astype(np.float32),
                   np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                   np.asarray(loss_from, np.int64),
                   np.asarray([stable_hash(p) for p in prompts], np.int64),
                   np.concatenate(hidden).astype(np.float16) if with_hidden else None)


def split_validation(seqs: Sequences, fraction: float):
  """(train, validation) by a hash of each sequence's prompt, so no prompt is in both."""
  held = (seqs.group % 10_000) < fraction * 10_000
  return seqs.subset(np.flatnonzero(~held)), seqs.subset(np.flatnonzero(held))


def load_teacher_data(target_key: dict, target: loading.LoadedModel, spec: TeacherSpec, seed: int):
  """Every task's teacher sequences, each computed once and cached under $SPECJAX_CACHE/teacher.

  target_key: what names the target (the model spec as a dict; fields at None are left out, so a
  field added later at its None default keeps earlier caches valid)."""
  parts, digests = [], prompt_digests(spec)
  for task in spec.tasks:
    key = json.dumps({"target": {k: v for k, v in target_key.items() if v is not None},
                      "config": dataclasses.asdict(target.config),
                      "teacher": dataclasses.asdict(spec), "task": task, "seed": seed,
                      "prompt_digest": digests[task], "format": 1}, sort_keys=True)
    path = (assets.cache_dir() / "teacher"
            / f"{task}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz")
    if path.exists():
      parts.append(Sequences.load(path))
      logging.info("teacher data for %s: cached at %s", task, path)
      continue
    start = time.perf_counter()
    seqs = teacher_sequences(target, task, spec, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    seqs.save(path)
    logging.info("teacher data for %s: %d sequences, %d positions in %.0fs -> %s", task, len(seqs),
                 seqs.offsets[-1], time.perf_counter() - start, path)
    parts.append(seqs)
  return Sequences.concat(parts)


