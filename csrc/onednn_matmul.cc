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
#include <tuple>

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

// Products read bfloat16 and sum in float32; they write float32 (the logits) or bfloat16 (the
// activations, rounded once, as XLA's path rounds its float32 sums).
matmul::primitive_desc Describe(int64_t m, int64_t k, int64_t n, const memory::desc& weights,
                                Dt out = Dt::f32) {
  return matmul::primitive_desc(Engine(), memory::desc({m, k}, Dt::bf16, Tag::ab), weights,
                                memory::desc({m, n}, out, Tag::ab));
}

// The layout kernels are packed in: the one oneDNN picks for 16 rows. On the AVX-512 BF16 cores
// measured it is the same for 1..128 rows; where a row count prefers another (AMX may), the product
// is built for the packed layout or, failing that, reorders the weight on each call.
const memory::desc& PackedDesc(int64_t k, int64_t n) {
  static std::mutex lock;
  static std::map<std::pair<int64_t, int64_t>, memory::desc> cache;
  std::lock_guard<std::mutex> guard(lock);
  auto found = cache.find({k, n});
  if (found == cache.end())
    found = cache.emplace(std::make_pair(k, n),
                          Describe(16, k, n, memory::desc({k, n}, Dt::bf16, Tag::any))
                              .weights_desc()).first;
  return found->second;
}

// The primitive for [m, k] x [k, n]; created once per shape (creation costs milliseconds) and shared
// by every thread: oneDNN primitives may execute concurrently.
struct Product {
  matmul::primitive_desc desc;
  matmul primitive;
  bool reorders;  // its weights are not in the packed layout: reordered on every call
};

const Product& ProductFor(int64_t m, int64_t k, int64_t n, Dt out = Dt::f32) {
  const memory::desc& packed = PackedDesc(k, n);
  static std::mutex lock;
  static std::map<std::tuple<int64_t, int64_t, int64_t, int>, Product> cache;
  std::lock_guard<std::mutex> guard(lock);
  auto key = std::make_tuple(m, k, n, static_cast<int>(out));
  auto found = cache.find(key);
  if (found == cache.end()) {
    matmul::primitive_desc desc = Describe(m, k, n, memory::desc({k, n}, Dt::bf16, Tag::any), out);
    bool reorders = false;
    if (desc.weights_desc() != packed) {
      try {
        desc = Describe(m, k, n, packed, out);
      } catch (const dnnl::error&) {
        reorders = true;
      }
    }
    found = cache.emplace(key, Product{desc, matmul(desc), reorders}).first;
  }
  return found->second;
}

// Set by specjax_cpu_matmul_always_reorder (a test's switch): every call takes the reordering path,
// which on the CPUs measured no row count needs.
std::atomic<bool> always_reorder{false};

namespace ffi = xla::ffi;

ffi::Error Matmul(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> packed,
                  ffi::Result<ffi::AnyBuffer> y) {
  Dt out;
  switch (y->element_type()) {
    case ffi::DataType::F32: out = Dt::f32; break;
    case ffi::DataType::BF16: out = Dt::bf16; break;
    default: return ffi::Error::InvalidArgument("the product writes float32 or bfloat16");
  }
  auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("x needs at least one dimension");
  int64_t k = dims.back();
  int64_t m = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) m *= dims[i];
  int64_t n = y->dimensions().back();
  const memory::desc& layout = PackedDesc(k, n);
  if (static_cast<int64_t>(packed.size_bytes()) != static_cast<int64_t>(layout.get_size()))
    return ffi::Error::InvalidArgument("packed weight does not match this product's layout");
  if (m == 0) return ffi::Error::Success();
  const Product& product = ProductFor(m, k, n, out);
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
  memory src(product.desc.src_desc(), Engine(), x.untyped_data());
  memory dst(product.desc.dst_desc(), Engine(), y->untyped_data());
  product.primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wanted},
                                     {DNNL_ARG_DST, dst}});
  stream.wait();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>());

extern "C" {

int64_t specjax_cpu_matmul_packed_bytes(int64_t k, int64_t n) {
  return static_cast<int64_t>(PackedDesc(k, n).get_size());
}

int specjax_cpu_matmul_pack(const void* src, int64_t k, int64_t n, void* dst) {
  try {
    memory plain(memory::desc({k, n}, Dt::bf16, Tag::ab), Engine(), const_cast<void*>(src));
    const memory::desc& layout = PackedDesc(k, n);
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

int specjax_cpu_matmul_unpack(const void* src, int64_t k, int64_t n, void* dst) {
  try {
    memory packed(PackedDesc(k, n), Engine(), const_cast<void*>(src));
    memory plain(memory::desc({k, n}, Dt::bf16, Tag::ab), Engine(), dst);
    dnnl::stream stream(Engine());
    dnnl::reorder(packed, plain).execute(stream, packed, plain);
    stream.wait();
    return 0;
  } catch (const dnnl::error&) {
    return 1;
  }
}

void specjax_cpu_matmul_always_reorder(int on) { always_reorder.store(on != 0); }

const char* specjax_cpu_matmul_implementation(int64_t k, int64_t n) {
  return ProductFor(16, k, n).desc.impl_info_str();
}

}  // extern "C"
