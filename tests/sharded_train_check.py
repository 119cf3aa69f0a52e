"""Run in a subprocess with 8 host devices: `specjax.training.seq2seq` on a 2x4 ('data', 'model') mesh (batch rows
over 'data', parameters and optimizer state over 'model') reaches the parameters of the same run on
one device, and its checkpoints resume sharded."""

import os
import sys
import tempfile

# Appended: the suite's compile flags (tests/conftest.py) reach this process too.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from specjax import checkpoints  # noqa: E402
from specjax.training import trainer  # noqa: E402
from specjax.data import tasks  # noqa: E402
from specjax.training import seq2seq  # noqa: E402
from specjax import vocabulary as vocabularies  # noqa: E402

SHAPE = seq2seq.T5Shape(embed_dim=32, num_encoder_layers=1, num_decoder_layers=1, num_heads=4,
                      head_dim=8, mlp_dim=64)
SPEC = trainer.TrainSpec(steps=12, tokens_per_batch=512, learning_rate=1e-2, warmup_steps=2,
                          checkpoint_every=6, bucket=16)


def main():
  assert jax.device_count() == 8, jax.devices()
  out = tempfile.mkdtemp()
  vocab = f"{out}/spiece.model"
  vocabularies.train(tasks.texts_for_vocabulary("gettext_ende"), vocab, 400)
  task = seq2seq.TaskSpec(task="gettext_ende", vocabulary=vocab, max_input_length=32,
                        max_target_length=32)
  run = lambda name, mesh, **kw: seq2seq.train(output_dir=f"{out}/{name}", task=task, model=SHAPE,
                                             training=SPEC, mesh_shape=mesh, **kw)
  single = run("single", (1, 1))
  assert run("sharded", (2, 4), stop_after_step=6) == {"stopped_after_step": 6}
  sharded = run("sharded", (2, 4))  # resumes from the sharded checkpoint at step 6
  _, a = checkpoints.load(f"{out}/single/hf")
  _, b = checkpoints.load(f"{out}/sharded/hf")
  # The same arithmetic, split differently: float32 reductions reorder, nothing else differs.
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, atol=2e-4, rtol=2e-3), a, b)
  print("losses", single["validation_after"]["loss"], sharded["validation_after"]["loss"])
  assert abs(single["validation_after"]["loss"] - sharded["validation_after"]["loss"]) < 1e-3


if __name__ == "__main__":
  sys.exit(main())
