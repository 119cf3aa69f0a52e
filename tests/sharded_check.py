"""Run in a subprocess with 8 host devices: sharded decoding must give the unsharded tokens, and a
batched decode must lay its KV cache out by the rules (rows over 'data', KV heads over 'model')."""

import os

# Appended: the suite's compile flags (tests/conftest.py) reach this process too.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from conftest import random_decoder_params  # noqa: E402
from specjax import models, sharding  # noqa: E402
from specjax.decoding import autoregressive
from specjax.models import decoder_only  # noqa: E402


def check_cache_layout():
  """On a 4x2 mesh the tiny model's batch-4 cache splits rows 4 ways and its 2 KV heads 2 ways; its
  activations (4 heads, MLP 128) split over 'model' too."""
  cfg = decoder_only.SIZES["tiny"]
  mesh = sharding.make_mesh(4, 2)
  step = decoder_only.make_step(cfg, mesh)
  cache = decoder_only.init_cache(cfg, 4, 16)
  tokens = jnp.zeros((4, 3), jnp.int32)
  params = sharding.place(random_decoder_params(cfg, seed=1), models.param_shardings(cfg, mesh))
  logits, cache = jax.jit(step)(params, tokens, jnp.broadcast_to(jnp.arange(3), (4, 3)), cache)
  # is_equivalent_to: a trailing unsharded dimension may or may not be spelled out in the spec.
  expected = NamedSharding(mesh, PartitionSpec("data", None, "model", None))
  for buffer in (*cache.keys, *cache.values):
    assert buffer.sharding.is_equivalent_to(expected, buffer.ndim), buffer.sharding
  expected = NamedSharding(mesh, PartitionSpec("data", None, "model"))
  assert logits.sharding.is_equivalent_to(expected, logits.ndim), logits.sharding
  print("cache and logits laid out by the rules")


def main():
  assert jax.device_count() == 8, jax.devices()
  check_cache_layout()
  cfg = decoder_only.SIZES["tiny"]
  params = random_decoder_params(cfg, seed=11)
  shape = autoregressive.DecodeShape(max_new_tokens=10)
  prompts = np.random.RandomState(0).randint(0, cfg.vocab_size, (4, 6)).astype(np.int32)
  lengths = np.array([6, 3, 5, 2], np.int32)
  plain = autoregressive.make_generate(decoder_only.model(cfg), shape)(
      params, prompts, lengths, jax.random.PRNGKey(1), 0.8, 1.0)
  for data, model in [(2, 4), (4, 2), (1, 8)]:
    mesh = sharding.make_mesh(data, model)
    param_shardings = models.param_shardings(cfg, mesh)
    generate = autoregressive.make_generate(
        decoder_only.model(cfg, mesh), shape,
        in_shardings=(param_shardings, sharding.batch_sharding(mesh, 4),
                      sharding.batch_sharding(mesh, 4, 1), None, None, None, None))
    placed = sharding.place(params, param_shardings)
    assert len(placed["layers_0"]["mlp"]["w_up"].sharding.device_set) == 8
    out = generate(placed, prompts, lengths, jax.random.PRNGKey(1), 0.8, 1.0, None)  # no source
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    print(f"sharded {data}x{model}: same tokens")


if __name__ == "__main__":
  main()
