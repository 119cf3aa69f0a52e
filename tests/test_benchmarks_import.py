"""Every benchmark script imports (its names resolve against the library as it is now): the
benchmarks are run by hand, not by the suite, so a renamed library function would otherwise break
one unnoticed until someone runs it. Each is imported in a fresh interpreter, as `python
benchmarks/<name>.py` would (the benchmarks folder first on the path), from the repository root, and
every specjax / experiments module it loaded must come from this checkout: an editable install of
another checkout would otherwise answer for a module this one no longer has (a benchmark still
importing `specjax.trees` imported fine that way)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "common")

CHECK = """
import sys
sys.path[:0] = [{benchmarks!r}, {root!r}]
import {name}
assert callable({name}.main)
stray = sorted(f"{{key}}: {{module.__file__}}" for key, module in list(sys.modules.items())
               if key.split(".")[0] in ("specjax", "experiments")
               and getattr(module, "__file__", None)
               and not module.__file__.startswith({root!r} + "/"))
assert not stray, "modules from outside this checkout: " + ", ".join(stray)
"""


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports(name):
  code = CHECK.format(benchmarks=str(BENCHMARKS), root=str(ROOT), name=name)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          check=False, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-2000:]
