// The CPU path's LoRA delta over a step's short adapter segments, one call a linear.
//
// At decode a step's rows under one adapter are a handful (8 lines of each of 8 adapters: 8 rows a
// segment) and the arithmetic is small: what a step pays is reading every resident adapter's A
// and B once (8 adapters of ranks 8-64 on the default model's seven projections: 351 MB in fp32,
// 65% of the base model's bytes). Issued from Python (a matmul, then an addmm_ a piece, each with
// its views) or even through BLAS, these tiny GEMMs read their weights at half the machine's
// bandwidth: BLAS packs each small operand before multiplying it. Here each weight is streamed
// once, in the order it is stored, straight into registers:
//
//   shrink  y[rows, R] = x[rows] @ A.T         A stored as At [R/16, in, 16] (R padded to 16)
//   expand  out[rows, cols] += y[:, ranks] @ (s * B).T, per piece
//                                              s * B stored as Bt [cols/16, rank, 16] (cols padded)
//
// Both are "broadcast one input value, FMA it with 16 weights" loops over up to 8 rows at a time
// (4 with AVX2, whose 16 lanes take two registers):
// no horizontal sums, one sequential pass over the weights. x, out and the weights are fp32 or
// bf16 (bf16 is widened in registers; y and the sums are fp32; out is rounded once, to nearest
// even). The layouts are made once per adapter by engine/layers/lora.py (ModuleLoRA.kernel_args).
//
// With AVX512-BF16 (compiled for a CPU that has it) a bf16 linear takes another path: its weights
// are stored as pairs of depth, [blocks, depth/2, 16, 2], and each `vdpbf16ps` multiplies a
// broadcast pair of inputs (x[k], x[k+1]) with 16 lanes' pairs and adds both products: twice the
// multiply-adds of an fp32 FMA an instruction, with no widening of the weights. x is read as it
// is (bf16), the shrink's y is rounded to bf16 as torch's bf16 matmul rounds it, sums are fp32.
// Such a path is also quick enough for a prompt chunk's long segments (engine/layers/lora.py
// sends it every bf16 segment): the weights of two 16-column blocks stay in L1 while every row
// block passes over them.
//
// With more than one thread the work is split over (segment, 16-column block) items, for the
// shrink and then for the expand: the ranks differ by adapter, so splitting by segment alone would
// leave a thread waiting on the rank-64 adapter.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "lora_segment.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;
// Rows a register block holds: 8 x one zmm accumulator with AVX-512; with AVX2 a 16-lane row
// is two ymm, and 4 rows (8 accumulators, 2 weight registers, broadcasts) fill the 16 ymm.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BOXCAR_LORA_BF16_PAIRS 1
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define BOXCAR_LORA_AVX2 1
constexpr int kRowBlock = 4;
#else
constexpr int kRowBlock = 8;
#endif

