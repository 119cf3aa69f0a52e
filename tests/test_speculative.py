"""The loop with sampled chains (chain rejection): a numpy replay, greedy == target greedy,
losslessness, alpha, compilations."""

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import (BigramDrafter, assert_follows_laws, bigram_from_step, bigram_marginals,
                      bigram_model, random_decoder_params)
from specjax import metrics, theory, timing
from specjax.decoding import acceptance, autoregressive, core, sampling
from specjax.drafters import expansion, lookup
from specjax.drafters.model import ModelDrafter
from specjax.contracts import StepModel
from specjax.models import decoder_only

# ---------------------------------------------------------------------------------------------------
# Table models: logits looked up from fixed arrays (DESIGN.md: the core never imports models/).




@flax.struct.dataclass
class HistoryCache:
  history: jax.Array  # [B, S] token at each position
  lengths: jax.Array


def trigram_step(table, tokens, positions, cache):
  """logits = table[token at pos - 1, token at pos] (0 before position 0). The older token comes from
  the cache whenever it is not in this call, and only from slots below the cache's length (else 0),
  so misplaced writes and lengths rolled back too far both change the output."""
  rows = jnp.arange(tokens.shape[0])[:, None]
  cached = (positions - 1 < cache.lengths[:, None]) | (jnp.arange(tokens.shape[1]) > 0)
  history = cache.history.at[rows, positions].set(tokens)
  before = jnp.where((positions > 0) & cached, history[rows, jnp.maximum(positions - 1, 0)], 0)
  return table[before, tokens], HistoryCache(history, positions[:, -1] + 1)


def trigram_cache(batch, max_length):
  return HistoryCache(jnp.zeros((batch, max_length), jnp.int32), jnp.zeros((batch,), jnp.int32))


def pad_prompts(prompts):
  length = max(len(p) for p in prompts)
  tokens = np.zeros((len(prompts), length), np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :len(prompt)] = prompt
  return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


# ---------------------------------------------------------------------------------------------------
# (a) The loop == a naive numpy loop fed the same uniforms.


def _inverse_cdf(uniform, probs):
  cumulative = np.cumsum(probs)
  index = int(np.sum(cumulative <= uniform * cumulative[-1]))
  return min(index, int(np.flatnonzero(probs > 0)[-1]))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _all_uniforms(rng, iterations, batch, gamma):
  """A sampled chain's uniforms per iteration: the draft's [I, B, g], then chain rejection's accept
  [I, B, g] and resample [I, B] (core.iteration_uniforms: the drafter's first)."""
  u = jax.vmap(lambda i: core.iteration_uniforms(rng, i, batch, 2 * gamma + 1))(iterations)
  return u[..., :gamma], u[..., gamma:2 * gamma], u[..., 2 * gamma]


