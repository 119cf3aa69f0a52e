"""Every benchmark script imports (its names resolve against the library as it is now): the
benchmarks are run by hand, not by the suite, so a renamed library function would otherwise break
one unnoticed until someone runs it. Each is imported in a fresh interpreter, as `python
benchmarks/<name>.py` would (the benchmarks folder first on the path)."""

import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "common")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports(name):
  code = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import {name}; assert callable({name}.main)"
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode == 0, result.stderr[-2000:]
