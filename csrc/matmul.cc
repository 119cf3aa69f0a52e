// Matrix products of a few rows for XLA:CPU, at the memory's speed, each row computed alike whatever
// the row count.
//
// A decode step multiplies 1 row per sequence by every weight, a verification 5-33: the weights'
// bytes, not the arithmetic, set the cost, so a product should stream each weight once at the
// memory's speed. XLA:CPU's products of a few rows do not (they cost what they compute), nor did
// oneDNN's for one row inside a jitted program (15-16 GB/s in float32 where the machine reads 26-30).
// And speculative decoding is lossless token for token only if a verified token's sums come out bit
// for bit as its own one-token step's, while libraries pick their kernels (and so the order of a
// row's sums) by the row count.
//
// So: weights are packed once, at load, into panels of 32 columns (float32: [column / 32][k][32];
// bfloat16: [column / 32][k / 2][32][2], k's pairs side by side), the last panel zero-padded; a
// product reads each panel as one forward stream, fetched ahead of use; the panels are split between
// the cores (team.h); a core runs up to 12 rows at once against a panel, holding each row's 32 sums in
// two vector registers (with more rows the panel goes by in L1-sized chunks, each used by every
// block of rows). Every row's sum over k runs in the same order (k = 0, 1, ..., one fused
// multiply-add each, from zero) whatever the row count, the row's place in its block, the number of
// cores or the panel's owner: a row of a 17-row product is bit for bit that row alone.
// bfloat16 weights are widened to float32 as they are read (exact); rows against them are bfloat16
// (float32 rows are rounded to bfloat16 first, to nearest, ties to even); sums are float32, written
// as float32 or rounded once to bfloat16. Denormals count as zero (team.h's FlushDenormals).
//
// Without AVX-512 (a build for another CPU) the same sums run in 8-lane AVX2 registers, two rows at
// a time, or without either through std::fma, in the same order: equal results, slower. Where the
// CPU has AMX, bfloat16 products whose k is a multiple of 32 run on its tile unit instead, at every
// row count: other roundings than the fused multiply-adds', but still the same for a row whatever
// the other rows (AmxPanel).
//
//   specjax_cpu_matmul_packed_bytes(k, n, f32)        bytes of the packed [k, n] weight
//   specjax_cpu_matmul_pack(src, k, n, f32, dst)      row-major [k, n] -> packed
//   specjax_cpu_matmul_unpack(src, k, n, f32, dst)    and back
//   specjax_cpu_matmul_run(x, m, k, n, f32, packed, y) y[m, n] float32 of float32 rows x[m, k]
//   specjax_cpu_matmul_implementation()               "amx", "avx512", "avx2" or "portable"
//   SpecjaxCpuMatmul (XLA FFI)                        x[..., k], packed u8 -> y[..., n]
//       (attribute bfloat16_weights; rows float32 or bfloat16; writes float32 or bfloat16)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "team.h"
#include "xla/ffi/api/ffi.h"

