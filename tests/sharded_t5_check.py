"""Run in a subprocess with 8 host devices: speculative T5 decoding with a T5 target and a smaller T5
draft on ONE ('data', 'model') mesh emits exactly the unsharded tokens, greedy and sampled."""

import os

# Appended: the suite's compile flags (tests/conftest.py) reach this process too.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from conftest import ragged_source, random_t5_params  # noqa: E402
from specjax import contracts, models, sharding  # noqa: E402
from specjax.decoding import core  # noqa: E402
from specjax.drafters import expansion  # noqa: E402
from specjax.drafters.model import ModelDrafter  # noqa: E402
from specjax.models import t5  # noqa: E402

TARGET = t5.SIZES["tiny"]  # 4 heads, MLP 64: split over 'model'
DRAFT = t5.T5Config(vocab_size=128, embed_dim=16, num_encoder_layers=1, num_decoder_layers=1,
                    num_heads=2, head_dim=8, mlp_dim=32)
SETTINGS = [("greedy", 0.0), ("sampled", 0.8)]
GAMMA = 3


def main():
  assert jax.device_count() == 8, jax.devices()
  target_params, draft_params = random_t5_params(TARGET, seed=11), random_t5_params(DRAFT, seed=12)
  config = core.DecodeConfig(max_new_tokens=12)
  source = contracts.Source(*ragged_source(TARGET, (20, 9, 14, 5), seed=0))
  prompt = t5.decoder_prompt(TARGET, 4)
  rng = jax.random.PRNGKey(1)
  plain_fn = core.make_decode(t5.model(TARGET),
                              expansion.SampledChain(ModelDrafter(t5.model(DRAFT)), GAMMA), config)
  plain = {name: plain_fn(target_params, draft_params, *prompt, rng, temperature, source=source)
           for name, temperature in SETTINGS}
  n = np.asarray(plain["sampled"].stats.num_accepted)
  assert 0 < n[n >= 0].mean() < GAMMA, "want both accepts and rejects in the sampled run"
  for data, model in [(2, 4), (4, 2), (1, 8)]:
    mesh = sharding.make_mesh(data, model)
    target_shardings = models.param_shardings(TARGET, mesh)
    draft_shardings = models.param_shardings(DRAFT, mesh)
    fn = core.make_decode(
        t5.model(TARGET, mesh), expansion.SampledChain(ModelDrafter(t5.model(DRAFT, mesh)), GAMMA),
        config)
    placed_target = sharding.place(target_params, target_shardings)
    placed_draft = sharding.place(draft_params, draft_shardings)
    kernel = placed_target["decoder"]["layers_0"]["mlp"]["wo"]["kernel"]
    assert len(kernel.sharding.device_set) == 8
    for name, temperature in SETTINGS:
      out = fn(placed_target, placed_draft, *prompt, rng, temperature, source=source)
      np.testing.assert_array_equal(out.tokens, plain[name].tokens, err_msg=f"{data}x{model} {name}")
      print(f"sharded {data}x{model} {name}: same tokens")


if __name__ == "__main__":
  main()
