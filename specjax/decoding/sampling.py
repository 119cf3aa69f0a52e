"""Logits -> the probabilities a token is drawn from, and drawing from them.

One transform, `probs_from_logits`, serves the autoregressive sampler, the draft and the target's
verification. The speculative accept rule is lossless only if the draft's probabilities are the very
distribution its token was drawn from and the target's probabilities went through the same transform as
the plain sampler (a bug seen in other implementations), so every path calls this one function.

Conventions:
  * temperature == 0 means greedy: the distribution is one-hot on the argmax (ties go to the lowest id,
    as `jnp.argmax`), so sampling from it and taking argmax agree.
  * top_k == 0 disables top-k; it is static (it fixes a shape in `lax.top_k`).
  * top_p == 1 disables nucleus filtering; top_p keeps the smallest set of most likely tokens whose mass
    reaches top_p (the token that crosses the threshold is kept).
  * temperature and top_p may be traced arrays (scalars, or one value per row of shape [B]), so a sweep
    over them compiles once.
"""

from __future__ import annotations

import hashlib
import math

import jax
import jax.numpy as jnp


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """Host-side range checks (traced values cannot raise inside jit); each error names the fix."""
  if not 0.0 <= temperature < math.inf:  # also rejects NaN and infinity
    raise ValueError(f"temperature must be >= 0 and finite (0 means greedy), got {temperature}")
  if int(top_k) != top_k or top_k < 0:
    raise ValueError(f"top_k must be a whole number >= 0 (0 disables top-k), got {top_k}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must lie in (0, 1] (1 disables nucleus sampling), got {top_p}")


# A float32 argmax over at least this many entries runs on the CPU kernels' argmax where it can.
_CPU_ARGMAX_WIDTH = 4096


def _cpu_argmax(scores: jax.Array) -> bool:
  """Whether `argmax` may run on the CPU kernels (cpu_kernels.argmax): float32 rows of a large
  vocabulary, one device, the library built. It is exact, so either path gives the same ids;
  lowered for a platform other than the CPU (a GPU, a plan's TPU compile) the XLA form is taken
  (`argmax`'s lax.platform_dependent)."""
  from specjax.models import cpu_kernels  # pylint: disable=import-outside-toplevel
  return (scores.dtype == jnp.float32 and scores.ndim >= 1 and scores.shape[-1] >= _CPU_ARGMAX_WIDTH
          and jax.device_count() == 1 and cpu_kernels.available())


def argmax(scores: jax.Array) -> jax.Array:
  """jnp.argmax(scores, axis=-1) as int32 (ties and NaN alike: the first maximum, or the first NaN),
  as two vectorised passes: the row's max, then the first index that holds it. XLA:CPU runs
  jnp.argmax's paired (value, index) reduction one element at a time: 1.5 ms over 17 rows of
  SmolLM2's 49,152 logits against 0.7 ms this way (2-core Xeon, 2026-12). On one CPU device with
  specjax's CPU kernels built, a large vocabulary's float32 rows go to their argmax (_cpu_argmax):
  one pass for the maximum, then a scan up to its first hit."""
  def vectorised(scores):
    peak = jnp.max(scores, axis=-1, keepdims=True)
    hit = (scores == peak) | jnp.isnan(scores)
    ids = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, ids, scores.shape[-1]), axis=-1)
  if _cpu_argmax(scores):
    from specjax.models import cpu_kernels  # pylint: disable=import-outside-toplevel
    return jax.lax.platform_dependent(scores, cpu=cpu_kernels.argmax, default=vectorised)
  return vectorised(scores)


