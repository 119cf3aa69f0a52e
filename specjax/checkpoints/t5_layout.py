"""The T5 parameter tree as T5X (and specjax) name it, from a config's sizes alone: its shapes, the
config a tree's shapes imply, and the check that a tree fits a config.

Used by t5x.py to read checkpoints whose config is nowhere but in their shapes; kept equal to
models.t5.param_shapes by the tests (this one needs no tracing, so sizing T5-XXL is instant).
"""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
from flax import traverse_util

from specjax.models.t5_network import SIZES, T5Config


def param_shapes(config: T5Config) -> dict:
  """The T5X / specjax T5 parameter tree for `config`, with shape tuples as leaves.

  E = embed_dim, H = num_heads, D = head_dim, F = mlp_dim, V = vocab_size:
    token_embedder/embedding [V, E]; {encoder,decoder}/relpos_bias/rel_embedding [H, buckets];
    attention query / key / value kernels [E, H*D], out [H*D, E]; mlp wi_0 / wi_1 (1.1) or wi (1.0)
    [E, F], wo [F, E]; layer norm scales [E]; decoder/logits_dense/kernel [E, V] unless tied.
  """
  e, hd, f = config.embed_dim, config.num_heads * config.head_dim, config.mlp_dim
  attention = {"query": {"kernel": (e, hd)}, "key": {"kernel": (e, hd)},
               "value": {"kernel": (e, hd)}, "out": {"kernel": (hd, e)}}
  if config.gated:
    mlp = {"wi_0": {"kernel": (e, f)}, "wi_1": {"kernel": (e, f)}, "wo": {"kernel": (f, e)}}
  else:
    mlp = {"wi": {"kernel": (e, f)}, "wo": {"kernel": (f, e)}}
  scale = {"scale": (e,)}
  relpos = {"rel_embedding": (config.num_heads, config.relative_buckets)}
  encoder = {"relpos_bias": relpos, "encoder_norm": dict(scale)}
  for i in range(config.num_encoder_layers):
    encoder[f"layers_{i}"] = {
        "pre_attention_layer_norm": dict(scale), "attention": copy.deepcopy(attention),
        "pre_mlp_layer_norm": dict(scale), "mlp": copy.deepcopy(mlp)}
  decoder = {"relpos_bias": dict(relpos), "decoder_norm": dict(scale)}
  for i in range(config.num_decoder_layers):
    decoder[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": dict(scale), "self_attention": copy.deepcopy(attention),
        "pre_cross_attention_layer_norm": dict(scale),
        "encoder_decoder_attention": copy.deepcopy(attention),
        "pre_mlp_layer_norm": dict(scale), "mlp": copy.deepcopy(mlp)}
  if not config.tie_embeddings:
    decoder["logits_dense"] = {"kernel": (e, config.vocab_size)}
  return {"token_embedder": {"embedding": (config.vocab_size, e)}, "encoder": encoder,
          "decoder": decoder}


def size_name(config: T5Config) -> str | None:
  """The name of the `SIZES` entry `config` equals (e.g. "t5.1.1-small"), or None."""
  for name, size in SIZES.items():
    if size == config:
      return name
  return None


