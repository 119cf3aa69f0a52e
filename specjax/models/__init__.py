"""The model families behind contracts.Model: decoder_only (Llama family) and t5 (encoder-decoder).

These functions pick the family by the config's type, so callers never branch on it.
"""

from jax.sharding import Mesh

from specjax import sharding
from specjax.models import decoder_only, t5


def _family(config):
  if isinstance(config, decoder_only.DecoderConfig):
    return decoder_only
  if isinstance(config, t5.T5Config):
    return t5
  raise TypeError(f"no model family for a config of type {type(config).__name__}")


def model_for(config, mesh: Mesh | None = None):
  """The contracts.Model of a config of either family (activations laid out on `mesh` if given)."""
  return _family(config).model(config, mesh)


def param_shardings(config, mesh: Mesh):
  """NamedShardings for a config's parameter tree under the rules table."""
  family = _family(config)
  return sharding.tree_shardings(family.param_logical_axes(config), family.param_shapes(config), mesh)
