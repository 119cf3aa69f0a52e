"""Run in a subprocess with 8 host devices: token-tree decoding with the target and a smaller model
draft (a tree of its top-k) on ONE ('data', 'model') mesh emits exactly the unsharded tokens and
accepted counts, greedy and sampled (fixed rng), for a decoder-only target and for a T5 target."""

import os

# Appended: the suite's compile flags (tests/conftest.py) reach this process too.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from conftest import ragged_source, random_decoder_params, random_t5_params  # noqa: E402
from specjax import contracts, models, sharding  # noqa: E402
from specjax.decoding import core  # noqa: E402
from specjax.decoding.tree import Tree  # noqa: E402
from specjax.drafters import expansion  # noqa: E402
from specjax.drafters.model import ModelDrafter  # noqa: E402
from specjax.models import decoder_only, t5  # noqa: E402

SETTINGS = [("greedy", 0.0), ("sampled", 0.8)]
TREE = Tree.from_name("spine:3x2")
CONFIG = core.DecodeConfig(max_new_tokens=12)
FAMILIES = {
    "decoder-only": (decoder_only, decoder_only.SIZES["tiny"],
                     decoder_only.DecoderConfig(vocab_size=decoder_only.SIZES["tiny"].vocab_size,
                                                embed_dim=32, num_layers=1, num_heads=4,
                                                num_kv_heads=2, head_dim=8, mlp_dim=64),
                     random_decoder_params),
    "t5": (t5, t5.SIZES["tiny"],
           t5.T5Config(vocab_size=128, embed_dim=16, num_encoder_layers=1, num_decoder_layers=1,
                       num_heads=2, head_dim=8, mlp_dim=32), random_t5_params),
}


def inputs(family, target):
  """(prompt tokens, lengths, source) for a ragged batch of 4."""
  if family == "t5":
    return (*t5.decoder_prompt(target, 4),
            contracts.Source(*ragged_source(target, (20, 9, 14, 5), seed=0)))
  prompts = np.random.RandomState(0).randint(0, target.vocab_size, (4, 6)).astype(np.int32)
  return prompts, np.array([6, 3, 5, 2], np.int32), None


def main():
  assert jax.device_count() == 8, jax.devices()
  rng = jax.random.PRNGKey(1)
  for family, (module, target, draft, random_params) in FAMILIES.items():
    target_params, draft_params = random_params(target, seed=11), random_params(draft, seed=12)
    tokens, lengths, source = inputs(family, target)
    decode = lambda fn, tp, dp, temperature: fn(tp, dp, tokens, lengths, rng, temperature,
                                                source=source)
    plain_fn = core.make_decode(
        module.model(target), expansion.TopK(ModelDrafter(module.model(draft)), TREE), CONFIG)
    plain = {name: decode(plain_fn, target_params, draft_params, temperature)
             for name, temperature in SETTINGS}
    n = np.asarray(plain["sampled"].stats.num_accepted)
    assert 0 < n[n >= 0].mean() < TREE.depth, "want both accepts and rejects when sampled"
    for data, model in [(2, 4), (1, 8)]:
      mesh = sharding.make_mesh(data, model)
      target_shardings = models.param_shardings(target, mesh)
      placed_target = sharding.place(target_params, target_shardings)
      placed_draft = sharding.place(draft_params, models.param_shardings(draft, mesh))
      for placed in (placed_target, placed_draft):  # both models really spread over the one mesh
        leaves = jax.tree_util.tree_leaves(placed)
        assert max(len(leaf.sharding.device_set) for leaf in leaves) == 8
        assert all(leaf.sharding.mesh == mesh for leaf in leaves)
      fn = core.make_decode(
          module.model(target, mesh),
          expansion.TopK(ModelDrafter(module.model(draft, mesh)), TREE), CONFIG)
      for name, temperature in SETTINGS:
        out = decode(fn, placed_target, placed_draft, temperature)
        np.testing.assert_array_equal(out.tokens, plain[name].tokens,
                                      err_msg=f"{family} {data}x{model} {name}")
        np.testing.assert_array_equal(out.stats.num_accepted, plain[name].stats.num_accepted)
        print(f"{family} sharded {data}x{model} {name}: same tokens")


if __name__ == "__main__":
  main()
