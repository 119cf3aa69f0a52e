"""The model families behind contracts.Model: decoder_only (Llama family) and t5 (encoder-decoder).

These functions pick the family by the config's type, so callers never branch on it.
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specjax import sharding
from specjax.models import decoder_only, t5

# Every named architecture of both families (T5's test shapes as "t5-tiny", "t5-tiny-1.0"): what a
# plan builds from shapes alone.
SIZES = {**decoder_only.SIZES,
         **{name if name.startswith("t5") else f"t5-{name}": config
            for name, config in t5.SIZES.items()}}


# The dtypes a model decodes in (specs.ModelSpec.dtype) and a plan compiles at: parameters, activations
# and KV cache. Matrix products sum in float32, norms, softmax and the logits acceptance reads are
# float32 in both (models/layers.py).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_named(name: str):
  """The jnp dtype of a DTYPES name; anything else is refused with the names."""
  if name not in DTYPES:
    raise ValueError(f"dtype {name!r} is not one a model decodes in; use one of "
                     f"{', '.join(map(repr, DTYPES))}")
  return DTYPES[name]


def cast(params, dtype):
  """The floating leaves of a params tree in `dtype` (integer leaves, e.g. token ids, keep theirs)."""
  return jax.tree_util.tree_map(
      lambda leaf: leaf.astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating)
      and leaf.dtype != dtype else leaf, params)


def config_by_name(name: str):
  if name not in SIZES:
    raise ValueError(f"unknown architecture {name!r}; known: {', '.join(sorted(SIZES))}")
  return SIZES[name]


def size_name(config) -> str | None:
  """The name of a config in SIZES, if it is one of them."""
  return next((name for name, known in SIZES.items() if known == config), None)


def _family(config):
  if isinstance(config, decoder_only.DecoderConfig):
    return decoder_only
  if isinstance(config, t5.T5Config):
    return t5
  raise TypeError(f"no model family for a config of type {type(config).__name__}")


def model_for(config, mesh: Mesh | None = None, cache_dtype=jnp.float32):
  """The contracts.Model of a config of either family (activations laid out on `mesh` if given; KV
  cache buffers in `cache_dtype`)."""
  return _family(config).model(config, mesh, cache_dtype)


def init_params(config, rng: jax.Array, dtype=jnp.float32):
  """Random parameters of a config of either family (normal, std 0.02; norm scales 1) in `dtype`,
  drawn and cast inside one compiled program: the float32 draw is then a temporary of that
  program, not a second copy of the model beside the cast one (a 7B model's takes 27 GB)."""
  return jax.jit(lambda key: cast(_family(config).init_params(config, key), dtype))(rng)


def param_shapes(config):
  """A tree of jax.ShapeDtypeStruct shaped like the params (float32; nothing is allocated)."""
  return _family(config).param_shapes(config)


def param_logical_axes(config):
  """A tree shaped like the params whose leaves are PartitionSpecs of logical axis names."""
  return _family(config).param_logical_axes(config)


def param_shardings(config, mesh: Mesh, strict: bool = False):
  """NamedShardings for a config's parameter tree under the rules table (strict: see
  sharding.tree_shardings)."""
  return sharding.tree_shardings(param_logical_axes(config), param_shapes(config), mesh, strict)