// How far ahead of its loads a block's weights are prefetched. A decode step streams every
// resident adapter from memory (176 MB for bench.lora's 8 adapters) in short runs that the
// hardware prefetchers start on late. On a Zen 5 core, one sweep of the distance (a bf16 step's
// LoRA, bench.lora_kernel --layers 30): none 16.5 ms, 1 KB 13.2, 2 KB 11.8, 4 KB 10.6, 8 KB 12.6;
// interleaved with the code before, 18.9-23.7 ms -> 12.9-16.0 (memory speed varies there). The
// AMX path's distance too.
constexpr int64_t kAheadBytes = 4096;

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (no NaN inputs here)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#elif defined(BOXCAR_LORA_AVX2)
// 16 lanes as two ymm. A partial block (lanes < 16, only a piece's last columns) goes through a
// zero-padded copy.
struct V16 {
  __m256 lo, hi;
};
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load16(const uint16_t* p) { return {widen8(p), widen8(p + 8)}; }
inline void narrow8(uint16_t* p, __m256 v) {  // round to nearest even, then pack to 16 bits
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store16(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store16(uint16_t* p, V16 v) {
  narrow8(p, v.lo);
  narrow8(p + 8, v.hi);
}
template <typename D>
inline V16 load16(const D* p, int lanes) {
  if (lanes >= kLanes) return load16(p);
  D tmp[kLanes] = {};
  std::memcpy(tmp, p, lanes * sizeof(D));
  return load16(tmp);
}
template <typename D>
inline void store16(D* p, V16 v, int lanes) {
  if (lanes >= kLanes) return store16(p, v);
  D tmp[kLanes];
  store16(tmp, v);
  std::memcpy(p, tmp, lanes * sizeof(D));
}
#endif

// A tensor's elements as T: float for fp32, the raw bits (uint16_t) for bf16.
template <typename T>
T* elements(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }
inline void from_float(float* p, float v) { *p = v; }
inline void from_float(uint16_t* p, float v) { *p = float_to_bf16(v); }

// acc[i][0..lanes) += sum_k v[i * ldv + k] * w[k * 16 + 0..16) for i < ROWS, k < depth;
// acc starts from init (or zero) and is written to dst rows (ld_dst apart), lanes masked.
template <int ROWS, typename W, typename D>
void block(const float* v, int64_t ldv, const W* w, int64_t depth, D* dst,
           int64_t ld_dst, int lanes, bool accumulate) {
#if defined(__AVX512F__)
  const __mmask16 mask = lanes >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << lanes) - 1);
  __m512 acc[ROWS];
  for (int i = 0; i < ROWS; ++i)
    acc[i] = accumulate ? load16(dst + i * ld_dst, mask) : _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * kLanes) + kAheadBytes, _MM_HINT_T0);
    const __m512 wk = load16(w + k * kLanes);
    for (int i = 0; i < ROWS; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(v[i * ldv + k]), wk, acc[i]);
  }
  for (int i = 0; i < ROWS; ++i) store16(dst + i * ld_dst, acc[i], mask);
#elif defined(BOXCAR_LORA_AVX2)
  V16 acc[ROWS];
  for (int i = 0; i < ROWS; ++i)
    acc[i] = accumulate ? load16(dst + i * ld_dst, lanes)
                        : V16{_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t k = 0; k < depth; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * kLanes) + kAheadBytes, _MM_HINT_T0);
    const V16 wk = load16(w + k * kLanes);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 vi = _mm256_set1_ps(v[i * ldv + k]);
      acc[i].lo = _mm256_fmadd_ps(vi, wk.lo, acc[i].lo);
      acc[i].hi = _mm256_fmadd_ps(vi, wk.hi, acc[i].hi);
    }
  }
  for (int i = 0; i < ROWS; ++i) store16(dst + i * ld_dst, acc[i], lanes);
#else
  float acc[ROWS][kLanes];
  for (int i = 0; i < ROWS; ++i)
    for (int l = 0; l < kLanes; ++l)
      acc[i][l] = accumulate && l < lanes ? to_float(dst[i * ld_dst + l]) : 0.0f;
  for (int64_t k = 0; k < depth; ++k) {
    float wk[kLanes];
    for (int l = 0; l < kLanes; ++l) wk[l] = to_float(w[k * kLanes + l]);
    for (int i = 0; i < ROWS; ++i) {
      const float s = v[i * ldv + k];
      for (int l = 0; l < kLanes; ++l) acc[i][l] += s * wk[l];
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int l = 0; l < lanes; ++l) from_float(dst + i * ld_dst + l, acc[i][l]);
#endif
}

// block() over any number of rows, kRowBlock at a time.
template <typename W, typename D>
void rows_block(int64_t rows, const float* v, int64_t ldv, const W* w, int64_t depth,
                D* dst, int64_t ld_dst, int lanes, bool accumulate) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const float* vr = v + r0 * ldv;
    D* dr = dst + r0 * ld_dst;
    switch (std::min<int64_t>(kRowBlock, rows - r0)) {
#define BOXCAR_ROWS(n) \
  case n: block<n>(vr, ldv, w, depth, dr, ld_dst, lanes, accumulate); break;
      BOXCAR_ROWS(1) BOXCAR_ROWS(2) BOXCAR_ROWS(3) BOXCAR_ROWS(4)
#if !defined(BOXCAR_LORA_AVX2)
      BOXCAR_ROWS(5) BOXCAR_ROWS(6) BOXCAR_ROWS(7) BOXCAR_ROWS(8)
#endif
#undef BOXCAR_ROWS
    }
  }
}

