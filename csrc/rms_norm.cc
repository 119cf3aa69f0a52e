// RMSNorm for XLA:CPU whose sum of squares runs in one fixed order, so a row's result does not
// depend on how many rows share the call. XLA's own reduction does: its code for [T, 576] rows
// summed SmolLM2's rows in another order from 8 rows on than for one row, so a verification of 8 or
// more tokens scored them in other last bits than the one-token baseline step (csrc/attention.cc
// says why that matters for greedy output).
//
//   SpecjaxCpuRmsNorm(x[..., E], scale[E]; eps) -> x * (1 / sqrt(mean(x * x) + eps)) * scale
//                                                                                 (float32)
// Each row's squares are summed into 8 lanes (element i into lane i % 8) in increasing i, the 8
// lanes then added in order. The lanes are GCC vector types, compiled with -fno-tree-vectorize and
// -ffp-contract=off (scripts/build_cpu_kernels.sh): the compiler keeps that order for any width and
// alignment and rounds every product apart.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "team.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;

constexpr int kLanes = 8;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale, float eps,
                   ffi::ResultBuffer<ffi::F32> out) {
  specjax::FlushDenormals flush;
  auto dims = x.dimensions();
  if (dims.size() < 1 || scale.dimensions().size() != 1 || scale.dimensions()[0] != dims.back())
    return ffi::Error::InvalidArgument("x[..., E] and scale[E]");
  const int64_t width = dims.back();
  const int64_t rows = width ? x.element_count() / width : 0;
  const int64_t whole = width / kLanes * kLanes;
  const float* gain = scale.typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.typed_data() + r * width;
    float* result = out->typed_data() + r * width;
    Vec lanes = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < whole; i += kLanes) {
      const Vec v = Load(row + i);
      lanes += v * v;
    }
    for (int64_t i = whole; i < width; ++i) lanes[i % kLanes] += row[i] * row[i];
    float sum = 0.0f;
    for (int j = 0; j < kLanes; ++j) sum += lanes[j];
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
    for (int64_t i = 0; i < width; ++i) result[i] = row[i] * inverse * gain[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());
