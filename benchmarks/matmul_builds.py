"""Two builds of specjax's product kernel side by side: csrc/matmul.cc at a git revision against the
working tree's, on the same packed weights, timed in turn in one process.

    .venv/bin/python benchmarks/matmul_builds.py [--baseline 476f7f9] [--rows 1,2,4,5,8,12,17]
        [--repeats 15]

Each build is compiled the way scripts/build_cpu_kernels.sh compiles it (-march=native, this
machine's widest vectors) into a library of its own and called through its C entry point
(`specjax_cpu_matmul_run`: float32 rows, float32 sums, the same code the XLA custom call runs).
For each product shape (the EnDe T5 target's [512, 1536] and [512, 8000] head, SmolLM2's fused
[576, 1536] and [1536, 576] down projection), dtype and row count, the builds run alternately, each
over enough distinct copies of the weight that they come from memory, not the cache: on a shared
machine whose read bandwidth moves by 2x within minutes, only products timed in turn compare. A
figure is the median over `repeats` turns of the time per product. The builds must give the same
bits (checked on every shape and row count before timing). Writes
benchmarks/results/matmul_builds.{md,json}.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

import common
import roofline

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES = {"T5 EnDe MLP [512, 1536]": (512, 1536), "T5 EnDe head [512, 8000]": (512, 8000),
          "SmolLM2 gate+up [576, 3072]": (576, 3072), "SmolLM2 down [1536, 576]": (1536, 576)}
COPIES_BYTES = 64 << 20  # distinct weights per turn: far more than the caches hold


def build(source_dir: pathlib.Path, out: pathlib.Path) -> ctypes.CDLL:
  """csrc/matmul.cc (with its team.h) from source_dir, as scripts/build_cpu_kernels.sh builds it."""
  include = jax.ffi.include_dir()
  subprocess.run(["g++", "-O2", "-march=native", "-fno-tree-vectorize", "-ffp-contract=off",
                  "-std=c++17", "-fPIC", "-w", "-pthread", "-shared", "-o", str(out),
                  str(source_dir / "matmul.cc"), f"-I{include}"], check=True)
  lib = ctypes.CDLL(str(out))
  lib.specjax_cpu_matmul_packed_bytes.restype = ctypes.c_int64
  lib.specjax_cpu_matmul_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
  lib.specjax_cpu_matmul_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_int, ctypes.c_void_p]
  lib.specjax_cpu_matmul_run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_void_p]
  lib.specjax_cpu_matmul_implementation.restype = ctypes.c_char_p
  return lib


def sources_at(revision: str, directory: pathlib.Path) -> pathlib.Path:
  for name in ("matmul.cc", "team.h"):
    text = subprocess.run(["git", "show", f"{revision}:csrc/{name}"], cwd=ROOT, check=True,
                          capture_output=True).stdout
    (directory / name).write_bytes(text)
  return directory


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--baseline", default="476f7f9",
                      help="the git revision whose csrc/matmul.cc is the baseline")
  parser.add_argument("--rows", default="1,2,4,5,8,12,17")
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args()
  rows = [int(r) for r in args.rows.split(",")]
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    (tmp / "baseline").mkdir()
    libs = {f"baseline ({args.baseline})": build(sources_at(args.baseline, tmp / "baseline"),
                                                 tmp / "baseline.so"),
            "working tree": build(ROOT / "csrc", tmp / "working.so")}
    implementation = libs["working tree"].specjax_cpu_matmul_implementation().decode()
    rng = np.random.default_rng(0)
    results = []
    for shape_name, (k, n) in SHAPES.items():
      for f32, dtype in ((1, "float32"), (0, "bfloat16")):
        weight = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        source = weight if f32 else (weight.view(np.uint32) >> 16).astype(np.uint16)
        nbytes = libs["working tree"].specjax_cpu_matmul_packed_bytes(k, n, f32)
        copies = max(2, COPIES_BYTES // nbytes)
        packed = [np.empty(nbytes, np.uint8) for _ in range(copies)]
        lib = next(iter(libs.values()))  # both builds pack alike (the layout is unchanged)
        for p in packed:
          lib.specjax_cpu_matmul_pack(source.ctypes.data, k, n, f32, p.ctypes.data)
        for m in rows:
          x = rng.standard_normal((m, k)).astype(np.float32)
          outputs = {name: np.empty((m, n), np.float32) for name in libs}
          for name, lib in libs.items():
            lib.specjax_cpu_matmul_run(x.ctypes.data, m, k, n, f32, packed[0].ctypes.data,
                                       outputs[name].ctypes.data)
          first, *others = outputs.values()
          for other in others:
            np.testing.assert_array_equal(other, first, err_msg=f"{shape_name} {dtype} {m} rows")
          times = {name: [] for name in libs}
          for _ in range(args.repeats + 1):  # the first turn warms up
            for name, lib in libs.items():
              y = outputs[name]
              # Each library has its own team of threads, whose helpers spin 0.2 ms after a call
              # before they sleep: let the other build's fall asleep first.
              time.sleep(0.002)
              start = time.perf_counter()
              for p in packed:
                lib.specjax_cpu_matmul_run(x.ctypes.data, m, k, n, f32, p.ctypes.data,
                                           y.ctypes.data)
              times[name].append((time.perf_counter() - start) / copies)
          for name in libs:
            seconds = statistics.median(times[name][1:])
            results.append({"shape": shape_name, "k": k, "n": n, "dtype": dtype, "rows": m,
                            "build": name, "ms": 1000 * seconds,
                            "gbps": nbytes / seconds / 1e9})
        print(f"{shape_name} {dtype}: done", flush=True)

  one_row = {(r["shape"], r["dtype"], r["build"]): r["ms"] for r in results if r["rows"] == 1}
  for r in results:
    r["vs_one_row"] = r["ms"] / one_row[r["shape"], r["dtype"], r["build"]]
  names = list(libs)
  lines = [f"{datetime.date.today()}, {roofline.cpu_description()}, {os.cpu_count()} cores, "
           f"products: {implementation}: `python benchmarks/matmul_builds.py "
           f"{' '.join(sys.argv[1:])}`", "",
           f"ms per product (median of {args.repeats} turns, the builds in turn), and in brackets "
           "the time against the same build's one-row product; the builds' outputs are equal bit "
           "for bit:", "",
           "| shape | dtype | rows | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(names)]
  for shape_name in SHAPES:
    for dtype in ("float32", "bfloat16"):
      for m in rows:
        cells = [next(r for r in results if (r["shape"], r["dtype"], r["rows"], r["build"])
                      == (shape_name, dtype, m, name)) for name in names]
        lines.append(f"| {shape_name} | {dtype} | {m} | " + " | ".join(
            f"{c['ms']:.3f} ({c['vs_one_row']:.2f}x)" for c in cells) + " |")
  markdown = "\n".join(lines)
  common.write_results("matmul_builds", results, markdown,
                       {"machine": roofline.cpu_description(), "cpus": os.cpu_count(),
                        "implementation": implementation, "args": vars(args)})
  print(markdown)


if __name__ == "__main__":
  main()
