"""Aggregates of speculative.SpecStats on the host (numpy), comparable with theory.py and with vLLM.

Conventions: an iteration is "active" for a row when num_accepted >= 0. Draft position i (1-based) is
"reached" when the i - 1 drafts before it were accepted (num_accepted >= i - 1); its acceptance_probs
entry (beta) is then an unbiased estimate of that position's acceptance chance given a real prefix.
"""

from __future__ import annotations

import numpy as np


def acceptance_histogram(num_accepted, gamma: int) -> np.ndarray:
  """num_accepted[B, I] (-1 idle) -> counts[gamma + 1] of iterations that accepted n = 0..gamma."""
  n = np.asarray(num_accepted).ravel()
  return np.bincount(n[n >= 0], minlength=gamma + 1)[:gamma + 1]


def per_position_acceptance(num_accepted, gamma: int):
  """Acceptance at draft positions 1..gamma.

  Returns (per_draft[g], conditional[g]): per_draft = accepted at i / drafted at i, where every active
  iteration drafts all gamma positions (vLLM's per-position rate, ~alpha^i); conditional = accepted at
  i / reached i (~alpha at every i under the i.i.d. assumption). NaN where the denominator is 0.
  """
  n = np.asarray(num_accepted).ravel()
  n = n[n >= 0]
  i = np.arange(1, gamma + 1)[:, None]
  accepted = (n[None, :] >= i).sum(1)
  reached = (n[None, :] >= i - 1).sum(1)
  with np.errstate(invalid="ignore", divide="ignore"):
    return accepted / np.float64(len(n)), accepted / reached.astype(np.float64)


def empirical_alpha(num_accepted, gamma: int) -> float:
  """Accepted drafts / reached draft positions: the maximum-likelihood alpha of a truncated geometric."""
  n = np.asarray(num_accepted).ravel()
  n = n[n >= 0]
  reached = np.minimum(n + 1, gamma).sum()
  return float(n.sum() / reached) if reached else float("nan")


def alpha_estimate(acceptance_probs, num_accepted) -> float:
  """Mean beta = sum_x min(target_probs, draft_probs) over reached draft positions.

  acceptance_probs[B, I, g], num_accepted[B, I]. Needs no sampling luck: it is the expectation the
  empirical rate fluctuates around.
  """
  beta = np.asarray(acceptance_probs, np.float64)
  n = np.asarray(num_accepted)[..., None]
  reached = (n >= 0) & (np.arange(beta.shape[-1]) <= n)
  return float(beta[reached].mean()) if reached.any() else float("nan")


def mean_accepted_length(num_accepted) -> float:
  """Mean of n + 1 over active iterations: tokens per target call before EOS / max_new cuts (the
  quantity theory.expected_tokens predicts; vLLM's "mean acceptance length")."""
  n = np.asarray(num_accepted).ravel()
  n = n[n >= 0]
  return float((n + 1).mean()) if n.size else float("nan")


def summarize(output) -> dict:
  """A SpecOutput -> JSON-ready scalars and lists."""
  stats = output.stats
  num_accepted = np.asarray(stats.num_accepted)
  gamma = stats.acceptance_probs.shape[-1]
  active = num_accepted >= 0
  per_draft, conditional = per_position_acceptance(num_accepted, gamma)
  return {
      "gamma": int(gamma),
      "tokens": int(np.asarray(output.num_generated).sum()),
      "iterations": int(output.target_calls),
      "target_calls": int(output.target_calls),
      "draft_calls": int(output.draft_calls),
      "row_target_calls": np.asarray(stats.target_calls).tolist(),
      "acceptance_histogram": acceptance_histogram(num_accepted, gamma).tolist(),
      "per_position_acceptance": per_draft.tolist(),
      "conditional_acceptance": conditional.tolist(),
      "empirical_alpha": empirical_alpha(num_accepted, gamma),
      "alpha_estimate": alpha_estimate(stats.acceptance_probs, num_accepted),
      "mean_accepted_length": mean_accepted_length(num_accepted),
      # Committed tokens per verification call a row took part in (after EOS / max_new cuts).
      "tokens_per_target_call": float(np.asarray(stats.num_emitted)[active].sum() / active.sum())
                                if active.any() else float("nan"),
  }
