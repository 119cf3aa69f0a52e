#!/usr/bin/env bash
# Build specjax's bfloat16 matrix product for XLA:CPU (csrc/onednn_matmul.cc) into .venv/lib, against
# oneDNN from PyPI (onednn-cpu-gomp: the CPU-only build on GNU OpenMP, 39 MB) and the XLA FFI headers
# jax ships. Needs g++ (C++17). Used by decoding with ModelSpec.matmul = "onednn" or "auto"
# (specjax/models/cpu_matmul.py); without it every product runs through XLA.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
ONEDNN=2023.2.0
"$VENV/bin/python" -m pip install -q --no-deps --disable-pip-version-check "onednn-cpu-gomp==$ONEDNN" "onednn-devel-cpu-gomp==$ONEDNN"
FFI_INCLUDE=$("$VENV/bin/python" -c "import jax; print(jax.ffi.include_dir())")
g++ -O2 -std=c++17 -shared -fPIC -w -o "$VENV/lib/libspecjax_cpu_matmul.so" csrc/onednn_matmul.cc \
  -I"$VENV/include" -I"$FFI_INCLUDE" -L"$VENV/lib" -l:libdnnl.so.3 -Wl,-rpath,'$ORIGIN'
echo "built $VENV/lib/libspecjax_cpu_matmul.so"