def numpy_reference(target_table, draft_table, prompts, rng, shape, gamma, temperature, top_p,
                    lenience):
  """Leviathan Alg. 1 row by row in numpy, with the loop's random numbers. Returns (tokens, n per
  iteration) as lists per row. shape: the core.DecodeConfig."""
  max_new = shape.max_new_tokens
  transform = functools.partial(sampling.probs_from_logits, temperature=temperature,
                                top_k=shape.top_k, top_p=top_p)
  sample_tab = target_tab = np.asarray(transform(target_table), np.float64)
  draft_tab = np.asarray(transform(draft_table), np.float64)
  greedy = temperature == 0
  if greedy:  # argmax lenience compares against the soft distribution
    soft = np.exp(target_table - target_table.max(-1, keepdims=True))
    target_tab = soft / soft.sum(-1, keepdims=True)

  def next_probs(tab, seq):
    return tab[seq[-2] if len(seq) > 1 else 0, seq[-1]]

  batch = len(prompts)
  first_u = np.asarray(core.first_token_uniform(rng, batch))
  all_u = _all_uniforms(rng, jnp.arange(max_new), batch, gamma)
  outs = [[_inverse_cdf(first_u[b], next_probs(sample_tab, p))] for b, p in enumerate(prompts)]
  done = [o[0] == shape.eos_id or max_new == 1 for o in outs]
  accepted = [[] for _ in prompts]
  iteration = 0
  while iteration < max_new and not all(done):
    draft_u, accept_u, resample_u = (np.asarray(u[iteration]) for u in all_u)
    for b in range(batch):
      if done[b]:
        continue
      seq = list(prompts[b]) + outs[b]
      drafts, draft_probs = [], []
      for i in range(gamma):
        draft_probs.append(next_probs(draft_tab, seq + drafts))
        drafts.append(_inverse_cdf(draft_u[b, i], draft_probs[-1]))
      target_probs = [next_probs(target_tab, seq + drafts[:j]) for j in range(gamma + 1)]
      n = 0
      while n < gamma:
        t, d = target_probs[n][drafts[n]], draft_probs[n][drafts[n]]
        ok = t >= lenience * target_probs[n].max() if greedy else accept_u[b, n] * lenience * d < t
        if not ok:
          break
        n += 1
      if greedy:
        nxt = int(np.argmax(target_probs[n]))
      else:
        residual = np.maximum(target_probs[n] - lenience * (draft_probs[n] if n < gamma else 0), 0)
        if residual.sum() <= acceptance.RESIDUAL_FLOOR:
          residual = target_probs[n]
        nxt = _inverse_cdf(resample_u[b], residual)
      accepted[b].append(n)
      for token in drafts[:n] + [nxt]:
        outs[b].append(token)
        if token == shape.eos_id or len(outs[b]) == max_new:
          done[b] = True
          break
    iteration += 1
  return outs, accepted


def _tables(vocab, seed, eos=None):
  rng = np.random.RandomState(seed)
  target = (2.0 * rng.randn(vocab, vocab, vocab)).astype(np.float32)
  draft = (target + 1.5 * rng.randn(vocab, vocab, vocab)).astype(np.float32)
  if eos is not None:  # rarer EOS, so rows end at different iterations
    target[..., eos] -= 1.5
    draft[..., eos] -= 1.5
  return target, draft


PROMPTS = [[1, 2, 3, 4, 5], [3], [2, 2, 0], [5, 1], [4, 4, 4, 4], [0, 1, 2]]


@pytest.mark.parametrize("top_k,gamma,max_new", [(0, 3, 12), (3, 1, 12), (0, 5, 3)])
def test_loop_matches_numpy_reference(top_k, gamma, max_new):
  vocab, eos = 6, 1
  shape = core.DecodeConfig(max_new_tokens=max_new, top_k=top_k, eos_id=eos, pad_id=-1)
  target_table, draft_table = _tables(vocab, seed=top_k, eos=eos)
  trigram = StepModel(trigram_step, trigram_cache)
  fn = core.make_decode(trigram, expansion.SampledChain(ModelDrafter(trigram), gamma), shape)
  prompt_tokens, prompt_lengths = pad_prompts(PROMPTS)
  settings = [(1.0, 1.0, 1.0), (0.7, 0.8, 1.0), (1.0, 1.0, 0.5), (0.0, 1.0, 1.0), (0.0, 1.0, 0.6)]
  for seed, (temperature, top_p, lenience) in enumerate(settings):
    rng = jax.random.PRNGKey(seed)
    out = fn(target_table, draft_table, prompt_tokens, prompt_lengths, rng, temperature, top_p,
             lenience)
    tokens, accepted = numpy_reference(target_table, draft_table, PROMPTS, rng, shape, gamma,
                                       temperature, top_p, lenience)
    setting = f"temperature={temperature} top_p={top_p} lenience={lenience}"
    for b in range(len(PROMPTS)):
      got = np.asarray(out.tokens[b])
      assert got[:int(out.num_generated[b])].tolist() == tokens[b], setting
      assert np.all(got[len(tokens[b]):] == -1), setting
      got_n = np.asarray(out.stats.num_accepted[b])
      assert got_n[got_n >= 0].tolist() == accepted[b], setting
    assert int(out.target_calls) == max(len(a) for a in accepted)
    assert int(out.draft_calls) == gamma * int(out.target_calls)
  assert fn.jitted._cache_size() == 1


# ---------------------------------------------------------------------------------------------------
# (b), (c) Greedy output == target-only greedy, for any draft; an identical draft accepts everything.

