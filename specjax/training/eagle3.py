"""Train an EAGLE-3 drafter (specjax/drafters/eagle3.py) on a decoder-only target's own features.

    python -m specjax.train --gin_file=configs/smollm2_eagle3.gin

The stages, batches, loss and outputs are DFlash's (training/dflash.py: teacher data, the target's
features cached once, `anchors` random roots per sequence drawn afresh each step from (seed, step)
where every following token is the target's own, cross-entropy plus `distill_weight` x the target's
top-k, held-out top-1 by depth and tokens per greedy chain before and after); what differs is the
drafter's pass, `unroll_terms`, EAGLE-3's training-time test. For a root at position a:

    depth 1   the entry (features at a - 1, token a) attends to the entries of every position up to
              a - 1 (all built from the target's features) and predicts token a + 1;
    depth k   the entry (the drafter's own output at depth k - 1, the true token a + k - 1) attends
              to the same entries and to its own depths 2 .. k, and predicts token a + k

exactly what drafting computes along one path of the tree (tests/test_eagle3.py checks the logits
match), so the drafter learns from the hidden states it will itself feed back. Depth k's loss
weighs 0.8^(k - 1), as in EAGLE-3's released training code.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import eagle3
from specjax.models import layers
from specjax.training import dflash as train_dflash
from specjax.training import heads as train_heads
from specjax.training.teacher import TeacherSpec
from specjax.training.trainer import TrainSpec


@dataclasses.dataclass(frozen=True)
class Eagle3Spec:
  """The drafter's training: `depth` unrolled depths per root (the deepest tree it drafts well),
  `anchors` roots per sequence (the last `sequence_length` tokens of each), the `head_size` tokens
  its head scores, the prefill that computes the target's features, and the weight of the
  distillation term (0: tokens only)."""
  depth: int = 5
  head_size: int = 4096
  anchors: int = 32
  sequence_length: int = 384
  decay: float = 0.8
  prefill_tokens: int = 2048
  prefill_bucket: int = 128
  distill_weight: float = 1.0

  def __post_init__(self):
    if self.depth < 1 or self.anchors < 1 or self.sequence_length < 2 or self.head_size < 0:
      raise ValueError(f"depth and anchors must be >= 1, sequence_length >= 2 and head_size >= 0; "
                       f"got {self.depth}, {self.anchors}, {self.sequence_length}, {self.head_size}")

  def position_weights(self) -> np.ndarray:
    """[depth]: the loss weight of depths 1 .. depth."""
    return (self.decay ** np.arange(self.depth)).astype(np.float32)


def unroll_terms(config: eagle3.Eagle3Config, params: dict, frozen: dict, batch: dict, depth: int):
  """(logits [N, M, depth, S], labels as head columns [N, M, depth] (-1: none or off the head),
  labelled [N, M, depth]) for the M roots (`anchors`) of each of a batch's N sequences."""
  tokens, anchors = batch["tokens"], batch["anchors"]
  rows, length = tokens.shape
  count = anchors.shape[1]
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
  following = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
  fused = eagle3.fuse(params, batch["features"])
  queries, keys, values = eagle3.entry(config, params, fused, layers.embed(
      frozen["embed_rows"], following), positions)
  roots = anchors - 1                                   # the entry that predicts depth 1
  take = lambda x: jnp.take_along_axis(x, roots.reshape(rows, count, *(1,) * (x.ndim - 2)), axis=1)
  visible = jnp.arange(length)[None, None, :] <= roots[:, :, None]
  hidden = eagle3.finish(config, params, take(fused),
                         eagle3.attend(config, take(queries), keys, values, visible))
  out = [eagle3.logits(config, params, frozen["head_rows"], hidden)]
  path_shape = (rows, count, max(depth - 1, 1), config.num_kv_heads, config.head_dim)
  path_keys = path_values = jnp.zeros(path_shape, jnp.float32)
  for level in range(depth - 1):
    token = jnp.take_along_axis(tokens, jnp.minimum(anchors + level + 1, length - 1), axis=1)
    hidden, path_keys, path_values = eagle3.step(
        config, params, hidden, layers.embed(frozen["embed_rows"], token), anchors + level, keys,
        values, visible, path_keys, path_values, level)
    out.append(eagle3.logits(config, params, frozen["head_rows"], hidden))
  ahead = anchors[:, :, None] + jnp.arange(1, depth + 1)                        # [N, M, depth]
  labelled = (ahead < batch["lengths"][:, None, None]) & batch["valid"][:, :, None]
  labels = jnp.take_along_axis(tokens, jnp.minimum(ahead, length - 1).reshape(rows, -1),
                               axis=1).reshape(ahead.shape)
  columns = jnp.where(labelled, frozen["index_map"][labels], -1)
  return jnp.stack(out, axis=2), columns, labelled


def _drafter(spec: Eagle3Spec) -> train_dflash.Anchored:
  return train_dflash.Anchored(
      eagle3.KIND, "EAGLE-3", lambda target_config, _: eagle3.Eagle3Config.for_target(target_config),
      eagle3.init_params, functools.partial(unroll_terms, depth=spec.depth), eagle3.save)


def train(output_dir: str = "out/smollm2_eagle3", target=None, eagle3_spec: Eagle3Spec = Eagle3Spec(),
          teacher: TeacherSpec = TeacherSpec(), training: TrainSpec = TrainSpec(), seed: int = 0,
          stop_after_step: int | None = None) -> dict:
  """Train an EAGLE-3 drafter for `target` (specs.ModelSpec) into output_dir (its weights in
  output_dir/eagle3); returns the summary. Finished runs are reused, interrupted ones resume."""
  return train_heads.run_on_teacher_data(
      output_dir, target, (eagle3.KIND, eagle3_spec), teacher, training, seed,
      "an EAGLE-3 drafter", functools.partial(train_on_sequences, eagle3_spec=eagle3_spec,
                                              training=training, seed=seed,
                                              stop_after_step=stop_after_step))


def train_on_sequences(output_dir, loss_log, target_config, target_params, train_seqs, val_seqs,
                       eagle3_spec: Eagle3Spec, training: TrainSpec, seed: int,
                       stop_after_step: int | None = None, metadata: dict | None = None,
                       teacher_seconds: float = 0.0) -> dict:
  """Stages 2-4 (training/dflash.py) for a target already in memory."""
  return train_dflash.train_on_sequences(
      output_dir, loss_log, target_config, target_params, train_seqs, val_seqs, eagle3_spec,
      training, seed, stop_after_step, metadata, teacher_seconds, drafter=_drafter(eagle3_spec))
