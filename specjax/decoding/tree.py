"""The shape of what a drafter proposes: a tree of candidate tokens below the root (a chain is a tree).

Node 0 is the root, the newest committed token; every other node is a candidate whose parent precedes
it. A `Tree` is static: it fixes the node count T and the depth of every compiled program. Which
nodes hang where may still change from round to round (a dynamic tree, EAGLE-2 style): a proposal
then carries its own `parents[B, T]`, and everything here takes either form:

  parents  numpy [T] (the static tree; root -1) or a traced int32 [B, T] (per row, per round)

Verification (one target call on all T nodes): node i goes into the KV cache at slot prefix + i with
its RoPE / relative position prefix + depth(i), and attends to the prefix and its own ancestors only
(`attention_inputs`), so its logits are exactly those of its path run as a chain. A chain needs none
of this: its nodes sit at consecutive slots = positions, the plain causal step.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import validation


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static candidate tree. Each non-root node is named by its ranks from the root: (0, 2) is the
  third candidate (at depth 2) below the first candidate (at depth 1). Every prefix of a path is a node.
  Nodes are numbered root first, then by depth, then by path, so a parent precedes its children.

  top_k > 0 marks a dynamic tree (`Tree.dynamic`): its paths only fix the node count and the depth,
  and the drafter sends each round's parents with its proposal."""
  paths: tuple[tuple[int, ...], ...]
  top_k: int = 0

  def __post_init__(self):
    paths = tuple(sorted({tuple(int(r) for r in p) for p in self.paths}, key=lambda p: (len(p), p)))
    if len(paths) != len(self.paths):
      raise ValueError("tree paths must be distinct")
    if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
      raise ValueError("a tree needs at least one node; each path is a non-empty tuple of ranks >= 0")
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in set(paths)]
    if missing:
      raise ValueError(f"tree path {missing[0]} has no parent node {missing[0][:-1]}; add it")
    object.__setattr__(self, "paths", paths)

  @classmethod
  def chain(cls, gamma: int) -> "Tree":
    """gamma candidates in a row: the chain as a tree."""
    gamma = validation.whole_number(gamma, "gamma (draft tokens per iteration)", 1, MAX_NODES,
                                    fix=f"one verification scores at most {MAX_NODES} nodes")
    return cls.spine(gamma, 1)

  @classmethod
  def spine(cls, depth: int, width: int) -> "Tree":
    """The top-1 chain of `depth` nodes, with width - 1 alternative siblings at every depth."""
    _check_positive(depth=depth, width=width)
    _check_size(depth * width, f"spine:{depth}x{width}")
    return cls(tuple((0,) * d + (r,) for d in range(depth) for r in range(width)))

  @classmethod
  def full(cls, widths: Sequence[int]) -> "Tree":
    """Every node at depth d has widths[d] children (a Cartesian product of candidate ranks)."""
    _check_positive(**{f"width_{d}": w for d, w in enumerate(widths)})
    _check_size(sum(np.prod(widths[:d + 1], dtype=object) for d in range(len(widths))),
                "full:" + ",".join(map(str, widths)))
    return cls(tuple(p for d in range(1, len(widths) + 1)
                     for p in itertools.product(*[range(w) for w in widths[:d]])))

  @classmethod
  def dynamic(cls, nodes: int, depth: int, top_k: int) -> "Tree":
    """A budget of `nodes` candidates reaching at most `depth`, grown afresh every round by a
    drafter that expands the `top_k` most probable nodes of each depth (EAGLE-2 / EAGLE-3): at most
    top_k + (depth - 1) top_k^2 nodes exist to pick from. Its static paths (the chain of `depth`,
    the rest as siblings at depth 1) only size the programs; the drafter sends the parents."""
    _check_positive(nodes=nodes, depth=depth, top_k=top_k)
    _check_size(nodes, f"dynamic:{nodes},{depth},{top_k}")
    grown = top_k + (depth - 1) * top_k * top_k
    if not depth <= nodes <= grown:
      raise ValueError(f"a dynamic tree of depth {depth} expanding the top {top_k} holds {depth} to "
                       f"{grown} candidates, not {nodes}; change nodes, depth or top_k")
    return cls(tuple((0,) * d for d in range(1, depth + 1)) +
               tuple((r,) for r in range(1, nodes - depth + 1)), top_k)

  @classmethod
  def from_name(cls, name: str) -> "Tree":
    """'chain:4', 'spine:4x3' (depth x width), 'full:3,2,1' (widths per depth) or 'dynamic:16,5,4'
    (nodes, depth, top-k: `Tree.dynamic`)."""
    kind, _, shape = name.partition(":")
    try:
      if kind == "dynamic":
        nodes, depth, top_k = (int(v) for v in shape.split(","))
        return cls.dynamic(nodes, depth, top_k)
      if kind == "chain":
        return cls.chain(int(shape))
      if kind == "spine":
        depth, width = re.fullmatch(r"(\d+)x(\d+)", shape).groups()
        return cls.spine(int(depth), int(width))
      if kind == "full":
        return cls.full([int(w) for w in shape.split(",")])
    except (AttributeError, ValueError) as error:
      raise ValueError(f"cannot read tree {name!r}: {error}; write chain:D, spine:DxW, "
                       "full:W1,W2,... or dynamic:N,D,K") from None
    raise ValueError(f"unknown tree kind {kind!r} in {name!r}; write chain:D, spine:DxW, "
                     "full:W1,W2,... or dynamic:N,D,K")

  @functools.cached_property
  def name(self) -> str:
    if self.top_k:
      return f"dynamic:{self.size - 1},{self.depth},{self.top_k}"
    if self == Tree.spine(self.depth, self.width):
      return f"chain:{self.depth}" if self.width == 1 else f"spine:{self.depth}x{self.width}"
    widths = [max(p[-1] for p in self.paths if len(p) == d) + 1 for d in range(1, self.depth + 1)]
    if self == Tree.full(widths):
      return "full:" + ",".join(map(str, widths))
    return f"tree:{self.size}"

  @property
  def size(self) -> int:
    """T: nodes scored per target call, the root included."""
    return len(self.paths) + 1

  @functools.cached_property
  def depth(self) -> int:
    return max(len(p) for p in self.paths)

  @functools.cached_property
  def width(self) -> int:
    """Candidates per depth a drafter must rank (max rank + 1)."""
    return max(max(p) for p in self.paths) + 1

  @property
  def is_chain(self) -> bool:
    return self.width == 1 and not self.top_k

  @functools.cached_property
  def parents(self) -> np.ndarray:
    index = {p: i + 1 for i, p in enumerate(self.paths)}
    return np.asarray([-1] + [index.get(p[:-1], 0) for p in self.paths], np.int32)

  @functools.cached_property
  def depths(self) -> np.ndarray:
    return np.asarray([0] + [len(p) for p in self.paths], np.int32)

  @functools.cached_property
  def ranks(self) -> np.ndarray:
    return np.asarray([0] + [p[-1] for p in self.paths], np.int32)


