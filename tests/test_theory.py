"""theory.py against Leviathan et al. 2022's own numbers (REFERENCE.md section 2)."""

import numpy as np
import pytest

from specjax import theory

C = {"T5-small": 0.02, "T5-base": 0.04, "T5-large": 0.11}  # measured by profiling (Leviathan)

# Table 4 rows: (task, draft, temperature, gamma, alpha, expected speedup as printed).
TABLE_4 = [
    ("EnDe", "T5-small", 0, 7, 0.75, 3.2), ("EnDe", "T5-base", 0, 7, 0.80, 3.3),
    ("EnDe", "T5-large", 0, 7, 0.82, 2.5), ("EnDe", "T5-small", 1, 7, 0.62, 2.3),
    ("EnDe", "T5-base", 1, 5, 0.68, 2.4), ("EnDe", "T5-large", 1, 3, 0.71, 2.0),
    ("CNNDM", "T5-small", 0, 5, 0.65, 2.4), ("CNNDM", "T5-base", 0, 5, 0.73, 2.6),
    ("CNNDM", "T5-large", 0, 3, 0.74, 2.0), ("CNNDM", "T5-small", 1, 5, 0.53, 1.9),
    ("CNNDM", "T5-base", 1, 3, 0.55, 1.8), ("CNNDM", "T5-large", 1, 3, 0.56, 1.6),
]


@pytest.mark.parametrize("task,draft,temperature,gamma,alpha,expected", TABLE_4)
def test_table_4_expected_speedup(task, draft, temperature, gamma, alpha, expected):
  assert abs(theory.walltime_improvement(alpha, gamma, C[draft]) - expected) < 0.07


def test_table_4_vectorised():
  alphas, gammas = np.array([r[4] for r in TABLE_4]), np.array([r[3] for r in TABLE_4])
  cs = np.array([C[r[1]] for r in TABLE_4])
  np.testing.assert_allclose(theory.walltime_improvement(alphas, gammas, cs),
                             [r[5] for r in TABLE_4], atol=0.07)


def test_argmax_lenience_speedups():
  # T5-small EnDe with argmax lenience l = 1 / 0.5 / 0.3 / 0.1: alpha 0.75 / 0.75 / 0.80 / 0.87 give
  # 3.3 / 3.3 / 3.9 / 4.9X at c = 0.015, gamma = 8.
  got = theory.walltime_improvement(np.array([0.75, 0.75, 0.80, 0.87]), 8, 0.015)
  np.testing.assert_allclose(got, [3.3, 3.3, 3.9, 4.9], atol=0.05)


def test_bigram_row():
  # A bigram draft (c = 0) at alpha 0.2, gamma 3: 1.25X.
  assert abs(theory.walltime_improvement(0.2, 3, 0.0) - 1.25) < 0.01


def test_expected_tokens_limits():
  assert theory.expected_tokens(0.0, 5) == 1.0
  assert theory.expected_tokens(1.0, 5) == 6.0
  assert abs(theory.expected_tokens(1.0 - 1e-12, 5) - 6.0) < 1e-9
  np.testing.assert_allclose(theory.expected_tokens(0.5, 2), 1 + 0.5 + 0.25)
  # Continuous through alpha = 1.
  np.testing.assert_allclose(theory.expected_tokens(1 - 1e-6, 7), 8.0, rtol=1e-4)
  # Monotone in alpha and in gamma.
  values = theory.expected_tokens(np.linspace(0, 1, 11), 4)
  assert np.all(np.diff(values) > 0)
  assert np.all(np.diff(theory.expected_tokens(0.7, np.arange(1, 10))) > 0)


