"""The gin entry point: every config parses and binds; a tiny real run end to end; resume and refusal."""

import json
import pathlib
import re

import gin
import jax
import numpy as np
import pytest

from specjax import checkpoints, outputs, run

CONFIG_DIR = pathlib.Path(__file__).parent.parent / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("**/*.gin"))


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses_and_binds(config):
  """The paper configs name checkpoints that are not here: parsing and binding is what can be checked.
  Every config names its job (`run.main.job`: a decoding job, built here with every binding it has;
  `train.main.job`: a training function, whose bound specs are built)."""
  run.parse_gin([str(config)], [])
  if "train.main.job" in _with_includes(config):
    job = gin.query_parameter("train.main.job")
    bound = gin.get_bindings(job.selector)
    assert {"output_dir", "training"} <= set(bound)
    for value in bound.values():  # every binding names a real field
      if isinstance(value, gin.config.ConfigurableReference) and value.evaluate:
        value.scoped_configurable_fn()
    return
  job = gin.query_parameter("run.main.job").scoped_configurable_fn()
  for name in ("output_dir", "target", "prompts", "decode"):
    assert hasattr(job, name)


def _with_includes(config: pathlib.Path) -> str:
  text = config.read_text()
  for included in re.findall(r'^include "([^"]+)"', text, flags=re.M):
    text += _with_includes(CONFIG_DIR.parent / included)
  return text


def _tiny(tmp_path, *extra):
  run.parse_gin([str(CONFIG_DIR / "smollm2_generate.gin")], [
      f"generation.Generate.output_dir = '{tmp_path}'", "specs.PromptSpec.limit = 2",
      "specs.PromptSpec.batch_size = 2", "specs.DecodeSpec.max_new_tokens = 6", *extra])
  return gin.get_configurable(run.main)()


def test_smoke_real_run_writes_everything_and_resumes(tmp_path):
  summary = _tiny(tmp_path)
  assert summary["prompts"] == 2 and 2 <= summary["tokens"] <= 12
  for name in ("config.gin", "spec.json", "environment.json", "generations.jsonl", "summary.json"):
    assert (tmp_path / name).is_file(), name
  rows = [json.loads(l) for l in (tmp_path / "generations.jsonl").read_text().splitlines()]
  assert [r["key"] for r in rows] == ["HumanEval/7", "HumanEval/14"]
  assert all(1 <= r["num_generated"] <= 6 and r["text"] for r in rows)
  assert json.loads((tmp_path / "spec.json").read_text())["decode"]["max_new_tokens"] == 6
  gin.clear_config()
  _tiny(tmp_path)  # same spec again: nothing left to do, no duplicate rows
  assert len((tmp_path / "generations.jsonl").read_text().splitlines()) == 2


def test_output_dir_with_rows_of_another_config_is_refused(tmp_path):
  (tmp_path / "generations.jsonl").write_text('{"key": "x", "spec_fingerprint": "0123"}\n')
  with pytest.raises(ValueError, match="holds 1 rows of another config"):
    _tiny(tmp_path)
  assert not (tmp_path / "spec.json").exists()  # refused before writing anything


def test_unknown_binding_and_missing_checkpoint_are_clear(tmp_path):
  with pytest.raises(ValueError, match="no_such_parameter"):
    _tiny(tmp_path, "specs.DecodeSpec.no_such_parameter = 3")
  gin.clear_config()
  with pytest.raises(FileNotFoundError, match="does not exist"):
    _tiny(tmp_path / "x", "specs.ModelSpec.checkpoint = '/nonexistent/model.gguf'")
  gin.clear_config()
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    _tiny(tmp_path / "y", "specs.DecodeSpec.temperature = -1.0")


def _tiny_sweep(tmp_path, *extra, target=None):
  """The main job's sweep (configs/smollm2_default.gin) on a small grid; `target`: another checkpoint."""
  run.parse_gin([str(CONFIG_DIR / "smollm2_default.gin")], [
      f"speculative_sweep.Sweep.output_dir = '{tmp_path}'",
      *([f"specs.ModelSpec.checkpoint = '{target}'"] if target else []), "specs.DecodeSpec.max_new_tokens = 8",
      "speculative_sweep.SweepSpec.tasks = ('humaneval',)",
      "speculative_sweep.SweepSpec.drafters = ('lookup',)",
      "speculative_sweep.SweepSpec.gammas = (3,)",
      "speculative_sweep.SweepSpec.temperatures = (0.0, 1.0)",
      "speculative_sweep.SweepSpec.leniences = (1.0, 0.5)",
      "speculative_sweep.SweepSpec.lenience_gammas = (3,)",
      "speculative_sweep.SweepSpec.prompts_per_task = 1", *extra])
  return gin.get_configurable(run.main)()