TINY = decoder_only.SIZES["tiny"]
TINY_DRAFT = decoder_only.DecoderConfig(vocab_size=128, embed_dim=32, num_layers=1, num_heads=2,
                                        num_kv_heads=1, head_dim=16, mlp_dim=64)
GREEDY_SHAPE = dict(gamma=4, max_new_tokens=20)


@functools.lru_cache(maxsize=None)
def _decoder_setup():
  target_params = random_decoder_params(TINY, seed=0)
  step = decoder_only.make_step(TINY)
  init_cache = functools.partial(decoder_only.init_cache, TINY)
  prompt_tokens = jnp.asarray(np.random.RandomState(0).randint(0, 128, (4, 7)), jnp.int32)
  prompt_lengths = jnp.array([7, 3, 5, 1], jnp.int32)
  # EOS = a token row 0 emits mid-way, so rows end at different points.
  plain = autoregressive.make_generate(StepModel(step, init_cache), autoregressive.DecodeShape(20))(
      target_params, prompt_tokens, prompt_lengths, jax.random.PRNGKey(0), 0.0)
  eos = int(plain.tokens[0, 8])
  return target_params, step, init_cache, prompt_tokens, prompt_lengths, eos


@functools.lru_cache(maxsize=None)
def _target_greedy(batch):
  target_params, step, init_cache, prompt_tokens, prompt_lengths, eos = _decoder_setup()
  return autoregressive.make_generate(StepModel(step, init_cache), autoregressive.DecodeShape(
      20, eos_id=eos, pad_id=-1))(target_params, prompt_tokens[:batch], prompt_lengths[:batch],
                                  jax.random.PRNGKey(0), 0.0)


def _greedy_drafter(kind, step, init_cache, target_params):
  if kind == "lookup then random model":
    inner, params = _greedy_drafter("random model", step, init_cache, target_params)
    return lookup.TokenLookupFront(inner, lookup.PromptLookupDrafter(128, 2, 1)), params
  if kind == "subset-head model":
    config = dataclasses.replace(TINY_DRAFT, tie_embeddings=False, head_size=40)
    params = random_decoder_params(dataclasses.replace(config, head_size=0), seed=2)
    params["lm_head"] = params["lm_head"][:, :40]
    params[decoder_only.HEAD_TOKENS] = np.arange(0, 120, 3, dtype=np.int32)
    return (ModelDrafter(decoder_only.model(config)), params)
  if kind == "random model":
    return (ModelDrafter(decoder_only.model(TINY_DRAFT)),
            random_decoder_params(TINY_DRAFT, seed=1))
  if kind == "identical model":
    return ModelDrafter(StepModel(step, init_cache)), target_params
  if kind == "bigram":
    return BigramDrafter(), bigram_from_step(StepModel(step, init_cache), target_params, 128)
  return lookup.PromptLookupDrafter(128, max_ngram=2), None


@pytest.mark.parametrize("batch", [4, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["random model", "identical model", "bigram", "prompt lookup",
                                  "lookup then random model", "subset-head model"])
def test_greedy_equals_target_greedy(kind, batch):
  target_params, step, init_cache, prompt_tokens, prompt_lengths, eos = _decoder_setup()
  prompt_tokens, prompt_lengths = prompt_tokens[:batch], prompt_lengths[:batch]
  drafter, draft_params = _greedy_drafter(kind, step, init_cache, target_params)
  expected = _target_greedy(batch)
  gamma = GREEDY_SHAPE["gamma"]
  shape = core.DecodeConfig(GREEDY_SHAPE["max_new_tokens"], eos_id=eos, pad_id=-1)
  out = core.make_decode(StepModel(step, init_cache), expansion.SampledChain(drafter, gamma), shape)(
      target_params, draft_params, prompt_tokens, prompt_lengths, jax.random.PRNGKey(3), 0.0)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_generated, expected.num_generated)
  if batch == 4:
    # EOS ended row 0 early while another row ran to max_new_tokens.
    assert int(out.num_generated[0]) < 20 <= int(out.num_generated.max())
  n = np.asarray(out.stats.num_accepted)
  if kind == "identical model":  # (c) draft == target accepts every drafted token
    assert np.all(n[n >= 0] == gamma)
    assert int(out.target_calls) < 20 // (gamma + 1) + 1


