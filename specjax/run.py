"""THE decoding entry point: `python -m specjax.run --gin_file=configs/X.gin [--gin_bindings='...']`.

Gin wires the experiment; the library stays plain Python. A config names its job, a frozen dataclass
that runs when called, and binds it and the specs it takes (see configs/smollm2_generate.gin):

    from __gin__ import dynamic_registration
    from specjax import generation, run, specs
    run.main.job = @generation.Generate()
    generation.Generate.output_dir = "out/smollm2_generate"
    generation.Generate.prompts = @specs.PromptSpec()
    specs.PromptSpec.name = "humaneval"

Jobs: `generation.Generate` (decode a prompt set, target alone or speculatively) and the sweeps of
`experiments/` (`speculative_sweep.Sweep`, `tree_sweep.TreeSweep`). `python -m specjax.plan` reads
the same configs and plans the job instead of running it. Training jobs run with `python -m
specjax.train`.
"""

from __future__ import annotations

import functools

import gin

from specjax import launch

parse_gin = functools.partial(launch.parse_configs, functools.partial(
    gin.parse_config_files_and_bindings, finalize_config=False))


@gin.configurable
def main(job=None):
  """What `python -m specjax.run` runs: the job the config binds, e.g.
  `run.main.job = @generation.Generate()` or `@speculative_sweep.Sweep()`."""
  if job is None:
    raise ValueError("the config names no job: bind one, e.g. `run.main.job = @generation.Generate()` "
                     "(see configs/smollm2_generate.gin and configs/smollm2_default.gin)")
  return job()


def cli():
  launch.cli(lambda: gin.get_configurable(main)(), parse_gin, gin.config_str,
             "configs/<experiment>.gin (see configs/)")


if __name__ == "__main__":
  # Configs import `specjax.run`; run that module's functions, not this __main__ copy of them, so gin
  # bindings and flags exist once.
  from specjax import run as _module  # pylint: disable=import-self
  _module.cli()
