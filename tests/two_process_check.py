"""One of two processes (tests/test_multiprocess.py starts both): 4 simulated CPU devices each, one
global ('data' 2, 'model' 4) mesh over both, gloo collectives. Runs `generation.Generate` with speculative
decoding (a T5 target and a T5 draft, both sharded on that mesh) greedy and at temperature 0.8.

argv: <target dir> <draft dir> <prompts.jsonl> <output base dir>. The environment names the
coordinator and this process (JAX_COORDINATOR_ADDRESS, SPECJAX_NUM_PROCESSES, SPECJAX_PROCESS_ID)."""

import os
import sys

# Appended: the suite's compile flags (tests/conftest.py) reach this process too.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402  pylint: disable=wrong-import-position

from specjax import generation, launch, specs  # noqa: E402  pylint: disable=wrong-import-position

SETTINGS = (("greedy", 0.0), ("sampled", 0.8))
MESH = (2, 4)


def generate(target_dir, draft_dir, prompts, output_dir, temperature, mesh_shape):
  """The decode both this check and the single-process reference run."""
  return generation.Generate(
      output_dir=output_dir, target=specs.ModelSpec(checkpoint=target_dir),
      prompts=specs.PromptSpec(name=prompts, split="all", limit=None, batch_size=2, bucket=8),
      decode=specs.DecodeSpec(max_new_tokens=12, temperature=temperature), mesh_shape=mesh_shape,
      drafter=f"model:{draft_dir}", gamma=3, seed=0)()


def main():
  target_dir, draft_dir, prompts, output_base = sys.argv[1:]
  assert launch.initialize_distributed(), "the environment names no coordinator"
  assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.devices())
  for name, temperature in SETTINGS:
    generate(target_dir, draft_dir, prompts, os.path.join(output_base, name), temperature, MESH)
    print(f"process {jax.process_index()}: {name} done", flush=True)


if __name__ == "__main__":
  main()
