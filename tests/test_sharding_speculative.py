"""Sharded speculative decoding == unsharded on an 8-device CPU mesh (a subprocess: the device count is
fixed when jax is imported). The check itself is tests/sharded_speculative_check.py."""

import pytest

from conftest import run_check_on_8_devices


@pytest.mark.slow  # ~30-40 s on 2 cores: four compilations of the loop over 8 host devices
def test_sharded_speculative_decoding_equals_unsharded():
  stdout = run_check_on_8_devices("sharded_speculative_check.py")
  # 3 meshes x (greedy, sampled)
  assert stdout.count("same tokens") == 6, stdout


@pytest.mark.slow  # three compilations of the tree loop per family (unsharded, 2 meshes)
def test_sharded_tree_decoding_equals_unsharded():
  """Token trees from a model draft's top-k, both families, target and draft on one mesh."""
  stdout = run_check_on_8_devices("sharded_trees_check.py")
  # 2 families x 2 meshes x (greedy, sampled)
  assert stdout.count("same tokens") == 8, stdout