#if defined(BOXCAR_LORA_BF16_PAIRS)
// acc[i][0..lanes) += sum_p v[i][2p] * w[p][.][0] + v[i][2p+1] * w[p][.][1] for i < ROWS,
// p < pairs, for NB blocks of 16 columns side by side (block j's weights at w + j * pairs * 32,
// its columns at dst + j * 16; ``lanes`` masks the last one): v and w bf16, w as [pairs, 16, 2];
// written to dst (bf16) rows. Two blocks share each broadcast of v.
template <int ROWS, int NB>
void block_pairs(const uint16_t* v, int64_t ldv, const uint16_t* w, int64_t pairs,
                 uint16_t* dst, int64_t ld_dst, int lanes, bool accumulate) {
  __mmask16 mask[NB];
  for (int j = 0; j < NB; ++j)
    mask[j] = j < NB - 1 || lanes >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << lanes) - 1);
  __m512 acc[ROWS][NB];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < NB; ++j)
      acc[i][j] = accumulate ? load16(dst + i * ld_dst + j * kLanes, mask[j])
                             : _mm512_setzero_ps();
  const int64_t w_step = pairs * 2 * kLanes;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wp[NB];
    for (int j = 0; j < NB; ++j) {
      const uint16_t* line = w + j * w_step + p * 2 * kLanes;  // one 64-byte line a pair
      _mm_prefetch(reinterpret_cast<const char*>(line) + kAheadBytes, _MM_HINT_T0);
      wp[j] = (__m512bh)_mm512_loadu_si512(line);
    }
    for (int i = 0; i < ROWS; ++i) {
      uint32_t pair;  // (v[2p], v[2p + 1]): one 32-bit broadcast
      std::memcpy(&pair, v + i * ldv + 2 * p, sizeof pair);
      const __m512bh vi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], vi, wp[j]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < NB; ++j) store16(dst + i * ld_dst + j * kLanes, acc[i][j], mask[j]);
}

template <int NB>
void rows_pairs(int64_t rows, const uint16_t* v, int64_t ldv, const uint16_t* w, int64_t pairs,
                uint16_t* dst, int64_t ld_dst, int lanes, bool accumulate) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const uint16_t* vr = v + r0 * ldv;
    uint16_t* dr = dst + r0 * ld_dst;
    switch (std::min<int64_t>(kRowBlock, rows - r0)) {
#define BOXCAR_ROWS(n) \
  case n: block_pairs<n, NB>(vr, ldv, w, pairs, dr, ld_dst, lanes, accumulate); break;
      BOXCAR_ROWS(1) BOXCAR_ROWS(2) BOXCAR_ROWS(3) BOXCAR_ROWS(4)
      BOXCAR_ROWS(5) BOXCAR_ROWS(6) BOXCAR_ROWS(7) BOXCAR_ROWS(8)
#undef BOXCAR_ROWS
    }
  }
}

// rows_pairs over one or two blocks
inline void rows_pairs(int nb, int64_t rows, const uint16_t* v, int64_t ldv, const uint16_t* w,
                       int64_t pairs, uint16_t* dst, int64_t ld_dst, int lanes, bool accumulate) {
  if (nb == 2) {
    rows_pairs<2>(rows, v, ldv, w, pairs, dst, ld_dst, lanes, accumulate);
  } else {
    rows_pairs<1>(rows, v, ldv, w, pairs, dst, ld_dst, lanes, accumulate);
  }
}
#endif

struct Work {
  int64_t segment;
  int64_t piece;  // -1: a shrink block
  int64_t block;  // 16-column block of y (shrink) or of the piece's columns (expand)
  int64_t blocks = 1;  // how many side by side, from block on (the bf16 pair path takes 2)
};

