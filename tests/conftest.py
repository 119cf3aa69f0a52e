"""Shared fixtures. Multi-device tests set XLA_FLAGS themselves in a subprocess."""

import os
import pathlib
import subprocess
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import decoder_only


def random_decoder_params(config, seed=0, scale=0.2):
  """Random weights large enough that greedy outputs vary from token to token (std 0.02 collapses)."""
  params = decoder_only.init_params(config, jax.random.PRNGKey(seed))
  rng = np.random.RandomState(seed)

  def scaled(leaf):
    leaf = np.asarray(leaf)
    if np.all(leaf == 1.0):  # norm scales: perturb around 1 so a bug in their use shows
      return (1.0 + 0.1 * rng.randn(*leaf.shape)).astype(np.float32)
    return (scale * rng.randn(*leaf.shape)).astype(np.float32)

  return jax.tree_util.tree_map(scaled, params)


def run_check_on_8_devices(script: str) -> str:
  """Run tests/<script> in a subprocess (it sets XLA_FLAGS for 8 host devices before importing jax,
  which is fixed per process); assert it succeeded and return its stdout."""
  here = pathlib.Path(__file__).parent
  env = dict(os.environ, PYTHONPATH=str(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, str(here / script)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


@flax.struct.dataclass
class LengthsCache:
  """The cache of a table model: nothing but each row's length."""
  lengths: jax.Array


def bigram_step(table, tokens, positions, cache):
  """A table model (DESIGN.md: speculative.py never imports models/): next-token logits =
  table[token]; the cache only tracks lengths."""
  return table[tokens], cache.replace(lengths=positions[:, -1] + 1)


def bigram_cache(batch, max_length):
  del max_length  # a table model stores nothing per position
  return LengthsCache(jnp.zeros((batch,), jnp.int32))


@pytest.fixture(scope="session")
def smollm2():
  """(config, params, tokenizer) of the embedded SmolLM2-135M-Instruct; loads in well under a second
  once the dequantized cache exists."""
  from specjax import assets, checkpoints, tokenizer  # pylint: disable=import-outside-toplevel
  path = assets.smollm2_gguf_path()
  config, params = checkpoints.load_decoder(path)
  return config, params, tokenizer.Tokenizer.from_gguf(path)
