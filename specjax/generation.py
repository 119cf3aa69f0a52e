"""The generation job: decode a prompt set with the target, alone or speculatively, one row per prompt.

`Generate` checks its inputs (settings, prompt set and every prompt's tokens, checkpoint, tokenizer and
vocabulary, drafter, whether the decode fits the machine) before it writes anything; then it holds its output directory (specjax.outputs.RunDirectory: one run at a time) and writes
config.gin (the operative config), spec.json (the resolved specs and the content keys of the models)
and environment.json, then generations.jsonl, one row per prompt written as its batch finishes (one
writer: locked, torn tail cut and saved aside, duplicate keys refused), and summary.json. A directory
that holds results of a different spec (weights changed behind the same path included) is refused,
never mixed; the spec holds a digest of the prompts used, so a prompt file edited in place is a
different spec too. Rerunning the same spec resumes, skipping finished prompts; each prompt draws from
its own key (seed, prompt id) in a batch fixed by the prompt set, so a resumed sampled run writes
the tokens an uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import time

import jax
import numpy as np
from absl import logging
from tqdm import tqdm

from specjax import launch, loading, outputs, sharding, validation
from specjax.data import prompts as prompt_sets
from specjax.decoding import autoregressive, core, sampling
from specjax.decoding.tree import Tree
from specjax.drafters import registry
from specjax.specs import DecodeSpec, ModelSpec, PromptSpec


# How a prompt's random numbers are drawn, in the spec (so in the fingerprint): rows drawn another way
# (one key per batch, before) are not resumed into one file with these.
RANDOM_KEYS = "each prompt its own key: fold_in(PRNGKey(seed), hash of its id)"


@dataclasses.dataclass(frozen=True)
class Generate:
  """Decode a prompt set with the target (or speculatively, with `drafter` proposing `gamma` tokens:
  the same tokens, sooner); write one row per prompt, timings and a summary."""
  output_dir: str = "out/smollm2_generate"
  target: ModelSpec = ModelSpec()
  prompts: PromptSpec = PromptSpec()
  decode: DecodeSpec = DecodeSpec()
  mesh_shape: tuple = (1, 1)
  seed: int = 0
  drafter: str | None = None
  gamma: int = 4

  def __call__(self) -> dict:
    target, prompts, decode = self.target, self.prompts, self.decode
    # Everything that can fail on bad input fails here, before the output directory is touched:
    # the settings, the prompts (read, checked and tokenized: each refusal names the prompt's id),
    # the checkpoint and its vocabulary, the drafter's, and whether the decode fits this machine.
    mesh_shape = validation.check_mesh_shape(self.mesh_shape, "Generate.mesh_shape")
    validation.whole_number(self.seed, "Generate.seed", 0)
    tree = None
    if self.drafter is not None:
      tree = Tree.chain(self.gamma)  # refuses a gamma that is not a whole number in range
      registry.check_tree(self.drafter, tree)
    prompt_set = prompt_sets.prompt_set_for_run(prompts.name, prompts.split, prompts.limit,
                                                prompts.style, "PromptSpec.name")
    spec = {"target": dataclasses.asdict(target), "prompts": dataclasses.asdict(prompts),
            "decode": dataclasses.asdict(decode), "mesh_shape": list(self.mesh_shape),
            "seed": self.seed, "drafter": self.drafter,
            "gamma": self.gamma if self.drafter is not None else None,
            "prompt_digest": validation.prompt_digest(prompt_set), "random_keys": RANDOM_KEYS}
    spec["content_keys"] = loading.content_keys(target, registry.checkpoints_of(
        () if self.drafter is None else (self.drafter,)))
    loaded, mesh = loading.load_target(target, mesh_shape)
    tokenizer = loaded.tokenizer
    if self.drafter is not None:
      registry.check_vocabulary([self.drafter], tokenizer, target.checkpoint)
    encoded = [tokenizer.encode(text) for text in prompt_set.prompts]
    validation.check_token_lists(encoded, prompt_set.keys, prompt_set.name,
                                 prompts.max_prompt_length)
    longest = max(map(len, encoded))
    width = 1 if loaded.encoder_decoder else min(-(-longest // prompts.bucket) * prompts.bucket,
                                                 prompts.max_prompt_length)
    validation.check_decode_fits(
        loaded.model, loaded.config.vocab_size, min(prompts.batch_size, len(encoded)), width,
        decode.max_new_tokens, 1 if tree is None else tree.size,
        f"PromptSpec.batch_size={prompts.batch_size}, DecodeSpec.max_new_tokens="
        f"{decode.max_new_tokens}" + ("" if tree is None else f", Generate.gamma={self.gamma}"))
    program, params, settings = self._program(loaded, mesh)
    rng = jax.random.PRNGKey(self.seed)
    compiled = {}  # per padded prompt shape: compile ahead of time, outside the timed region
    with outputs.RunDirectory(self.output_dir, spec, "generations.jsonl", "spec_fingerprint",
                              launch.operative_config()) as run_dir, \
         outputs.RowsFile(run_dir.results, run_dir.fingerprint, "spec_fingerprint",
                          unique_key="key") as rows:
      done = {row.get("key") for row in rows.existing}
      # The batches are fixed by the prompt set (prompts 0..B-1, B..2B-1, ...), whatever ran before:
      # a batch with a prompt left to do runs whole (its finished rows are not written again), so a
      # resumed run decodes every prompt in the batch, with the key, it had in an uninterrupted one.
      size = prompts.batch_size
      batches = [list(range(i, min(i + size, len(prompt_set)))) for i in range(0, len(prompt_set),
                                                                                 size)]
      batches = [b for b in batches if any(prompt_set.keys[i] not in done for i in b)]
      for batch_index in tqdm(batches, desc="generate", unit="batch",
                              disable=jax.process_index() != 0):
        names = [prompt_set.keys[i] for i in batch_index]
        batch = loaded.batch_ids([encoded[i] for i in batch_index], prompts.bucket,
                                 prompts.max_prompt_length, names)
        keys = np.stack([np.asarray(sampling.prompt_key(rng, name)) for name in names])
        args = (*params, batch.prompt_tokens, batch.prompt_lengths, keys, *settings, batch.source)
        key = (batch.prompt_tokens.shape,
               None if batch.source is None else batch.source.tokens.shape)
        if key not in compiled:
          compiled[key] = program.lower(*args).compile()
        start = time.perf_counter()
        out = jax.block_until_ready(compiled[key](*args))
        seconds = time.perf_counter() - start
        # Every process reads the whole batch (rows may live on another host's devices).
        tokens, generated = sharding.to_host(out.tokens), sharding.to_host(out.num_generated)
        for row, i in enumerate(batch_index):
          if prompt_set.keys[i] in done:
            continue
          new = tokens[row, :int(generated[row])].tolist()
          rows.append({"key": prompt_set.keys[i], "prompt_tokens": int(_input_lengths(batch)[row]),
                       "new_tokens": new, "text": tokenizer.decode(new, skip_special=True),
                       "num_generated": len(new), "batch_seconds": seconds,
                       "batch_size": len(batch_index),
                       "target_calls": int(sharding.to_host(out.target_calls)) + 1})
      return _summarize(run_dir.path)

  def _program(self, loaded: loading.LoadedModel, mesh):
    """-> (jitted program, its leading params, its float settings): the program is called as
    program(*params, prompt_tokens, prompt_lengths, rng, *settings, source). The target alone, or
    speculative decoding with the named drafter (its params on the target's mesh)."""
    tokenizer, decode = loaded.tokenizer, self.decode
    if self.drafter is None:
      shape = autoregressive.DecodeShape(decode.max_new_tokens, decode.top_k, tokenizer.eos_id,
                                         tokenizer.pad_id)
      return (autoregressive.make_generate(loaded.model, shape), (loaded.params,),
              (np.float32(decode.temperature), np.float32(decode.top_p)))
    sequences = (prompt_sets.train_sequences(tokenizer, loaded.encoder_decoder, self.prompts.style)
                 if registry.needs_text([self.drafter]) else None)
    made, draft_params = registry.build(self.drafter, registry.Target(
        loaded.config, loaded.params, mesh if mesh.size > 1 else None, sequences),
        Tree.chain(self.gamma))
    config = core.DecodeConfig(decode.max_new_tokens, decode.top_k, tokenizer.eos_id,
                               tokenizer.pad_id)
    program = core.make_decode(loaded.model, made, config).jitted
    return (program, (loaded.params, draft_params),
            (np.float32(decode.temperature), np.float32(decode.top_p), np.float32(1.0)))


def _input_lengths(batch: loading.Batch) -> np.ndarray:
  """Tokens each row read: its prompt, or for an encoder-decoder model its source."""
  return np.asarray(batch.prompt_lengths if batch.source is None else batch.source.lengths)


def _summarize(output_dir: pathlib.Path) -> dict:
  records = outputs.read_rows(output_dir / "generations.jsonl")
  ms_per_token = [1000 * r["batch_seconds"] / max(1, r["target_calls"]) for r in records]
  summary = {
      "prompts": len(records),
      "tokens": sum(r["num_generated"] for r in records),
      "median_ms_per_target_call": statistics.median(ms_per_token) if records else None,
      "tokens_per_second": (sum(r["num_generated"] / r["batch_size"] for r in records)
                            / max(1e-9, sum(r["batch_seconds"] / r["batch_size"] for r in records))
                            if records else None),
  }
  if jax.process_index() == 0:
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  logging.info("summary: %s", summary)
  return summary