def infer_config(params, where: str = "params") -> T5Config:
  """The T5Config whose `param_shapes` the tree `params` has (arrays or shape tuples as leaves).

  Read from the shapes: vocab and embed from token_embedder/embedding, heads and buckets from
  encoder/relpos_bias/rel_embedding, head_dim from the first query kernel, mlp_dim and gated from
  the first MLP (wi_0 present: gated), layer counts from layers_{i}, tied from logits_dense's
  absence. relative_max_distance cannot be seen in shapes: T5's 128 is kept. Every other parameter
  is then checked against the result; ValueError (naming `where`, the parameter, the expected and
  the found shape) when one is missing, misshapen or unexpected.
  """
  flat = flatten(params)
  shapes = {name: _shape(leaf) for name, leaf in flat.items()}

  def need(name, rank, what):
    if name not in shapes:
      raise ValueError(f"{where}: parameter {name} is missing (expected {what}); a T5X T5 "
                       "checkpoint has token_embedder/, encoder/ and decoder/ under target/")
    if len(shapes[name]) != rank:
      raise ValueError(f"{where}: parameter {name} has shape {shapes[name]}, expected {what}")
    return shapes[name]

  vocab, embed = need("token_embedder/embedding", 2, "[vocab, embed]")
  heads, buckets = need("encoder/relpos_bias/rel_embedding", 2, "[heads, buckets]")
  q_in, joined = need("encoder/layers_0/attention/query/kernel", 2,
                      f"[embed, heads * head_dim] = [{embed}, {heads} * head_dim]")
  if q_in != embed or joined % heads:
    raise ValueError(
        f"{where}: parameter encoder/layers_0/attention/query/kernel has shape {(q_in, joined)}, "
        f"expected ({embed}, {heads} * head_dim) (embed from token_embedder/embedding, heads from "
        "encoder/relpos_bias/rel_embedding)")
  gated = "encoder/layers_0/mlp/wi_0/kernel" in shapes
  wi = "encoder/layers_0/mlp/wi_0/kernel" if gated else "encoder/layers_0/mlp/wi/kernel"
  _, mlp_dim = need(wi, 2, f"[embed, mlp] = [{embed}, mlp] (wi_0 / wi_1 for T5 1.1, wi for 1.0)")
  config = T5Config(
      vocab_size=vocab, embed_dim=embed, num_encoder_layers=_count_layers(shapes, "encoder", where),
      num_decoder_layers=_count_layers(shapes, "decoder", where), num_heads=heads,
      head_dim=joined // heads, mlp_dim=mlp_dim, gated=gated,
      tie_embeddings="decoder/logits_dense/kernel" not in shapes, relative_buckets=buckets)
  check_shapes(params, config, where)
  return config


def check_shapes(params, config: T5Config, where: str = "params") -> None:
  """ValueError unless `params` has exactly `param_shapes(config)`: names the parameter, the
  expected and the found shape."""
  expected = flatten(param_shapes(config))
  found = {name: _shape(leaf) for name, leaf in flatten(params).items()}
  arch = _describe(config)
  for name, shape in expected.items():
    if name not in found:
      raise ValueError(f"{where}: parameter {name} is missing (expected shape {shape} for {arch})")
    if found[name] != shape:
      raise ValueError(f"{where}: parameter {name} has shape {found[name]}, expected {shape} for "
                       f"{arch}")
  extra = sorted(set(found) - set(expected))
  if extra:
    raise ValueError(f"{where}: unexpected parameter {extra[0]} with shape {found[extra[0]]} "
                     f"({len(extra)} unexpected in all): not part of {arch}")


def _shape(leaf) -> tuple:
  if isinstance(leaf, tuple):
    return leaf
  return tuple(int(d) for d in np.shape(leaf))


def _count_layers(shapes: dict, stack: str, where: str) -> int:
  found = {int(m.group(1)) for name in shapes
           if (m := re.match(rf"{stack}/layers_(\d+)/", name))}
  if not found:
    raise ValueError(f"{where}: parameter {stack}/layers_0 is missing (a T5 {stack} has layers_0, "
                     "layers_1, ...)")
  missing = sorted(set(range(max(found) + 1)) - found)
  if missing:
    raise ValueError(f"{where}: {stack}/layers_{missing[0]} is missing while {stack}/layers_"
                     f"{max(found)} exists")
  return max(found) + 1


def _describe(config: T5Config) -> str:
  version = ("T5 1.1 (gated-GELU, untied head)" if config.gated and not config.tie_embeddings
             else "T5 1.0 (ReLU, tied head)" if not config.gated and config.tie_embeddings
             else f"a T5 with gated={config.gated}, tie_embeddings={config.tie_embeddings}")
  name = size_name(config)
  fields = dataclasses.asdict(config)
  keys = ("vocab_size", "embed_dim", "num_encoder_layers", "num_decoder_layers", "num_heads",
          "head_dim", "mlp_dim", "relative_buckets")
  return (f"{version} {', '.join(f'{k}={fields[k]}' for k in keys)}"
          + (f" ({name})" if name else ""))


def flatten(tree) -> dict:
  """{"a/b/c": leaf} for a nested dict or flax FrozenDict."""
  return traverse_util.flatten_dict(tree, sep="/")
