"""Run in a subprocess with the libtpu wheel on its path (tests/test_plan.py): plans compiled by the
TPU compiler for TPU topologies, on this CPU machine. A tiny T5 pair fits a v4-8; Llama 2 7B in
float32 (27 GB of weights) does not fit one v5e chip (16 GiB): the compiler's out-of-memory error
becomes a "does not fit" row with its figures."""

import jax

from specjax import plan
from specjax.plan import devices as devices_lib, workload
from specjax.models import decoder_only, t5

jax.config.update("jax_platforms", "cpu")  # the TPU compiler needs no TPU


def main():
  devices = devices_lib.tpu_devices("v4-8")
  assert len(devices.devices) == 4 and devices.tpu and devices.memory_bytes == 32 * plan.GIB
  tiny = workload.Workload(target=t5.SIZES["tiny"], drafts=(("draft", t5.SIZES["tiny"]),),
                       mesh_shape=(1, 4), batch=1, prompt_length=16, max_new_tokens=8, gamma=3)
  result = plan.plan(tiny, devices, "bfloat16")
  assert result["fits"] is True, result
  assert [row["program"] for row in result["rows"]] == [
      "prefill", "verify", "prefill", "draft step", "loop"]
  assert all(row["peak"] > 0 and row["flops"] for row in result["rows"]), result["rows"]
  print("tiny T5 pair on v4-8: compiled by the TPU compiler, fits")

  big = workload.Workload(target=decoder_only.SIZES["llama2-7b"], drafts=(), mesh_shape=(1, 1),
                      batch=1, prompt_length=8, max_new_tokens=8, gamma=0)
  result = plan.plan(big, devices_lib.tpu_devices("v5e-1"), "float32", programs=("decode step",))
  (row,) = result["rows"]
  assert result["fits"] is False and "RESOURCE_EXHAUSTED" in row["note"], row
  assert row["peak"] > 16 * plan.GIB, row  # the compiler's own figure, parsed from its error
  print(f"llama2-7b float32 on one v5e chip: does not fit ({row['peak'] / plan.GIB:.1f} GiB needed)")


if __name__ == "__main__":
  main()
