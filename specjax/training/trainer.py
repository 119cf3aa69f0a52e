"""Training loops shared by the draft distillation and model training: optax AdamW (or Adafactor,
TrainSpec.optimizer) with warmup + cosine decay and global-norm clipping, batches in a seeded order
fixed by the step number, orbax checkpoints with exact resume, tqdm progress with ETA.

`fit` trains any trainer: an object with `spec` (TrainSpec), `optimizer` (optax) and a jitted
`train_step(params, opt_state, batch) -> (params, opt_state, loss)`. Because the batch a step trains
on is a pure function of (seed, step), a run interrupted after its last checkpoint resumes to the
very parameters an uninterrupted run reaches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from tqdm import tqdm


OPTIMIZERS = (None, "adafactor")


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
  # None: AdamW. "adafactor": T5's optimizer, whose step is relative to each parameter's scale
  # (learning_rate about 1e-2; weight_decay unused). None rather than "adamw", so that the runs'
  # fingerprints from before this setting existed still match.
  optimizer: str | None = None

  def __post_init__(self):
    if self.steps < 1 or self.tokens_per_batch < 1 or self.checkpoint_every < 1:
      raise ValueError("steps, tokens_per_batch and checkpoint_every must be >= 1")
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f"TrainSpec.optimizer = {self.optimizer!r}; choose one of {OPTIMIZERS} "
                       "(None is AdamW)")
    if not 0.0 < self.validation_fraction < 1.0:
      raise ValueError(f"validation_fraction must lie in (0, 1), got {self.validation_fraction}")


def make_optimizer(spec: TrainSpec):
  schedule = optax.warmup_cosine_decay_schedule(0.0, spec.learning_rate, spec.warmup_steps,
                                                max(spec.steps, spec.warmup_steps + 1),
                                                end_value=spec.learning_rate * 0.1)
  # Decay matrices only; the embedding's unseen rows keep their (projected) start.
  decay = lambda params: {name: jax.tree_util.tree_map(lambda x: x.ndim == 2 and name != "embedding",
                                                       leaf) for name, leaf in params.items()}
  if spec.optimizer == "adafactor":
    # As T5X configures it: factored second moments, no momentum, updates clipped to RMS 1 and
    # scaled by each parameter's RMS, so the embedding (std 1) moves as fast as the kernels.
    update = optax.adafactor(schedule, multiply_by_parameter_scale=True, clipping_threshold=1.0,
                             decay_rate=0.8, momentum=None)
  else:
    update = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=spec.weight_decay, mask=decay)
  return optax.chain(optax.clip_by_global_norm(spec.clip_norm), update)


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
  return ocp.CheckpointManager(
      pathlib.Path(directory).absolute(),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=spec.checkpoint_every,
                                           enable_async_checkpointing=False))


def _restore_latest_intact(checkpoint_dir: pathlib.Path, spec: TrainSpec, state):
  """(manager, step, state) from the newest checkpoint that restores. A checkpoint that does not (a
  disk error, a kill mid-write that orbax did not catch) is moved to `<checkpoint_dir>.corrupt/`
  with a warning naming it, and the one before it is tried; none intact starts from step 0.
  Directories left by a kill during a save (`*.orbax-checkpoint-tmp-*`) are removed first."""
  for stale in sorted(checkpoint_dir.glob("*.orbax-checkpoint-tmp-*")):
    logging.warning("removing %s, an unfinished save left by a killed run", stale)
    shutil.rmtree(stale)
  while True:
    manager = _checkpoint_manager(checkpoint_dir, spec)
    step = manager.latest_step()
    if step is None:
      return manager, 0, state
    try:
      restored = manager.restore(step, args=ocp.args.StandardRestore(
          jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)))
      return manager, step, restored
    except Exception as error:  # pylint: disable=broad-except  # orbax raises many kinds
      aside = checkpoint_dir.parent / f"{checkpoint_dir.name}.corrupt" / str(step)
      aside.parent.mkdir(parents=True, exist_ok=True)
      manager.close()
      shutil.move(str(checkpoint_dir / str(step)), str(aside))
      logging.warning("the checkpoint at step %d (%s) does not restore (%s: %s); moved it to %s and "
                      "falling back to the one before it", step, checkpoint_dir / str(step),
                      type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "",
                      aside)


def _on_params_mesh(state, params):
  """The optimizer's scalars (step counts) replicated on the mesh the parameters are sharded over:
  optax creates them on the default device, and one jitted step cannot mix the two."""
  meshes = {leaf.sharding.mesh for leaf in jax.tree_util.tree_leaves(params)
            if isinstance(leaf.sharding, jax.sharding.NamedSharding)}
  if len(meshes) != 1:
    return state
  replicated = jax.sharding.NamedSharding(meshes.pop(), jax.sharding.PartitionSpec())
  return jax.tree_util.tree_map(
      lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding) else
      jax.device_put(x, replicated), state)


def fit(trainer, params, train_batches, seed: int, checkpoint_dir, *,
        stop_after_step: int | None = None, desc: str = "train", on_loss=None, validate=None):
  """Train trainer.spec.steps steps from the newest intact checkpoint in checkpoint_dir (or from
  `params`, the trainable tree).

  train_batches: the list of batch dicts, or a function of the step that returns its batch (drawn
  from the step alone, so a resumed run trains on what an uninterrupted one would).
  stop_after_step: return after that step as an interruption would (the checkpoint written there
  lets a rerun resume). on_loss(step, loss, **validation):
  called every 10 steps, at every checkpoint and at the end (a run's loss log); validate(params) ->
  dict, if given, is run at every checkpoint and at the end and its results passed on as
  `validation_<name>` (the validation curve). Returns (params, losses of this run)."""
  spec = trainer.spec
  params = jax.tree_util.tree_map(jnp.asarray, params)
  state = _on_params_mesh({"params": params, "opt_state": trainer.optimizer.init(params)}, params)
  with _quiet_absl():
    manager, start, state = _restore_latest_intact(pathlib.Path(checkpoint_dir).absolute(), spec,
                                                   state)
  if start:
    logging.info("resumed from step %d (checkpoint %s)", start, pathlib.Path(checkpoint_dir) / str(start))
  else:
    logging.info("no checkpoint in %s: training from step 0", checkpoint_dir)
  end = spec.steps if stop_after_step is None else min(spec.steps, stop_after_step)
  losses = []
  params, opt_state = state["params"], state["opt_state"]
  with tqdm(total=spec.steps, initial=start, desc=desc, unit="step") as bar:
    for step in range(start, end):
      batch = (train_batches(step) if callable(train_batches) else
               train_batches[batch_order(len(train_batches), step, seed)])
      params, opt_state, loss = trainer.train_step(params, opt_state, batch)
      at_checkpoint = (step + 1) % spec.checkpoint_every == 0 or step + 1 == end
      if (step + 1) % 10 == 0 or at_checkpoint:
        losses.append((step + 1, float(loss)))
        validation = ({f"validation_{name}": value for name, value in validate(params).items()}
                      if validate is not None and at_checkpoint else {})
        bar.set_postfix(loss=f"{losses[-1][1]:.3f}", **{
            name.replace("validation_", "val_"): f"{value:.3f}" for name, value in
            validation.items() if name == "validation_loss"})
        if on_loss is not None:
          on_loss(*losses[-1], **validation)
      if at_checkpoint:
        with _quiet_absl():  # orbax logs every save at INFO, dozens of lines
          manager.save(step + 1, args=ocp.args.StandardSave({"params": params,
                                                             "opt_state": opt_state}), force=True)
      bar.update()
  with _quiet_absl():
    manager.wait_until_finished()
  return params, losses


def make_train_step(loss_fn, optimizer):
  """The jitted step `(params, opt_state, batch) -> (params, opt_state, loss)` of a loss
  `loss_fn(params, batch)`; params and optimizer state are donated (updated in place)."""

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(train_step, donate_argnums=(0, 1))


def per_position(eval_step, params, batches) -> dict:
  """Sums of `eval_step(params, batch)` (a dict with 'positions') over batches, divided by the
  positions: per-token means of a validation set, and the positions counted."""
  totals = {}
  for batch in batches:
    for name, value in eval_step(params, batch).items():
      totals[name] = totals.get(name, 0.0) + float(value)
  positions = max(totals.pop("positions"), 1.0)
  return {name: value / positions for name, value in totals.items()} | {"positions": positions}


def loss_logger(loss_log):
  """on_loss for `fit` writing {'step', 'loss'} rows once: a resumed run redoes identical steps
  whose rows the log already holds."""
  logged = {row["step"] for row in loss_log.existing}

  def log_loss(step, loss, **validation):
    if step not in logged:
      loss_log.append({"step": step, "loss": loss, **validation})
      logged.add(step)

  return log_loss


def plot_training_curve(loss_curve, validation_curve, path: pathlib.Path) -> pathlib.Path:
  """A PNG of the training objective and the validation loss, each a list of (step, loss), against
  the step (the curves a trainer's summary.json records)."""
  import matplotlib  # pylint: disable=import-outside-toplevel  # only once a model is trained
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(*zip(*loss_curve), label="training objective (every 10 steps)", color="tab:blue")
  ax.plot(*zip(*validation_curve), "o-", label="validation cross-entropy on the references",
          color="tab:orange")
  ax.set(xlabel="step", ylabel="cross-entropy per target token", title=path.parent.name)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
