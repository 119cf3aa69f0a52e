"""Run in a subprocess with 8 host devices (tests/test_plan.py): a plan's per-device figures equal
what running the same config allocates, a 70B target on 2 devices with 16 GiB each is reported as not
fitting (not crashed), and the mesh / sharding errors name the problem."""

import functools
import os
import time

# Appended: the suite's compile flags (tests/conftest.py) reach this process too.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from conftest import random_decoder_params  # noqa: E402
from specjax import contracts, models, plan, sharding  # noqa: E402
from specjax.decoding import autoregressive, core  # noqa: E402
from specjax.drafters import expansion  # noqa: E402
from specjax.drafters.model import ModelDrafter  # noqa: E402
from specjax.plan import devices, workload  # noqa: E402
from specjax.models import decoder_only  # noqa: E402

TARGET = decoder_only.DecoderConfig(vocab_size=256, embed_dim=64, num_layers=2, num_heads=8,
                                    num_kv_heads=4, head_dim=16, mlp_dim=128)
DRAFT = decoder_only.DecoderConfig(vocab_size=256, embed_dim=32, num_layers=1, num_heads=4,
                                   num_kv_heads=4, head_dim=8, mlp_dim=64)
WORKLOAD = workload.Workload(target=TARGET, drafts=(("draft", DRAFT),), mesh_shape=(2, 4), batch=4,
                         prompt_length=16, max_new_tokens=8, gamma=3)


def on_device(tree, device) -> int:
  """Bytes of `tree` that really sit on `device`."""
  return sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
             for shard in leaf.addressable_shards if shard.device == device)


def check_plan_equals_allocation():
  result = plan.plan(WORKLOAD, devices.local_devices(), "float32")
  rows = {(row["model"], row["program"]): row for row in result["rows"]}
  assert set(rows) == {("target", "prefill"), ("target", "verify"), ("draft", "prefill"),
                       ("draft", "draft step"), ("target + draft", "loop")}, sorted(rows)
  assert result["replicated"] == [], result["replicated"]  # every axis divides this mesh
  mesh = sharding.make_mesh(2, 4)
  placed = {name: sharding.place(random_decoder_params(config, seed=1),
                                 models.param_shardings(config, mesh))
            for name, config in (("target", TARGET), ("draft", DRAFT))}
  prompts = np.random.RandomState(0).randint(0, 256, (4, 16)).astype(np.int32)
  lengths = np.array([16, 9, 12, 5], np.int32)
  max_length = 16 + 8 + 3 + 1
  for name, config in (("target", TARGET), ("draft", DRAFT)):
    model = models.model_for(config, mesh)
    prefill = jax.jit(lambda params, tokens, lengths, model=model: autoregressive.prefill(
        contracts.open_session(model, params), tokens, lengths, max_length)[1])
    cache = prefill(placed[name], prompts, lengths)
    for device in mesh.devices.flat:  # every device holds what the plan says: exactly
      assert on_device(placed[name], device) == rows[(name, "prefill")]["params"], name
      # The cache's lengths[B] are bookkeeping, not K/V: the plan counts the buffers.
      assert on_device((cache.keys, cache.values), device) == rows[(name, "prefill")]["cache"], name
    print(f"{name}: params {rows[(name, 'prefill')]['params']} B and KV cache "
          f"{rows[(name, 'prefill')]['cache']} B per device, as allocated")

  # The loop compiled from real, placed arrays has the plan's memory figures.
  loop = jax.jit(functools.partial(
      core.decode, models.model_for(TARGET, mesh),
      expansion.SampledChain(ModelDrafter(models.model_for(DRAFT, mesh)), 3), core.DecodeConfig(8)))
  settings = (np.float32(0.0), np.float32(1.0), np.float32(1.0))  # temperature, top_p, lenience
  tokens = sharding.place(prompts, sharding.batch_sharding(mesh, 4))
  row_lengths = sharding.place(lengths, sharding.batch_sharding(mesh, 4, 1))
  compiled = loop.lower(placed["target"], placed["draft"], tokens, row_lengths,
                        jax.random.PRNGKey(0), *settings).compile()
  memory = compiled.memory_analysis()
  planned = rows[("target + draft", "loop")]
  arguments = on_device((placed, tokens, row_lengths), mesh.devices.flat[0])
  for planned_field, compiled_field in (("arguments", "argument_size_in_bytes"),
                                        ("outputs", "output_size_in_bytes"),
                                        ("temporaries", "temp_size_in_bytes")):
    assert planned[planned_field] == getattr(memory, compiled_field), (planned, memory)
  # Arguments: the placed params and prompts, plus the rng key (8 bytes) and the three settings.
  assert 0 <= memory.argument_size_in_bytes - arguments <= 8 + 12, (memory, arguments)
  out = compiled(placed["target"], placed["draft"], tokens, row_lengths, jax.random.PRNGKey(0),
                 *settings)
  assert np.asarray(out.num_generated).min() >= 1  # the planned program runs
  print("loop: arguments and temporaries as compiled from placed arrays")


def check_seventy_b_does_not_fit():
  seventy_b = workload.Workload(target=decoder_only.SIZES["llama2-70b"], drafts=(), mesh_shape=(1, 2),
                           batch=1, prompt_length=8, max_new_tokens=8, gamma=0)
  two = devices.Devices(tuple(jax.devices()[:2]), "2 cpu devices", None, False)
  result = plan.plan(seventy_b, two, "bfloat16", memory_bytes=16 * plan.GIB,
                     programs=("decode step",))
  (row,) = result["rows"]
  assert result["fits"] is False and row["fits"] is False, result
  # Hand arithmetic: 69.0B bf16 parameters split two ways, ~64 GiB per device.
  total = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(
      models.param_shapes(decoder_only.SIZES["llama2-70b"])))
  assert abs(row["params"] - 2 * total / 2) <= 0.01 * row["params"], (row["params"], total)
  print(f"70B on 2 devices: does not fit ({row['params'] / plan.GIB:.1f} GiB of parameters per device)")


def check_errors():
  for shape in [(3, 1), (1, 3), (5, 1)]:
    try:
      sharding.make_mesh(*shape)
    except ValueError as error:
      assert "does not divide the 8 devices" in str(error), error
    else:
      raise AssertionError(f"a {shape} mesh on 8 devices was accepted")
  uneven = workload.Workload(target=decoder_only.SIZES["tiny"], drafts=(), mesh_shape=(1, 4), batch=1,
                         prompt_length=8, max_new_tokens=4, gamma=0)  # 2 KV heads over model=4
  try:
    plan.plan(uneven, devices.local_devices(), "float32", strict=True)
  except sharding.UnshardableError as error:
    assert "'model' mesh axis of size 4" in str(error) and "kv_heads" in str(error), error
  else:
    raise AssertionError("strict sharding accepted 2 KV heads over a 4-way model axis")
  lenient = plan.plan(uneven, devices.local_devices(), "float32", programs=("prefill",))
  assert "target KV cache: cache_kv_heads" in lenient["replicated"], lenient["replicated"]
  print("errors: mesh sizes, strict sharding")


if __name__ == "__main__":
  assert jax.device_count() == 8
  for check in (check_plan_equals_allocation, check_seventy_b_does_not_fit, check_errors):
    start = time.perf_counter()
    check()
    print(f"{check.__name__}: {time.perf_counter() - start:.0f} s")