namespace {

constexpr int64_t kColumns = 32;  // a panel's width: two 16-lane float32 registers
constexpr int kRows = 12;         // rows run against a panel at once (24 sums in registers)
// Weights are fetched this far ahead of their use: the hardware's own prefetcher, on one stream per
// core, left the product at 16-24 GB/s where the machine reads 26-33 (2-core Xeon, 2026-12).
constexpr int64_t kAhead = 2048;

int64_t Panels(int64_t n) { return (n + kColumns - 1) / kColumns; }

float Widen(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

uint16_t Narrow(float value) {  // to nearest bfloat16, ties to even; NaN stays NaN
  uint32_t word;
  std::memcpy(&word, &value, sizeof word);
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

// The packed weight: `depth` rows of a panel (k in float32, k / 2 rounded up in bfloat16 pairs),
// each 32 columns of 4 bytes (a float32, or a pair of bfloat16).
int64_t Depth(int64_t k, bool f32) { return f32 ? k : (k + 1) / 2; }
int64_t PanelBytes(int64_t k, bool f32) { return Depth(k, f32) * kColumns * 4; }
int64_t PackedBytes(int64_t k, int64_t n, bool f32) { return Panels(n) * PanelBytes(k, f32); }

// R rows x 32 sums over depth rows [begin, end) of one panel, added to sums[R][32] (resume) or
// from zero. Float32: x[R][stride] against [depth][32]. bfloat16: x as pairs of bfloat16 (k
// zero-padded to even) against [depth][32][2]; each pair adds its odd product, then its even one
// (as VDPBF16PS does; a product of two bfloat16 is exact in float32, so each addition rounds once).
#if defined(__AVX512F__)
template <int R, bool F32>
void Block(const void* x_rows, int64_t stride, int64_t begin, int64_t end, const void* panel,
           float* sums, bool resume) {
  __m512 low[R], high[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    low[r] = resume ? _mm512_loadu_ps(sums + r * kColumns) : _mm512_setzero_ps();
    high[r] = resume ? _mm512_loadu_ps(sums + r * kColumns + 16) : _mm512_setzero_ps();
  }
  const __m512i odd_bits = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t i = begin; i < end; ++i) {
    const char* w = static_cast<const char*>(panel) + i * kColumns * 4;
    _mm_prefetch(w + kAhead, _MM_HINT_T0);
    _mm_prefetch(w + kAhead + 64, _MM_HINT_T0);
    if constexpr (F32) {
      const float* x = static_cast<const float*>(x_rows);
      const __m512 a = _mm512_loadu_ps(w), b = _mm512_loadu_ps(w + 64);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(x[r * stride + i]);
        low[r] = _mm512_fmadd_ps(s, a, low[r]);
        high[r] = _mm512_fmadd_ps(s, b, high[r]);
      }
    } else {
      const uint32_t* x = static_cast<const uint32_t*>(x_rows);
      const __m512i a = _mm512_loadu_si512(w), b = _mm512_loadu_si512(w + 64);
      const __m512 a_even = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
      const __m512 a_odd = _mm512_castsi512_ps(_mm512_and_si512(a, odd_bits));
      const __m512 b_even = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
      const __m512 b_odd = _mm512_castsi512_ps(_mm512_and_si512(b, odd_bits));
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512i pair = _mm512_set1_epi32(static_cast<int>(x[r * stride + i]));
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pair, odd_bits));
        low[r] = _mm512_fmadd_ps(even, a_even, _mm512_fmadd_ps(odd, a_odd, low[r]));
        high[r] = _mm512_fmadd_ps(even, b_even, _mm512_fmadd_ps(odd, b_odd, high[r]));
      }
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(sums + r * kColumns, low[r]);
    _mm512_storeu_ps(sums + r * kColumns + 16, high[r]);
  }
}
constexpr const char* kImplementation = "avx512";

