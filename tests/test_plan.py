"""specjax.plan: per-device figures equal what a run allocates (8 simulated devices, a subprocess:
tests/plan_check.py), the paper configs' workloads and parameter bytes against hand arithmetic, and
the errors a researcher can run into before a pod starts."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import gin
import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

from conftest import run_check_on_8_devices
from specjax import models, plan
from specjax.plan import __main__ as plan_cli
from specjax.plan import devices, workload


def test_plan_equals_what_a_run_allocates_and_seventy_b_does_not_fit_on_two_devices():
  stdout = run_check_on_8_devices("plan_check.py")
  assert stdout.count("as allocated") == 2, stdout
  assert "loop: arguments and temporaries as compiled from placed arrays" in stdout
  assert "70B on 2 devices: does not fit" in stdout
  assert "errors: mesh sizes, strict sharding" in stdout


ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBTPU = ROOT / ".venv" / "libtpu"  # `scripts/setup.sh test` installs the TPU compiler here


@pytest.mark.slow  # the TPU compiler on 2 CPU cores: about a minute
def test_tpu_compiler_plans_topologies_and_reports_out_of_memory():
  assert (LIBTPU / "libtpu").is_dir(), "`bash scripts/setup.sh test` installs libtpu into .venv/libtpu"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [LIBTPU, ROOT / "tests", ROOT]))}
  done = subprocess.run([sys.executable, str(ROOT / "tests" / "tpu_plan_check.py")], env=env,
                        capture_output=True, text=True, timeout=900, check=False)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "tiny T5 pair on v4-8: compiled by the TPU compiler, fits" in done.stdout
  assert "llama2-7b float32 on one v5e chip: does not fit" in done.stdout


def _workload(config_file, *bindings):
  gin.clear_config()
  plan_cli.parse_gin([config_file], list(bindings))
  try:
    spec = plan_cli.configured_plan_spec()  # with the config's bindings
    return workload.of_job(plan_cli.configured_job(), spec.target_size, spec.draft_sizes,
                           spec.prompt_length)
  finally:
    gin.clear_config()


def test_paper_configs_plan_the_papers_models():
  ende = _workload("configs/paper/leviathan_table2_ende.gin")
  assert models.size_name(ende.target) == "t5.1.1-xxl"
  assert [models.size_name(c) for _, c in ende.drafts] == ["t5.1.1-small", "t5.1.1-base", "t5.1.1-large"]
  assert (ende.mesh_shape, ende.batch, ende.gamma, ende.max_new_tokens) == ((1, 4), 1, 8, 64)
  chen = _workload("configs/paper/chen_table1_xsum_humaneval.gin")
  assert models.size_name(chen.target) == "llama2-70b" and chen.mesh_shape == (1, 16)
  assert [models.size_name(c) for _, c in chen.drafts] == ["chen-4b-draft"] and chen.gamma == 4
  batched = _workload("configs/paper/batch64_v5p64.gin")
  assert (batched.mesh_shape, batched.batch, batched.gamma) == ((4, 8), 64, 4)
  assert [models.size_name(c) for _, c in batched.drafts] == ["chen-4b-draft"]
  lenience = _workload("configs/paper/leviathan_table5_lenience.gin")
  assert lenience.skipped == ("unigram", "bigram")  # tables: nothing to compile


def test_a_plan_compiles_at_the_dtype_the_run_decodes_in():
  assert _workload("configs/paper/leviathan_table2_ende.gin").dtype == "float32"
  assert _workload("configs/paper/leviathan_table2_ende.gin",
                   "specs.ModelSpec.dtype = 'bfloat16'").dtype == "bfloat16"
  assert plan.PlanSpec().dtypes is None  # run_plan then plans (workload.dtype,)


@pytest.mark.parametrize("size, model_axis, billions", [
    ("t5.1.1-xxl", 4, 11.14), ("llama2-70b", 16, 68.98), ("chen-4b-draft", 16, 4.02),
    ("llama2-70b", 8, 68.98)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parameter_bytes_per_device_equal_hand_arithmetic(size, model_axis, billions, dtype):
  config = models.config_by_name(size)
  count = sum(leaf.size for leaf in jax.tree_util.tree_leaves(models.param_shapes(config)))
  assert abs(count / 1e9 - billions) < 0.01  # the published sizes
  mesh = AbstractMesh((1, model_axis), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  per_device = plan.per_device_bytes(plan.abstract_params(config, mesh, plan.DTYPES[dtype]))
  by_hand = count * {"float32": 4, "bfloat16": 2}[dtype] / model_axis  # everything split N ways
  assert abs(per_device - by_hand) <= 0.01 * by_hand, (per_device, by_hand)


def test_unknown_topology_is_named():
  for name in ["v9-8", "v4", "tpu-v4-8", "v4:2x2"]:
    with pytest.raises(ValueError, match="unknown TPU topology"):
      devices.tpu_devices(name)
  with pytest.raises(ValueError, match="v4 slices here: v4-2, v4-8"):
    devices.tpu_devices("v4-12")


def test_tpu_topology_without_libtpu_names_the_extra(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *args: None if name == "libtpu" else real(name, *args))
  with pytest.raises(RuntimeError, match=r"pip install -e '\.\[tpu\]'"):
    devices.tpu_devices("v4-8")


def test_unreadable_architecture_names_the_binding():
  with pytest.raises(ValueError, match="plan.PlanSpec.target_size"):
    _workload("configs/paper/leviathan_table3_lm1b.gin")
  with pytest.raises(ValueError, match="draft_sizes names 2 architectures but the config has 1"):
    _workload("configs/paper/chen_table1_xsum_humaneval.gin",
              "plan.PlanSpec.draft_sizes = ('chen-4b-draft', 'llama2-7b')")
  with pytest.raises(ValueError, match="unknown architecture 'llama-70b'"):
    _workload("configs/paper/chen_table1_xsum_humaneval.gin",
              "plan.PlanSpec.target_size = 'llama-70b'")


def test_a_training_config_is_not_planned():
  with pytest.raises(ValueError, match="binds no job|covers the decoding jobs"):
    _workload("configs/smollm2_draft.gin")
