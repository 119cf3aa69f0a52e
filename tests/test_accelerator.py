"""benchmarks/accelerator.py end to end in its CI mode (--tiny) on this CPU, as a user runs it (a
fresh interpreter, the repository root as its folder), writing into a temporary folder: it names
the backend, measures both tiny shapes, skips a 7B shape that a 1 GiB budget cannot hold with its
line, and every speedup it predicts is what specjax.theory gives for the v(T) it reports and the
acceptance figures it names, each figure found in the file it cites."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from specjax import theory

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp("accelerator")
  command = ["--tiny", "--shapes", "tiny,t5-tiny,llama2-7b", "--memory_gib", "1", "--output",
             str(out)]
  # This checkout's specjax, whatever else the environment has installed.
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")]))}
  done = subprocess.run([sys.executable, "benchmarks/accelerator.py", *command], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  data = json.loads((out / "accelerator-cpu.json").read_text())
  return data["meta"], {row["shape"]: row for row in data["rows"]}, \
      (out / "accelerator-cpu.md").read_text(), done.stderr


def test_names_the_backend_and_the_command(results):
  meta, _, markdown, progress = results
  assert meta["backend"] == "cpu" and meta["device_kind"] == "cpu"
  first = markdown.splitlines()[0]
  assert "cpu backend" in first and meta["date"] in first and "--tiny" in first
  assert "`python benchmarks/accelerator.py --tiny" in first
  assert "{" not in markdown  # every field formatted
  assert "] measuring backend cpu, device cpu" in progress


def test_a_shape_that_does_not_fit_is_skipped_with_its_line(results):
  _, rows, markdown, _ = results
  assert rows["llama2-7b"]["status"] == "skipped"
  assert rows["llama2-7b"]["reason"].startswith("does not fit: needs 25.")  # float32 on a CPU
  assert "- llama2-7b: skipped, does not fit" in markdown
  assert "steps" not in rows["llama2-7b"]


@pytest.mark.parametrize("shape", ["tiny", "t5-tiny"])
def test_steps_floor_and_v(results, shape):
  meta, rows, _, _ = results
  row = rows[shape]
  assert row["status"] == "measured" and row["weights"] == "random"
  tokens = [s["tokens"] for s in row["steps"]]
  assert tokens == meta["tokens"] == [1, 2, 5, 17]
  assert row["steps"][0]["v"] == 1.0
  assert all(s["v"] > 0 and s["step_ms"] > 1e-4 for s in row["steps"])
  assert row["ms_per_token"] == row["steps"][0]["step_ms"]
  assert row["floor_ms"] > 0
  assert row["floor_ms"] == pytest.approx(1000 * row["bytes_read"] / (meta["bandwidth_gbps"] * 1e9))
  assert row["step_over_floor"] == pytest.approx(row["ms_per_token"] / row["floor_ms"])


@pytest.mark.parametrize("shape", ["tiny", "t5-tiny"])
def test_predictions_are_the_theory_of_the_reported_figures(results, shape):
  meta, rows, _, _ = results
  row = rows[shape]
  tokens = [s["tokens"] for s in row["steps"]]
  v = [s["v"] for s in row["steps"]]
  assert len(row["predictions"]) == len(meta["acceptance"]) >= 10
  for figure, predicted in zip(meta["acceptance"], row["predictions"]):
    v_at = float(np.interp(figure["nodes"], tokens, v))
    assert predicted["v"] == pytest.approx(v_at, rel=1e-12)
    c = figure["draft_cost"]
    if figure["kind"] == "chain":
      (alpha,), gamma = figure["alpha"], figure["nodes"] - 1
      speedup = lambda cost: theory.speedup_from_costs(alpha, gamma, gamma * cost, v_at, 0.0)
    else:
      speedup = lambda cost: theory.tree_speedup(figure["alpha"], cost, v_at)
    assert predicted["speedup"] == pytest.approx(float(speedup(c)), rel=1e-12)
    assert predicted["speedup_free_draft"] == pytest.approx(float(speedup(0.0)), rel=1e-12)


def test_acceptance_figures_are_found_in_their_sources(results):
  """Every alpha the predictions use is printed in the results file it names."""
  meta, _, markdown, _ = results
  kinds = {figure["kind"] for figure in meta["acceptance"]}
  assert kinds == {"chain", "tree"}
  for figure in meta["acceptance"]:
    source = (ROOT / figure["source"].split(",")[0]).read_text()
    if figure["kind"] == "chain":
      assert f"{figure['alpha'][0]:.3f}" in source, figure
    else:
      assert " ".join(f"{a:.2f}" for a in figure["alpha"]) in source, figure
  assert any(f["drafter"] == "DFlash block" for f in meta["acceptance"])  # the block drafter
  assert "Block drafter (DFlash" in markdown
