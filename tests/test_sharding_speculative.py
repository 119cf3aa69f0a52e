"""Sharded speculative decoding == unsharded on an 8-device CPU mesh (a subprocess: the device count is
fixed when jax is imported). The check itself is tests/sharded_speculative_check.py."""

import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.slow  # ~30-40 s on 2 cores: four compilations of the loop over 8 host devices
def test_sharded_speculative_decoding_equals_unsharded():
  here = pathlib.Path(__file__).parent
  env = dict(os.environ, PYTHONPATH=str(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, str(here / "sharded_speculative_check.py")], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  # 3 meshes x (greedy, sampled)
  assert result.stdout.count("same tokens") == 6, result.stdout