def test_alpha_from_distributions():
  target = np.array([0.5, 0.3, 0.2, 0.0])
  draft = np.array([0.25, 0.25, 0.25, 0.25])
  assert abs(theory.alpha(target, draft) - (0.25 + 0.25 + 0.2 + 0.0)) < 1e-12
  assert theory.alpha(target, target) == pytest.approx(1.0)
  assert theory.alpha(target, [0, 0, 0, 1.0]) == 0.0
  # Lenience: sum min(target / l, draft) grows as l shrinks, up to the draft's mass on the target's
  # support (0.75 here: the draft's 0.25 on token 3, which the target never emits, stays rejected).
  lenient = [theory.alpha(target, draft, l) for l in (1.0, 0.5, 0.1)]
  assert lenient[0] < lenient[1] == lenient[2] == pytest.approx(0.75)
  assert theory.alpha(target, draft, 0.9) == pytest.approx(0.25 + 0.25 + 0.2 / 0.9)
  # Batched over leading axes.
  assert theory.alpha(np.stack([target, draft]), np.stack([draft, draft])).shape == (2,)


def test_best_gamma():
  # Free, perfect drafts: the longest gamma allowed wins.
  assert theory.best_gamma(1.0, 0.0, max_gamma=12)[0] == 12
  # Better drafts and cheaper drafts both justify longer speculation.
  gammas = [theory.best_gamma(a, 0.05)[0] for a in (0.5, 0.7, 0.8, 0.9)]
  assert gammas == sorted(gammas) and gammas[0] < gammas[-1]
  costs = [theory.best_gamma(0.8, c)[0] for c in (0.01, 0.05, 0.2)]
  assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1]
  # It agrees with a brute-force search and reports the gain.
  gamma, gain = theory.best_gamma(0.75, 0.02)
  brute = max(range(1, 17), key=lambda g: theory.walltime_improvement(0.75, g, 0.02))
  assert gamma == brute and gain == pytest.approx(theory.walltime_improvement(0.75, gamma, 0.02))
  # Speculation pays iff alpha > c (Cor. 3.9).
  assert theory.best_gamma(0.3, 0.2)[1] > 1.0
  assert theory.best_gamma(0.2, 0.3)[1] < 1.0
  with pytest.raises(ValueError, match="max_gamma"):
    theory.best_gamma(0.5, 0.1, max_gamma=0)


def test_speedup_from_measured_costs():
  # No accept cost, draft = gamma c, verify = v: Thm 3.8 with v; and with v = 1 Thm 3.8 itself.
  for a, gamma, c, v in [(0.3, 1, 0.1, 1.2), (0.7, 4, 0.05, 1.6), (0.95, 6, 0.0, 1.0)]:
    assert theory.speedup_from_costs(a, gamma, gamma * c, v, 0.0) == pytest.approx(
        theory.speedup_with_verify_cost(a, gamma, c, v))
    assert theory.speedup_from_costs(a, gamma, gamma * c, 1.0, 0.0) == pytest.approx(
        theory.walltime_improvement(a, gamma, c))
  # The accept step adds to the iteration: alpha 0.5, gamma 2 -> 1.75 tokens over 0.4 + 1.1 + 0.25.
  assert theory.speedup_from_costs(0.5, 2, 0.4, 1.1, 0.25) == pytest.approx(1.75 / 1.75)


def test_tree_prediction():
  # A chain with the same alpha at every depth is Leviathan's Eq. 1 and Thm 3.8.
  for a, gamma, c in [(0.3, 1, 0.1), (0.7, 4, 0.05), (0.95, 6, 0.0)]:
    assert theory.tree_expected_tokens([a] * gamma) == pytest.approx(theory.expected_tokens(a, gamma))
    assert theory.tree_speedup([a] * gamma, gamma * c, 1.0) == pytest.approx(
        theory.walltime_improvement(a, gamma, c))
  # Depth by depth: 1 + a1 + a1 a2 + a1 a2 a3; a zero stops everything below it.
  assert theory.tree_expected_tokens([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
  assert theory.tree_expected_tokens([0.9, 0.0, 1.0]) == pytest.approx(1.9)
  # Costs add in target steps; batched over leading axes.
  assert theory.tree_speedup([0.5, 0.5], 0.2, 1.5, 0.3) == pytest.approx(1.75 / 2.0)
  assert theory.tree_expected_tokens(np.full((3, 2), 1.0)).shape == (3,)
