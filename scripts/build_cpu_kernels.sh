#!/usr/bin/env bash
# Build specjax's CPU kernels for XLA:CPU into .venv/lib/libspecjax_cpu.so: matrix products of a few
# rows at the memory's speed (csrc/matmul.cc), attention over the KV cache (csrc/attention.cc),
# RMSNorm (csrc/rms_norm.cc) and the argmax of each row (csrc/argmax.cc), against the XLA FFI headers
# jax ships. Needs only g++ (C++17). Used by decoding with ModelSpec.kernels = "cpu"
# (specjax/models/cpu_kernels.py); without it every decode runs on XLA's own kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
FFI_INCLUDE=$("$VENV/bin/python" -c "import jax; print(jax.ffi.include_dir())")
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
# The attention's and the norm's sums must run in one fixed order (csrc/attention.cc says why): their
# vector code is written out by hand, so the compiler's own vectorizer and its fusing of a product
# and a sum into one rounding stay off (the products' fused multiply-adds are written out as such).
# -march=native: the vectors are the machine's widest (the library is built where it runs).
FLAGS="-O2 -march=native -fno-tree-vectorize -ffp-contract=off -std=c++17 -fPIC -w -pthread"
for name in matmul attention rms_norm argmax; do
  g++ $FLAGS -c "csrc/$name.cc" -o "$build/$name.o" -I"$FFI_INCLUDE"
done
g++ -shared -pthread -o "$VENV/lib/libspecjax_cpu.so" "$build"/*.o
rm -f "$VENV/lib/libspecjax_cpu_matmul.so"  # the library's name before attention joined it
products=$("$VENV/bin/python" -c "import ctypes; f = ctypes.CDLL('$VENV/lib/libspecjax_cpu.so').specjax_cpu_matmul_implementation; f.restype = ctypes.c_char_p; print(f().decode())")
echo "built $VENV/lib/libspecjax_cpu.so (products: $products)"
