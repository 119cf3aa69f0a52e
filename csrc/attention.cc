// Attention over a KV cache for XLA:CPU whose every sum runs in one fixed order: key slots in
// increasing order, each key's score summed over the head dimension by one fixed code path. A query's
// output then depends only on its own query vector and the keys and values it sees, not on how many
// other queries share the call, how long the cache buffer is, or where masked slots lie. That is what
// makes a speculative verification of T tokens (a chain, or a token tree whose nodes sit in slots
// after the prefix) compute each token bit for bit as the one-token baseline step does, so greedy
// speculative output equals greedy autoregressive output token for token.
//
// XLA's own attention (two einsums and a softmax) sums in an order that depends on the number of
// query rows and the cache length. Here masked slots are skipped, never summed, so the work also
// stops at each row's last visible slot instead of covering the whole padded cache.
//
//   SpecjaxCpuAttention(q[B, T, H, D], keys[B, S, KV, D], values[B, S, KV, D], visible[B, Tm, S],
//                       bias[Bb, H, T, S] or [0]; scale) -> out[B, T, H, D]        (float32)
//     head h reads key / value head h / (H / KV) (grouped-query attention); visible is per query
//     (Tm = T) or shared by all queries of a row (Tm = 1, e.g. a source's padding mask); bias is added
//     to the scaled scores (T5's relative positions; Bb = 1 or B), or absent (size 0).
//   SpecjaxCpuCacheWrite(keys, values, new_keys[B, T, KV, D], new_values, slots[B, T] int32)
//       -> (keys, values)                                           (float32; in place: aliased)
//
// Compiled with -fno-tree-vectorize and -ffp-contract=off (scripts/build_cpu_kernels.sh): the vector
// code below is written out with GCC vector types, so the compiler cannot vectorize a loop one way for
// some lengths or alignments and another way for others, nor fuse a product and a sum into one
// rounding in one place and not another.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "team.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;

constexpr int kKeys = 8;  // keys scored together (independent sums, so they overlap in the pipeline)
#if defined(__AVX512F__)
constexpr bool kWide = true;  // blocks of 16 rows fit AVX-512's registers
#else
constexpr bool kWide = false;
#endif

template <typename A, typename B>
bool Same(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// One call's operands, as flat arrays with their strides.
struct Operands {
  const float *q, *keys, *values, *bias;
  const bool* visible;
  float* out;
  int64_t batch, steps, heads, dim, slots, kv_heads, group, mask_steps, bias_batch;
  float scale;
  const bool* Visible(int64_t b, int64_t t) const {
    return visible + (b * mask_steps + (mask_steps == 1 ? 0 : t)) * slots;
  }
};

template <int kLanes>
struct Vectors;  // spelled out per width: GCC drops a vector_size that depends on a template argument
template <>
struct Vectors<8> {
  typedef float Vec __attribute__((vector_size(8 * sizeof(float))));
  typedef int32_t IVec __attribute__((vector_size(8 * sizeof(int32_t))));
};
template <>
struct Vectors<16> {
  typedef float Vec __attribute__((vector_size(16 * sizeof(float))));
  typedef int32_t IVec __attribute__((vector_size(16 * sizeof(int32_t))));
};

// The kernel for blocks of kLanes rows, its vectors kLanes floats wide: 8 (AVX2's registers) or 16
// (AVX-512's). A row's every sum runs the same operations in the same order at either width (one
// lane of a product, one element of a weighted value), so its result does not depend on the width:
// the call takes 8 for up to 16 rows, where wider vectors would mostly compute padding, and, on a
// CPU with AVX-512 (kWide), 16 for more (a 17-token verification of SmolLM2 has 51 rows per KV head:
// 4 blocks instead of 7; its 30 attentions went from 2.5 to 1.9 ms on a 2-core Xeon).
template <int kLanes>
struct Lanes {
typedef typename Vectors<kLanes>::Vec Vec;
typedef typename Vectors<kLanes>::IVec IVec;

static Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

template <size_t... I>
static Vec Splat(float x, std::index_sequence<I...>) { return Vec{((void)I, x)...}; }
static Vec Splat(float x) { return Splat(x, std::make_index_sequence<kLanes>()); }

// exp(x) for x <= 0 (a score minus its row's maximum), lane by lane: 2^n * p(r) with
// r = x - n ln 2 and a degree-6 polynomial (relative error about 2e-7); below -87 it returns 0.
static Vec Exp(Vec x) {
  const Vec lowest = Splat(-87.0f);
  IVec underflow = x < lowest;
  x = x < lowest ? lowest : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  Vec n = (x * 1.44269504088896341f + shifter) - shifter;
  Vec r = x - n * 0.693145751953125f;  // ln 2 in two parts, exact products
  r = r - n * 1.428606765330187045e-06f;
  Vec p = Splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  IVec exponent = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  Vec out = p * scale;
  return underflow ? Splat(0.0f) : out;
}

// out[d] = sum_s weight[s] value_s[d] / sum_s weight[s] over the visible slots s in [first, last],
// in increasing order; value_s = values + s * stride. kVecs: dim / kLanes held in registers (0: any
// dim, through memory).
template <int kVecs>
static void WeightedSum(const float* weight, const bool* visible, int64_t first, int64_t last,
                 const float* values, int64_t stride, int64_t dim, float* out) {
  float denominator = 0.0f;
  if (kVecs > 0) {
    Vec acc[kVecs > 0 ? kVecs : 1];
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) acc[i] = Splat(0.0f);
    for (int64_t s = first; s <= last; ++s) {
      if (!visible[s]) continue;
      const float w = weight[s];
      const float* value = values + s * stride;
      denominator += w;
      const Vec ws = Splat(w);
#pragma GCC unroll 16
      for (int i = 0; i < kVecs; ++i) acc[i] += ws * Load(value + i * kLanes);
    }
    const Vec scale = Splat(denominator > 0.0f ? 1.0f / denominator : 0.0f);
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) Store(out + i * kLanes, acc[i] * scale);
    return;
  }
  std::vector<float> acc(dim, 0.0f);
  for (int64_t s = first; s <= last; ++s) {
    if (!visible[s]) continue;
    const float w = weight[s];
    const float* value = values + s * stride;
    denominator += w;
    for (int64_t d = 0; d < dim; ++d) acc[d] += w * value[d];
  }
  const float scale = denominator > 0.0f ? 1.0f / denominator : 0.0f;
  for (int64_t d = 0; d < dim; ++d) out[d] = acc[d] * scale;
}