# ---------------------------------------------------------------------------------------------------
# (d), (e) Losslessness and acceptance on bigram table models: 4000 rows per setting.

ROWS, VOCAB = 4000, 6
STAT_SHAPE = dict(gamma=3, max_new_tokens=6)


@functools.lru_cache(maxsize=None)
def _stat_fn(top_k, kind):
  shape = core.DecodeConfig(STAT_SHAPE["max_new_tokens"], top_k=top_k)
  step = {"lookup": lookup.PromptLookupDrafter(VOCAB), "bigram": BigramDrafter(),
          # lookup where a 2-gram repeats (often, with 6 tokens), the bigram elsewhere
          "lookup+bigram": lookup.TokenLookupFront(
              BigramDrafter(), lookup.PromptLookupDrafter(VOCAB, 2, 2))}[kind]
  return core.make_decode(bigram_model(), expansion.SampledChain(step, STAT_SHAPE["gamma"]), shape)


def _run_stat(target, draft, seed, temperature=1.0, top_p=1.0, lenience=1.0, top_k=0,
              kind="bigram"):
  prompt = jnp.full((ROWS, 1), 2, jnp.int32)
  kind = "lookup" if draft is None else kind  # prompt lookup: one-hot drafts from the row's history
  return _stat_fn(top_k, kind)(jnp.asarray(target), None if draft is None else jnp.asarray(draft),
                               prompt, jnp.ones((ROWS,), jnp.int32), jax.random.PRNGKey(seed),
                               temperature, top_p, lenience)


def _random_pair(seed, scale_target=2.0, scale_draft=2.0):
  rng = np.random.RandomState(seed)
  return ((scale_target * rng.randn(VOCAB, VOCAB)).astype(np.float32),
          (scale_draft * rng.randn(VOCAB, VOCAB)).astype(np.float32))


def _adversarial(name):
  target, draft = _random_pair(10)
  if name == "disjoint supports":
    target[:, 3:] = -np.inf
    draft[:, :3] = -np.inf
  elif name == "one-hot target":
    target = np.where(np.eye(VOCAB)[np.roll(np.arange(VOCAB), 1)] > 0, 0.0, -np.inf)
  elif name == "draft == target":
    draft = target.copy()
  elif name == "near-uniform draft":
    draft = 0.05 * draft
  elif name == "prompt lookup":
    draft = None
  return target.astype(np.float32), draft if draft is None else draft.astype(np.float32)


CASES = [("disjoint supports", {}), ("one-hot target", {}), ("draft == target", {}),
         ("near-uniform draft", {}), ("prompt lookup", {}), ("random", dict(temperature=0.6)),
         ("random", dict(top_p=0.7)), ("random", dict(temperature=1.3, top_k=3)),
         ("random", dict(lenience=1.0, temperature=0.8, top_p=0.9)),
         ("random", dict(kind="lookup+bigram"))]


@pytest.mark.parametrize("name,transform", CASES)
def test_emitted_distribution_equals_target(name, transform):
  """Each output position's token counts vs the exact target-only law: chi-square p < 1e-6 fails
  (6 positions per case, 10 cases: false-failure rate < 6e-5 over seeds), and total variation < 0.06
  (its sd here is ~0.005, so > 7 sd). A lossy or mis-wired rule (draft probs not the sampled ones,
  residual wrong, bonus from the wrong position) moves these laws by far more."""
  target, draft = _adversarial(name)
  temperature, top_k = transform.get("temperature", 1.0), transform.get("top_k", 0)
  top_p = transform.get("top_p", 1.0)
  out = _run_stat(target, draft, seed=CASES.index((name, transform)), **transform)
  assert_follows_laws(out.tokens, bigram_marginals(target, temperature, top_k, top_p,
                                             STAT_SHAPE["max_new_tokens"]), name)
  n = np.asarray(out.stats.num_accepted)
  if name == "draft == target":  # (c) on a sampled table model
    assert np.all(n[n >= 0] == STAT_SHAPE["gamma"])
  if name == "disjoint supports":
    assert np.all(n[n >= 0] == 0)