# The most candidate nodes one verification scores: a tree's paths are built on the host and every
# node is a column of the target's call, so a larger one (gamma = 1e9) would exhaust memory long
# before it could be useful. Far above any tree the papers or the configs use (tens of nodes).
MAX_NODES = 1024


def _check_positive(**values) -> None:
  for name, value in values.items():
    validation.whole_number(value, f"tree {name}")


def _check_size(size, name: str) -> None:
  if size > MAX_NODES:
    raise ValueError(f"the tree {name} has {size} candidate nodes, more than the {MAX_NODES} one "
                     "verification scores; use a smaller gamma, depth or width")


# ----------------------------------------------------------------------------------------------------
# Structure from parents: numpy for a static tree (folded into the program), jnp for a dynamic one.


def ancestors(parents) -> np.ndarray | jax.Array:
  """parents [T] or [B, T] -> bool [..., T, T]: [i, j] when node j is node i or one of its ancestors
  (parents precede their children, so one pass in node order suffices)."""
  if isinstance(parents, np.ndarray):
    out = np.eye(len(parents), dtype=bool)
    for i in range(1, len(parents)):
      out[i] |= out[parents[i]]
    return out
  size = parents.shape[-1]
  out = jnp.broadcast_to(jnp.eye(size, dtype=bool), parents.shape + (size,))
  rows = jnp.arange(parents.shape[0])
  for i in range(1, size):
    out = out.at[:, i].set(out[:, i] | out[rows, parents[:, i]])
  return out


def depths(parents) -> np.ndarray | jax.Array:
  """parents [T] or [B, T] -> depth of every node [..., T] (the root 0)."""
  return ancestors(parents).sum(-1) - 1


def children(parents) -> np.ndarray | jax.Array:
  """parents [T] or [B, T] -> bool [..., T, T]: [i, j] when node j's parent is node i."""
  size = parents.shape[-1]
  if isinstance(parents, np.ndarray):
    out = np.zeros((size, size), bool)
    out[parents[1:], np.arange(1, size)] = True
    return out
  return jnp.swapaxes(jax.nn.one_hot(parents, size, dtype=bool), -1, -2).at[..., 0].set(False)


def attention_inputs(parents, position: jax.Array, max_length: int):
  """parents [T] or [B, T], position[B] (the root's position = the cache length) -> positions,
  slots [B, T] and visible [B, T, S]: node i at position + depth(i) in slot position + i, seeing
  the slots before the root's and its own ancestors' slots."""
  size = parents.shape[-1]
  node_depths, node_ancestors = depths(parents), ancestors(parents)
  batch = position.shape[0]
  positions = position[:, None] + jnp.broadcast_to(jnp.asarray(node_depths), (batch, size))
  slots = position[:, None] + jnp.arange(size, dtype=jnp.int32)
  offset = jnp.arange(max_length, dtype=jnp.int32)[None, :] - position[:, None]  # [B, S]
  in_tree = (offset >= 0) & (offset < size)
  node_ancestors = jnp.broadcast_to(jnp.asarray(node_ancestors), (batch, size, size))
  ancestor = jnp.take_along_axis(node_ancestors, jnp.clip(offset, 0, size - 1)[:, None, :], axis=2)
  visible = (offset < 0)[:, None, :] | (in_tree[:, None, :] & ancestor)
  return positions.astype(jnp.int32), slots, visible


def fill(tree: Tree, candidates: jax.Array) -> jax.Array:
  """candidates[B, depth, width] (ranked per depth, shared by every node at that depth, as top-k
  lists and Medusa heads produce them) -> the tokens of the tree's nodes after the root [B, T - 1]:
  node i gets candidates[depth(i) - 1, rank(i)]."""
  return candidates[:, tree.depths[1:] - 1, tree.ranks[1:]].astype(jnp.int32)
