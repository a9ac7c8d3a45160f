// x @ W.T for a weight kept in one of ggml's block formats, dequantized inside the product.
//
// Layout. At load (quant_repack) every 8 output rows become a tile whose blocks are interleaved:
// the tile's block b holds the 8 rows' block b with each field laid out lane by lane (lane = row),
// so one vector load gives a field for 8 rows and the dequantized value of position k is one
// 8-lane vector. The packed values are regrouped so that lane r's 32-bit word holds 8 of row r's
// 4-bit values (k = 8g .. 8g+7 at bits 4i), or its 32 5th-bits, or 16 of Q6_K's 2-bit tops: one
// shift and one mask per position then give 8 rows' values. The fp16 scales stay fp16 (F16C
// widens 8 at a time); the K-quants' 6-bit scales and mins, packed 8 in 12 bytes, are stored one
// byte each. A tile takes 8x ggml's block bytes (Q4_K +2.8%, Q5_K +2.3% for the unpacked scales)
// plus the zero rows padding the last tile: the weight stays within 1.03x of its GGUF bytes.
//
// Every dequantized value is computed as one rounding of the exact d*sc*q - dmin*mn (the scale
// products d*sc are exact in fp32: 11 bits of fp16 mantissa times a 6- or 8-bit integer, and
// d*q+m fused rounds once as gguf's d*q (exact) + m does), so the weights equal gguf's
// dequantization; what differs from the fp32 reference is only the order of the sums.
//
// Paths (quant_linear's `path`; "auto" picks by row count):
//   fused   per tile, per block: unpack 8 rows' values into registers and FMA each against up
//           to 4 activation rows (more rows: the tile again, from cache). The weight is read once
//           for few rows, so this is the memory-bound decode path.
//   panel   per pair of tiles (16 output rows), per 256 values of depth: dequantize into a 16 KB
//           fp32 panel (L1), then a 6x16 register-blocked FMA micro-kernel over a block of
//           activation rows (all of them up to 48-108, by depth: panel_rows): the dequantization
//           is paid once for many rows, the FMAs run at the GEMM's rate.
//   generic plain loops the compiler vectorizes, for CPUs without AVX2+FMA+F16C (and the tests).
// x is fp32 or bf16; the sums are fp32; out is x's dtype (bf16 rounded once, to nearest even),
// with the bias added in fp32. A bf16 x is widened once for the fused and generic paths, and for
// the panel path where the CPU has no AVX512-BF16. Where it has (built with it: BOXCAR_QUANT_BF16),
// a bf16 x's panel path is the bf16 panel:
//   panel   as above, but the panel holds the dequantized values rounded to bf16 (to nearest
//   (bf16)  even, as torch's .to(bfloat16) rounds them: the dequantize mode's bf16 weights) in
//           pairs of depth, [128 pairs][16 rows][2], and the micro-kernel's `vdpbf16ps` multiplies
//           a broadcast pair of x's values with 16 rows' pairs and adds both products (exact in
//           fp32) to fp32 sums: twice the multiply-adds of an fp32 FMA an instruction, and half
//           the bytes of x and the panel. Its products are those of the dequantized bf16 model's
//           weights; only the order of the fp32 sums differs.
// The int8 screen (quant_screen_q8_0, Q8_0 only, built with AVX512-VNNI and VBMI:
// BOXCAR_QUANT_VNNI) approximates a Q8_0 weight's product with x quantized to int8 by blocks of
// 32 (engine/runner/greedy_screen.py's Int8GreedyScreen bounds the difference): out[r, v] =
// bf16(sum_b fl(d_w[v, b] * d_x[r, b]) * sum_i q_w[v, b, i] * q_x[r, b, i]), the int32 sums
// exact, the blocks' sum in fp32. The panel is the pair's int8 values as vpdpbusd reads them,
// [64 groups of 4 depth][16 rows][4], their sign bit flipped (q_w + 128, the unsigned operand;
// x's values are the signed one), then the 16 rows' fp32 d per block; each block's int32 sum
// starts at -128 * sum_i q_x[r, b, i], which takes the flip's +128 back out. vpdpbusd does 64
// multiply-adds an instruction, twice the bf16 panel's vdpbf16ps, and building the panel is a
// byte permutation (no conversion): the output layer's screen at a fraction of its product.
// Where the CPU has AMX (BOXCAR_QUANT_AMX: amx.h; and the process may use the tiles) both panels
// also run on its tiles: the bf16 panel is already a tile of B's layout, and `tdpbf16ps`
// multiplies 16 rows of x by 32 of its values of depth in one instruction (run_panel_amx: auto's
// choice for a bf16 x above kFusedMaxRows); the int8 screen's `tdpbssd` takes a block's unflipped
// values (run_screen_amx). Same products, same fp32 sums in another order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BOXCAR_QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define BOXCAR_QUANT_BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define BOXCAR_QUANT_VNNI 1  // the int8 screen (quant_screen_q8_0): vpdpbusd, and vpermb
#endif
#endif

#include "amx.h"
#if defined(BOXCAR_QUANT_BF16) && defined(BOXCAR_AMX)
#define BOXCAR_QUANT_AMX 1  // the bf16 panel on AMX tiles (run_panel_amx)
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int kLanes = 8;         // output rows a tile interleaves
constexpr int kPanelDepth = 256;  // values of depth a panel holds (16 rows x 256 x 4 B = 16 KB)
// Activation rows one fused pass holds in registers; more rows take the tile again (from cache).
// Only up to kFusedMaxRows take this path under "auto", so 4 (not 8) instantiations a format:
// the file's own compile time (beyond torch's headers, ~40 s) halves, 32 -> 16 s.
constexpr int kFusedRows = 4;
// Row counts up to this take the fused path under "auto". Fused over panel time on this repo's
// AVX2 machine (Q4_1 576->1536, Q5_0 640->2048, Q4_K 1024->640, Q6_K 2048->640, Q8_0 640->256;
// best of 60, 1 thread): 0.71-0.93 at 2 rows, 0.78-1.00 at 4, 1.01-1.07 at 5, 1.32-1.47 at 12.
constexpr int64_t kFusedMaxRows = 4;
static_assert(kFusedMaxRows <= kFusedRows, "auto's fused rows take one pass");

// One row's block, unpacked: the repack's go-between from ggml's layout to the tile's and back.
struct Block {
  uint16_t d = 0, m = 0;  // fp16 bits: d, and m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
  uint8_t q[256] = {};    // the values as stored: unsigned 4/5/6-bit, or int8 bits (Q8_0)
  uint8_t sc[16] = {};    // K-quants' sub-block scales (Q6_K: int8 bits)
  uint8_t mn[8] = {};     // Q4_K/Q5_K sub-block mins
};

inline uint16_t load16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t load32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline void store16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
inline float half(const uint8_t* p) { return c10::detail::fp16_ieee_to_fp32_value(load16(p)); }

// Lane r's 32-bit word of group g: 8 nibbles (4-bit values 8g..8g+7) or 32 bits or 16 pairs.
inline uint8_t* word(uint8_t* at, int g, int lane) { return at + 4 * (g * kLanes + lane); }
inline const uint8_t* word(const uint8_t* at, int g, int lane) {
  return at + 4 * (g * kLanes + lane);
}

// Low nibbles of `values` into the tile's words at `at`, and back.
void put_nibbles(const uint8_t* values, int count, int lane, uint8_t* at) {
  for (int g = 0; g < count / 8; ++g) {
    uint32_t w = 0;
    for (int i = 0; i < 8; ++i) w |= static_cast<uint32_t>(values[8 * g + i] & 0xF) << (4 * i);
    store32(word(at, g, lane), w);
  }
}

void get_nibbles(const uint8_t* at, int count, int lane, uint8_t* values) {
  for (int g = 0; g < count / 8; ++g) {
    const uint32_t w = load32(word(at, g, lane));
    for (int i = 0; i < 8; ++i) values[8 * g + i] = (w >> (4 * i)) & 0xF;
  }
}

#if defined(BOXCAR_QUANT_AVX2)
inline __m256 halves(const uint8_t* p) {  // 8 fp16 -> 8 fp32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load8(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256 bytes_u8(const uint8_t* p) {  // 8 uint8 -> 8 fp32
  return _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 bytes_i8(const uint8_t* p) {  // 8 int8 -> 8 fp32
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// Bits [lo, lo + width) of each lane, moved to bit `to` (lo, to compile-time after unrolling).
inline __m256i bits_at(__m256i v, int lo, int to, int mask) {
  const __m256i moved = lo >= to ? _mm256_srli_epi32(v, lo - to) : _mm256_slli_epi32(v, to - lo);
  return _mm256_and_si256(moved, _mm256_set1_epi32(mask));
}

// What a format's dequantizer (F::dequant_rows) reads a tile through: the fields of one tile's
// 8 rows in 256-bit vectors (Rows8), or of a pair of tiles' 16 rows in 512-bit ones (Rows16,
// the bf16 panel's fill). Each field's offset `at` is within a tile's block.
struct Rows8 {
  using Float = __m256;
  using Int = __m256i;
  const uint8_t* t;
  Int words(int at) const { return load8(t + at); }
  Float fp16(int at) const { return halves(t + at); }
  Float u8(int at) const { return bytes_u8(t + at); }
  Float i8(int at) const { return bytes_i8(t + at); }
  static Int bits(Int v, int lo, int to, int mask) { return bits_at(v, lo, to, mask); }
  static Int shr(Int v, int n) { return _mm256_srli_epi32(v, n); }
  static Int either(Int a, Int b) { return _mm256_or_si256(a, b); }
  static Int zero() { return _mm256_setzero_si256(); }
  static Float to_float(Int v) { return _mm256_cvtepi32_ps(v); }
  static Float splat(float v) { return _mm256_set1_ps(v); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static Float fmsub(Float a, Float b, Float c) { return _mm256_fmsub_ps(a, b, c); }
};
#endif

#if defined(BOXCAR_QUANT_BF16)
#define BOXCAR_QUANT_WIDE_FILL 1  // the bf16 panel's fill, a pair of tiles at once
// A pair of tiles' field at the same offset, t0's 8 rows in lanes 0-7 and t1's in 8-15.
inline __m512i load16(const uint8_t* t0, const uint8_t* t1, int at) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load8(t0 + at)), load8(t1 + at), 1);
}
inline __m512 halves16(const uint8_t* t0, const uint8_t* t1, int at) {  // 2 x 8 fp16 -> fp32
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t0 + at));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t1 + at));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
inline __m128i bytes16(const uint8_t* t0, const uint8_t* t1, int at) {  // 2 x 8 bytes
  int64_t lo, hi;
  std::memcpy(&lo, t0 + at, 8);
  std::memcpy(&hi, t1 + at, 8);
  return _mm_set_epi64x(hi, lo);
}
inline __m512 bytes16_i8(const uint8_t* t0, const uint8_t* t1, int at) {  // 2 x 8 int8
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(t0, t1, at)));
}
inline __m512 bytes16_u8(const uint8_t* t0, const uint8_t* t1, int at) {  // 2 x 8 uint8
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(t0, t1, at)));
}
inline __m512i bits16_at(__m512i v, int lo, int to, int mask) {
  const __m512i moved = lo >= to ? _mm512_srli_epi32(v, lo - to) : _mm512_slli_epi32(v, to - lo);
  return _mm512_and_si512(moved, _mm512_set1_epi32(mask));
}

