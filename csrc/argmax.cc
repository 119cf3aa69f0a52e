// The index of each row's largest value for XLA:CPU, as jnp.argmax gives it: the first maximum, or
// the first NaN where a row holds one. A greedy verification reads it at every position. XLA:CPU
// runs sampling.argmax's vectorised form as passes over the logits (the maximum, then the first
// index that holds it): over 17 rows of SmolLM2's 49,152 logits about 1 ms more than this kernel,
// which finds a row's maximum in registers and scans the row once more only up to its first hit.
//
//   SpecjaxCpuArgmax(x[..., V]) -> int32[...]                                        (float32 x)
//
// Exact: comparisons only, no arithmetic.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "team.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;

constexpr int kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The first maximum of row[0, n) (the first NaN if any), n >= 1: lane-wise maxima over the whole
// vectors with a NaN flag, then one scan for the first index holding the winner.
int32_t RowArgmax(const float* row, int64_t n) {
  const int64_t whole = n / kLanes * kLanes;
  float top = row[0];
  bool nan = false;
  if (whole > 0) {
    Vec peak = Load(row);
    IVec unordered = peak != peak;
    for (int64_t i = kLanes; i < whole; i += kLanes) {
      const Vec v = Load(row + i);
      unordered |= v != v;
      peak = v > peak ? v : peak;
    }
    for (int lane = 0; lane < kLanes; ++lane) {
      nan = nan || unordered[lane] != 0;
      top = peak[lane] > top ? peak[lane] : top;
    }
  }
  for (int64_t i = whole; i < n; ++i) {
    nan = nan || std::isnan(row[i]);
    top = row[i] > top ? row[i] : top;
  }
  for (int64_t i = 0; i < n; ++i)
    if (nan ? std::isnan(row[i]) : row[i] == top) return static_cast<int32_t>(i);
  return 0;  // not reached: the row holds its maximum
}

ffi::Error Argmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  specjax::FlushDenormals flush;  // as the team's helpers do: a denormal compares as zero on every row
  auto dims = x.dimensions();
  if (dims.size() < 1 || dims.back() < 1)
    return ffi::Error::InvalidArgument("x[..., V] with V >= 1");
  const int64_t width = dims.back(), rows = x.element_count() / width;
  if (static_cast<int64_t>(out->element_count()) != rows)
    return ffi::Error::InvalidArgument("out holds one index per row of x");
  const float* data = x.typed_data();
  int32_t* result = out->typed_data();
  auto run = [&](int part, int parts) {
    for (int64_t r = rows * part / parts; r < rows * (part + 1) / parts; ++r)
      result[r] = RowArgmax(data + r * width, width);
  };
  if (rows > 1 && rows * width >= (int64_t{1} << 16))
    specjax::Team::Get().Run(run);
  else
    run(0, 1);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuArgmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
