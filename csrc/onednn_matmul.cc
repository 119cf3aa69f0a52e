// bfloat16 matrix products on the CPU's matrix units (AVX-512 BF16, AMX) through oneDNN, for XLA:CPU.
//
// XLA:CPU in the jaxlib specjax runs on has no fast bfloat16 product (its one-row product is several
// times slower than float32), while oneDNN's brgemm kernels read a bfloat16 weight at the memory's
// speed. Weights are reordered once, at load, into oneDNN's blocked layout (the same layout for any
// row count, so one packed copy serves a one-token step and a 64-token verification); each product
// then streams them once. Built by scripts/build_cpu_matmul.sh, loaded by specjax/models/cpu_matmul.py.
//
//   specjax_cpu_matmul_packed_bytes(k, n)       bytes of the packed [k, n] bfloat16 weight
//   specjax_cpu_matmul_pack(src, k, n, dst)     row-major [k, n] bfloat16 -> packed bytes
//   specjax_cpu_matmul_unpack(src, k, n, dst)   and back
//   specjax_cpu_matmul_implementation(k, n)     oneDNN's kernel for that shape (brg:avx512_core_bf16, ...)
//   SpecjaxCpuMatmul (XLA FFI)                  x[..., k] bf16, packed u8 -> y[..., n] f32 or bf16
//
// oneDNN runs each product on its OpenMP team (OMP_NUM_THREADS, all cores by default). Splitting a
// product into column slices run single-threaded on XLA's intra-op pool, or on helper threads of our
// own, was tried: no faster inside a SmolLM2 step on 2 cores, and slower at 5 and 17 rows.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <utility>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>
#include <algorithm>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace {

using dnnl::matmul;
using dnnl::memory;
using Dt = memory::data_type;
using Tag = memory::format_tag;

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The row count whose kernel every product uses (see Product): the layout kernels are packed in is
// the one oneDNN picks for it too.
constexpr int64_t kRows = 16;

// Products read bfloat16 or float32 (activations and weights alike) and sum in float32; they write
// float32 (the logits) or the activations' dtype (rounded once, as XLA's path rounds its sums).
matmul::primitive_desc Describe(int64_t m, int64_t k, int64_t n, const memory::desc& weights,
                                Dt in, Dt out) {
  return matmul::primitive_desc(Engine(), memory::desc({m, k}, in, Tag::ab), weights,
                                memory::desc({m, n}, out, Tag::ab));
}

const memory::desc& PackedDesc(int64_t k, int64_t n, Dt in) {
  static std::mutex lock;
  static std::map<std::tuple<int64_t, int64_t, int>, memory::desc> cache;
  std::lock_guard<std::mutex> guard(lock);
  auto key = std::make_tuple(k, n, static_cast<int>(in));
  auto found = cache.find(key);
  if (found == cache.end())
    found = cache.emplace(key, Describe(kRows, k, n, memory::desc({k, n}, in, Tag::any), in, in)
                                   .weights_desc()).first;
  return found->second;
}

// The primitive for [m, k] x [k, n], created once per shape (creation costs milliseconds) and shared
// by every thread. A row's result must not depend on how many rows share its product (speculative
// decoding verifies T tokens in one product where the baseline runs one: greedy output is equal
// token for token only if every token is computed bit for bit alike). oneDNN picks its kernel by
// the row count (on AMX cores: an AVX-512 kernel for 1-2 rows of SmolLM2's head, AMX from 3), so a
// product whose kernel differs from the one for kRows rows runs as blocks of kRows rows instead,
// the last block padded: every row then goes through the one kernel.
struct Product {
  matmul::primitive_desc desc;
  matmul primitive;
  bool reorders;  // its weights are not in the packed layout: reordered on every call
  bool blocked;   // runs as blocks of kRows rows (`desc` is then the kRows-row product)
};

const Product& ProductFor(int64_t m, int64_t k, int64_t n, Dt in, Dt out);

Product Build(int64_t m, int64_t k, int64_t n, Dt in, Dt out) {
  const memory::desc& packed = PackedDesc(k, n, in);
  matmul::primitive_desc desc = Describe(m, k, n, memory::desc({k, n}, in, Tag::any), in, out);
  bool reorders = false;
  if (desc.weights_desc() != packed) {
    try {
      desc = Describe(m, k, n, packed, in, out);
    } catch (const dnnl::error&) {
      reorders = true;
    }
  }
  return Product{desc, matmul(desc), reorders, false};
}

const Product& ProductFor(int64_t m, int64_t k, int64_t n, Dt in, Dt out) {
  static std::mutex lock;
  static std::map<std::tuple<int64_t, int64_t, int64_t, int, int>, Product> cache;
  std::lock_guard<std::mutex> guard(lock);
  auto key = std::make_tuple(m, k, n, static_cast<int>(in), static_cast<int>(out));
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  Product product = Build(m, k, n, in, out);
  if (m != kRows) {
    auto reference_key = std::make_tuple(kRows, k, n, static_cast<int>(in), static_cast<int>(out));
    auto reference = cache.find(reference_key);
    if (reference == cache.end())
      reference = cache.emplace(reference_key, Build(kRows, k, n, in, out)).first;
    if (std::string(product.desc.impl_info_str()) != reference->second.desc.impl_info_str()) {
      product = reference->second;
      product.blocked = true;
    }
  }
  return cache.emplace(key, product).first->second;
}

// Set by specjax_cpu_matmul_always_reorder (a test's switch): every call takes the reordering path,
// which on the CPUs measured no row count needs.
std::atomic<bool> always_reorder{false};

namespace ffi = xla::ffi;