struct Rows16 {  // Rows8 over a pair of tiles: t0's 8 rows in lanes 0-7, t1's in 8-15
  using Float = __m512;
  using Int = __m512i;
  const uint8_t* t0;
  const uint8_t* t1;
  Int words(int at) const { return load16(t0, t1, at); }
  Float fp16(int at) const { return halves16(t0, t1, at); }
  Float u8(int at) const { return bytes16_u8(t0, t1, at); }
  Float i8(int at) const { return bytes16_i8(t0, t1, at); }
  static Int bits(Int v, int lo, int to, int mask) { return bits16_at(v, lo, to, mask); }
  static Int shr(Int v, int n) { return _mm512_srli_epi32(v, n); }
  static Int either(Int a, Int b) { return _mm512_or_si512(a, b); }
  static Int zero() { return _mm512_setzero_si512(); }
  static Float to_float(Int v) { return _mm512_cvtepi32_ps(v); }
  static Float splat(float v) { return _mm512_set1_ps(v); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
  static Float fmsub(Float a, Float b, Float c) { return _mm512_fmsub_ps(a, b, c); }
};
#endif

// fn(std::integral_constant<int, i>{}) for i = 0 .. N-1, unrolled by the front end: every index
// is a constant from the start, so arrays indexed by it stay in registers (GCC's scalar
// replacement runs before its loop unroller, and a `#pragma unroll` loop kept its accumulators
// on the stack, stored back every iteration).
template <class Fn, int... I>
inline __attribute__((always_inline)) void unrolled(Fn& fn, std::integer_sequence<int, I...>) {
  (fn(std::integral_constant<int, I>{}), ...);
}
template <int N, class Fn>
inline __attribute__((always_inline)) void unroll(Fn&& fn) {
  unrolled(fn, std::make_integer_sequence<int, N>{});
}

// F::dequant (one tile: Rows8) and F::dequant16 (a pair of tiles: Rows16), both the format's
// F::dequant_rows: the same arithmetic lane by lane.
template <class F>
struct Dequantizer {
#if defined(BOXCAR_QUANT_AVX2)
  template <class Sink>
  static inline __attribute__((always_inline)) void dequant(const uint8_t* t, Sink& sink) {
    F::dequant_rows(Rows8{t}, sink);
  }
#endif
#if defined(BOXCAR_QUANT_WIDE_FILL)
  template <class Sink>
  static inline __attribute__((always_inline)) void dequant16(const uint8_t* t0,
                                                              const uint8_t* t1, Sink& sink) {
    F::dequant_rows(Rows16{t0, t1}, sink);
  }
#endif
};

// ---- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32, one or two fp16 scales -----------------
// tile block: d[8] fp16 | m[8] fp16 (with a min) | qh[8] u32 (5 bits) | nibble words [4][8] u32,
// or int8 values [32][8] (Q8_0)
template <int kBits, bool kHasMin>
struct Simple : Dequantizer<Simple<kBits, kHasMin>> {
  static constexpr int kBlock = 32;
  static constexpr int kTypeSize = 2 + (kHasMin ? 2 : 0) + (kBits == 5 ? 4 : 0) +
                                   (kBits == 8 ? 32 : 16);
  static constexpr int kTileBytes = kLanes * kTypeSize;
  static constexpr int kHighAt = kHasMin ? 32 : 16;
  static constexpr int kValuesAt = kHighAt + (kBits == 5 ? 32 : 0);

  static void from_ggml(const uint8_t* b, Block& v) {
    int at = 2;
    v.d = load16(b);
    if (kHasMin) v.m = load16(b + 2), at = 4;
    const uint32_t qh = kBits == 5 ? load32(b + at) : 0;
    at += kBits == 5 ? 4 : 0;
    for (int i = 0; i < 32; ++i) {
      if (kBits == 8) {
        v.q[i] = b[at + i];
      } else {
        const uint8_t nibble = i < 16 ? b[at + i] & 0xF : b[at + i - 16] >> 4;
        v.q[i] = nibble | (((qh >> i) & 1) << 4);
      }
    }
  }

  static void to_ggml(const Block& v, uint8_t* b) {
    int at = 2;
    store16(b, v.d);
    if (kHasMin) store16(b + 2, v.m), at = 4;
    if (kBits == 5) {
      uint32_t qh = 0;
      for (int i = 0; i < 32; ++i) qh |= static_cast<uint32_t>((v.q[i] >> 4) & 1) << i;
      store32(b + at, qh);
      at += 4;
    }
    for (int i = 0; i < (kBits == 8 ? 32 : 16); ++i) {
      b[at + i] = kBits == 8 ? v.q[i] : ((v.q[i] & 0xF) | ((v.q[i + 16] & 0xF) << 4));
    }
  }

  static void put(const Block& v, int lane, uint8_t* t) {
    store16(t + 2 * lane, v.d);
    if (kHasMin) store16(t + 16 + 2 * lane, v.m);
    if (kBits == 5) {
      uint32_t qh = 0;
      for (int i = 0; i < 32; ++i) qh |= static_cast<uint32_t>((v.q[i] >> 4) & 1) << i;
      store32(t + kHighAt + 4 * lane, qh);
    }
    if (kBits == 8) {
      for (int k = 0; k < 32; ++k) t[kValuesAt + k * kLanes + lane] = v.q[k];
    } else {
      put_nibbles(v.q, 32, lane, t + kValuesAt);
    }
  }

  static void get(const uint8_t* t, int lane, Block& v) {
    v.d = load16(t + 2 * lane);
    if (kHasMin) v.m = load16(t + 16 + 2 * lane);
    if (kBits == 8) {
      for (int k = 0; k < 32; ++k) v.q[k] = t[kValuesAt + k * kLanes + lane];
      return;
    }
    get_nibbles(t + kValuesAt, 32, lane, v.q);
    if (kBits == 5) {
      const uint32_t qh = load32(t + kHighAt + 4 * lane);
      for (int i = 0; i < 32; ++i) v.q[i] |= ((qh >> i) & 1) << 4;
    }
  }

  // The block's 32 x 8 values, out[k * 8 + lane].
  static void dequant_generic(const uint8_t* t, float* out) {
    float d[kLanes], c[kLanes];
    for (int r = 0; r < kLanes; ++r) {
      d[r] = half(t + 2 * r);
      c[r] = kHasMin ? half(t + 16 + 2 * r) : kBits == 8 ? 0.0f : (kBits == 4 ? -8 : -16) * d[r];
    }
    for (int k = 0; k < 32; ++k) {
      for (int r = 0; r < kLanes; ++r) {
        int q;
        if (kBits == 8) {
          q = static_cast<int8_t>(t[kValuesAt + k * kLanes + r]);
        } else {
          q = (load32(word(t + kValuesAt, k / 8, r)) >> (4 * (k % 8))) & 0xF;
          if (kBits == 5) q |= ((load32(t + kHighAt + 4 * r) >> k) & 1) << 4;
        }
        out[k * kLanes + r] = static_cast<float>(q) * d[r] + c[r];
      }
    }
  }

#if defined(BOXCAR_QUANT_AVX2)
  // sink(k, i, w): w holds the rows' values at depth k + i of this block (8 rows through Rows8,
  // 16 through Rows16), i an integral_constant (0-7): only the 8 positions of a word are
  // unrolled, which keeps the instantiations (8 formats x 4 row counts) quick to compile.
  template <class V, class Sink>
  static inline __attribute__((always_inline)) void dequant_rows(const V& v, Sink& sink) {
    const auto d = v.fp16(0);
    if constexpr (kBits == 8) {
      for (int k = 0; k < 32; k += 8) {
        unroll<8>([&](auto i) { sink(k, i, V::mul(v.i8(kValuesAt + 8 * (k + i)), d)); });
      }
    } else {
      const auto c = kHasMin ? v.fp16(16) : V::mul(d, V::splat(-(1 << (kBits - 1))));
      const auto qh = kBits == 5 ? v.words(kHighAt) : V::zero();
      for (int g = 0; g < 4; ++g) {
        const auto w = v.words(kValuesAt + 32 * g);
        const auto high = kBits == 5 ? V::shr(qh, 8 * g) : qh;
        unroll<8>([&](auto i) {
          auto q = V::bits(w, 4 * i, 0, 0xF);
          if constexpr (kBits == 5) q = V::either(q, V::bits(high, i, 4, 0x10));
          sink(8 * g, i, V::fmadd(V::to_float(q), d, c));
        });
      }
    }
  }
#endif
};

// ---- Q4_K, Q5_K: super-blocks of 256, 8 sub-blocks of 32 with 6-bit scales and mins ------
// tile block: d[8] fp16 | dmin[8] fp16 | sc[8 sub][8] u8 | mn[8 sub][8] u8
//             | qh[8 sub][8] u32 (Q5_K: bit i = value 32j+i's 5th bit) | nibble words [32][8] u32
template <int kBits>
struct KQuant : Dequantizer<KQuant<kBits>> {
  static constexpr int kBlock = 256;
  static constexpr int kTypeSize = kBits == 4 ? 144 : 176;
  static constexpr int kHighAt = 160;
  static constexpr int kValuesAt = kHighAt + (kBits == 5 ? 256 : 0);
  static constexpr int kTileBytes = kValuesAt + 1024;
  static constexpr int kQsAt = 16 + (kBits == 5 ? 32 : 0);  // in ggml's block

