"""Functional key/value cache with one length per row.

Layout: slot s of row b holds the keys and values of the token at position s of that row, so a write
goes to the token's own position and a read needs no offset arithmetic. Rows of a batch advance by
different amounts (speculative rows accept different counts; prompts have different lengths), so the
cache keeps `lengths[B]`, the number of valid slots of each row.

Invariants the step functions rely on:
  * A step writes its T tokens at `positions[B, T]` and its queries attend to slots <= their own
    position. Slots beyond a row's length are stale (rejected draft tokens, right padding of a shorter
    prompt); they are never read, because a row always writes position p before any query at p reads it.
  * Rollback is `contracts.set_lengths`: nothing is zeroed. The next step overwrites the stale slots.
  * The loops size buffers max_prompt + max_new_tokens + gamma + 1, so a verification write of
    gamma + 1 tokens never falls off the end.

Shapes: keys, values are tuples with one [B, S, kv_heads, head_dim] buffer per layer (separate buffers,
not one stacked array: XLA:CPU copied a stacked buffer's layer slices every step); lengths [B] int32.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax import axes

LOGICAL_AXES = (axes.CACHE_BATCH, axes.CACHE_LENGTH, axes.CACHE_KV_HEADS, axes.CACHE_HEAD_DIM)


@flax.struct.dataclass
class KVCache:
  keys: tuple    # per layer [B, S, kv_heads, head_dim]
  values: tuple  # per layer [B, S, kv_heads, head_dim]
  lengths: jax.Array  # [B] int32

  @property
  def max_length(self) -> int:
    return self.keys[0].shape[1]


def init(num_layers: int, batch: int, max_length: int, kv_heads: int, head_dim: int,
         dtype=jnp.float32) -> KVCache:
  """An empty cache: every row has length 0."""
  shape = (batch, max_length, kv_heads, head_dim)
  return KVCache(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                 tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                 jnp.zeros((batch,), jnp.int32))


def write(buffer: jax.Array, new: jax.Array, positions: jax.Array,
          valid: jax.Array | None = None) -> jax.Array:
  """Write new[B, T, kv, d] into one layer's buffer[B, S, kv, d] at each row's positions[B, T]
  (only where valid[B, T], when given: the others are dropped).

  A scatter, which XLA performs in place inside loops (the buffer is a loop carry).
  """
  rows = jnp.arange(new.shape[0])[:, None]
  if valid is None:
    return buffer.at[rows, positions].set(new.astype(buffer.dtype), mode="promise_in_bounds")
  slots = jnp.where(valid, positions, buffer.shape[1])  # out of range: mode="drop" skips them
  return buffer.at[rows, slots].set(new.astype(buffer.dtype), mode="drop")


def attention_mask(query_positions: jax.Array, max_length: int) -> jax.Array:
  """query_positions[B, T] -> bool[B, T, S]: a query sees the slots at or before its own position."""
  slots = jnp.arange(max_length, dtype=jnp.int32)
  return slots[None, None, :] <= query_positions[:, :, None]


def move(cache: KVCache, source_slots: jax.Array, dest_slots: jax.Array) -> KVCache:
  """Copy each row's slots source_slots[B, D] to dest_slots[B, D] in every layer (lengths unchanged).

  A verified token tree leaves its accepted path scattered over the tree's slots; this compacts it to
  consecutive slots. All reads happen before the writes, so overlapping ranges are safe.
  """
  rows = jnp.arange(source_slots.shape[0])[:, None]

  def one(buffer):
    moved = buffer[rows, source_slots]
    return buffer.at[rows, dest_slots].set(moved, mode="promise_in_bounds")

  return cache.replace(keys=tuple(map(one, cache.keys)), values=tuple(map(one, cache.values)))
