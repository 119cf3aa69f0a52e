"""notebooks/quickstart.ipynb executes top to bottom on CPU, in this interpreter's environment.

The kernel is pinned to sys.executable: a temporary kernelspec named python3 is put first on
JUPYTER_PATH, so a python3 kernelspec elsewhere on the machine (a user's, the system's) cannot swap in
another interpreter without specjax. The notebook runs from the repository root, writes its sweep into
a temporary directory (SPECJAX_QUICKSTART_OUT) and must show the tables and at least one plot. Its
SmolLM2 sweep runs on the model's first 2 blocks (SPECJAX_QUICKSTART_TARGET): every cell, setting and
table as on the whole model, at a tenth of the compile and step time; the whole model's decoding is
checked against Hugging Face and its speculative output against its own in test_smollm2*.py.
"""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
HANG_GUARD_S = 900  # per cell: catches a hung kernel; speed is measured in benchmarks/, not asserted here


def _pin_kernel(tmp_path, monkeypatch) -> None:
  """A python3 kernelspec that runs sys.executable, first on JUPYTER_PATH; checked to resolve."""
  from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=import-outside-toplevel
  spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (specjax tests)", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  spec = KernelSpecManager().get_kernel_spec("python3")
  assert spec.argv[0] == sys.executable, spec.argv


def _text(output) -> str:
  """Everything a cell output shows as text: stream text, or the text/* entries of display data."""
  if output.get("output_type") == "stream":
    return output.get("text", "")
  return "\n".join(str(value) for key, value in output.get("data", {}).items()
                   if key.startswith("text/"))


def _cell(nb, tag):
  return next(c for c in nb.cells if tag in c.get("metadata", {}).get("tags", []))


@pytest.mark.slow
def test_quickstart_notebook_runs_on_cpu(tmp_path, monkeypatch, smollm2_two_blocks):
  import nbclient  # pylint: disable=import-outside-toplevel
  import nbformat  # pylint: disable=import-outside-toplevel

  committed = nbformat.read(NOTEBOOK, as_version=4)
  assert all(not c.get("outputs") and c.get("execution_count") is None
             for c in committed.cells if c.cell_type == "code"), "commit the notebook with outputs cleared"

  _pin_kernel(tmp_path, monkeypatch)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  out = tmp_path / "quickstart"
  monkeypatch.setenv("SPECJAX_QUICKSTART_OUT", str(out))
  monkeypatch.setenv("SPECJAX_QUICKSTART_TARGET", str(smollm2_two_blocks))

  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=HANG_GUARD_S, startup_timeout=60,
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()  # raises CellExecutionError on the first failing cell

  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.get("output_type") == "error"]
  assert not errors, errors
  setup = "".join(_text(o) for o in nb.cells[1].outputs)
  assert f"python : {sys.executable}" in setup and "backend: cpu" in setup, setup
  assert "alpha" in "".join(_text(o) for o in _cell(nb, "tables").outputs)
  assert any("image/png" in o.get("data", {}) for o in _cell(nb, "plots").outputs)
  planned = "".join(_text(o) for o in _cell(nb, "plan").outputs)
  assert "t5.1.1-xxl" in planned and "| target + t5.1.1-small draft | loop |" in planned, planned
  trained = "".join(_text(o) for o in _cell(nb, "t5_train").outputs)
  assert "target:" in trained and "draft:" in trained and "BLEU" in trained, trained
  assert "alpha" in "".join(_text(o) for o in _cell(nb, "t5_tables").outputs)
  assert any("image/png" in o.get("data", {}) for o in _cell(nb, "t5_plots").outputs)
  t5_rows = [json.loads(r) for r in (out / "t5" / "sweep" / "results.jsonl").read_text().splitlines()]
  assert len(t5_rows) == 2  # gamma 3 x temperatures (0, 1)
  assert all(r["outputs_match_baseline"] for r in t5_rows if r["temperature"] == 0.0)
  rows = (out / "results.jsonl").read_text().splitlines()
  assert len(rows) == 1  # gamma 2, greedy
  assert all(json.loads(r)["outputs_match_baseline"] is True for r in rows)
