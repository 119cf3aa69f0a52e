"""What every command-line entry point does around its job (`python -m specjax.run`, `specjax.train`,
`specjax.plan`): flags, parsing the configs, the persistent compilation cache, joining a multi-process
run, and the operative config written beside the results.

The entry points own gin (DESIGN.md: the library is plain Python); they hand this module the two gin
calls it needs (`parse`, and the operative config) so that nothing here imports gin.
"""

from __future__ import annotations

import os
import pathlib
from typing import Callable

import jax
from absl import app, flags, logging

from specjax import assets, validation

_operative_config: Callable[[], str] = lambda: ""


def operative_config() -> str:
  """The config as parsed and used so far, written beside a run's results (empty outside a config
  run): the entry point registers gin's `config_str` in `cli`."""
  return _operative_config()


def parse_configs(parse: Callable, files, bindings) -> None:
  """Parse config files and bindings with `parse` (gin's parser); a missing file is named first,
  with the configs that exist."""
  for file in files:
    if not pathlib.Path(file).is_file():
      known = sorted(str(p) for p in pathlib.Path("configs").glob("**/*.gin"))
      raise FileNotFoundError(f"no gin config {file}; configs here: {', '.join(known) or 'none'}")
  parse(files, bindings)


def enable_compilation_cache(path: str | os.PathLike | None = None,
                             min_compile_seconds: float = 1.0) -> str:
  """Persist compiled programs across processes (XLA's own cache, keyed by the program, the compiler
  and the devices): a sweep compiles a loop per drafter and shape and spends much of its time
  compiling on CPU. Programs that compile in under `min_compile_seconds` are not stored. path:
  default $JAX_COMPILATION_CACHE_DIR if set, else $SPECJAX_CACHE/xla. Returns the directory."""
  path = path or os.environ.get("JAX_COMPILATION_CACHE_DIR") or assets.cache_dir() / "xla"
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  return str(path)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, auto: bool = False) -> bool:
  """Join a multi-process run (one process per host) before anything touches a device.

  Explicitly: the coordinator's host:port, the process count and this process's id, from these
  arguments or the environment (JAX_COORDINATOR_ADDRESS, SPECJAX_NUM_PROCESSES, SPECJAX_PROCESS_ID).
  auto=True (`--distributed`): as the cluster says, e.g. on every worker of a Cloud TPU pod slice.
  Neither: a single process (returns False). Then every process runs the same job on one global
  mesh; process 0 alone writes results."""
  environ = os.environ
  coordinator_address = coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS") or None
  if num_processes is None:
    num_processes = validation.env_int("SPECJAX_NUM_PROCESSES", 1, environ)
  if process_id is None:
    process_id = validation.env_int("SPECJAX_PROCESS_ID", 0, environ)
  if num_processes is not None and process_id is not None and process_id >= num_processes:
    raise ValueError(f"SPECJAX_PROCESS_ID={process_id} is not below SPECJAX_NUM_PROCESSES="
                     f"{num_processes}: ids run from 0 to {num_processes - 1}")
  if coordinator_address is None and not auto:
    if (num_processes or 1) > 1 or process_id:
      raise ValueError(f"SPECJAX_NUM_PROCESSES={num_processes} / SPECJAX_PROCESS_ID={process_id} ask "
                       "for a multi-process run but no coordinator is set: set "
                       "JAX_COORDINATOR_ADDRESS=host:port (process 0's host, the same on every "
                       "process), or pass --distributed on a cluster that says it itself (a Cloud "
                       "TPU pod slice); unset both for a single process")
    return False
  if coordinator_address is not None and (num_processes is None or process_id is None):
    raise ValueError(f"a multi-process run with coordinator {coordinator_address} needs the process "
                     "count and this process's id: set SPECJAX_NUM_PROCESSES and SPECJAX_PROCESS_ID, "
                     "or pass --distributed on a cluster that says them itself (a Cloud TPU pod "
                     "slice)")
  jax.distributed.initialize(coordinator_address, num_processes, process_id)
  logging.info("process %d of %d: %d local devices of %d", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True


def cli(run_job: Callable[[], object], parse: Callable, config_text: Callable[[], str],
        example: str) -> None:
  """`python -m <entry point> --gin_file=... [--gin_bindings=...]`: parse the configs with `parse`,
  then call `run_job` (which runs what they bind). config_text: the operative config (gin's
  config_str). example: a config path for the usage error."""
  global _operative_config  # pylint: disable=global-statement
  _operative_config = config_text
  flags.DEFINE_multi_string("gin_file", [], "Gin config files (configs/*.gin).")
  flags.DEFINE_multi_string("gin_bindings", [], "Extra bindings, e.g. "
                            "\"specs.DecodeSpec.temperature = 1.0\".")
  flags.DEFINE_bool("distributed", False, "Join a multi-process run as the cluster describes it "
                    "(run the same command on every worker of a TPU pod slice).")
  flags.DEFINE_bool("compilation_cache", True, "Keep compiled XLA programs on disk "
                    "($SPECJAX_CACHE/xla, or $JAX_COMPILATION_CACHE_DIR) so a rerun loads them.")

  def entry(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS.gin_file:
      raise app.UsageError(f"pass --gin_file={example}")
    parse_configs(parse, flags.FLAGS.gin_file, flags.FLAGS.gin_bindings)
    if flags.FLAGS.compilation_cache:
      enable_compilation_cache()
    initialize_distributed(**({"auto": True} if flags.FLAGS.distributed else {}))
    run_job()

  app.run(entry)
