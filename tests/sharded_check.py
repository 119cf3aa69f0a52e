"""Run in a subprocess with 8 host devices: sharded decoding must give the unsharded tokens."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from conftest import random_decoder_params  # noqa: E402
from specjax import autoregressive, sharding  # noqa: E402
from specjax.models import decoder_only  # noqa: E402


def main():
  assert jax.device_count() == 8, jax.devices()
  cfg = decoder_only.SIZES["tiny"]
  params = random_decoder_params(cfg, seed=11)
  step = decoder_only.make_step(cfg)
  init = lambda b, s: decoder_only.init_cache(cfg, b, s)
  shape = autoregressive.DecodeShape(max_new_tokens=10)
  prompts = np.random.RandomState(0).randint(0, cfg.vocab_size, (4, 6)).astype(np.int32)
  lengths = np.array([6, 3, 5, 2], np.int32)
  plain = autoregressive.make_generate(step, init, shape)(
      params, prompts, lengths, jax.random.PRNGKey(1), 0.8, 1.0)
  for data, model in [(2, 4), (4, 2), (1, 8)]:
    mesh = sharding.make_mesh(data, model)
    param_shardings = sharding.decoder_param_shardings(cfg, mesh)
    rows = sharding.batch_sharding(mesh, 4)
    generate = autoregressive.make_generate(
        step, init, shape, in_shardings=(param_shardings, rows, sharding.batch_sharding(mesh, 4, 1),
                                         None, None, None))
    placed = sharding.place(params, param_shardings)
    assert len(placed["layers_0"]["mlp"]["w_up"].sharding.device_set) == 8
    out = generate(placed, prompts, lengths, jax.random.PRNGKey(1), 0.8, 1.0)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    print(f"sharded {data}x{model}: same tokens")


if __name__ == "__main__":
  main()
