"""What a decode measured: the per-iteration statistics the speculative loop records (SpecStats, in
its SpecOutput) and their aggregates on the host (numpy), comparable with theory.py and with vLLM.
How long it took is timed by specjax/timing.py.

Statistics conventions: an iteration is "active" for a row when num_accepted >= 0. Draft position i
(1-based) is "reached" when the i - 1 drafts before it were accepted (num_accepted >= i - 1); its
acceptance_probs entry (beta) is then an unbiased estimate of that position's acceptance chance given
a real prefix.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class SpecStats:
  """Per row and iteration (I = max_new_tokens slots; the loop runs at most max_new_tokens - 1)."""
  num_accepted: jax.Array      # [B, I] int32 drafts accepted (raw n, before EOS / max_new cuts); -1 idle
  num_emitted: jax.Array       # [B, I] int32 tokens committed (after the cuts); 0 when idle
  acceptance_probs: jax.Array  # [B, I, g] float32 beta per drafted position (`acceptance_probs`);
  #                              meaningful where the position was reached: index i <= num_accepted

  @classmethod
  def empty(cls, batch: int, iterations: int, gamma: int) -> "SpecStats":
    return cls(jnp.full((batch, iterations), -1, jnp.int32),
               jnp.zeros((batch, iterations), jnp.int32),
               jnp.zeros((batch, iterations, gamma), jnp.float32))

  def record(self, iteration: jax.Array, active: jax.Array, num_accepted: jax.Array,
             num_emitted: jax.Array, betas: jax.Array) -> "SpecStats":
    """Write one iteration's column; rows inactive at its start keep the idle values."""
    return SpecStats(
        self.num_accepted.at[:, iteration].set(jnp.where(active, num_accepted, -1)),
        self.num_emitted.at[:, iteration].set(num_emitted),
        self.acceptance_probs.at[:, iteration].set(jnp.where(active[:, None], betas, 0.0)))

  @property
  def target_calls(self) -> jax.Array:
    """[B] verification calls each row took part in (prefill not counted)."""
    return jnp.sum(self.num_accepted >= 0, axis=-1)

  @property
  def draft_calls(self) -> jax.Array:
    """[B] drafter calls each row took part in (gamma per verification; drafter prefill not counted)."""
    return self.target_calls * self.acceptance_probs.shape[-1]


@flax.struct.dataclass
class SpecOutput:
  tokens: jax.Array         # [B, max_new_tokens] int32, pad_id past each row's end
  num_generated: jax.Array  # [B] int32, EOS included
  target_calls: jax.Array   # [] int32 target step calls after prefill (loop iterations)
  draft_calls: jax.Array    # [] int32 drafter calls after its prefill (gamma per iteration)
  stats: SpecStats


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


def summarize(output: SpecOutput) -> dict:
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


def summarize_outputs(outputs: list[SpecOutput]) -> dict:
  """Per-prompt SpecOutputs -> `summarize` of them stacked as one batch."""
  stats = jax.tree_util.tree_map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]),
                                 *[o.stats for o in outputs])
  stacked = SpecOutput(
      tokens=np.concatenate([np.asarray(o.tokens) for o in outputs]),
      num_generated=np.concatenate([np.asarray(o.num_generated) for o in outputs]),
      target_calls=sum(int(o.target_calls) for o in outputs),
      draft_calls=sum(int(o.draft_calls) for o in outputs), stats=stats)
  return summarize(stacked)