  static void from_ggml(const uint8_t* b, Block& v) {
    v.d = load16(b);
    v.m = load16(b + 2);
    const uint8_t* s = b + 4;  // 12 bytes of 6-bit scales and mins (ggml_quants.k_scales_mins)
    for (int j = 0; j < 4; ++j) {
      v.sc[j] = s[j] & 63;
      v.mn[j] = s[j + 4] & 63;
      v.sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
      v.mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    for (int k = 0; k < 256; ++k) {
      const int j = k / 32, i = k % 32;
      v.q[k] = (b[kQsAt + (j / 2) * 32 + i] >> (4 * (j & 1))) & 0xF;
      if (kBits == 5) v.q[k] |= ((b[16 + i] >> j) & 1) << 4;
    }
  }

  static void to_ggml(const Block& v, uint8_t* b) {
    std::memset(b, 0, kTypeSize);
    store16(b, v.d);
    store16(b + 2, v.m);
    uint8_t* s = b + 4;
    for (int j = 0; j < 4; ++j) {
      s[j] = v.sc[j] | ((v.sc[j + 4] >> 4) << 6);
      s[j + 4] = v.mn[j] | ((v.mn[j + 4] >> 4) << 6);
      s[j + 8] = (v.sc[j + 4] & 0xF) | ((v.mn[j + 4] & 0xF) << 4);
    }
    for (int k = 0; k < 256; ++k) {
      const int j = k / 32, i = k % 32;
      b[kQsAt + (j / 2) * 32 + i] |= (v.q[k] & 0xF) << (4 * (j & 1));
      if (kBits == 5) b[16 + i] |= ((v.q[k] >> 4) & 1) << j;
    }
  }

  static void put(const Block& v, int lane, uint8_t* t) {
    store16(t + 2 * lane, v.d);
    store16(t + 16 + 2 * lane, v.m);
    for (int j = 0; j < 8; ++j) {
      t[32 + j * kLanes + lane] = v.sc[j];
      t[96 + j * kLanes + lane] = v.mn[j];
      if (kBits == 5) {
        uint32_t qh = 0;
        for (int i = 0; i < 32; ++i) qh |= static_cast<uint32_t>((v.q[32 * j + i] >> 4) & 1) << i;
        store32(word(t + kHighAt, j, lane), qh);
      }
    }
    put_nibbles(v.q, 256, lane, t + kValuesAt);
  }

  static void get(const uint8_t* t, int lane, Block& v) {
    v.d = load16(t + 2 * lane);
    v.m = load16(t + 16 + 2 * lane);
    get_nibbles(t + kValuesAt, 256, lane, v.q);
    for (int j = 0; j < 8; ++j) {
      v.sc[j] = t[32 + j * kLanes + lane];
      v.mn[j] = t[96 + j * kLanes + lane];
      if (kBits == 5) {
        const uint32_t qh = load32(word(t + kHighAt, j, lane));
        for (int i = 0; i < 32; ++i) v.q[32 * j + i] |= ((qh >> i) & 1) << 4;
      }
    }
  }

  static void dequant_generic(const uint8_t* t, float* out) {
    for (int j = 0; j < 8; ++j) {
      float s[kLanes], o[kLanes];
      for (int r = 0; r < kLanes; ++r) {
        s[r] = half(t + 2 * r) * t[32 + j * kLanes + r];
        o[r] = half(t + 16 + 2 * r) * t[96 + j * kLanes + r];
      }
      for (int i = 0; i < 32; ++i) {
        const int k = 32 * j + i;
        for (int r = 0; r < kLanes; ++r) {
          int q = (load32(word(t + kValuesAt, k / 8, r)) >> (4 * (k % 8))) & 0xF;
          if (kBits == 5) q |= ((load32(word(t + kHighAt, j, r)) >> i) & 1) << 4;
          out[k * kLanes + r] = static_cast<float>(q) * s[r] - o[r];
        }
      }
    }
  }

#if defined(BOXCAR_QUANT_AVX2)
  template <class V, class Sink>
  static inline __attribute__((always_inline)) void dequant_rows(const V& v, Sink& sink) {
    const auto d = v.fp16(0), dmin = v.fp16(16);
    for (int j = 0; j < 8; ++j) {
      const auto s = V::mul(d, v.u8(32 + 8 * j));
      const auto o = V::mul(dmin, v.u8(96 + 8 * j));
      const auto qh = kBits == 5 ? v.words(kHighAt + 32 * j) : V::zero();
      for (int g = 0; g < 4; ++g) {
        const auto w = v.words(kValuesAt + 32 * (4 * j + g));
        const auto high = kBits == 5 ? V::shr(qh, 8 * g) : qh;
        unroll<8>([&](auto i) {
          auto q = V::bits(w, 4 * i, 0, 0xF);
          if constexpr (kBits == 5) q = V::either(q, V::bits(high, i, 4, 0x10));
          sink(32 * j + 8 * g, i, V::fmsub(V::to_float(q), s, o));
        });
      }
    }
  }
#endif
};

// ---- Q6_K: super-blocks of 256, 16 sub-blocks of 16 with int8 scales, 4+2 bits a value ----
// tile block: d[8] fp16 | sc[16 sub][8] i8 | nibble words [32][8] u32
//             | top-bit words [16][8] u32 (value 16g+i's bits 4-5 at bits 2i)
struct Q6K : Dequantizer<Q6K> {
  static constexpr int kBlock = 256;
  static constexpr int kTypeSize = 210;
  static constexpr int kValuesAt = 144;
  static constexpr int kHighAt = 1168;
  static constexpr int kTileBytes = 1680;

  static void from_ggml(const uint8_t* b, Block& v) {
    // value h*128 + r: nibble (r / 64) of ql byte h*64 + r%64, bits 2(r / 32) of qh byte h*32 + r%32
    for (int k = 0; k < 256; ++k) {
      const int h = k / 128, r = k % 128;
      const int low = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
      const int top = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
      v.q[k] = low | (top << 4);
    }
    std::memcpy(v.sc, b + 192, 16);
    v.d = load16(b + 208);
  }

  static void to_ggml(const Block& v, uint8_t* b) {
    std::memset(b, 0, kTypeSize);
    for (int k = 0; k < 256; ++k) {
      const int h = k / 128, r = k % 128;
      b[h * 64 + r % 64] |= (v.q[k] & 0xF) << (4 * (r / 64));
      b[128 + h * 32 + r % 32] |= ((v.q[k] >> 4) & 3) << (2 * (r / 32));
    }
    std::memcpy(b + 192, v.sc, 16);
    store16(b + 208, v.d);
  }

  static void put(const Block& v, int lane, uint8_t* t) {
    store16(t + 2 * lane, v.d);
    for (int j = 0; j < 16; ++j) {
      t[16 + j * kLanes + lane] = v.sc[j];
      uint32_t top = 0;
      for (int i = 0; i < 16; ++i) top |= static_cast<uint32_t>((v.q[16 * j + i] >> 4) & 3) << (2 * i);
      store32(word(t + kHighAt, j, lane), top);
    }
    put_nibbles(v.q, 256, lane, t + kValuesAt);
  }

  static void get(const uint8_t* t, int lane, Block& v) {
    v.d = load16(t + 2 * lane);
    get_nibbles(t + kValuesAt, 256, lane, v.q);
    for (int j = 0; j < 16; ++j) {
      v.sc[j] = t[16 + j * kLanes + lane];
      const uint32_t top = load32(word(t + kHighAt, j, lane));
      for (int i = 0; i < 16; ++i) v.q[16 * j + i] |= ((top >> (2 * i)) & 3) << 4;
    }
  }

