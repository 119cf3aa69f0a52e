"""Closed-form predictions of Leviathan et al. (2022), section 3, for measured (alpha, c).

  alpha   acceptance rate: E over prefixes of beta = sum_x min(target_probs(x), draft_probs(x))
          (Def. 3.1 / Thm 3.5); with lenience l (app. A.5) beta_l = sum_x min(target_probs(x) / l,
          draft_probs(x)), which is the chance a drafted token survives the lenient test.
  gamma   draft tokens per iteration.
  c       cost of one draft step / cost of one target step (Def. 3.7), measured by profiling.

Under the i.i.d. assumption each iteration emits (1 - alpha^(gamma+1)) / (1 - alpha) tokens (Eq. 1)
for gamma draft steps and one target step, so the walltime improvement over target-only decoding is
that divided by (gamma * c + 1) (Thm 3.8). Everything here is numpy and broadcasts over its inputs,
so a table of (alpha, gamma, c) rows is one call.
"""

from __future__ import annotations

import numpy as np

# Below this distance from 1 the closed form divides ~0 by ~0; use the limit gamma + 1 instead.
_ALPHA_ONE = 1e-9


def alpha(target_probs, draft_probs, lenience=1.0):
  """beta = sum_x min(target_probs(x) / lenience, draft_probs(x)), over the last axis.

  Args:
    target_probs, draft_probs: [..., V] distributions after the same sampling transform.
    lenience: l in (0, 1]; 1 is the lossless rule.
  Returns: [...] float64 in [0, 1]. Averaging it over the prefixes a task visits gives alpha.
  """
  target_probs = np.asarray(target_probs, np.float64)
  draft_probs = np.asarray(draft_probs, np.float64)
  return np.minimum(target_probs / np.asarray(lenience, np.float64), draft_probs).sum(-1)


def expected_tokens(alpha_, gamma):
  """Expected tokens emitted per iteration (accepted drafts plus the correction or bonus token).

  (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan Eq. 1); gamma + 1 at alpha = 1, 1 at alpha = 0.
  alpha_, gamma: scalars or broadcastable arrays. Returns float64 of the broadcast shape.
  """
  a = np.asarray(alpha_, np.float64)
  g = np.asarray(gamma, np.float64)
  near_one = np.abs(1.0 - a) < _ALPHA_ONE
  safe = np.where(near_one, 0.5, a)  # keeps the unused branch finite
  return np.where(near_one, g + 1.0, (1.0 - safe ** (g + 1.0)) / (1.0 - safe))


def walltime_improvement(alpha_, gamma, c):
  """Leviathan Thm 3.8: expected speedup over target-only decoding.

  (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1)). Broadcasts over alpha_, gamma, c.
  """
  return expected_tokens(alpha_, gamma) / (np.asarray(gamma, np.float64) * np.asarray(c, np.float64)
                                           + 1.0)


def best_gamma(alpha_, c, max_gamma: int = 16):
  """The gamma in 1..max_gamma that maximises Thm 3.8's improvement for scalar (alpha, c).

  Returns (gamma: int, improvement: float). Ties go to the smaller gamma (less wasted draft work).
  Speculation pays (improvement > 1 for some gamma) iff alpha > c (Leviathan Cor. 3.9); when it does
  not, the answer is still the least-bad gamma, 1, and the improvement says it loses.
  """
  if max_gamma < 1:
    raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
  gammas = np.arange(1, max_gamma + 1)
  gains = walltime_improvement(alpha_, gammas, c)
  index = int(np.argmax(gains))
  return int(gammas[index]), float(gains[index])


def speedup_with_verify_cost(alpha_, gamma, c, verify_cost):
  """Thm 3.8 with the target's cost of scoring gamma + 1 tokens, `verify_cost` target steps, in place
  of Leviathan's 1: expected_tokens / (gamma c + verify_cost). On hardware where a step is bound by
  reading the weights verify_cost ~ 1 (Thm 3.8); on a CPU running a GEMM for T > 1 it is 1.3-1.8."""
  return expected_tokens(alpha_, gamma) / (np.asarray(gamma, np.float64) * np.asarray(c, np.float64)
                                           + np.asarray(verify_cost, np.float64))


def speedup_from_costs(alpha_, gamma, draft_cost, verify_cost, accept_cost):
  """Thm 3.8 with every part of an iteration measured: expected_tokens / (draft_cost + verify_cost +
  accept_cost), the costs of the gamma draft calls, the target scoring gamma + 1 tokens and the
  accept / commit / roll-back step, in units of the baseline's decode time per token (which carries
  its own per-token overhead). Where a target step takes well under a millisecond the accept step
  and the loop's bookkeeping are a visible share of an iteration, which Thm 3.8 leaves out."""
  cost = (np.asarray(draft_cost, np.float64) + np.asarray(verify_cost, np.float64)
          + np.asarray(accept_cost, np.float64))
  return expected_tokens(alpha_, gamma) / cost


# ----------------------------------------------------------------------------------------------------
# Token trees (decoding/tree.py). The i.i.d. chain model generalises by depth: alpha_d is the chance that the
# walk passes depth d given it reached it (for a tree, the target's mass on the node's candidate
# tokens; SpecStats' betas estimate it without sampling luck).


def tree_expected_tokens(depth_alphas):
  """Tokens per target call of a tree walk: 1 + sum_d prod_{j <= d} alpha_j over depths 1..D (the
  accepted path plus the token drawn where the walk stops). A chain with alpha_d = alpha for every d
  gives Leviathan's Eq. 1. depth_alphas[..., D] -> [...] float64."""
  a = np.asarray(depth_alphas, np.float64)
  return 1.0 + np.cumprod(a, axis=-1).sum(-1)


def tree_speedup(depth_alphas, draft_cost, verify_cost, accept_cost=0.0):
  """Predicted speedup of a tree loop over target-only decoding: tree_expected_tokens over the cost
  of one iteration in target steps: the drafter's work (all its calls for the tree), the target
  scoring the T tree nodes (v(T)), and the acceptance walk (transform at T nodes, sampling per depth,
  cache compaction), each measured. With one draft call per depth, verify_cost 1 and no accept cost,
  a chain tree reduces to Thm 3.8."""
  cost = (np.asarray(draft_cost, np.float64) + np.asarray(verify_cost, np.float64)
          + np.asarray(accept_cost, np.float64))
  return tree_expected_tokens(depth_alphas) / cost