def test_target_only_sampling_follows_the_exact_law():
  """The oracle above is the law plain sampling produces (same false-failure budget)."""
  target, _ = _random_pair(10)
  out = autoregressive.make_generate(bigram_model(), autoregressive.DecodeShape(3))(
      jnp.asarray(target), jnp.full((ROWS, 1), 2, jnp.int32), jnp.ones((ROWS,), jnp.int32),
      jax.random.PRNGKey(1), 0.6)
  for position, law in enumerate(bigram_marginals(target, 0.6, 0, 1.0, 3)):
    counts = np.bincount(np.asarray(out.tokens[:, position]), minlength=VOCAB)
    assert stats.chisquare(counts, law / law.sum() * ROWS).pvalue > 1e-6


@pytest.mark.parametrize("lenience", [1.0, 0.5])
def test_acceptance_rate_matches_alpha(lenience):
  """Context-free tables (every row equal) give one alpha for every position. Empirical acceptance
  within 5 sd of theory.alpha and the mean accepted length within 5 sd of theory.expected_tokens
  (two-sided normal tails 6e-7 each); the histogram vs the truncated geometric, chi-square p > 1e-6."""
  rng = np.random.RandomState(4)
  target = np.broadcast_to(1.5 * rng.randn(VOCAB), (VOCAB, VOCAB)).astype(np.float32)
  draft = np.broadcast_to(1.5 * rng.randn(VOCAB), (VOCAB, VOCAB)).astype(np.float32)
  out = _run_stat(target, draft, seed=5, lenience=lenience)
  gamma = STAT_SHAPE["gamma"]
  target_probs = np.asarray(sampling.probs_from_logits(jnp.asarray(target[0]), 1.0))
  draft_probs = np.asarray(sampling.probs_from_logits(jnp.asarray(draft[0]), 1.0))
  alpha = float(theory.alpha(target_probs, draft_probs, lenience))
  n = np.asarray(out.stats.num_accepted)
  summary = metrics.summarize(out)
  np.testing.assert_allclose(summary["alpha_estimate"], alpha, rtol=1e-5)
  reached = np.minimum(n[n >= 0] + 1, gamma).sum()
  assert abs(summary["empirical_alpha"] - alpha) < 5 * np.sqrt(alpha * (1 - alpha) / reached)
  geometric = np.array([alpha ** k * (1 - alpha) for k in range(gamma)] + [alpha ** gamma])
  histogram = np.asarray(summary["acceptance_histogram"])
  assert stats.chisquare(histogram, geometric * histogram.sum()).pvalue > 1e-6
  lengths = np.arange(1, gamma + 2)
  sd = np.sqrt(geometric @ (lengths - geometric @ lengths) ** 2 / histogram.sum())
  assert abs(summary["mean_accepted_length"] - theory.expected_tokens(alpha, gamma)) < 5 * sd
  np.testing.assert_allclose(summary["conditional_acceptance"], alpha, atol=0.05)
  assert summary["row_target_calls"] == np.asarray(out.stats.target_calls).tolist()
  assert sum(summary["acceptance_histogram"]) == int(np.sum(n >= 0))


# ---------------------------------------------------------------------------------------------------
# (f) Compilations, (g) bad input.


def test_sweeping_traced_values_does_not_recompile():
  target, draft = _random_pair(0)
  fn = core.make_decode(bigram_model(), expansion.SampledChain(BigramDrafter(), 2),
                        core.DecodeConfig(max_new_tokens=5))
  prompt, lengths = pad_prompts([[1, 2], [3]])
  for i, (temperature, top_p, lenience) in enumerate(
      [(0, 1, 1), (0.5, 0.9, 1.0), (1.0, 1.0, 0.3), (np.float64(2.0), 0.5, 0.75), (0.0, 1.0, 0.5)]):
    jax.block_until_ready(fn(target, draft, prompt, lengths, jax.random.PRNGKey(i), temperature,
                             top_p, lenience))
  assert fn.jitted._cache_size() == 1