  static void dequant_generic(const uint8_t* t, float* out) {
    for (int j = 0; j < 16; ++j) {
      float s[kLanes];
      for (int r = 0; r < kLanes; ++r) {
        s[r] = half(t + 2 * r) * static_cast<float>(static_cast<int8_t>(t[16 + j * kLanes + r]));
      }
      for (int i = 0; i < 16; ++i) {
        const int k = 16 * j + i;
        for (int r = 0; r < kLanes; ++r) {
          const int low = (load32(word(t + kValuesAt, k / 8, r)) >> (4 * (k % 8))) & 0xF;
          const int top = (load32(word(t + kHighAt, j, r)) >> (2 * i)) & 3;
          out[k * kLanes + r] = static_cast<float>((low | (top << 4)) - 32) * s[r];
        }
      }
    }
  }

#if defined(BOXCAR_QUANT_AVX2)
  template <class V, class Sink>
  static inline __attribute__((always_inline)) void dequant_rows(const V& v, Sink& sink) {
    const auto d = v.fp16(0);
    for (int j = 0; j < 16; ++j) {
      const auto s = V::mul(d, v.i8(16 + 8 * j));
      const auto c = V::mul(s, V::splat(-32.0f));
      const auto top = v.words(kHighAt + 32 * j);
      for (int g = 0; g < 2; ++g) {
        const auto w = v.words(kValuesAt + 32 * (2 * j + g));
        const auto high = V::shr(top, 16 * g);
        unroll<8>([&](auto i) {
          const auto q = V::either(V::bits(w, 4 * i, 0, 0xF), V::bits(high, 2 * i, 4, 0x30));
          sink(16 * j + 8 * g, i, V::fmadd(V::to_float(q), s, c));
        });
      }
    }
  }
#endif
};

using Q4_0 = Simple<4, false>;
using Q4_1 = Simple<4, true>;
using Q5_0 = Simple<5, false>;
using Q5_1 = Simple<5, true>;
using Q8_0 = Simple<8, false>;
using Q4_K = KQuant<4>;
using Q5_K = KQuant<5>;

const std::vector<std::string> kFormats = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                           "Q4_K", "Q5_K", "Q6_K"};

// Calls fn(F{}) with the format struct named `fmt`.
template <class Fn>
void visit(const std::string& fmt, Fn&& fn) {
  if (fmt == "Q4_0") return fn(Q4_0{});
  if (fmt == "Q4_1") return fn(Q4_1{});
  if (fmt == "Q5_0") return fn(Q5_0{});
  if (fmt == "Q5_1") return fn(Q5_1{});
  if (fmt == "Q8_0") return fn(Q8_0{});
  if (fmt == "Q4_K") return fn(Q4_K{});
  if (fmt == "Q5_K") return fn(Q5_K{});
  if (fmt == "Q6_K") return fn(Q6K{});
  TORCH_CHECK(false, "no quantized kernel for format ", fmt);
}

// ---- repack and back ----------------------------------------------------------------------

template <class F>
int64_t check_rows(const torch::Tensor& t, int64_t in_features) {
  TORCH_CHECK(in_features > 0 && in_features % F::kBlock == 0, "in_features ", in_features,
              " is not a multiple of the block size ", F::kBlock);
  TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.is_contiguous() && t.device().is_cpu(),
              "quantized data must be a contiguous CPU uint8 tensor");
  return in_features / F::kBlock;
}

// raw: uint8 [out, row_bytes] (ggml's rows) -> uint8 [ceil(out / 8), blocks * tile_bytes]
torch::Tensor quant_repack(const std::string& fmt, const torch::Tensor& raw, int64_t in_features) {
  torch::Tensor tiles;
  visit(fmt, [&](auto f) {
    using F = decltype(f);
    const int64_t blocks = check_rows<F>(raw, in_features);
    TORCH_CHECK(raw.dim() == 2 && raw.size(1) == blocks * F::kTypeSize, "raw rows must be [out, ",
                blocks * F::kTypeSize, "]");
    const int64_t rows = raw.size(0), num_tiles = (rows + kLanes - 1) / kLanes;
    tiles = torch::empty({num_tiles, blocks * F::kTileBytes}, raw.options());
    const uint8_t* src = raw.data_ptr<uint8_t>();
    uint8_t* dst = tiles.data_ptr<uint8_t>();
    at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
      Block v;
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* tile = dst + (t * blocks + b) * F::kTileBytes;
          for (int lane = 0; lane < kLanes; ++lane) {
            const int64_t row = t * kLanes + lane;
            v = Block{};  // the padding rows: zero scales, zero values
            if (row < rows) F::from_ggml(src + (row * blocks + b) * F::kTypeSize, v);
            F::put(v, lane, tile);
          }
        }
      }
    });
  });
  return tiles;
}

// tiles -> uint8 [len(ids), row_bytes]: ggml's bytes of the rows `ids` (an embedding lookup, or
// every row for the model cache)
torch::Tensor quant_unpack_rows(const std::string& fmt, const torch::Tensor& tiles,
                                int64_t in_features, const torch::Tensor& ids) {
  torch::Tensor rows;
  visit(fmt, [&](auto f) {
    using F = decltype(f);
    const int64_t blocks = check_rows<F>(tiles, in_features);
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
                "ids must be a contiguous 1-D int64 tensor");
    const int64_t num_tiles = tiles.size(0), n = ids.size(0);
    rows = torch::empty({n, blocks * F::kTypeSize}, tiles.options());
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < num_tiles * kLanes, "row id ", id[i], " out of range");
    }
    const uint8_t* src = tiles.data_ptr<uint8_t>();
    uint8_t* dst = rows.data_ptr<uint8_t>();
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      Block v;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = id[i] / kLanes;
        const int lane = static_cast<int>(id[i] % kLanes);
        for (int64_t b = 0; b < blocks; ++b) {
          F::get(src + (t * blocks + b) * F::kTileBytes, lane, v);
          F::to_ggml(v, dst + (i * blocks + b) * F::kTypeSize);
        }
      }
    });
  });
  return rows;
}

// ---- the products ---------------------------------------------------------------------------

struct Problem {
  const uint8_t* tiles;
  int64_t blocks, num_tiles;  // blocks of depth a row; tiles of 8 output rows
  const float* x;             // [rows, depth] fp32 (null on the bf16 panel path)
  const uint16_t* xh;         // [rows, depth] bf16 bits (the bf16 panel path), else null
  int64_t rows, depth, out_features;
  const float* bias;          // [out_features] or null
  torch::Tensor out;          // [rows, out_features] fp32 or bf16
  // The int8 screen's x (quant_screen_q8_0), else null: int8 [rows, depth], and per row and
  // block of 32 the fp32 scale and the int32 offset -128 * (sum of the block's values).
  const int8_t* xq = nullptr;
  const float* xq_scales = nullptr;
  const int32_t* xq_offsets = nullptr;
  int64_t xh_stride = 0;  // the bf16 panel path's row stride of xh, in elements (spread_rows)
};

#if defined(BOXCAR_QUANT_AVX2)
// 8 fp32 -> 8 bf16 bits, to nearest even (NaN -> 0x7FC0), as c10::BFloat16(float) rounds.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

// out[m, col0 + c] = acc[m * stride + c] + bias, for the c < cols that exist: 8 at a time
// where the CPU has AVX2 (a scalar bf16 rounding a value cost a quarter of a 64-row step's
// time at a depth of 640), else one by one.
void write_out(const Problem& p, const float* acc, int64_t stride, int64_t m0, int64_t rows,
               int64_t col0, int64_t cols) {
  cols = std::min(cols, p.out_features - col0);
  const bool fp32 = p.out.scalar_type() == torch::kFloat;
  float* out_f = fp32 ? p.out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_h = fp32 ? nullptr : p.out.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < rows; ++m) {
    const float* a = acc + m * stride;
    const int64_t at = (m0 + m) * p.out_features + col0;
    int64_t c = 0;
#if defined(BOXCAR_QUANT_AVX2)
    for (; c + 8 <= cols; c += 8) {
      __m256 v = _mm256_loadu_ps(a + c);
      if (p.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(p.bias + col0 + c));
      if (fp32) {
        _mm256_storeu_ps(out_f + at + c, v);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out_h + at + c), to_bf16(v));
      }
    }
#endif
    for (; c < cols; ++c) {
      const float v = a[c] + (p.bias ? p.bias[col0 + c] : 0.0f);
      if (fp32) {
        out_f[at + c] = v;
      } else {
        out_h[at + c] = c10::BFloat16(v);  // nearest even
      }
    }
  }
}

template <class F>
void run_generic(const Problem& p) {
  at::parallel_for(0, p.num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> values(F::kBlock * kLanes), acc(p.rows * kLanes);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < p.blocks; ++b) {
        F::dequant_generic(p.tiles + (t * p.blocks + b) * F::kTileBytes, values.data());
        for (int64_t m = 0; m < p.rows; ++m) {
          const float* xm = p.x + m * p.depth + b * F::kBlock;
          float* am = acc.data() + m * kLanes;
          for (int k = 0; k < F::kBlock; ++k) {
            for (int r = 0; r < kLanes; ++r) am[r] += xm[k] * values[k * kLanes + r];
          }
        }
      }
      write_out(p, acc.data(), kLanes, 0, p.rows, t * kLanes, kLanes);
    }
  });
}

#if defined(BOXCAR_QUANT_AVX2)
// M activation rows (x, row stride `depth`) against one tile: out[m * 8 + lane]. Each row's
// sum is split over `kChains` accumulators (by depth) so that few rows still keep enough FMAs in
// flight: one chain waits the FMA's latency (4-5 cycles) between steps.
template <class F, int M>
void fused_tile(const uint8_t* tile, int64_t blocks, const float* x, int64_t depth, float* out) {
  constexpr int kChains = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;  // divides 8
  __m256 acc[M][kChains];
  unroll<M>([&](auto m) { unroll<kChains>([&](auto c) { acc[m][c] = _mm256_setzero_ps(); }); });
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * F::kBlock;
    auto sink = [&](int k, auto i, __m256 w) __attribute__((always_inline)) {
      unroll<M>([&](auto m) {
        constexpr int c = i % kChains;
        acc[m][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + m * depth + k + i), w, acc[m][c]);
      });
    };
    F::dequant(tile + b * F::kTileBytes, sink);
  }
  unroll<M>([&](auto m) {
    unroll<kChains - 1>([&](auto c) { acc[m][0] = _mm256_add_ps(acc[m][0], acc[m][c + 1]); });
    _mm256_storeu_ps(out + m * kLanes, acc[m][0]);
  });
}