def test_smoke_sweep_writes_rows_tables_and_plots(tmp_path, smollm2_two_blocks):
  """The main job's sweep end to end on a 2-block SmolLM2 (the notebook's test runs it on the whole
  model): rows, tables, plots, resuming, and refusing rows measured another way."""
  rows = _tiny_sweep(tmp_path, target=smollm2_two_blocks)
  weight_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(
      checkpoints.load(smollm2_two_blocks)[1]))
  # 2 temperatures lossless + 2 at l = 0.5, all of one gamma: one compiled loop and one part timer
  # serve every point (temperature and lenience are traced)
  assert len(rows) == 4
  for row in rows:
    assert 0.0 <= row["alpha"] <= 1.0 and row["speedup"] > 0 and row["c"] > 0
    assert 1.0 <= row["tokens_per_target_call"] <= row["gamma"] + 1
    assert sorted(row["iteration_ms"]) == ["accept", "draft", "verify"]
    assert min(row["iteration_ms"].values()) > 0 and row["predicted_speedup_from_costs"] > 0
    assert row["read_bandwidth_gbps"] > 0 and row["target_step_floor_ms"] == pytest.approx(
        1000 * weight_bytes / (row["read_bandwidth_gbps"] * 1e9), rel=1e-6)
    if row["temperature"] == 0.0 and row["lenience"] == 1.0:
      assert row["outputs_match_baseline"] is True  # greedy speculative == greedy baseline
  assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4
  assert "alpha" in (tmp_path / "tables.md").read_text()
  step, floor = rows[0]["target_step_ms"], rows[0]["target_step_floor_ms"]
  assert f"{step:.1f} ({floor:.1f})" in (tmp_path / "tables.md").read_text()
  assert (tmp_path / "speedup_vs_gamma.png").stat().st_size > 1000
  gin.clear_config()
  assert len(_tiny_sweep(tmp_path, target=smollm2_two_blocks)) == 4  # a rerun resumes: nothing measured twice, no new rows
  assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4
  # The same directory as a sweep measured before methods were recorded left it: refused, not mixed.
  _as_if_measured_before_methods_were_recorded(tmp_path)
  gin.clear_config()
  with pytest.raises(ValueError, match="measurement: the rows were drawn or timed by an earlier"):
    _tiny_sweep(tmp_path, target=smollm2_two_blocks)


