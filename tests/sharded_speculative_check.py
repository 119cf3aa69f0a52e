"""Run in a subprocess with 8 host devices: the speculative loop with target and model draft on ONE
('data', 'model') mesh must emit exactly the unsharded tokens, greedy and sampled (fixed rng)."""

import os

# Appended: the suite's compile flags (tests/conftest.py) reach this process too.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from conftest import random_decoder_params  # noqa: E402
from specjax import models, sharding  # noqa: E402
from specjax.decoding import core  # noqa: E402
from specjax.drafters import expansion  # noqa: E402
from specjax.drafters.model import ModelDrafter  # noqa: E402
from specjax.models import decoder_only  # noqa: E402

TARGET = decoder_only.SIZES["tiny"]
# Smaller, with the target's vocabulary; 4 heads / 2 KV heads / MLP 64 still split over 'model'.
DRAFT = decoder_only.DecoderConfig(vocab_size=TARGET.vocab_size, embed_dim=32, num_layers=1,
                                   num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
SETTINGS = [("greedy", 0.0), ("sampled", 0.8)]
GAMMA = 3


def main():
  assert jax.device_count() == 8, jax.devices()
  target_params = random_decoder_params(TARGET, seed=11)
  draft_params = random_decoder_params(DRAFT, seed=12)
  drafter = expansion.SampledChain(ModelDrafter(decoder_only.model(DRAFT)), GAMMA)
  shape = core.DecodeConfig(max_new_tokens=12)
  prompts = np.random.RandomState(0).randint(0, TARGET.vocab_size, (4, 6)).astype(np.int32)
  lengths = np.array([6, 3, 5, 2], np.int32)
  rng = jax.random.PRNGKey(1)

  plain_fn = core.make_decode(decoder_only.model(TARGET), drafter, shape)
  plain = {name: plain_fn(target_params, draft_params, prompts, lengths, rng, temperature)
           for name, temperature in SETTINGS}
  n = np.asarray(plain["sampled"].stats.num_accepted)
  assert 0 < n[n >= 0].mean() < GAMMA, "want both accepts and rejects in the sampled run"

  for data, model in [(2, 4), (4, 2), (1, 8)]:
    mesh = sharding.make_mesh(data, model)
    target_shardings = models.param_shardings(TARGET, mesh)
    draft_shardings = models.param_shardings(DRAFT, mesh)
    # Both models lay out their activations and caches on the mesh they share.
    fn = core.make_decode(
        decoder_only.model(TARGET, mesh),
        expansion.SampledChain(ModelDrafter(decoder_only.model(DRAFT, mesh)), GAMMA),
        shape, in_shardings=(target_shardings, draft_shardings, sharding.batch_sharding(mesh, 4),
                             sharding.batch_sharding(mesh, 4, 1), None, None, None, None, None))
    placed_target = sharding.place(target_params, target_shardings)
    placed_draft = sharding.place(draft_params, draft_shardings)
    # Both models really are spread over all 8 devices of the one mesh.
    assert len(placed_target["layers_0"]["mlp"]["w_up"].sharding.device_set) == 8
    assert len(placed_draft["layers_0"]["mlp"]["w_up"].sharding.device_set) == 8
    assert placed_draft["layers_0"]["mlp"]["w_up"].sharding.mesh == mesh
    for name, temperature in SETTINGS:
      out = fn(placed_target, placed_draft, prompts, lengths, rng, temperature)
      np.testing.assert_array_equal(out.tokens, plain[name].tokens, err_msg=f"{data}x{model} {name}")
      np.testing.assert_array_equal(out.stats.num_accepted, plain[name].stats.num_accepted)
      print(f"sharded {data}x{model} {name}: same tokens")


if __name__ == "__main__":
  main()