// Sums to bfloat16 as Narrow rounds them, 16 at a time.
void NarrowRow(const float* from, int64_t count, uint16_t* to) {
  int64_t c = 0;
  for (; c + 16 <= count; c += 16) {
    const __m512i word = _mm512_castps_si512(_mm512_loadu_ps(from + c));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(word, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(word, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(word, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(word, 16),
                                   _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + c), _mm512_cvtepi32_epi16(rounded));
  }
  for (; c < count; ++c) to[c] = Narrow(from[c]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 holds a row's 32 sums in four 8-lane registers, so two rows fit the 16 registers at once: the
// block's rows go by in pairs (Pair). The row count of a pair is a template argument so that its
// sums stay in registers (a runtime count left them on the stack: every multiply-add a load and a
// store, 4 rows cost 2.3x one row and 8 rows 4.6x, where the weights' read should set the cost).
// The range goes by in chunks of kPairChunk depth rows (8 KB, in L1), every pair running over a
// chunk before the next: the weights come from memory once, and each pair fetches its share of the
// next chunk's weights while it runs, so the memory keeps streaming whichever pair is computing
// (past the range's end that is the next panel, or nothing: a prefetch never faults). A row's
// sums still run over k in order from zero (a chunk resumes them): the same sums in the same order.
constexpr int64_t kPairChunk = 64;

template <int P, bool F32>
inline void Pair(const void* x_rows, int64_t stride, int64_t begin, int64_t end, const char* panel,
                 float* sums, bool resume, int64_t fetch_from, int64_t fetch_to) {
  const __m256i odd_bits = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[P][4];
#pragma GCC unroll 2
  for (int r = 0; r < P; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      acc[r][j] = resume ? _mm256_loadu_ps(sums + r * kColumns + 8 * j) : _mm256_setzero_ps();
  // This pair's share of the next chunk's bytes, two cache lines (a depth row's) per depth row.
  int64_t fetch = fetch_from;
  for (int64_t i = begin; i < end; ++i) {
    const char* w = panel + i * kColumns * 4;
    if (fetch < fetch_to) {
      _mm_prefetch(panel + fetch, _MM_HINT_T0);
      _mm_prefetch(panel + fetch + 64, _MM_HINT_T0);
      fetch += 128;
    }
    if constexpr (F32) {
      const float* x = static_cast<const float*>(x_rows);
      __m256 s[P];
#pragma GCC unroll 2
      for (int r = 0; r < P; ++r) s[r] = _mm256_set1_ps(x[r * stride + i]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 wj = _mm256_loadu_ps(reinterpret_cast<const float*>(w) + 8 * j);
#pragma GCC unroll 2
        for (int r = 0; r < P; ++r) acc[r][j] = _mm256_fmadd_ps(s[r], wj, acc[r][j]);
      }
    } else {
      const uint32_t* x = static_cast<const uint32_t*>(x_rows);
      __m256 even[P], odd[P];
#pragma GCC unroll 2
      for (int r = 0; r < P; ++r) {
        const __m256i pair = _mm256_set1_epi32(static_cast<int>(x[r * stride + i]));
        even[r] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
        odd[r] = _mm256_castsi256_ps(_mm256_and_si256(pair, odd_bits));
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i ws = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
        const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(ws, 16));
        const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(ws, odd_bits));
#pragma GCC unroll 2
        for (int r = 0; r < P; ++r)
          acc[r][j] = _mm256_fmadd_ps(even[r], w_even, _mm256_fmadd_ps(odd[r], w_odd, acc[r][j]));
      }
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < P; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(sums + r * kColumns + 8 * j, acc[r][j]);
}

template <int R, bool F32>
void Block(const void* x_rows, int64_t stride, int64_t begin, int64_t end, const void* panel,
           float* sums, bool resume) {
  constexpr int kPairs = (R + 1) / 2;
  const char* weights = static_cast<const char*>(panel);
  const int64_t row_bytes = kColumns * 4;
  for (int64_t chunk = begin; chunk < end; chunk += kPairChunk) {
    const int64_t chunk_end = std::min(end, chunk + kPairChunk);
    // The next chunk's bytes, shared out between the pairs in whole depth rows.
    const int64_t next_from = chunk_end * row_bytes, next_to = next_from + kPairChunk * row_bytes;
    const int64_t share = (kPairChunk + kPairs - 1) / kPairs * row_bytes;
    for (int q = 0; q < kPairs; ++q) {
      const int r0 = 2 * q;
      const void* x = static_cast<const char*>(x_rows) + r0 * stride * 4;
      const int64_t from = next_from + q * share, to = std::min(next_to, from + share);
      if (R - r0 >= 2)
        Pair<2, F32>(x, stride, chunk, chunk_end, weights, sums + r0 * kColumns,
                     resume || chunk > begin, from, to);
      else
        Pair<1, F32>(x, stride, chunk, chunk_end, weights, sums + r0 * kColumns,
                     resume || chunk > begin, from, to);
    }
  }
}
constexpr const char* kImplementation = "avx2";

void NarrowRow(const float* from, int64_t count, uint16_t* to) {
  for (int64_t c = 0; c < count; ++c) to[c] = Narrow(from[c]);
}
#else
template <int R, bool F32>
void Block(const void* x_rows, int64_t stride, int64_t begin, int64_t end, const void* panel,
           float* sums, bool resume) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kColumns; ++c) {
      float sum = resume ? sums[r * kColumns + c] : 0.0f;
      for (int64_t i = begin; i < end; ++i) {
        if constexpr (F32) {
          const float w = static_cast<const float*>(panel)[i * kColumns + c];
          sum = std::fma(static_cast<const float*>(x_rows)[r * stride + i], w, sum);
        } else {
          const uint32_t pair = static_cast<const uint32_t*>(x_rows)[r * stride + i];
          const uint16_t* w = static_cast<const uint16_t*>(panel) + (i * kColumns + c) * 2;
          sum = std::fma(Widen(static_cast<uint16_t>(pair >> 16)), Widen(w[1]), sum);
          sum = std::fma(Widen(static_cast<uint16_t>(pair)), Widen(w[0]), sum);
        }
      }
      sums[r * kColumns + c] = sum;
    }
}
constexpr const char* kImplementation = "portable";

void NarrowRow(const float* from, int64_t count, uint16_t* to) {
  for (int64_t c = 0; c < count; ++c) to[c] = Narrow(from[c]);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX: a bfloat16 product as 16 x 16 tiles of sums, each TDPBF16PS adding 16 of k's pairs at once.
// The tile unit rounds its sums its own way (not the fused multiply-adds' order), so where it is
// used it runs every row count, one row included, and a row's sums stay the same whatever the
// other rows: a tile's row is computed from that row alone, and k goes by in the same 16-pair steps.
bool AmxGranted() {  // Linux hands out the tile registers' state on request only
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

// This thread's tile registers while it lives: eight of 16 rows x 64 bytes. Tiles 0-3 hold sums
// (two row tiles x two column halves of a panel), 4-5 rows of x, 6-7 the panel's two halves.
class Tiles {
 public:
  Tiles() {
    struct {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes_per_row[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
};

// sums[rows16][32] = x[rows16][depth pairs] x panel [depth][32][2], rows16 a multiple of 16 and
// depth of 16: 32 rows at a time, the panel's 16-pair steps read straight from its layout (a row of
// pairs is 128 bytes: one tile row per column half).
void AmxPanel(const char* x, int64_t rows16, int64_t depth, const char* panel, float* sums) {
  const int64_t stride = depth * 4;
  for (int64_t r = 0; r < rows16; r += 32) {
    const bool two = rows16 - r > 16;
    const char* a = x + r * stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < depth; i += 16) {
      const char* w = panel + i * kColumns * 4;
      for (int64_t line = 0; line < 16 * kColumns * 4; line += 64)  // two steps ahead
        _mm_prefetch(w + 2 * kAhead + line, _MM_HINT_T0);
      _tile_loadd(6, w, kColumns * 4);
      _tile_loadd(7, w + 64, kColumns * 4);
      _tile_loadd(4, a + i * 4, stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, a + 16 * stride + i * 4, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums + r * kColumns, kColumns * 4);
    _tile_stored(1, sums + r * kColumns + 16, kColumns * 4);
    if (two) {
      _tile_stored(2, sums + (r + 16) * kColumns, kColumns * 4);
      _tile_stored(3, sums + (r + 16) * kColumns + 16, kColumns * 4);
    }
  }
}

// The tile unit takes a product of bfloat16 pairs whose k is a whole number of 16-pair steps.
bool UseAmx(int64_t depth) { return depth % 16 == 0 && AmxGranted(); }
#else
bool UseAmx(int64_t) { return false; }
void AmxPanel(const char*, int64_t, int64_t, const char*, float*) {}
struct Tiles {};
#endif

// `rows` (1 .. kRows) rows through Block.
template <bool F32>
void RunBlock(int rows, const void* x, int64_t stride, int64_t begin, int64_t end,
              const void* panel, float* sums, bool resume) {
  using Kernel = void (*)(const void*, int64_t, int64_t, int64_t, const void*, float*, bool);
  static constexpr Kernel kernels[kRows] = {
      Block<1, F32>, Block<2, F32>, Block<3, F32>,  Block<4, F32>,  Block<5, F32>,  Block<6, F32>,
      Block<7, F32>, Block<8, F32>, Block<9, F32>, Block<10, F32>, Block<11, F32>, Block<12, F32>};
  kernels[rows - 1](x, stride, begin, end, panel, sums, resume);
}

// sums[m][32] into columns [first, first + 32) of y[m, n] (float32, or rounded to bfloat16).
void WriteColumns(const float* sums, int64_t m, int64_t n, int64_t first, void* y, bool out_f32) {
  const int64_t columns = std::min(kColumns, n - first);
  for (int64_t r = 0; r < m; ++r) {
    const float* from = sums + r * kColumns;
    if (out_f32)
      std::memcpy(static_cast<float*>(y) + r * n + first, from, columns * 4);
    else
      NarrowRow(from, columns, static_cast<uint16_t*>(y) + r * n + first);
  }
}

// Columns [32 p, 32 p + 32) of y[m, n] = x[m, ...] x panel p; y float32 or bfloat16 (out_f32).
// The rows run in blocks of at most kRows, as even as can be (17 rows: 9 and 8). With more than one
// block the panel goes by in chunks of kChunk depth rows, each run against every block while it sits
// in the L1 cache: the weights then stream from memory while all the rows compute, not during the
// first block only. A row's sums still run over k in order from zero (a chunk resumes them).
template <bool F32>
void Panel(const char* x, int64_t m, int64_t depth, int64_t n, const char* panel, int64_t p,
           void* y, bool out_f32) {
  constexpr int64_t kChunk = 64;  // 8 KB of weights
  thread_local std::vector<float> sums;
  sums.resize(m * kColumns);
  const int64_t first = p * kColumns;
  const int64_t blocks = (m + kRows - 1) / kRows, chunk = blocks == 1 ? depth : kChunk;
  for (int64_t begin = 0; begin < depth; begin += chunk) {
    const int64_t end = std::min(depth, begin + chunk);
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t row = m * block / blocks;
      const int rows = static_cast<int>(m * (block + 1) / blocks - row);
      RunBlock<F32>(rows, x + row * depth * 4, depth, begin, end, panel, &sums[row * kColumns],
                    begin > 0);
    }
  }
  WriteColumns(sums.data(), m, n, first, y, out_f32);
}

// y[m, n] = x[m, ...] x packed weight, the panels split between the team's threads.
template <bool F32>
void Product(const char* x, int64_t m, int64_t k, int64_t n, const char* packed, void* y,
             bool out_f32) {
  const int64_t panels = Panels(n), depth = Depth(k, F32), panel_bytes = PanelBytes(k, F32);
  const bool amx = !F32 && UseAmx(depth);
  // The tile unit reads x in tiles of 16 rows: a copy padded with zero rows.
  const int64_t rows16 = (m + 15) / 16 * 16;
  std::vector<char> padded;
  if (amx) {
    padded.assign(rows16 * depth * 4, 0);
    std::memcpy(padded.data(), x, m * depth * 4);
  }
  auto run = [&](int part, int parts) {
    const int64_t begin = panels * part / parts, end = panels * (part + 1) / parts;
    if (!amx) {
      for (int64_t p = begin; p < end; ++p)
        Panel<F32>(x, m, depth, n, packed + p * panel_bytes, p, y, out_f32);
      return;
    }
    Tiles tiles;
    thread_local std::vector<float> sums;
    sums.resize(rows16 * kColumns);
    for (int64_t p = begin; p < end; ++p) {
      AmxPanel(padded.data(), rows16, depth, packed + p * panel_bytes, sums.data());
      WriteColumns(sums.data(), m, n, p * kColumns, y, out_f32);
    }
  };
  // Small products are not worth waking the other cores.
  if (m * k * n < (int64_t{1} << 16) || panels == 1)
    run(0, 1);
  else
    specjax::Team::Get().Run(run);
}

namespace ffi = xla::ffi;

ffi::Error Compute(ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::Result<ffi::AnyBuffer> y,
                   bool bfloat16_weights) {
  const ffi::DataType in = x.element_type(), out = y->element_type();
  if (in != ffi::DataType::F32 && in != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("the product reads float32 or bfloat16 rows");
  if (!bfloat16_weights && (in != ffi::DataType::F32 || out != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("a float32 weight reads and writes float32");
  if (out != ffi::DataType::F32 && out != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("the product writes float32 or bfloat16");
  auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("x needs at least one dimension");
  const int64_t k = dims.back();
  int64_t m = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) m *= dims[i];
  auto out_dims = y->dimensions();
  if (out_dims.size() < 1 || static_cast<int64_t>(y->element_count()) != m * out_dims.back())
    return ffi::Error::InvalidArgument("y must hold x's rows, each of the product's columns");
  const int64_t n = out_dims.back();
  const bool f32 = !bfloat16_weights;
  if (static_cast<int64_t>(packed.size_bytes()) != PackedBytes(k, n, f32))
    return ffi::Error::InvalidArgument("packed weight does not match this product's shape");
  if (m == 0) return ffi::Error::Success();
  const char* weights = static_cast<const char*>(packed.untyped_data());
  const char* rows = static_cast<const char*>(x.untyped_data());
  if (f32) {
    Product<true>(rows, m, k, n, weights, y->untyped_data(), true);
    return ffi::Error::Success();
  }
  // Rows for bfloat16 weights are read as bfloat16 pairs: float32 rows are rounded here (as XLA's
  // convert rounds them), and a row of odd length gets a zero to pair its last element with.
  const int64_t even = k + k % 2;
  if (in == ffi::DataType::F32 || even != k) {
    thread_local std::vector<uint16_t> pairs;
    pairs.assign(m * even, 0);
    for (int64_t r = 0; r < m; ++r) {
      if (in == ffi::DataType::F32)
        NarrowRow(reinterpret_cast<const float*>(rows) + r * k, k, &pairs[r * even]);
      else
        std::memcpy(&pairs[r * even], rows + r * k * 2, k * 2);
    }
    rows = reinterpret_cast<const char*>(pairs.data());
  }
  Product<false>(rows, m, k, n, weights, y->untyped_data(), out == ffi::DataType::F32);
  return ffi::Error::Success();
}

// No exception may cross the FFI boundary (a thread's vector can fail to grow).
ffi::Error Matmul(ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::Result<ffi::AnyBuffer> y,
                  bool bfloat16_weights) {
  try {
    specjax::FlushDenormals flush;
    return Compute(x, packed, y, bfloat16_weights);
  } catch (const std::exception& error) {
    return ffi::Error::Internal(error.what());
  }
}

// Row-major [k, n] <-> packed: float32 [panel][k][32]; bfloat16 [panel][k / 2][32][2] (element
// (i, column) at pair i / 2, slot i % 2). Padding (columns past n, the odd k's last pair) is zero.
template <typename T>
void Repack(const T* from, int64_t k, int64_t n, T* to, bool pack) {
  const bool pairs = sizeof(T) == 2;
  const int64_t depth = pairs ? (k + 1) / 2 : k, per = pairs ? 2 : 1;
  if (pack) std::memset(to, 0, Panels(n) * depth * kColumns * per * sizeof(T));
  for (int64_t p = 0; p < Panels(n); ++p)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t c = 0; c < kColumns && p * kColumns + c < n; ++c) {
        const int64_t column = p * kColumns + c;
        const int64_t slot = ((p * depth + i / per) * kColumns + c) * per + i % per;
        if (pack)
          to[slot] = from[i * n + column];
        else
          to[i * n + column] = from[slot];
      }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("bfloat16_weights"));

extern "C" {

// `f32`: 1 for a float32 weight, 0 for bfloat16.
int64_t specjax_cpu_matmul_packed_bytes(int64_t k, int64_t n, int f32) {
  return PackedBytes(k, n, f32 != 0);
}

int specjax_cpu_matmul_pack(const void* src, int64_t k, int64_t n, int f32, void* dst) {
  if (f32)
    Repack(static_cast<const uint32_t*>(src), k, n, static_cast<uint32_t*>(dst), true);
  else
    Repack(static_cast<const uint16_t*>(src), k, n, static_cast<uint16_t*>(dst), true);
  return 0;
}

int specjax_cpu_matmul_unpack(const void* src, int64_t k, int64_t n, int f32, void* dst) {
  if (f32)
    Repack(static_cast<const uint32_t*>(src), k, n, static_cast<uint32_t*>(dst), false);
  else
    Repack(static_cast<const uint16_t*>(src), k, n, static_cast<uint16_t*>(dst), false);
  return 0;
}

// "amx" where bfloat16 products of whole 16-pair steps run on the tile unit (the float32 ones and
// the rest on kImplementation's code).
const char* specjax_cpu_matmul_implementation() { return UseAmx(16) ? "amx" : kImplementation; }

// The threads a product runs on (the team's size; tests check SPECJAX_CPU_THREADS took).
int specjax_cpu_threads() { return specjax::Team::Get().size(); }

// The product outside XLA (tests compare builds with it): float32 rows, float32 out.
void specjax_cpu_matmul_run(const float* x, int64_t m, int64_t k, int64_t n, int f32,
                            const void* packed, float* y) {
  specjax::FlushDenormals flush;
  const char* weights = static_cast<const char*>(packed);
  if (f32) return Product<true>(reinterpret_cast<const char*>(x), m, k, n, weights, y, true);
  const int64_t even = k + k % 2;
  std::vector<uint16_t> pairs(m * even, 0);
  for (int64_t r = 0; r < m; ++r) NarrowRow(x + r * k, k, &pairs[r * even]);
  Product<false>(reinterpret_cast<const char*>(pairs.data()), m, k, n, weights, y, true);
}

}  // extern "C"