// Rows (query, head) r0 .. r0 + kLanes - 1 of batch row b that read kv head g: their scores over the
// slots [lo, hi], softmax, and weighted values. first / last: each query's visible range.
static void Block(const Operands& o, int64_t b, int64_t g, int64_t r0, int64_t lo, int64_t hi,
           const int64_t* first, const int64_t* last) {
  const int64_t rows = o.steps * o.group, dim = o.dim;
  const int64_t span = hi - lo + 1, stride = (span + kLanes - 1) / kLanes * kLanes;
  const int64_t key_stride = o.kv_heads * dim;  // between consecutive slots
  const int lanes = static_cast<int>(std::min<int64_t>(kLanes, rows - r0));
  const float minus_infinity = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> scratch;
  thread_local std::vector<float> queries;  // [dim][kLanes]
  if (scratch.size() < static_cast<size_t>(kLanes * stride)) scratch.resize(kLanes * stride);
  if (queries.size() < static_cast<size_t>(dim * kLanes)) queries.resize(dim * kLanes);
  float* scores = scratch.data();
  const float* query[kLanes];
  const bool* seen[kLanes];
  int64_t step[kLanes], head[kLanes];
  for (int lane = 0; lane < lanes; ++lane) {
    step[lane] = (r0 + lane) / o.group;
    head[lane] = g * o.group + (r0 + lane) % o.group;
    query[lane] = o.q + ((b * o.steps + step[lane]) * o.heads + head[lane]) * dim;
    seen[lane] = o.Visible(b, step[lane]);
  }
  for (int64_t d = 0; d < dim; ++d) {  // the block's queries, transposed [dim][lanes]
    Vec column = Splat(0.0f);
    for (int lane = 0; lane < lanes; ++lane) column[lane] = query[lane][d];
    Store(queries.data() + d * kLanes, column);
  }
  // Scores, kLanes rows (lanes) against kKeys keys at a time: each lane sums its row's products with one
  // key over d = 0, 1, ... in order, whatever lane or block it falls in. Slots a row does not see
  // score -infinity.
  for (int64_t s0 = lo; s0 <= hi; s0 += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, hi + 1 - s0);
    const float* key[kKeys];
    for (int j = 0; j < kKeys; ++j)
      key[j] = o.keys + (b * o.slots + s0 + std::min<int64_t>(j, count - 1)) * key_stride + g * dim;
    Vec sum[kKeys];
#pragma GCC unroll 8
    for (int j = 0; j < kKeys; ++j) sum[j] = Splat(0.0f);
    for (int64_t d = 0; d < dim; ++d) {
      const Vec q_d = Load(queries.data() + d * kLanes);
#pragma GCC unroll 8
      for (int j = 0; j < kKeys; ++j) sum[j] += q_d * Splat(key[j][d]);
    }
    for (int lane = 0; lane < lanes; ++lane) {
      float* own = scores + lane * stride + (s0 - lo);
      for (int j = 0; j < count; ++j)
        own[j] = seen[lane][s0 + j] ? sum[j][lane] * o.scale : minus_infinity;
    }
  }
  for (int lane = 0; lane < lanes; ++lane) {
    float* own = scores + lane * stride;
    std::fill(own + span, own + stride, minus_infinity);  // the padding after the span
    if (o.bias != nullptr) {
      const float* row_bias = o.bias + (((o.bias_batch == 1 ? 0 : b) * o.heads + head[lane]) *
                                        o.steps + step[lane]) * o.slots;
      for (int64_t s = lo; s <= hi; ++s) own[s - lo] += row_bias[s];
    }
    // The maximum over the slots the row sees (unseen ones are -infinity), exp lane by lane over
    // the span (unseen slots are skipped below, whatever their lanes hold), then the weighted values
    // and the denominator, summed slot by slot in increasing order.
    Vec tops = Splat(minus_infinity);
    for (int64_t i = 0; i < stride; i += kLanes) {
      Vec x = Load(own + i);
      tops = x > tops ? x : tops;
    }
    float top = tops[0];
    for (int lane2 = 1; lane2 < kLanes; ++lane2) top = std::max(top, tops[lane2]);
    for (int64_t i = 0; i < stride; i += kLanes) {
      Vec x = Load(own + i) - top;
      Store(own + i, Exp(x < Splat(0.0f) ? x : Splat(0.0f)));
    }
    const int64_t t = step[lane];
    float* dst = o.out + ((b * o.steps + t) * o.heads + head[lane]) * dim;
    const float* values = o.values + b * o.slots * key_stride + g * dim;
    const float* weight = own - lo;
    switch (dim % kLanes ? 0 : dim / kLanes) {
      case 1: WeightedSum<1>(weight, seen[lane], first[t], last[t], values, key_stride, dim, dst); break;
      case 2: WeightedSum<2>(weight, seen[lane], first[t], last[t], values, key_stride, dim, dst); break;
      case 4: WeightedSum<4>(weight, seen[lane], first[t], last[t], values, key_stride, dim, dst); break;
      case 8: WeightedSum<8>(weight, seen[lane], first[t], last[t], values, key_stride, dim, dst); break;
      case 16: WeightedSum<16>(weight, seen[lane], first[t], last[t], values, key_stride, dim, dst); break;
      default: WeightedSum<0>(weight, seen[lane], first[t], last[t], values, key_stride, dim, dst);
    }
  }
}
};


