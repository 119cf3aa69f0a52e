"""Sharded == unsharded on an 8-device CPU mesh (in a subprocess: the device count is fixed at import)."""

from jax.sharding import PartitionSpec

from conftest import run_check_on_8_devices
from specjax import axes, sharding


def test_sharded_decoding_equals_unsharded():
  assert run_check_on_8_devices("sharded_check.py").count("same tokens") == 3


def test_axes_that_do_not_divide_are_replicated():
  import jax  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
  assert sharding.spec_for((axes.EMBED, axes.MLP), (576, 1536), mesh) == PartitionSpec(None, "model")

  class FakeMesh:  # a 2-way model axis without needing 2 devices in this process
    shape = {"data": 1, "model": 2}
  spec = sharding.spec_for((axes.CACHE_BATCH, axes.CACHE_LENGTH, axes.CACHE_KV_HEADS, axes.HEAD_DIM),
                           (4, 64, 3, 64), FakeMesh)
  assert spec == PartitionSpec("data", None, None, None)  # 3 KV heads do not split two ways
