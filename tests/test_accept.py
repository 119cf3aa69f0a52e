"""The accept rule on its own: hand-computed cases, ragged rows, the residual guard, lenience, greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import theory
from specjax.decoding import acceptance
from specjax.decoding import sampling

# V = 4, gamma = 2. Row-wise draft / target distributions used by the hand cases below.
DRAFT_1 = [0.5, 0.5, 0.0, 0.0]
DRAFT_2 = [0.25, 0.25, 0.25, 0.25]
UNIFORM = [0.25, 0.25, 0.25, 0.25]


def _accept(accept_u, resample_u, tokens, draft_probs, target_probs, lenience=1.0, greedy=False):
  n, nxt = acceptance.accept_with_uniforms(
      jnp.asarray(accept_u, jnp.float32), jnp.asarray(resample_u, jnp.float32),
      jnp.asarray(tokens, jnp.int32), jnp.asarray(draft_probs, jnp.float32),
      jnp.asarray(target_probs, jnp.float32), lenience, greedy)
  return np.asarray(n).tolist(), np.asarray(nxt).tolist()


def test_hand_cases_ragged_rows():
  tokens = [[0, 1]] * 4
  draft = [[DRAFT_1, DRAFT_2]] * 4
  target = [
      # x1 = 0: ratio 0.25 / 0.5 = 0.5, u 0.4 accepts; x2 = 1: ratio 0.6 / 0.25 > 1 accepts even at
      # u 0.99; bonus from target_3 = one-hot on token 2.
      [UNIFORM, [0.1, 0.6, 0.2, 0.1], [0.0, 0.0, 1.0, 0.0]],
      # u 0.6 > 0.5 rejects x1; residual max(0, target_1 - draft_1) = [0, 0, .25, .25] -> [0, 0, .5, .5];
      # resample u 0.7 lands on token 3.
      [UNIFORM, [0.1, 0.6, 0.2, 0.1], [0.0, 0.0, 1.0, 0.0]],
      # x1 accepted; x2 = 1: ratio 0.1 / 0.25 = 0.4 < u 0.5 rejects; residual target_2 - draft_2 =
      # [0, 0, .15, .15]; resample u 0.2 -> token 2.
      [UNIFORM, [0.1, 0.1, 0.4, 0.4], [1.0, 0.0, 0.0, 0.0]],
      # Same, resample u 0.8 -> token 3.
      [UNIFORM, [0.1, 0.1, 0.4, 0.4], [1.0, 0.0, 0.0, 0.0]],
  ]
  accept_u = [[0.4, 0.99], [0.6, 0.0], [0.4, 0.5], [0.4, 0.5]]
  n, nxt = _accept(accept_u, [0.3, 0.7, 0.2, 0.8], tokens, draft, target)
  assert n == [2, 0, 1, 1]
  assert nxt == [2, 3, 2, 3]


def test_target_zero_is_never_accepted_and_residual_excludes_it():
  # target_1(x1) = 0: rejected even with u = 0; residual max(0, target - draft) is [0, 0, .5, .5].
  n, nxt = _accept([[0.0, 0.0]], [0.0], [[0, 1]], [[DRAFT_1, DRAFT_2]],
                   [[[0.0, 0.0, 0.5, 0.5], UNIFORM, UNIFORM]])
  assert (n, nxt) == ([0], [2])


def test_lenience_hand_case():
  # l = 0.5: x1 ratio 0.25 / (0.5 * 0.5) = 1 accepts at any u; x2 = 1: 0.1 / (0.5 * 0.25) = 0.8 and u 0.9
  # rejects; residual max(0, target_2 - 0.5 * draft_2) = [0, 0, .275, .275] -> u 0.6 picks token 3.
  target = [[UNIFORM, [0.1, 0.1, 0.4, 0.4], UNIFORM]]
  n, nxt = _accept([[0.999, 0.9]], [0.6], [[0, 1]], [[DRAFT_1, DRAFT_2]], target, lenience=0.5)
  assert (n, nxt) == ([1], [3])
  n, _ = _accept([[0.999, 0.7]], [0.6], [[0, 1]], [[DRAFT_1, DRAFT_2]], target, lenience=0.5)
  assert n == [2]  # u 0.7 < 0.8 accepts x2 too


def test_residual_normaliser_near_zero_falls_back_to_target():
  # target and draft differ by 4e-6 of mass: the residual [0, 0, 4e-6, 0] is below RESIDUAL_FLOOR, so
  # the rare rejection (u = 1 - 1e-6 > ratio 1 - 8e-6) draws from target_1 instead: u 0.2 -> token 0.
  assert 4e-6 < acceptance.RESIDUAL_FLOOR
  target = [[[0.5, 0.5 - 4e-6, 4e-6, 0.0], UNIFORM]]
  n, nxt = _accept([[1 - 1e-6]], [0.2], [[1]], [[[0.5, 0.5, 0.0, 0.0]]], target)
  assert (n, nxt) == ([0], [0])
  # Identical distributions: nothing is ever rejected and nothing is NaN (the 0 / 0 case).
  n, nxt = _accept([[0.9999999, 0.9999999]], [0.4], [[0, 1]], [[DRAFT_2, DRAFT_2]],
                   [[DRAFT_2, DRAFT_2, DRAFT_1]])
  assert (n, nxt) == ([2], [0])
  # Above the floor the residual itself is used: [0, 0, 1e-3, 0] -> token 2 for any u.
  target = [[[0.5, 0.499, 0.001, 0.0], UNIFORM]]
  assert _accept([[1 - 1e-6]], [0.2], [[1]], [[[0.5, 0.5, 0.0, 0.0]]], target) == ([0], [2])


def test_greedy_cases():
  draft = [[DRAFT_1, DRAFT_2]] * 3  # ignored in greedy mode
  target = [[0.1, 0.6, 0.3, 0.0], [0.5, 0.2, 0.3, 0.0], [0.0, 0.1, 0.2, 0.7]]
  # x1 = 1 is target_1's argmax: accepted; x2 = 2 is not target_2's argmax: rejected, correction 0.
  n, nxt = _accept([[0.99, 0.99]] * 3, [0.5] * 3, [[1, 2]] * 3, draft, [target] * 3, greedy=True)
  assert (n, nxt) == ([1] * 3, [0] * 3)
  # Argmax lenience: target_2(2) = 0.3 >= 0.5 * max 0.5, accepted; bonus = argmax target_3 = 3.
  assert _accept([[0.99, 0.99]], [0.5], [[1, 2]], draft[:1], [target], lenience=0.5,
                 greedy=True) == ([2], [3])
  # ... but 0.3 < 0.7 * 0.5: rejected at l = 0.7.
  assert _accept([[0.99, 0.99]], [0.5], [[1, 2]], draft[:1], [target], lenience=0.7,
                 greedy=True) == ([1], [0])
  # The one-hot target of probs_from_logits at temperature 0 works as well (plain greedy).
  onehot = np.eye(4)[[1, 0, 3]]
  assert _accept([[0.0, 0.0]], [0.0], [[1, 0]], draft[:1], [onehot], greedy=True) == ([2], [3])
  # greedy may differ per row: row 0 greedy rejects x2 = 2, row 1 samples and accepts it (u 0).
  n, _ = _accept([[0.0, 0.0]] * 2, [0.5] * 2, [[1, 2]] * 2, draft[:2], [target] * 2,
                 greedy=jnp.array([True, False]))
  assert n == [1, 2]


def test_greedy_target_probs_breaks_float_ties_like_argmax():
  # exp(-1e-8) rounds to 1 in float32, so softmax ties two distinct logits; argmax(logits) says 1.
  logits = jnp.array([[0.0, 1e-8, -3.0]], jnp.float32)
  assert float(jax.nn.softmax(logits)[0, 0]) == float(jax.nn.softmax(logits)[0, 1])
  probs = acceptance.greedy_target_probs(logits)
  assert int(jnp.argmax(probs)) == 1 == int(jnp.argmax(logits))
  n, nxt = _accept([[0.0]], [0.0], [[0]], [[[1.0, 0.0, 0.0]]], probs[:, None].repeat(2, 1),
                   greedy=True)
  assert (n, nxt) == ([0], [1])  # the tied-but-lower token is rejected, as greedy decoding would
  np.testing.assert_allclose(np.asarray(probs).sum(), 1.0, atol=1e-6)


def _emit_distribution(target, draft, lenience):
  """Exact law of the first emitted token for gamma = 1 (accepted draft, else residual draw)."""
  target, draft = np.asarray(target, np.float64), np.asarray(draft, np.float64)
  accepted = draft * np.minimum(1.0, np.where(draft > 0, target / (lenience * np.maximum(draft, 1e-300)),
                                              1.0))
  residual = np.maximum(target - lenience * draft, 0.0)
  return accepted + (1.0 - accepted.sum()) * residual / residual.sum()


def test_lenience_accepts_more_and_bounds_emitted_probability():
  """gamma = 1, 200k rows per lenience. Three checks per lenience value: chi-square of the emitted
  tokens against their exact law (p < 1e-6 fails), acceptance within 5 sigma of alpha_l (two-sided
  normal tail 6e-7), and every empirical frequency <= target / l + 5 sigma. With 3 lenience values the
  false-failure rate over seeds is below 1e-5; the seed is fixed, so the outcome is deterministic."""
  target = np.array([0.5, 0.3, 0.1, 0.1, 0.0], np.float32)
  draft = np.array([0.1, 0.1, 0.2, 0.3, 0.3], np.float32)
  rows = 200_000
  run = jax.jit(acceptance.accept)
  rates = []
  for i, lenience in enumerate([1.0, 0.5, 0.2]):
    draw_rng, accept_rng = jax.random.split(jax.random.PRNGKey(i))
    tokens = sampling.sample(draw_rng, jnp.broadcast_to(draft, (rows, 1, 5)))
    n, nxt = run(accept_rng, tokens, jnp.broadcast_to(draft, (rows, 1, 5)),
                 jnp.broadcast_to(target, (rows, 2, 5)), jnp.float32(lenience), False)
    emitted = np.where(np.asarray(n) == 1, np.asarray(tokens)[:, 0], np.asarray(nxt))
    counts = np.bincount(emitted, minlength=5)
    law = _emit_distribution(target, draft, lenience)
    assert np.all(law <= target / lenience + 1e-12)  # the bound holds exactly ...
    freq = counts / rows
    sigma = np.sqrt(law * (1 - law) / rows)
    assert np.all(freq <= target / lenience + 5 * sigma + 1e-12)  # ... and empirically
    support = law > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], law[support] * rows).pvalue > 1e-6
    alpha_l = float(theory.alpha(target, draft, lenience))
    rate = float(np.mean(np.asarray(n)))
    assert abs(rate - alpha_l) < 5 * np.sqrt(alpha_l * (1 - alpha_l) / rows)
    rates.append(rate)
  assert rates[0] < rates[1] < rates[2]
  # At l = 1 the law is the target itself: lossless.
  np.testing.assert_allclose(_emit_distribution(target, draft, 1.0), target, atol=1e-7)


def test_acceptance_probs_matches_theory():
  rng = np.random.RandomState(0)
  draft = rng.dirichlet(np.ones(6), size=(3, 2)).astype(np.float32)
  target = rng.dirichlet(np.ones(6), size=(3, 3)).astype(np.float32)
  tokens = jnp.zeros((3, 2), jnp.int32)
  beta = acceptance.acceptance_probs(tokens, draft, target, 0.5, False)
  np.testing.assert_allclose(beta, np.minimum(theory.alpha(target[:, :2], draft, 0.5), 1.0), rtol=1e-5)


@pytest.mark.parametrize("lenience", [1.0, 0.5])
def test_accept_rng_wrapper_shapes(lenience):
  tokens = jnp.array([[0, 1, 2]] * 2, jnp.int32)
  probs = jnp.full((2, 3, 4), 0.25)
  n, nxt = acceptance.accept(jax.random.PRNGKey(0), tokens, probs, jnp.full((2, 4, 4), 0.25),
                              lenience)
  assert n.shape == nxt.shape == (2,) and n.dtype == nxt.dtype == jnp.int32
  assert np.all(np.asarray(n) == 3)  # identical distributions accept everything