template <class F>
void fused_rows(const uint8_t* tile, int64_t blocks, const float* x, int64_t depth, int rows,
                float* out) {
  switch (rows) {
    case 1: return fused_tile<F, 1>(tile, blocks, x, depth, out);
    case 2: return fused_tile<F, 2>(tile, blocks, x, depth, out);
    case 3: return fused_tile<F, 3>(tile, blocks, x, depth, out);
    default: return fused_tile<F, 4>(tile, blocks, x, depth, out);
  }
}

template <class F>
void run_fused(const Problem& p) {
  at::parallel_for(0, p.num_tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float acc[kFusedRows * kLanes];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = p.tiles + t * p.blocks * F::kTileBytes;
      for (int64_t m0 = 0; m0 < p.rows; m0 += kFusedRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kFusedRows, p.rows - m0));
        fused_rows<F>(tile, p.blocks, p.x + m0 * p.depth, p.depth, rows, acc);
        write_out(p, acc, kLanes, m0, rows, t * kLanes, kLanes);
      }
    }
  });
}

// c[MR][16] += x[MR rows, depth] @ panel[depth][16]
template <int MR>
inline void micro_kernel(const float* x, int64_t stride, const float* panel, int depth, float* c) {
  __m256 lo[MR], hi[MR];
  unroll<MR>([&](auto r) {
    lo[r] = _mm256_loadu_ps(c + 16 * r);
    hi[r] = _mm256_loadu_ps(c + 16 * r + 8);
  });
  for (int k = 0; k < depth; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + 16 * k), b1 = _mm256_load_ps(panel + 16 * k + 8);
    unroll<MR>([&](auto r) {
      const __m256 a = _mm256_broadcast_ss(x + r * stride + k);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    });
  }
  unroll<MR>([&](auto r) {
    _mm256_storeu_ps(c + 16 * r, lo[r]);
    _mm256_storeu_ps(c + 16 * r + 8, hi[r]);
  });
}

void micro_rows(int rows, const float* x, int64_t stride, const float* panel, int depth,
                float* c) {
  switch (rows) {
    case 1: return micro_kernel<1>(x, stride, panel, depth, c);
    case 2: return micro_kernel<2>(x, stride, panel, depth, c);
    case 3: return micro_kernel<3>(x, stride, panel, depth, c);
    case 4: return micro_kernel<4>(x, stride, panel, depth, c);
    case 5: return micro_kernel<5>(x, stride, panel, depth, c);
    default: return micro_kernel<6>(x, stride, panel, depth, c);
  }
}

// Rows of x a panel pass takes at a time: a block of x (rows x depth fp32) sized to stay in L2
// (~256 KB) while every pair of tiles passes over it, and no fewer than 48 rows, so that
// dequantizing each panel again per block stays small (1 op a value against >= 6 FMAs). Without
// it x streamed from L3 once a pair: 56 against 64 GFLOP/s at 1,024 rows (Q4_1 576 -> 3072).
inline int64_t panel_rows(int64_t depth) {
  return std::max<int64_t>(48, (65536 / depth) / 6 * 6);
}

// The fp32 panel: panel[k][16] fp32, a pair's two tiles side by side (16 KB).
struct PanelF32 {
  using Elem = float;
  static constexpr int kAlign = 32;
  static constexpr int kPanelElems = kPanelDepth * 16;
  static constexpr int kMicroRows = 6;
  static constexpr bool kFillsPairs = false;  // fill_pair (both tiles at once): none
  static int64_t block_rows(int64_t depth) { return panel_rows(depth); }
  template <class F>
  static void fill(const uint8_t* tile, Elem* panel, int blk, int half_index) {
    float* dst = panel + blk * F::kBlock * 16 + 8 * half_index;
    auto sink = [&](int k, auto i, __m256 w) __attribute__((always_inline)) {
      _mm256_store_ps(dst + 16 * (k + i), w);
    };
    F::dequant(tile, sink);
  }
  static void micro(const Problem& p, int64_t m, int64_t k0, int rows, const Elem* panel,
                    int depth, float* c) {
    micro_rows(rows, p.x + m * p.depth + k0, p.depth, panel, depth, c);
  }
};

// P::fill's panel of tiles t0 and t0 + 1 (t0 alone when !two): `count` blocks of depth from
// block b0, both tiles of a block at once where P can (P::kFillsPairs: P::fill_pair).
template <class F, class P>
inline void fill_panel(const Problem& p, int64_t t0, bool two, int64_t b0, int count,
                       typename P::Elem* panel) {
  for (int blk = 0; blk < count; ++blk) {
    const uint8_t* tile = p.tiles + (t0 * p.blocks + b0 + blk) * F::kTileBytes;
    const uint8_t* next = tile + p.blocks * F::kTileBytes;  // tile t0 + 1's block
    if constexpr (P::kFillsPairs) {
      if (two) {
        P::template fill_pair<F>(tile, next, panel, blk);
        continue;
      }
    }
    for (int half_index = 0; half_index < (two ? 2 : 1); ++half_index) {
      P::template fill<F>(half_index == 0 ? tile : next, panel, blk, half_index);
    }
  }
}

// The panel path's driver, for a panel kind P (PanelF32, PanelBf16, PanelQ8): per pair of tiles
// (16 output rows), per kPanelDepth values of depth, P::fill dequantizes the pair into the panel,
// then P::micro multiplies a block of x's rows by it (P::block_rows(depth) rows at a time):
// P::micro(p, row, depth offset, rows, panel, depth, sums) finds those rows of x in p.
template <class F, class P>
void run_panel(const Problem& p) {
  using Elem = typename P::Elem;
  constexpr int kBlocksAPanel = std::max(1, kPanelDepth / F::kBlock);
  const int64_t pairs = (p.num_tiles + 1) / 2;
  const int64_t block_rows = std::min(p.rows, P::block_rows(p.depth));
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    constexpr uintptr_t kMask = P::kAlign - 1;
    std::vector<Elem> storage(P::kPanelElems + P::kAlign / sizeof(Elem));
    Elem* panel = reinterpret_cast<Elem*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + kMask) & ~kMask);
    std::vector<float> sums(block_rows * 16);  // c[rows][16]: the pair's sums
    float* c = sums.data();
    for (int64_t r0 = 0; r0 < p.rows; r0 += block_rows) {
      const int64_t rows = std::min(block_rows, p.rows - r0);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t t0 = 2 * pair;
        const bool two = t0 + 1 < p.num_tiles;
        std::fill(c, c + rows * 16, 0.0f);
        if (!two) std::fill(panel, panel + P::kPanelElems, Elem{0});
        for (int64_t b0 = 0; b0 < p.blocks; b0 += kBlocksAPanel) {
          const int count = static_cast<int>(std::min<int64_t>(kBlocksAPanel, p.blocks - b0));
          fill_panel<F, P>(p, t0, two, b0, count, panel);
          for (int64_t m0 = 0; m0 < rows; m0 += P::kMicroRows) {
            P::micro(p, r0 + m0, b0 * F::kBlock,
                     static_cast<int>(std::min<int64_t>(P::kMicroRows, rows - m0)), panel,
                     count * F::kBlock, c + m0 * 16);
          }
        }
        write_out(p, c, 16, r0, rows, t0 * kLanes, 16);
      }
    }
  });
}
#endif

#if defined(BOXCAR_QUANT_BF16)
// c[MR][16] += x[MR rows, 2 * pairs] @ panel[pairs][16][2], x and the panel bf16: each step
// broadcasts one row's pair (x[2p], x[2p + 1]) and adds both products to 16 sums.
template <int MR>
inline void micro_kernel_bf16(const uint16_t* x, int64_t stride, const uint16_t* panel,
                              int pairs, float* c) {
  __m512 acc[MR];
  unroll<MR>([&](auto r) { acc[r] = _mm512_loadu_ps(c + 16 * r); });
  for (int q = 0; q < pairs; ++q) {
    const __m512bh w = (__m512bh)_mm512_load_si512(panel + 32 * q);
    unroll<MR>([&](auto r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * stride + 2 * q, sizeof pair);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), w);
    });
  }
  unroll<MR>([&](auto r) { _mm512_storeu_ps(c + 16 * r, acc[r]); });
}

// Rows a bf16 micro-kernel call takes: MR accumulators, the panel's pair and a broadcast fit
// the 32 zmm registers with room to spare.
constexpr int kMicroRowsBf16 = 12;

void micro_rows_bf16(int rows, const uint16_t* x, int64_t stride, const uint16_t* panel,
                     int pairs, float* c) {
  switch (rows) {
#define BOXCAR_ROWS(n) case n: return micro_kernel_bf16<n>(x, stride, panel, pairs, c);
    BOXCAR_ROWS(1) BOXCAR_ROWS(2) BOXCAR_ROWS(3) BOXCAR_ROWS(4) BOXCAR_ROWS(5) BOXCAR_ROWS(6)
    BOXCAR_ROWS(7) BOXCAR_ROWS(8) BOXCAR_ROWS(9) BOXCAR_ROWS(10) BOXCAR_ROWS(11)
#undef BOXCAR_ROWS
    default: return micro_kernel_bf16<kMicroRowsBf16>(x, stride, panel, pairs, c);
  }
}

// 8 rows' values at depth k (even) and k + 1 -> the panel's 16 bf16 of those rows' pairs,
// (row 0: k, k + 1), (row 1: k, k + 1), ..., each rounded to nearest even: one conversion of
// both vectors ([k: rows 0-7, k + 1: rows 0-7]) and one permutation of its 16-bit halves.
inline __m256i pairs_bf16(__m256 even, __m256 odd) {
  const __m256i both = (__m256i)_mm256_cvtne2ps_pbh(odd, even);  // even's in the low half
  const __m256i interleave = _mm256_setr_epi16(0, 8, 1, 9, 2, 10, 3, 11,
                                               4, 12, 5, 13, 6, 14, 7, 15);
  return _mm256_permutexvar_epi16(interleave, both);
}