bool DataType(ffi::DataType type, Dt* dt) {
  switch (type) {
    case ffi::DataType::F32: *dt = Dt::f32; return true;
    case ffi::DataType::BF16: *dt = Dt::bf16; return true;
    default: return false;
  }
}

size_t Bytes(Dt dt) { return dt == Dt::f32 ? 4 : 2; }

ffi::Error Matmul(ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::Result<ffi::AnyBuffer> y) {
  Dt in, out;
  if (!DataType(x.element_type(), &in))
    return ffi::Error::InvalidArgument("the product reads float32 or bfloat16");
  if (!DataType(y->element_type(), &out) || (in == Dt::f32 && out != Dt::f32))
    return ffi::Error::InvalidArgument("the product writes float32, or bfloat16 from bfloat16");
  auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("x needs at least one dimension");
  int64_t k = dims.back();
  int64_t m = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) m *= dims[i];
  int64_t n = y->dimensions().back();
  const memory::desc& layout = PackedDesc(k, n, in);
  if (static_cast<int64_t>(packed.size_bytes()) != static_cast<int64_t>(layout.get_size()))
    return ffi::Error::InvalidArgument("packed weight does not match this product's layout");
  if (m == 0) return ffi::Error::Success();
  const Product& product = ProductFor(m, k, n, in, out);
  // One product at a time: XLA runs independent operations concurrently, and oneDNN's own
  // scratchpad is shared by its primitives unless it was built for concurrent execution (this wheel
  // is not: concurrent products returned wrong values, about 1 in 1,600, before this lock). Each
  // product already runs on every core through oneDNN's OpenMP team.
  static std::mutex one_at_a_time;
  std::lock_guard<std::mutex> serial(one_at_a_time);
  thread_local dnnl::stream stream(Engine());
  memory weights(layout, Engine(), packed.untyped_data());
  memory wanted = weights;
  if (product.reorders || always_reorder.load()) {
    wanted = memory(product.desc.weights_desc(), Engine());
    dnnl::reorder(weights, wanted).execute(stream, weights, wanted);
  }
  auto run = [&](void* src_data, void* dst_data) {
    memory src(product.desc.src_desc(), Engine(), src_data);
    memory dst(product.desc.dst_desc(), Engine(), dst_data);
    product.primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wanted},
                                       {DNNL_ARG_DST, dst}});
    stream.wait();
  };
  char* x_data = static_cast<char*>(x.untyped_data());
  char* y_data = static_cast<char*>(y->untyped_data());
  if (!product.blocked) {
    run(x_data, y_data);
    return ffi::Error::Success();
  }
  const size_t row_in = k * Bytes(in), row_out = n * Bytes(out);
  thread_local std::vector<char> padded_in, padded_out;
  for (int64_t row = 0; row < m; row += kRows) {
    int64_t rows = std::min(kRows, m - row);
    if (rows == kRows) {
      run(x_data + row * row_in, y_data + row * row_out);
      continue;
    }
    padded_in.assign(kRows * row_in, 0);
    padded_out.resize(kRows * row_out);
    std::memcpy(padded_in.data(), x_data + row * row_in, rows * row_in);
    run(padded_in.data(), padded_out.data());
    std::memcpy(y_data + row * row_out, padded_out.data(), rows * row_out);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>());

extern "C" {

// `f32`: 1 for a float32 weight, 0 for bfloat16.
static Dt WeightType(int f32) { return f32 ? Dt::f32 : Dt::bf16; }

int64_t specjax_cpu_matmul_packed_bytes(int64_t k, int64_t n, int f32) {
  return static_cast<int64_t>(PackedDesc(k, n, WeightType(f32)).get_size());
}

int specjax_cpu_matmul_pack(const void* src, int64_t k, int64_t n, int f32, void* dst) {
  try {
    Dt dt = WeightType(f32);
    memory plain(memory::desc({k, n}, dt, Tag::ab), Engine(), const_cast<void*>(src));
    const memory::desc& layout = PackedDesc(k, n, dt);
    std::memset(dst, 0, layout.get_size());  // the blocks' padding past k, n reads as zeros
    memory packed(layout, Engine(), dst);
    dnnl::stream stream(Engine());
    dnnl::reorder(plain, packed).execute(stream, plain, packed);
    stream.wait();
    return 0;
  } catch (const dnnl::error&) {
    return 1;
  }
}

int specjax_cpu_matmul_unpack(const void* src, int64_t k, int64_t n, int f32, void* dst) {
  try {
    Dt dt = WeightType(f32);
    memory packed(PackedDesc(k, n, dt), Engine(), const_cast<void*>(src));
    memory plain(memory::desc({k, n}, dt, Tag::ab), Engine(), dst);
    dnnl::stream stream(Engine());
    dnnl::reorder(packed, plain).execute(stream, packed, plain);
    stream.wait();
    return 0;
  } catch (const dnnl::error&) {
    return 1;
  }
}

void specjax_cpu_matmul_always_reorder(int on) { always_reorder.store(on != 0); }

// oneDNN's kernel for m rows of [k, n] products (after the choice above: a blocked product names
// the kRows-row kernel it runs).
const char* specjax_cpu_matmul_implementation(int64_t m, int64_t k, int64_t n, int f32) {
  Dt dt = WeightType(f32);
  return ProductFor(m, k, n, dt, dt == Dt::f32 ? Dt::f32 : Dt::bf16).desc.impl_info_str();
}

// Whether m rows of [k, n] products run as blocks of kRows rows (their own kernel differs).
int specjax_cpu_matmul_blocked(int64_t m, int64_t k, int64_t n, int f32) {
  Dt dt = WeightType(f32);
  return ProductFor(m, k, n, dt, Dt::f32).blocked ? 1 : 0;
}

}  // extern "C"