// Work items over blocks [0, n), `width` at a time (the last may hold fewer).
void push_blocks(std::vector<Work>& items, int64_t segment, int64_t piece, int64_t n,
                 int64_t width) {
  for (int64_t b = 0; b < n; b += width) items.push_back({segment, piece, b, std::min(width, n - b)});
}

// fn over the work items, on torch's threads when there are more than one.
template <typename Fn>
void for_each(const std::vector<Work>& items, Fn&& fn) {
  const auto n = static_cast<int64_t>(items.size());
  if (at::get_num_threads() > 1 && n > 1) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t finish) {
      for (int64_t i = begin; i < finish; ++i) fn(items[i]);
    });
  } else {
    for (const auto& item : items) fn(item);
  }
}

template <typename T>
void run(const at::Tensor& x, at::Tensor& out, const std::vector<Segment>& segments) {
  const int64_t in = x.size(1), ldx = x.stride(0), ldo = out.stride(0);
  const auto count = static_cast<int64_t>(segments.size());
  // fp32 copies of the segments' x rows (bf16 x), and their y: one buffer each, per segment
  std::vector<int64_t> x_at(count + 1, 0), y_at(count + 1, 0);
  std::vector<Work> shrink, expand;
  for (int64_t s = 0; s < count; ++s) {
    const auto& [start, end, at_, bts, meta] = segments[s];
    const int64_t rows = end - start, padded = at_.size(0) * kLanes;
    x_at[s + 1] = x_at[s] + (std::is_same_v<T, float> ? 0 : rows * in);
    y_at[s + 1] = y_at[s] + rows * padded;
    for (int64_t b = 0; b < at_.size(0); ++b) shrink.push_back({s, -1, b});
    for (size_t p = 0; p < bts.size(); ++p)
      for (int64_t b = 0; b < bts[p].size(0); ++b)
        expand.push_back({s, static_cast<int64_t>(p), b});
  }
  std::vector<float> xf(x_at[count]), y(y_at[count]);
  const T* xp = elements<T>(x);
  T* op = elements<T>(out);
  auto x_rows = [&](int64_t s, int64_t* ld) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      *ld = ldx;
      return xp + std::get<0>(segments[s]) * ldx;
    } else {
      *ld = in;
      return xf.data() + x_at[s];
    }
  };
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t s = 0; s < count; ++s) {
      const int64_t start = std::get<0>(segments[s]), end = std::get<1>(segments[s]);
      float* dst = xf.data() + x_at[s];
      for (int64_t r = start; r < end; ++r)
        for (int64_t k = 0; k < in; ++k) dst[(r - start) * in + k] = to_float(xp[r * ldx + k]);
    }
  }
  auto do_shrink = [&](const Work& w) {
    const auto& [start, end, at_, bts, meta] = segments[w.segment];
    const int64_t padded = at_.size(0) * kLanes;
    int64_t ld;
    const float* xs = x_rows(w.segment, &ld);
    const T* a = elements<T>(at_) + w.block * in * kLanes;
    rows_block(end - start, xs, ld, a, in, y.data() + y_at[w.segment] + w.block * kLanes,
               padded, kLanes, false);
  };
  auto do_expand = [&](const Work& w) {
    const auto& [start, end, at_, bts, meta] = segments[w.segment];
    const int64_t padded = at_.size(0) * kLanes;
    const int64_t col_offset = meta[4 * w.piece], col_size = meta[4 * w.piece + 1];
    const int64_t rank_offset = meta[4 * w.piece + 2], rank = meta[4 * w.piece + 3];
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, col_size - w.block * kLanes));
    const T* b = elements<T>(bts[w.piece]) + w.block * rank * kLanes;
    rows_block(end - start, y.data() + y_at[w.segment] + rank_offset, padded,
               b, rank,
               op + start * ldo + col_offset + w.block * kLanes, ldo, lanes, true);
  };
  for_each(shrink, do_shrink);
  for_each(expand, do_expand);
}