def probs_from_logits(logits: jax.Array, temperature=0.0, top_k: int = 0, top_p=1.0) -> jax.Array:
  """logits[..., V] float -> probabilities[..., V] float32 after temperature, top-k and top-p.

  Each row sums to 1. Filtered-out tokens get exactly probability 0.
  """
  logits = logits.astype(jnp.float32)
  temperature = jnp.asarray(temperature, jnp.float32)
  top_p = jnp.asarray(top_p, jnp.float32)
  vocab = logits.shape[-1]
  greedy = lambda logits: jax.nn.one_hot(argmax(logits), vocab, dtype=jnp.float32)

  def sampled(logits):
    # The tiny floor keeps the division finite when temperature is 0; that branch is discarded below.
    scaled = logits / jnp.maximum(temperature, 1e-6)[..., None]
    if top_k and top_k < vocab:
      kth_largest = jax.lax.top_k(scaled, top_k)[0][..., -1:]
      scaled = jnp.where(scaled >= kth_largest, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    # Sorting the vocabulary dominates a small model's sampling step, so skip it at runtime when no
    # row asks for nucleus filtering (lax.cond runs one branch; the values stay traced).
    probs = jax.lax.cond(jnp.any(top_p < 1.0), _nucleus, lambda p, _: p, probs, top_p[..., None])
    # Only rows at temperature 0 among sampled ones need the one-hot (two more passes over V).
    mixed = lambda probs: jnp.where(temperature[..., None] > 0, probs, greedy(logits))
    return jax.lax.cond(jnp.all(temperature > 0), lambda probs: probs, mixed, probs)

  # Greedy decoding needs no softmax: skip it at runtime when every row is at temperature 0 (a tree
  # verification transforms T x V logits per iteration).
  return jax.lax.cond(jnp.all(temperature == 0), greedy, sampled, logits)


def _nucleus(probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """Keep the smallest most-likely set whose mass reaches top_p, renormalised."""
  sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  # A token is kept when the mass of the strictly more likely tokens is still below top_p.
  kept_count = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
  threshold = jnp.take_along_axis(sorted_probs, kept_count - 1, axis=-1)
  filtered = jnp.where(probs >= threshold, probs, 0.0)
  filtered = jnp.where(top_p >= 1.0, probs, filtered)
  return filtered / jnp.sum(filtered, axis=-1, keepdims=True)


# Tokens per block of the two-level inverse CDF: a scan over the whole vocabulary is the slow part of
# a draw on XLA:CPU (jnp.cumsum over SmolLM2's 49,152 probabilities: 0.39 ms, 2-core Xeon).
SAMPLE_BLOCK = 256


def sample_with_uniform(uniform: jax.Array, probs: jax.Array) -> jax.Array:
  """Inverse-CDF draw: uniform[...] in [0, 1), probs[..., V] -> token ids[...] int32.

  Taking the uniform explicitly lets a numpy reference replay the exact same draws. Two levels, so no
  scan runs over the whole vocabulary: the block of SAMPLE_BLOCK tokens whose cumulative mass first
  passes u * total, then the token inside it. A token with probability 0 is never returned, even when
  rounding makes u * total reach the last cumulative sum (each level falls back to its last entry
  with mass).
  """
  vocab = probs.shape[-1]
  batch_shape = probs.shape[:-1]
  uniform = jnp.broadcast_to(uniform, batch_shape)
  block = min(SAMPLE_BLOCK, vocab)
  num_blocks = -(-vocab // block)
  padding = [(0, 0)] * len(batch_shape) + [(0, num_blocks * block - vocab)]
  blocks = jnp.pad(probs, padding).reshape(*batch_shape, num_blocks, block)
  block_mass = jnp.sum(blocks, axis=-1)
  block_cumulative = jnp.cumsum(block_mass, axis=-1)
  target = uniform * block_cumulative[..., -1]
  # A block without mass never holds the first cumulative sum above the target (its sum equals the
  # previous one), so only the rounding fallback needs the last block with mass.
  chosen = jnp.minimum(jnp.sum(block_cumulative <= target[..., None], axis=-1),
                       _last_positive(block_mass))
  before = jnp.take_along_axis(block_cumulative, jnp.maximum(chosen - 1, 0)[..., None], axis=-1)
  before = jnp.where(chosen > 0, before[..., 0], 0.0)
  inside = jnp.take_along_axis(blocks, chosen[..., None, None], axis=-2)[..., 0, :]
  index = jnp.sum(jnp.cumsum(inside, axis=-1) <= (target - before)[..., None], axis=-1)
  index = jnp.minimum(index, _last_positive(inside))
  return (chosen * block + index).astype(jnp.int32)


def _last_positive(values: jax.Array) -> jax.Array:
  """The index of the last entry > 0 along the last axis (0 if there is none)."""
  return values.shape[-1] - 1 - jnp.argmax(values[..., ::-1] > 0, axis=-1)


def sample(rng: jax.Array, probs: jax.Array) -> jax.Array:
  """Draw one token per row: probs[..., V] -> ids[...] int32. rng: one key, or one key per row of
  probs[B, V] (`per_row`)."""
  if per_row(rng):
    return sample_with_uniform(uniforms(rng, probs.shape[0], ()), probs)
  return sample_with_uniform(jax.random.uniform(rng, probs.shape[:-1]), probs)


# ---- random keys: one per decode, or one per row (a prompt's own) ------------------------------------

def prompt_key(rng: jax.Array, prompt_id: str) -> jax.Array:
  """A prompt's own key: `rng` (the run's seed) folded with a stable 31-bit hash of the prompt's id,
  so what a prompt draws depends on (seed, prompt id) alone, not on its batch or what ran before."""
  digest = hashlib.sha256(str(prompt_id).encode("utf-8", "surrogatepass")).digest()
  return jax.random.fold_in(rng, int.from_bytes(digest[:4], "big") >> 1)


def per_row(rng: jax.Array) -> bool:
  """Whether `rng` holds one key per row ([B, 2] raw keys, or [B] typed keys) rather than one key."""
  typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
  return jnp.ndim(rng) == (1 if typed else 2)


def fold_in(rng: jax.Array, data) -> jax.Array:
  """jax.random.fold_in of one key, or of every row's key."""
  if per_row(rng):
    return jax.vmap(lambda key: jax.random.fold_in(key, data))(rng)
  return jax.random.fold_in(rng, data)


def split(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
  """jax.random.split into two, of one key or of every row's key."""
  if per_row(rng):
    pairs = jax.vmap(jax.random.split)(rng)
    return pairs[:, 0], pairs[:, 1]
  first, second = jax.random.split(rng)
  return first, second


def uniforms(rng: jax.Array, batch: int, shape: tuple = ()) -> jax.Array:
  """[batch, *shape] uniforms in [0, 1): from one key as one block, or row b's from row b's key."""
  if per_row(rng):
    return jax.vmap(lambda key: jax.random.uniform(key, shape))(rng)
  return jax.random.uniform(rng, (batch, *shape))


def top_ids(scores: jax.Array, width: int) -> jax.Array:
  """scores[B, V] -> the ids of the `width` largest [B, width], best first (ties: lowest id). Repeated
  argmax: on XLA:CPU lax.top_k with k > 1 sorts the whole row, ~5 ms over SmolLM2's 49,152 tokens,
  while `width` argmax passes cost a fraction of a millisecond."""
  rows = jnp.arange(scores.shape[0])
  ids = []
  for _ in range(width):
    best = argmax(scores)
    ids.append(best)
    scores = scores.at[rows, best].set(-jnp.inf)
  return jnp.stack(ids, axis=1)
