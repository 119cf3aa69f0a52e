"""A T5's training objective and steps, for `specjax.training.seq2seq`: teacher-forced logits, the cross-entropy on
the reference tokens (optionally distilled from a teacher T5: `Teacher`), the jitted train and eval
steps (`Trainer`, which `training.fit` drives), and T5's own initialisation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from specjax import checkpoints, contracts, loading
from specjax import vocabulary as vocabularies
from specjax.checkpoints import t5_layout
from specjax.models import t5
from specjax.training.trainer import TrainSpec, make_optimizer, make_train_step, per_position


def teacher_forced_logits(model: t5.T5Model, params, batch) -> jax.Array:
  """logits[B, T, V] of every target position in one decoder call (a fresh cache of T slots)."""
  context = model.encode(params, contracts.Source(batch["inputs"], batch["input_lengths"]))
  rows, width = batch["decoder_inputs"].shape
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
  logits, _ = model.decode_step(params, context, batch["decoder_inputs"], positions,
                                model.init_cache(rows, width))
  return logits


def token_losses(model, params, batch):
  """(cross-entropy, correct) per target position, float32 [B, T] (mask not applied)."""
  logits = teacher_forced_logits(model, params, batch)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return losses, (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Teacher:
  """A trained T5 whose teacher-forced distribution a draft learns (word-level distillation): the
  draft's loss per target position is (1 - weight) x cross-entropy on the reference token + weight x
  cross-entropy against the teacher's softmax. A draft fitted to the target's own distribution agrees
  with it more often than one fitted to the references alone, and alpha is that agreement."""
  config: t5.T5Config
  params: object
  weight: float


def load_teacher(path: str, weight: float, config: t5.T5Config, vocab_path) -> Teacher:
  """The teacher checkpoint at `path`, refused unless it speaks the student's vocabulary."""
  teacher_config, params = checkpoints.load(path)
  if not isinstance(teacher_config, t5.T5Config):
    raise ValueError(f"the teacher {path} is a decoder-only checkpoint; a T5 draft distils from a T5")
  fix = "set TaskSpec.vocabulary to the teacher's spiece.model"
  if teacher_config.vocab_size != config.vocab_size:
    raise ValueError(f"the teacher {path} has another vocabulary ({teacher_config.vocab_size} ids) "
                     f"than the model trained here ({config.vocab_size} ids, {vocab_path}): {fix}")
  loading.check_same_vocabulary(vocabularies.SentencePieceVocabulary.from_file(vocab_path),
                                   str(vocab_path), path, "the teacher", fix)
  return Teacher(teacher_config, jax.device_get(params), weight)


class Trainer:
  """The jitted train and eval steps of one T5 config (one compile per bucket width); with a
  `teacher`, the training loss is distilled (`Teacher`), validation stays the plain cross-entropy."""

  def __init__(self, config: t5.T5Config, spec: TrainSpec, mesh=None, teacher: Teacher | None = None):
    self.config, self.spec = config, spec
    self.optimizer = make_optimizer(spec)
    model = t5.model(config, mesh)  # with a mesh, activations laid out by the sharding rules
    teacher_model = None if teacher is None else t5.model(teacher.config, mesh)

    def loss_fn(params, batch):
      logits = teacher_forced_logits(model, params, batch)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
      if teacher is not None:
        soft = jax.nn.softmax(jax.lax.stop_gradient(
            teacher_forced_logits(teacher_model, batch["teacher_params"], batch)), axis=-1)
        losses = ((1.0 - teacher.weight) * losses
                  + teacher.weight * optax.softmax_cross_entropy(logits, soft))
      return (losses * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1.0)

    def eval_step(params, batch):
      losses, correct = token_losses(model, params, batch)
      mask = batch["mask"]
      return {"loss": (losses * mask).sum(), "accuracy": (correct * mask).sum(),
              "positions": mask.sum()}

    step = make_train_step(loss_fn, self.optimizer)
    if teacher is None:
      self.train_step = step
    else:  # the teacher's weights go in as an argument: as jit constants they would be compiled in
      teacher_params = jax.tree_util.tree_map(jnp.asarray, teacher.params)
      self.train_step = lambda params, opt_state, batch: step(
          params, opt_state, {**batch, "teacher_params": teacher_params})
    self.eval_step = jax.jit(eval_step)

  def evaluate(self, params, batches) -> dict:
    """Validation cross-entropy and next-token accuracy per target token."""
    return per_position(self.eval_step, params, batches)


def t5_init(config: t5.T5Config, seed: int):
  """Random parameters scaled as T5 initialises them, which trains much faster here than the
  model's generic N(0, 0.02): T5 does not divide attention logits by sqrt(head_dim), so the query
  kernel carries that factor (std (d_in * head_dim)^-1/2); other kernels std d_in^-1/2 (fan-in),
  the token embedding std 1, the relative-position tables fan-average, norm scales 1."""
  shapes = t5_layout.flatten(t5.param_shapes(config))
  rng = np.random.default_rng(seed)
  flat = {}
  for name, leaf in sorted(shapes.items()):
    shape = leaf.shape
    if name.endswith("/scale"):
      flat[name] = np.ones(shape, np.float32)
      continue
    if name.endswith("embedding") and "relpos" not in name:
      std = 1.0
    elif "relpos" in name:
      std = (2.0 / sum(shape)) ** 0.5
    elif name.endswith("query/kernel"):
      std = (shape[0] * config.head_dim) ** -0.5
    else:
      std = shape[0] ** -0.5
    flat[name] = (std * rng.standard_normal(shape)).astype(np.float32)
  return traverse_util.unflatten_dict(flat, sep="/")
