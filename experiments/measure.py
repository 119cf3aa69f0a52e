"""Measuring speculative decoding on real hardware: drafters for a target, step costs, timed passes.

Shared by `benchmarks/speculative.py` and the sweeps behind `python -m specjax.run`, so both measure
the same way: ahead-of-time compilation outside the timed region, warm-up runs, medians, device-resident
draft tables, decode time with prefill subtracted (Thm 3.8 models decoding only).
"""

from __future__ import annotations

import functools
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import data, drafters, metrics, sampling, speculative
from specjax.models import decoder_only


def median_seconds(fn, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
  """Median wall time of fn() over `repeats` runs after `warmup` untimed runs; fn must block."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def ints(text):
  return [int(x) for x in str(text).split(",") if x]


# ---- setup ------------------------------------------------------------------------------------------

def train_sequences(tok):
  """Token ids of the train split of every prompt set, prompt + reference (the text a model writes)."""
  sequences = []
  for name in ("humaneval", "news", "ende"):
    split = data.load_prompt_set(name, "train")
    sequences += [tok.encode(p + (r or "")) for p, r in zip(split.prompts, split.references)]
  return sequences


def make_drafter(name: str, config, params, sequences=None, *, bigram_top_k: int = 64,
                 bigram_concentration: float = 1.0, lookup_ngram: int = 3,
                 lookup_min_ngram: int = 2):
  """A drafter by name for a decoder_only target -> (drafter, its params on the device).

  `lookup+<name>` puts prompt lookup (n-grams of lookup_min_ngram..lookup_ngram tokens) in front of
  any other drafter (LookupThenDrafter), e.g. `lookup+model:out/smollm2_draft/hf`.

  unigram / bigram: unigram / sparse top-K bigram counted on `sequences`; lookup: prompt lookup backed off to the unigram
  of `sequences`; layers{k}: the target's first k layers + final norm + tied head; model:<path>: a
  decoder-only checkpoint (.gguf or Hugging Face directory) sharing the target's vocabulary.
  """
  if name.startswith("lookup+"):
    inner, inner_params = make_drafter(
        name[len("lookup+"):], config, params, sequences, bigram_top_k=bigram_top_k,
        bigram_concentration=bigram_concentration, lookup_ngram=lookup_ngram)
    return (drafters.LookupThenDrafter(inner, drafters.PromptLookupDrafter(
        config.vocab_size, max_ngram=lookup_ngram, min_ngram=lookup_min_ngram)), inner_params)
  if name in ("bigram", "lookup", "unigram") and sequences is None:
    raise ValueError(f"the {name} drafter is counted on token sequences; pass sequences=")
  if name == "bigram":
    made = (drafters.SparseBigramDrafter(),
            drafters.sparse_bigram(sequences, config.vocab_size, bigram_top_k, bigram_concentration))
  elif name == "unigram":
    made = (drafters.UnigramDrafter(), drafters.unigram_table(sequences, config.vocab_size))
  elif name == "lookup":
    made = (drafters.PromptLookupDrafter(config.vocab_size, max_ngram=lookup_ngram),
            drafters.unigram_table(sequences, config.vocab_size))
  elif name.startswith("model:"):
    from specjax import checkpoints  # pylint: disable=import-outside-toplevel
    path = pathlib.Path(name[len("model:"):])
    if not path.exists():
      raise FileNotFoundError(
          f"no draft checkpoint at {path}; train one first (python -m specjax.train_draft "
          f"--gin_file=configs/smollm2_draft.gin writes out/smollm2_draft/hf; scripts/main.sh runs it)")
    draft_config, draft_params = checkpoints.load_decoder(path)
    if draft_config.vocab_size != config.vocab_size:
      raise ValueError(f"vocabulary sizes differ: the target has {config.vocab_size} tokens, the draft "
                       f"{name} {draft_config.vocab_size}; speculative decoding needs one vocabulary")
    made = (model_drafter(draft_config), draft_params)
  elif name.startswith("layers") and name[6:].isdigit():
    draft_config, draft_params = decoder_only.truncate_layers(config, params, int(name[6:]))
    made = (model_drafter(draft_config), draft_params)
  else:
    raise ValueError(f"unknown drafter {name!r}: use unigram, bigram, lookup, layers{{k}} (layers2), "
                     "lookup+<another drafter> or "
                     "model:<checkpoint path>")
  # On the device once: host (numpy) tables would be copied in on every call of a timed step.
  return made[0], jax.device_put(made[1])


def model_drafter(config):
  return drafters.ModelDrafter(decoder_only.make_step(config),
                               functools.partial(decoder_only.init_cache, config))


def load_prompts(tok, count, name="humaneval", style="chat", max_prompt_length=1024):
  """The first `count` held-out prompts of a set as batch-1 arrays padded to one shared length (one
  compiled program per set). Returns ([(tokens[1, P], lengths[1])], keys)."""
  heldout = data.load_prompt_set(name, "heldout", limit=count, style=style)
  tokens, lengths = data.make_batch([tok.encode(p) for p in heldout.prompts], tok.pad_id, bucket=32,
                                    max_prompt_length=max_prompt_length)
  return [(tokens[i:i + 1], lengths[i:i + 1]) for i in range(len(lengths))], list(heldout.keys)


# ---- timing -----------------------------------------------------------------------------------------

def time_passes(run_one, prompts, repeats, warmup):
  """Median over `repeats` of the summed wall time of run_one(tokens, lengths) over all prompts, after
  `warmup` untimed runs on the first prompt (warming a compiled program needs no full pass). run_one
  must block. Returns (seconds, per-pass seconds, the last pass's outputs)."""
  outputs = []
  for _ in range(warmup):
    run_one(*prompts[0])

  def one_pass():
    outputs.clear()
    outputs.extend(run_one(tokens, lengths) for tokens, lengths in prompts)

  seconds, passes = median_seconds(one_pass, repeats, warmup=0)
  return seconds, passes, list(outputs)


def prefill_seconds(target_step, target_init, drafter, target_params, draft_params, prompt,
                    max_length, repeats):
  """Median time of the work before the first token: the target's prefill (+ the drafter's init)."""
  def prefill(tp, dp, tokens, lengths):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    out = target_step(tp, tokens, positions, target_init(1, max_length))
    return out if drafter is None else (out, drafter.init(dp, tokens, lengths, max_length))
  compiled = jax.jit(prefill).lower(target_params, draft_params, *prompt).compile()
  return median_seconds(
      lambda: jax.block_until_ready(compiled(target_params, draft_params, *prompt)), repeats)[0]


def step_seconds(step_fn, params, state, tokens, positions, repeats):
  """Median wall time of one jitted step_fn(params, state, tokens, positions) -> (out, state), with
  the state donated and threaded through, as inside the loop (no cache copies)."""
  fn = jax.jit(step_fn, donate_argnums=1)
  _, state = jax.block_until_ready(fn(params, state, tokens, positions))  # compile + warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    _, state = jax.block_until_ready(fn(params, state, tokens, positions))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def transform(logits):
  return sampling.probs_from_logits(logits, 1.0)


def draft_step(drafter):
  """One draft step as the loop runs it: propose (transform included), then sample the token."""
  def fn(params, state, tokens, positions):
    probs, state = drafter.propose(params, state, tokens, positions, transform)
    return sampling.sample_with_uniform(jnp.full(probs.shape[:-1], 0.5), probs), state
  return fn


def target_step_fn(target_step):
  """The target scoring T tokens: step, transform at every position, sample the last."""
  def fn(params, cache, tokens, positions):
    logits, cache = target_step(params, tokens, positions, cache)
    probs = transform(logits)
    return sampling.sample_with_uniform(jnp.full((1,), 0.5), probs[:, -1]), cache
  return fn


def fresh_state(drafter, params, prompt, max_length):
  tokens, lengths = prompt
  return jax.jit(drafter.init, static_argnums=3)(params, tokens, lengths, max_length)


def one_token(prompt, width=1):
  """tokens[1, width] (the last prompt token repeated) at the positions right after the prompt."""
  tokens, lengths = prompt
  last = int(tokens[0, int(lengths[0]) - 1])
  return (jnp.full((1, width), last, jnp.int32),
          jnp.asarray(int(lengths[0]) + np.arange(width), jnp.int32)[None])


# ---- the runs ---------------------------------------------------------------------------------------

def summarize_outputs(outputs):
  """Per-prompt SpecOutputs -> metrics.summarize of them stacked as one batch."""
  stats = jax.tree_util.tree_map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]),
                                 *[o.stats for o in outputs])
  stacked = speculative.SpecOutput(
      tokens=np.concatenate([np.asarray(o.tokens) for o in outputs]),
      num_generated=np.concatenate([np.asarray(o.num_generated) for o in outputs]),
      target_calls=sum(int(o.target_calls) for o in outputs),
      draft_calls=sum(int(o.draft_calls) for o in outputs), stats=stats)
  return metrics.summarize(stacked)


def ms_per_token(seconds, prefill_s, num_prompts, new_tokens):
  """(decode ms per token after the first, end-to-end ms per token)."""
  decode = (seconds - num_prompts * prefill_s) / (num_prompts * (new_tokens - 1))
  return 1000 * decode, 1000 * seconds / (num_prompts * new_tokens)