// PanelBf16::fill for both tiles of a pair at once, in 512-bit registers (the same values, half
// the instructions): each pair of depth's 16 rows x 2 bf16 is one 64-byte row of the panel,
// made by one conversion and one permutation of 16-bit halves.
template <class F>
inline void fill_pair_bf16(const uint8_t* t0, const uint8_t* t1, uint16_t* panel, int blk) {
  uint16_t* dst = panel + blk * F::kBlock * 16;
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  __m512 even = _mm512_setzero_ps();
  auto sink = [&](int k, auto i, __m512 w) __attribute__((always_inline)) {
    if constexpr (i % 2 == 0) {
      even = w;
    } else {
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(w, even);  // even's in the low half
      _mm512_store_si512(dst + 16 * (k + i - 1), _mm512_permutexvar_epi16(order, both));
    }
  };
  F::dequant16(t0, t1, sink);
}

// x's rows as the bf16 micro-kernel reads them: 12 at once, a pair of values of each in turn.
// Rows a multiple of 4 KB apart all fall in one set of L1 (a way is 4 KB), which holds 8 (Zen
// 4) or 12 (Intel) lines: at a depth of 2048 the panel path ran at ~130 GFLOP/s against ~175 at
// 1,792 and 2,304 (1 thread, 64 rows, Zen 4). Such an x is copied into `storage` with its rows
// 64 bytes further apart; the stride (elements) is returned in `stride`.
inline const uint16_t* spread_rows(const uint16_t* x, int64_t rows, int64_t depth,
                                   std::vector<uint16_t>& storage, int64_t& stride) {
  constexpr int64_t kWay = 4096 / sizeof(uint16_t), kLine = 64 / sizeof(uint16_t);
  stride = depth;
  if (depth % kWay != 0 || rows <= 1) return x;
  stride = depth + kLine;
  storage.resize(rows * stride);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(storage.data() + r * stride, x + r * depth, depth * sizeof(uint16_t));
  }
  return storage.data();
}

// The bf16 panel: panel[k / 2][16][2] bf16 (8 KB), the values of depth in pairs.
struct PanelBf16 {
  using Elem = uint16_t;
  static constexpr int kAlign = 64;
  static constexpr int kPanelElems = kPanelDepth * 16;
  static constexpr int kMicroRows = kMicroRowsBf16;
  static constexpr bool kFillsPairs = true;
  static int64_t block_rows(int64_t depth) { return 2 * panel_rows(depth); }  // half x's bytes
  template <class F>
  static void fill(const uint8_t* tile, Elem* panel, int blk, int half_index) {
    uint16_t* dst = panel + blk * F::kBlock * 16 + 16 * half_index;
    __m256 even = _mm256_setzero_ps();
    // k + i is even exactly when i is: every format's sink walks k in steps of 8
    auto sink = [&](int k, auto i, __m256 w) __attribute__((always_inline)) {
      if constexpr (i % 2 == 0) {
        even = w;
      } else {
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 16 * (k + i - 1)),
                           pairs_bf16(even, w));
      }
    };
    F::dequant(tile, sink);
  }
  template <class F>  // both tiles of a pair at once
  static void fill_pair(const uint8_t* t0, const uint8_t* t1, Elem* panel, int blk) {
    fill_pair_bf16<F>(t0, t1, panel, blk);
  }
  static void micro(const Problem& p, int64_t m, int64_t k0, int rows, const Elem* panel,
                    int depth, float* c) {
    micro_rows_bf16(rows, p.xh + m * p.xh_stride + k0, p.xh_stride, panel, depth / 2, c);
  }
};
#endif

#if defined(BOXCAR_AMX)
constexpr int kAmxTileRows = 16;  // rows of a tile (x's rows are padded to a multiple of it)

// A [rows, width] array padded with zero rows to `padded_rows`: the array itself when it has
// them already, else a copy in `storage`.
template <class T>
const T* amx_padded(const T* data, int64_t rows, int64_t width, int64_t padded_rows,
                    std::vector<T>& storage) {
  if (padded_rows == rows) return data;
  storage.assign(padded_rows * width, T{0});
  std::memcpy(storage.data(), data, rows * width * sizeof(T));
  return storage.data();
}

// The first 64-byte-aligned element of `storage` (sized with 64 bytes to spare): tile loads and
// stores of whole lines.
template <class T>
T* aligned64(std::vector<T>& storage) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) &
                              ~uintptr_t{63});
}
#endif

#if defined(BOXCAR_QUANT_AMX)
// The bf16 panel on AMX tiles: the panel is PanelBf16's, [pairs][16][2], which is a tile of B's
// layout (a row a pair of depth, 16 columns of 2 values), so each 32 values of depth of it are
// one B tile, and `tdpbf16ps` multiplies a 16-row x 32-deep tile of x by it into a
// 16 x 16 fp32 tile of sums: 8,192 multiply-adds an instruction where vdpbf16ps does 512. The
// products and the fp32 sums are the bf16 panel's (only their order differs), and the step is
// then bound by dequantizing the panel, once a pair and panel whatever the rows.
//
// Tiles: 0-3 the sums of up to 4 blocks of 16 rows of x (64 rows), 4 the panel's B, 5-7 x's A
// (a block's A in its own register, so that a load need not wait for the last product that read
// it). A thread walks its pairs kAmxChunkPairs at a time panel by panel (each pair's sums, 64
// rows at a time, read from and written back to memory once a panel), so that a panel's slice
// of x is read from cache by the chunk's pairs, not streamed from L2 by every one. x's rows are
// padded to a multiple of 16 with zeros (a copy, only when they are not) so that every tile is
// whole. The panel is filled a pair of tiles at once (fill_panel).
constexpr int kAmxGroupRows = 4 * kAmxTileRows;

