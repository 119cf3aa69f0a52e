"""`python -m specjax.plan --gin_file=configs/X.gin [--topology=v4-8]`: plan a decoding config's job
(specjax.plan) instead of running it: the same configs `python -m specjax.run` takes."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import gin
from absl import app, flags

from specjax import launch, plan

parse_gin = functools.partial(launch.parse_configs, functools.partial(
    gin.parse_config_files_and_bindings, finalize_config=False))


def configured_job():
  """The decoding job the parsed config binds (`run.main.job`), built with its bindings."""
  try:
    job = gin.query_parameter("run.main.job")
  except ValueError:
    job = None
  if not isinstance(job, gin.config.ConfigurableReference):
    raise ValueError("the config binds no job (run.main.job); a plan covers the decoding jobs "
                     "generation.Generate and the sweeps")
  return job.scoped_configurable_fn()


def configured_plan_spec() -> plan.PlanSpec:
  """plan.PlanSpec with the config's bindings, if it has any."""
  try:
    return gin.get_configurable(plan.PlanSpec)()
  except ValueError:  # the config does not mention plan.PlanSpec
    return plan.PlanSpec()


def main():
  flags.DEFINE_multi_string("gin_file", [], "The experiment config(s) to plan (configs/*.gin).")
  flags.DEFINE_multi_string("gin_bindings", [], "Extra bindings, e.g. \"plan.PlanSpec.dtypes = "
                            "('bfloat16',)\".")
  flags.DEFINE_string("topology", None, "A TPU slice (v4-8, v5p-64, v5e-16, v4:2x2x1); default: this "
                      "machine's devices (simulated on CPU).")
  flags.DEFINE_multi_string("dtype", [], "Parameter / cache dtypes to plan (float32, bfloat16).")
  flags.DEFINE_float("memory_gib", None, "Per-device memory to fit in (default: the TPU's HBM).")
  flags.DEFINE_string("output_dir", None, "Where plan.md / plan.json go (default out/plan/<config>).")
  flags.DEFINE_bool("strict_sharding", None, "Refuse dimensions the mesh axis does not divide.")
  flags.DEFINE_multi_string("program", [],
                            f"Programs to compile (default all): {', '.join(plan.PROGRAMS)}.")

  def plan_entry(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS.gin_file:
      raise app.UsageError("pass --gin_file=configs/<experiment>.gin (see configs/)")
    parse_gin(flags.FLAGS.gin_file, flags.FLAGS.gin_bindings)
    spec = configured_plan_spec()  # with the config's plan.PlanSpec bindings, then the flags
    overrides = {"topology": flags.FLAGS.topology, "memory_gib": flags.FLAGS.memory_gib,
                 "strict_sharding": flags.FLAGS.strict_sharding,
                 "dtypes": tuple(flags.FLAGS.dtype) or None,
                 "programs": tuple(flags.FLAGS.program) or None}
    spec = dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    output_dir = flags.FLAGS.output_dir or str(
        pathlib.Path("out/plan") / (pathlib.Path(flags.FLAGS.gin_file[-1]).stem
                                    + (f"-{spec.topology}" if spec.topology else "")))
    plan.run_plan(configured_job(), spec, output_dir)

  app.run(plan_entry)


if __name__ == "__main__":
  main()