def test_bad_input():
  for gamma in [0, -1, 2.5]:
    with pytest.raises(ValueError, match="gamma"):
      expansion.SampledChain(BigramDrafter(), gamma)
  with pytest.raises(ValueError, match="top_k"):
    core.DecodeConfig(max_new_tokens=4, top_k=-1)
  with pytest.raises(ValueError, match="max_new_tokens"):
    core.DecodeConfig(max_new_tokens=0)

  target, draft = _random_pair(0)
  fn = core.make_decode(bigram_model(), expansion.SampledChain(BigramDrafter(), 2),
                        core.DecodeConfig(max_new_tokens=4))
  prompt, lengths = pad_prompts([[1, 2]])
  for lenience in [0.0, -0.5, 1.5, float("nan")]:
    with pytest.raises(ValueError, match="lenience"):
      fn(target, draft, prompt, lengths, jax.random.PRNGKey(0), 1.0, 1.0, lenience)
  with pytest.raises(ValueError, match="temperature"):
    fn(target, draft, prompt, lengths, jax.random.PRNGKey(0), -1.0)
  with pytest.raises(ValueError, match="top_p"):
    fn(target, draft, prompt, lengths, jax.random.PRNGKey(0), 1.0, 0.0)
  wide_draft = np.zeros((VOCAB, VOCAB + 2), np.float32)
  with pytest.raises(ValueError, match=f"target has {VOCAB} tokens, the drafter {VOCAB + 2}"):
    fn(target, wide_draft, prompt, lengths, jax.random.PRNGKey(0))
  wide_lookup = core.make_decode(
      bigram_model(), expansion.SampledChain(lookup.PromptLookupDrafter(VOCAB + 1), 2),
      core.DecodeConfig(max_new_tokens=4))
  with pytest.raises(ValueError, match="vocabulary sizes differ"):
    wide_lookup(target, None, prompt, lengths, jax.random.PRNGKey(0))


# ---------------------------------------------------------------------------------------------------
# Timing helpers the sweep's predictions rest on (values, not speed: no timing is asserted).


def test_loop_seconds_separates_the_per_prompt_cost_from_the_loop():
  iterations = [3, 10, 7, 25, 14]
  seconds = [0.004 + 0.0006 * n for n in iterations]
  per_iteration, fixed = timing.loop_seconds(seconds, iterations)
  assert per_iteration == pytest.approx(0.0006) and fixed == pytest.approx(0.004)
  # Every prompt ran the same number of iterations: the two parts cannot be told apart.
  assert timing.loop_seconds([0.01, 0.011, 0.012], [47, 47, 48]) is None
  assert timing.loop_seconds([0.01, 0.02], [3, 20]) is None  # two prompts fit any line
  # Noise of 17 iterations' cost on prompts 3-25 iterations long: no per-iteration figure is read
  # off it (the fit's standard error is 0.4 of the slope).
  noise = np.random.RandomState(0).normal(0, 0.01, len(iterations))
  assert timing.loop_seconds(np.asarray(seconds) + noise, iterations) is None
  # Noise a twentieth of that still gives the loop's cost.
  per_iteration, _ = timing.loop_seconds(np.asarray(seconds) + noise / 20, iterations)
  assert per_iteration == pytest.approx(0.0006, rel=0.25)


def test_iteration_costs_time_each_part_of_the_real_loop_body():
  # A table-model target (StepModel) with a model draft, both temperatures from one compile per part.
  target_params, step, init_cache, prompt_tokens, prompt_lengths, _ = _decoder_setup()
  drafter, draft_params = _greedy_drafter("random model", step, init_cache, target_params)
  drafter = expansion.SampledChain(drafter, 3)
  config = core.DecodeConfig(max_new_tokens=12)
  probe = (prompt_tokens[:1], prompt_lengths[:1])
  costs = timing.iteration_costs(StepModel(step, init_cache), target_params, drafter, draft_params,
                                 config, probe, 2, (0.0, 1.0))
  assert sorted(costs) == [0.0, 1.0]
  for parts in costs.values():
    assert sorted(parts) == ["accept", "draft", "verify"]
    assert all(np.isfinite(ms) and ms > 0 for ms in parts.values())
  only = timing.iteration_costs(StepModel(step, init_cache), target_params, drafter, draft_params,
                                config, probe, 2, (1.0,), parts=("draft",))
  assert list(only) == [1.0] and list(only[1.0]) == ["draft"]