void amx_configure() {
  boxcar_amx::TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Sums tiles 0 .. blocks-1 += x's 16-row blocks (x at the panel's first value of depth, row
// stride `depth` elements) @ the panel's first `subtiles` B tiles.
inline void amx_group(const uint16_t* x, int64_t depth, int blocks, const uint16_t* panel,
                      int subtiles) {
  const int64_t stride = 2 * depth;  // bytes
  for (int kk = 0; kk < subtiles; ++kk) {
    _tile_loadd(4, panel + kk * 512, 64);
    const uint16_t* a = x + 32 * kk;
    _tile_loadd(5, a, stride);
    _tile_dpbf16ps(0, 5, 4);
    if (blocks > 1) {
      _tile_loadd(6, a + kAmxTileRows * depth, stride);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (blocks > 2) {
      _tile_loadd(7, a + 2 * kAmxTileRows * depth, stride);
      _tile_dpbf16ps(2, 7, 4);
    }
    if (blocks > 3) {
      _tile_loadd(5, a + 3 * kAmxTileRows * depth, stride);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
}

inline void amx_load_sums(const float* c, int blocks) {
  _tile_loadd(0, c, 64);
  if (blocks > 1) _tile_loadd(1, c + 256, 64);
  if (blocks > 2) _tile_loadd(2, c + 512, 64);
  if (blocks > 3) _tile_loadd(3, c + 768, 64);
}

inline void amx_store_sums(float* c, int blocks) {
  _tile_stored(0, c, 64);
  if (blocks > 1) _tile_stored(1, c + 256, 64);
  if (blocks > 2) _tile_stored(2, c + 512, 64);
  if (blocks > 3) _tile_stored(3, c + 768, 64);
}

inline void amx_zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Pairs a thread takes through the depth together: the panel's slice of x (its rows x 256
// values of depth) is read by each of them in turn while it is in L1/L2, and their sums
// (kAmxChunkPairs x rows x 16 fp32) stay in L2.
// (1, 4, 8, 16 measured: within ~10% of each other, 4 the best at 64 rows; the panel's
// dequantization, not x's reads, bounds the path.)
constexpr int64_t kAmxChunkPairs = 4;

template <class F>
void run_panel_amx(const Problem& p) {
  constexpr int kBlocksAPanel = std::max(1, kPanelDepth / F::kBlock);
  const int64_t padded_rows = (p.rows + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows;
  std::vector<uint16_t> padded;
  const uint16_t* x = amx_padded(p.xh, p.rows, p.depth, padded_rows, padded);
  const int64_t pairs = (p.num_tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    std::vector<uint16_t> storage(PanelBf16::kPanelElems + 32);
    uint16_t* panel = aligned64(storage);
    const int64_t pair_sums = padded_rows * 16;  // a pair's c[padded rows][16]
    std::vector<float> sums_storage(kAmxChunkPairs * pair_sums + 16);
    float* sums = aligned64(sums_storage);
    for (int64_t first = begin; first < end; first += kAmxChunkPairs) {
      const int64_t last = std::min(end, first + kAmxChunkPairs);
      for (int64_t b0 = 0; b0 < p.blocks; b0 += kBlocksAPanel) {
        const int count = static_cast<int>(std::min<int64_t>(kBlocksAPanel, p.blocks - b0));
        const int subtiles = count * F::kBlock / 32;
        for (int64_t pair = first; pair < last; ++pair) {
          const int64_t t0 = 2 * pair;
          const bool two = t0 + 1 < p.num_tiles;
          if (!two) std::fill(panel, panel + PanelBf16::kPanelElems, uint16_t{0});
          fill_panel<F, PanelBf16>(p, t0, two, b0, count, panel);
          float* c = sums + (pair - first) * pair_sums;
          for (int64_t r0 = 0; r0 < padded_rows; r0 += kAmxGroupRows) {
            const int blocks = static_cast<int>(
                std::min<int64_t>(kAmxGroupRows, padded_rows - r0) / kAmxTileRows);
            if (b0 == 0) {
              amx_zero_sums();
            } else {
              amx_load_sums(c + r0 * 16, blocks);
            }
            amx_group(x + r0 * p.depth + b0 * F::kBlock, p.depth, blocks, panel, subtiles);
            amx_store_sums(c + r0 * 16, blocks);
          }
        }
      }
      for (int64_t pair = first; pair < last; ++pair) {
        write_out(p, sums + (pair - first) * pair_sums, 16, 0, p.rows, 2 * pair * kLanes, 16);
      }
    }
    _tile_release();
  });
}
#endif

#if defined(BOXCAR_QUANT_VNNI)
// c[MR][16] += the screen's sums of MR rows of x over `blocks` blocks of 32 against the panel
// (PanelQ8): per block, 8 vpdpbusd (a broadcast of 4 of a row's int8 values against 16 rows' 4
// flipped weights) from the row's offset, then one fp32 multiply-add by d_w * d_x.
template <int MR>
inline void micro_kernel_q8(const int8_t* x, const float* scales, const int32_t* offsets,
                            int64_t stride, int64_t block_stride, const uint8_t* panel,
                            const float* d, int blocks, float* c) {
  __m512 acc[MR];
  unroll<MR>([&](auto r) { acc[r] = _mm512_loadu_ps(c + 16 * r); });
  for (int b = 0; b < blocks; ++b) {
    __m512i sums[MR];
    unroll<MR>([&](auto r) { sums[r] = _mm512_set1_epi32(offsets[r * block_stride + b]); });
    unroll<8>([&](auto g) {
      const __m512i w = _mm512_load_si512(panel + 64 * (8 * b + g));
      unroll<MR>([&](auto r) {
        int32_t four;
        std::memcpy(&four, x + r * stride + 32 * b + 4 * g, sizeof four);
        sums[r] = _mm512_dpbusd_epi32(sums[r], w, _mm512_set1_epi32(four));
      });
    });
    const __m512 dw = _mm512_load_ps(d + 16 * b);
    unroll<MR>([&](auto r) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(scales[r * block_stride + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, acc[r]);
    });
  }
  unroll<MR>([&](auto r) { _mm512_storeu_ps(c + 16 * r, acc[r]); });
}

// Rows a screen micro-kernel call takes: MR int32 sums and MR fp32 sums, a panel vector, d and
// a scale in the 32 zmm registers.
constexpr int kMicroRowsQ8 = 10;

// The int8 screen's panel (header): 4 KB of flipped values, [64][16][4], then d fp32 [8][16].
struct PanelQ8 {
  using Elem = uint8_t;
  static constexpr int kAlign = 64;
  static constexpr int kValueBytes = kPanelDepth * 16;
  static constexpr int kPanelElems = kValueBytes + (kPanelDepth / 32) * 16 * sizeof(float);
  static constexpr int kMicroRows = kMicroRowsQ8;
  static constexpr bool kFillsPairs = false;
  // x is a quarter of the fp32 panel's bytes a row, so 4x its rows stay in L2
  static int64_t block_rows(int64_t depth) { return 4 * panel_rows(depth); }
  template <class F>
  static void fill(const uint8_t* tile, Elem* panel, int blk, int half_index) {
    fill_values<F>(tile, panel, blk, half_index, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  // fill with the values xor `flip` (0x80: vpdpbusd's unsigned operand; 0: AMX's tdpbssd)
  template <class F>
  static void fill_values(const uint8_t* tile, Elem* panel, int blk, int half_index,
                          __m256i flip) {
    static_assert(std::is_same_v<F, Q8_0>, "the int8 screen's panel holds Q8_0 values");
    // A tile's 4 depths x 8 rows (byte 8k + lane) -> 8 rows x 4 depths (byte 4 lane + k).
    alignas(32) static constexpr uint8_t kTranspose[32] = {
        0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
        4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31};
    const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(kTranspose));
    uint8_t* dst = panel + blk * 32 * 16 + 32 * half_index;
    unroll<8>([&](auto g) {
      const __m256i v = load8(tile + F::kValuesAt + 32 * g);
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 64 * g),
                         _mm256_xor_si256(_mm256_permutexvar_epi8(order, v), flip));
    });
    float* d = reinterpret_cast<float*>(panel + kValueBytes) + blk * 16 + 8 * half_index;
    _mm256_store_ps(d, halves(tile));
  }
  static void micro(const Problem& p, int64_t m, int64_t k0, int rows, const Elem* panel,
                    int depth, float* c) {
    const int64_t blocks = p.depth / 32, b0 = k0 / 32;
    const int8_t* x = p.xq + m * p.depth + k0;
    const float* scales = p.xq_scales + m * blocks + b0;
    const int32_t* offsets = p.xq_offsets + m * blocks + b0;
    const float* d = reinterpret_cast<const float*>(panel + kValueBytes);
    switch (rows) {
#define BOXCAR_ROWS(n)                                                                      \
  case n:                                                                                   \
    return micro_kernel_q8<n>(x, scales, offsets, p.depth, blocks, panel, d, depth / 32, c);
      BOXCAR_ROWS(1) BOXCAR_ROWS(2) BOXCAR_ROWS(3) BOXCAR_ROWS(4) BOXCAR_ROWS(5)
      BOXCAR_ROWS(6) BOXCAR_ROWS(7) BOXCAR_ROWS(8) BOXCAR_ROWS(9)
#undef BOXCAR_ROWS
      default: return micro_kernel_q8<kMicroRowsQ8>(x, scales, offsets, p.depth, blocks, panel,
                                                    d, depth / 32, c);
    }
  }
};
#endif

#if defined(BOXCAR_QUANT_VNNI) && defined(BOXCAR_AMX) && defined(__AMX_INT8__)
#define BOXCAR_QUANT_AMX_INT8 1
// The int8 screen on AMX tiles: the same formula, each block's int32 sums by `tdpbssd` (signed
// times signed: the panel's values go in unflipped and no offset is needed), a 16-row x 32-deep
// tile of x's int8 values times an 8 x 64-byte tile of a block's 32 values of 16 rows (the
// panel's layout, [groups of 4 depth][16][4]): 8,192 multiply-adds an instruction where
// vpdpbusd does 64. Each block's 16 x 16 int32 sums then go through memory (a tile store, 1 KB
// in L1) into the fp32 sums, times fl(d_w * d_x) as in the VNNI kernel: that epilogue, not the
// tile unit, bounds it. Tiles: 0-1 the int32 sums of two blocks (one stored while the next is
// computed), 2-3 x's blocks, 4-5 the panel's. x's rows are padded to a multiple of 16 (zeros,
// scale 0).
void amx_int8_configure() {
  boxcar_amx::TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 2; ++t) {  // C: 16 rows of 16 int32
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  for (int t = 2; t < 4; ++t) {  // A: 16 rows of a block's 32 int8
    cfg.rows[t] = 16;
    cfg.colsb[t] = 32;
  }
  for (int t = 4; t < 6; ++t) {  // B: 8 groups of 4 depth x 16 rows x 4
    cfg.rows[t] = 8;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// acc[16] += the int32 sums at `sums` ([16][16]) times d_w (16 columns) * d_x[r] (16 rows).
inline void amx_int8_epilogue(const int32_t* sums, const float* dw, const float* dx,
                              int64_t dx_stride, __m512* acc) {
  const __m512 w = _mm512_load_ps(dw);
  unroll<16>([&](auto r) {
    const __m512 scale = _mm512_mul_ps(w, _mm512_set1_ps(dx[r * dx_stride]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r)), scale,
                             acc[r]);
  });
}

void run_screen_amx(const Problem& p) {
  const int64_t blocks = p.depth / 32;
  const int64_t padded_rows = (p.rows + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows;
  std::vector<int8_t> xq_padded;
  std::vector<float> scales_padded;
  const int8_t* xq = amx_padded(p.xq, p.rows, p.depth, padded_rows, xq_padded);
  const float* scales = amx_padded(p.xq_scales, p.rows, blocks, padded_rows, scales_padded);
  constexpr int kBlocksAPanel = kPanelDepth / 32;
  const int64_t pairs = (p.num_tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    amx_int8_configure();
    std::vector<uint8_t> storage(PanelQ8::kPanelElems + 64);
    uint8_t* panel = aligned64(storage);
    const float* d = reinterpret_cast<const float*>(panel + PanelQ8::kValueBytes);
    std::vector<float> sums_storage(padded_rows * 16 + 16);  // c[padded rows][16]
    float* c = aligned64(sums_storage);
    alignas(64) int32_t block_sums[2][256];
    const __m256i no_flip = _mm256_setzero_si256();
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t0 = 2 * pair;
      const bool two = t0 + 1 < p.num_tiles;
      if (!two) std::fill(panel, panel + PanelQ8::kPanelElems, uint8_t{0});
      for (int64_t b0 = 0; b0 < blocks; b0 += kBlocksAPanel) {
        const int count = static_cast<int>(std::min<int64_t>(kBlocksAPanel, blocks - b0));
        for (int blk = 0; blk < count; ++blk) {
          for (int half_index = 0; half_index < (two ? 2 : 1); ++half_index) {
            PanelQ8::fill_values<Q8_0>(
                p.tiles + ((t0 + half_index) * blocks + b0 + blk) * Q8_0::kTileBytes, panel,
                blk, half_index, no_flip);
          }
        }
        for (int64_t r0 = 0; r0 < padded_rows; r0 += 16) {
          __m512 acc[16];
          unroll<16>([&](auto r) {
            acc[r] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(c + (r0 + r) * 16);
          });
          const int8_t* x = xq + r0 * p.depth + b0 * 32;
          const float* dx = scales + r0 * blocks + b0;
          int b = 0;
          for (; b + 1 < count; b += 2) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(2, x + 32 * b, p.depth);
            _tile_loadd(4, panel + 512 * b, 64);
            _tile_dpbssd(0, 2, 4);
            _tile_loadd(3, x + 32 * (b + 1), p.depth);
            _tile_loadd(5, panel + 512 * (b + 1), 64);
            _tile_dpbssd(1, 3, 5);
            _tile_stored(0, block_sums[0], 64);
            _tile_stored(1, block_sums[1], 64);
            amx_int8_epilogue(block_sums[0], d + 16 * b, dx + b, blocks, acc);
            amx_int8_epilogue(block_sums[1], d + 16 * (b + 1), dx + b + 1, blocks, acc);
          }
          if (b < count) {
            _tile_zero(0);
            _tile_loadd(2, x + 32 * b, p.depth);
            _tile_loadd(4, panel + 512 * b, 64);
            _tile_dpbssd(0, 2, 4);
            _tile_stored(0, block_sums[0], 64);
            amx_int8_epilogue(block_sums[0], d + 16 * b, dx + b, blocks, acc);
          }
          unroll<16>([&](auto r) { _mm512_store_ps(c + (r0 + r) * 16, acc[r]); });
        }
      }
      write_out(p, c, 16, 0, p.rows, t0 * kLanes, 16);
    }
    _tile_release();
  });
}
#endif

// The int8 screen (header): out bf16 [rows, out_features] from a Q8_0 weight's tiles and x
// quantized by blocks of 32: xq int8 [rows, in_features], scales fp32 [rows, in_features / 32].
bool quant_amx_int8_available() {
#if defined(BOXCAR_QUANT_AMX_INT8)
  return boxcar_amx::permitted();
#else
  return false;
#endif
}

// amx: on AMX tiles (run_screen_amx; needs quant_amx_int8_available()), else vpdpbusd.
void quant_screen_q8_0(const torch::Tensor& tiles, int64_t in_features, int64_t out_features,
                       const torch::Tensor& xq, const torch::Tensor& scales, torch::Tensor& out,
                       bool amx) {
  TORCH_CHECK(!amx || quant_amx_int8_available(),
              "the int8 screen's amx path needs a CPU whose AMX tiles this process may use");
#if defined(BOXCAR_QUANT_VNNI)
  const int64_t blocks = check_rows<Q8_0>(tiles, in_features);
  const int64_t num_tiles = (out_features + kLanes - 1) / kLanes;
  TORCH_CHECK(tiles.dim() == 2 && tiles.size(0) == num_tiles &&
                  tiles.size(1) == blocks * Q8_0::kTileBytes,
              "tiles do not fit ", out_features, " x ", in_features, " in Q8_0");
  TORCH_CHECK(xq.scalar_type() == torch::kInt8 && xq.dim() == 2 && xq.is_contiguous() &&
                  xq.size(1) == in_features, "xq must be a contiguous int8 [rows, in_features]");
  const int64_t rows = xq.size(0);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == rows && scales.size(1) == blocks,
              "scales must be a contiguous fp32 [rows, in_features / 32]");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == rows && out.size(1) == out_features,
              "out must be a contiguous bf16 [rows, out_features]");
  if (rows == 0) return;
  const int8_t* q = xq.data_ptr<int8_t>();
#if defined(BOXCAR_QUANT_AMX_INT8)
  if (amx) {
    Problem p{tiles.data_ptr<uint8_t>(), blocks, num_tiles, nullptr, nullptr, rows,
              in_features, out_features, nullptr, out};
    p.xq = q;
    p.xq_scales = scales.data_ptr<float>();
    return run_screen_amx(p);
  }
#endif
  std::vector<int32_t> offsets(rows * blocks);
  for (int64_t i = 0; i < rows * blocks; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 32; ++k) sum += q[32 * i + k];
    offsets[i] = -128 * sum;
  }
  Problem p{tiles.data_ptr<uint8_t>(), blocks, num_tiles, nullptr, nullptr, rows,
            in_features, out_features, nullptr, out};
  p.xq = q;
  p.xq_scales = scales.data_ptr<float>();
  p.xq_offsets = offsets.data();
  run_panel<Q8_0, PanelQ8>(p);
