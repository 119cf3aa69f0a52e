"""Sampler: exact transforms on hand-built logits, empirical frequencies, and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.decoding import sampling

LOGITS = jnp.log(jnp.array([0.05, 0.4, 0.1, 0.25, 0.2]))


def test_greedy_is_one_hot_on_argmax_lowest_id_on_ties():
  probs = sampling.probs_from_logits(jnp.array([[1.0, 3.0, 3.0, 0.0]]), temperature=0.0)
  np.testing.assert_array_equal(probs, [[0, 1, 0, 0]])


def test_argmax_equals_jnps_on_ties_infinities_nan_and_bfloat16():
  """sampling.argmax against jnp.argmax: random rows, rows of equal maxima (the first wins), rows
  of -inf with one finite entry, +inf twice, NaN (jnp.argmax returns the first NaN), and
  bfloat16, for 1-D and batched inputs."""
  rng = np.random.RandomState(0)
  rows = [rng.standard_normal(97).astype(np.float32) for _ in range(8)]
  tied = np.zeros(97, np.float32); tied[[5, 40, 96]] = 3.0
  lonely = np.full(97, -np.inf, np.float32); lonely[60] = -1e30
  infinite = rng.standard_normal(97).astype(np.float32); infinite[[7, 9]] = np.inf
  nan = rng.standard_normal(97).astype(np.float32); nan[[30, 70]] = np.nan; nan[3] = np.inf
  batch = np.stack(rows + [tied, lonely, infinite, nan])
  for scores in (batch, batch[:1, :], batch[0], batch.reshape(3, 4, 97)):
    for dtype in (jnp.float32, jnp.bfloat16):
      x = jnp.asarray(scores, dtype)
      ours = jax.jit(sampling.argmax)(x)
      assert ours.dtype == jnp.int32
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(jnp.argmax(x, axis=-1)))
  assert [int(i) for i in sampling.argmax(jnp.asarray(batch[8:]))] == [5, 60, 7, 30]


def test_temperature_scales_logits():
  probs = sampling.probs_from_logits(LOGITS, temperature=0.5)
  expected = np.array([0.05, 0.4, 0.1, 0.25, 0.2]) ** 2
  np.testing.assert_allclose(probs, expected / expected.sum(), rtol=1e-5)


def test_top_k_keeps_the_k_most_likely():
  probs = sampling.probs_from_logits(LOGITS, temperature=1.0, top_k=2)
  np.testing.assert_allclose(probs, [0, 0.4 / 0.65, 0, 0.25 / 0.65, 0], rtol=1e-5)


@pytest.mark.parametrize("top_p, kept", [
    (0.39, [1]),           # 0.4 alone reaches 0.39
    (0.41, [1, 3]),        # 0.4 < 0.41, so the next token (0.25) is needed
    (0.64, [1, 3]),
    (0.66, [1, 3, 4]),     # 0.65 < 0.66: the third token (0.2) crosses the threshold and is kept
    (1.0, [0, 1, 2, 3, 4]),
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
  probs = np.asarray(sampling.probs_from_logits(LOGITS, temperature=1.0, top_p=top_p))
  assert sorted(np.nonzero(probs)[0].tolist()) == kept
  base = np.array([0.05, 0.4, 0.1, 0.25, 0.2])
  np.testing.assert_allclose(probs[kept], base[kept] / base[kept].sum(), rtol=1e-5)


def test_per_row_temperature_and_top_p():
  logits = jnp.stack([LOGITS, LOGITS])
  probs = sampling.probs_from_logits(logits, temperature=jnp.array([0.0, 1.0]),
                                     top_p=jnp.array([1.0, 0.41]))
  np.testing.assert_array_equal(np.nonzero(probs[0])[0], [1])
  np.testing.assert_array_equal(np.nonzero(probs[1])[0], [1, 3])


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0),
                                                       (1.0, 0, 0.8), (0.8, 4, 0.9)])
def test_empirical_frequencies_match_the_transformed_distribution(temperature, top_k, top_p):
  logits = jax.random.normal(jax.random.PRNGKey(7), (12,)) * 1.5
  probs = np.asarray(sampling.probs_from_logits(logits, temperature, top_k, top_p), np.float64)
  draws = 40_000
  tokens = sampling.sample(jax.random.PRNGKey(11), jnp.broadcast_to(probs, (draws, 12)).astype(np.float32))
  counts = np.bincount(np.asarray(tokens), minlength=12)
  assert np.all(counts[probs == 0] == 0)  # filtered tokens are never drawn
  support = probs > 0
  # Chi-square goodness of fit at alpha = 1e-4: a correct sampler fails with probability 1e-4 per case
  # (seeds are fixed, so the outcome is deterministic; the rate bounds how unlucky a seed can be).
  _, p_value = stats.chisquare(counts[support], draws * probs[support] / probs[support].sum())
  assert p_value > 1e-4
  total_variation = 0.5 * np.abs(counts / draws - probs).sum()
  assert total_variation < 0.015


def test_sample_with_uniform_is_inverse_cdf_and_skips_zero_tokens():
  probs = jnp.array([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
  uniforms = jnp.array([0.0, 0.49, 0.5, 0.9999999])
  np.testing.assert_array_equal(sampling.sample_with_uniform(uniforms, probs), [1, 1, 3, 3])
  # u * total rounding onto the last cumulative sum must not land on a trailing zero-probability token.
  np.testing.assert_array_equal(sampling.sample_with_uniform(jnp.array([1.0]), probs[:1]), [3])


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be a whole number >= 0"),
])
def test_bad_sampling_settings_are_refused(kwargs, message):
  settings = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, **kwargs}
  with pytest.raises(ValueError, match=message):
    sampling.validate_sampling(**settings)


@pytest.mark.parametrize("vocab", [3, 255, 256, 257, 1000, 4099])
def test_sample_with_uniform_equals_a_float64_inverse_cdf_across_blocks(vocab):
  """The two-level draw (blocks of SAMPLE_BLOCK tokens) picks the token a float64 searchsorted over the
  whole cumulative sum picks, with whole blocks of zeros in the way; uniforms within 1e-5 of a
  boundary are skipped (float32 rounding may go either way there)."""
  rng = np.random.default_rng(vocab)
  probs = rng.random((200, vocab)) ** 4
  probs[:, rng.random(vocab) < 0.3] = 0.0
  probs[:, :min(vocab - 1, 2 * sampling.SAMPLE_BLOCK)] *= rng.random((200, 1)) < 0.5  # empty blocks
  probs[:, -1] += 0.01  # every row keeps some mass
  probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
  uniforms = rng.random(200).astype(np.float32)
  cumulative = np.cumsum(probs.astype(np.float64), axis=-1)
  targets = uniforms * cumulative[:, -1]
  want = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cumulative, targets)])
  clear = np.min(np.abs(cumulative - targets[:, None]), axis=-1) > 1e-5
  got = np.asarray(sampling.sample_with_uniform(jnp.asarray(uniforms), jnp.asarray(probs)))
  assert clear.sum() > 150
  np.testing.assert_array_equal(got[clear], want[clear])
  assert np.all(probs[np.arange(200), got] > 0)
