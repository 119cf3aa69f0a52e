#!/usr/bin/env bash
# Build specjax's CPU kernels for XLA:CPU into .venv/lib/libspecjax_cpu.so: matrix products through
# oneDNN (csrc/onednn_matmul.cc, against PyPI's onednn-cpu-gomp: the CPU-only build on GNU OpenMP,
# 39 MB) and attention over the KV cache (csrc/attention.cc), both against the XLA FFI headers jax
# ships. Needs g++ (C++17). Used by decoding with ModelSpec.kernels = "cpu"
# (specjax/models/cpu_kernels.py); without it every decode runs on XLA's own kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
ONEDNN=2023.2.0
"$VENV/bin/python" -m pip install -q --no-deps --disable-pip-version-check "onednn-cpu-gomp==$ONEDNN" "onednn-devel-cpu-gomp==$ONEDNN"
FFI_INCLUDE=$("$VENV/bin/python" -c "import jax; print(jax.ffi.include_dir())")
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
# The attention's sums must run in one fixed order (csrc/attention.cc says why): its vector code is
# written out by hand, so the compiler's own vectorizer and its fusing of a product and a sum into one
# rounding stay off. -march=native: the vectors are the machine's widest (the library is built where
# it runs).
g++ -O2 -march=native -fno-tree-vectorize -ffp-contract=off -fopenmp -std=c++17 -fPIC -w \
  -c csrc/attention.cc -o "$build/attention.o" -I"$FFI_INCLUDE"
g++ -O2 -march=native -fno-tree-vectorize -ffp-contract=off -std=c++17 -fPIC -w \
  -c csrc/rms_norm.cc -o "$build/rms_norm.o" -I"$FFI_INCLUDE"
g++ -O2 -std=c++17 -fPIC -w -c csrc/onednn_matmul.cc -o "$build/onednn_matmul.o" \
  -I"$VENV/include" -I"$FFI_INCLUDE"
g++ -shared -fopenmp -o "$VENV/lib/libspecjax_cpu.so" "$build/onednn_matmul.o" "$build/attention.o" \
  "$build/rms_norm.o" -L"$VENV/lib" -l:libdnnl.so.3 -Wl,-rpath,'$ORIGIN'
rm -f "$VENV/lib/libspecjax_cpu_matmul.so"  # the library's name before attention joined it
echo "built $VENV/lib/libspecjax_cpu.so"