#else
  TORCH_CHECK(false, "the int8 screen needs a build with AVX512-VNNI and AVX512-VBMI");
#endif
}

// Whether the bf16 panel runs on AMX tiles here (built with them, and the process may use them).
bool quant_amx_available() {
#if defined(BOXCAR_QUANT_AMX)
  return boxcar_amx::permitted();
#else
  return false;
#endif
}

// out = x @ W.T (+ bias). path: "auto", "fused", "panel" (the AVX-512 or AVX2 panel), "amx" (the
// bf16 panel on AMX tiles; "auto" takes it for a bf16 x above kFusedMaxRows where it runs) or
// "generic".
void quant_linear(const std::string& fmt, const torch::Tensor& tiles, int64_t in_features,
                  int64_t out_features, const torch::Tensor& x,
                  const c10::optional<torch::Tensor>& bias, torch::Tensor& out,
                  const std::string& path) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous() && x.size(1) == in_features,
              "x must be a contiguous fp32 or bf16 [rows, in_features]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.size(1) == out_features &&
                  (out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16),
              "out must be a contiguous fp32 or bf16 [rows, out_features]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                    bias->numel() == out_features, "bias must be a contiguous fp32 [out_features]");
  }
  TORCH_CHECK(path == "auto" || path == "fused" || path == "panel" || path == "amx" ||
                  path == "generic",
              "path must be auto, fused, panel, amx or generic, got ", path);
  TORCH_CHECK(path != "amx" || (quant_amx_available() && x.scalar_type() == torch::kBFloat16),
              "the amx path takes a bf16 x on a CPU whose AMX tiles this process may use");
  visit(fmt, [&](auto f) {
    using F = decltype(f);
    const int64_t blocks = check_rows<F>(tiles, in_features);
    const int64_t num_tiles = (out_features + kLanes - 1) / kLanes;
    TORCH_CHECK(tiles.dim() == 2 && tiles.size(0) == num_tiles &&
                    tiles.size(1) == blocks * F::kTileBytes, "tiles do not fit ", out_features,
                " x ", in_features, " in ", fmt);
    if (x.size(0) == 0) return;
    const bool fused = path == "fused" || (path == "auto" && x.size(0) <= kFusedMaxRows);
#if defined(BOXCAR_QUANT_BF16)
    if (x.scalar_type() == torch::kBFloat16 && !fused && path != "generic") {
      const auto* xh = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
      Problem p{tiles.data_ptr<uint8_t>(), blocks, num_tiles, nullptr, xh, x.size(0),
                in_features, out_features, bias ? bias->data_ptr<float>() : nullptr, out};
#if defined(BOXCAR_QUANT_AMX)
      if (path == "amx" || (path == "auto" && quant_amx_available())) {
        return run_panel_amx<F>(p);
      }
#endif
      std::vector<uint16_t> spread;
      p.xh = spread_rows(xh, p.rows, in_features, spread, p.xh_stride);
      return run_panel<F, PanelBf16>(p);
    }
#endif
    const torch::Tensor xf = x.to(torch::kFloat);  // x itself when it is fp32
    const Problem p{tiles.data_ptr<uint8_t>(), blocks, num_tiles, xf.data_ptr<float>(), nullptr,
                    xf.size(0), in_features, out_features,
                    bias ? bias->data_ptr<float>() : nullptr, out};
#if defined(BOXCAR_QUANT_AVX2)
    if (fused) return run_fused<F>(p);
    if (path != "generic") return run_panel<F, PanelF32>(p);
#endif
    run_generic<F>(p);
  });
}

}  // namespace

// Called from the extension's one PYBIND11_MODULE (paged_decode_attention.cpp).
void register_quant_gemm(pybind11::module& m) {
  m.def("quant_repack", &quant_repack,
        "ggml's rows (uint8 [out, row_bytes]) -> the kernel's tiles of 8 interleaved rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_unpack_rows", &quant_unpack_rows,
        "ggml's bytes of some rows of a repacked weight (uint8 [len(ids), row_bytes])",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear", &quant_linear,
        "out = x @ W.T (+ bias) for a repacked ggml weight; path auto|fused|panel|amx|generic",
        py::arg("fmt"), py::arg("tiles"), py::arg("in_features"), py::arg("out_features"),
        py::arg("x"), py::arg("bias"), py::arg("out"), py::arg("path") = "auto",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_screen_q8_0", &quant_screen_q8_0,
        "the int8 screen's bf16 approximation of x @ W.T for a repacked Q8_0 weight",
        py::arg("tiles"), py::arg("in_features"), py::arg("out_features"), py::arg("xq"),
        py::arg("scales"), py::arg("out"), py::arg("amx") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_amx_int8_available", &quant_amx_int8_available,
        "whether the int8 screen runs on AMX tiles here");
  m.def("quant_amx_available", &quant_amx_available,
        "whether a bf16 x's panel path runs on AMX tiles here");
  m.attr("quant_formats") = kFormats;
#if defined(BOXCAR_QUANT_VNNI)
  m.attr("quant_int8_screen") = true;
#else
  m.attr("quant_int8_screen") = false;
#endif
#if defined(BOXCAR_QUANT_BF16)
  m.attr("quant_isa") = "avx512_bf16";
#elif defined(BOXCAR_QUANT_AVX2)
  m.attr("quant_isa") = "avx2";
#else
  m.attr("quant_isa") = "generic";
#endif
}