ffi::Error Compute(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                   ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::PRED> visible,
                   ffi::Buffer<ffi::F32> bias, float scale, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = keys.dimensions(), md = visible.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 3)
    return ffi::Error::InvalidArgument("q[B, T, H, D], keys / values[B, S, KV, D], visible[B, T, S]");
  Operands o;
  o.batch = qd[0], o.steps = qd[1], o.heads = qd[2], o.dim = qd[3];
  o.slots = kd[1], o.kv_heads = kd[2], o.mask_steps = md[1];
  if (kd[0] != o.batch || kd[3] != o.dim || !Same(values.dimensions(), kd) ||
      o.kv_heads == 0 || o.heads % o.kv_heads || md[0] != o.batch ||
      (md[1] != o.steps && md[1] != 1) || md[2] != o.slots)
    return ffi::Error::InvalidArgument("attention operands' shapes do not agree");
  auto bd = bias.dimensions();
  const bool has_bias = bias.element_count() > 0;
  if (has_bias && (bd.size() != 4 || (bd[0] != o.batch && bd[0] != 1) || bd[1] != o.heads ||
                   bd[2] != o.steps || bd[3] != o.slots))
    return ffi::Error::InvalidArgument("bias must be [B or 1, H, T, S]");
  o.group = o.heads / o.kv_heads;
  o.bias_batch = has_bias ? bd[0] : 0;
  o.q = q.typed_data(), o.keys = keys.typed_data(), o.values = values.typed_data();
  o.bias = has_bias ? bias.typed_data() : nullptr;
  o.visible = visible.typed_data(), o.out = out->typed_data(), o.scale = scale;
  const int64_t rows = o.steps * o.group;
  const int64_t lanes = kWide && rows > 16 ? 16 : 8, blocks = (rows + lanes - 1) / lanes;
  const auto block = lanes == 16 ? Lanes<16>::Block : Lanes<8>::Block;
  // Each query's visible range, and each batch row's union of them.
  std::vector<int64_t> first(o.batch * o.steps), last(o.batch * o.steps), lo(o.batch), hi(o.batch);
  for (int64_t b = 0; b < o.batch; ++b) {
    lo[b] = o.slots, hi[b] = -1;
    for (int64_t t = 0; t < o.steps; ++t) {
      const bool* row = o.Visible(b, t);
      int64_t f = 0, l = o.slots - 1;
      while (f < o.slots && !row[f]) ++f;
      while (l >= f && !row[l]) --l;
      first[b * o.steps + t] = f, last[b * o.steps + t] = l;
      lo[b] = std::min(lo[b], f), hi[b] = std::max(hi[b], l);
    }
  }
  std::fill(o.out, o.out + o.batch * o.steps * o.heads * o.dim, 0.0f);  // queries that see nothing
  // Blocks of rows are independent: the cores share them (each row's sums are the same whichever
  // core computes them).
  const int64_t tasks = o.batch * o.kv_heads * blocks;
  auto run = [&](int part, int parts) {
    for (int64_t task = tasks * part / parts; task < tasks * (part + 1) / parts; ++task) {
      const int64_t b = task / (o.kv_heads * blocks), g = task / blocks % o.kv_heads;
      const int64_t r0 = task % blocks * lanes;
      if (hi[b] < lo[b]) continue;
      block(o, b, g, r0, lo[b], hi[b], first.data() + b * o.steps, last.data() + b * o.steps);
    }
  };
  if (tasks > 1)
    specjax::Team::Get().Run(run);
  else
    run(0, 1);
  return ffi::Error::Success();
}