def _as_if_measured_before_methods_were_recorded(run_dir):
  """Rewrite a finished sweep's spec.json and rows' fingerprints without the "measurement" field."""
  spec = json.loads((run_dir / "spec.json").read_text())
  del spec["measurement"]
  (run_dir / "spec.json").write_text(json.dumps(spec))
  fingerprint = outputs.digest(outputs.without_none(spec))
  rows = [dict(json.loads(line), sweep_fingerprint=fingerprint)
          for line in (run_dir / "results.jsonl").read_text().splitlines()]
  (run_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sweep_refuses_gamma_below_one(tmp_path):
  with pytest.raises(ValueError, match="gamma"):
    _tiny_sweep(tmp_path, "speculative_sweep.SweepSpec.gammas = (0, 2)")
  assert not (tmp_path / "results.jsonl").exists()


def _tiny_tree_sweep(tmp_path, *extra, target=None):
  run.parse_gin([str(CONFIG_DIR / "smollm2_trees.gin")], [
      f"tree_sweep.TreeSweep.output_dir = '{tmp_path}'",
      *([f"specs.ModelSpec.checkpoint = '{target}'"] if target else []), "specs.DecodeSpec.max_new_tokens = 8",
      "tree_sweep.TreeSweepSpec.drafters = ('lookup',)",
      "tree_sweep.TreeSweepSpec.trees = ('spine:2x2',)",
      "tree_sweep.TreeSweepSpec.temperatures = (0.0, 1.0)",
      "tree_sweep.TreeSweepSpec.prompts_per_task = 1", *extra])
  return gin.get_configurable(run.main)()


def test_smoke_tree_sweep_writes_rows_and_table_and_resumes(tmp_path, smollm2_two_blocks):
  """The tree sweep (configs/smollm2_trees.gin) end to end on a 2-block SmolLM2."""
  rows = _tiny_tree_sweep(tmp_path, target=smollm2_two_blocks)
  assert [(r["tree"], r["temperature"]) for r in rows] == [("spine:2x2", 0.0), ("spine:2x2", 1.0)]
  for row in rows:
    assert 1.0 <= row["tokens_per_target_call"] <= row["tree_depth"] + 1
    assert row["tree_size"] == 5 and row["decode_speedup"] > 0 and row["predicted_speedup"] > 0
    assert row["cost_verify"] > 0 and row["cost_draft"] > 0 and row["cost_accept"] > 0
    # calls that kept k = 0 .. depth candidates; each commits k + 1 tokens unless EOS or the token
    # budget cuts it, so the histogram's mean bounds tokens per call from above
    histogram = np.asarray(row["accepted_histogram"])
    assert len(histogram) == row["tree_depth"] + 1 and histogram.sum() > 0
    kept = (histogram * np.arange(1, len(histogram) + 1)).sum() / histogram.sum()
    assert kept >= row["tokens_per_target_call"] - 1e-9
  assert rows[0]["outputs_match_baseline"] is True  # greedy tree decode == greedy baseline
  assert (tmp_path / "accepted_per_call.png").stat().st_size > 0
  # the kind column is registry.label(name): "prompt lookup" for `lookup`
  assert "| prompt lookup | lookup | spine:2x2 (5) | 0 |" in (tmp_path / "trees.md").read_text()
  gin.clear_config()
  assert _tiny_tree_sweep(tmp_path, target=smollm2_two_blocks) == rows  # a rerun resumes: nothing measured twice
  _as_if_measured_before_methods_were_recorded(tmp_path)
  gin.clear_config()
  with pytest.raises(ValueError, match="measurement: the rows were drawn or timed by an earlier"):
    _tiny_tree_sweep(tmp_path, target=smollm2_two_blocks)


def test_tree_sweep_refuses_missing_heads_before_writing(tmp_path):
  with pytest.raises(FileNotFoundError, match="configs/smollm2_heads.gin"):
    _tiny_tree_sweep(tmp_path, f"tree_sweep.TreeSweepSpec.drafters = ('heads:{tmp_path}/none',)")
  gin.clear_config()
  with pytest.raises(FileNotFoundError, match="smollm2_mtp.gin"):
    _tiny_tree_sweep(tmp_path, f"tree_sweep.TreeSweepSpec.drafters = ('lookup+mtp:{tmp_path}/x',)")
  with pytest.raises(ValueError, match="spine:DxW"):
    gin.clear_config()
    _tiny_tree_sweep(tmp_path, "tree_sweep.TreeSweepSpec.trees = ('spine:3',)")
  assert not (tmp_path / "results.jsonl").exists()


def test_compilation_cache_serves_a_second_process(tmp_path):
  """enable_compilation_cache: the first process stores the program, the second one loads it (JAX's
  own hit counter) and computes the same value; run in child processes so this one's JAX config is
  left alone."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  script = """
import jax, jax.numpy as jnp
from specjax import launch
hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
print(launch.enable_compilation_cache(__import__("sys").argv[1], min_compile_seconds=0.0))
f = jax.jit(lambda x: jnp.cumsum(jnp.sin(x) @ x.T, axis=0).sum())
print(float(f(jnp.arange(64.0).reshape(8, 8))), len(hits))
"""
  runs = [subprocess.run([sys.executable, "-c", script, str(tmp_path / "xla")], check=True,
                         capture_output=True, text=True, cwd=CONFIG_DIR.parent).stdout.split()
          for _ in range(2)]
  assert runs[0][0] == str(tmp_path / "xla") and any((tmp_path / "xla").iterdir())
  assert runs[0][2] == "0" and int(runs[1][2]) >= 1, runs  # a miss, then a hit
  assert runs[0][1] == runs[1][1]