#if defined(BOXCAR_LORA_BF16_PAIRS)
// run() for bf16 weights in pairs of depth: y is bf16 (rounded once, as a bf16 matmul's output).
void run_pairs(const at::Tensor& x, at::Tensor& out, const std::vector<Segment>& segments) {
  const int64_t in = x.size(1), ldo = out.stride(0), in_pairs = (in + 1) / 2;
  const auto count = static_cast<int64_t>(segments.size());
  const uint16_t* xp = elements<uint16_t>(x);
  uint16_t* op = elements<uint16_t>(out);
  // An odd width's rows get a zero-padded copy: a pair read must not run past the tensor.
  const bool copy_x = in % 2 != 0;
  std::vector<int64_t> x_at(count + 1, 0), y_at(count + 1, 0);
  std::vector<Work> shrink, expand;
  for (int64_t s = 0; s < count; ++s) {
    const auto& [start, end, at_, bts, meta] = segments[s];
    const int64_t rows = end - start, padded = at_.size(0) * kLanes;
    x_at[s + 1] = x_at[s] + (copy_x ? rows * (in + 1) : 0);
    y_at[s + 1] = y_at[s] + rows * padded;
    push_blocks(shrink, s, -1, at_.size(0), 2);
    for (size_t p = 0; p < bts.size(); ++p)
      push_blocks(expand, s, static_cast<int64_t>(p), bts[p].size(0), 2);
  }
  // y has two spare elements: a piece of odd rank reads one past its ranks (its weight is zero)
  std::vector<uint16_t> xb(x_at[count], 0), y(y_at[count] + 2, 0);
  if (copy_x) {
    for (int64_t s = 0; s < count; ++s) {
      const int64_t start = std::get<0>(segments[s]), end = std::get<1>(segments[s]);
      for (int64_t r = start; r < end; ++r)
        std::memcpy(xb.data() + x_at[s] + (r - start) * (in + 1), xp + r * x.stride(0),
                    in * sizeof(uint16_t));
    }
  }
  auto do_shrink = [&](const Work& w) {
    const auto& [start, end, at_, bts, meta] = segments[w.segment];
    const int64_t padded = at_.size(0) * kLanes;
    const uint16_t* v = copy_x ? xb.data() + x_at[w.segment] : xp + start * x.stride(0);
    const int64_t ldv = copy_x ? in + 1 : x.stride(0);
    rows_pairs(static_cast<int>(w.blocks), end - start, v, ldv,
               elements<uint16_t>(at_) + w.block * in_pairs * 2 * kLanes, in_pairs,
               y.data() + y_at[w.segment] + w.block * kLanes, padded, kLanes, false);
  };
  auto do_expand = [&](const Work& w) {
    const auto& [start, end, at_, bts, meta] = segments[w.segment];
    const int64_t padded = at_.size(0) * kLanes;
    const int64_t col_offset = meta[4 * w.piece], col_size = meta[4 * w.piece + 1];
    const int64_t rank_offset = meta[4 * w.piece + 2], rank_pairs = (meta[4 * w.piece + 3] + 1) / 2;
    const int64_t last = w.block + w.blocks - 1;  // lanes: of the last block
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, col_size - last * kLanes));
    rows_pairs(static_cast<int>(w.blocks), end - start, y.data() + y_at[w.segment] + rank_offset,
               padded,
               elements<uint16_t>(bts[w.piece]) + w.block * rank_pairs * 2 * kLanes, rank_pairs,
               op + start * ldo + col_offset + w.block * kLanes, ldo, lanes, true);
  };
  for_each(shrink, do_shrink);
  for_each(expand, do_expand);
}
#endif

void check_rows(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a 2-D CPU tensor with a contiguous last dim, got ", t.sizes(),
              " strides ", t.strides());
}

// Whether bf16 weights come in pairs of depth ([blocks, ceil(depth / 2), 16, 2]) on this build.
constexpr bool kBf16Pairs =
#if defined(BOXCAR_LORA_BF16_PAIRS)
    true;