// No exception may cross the FFI boundary (a thread's vector can fail to grow).
ffi::Error Attention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                     ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::PRED> visible,
                     ffi::Buffer<ffi::F32> bias, float scale, ffi::ResultBuffer<ffi::F32> out) {
  try {
    specjax::FlushDenormals flush;
    return Compute(q, keys, values, visible, bias, scale, out);
  } catch (const std::exception& error) {
    return ffi::Error::Internal(error.what());
  }
}

ffi::Error CacheWrite(ffi::Buffer<ffi::F32> keys_in, ffi::Buffer<ffi::F32> values_in,
                      ffi::Buffer<ffi::F32> new_keys, ffi::Buffer<ffi::F32> new_values,
                      ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::F32> keys,
                      ffi::ResultBuffer<ffi::F32> values) {
  auto kd = keys_in.dimensions(), nd = new_keys.dimensions(), sd = slots.dimensions();
  if (kd.size() != 4 || nd.size() != 4 || sd.size() != 2 || nd[0] != kd[0] || nd[2] != kd[2] ||
      nd[3] != kd[3] || sd[0] != nd[0] || sd[1] != nd[1] || !Same(new_values.dimensions(), nd) ||
      !Same(values_in.dimensions(), kd))
    return ffi::Error::InvalidArgument("cache[B, S, KV, D], new[B, T, KV, D], slots[B, T]");
  const int64_t batch = kd[0], length = kd[1], steps = nd[1], width = kd[2] * kd[3];
  // The outputs alias the inputs (the write is in place); copy only if XLA gave other buffers.
  if (keys->typed_data() != keys_in.typed_data())
    std::memcpy(keys->typed_data(), keys_in.typed_data(), keys_in.size_bytes());
  if (values->typed_data() != values_in.typed_data())
    std::memcpy(values->typed_data(), values_in.typed_data(), values_in.size_bytes());
  const int32_t* sp = slots.typed_data();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t slot = sp[b * steps + t];
      if (slot < 0 || slot >= length) continue;  // out of the buffer: dropped, as XLA's scatter does
      const int64_t from = (b * steps + t) * width, to = (b * length + slot) * width;
      std::memcpy(keys->typed_data() + to, new_keys.typed_data() + from, width * sizeof(float));
      std::memcpy(values->typed_data() + to, new_values.typed_data() + from, width * sizeof(float));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuCacheWrite, CacheWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