#else
    false;
#endif

void check_blocked(const char* name, const at::Tensor& t, int64_t depth, at::ScalarType dtype) {
  if (dtype == at::kBFloat16 && kBf16Pairs) {
    TORCH_CHECK(t.dim() == 4 && t.is_contiguous() && t.size(1) == (depth + 1) / 2 &&
                    t.size(2) == kLanes && t.size(3) == 2 && t.scalar_type() == dtype,
                name, " must be contiguous [blocks, ", (depth + 1) / 2, ", 16, 2] ", dtype,
                ", got ", t.sizes(), " ", t.scalar_type());
    return;
  }
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.size(1) == depth && t.size(2) == kLanes &&
                  t.scalar_type() == dtype,
              name, " must be contiguous [blocks, ", depth, ", 16] ", dtype, ", got ", t.sizes(),
              " ", t.scalar_type());
}

void lora_segments(const at::Tensor& x, at::Tensor& out, const std::vector<Segment>& segments,
                   bool amx) {
  check_rows("x", x);
  check_rows("out", out);
  TORCH_CHECK(x.size(0) == out.size(0) && x.scalar_type() == out.scalar_type(),
              "x and out must have the same rows and dtype, got ", x.sizes(), " ",
              x.scalar_type(), " and ", out.sizes(), " ", out.scalar_type());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16, got ", dtype);
  for (const auto& segment : segments) {
    const auto& [start, end, at_, bts, meta] = segment;
    TORCH_CHECK(0 <= start && start <= end && end <= x.size(0), "segment rows ", start, "..",
                end, " outside the batch's ", x.size(0));
    check_blocked("At", at_, x.size(1), dtype);
    TORCH_CHECK(meta.size() == 4 * bts.size(), "each piece needs 4 meta values");
    for (size_t p = 0; p < bts.size(); ++p) {
      const int64_t col_offset = meta[4 * p], col_size = meta[4 * p + 1];
      const int64_t rank_offset = meta[4 * p + 2], rank = meta[4 * p + 3];
      TORCH_CHECK(0 <= col_offset && col_offset + col_size <= out.size(1) && 0 <= rank_offset &&
                      rank_offset + rank <= at_.size(0) * kLanes,
                  "piece ", p, " (columns ", col_offset, "+", col_size, ", ranks ", rank_offset,
                  "+", rank, ") outside out ", out.sizes(), " or At ", at_.sizes());
      check_blocked("Bt", bts[p], rank, dtype);
      TORCH_CHECK(bts[p].size(0) == (col_size + kLanes - 1) / kLanes, "Bt of piece ", p,
                  " needs ", (col_size + kLanes - 1) / kLanes, " blocks, got ", bts[p].size(0));
    }
  }
  if (dtype == at::kFloat) {
    run<float>(x, out, segments);
  } else {
#if defined(BOXCAR_LORA_BF16_PAIRS)
    if (!amx || !lora_segments_amx(x, out, segments)) run_pairs(x, out, segments);
#else
    run<uint16_t>(x, out, segments);
#endif
  }
}

}  // namespace

// Called from the extension's one PYBIND11_MODULE (paged_decode_attention.cpp).
void register_lora_segments(pybind11::module& m) {
  m.def("lora_segments", &lora_segments,
        "out[rows, cols] += (x[rows] @ A.T)[:, ranks] @ (scaling * B).T over a step's "
        "segments (A, scaled B in the kernel's blocked layouts); amx=False keeps bf16 off the "
        "AMX tiles (the tests run both paths)",
        py::arg("x"), py::arg("out"), py::arg("segments"), py::arg("amx") = true,
        py::call_guard<py::gil_scoped_release>());
  // engine/layers/lora.py lays bf16 weights out for the path this build runs
  m.attr("lora_bf16_pairs") = kBf16Pairs;
  // bf16 segments run on AMX tiles (lora_segments_amx.cpp): fast at any length
  m.attr("lora_amx") = kBf16Pairs && lora_amx_available();
}
