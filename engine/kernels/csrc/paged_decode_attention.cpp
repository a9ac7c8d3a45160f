// Paged decode attention for the CPU: one query token per sequence, reading K/V straight from
// the paged cache (no gather copy), GQA heads of one KV head processed together.
//
// q:            [num_seqs, num_heads, head_dim]                      float32, contiguous, or bf16
// k_cache:      [num_blocks, block_size, num_kv_heads, head_dim]     float32 or bfloat16, contiguous
// v_cache:      same as k_cache
// block_tables: [num_seqs, max_blocks]                               int32, contiguous
// context_lens: [num_seqs]                                           int32
// out:          [num_seqs, num_heads, head_dim]                      q's dtype, contiguous
// window:       0, or each query sees only the last `window` positions of its context
// soft_cap:     0, or scores become soft_cap * tanh(score / soft_cap) before the softmax
// sinks:        None, or [num_heads] float32: a per-head logit in each softmax's denominator
//
// A bf16 cache is read as bf16 (half the bytes of a decode step, which is bound by memory
// bandwidth) and widened to fp32 in registers: scores, softmax and the weighted sum of values are
// accumulated in fp32 either way. Where the compiler targets AVX512-BF16, q . k runs on the bf16
// dot-product unit (_mm512_dpbf16_ps: bf16 products, exact in fp32, summed in fp32); q is rounded
// to bf16 for it, which is exact for a bf16 model's queries.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// bf16 is the top half of an fp32: widening is a 16-bit shift, exact.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One (sequence, kv head) pair: scores for the group's query heads over the whole context, a
// softmax, then the weighted sum of values. HEAD_DIM > 0 fixes the head size at compile time so
// the inner loops unroll and vectorize; 0 is the generic fallback.
// The options of one layer's attention (all off: plain softmax over the whole context).
struct Options {
  int64_t window;        // 0: none
  float soft_cap;        // 0: none
  const float* sinks;    // nullptr: none; else this group's sink logits
};

template <int HEAD_DIM, typename KV>
void attend_one(const float* q_group, const KV* k_ptr, const KV* v_ptr,
                const int32_t* table, int64_t len, int64_t group, int64_t head_dim_rt,
                int64_t block_size, int64_t token_stride, int64_t block_stride, float scale,
                float* out_group, std::vector<float>& scores, std::vector<float>& acc,
                const Options& opt) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  // Positions start .. len - 1 are seen (start > 0 with a window); scores are indexed from it.
  const int64_t start = opt.window > 0 ? std::max<int64_t>(0, len - opt.window) : 0;
  const int64_t seen = len - start;
  scores.resize(group * seen);
  acc.assign(group * head_dim, 0.0f);
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  // Pass 1: q . k for every seen context token, block by block (no per-token division).
  for (int64_t j = start / block_size; j < num_blocks; ++j) {
    const KV* k_block = k_ptr + static_cast<int64_t>(table[j]) * block_stride;
    const int64_t first = j * block_size;
    const int64_t n = std::min(block_size, len - first);
    for (int64_t i = std::max<int64_t>(0, start - first); i < n; ++i) {
      const KV* k = k_block + i * token_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q_group + g * head_dim;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * to_float(k[d]);
        s *= scale;
        if (opt.soft_cap > 0.0f) s = opt.soft_cap * std::tanh(s / opt.soft_cap);
        scores[g * seen + first + i - start] = s;
      }
    }
  }
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * seen;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < seen; ++t) m = std::max(m, s[t]);
    if (opt.sinks != nullptr) m = std::max(m, opt.sinks[g]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < seen; ++t) {
      s[t] = std::exp(s[t] - m);
      total += s[t];
    }
    if (opt.sinks != nullptr) total += std::exp(opt.sinks[g] - m);
    inv_sum[g] = 1.0f / total;
  }
  // Pass 2: sum of p * v.
  for (int64_t j = start / block_size; j < num_blocks; ++j) {
    const KV* v_block = v_ptr + static_cast<int64_t>(table[j]) * block_stride;
    const int64_t first = j * block_size;
    const int64_t n = std::min(block_size, len - first);
    for (int64_t i = std::max<int64_t>(0, start - first); i < n; ++i) {
      const KV* v = v_block + i * token_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * seen + first + i - start];
        float* a = acc.data() + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(v[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < head_dim; ++d) {
      out_group[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
    }
  }
}


#if defined(__AVX512F__)
// exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite reduction to
// r in [-ln2/2, ln2/2], degree-7 Taylor polynomial (error ~6e-9 relative), scaled by 2^n.
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 consecutive cache elements as fp32 lanes.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Asks for one head's rows of a block ahead of use: blocks sit at random places in the pool,
// so the hardware prefetcher, which stops at page boundaries, would start cold on each one.
// One prefetch per 64-byte line of a row (4 lines of fp32 at head_dim 64, 2 of bf16).
template <int CHUNKS, typename KV>
static inline void prefetch_block(const KV* block, int64_t block_size, int64_t token_stride) {
  constexpr int per_line = 64 / sizeof(KV);
  for (int64_t t = 0; t < block_size; ++t)
    for (int c = 0; c < 16 * CHUNKS; c += per_line)
      _mm_prefetch(reinterpret_cast<const char*>(block + t * token_stride + c), _MM_HINT_T0);
}

// Sums of 16 vectors, one lane each: out[i] = sum of the lanes of a[i] (a transpose-and-add
// tree, 45 instructions instead of 16 serial horizontal reductions).
static inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// AVX-512 path for GROUP query heads per KV head and head_dim = 16 * CHUNKS: the group's query
// vectors and output accumulators stay in registers; each K/V row is loaded once per group.
// Scores are made 16 tokens at a time: per token and head a 16-lane partial product, then one
// reduce16 turns 16 of them into 16 scores.
template <int GROUP, int CHUNKS, typename KV>
void attend_one_avx512(const float* q_group, const KV* k_ptr, const KV* v_ptr,
                       const int32_t* table, int64_t len, int64_t block_size,
                       int64_t token_stride, int64_t block_stride, float scale, float* out_group,
                       std::vector<float>& scores, const Options& opt) {
  constexpr int64_t head_dim = 16 * CHUNKS;
  // Positions start .. len - 1 are seen (start > 0 with a window); scores are indexed from it.
  const int64_t start = opt.window > 0 ? std::max<int64_t>(0, len - opt.window) : 0;
  const int64_t seen = len - start;
  const int64_t padded = (seen + 15) & ~int64_t{15};
  scores.resize(GROUP * padded);
  __m512 q[GROUP][CHUNKS];
  for (int g = 0; g < GROUP; ++g)
    for (int c = 0; c < CHUNKS; ++c) q[g][c] = _mm512_loadu_ps(q_group + g * head_dim + 16 * c);
#if defined(__AVX512BF16__)
  // q as bf16 pairs for the dot-product unit: element order matches the cache row's.
  constexpr bool dot_bf16 = std::is_same_v<KV, uint16_t> && CHUNKS % 2 == 0;
  __m512bh q_bf16[GROUP][CHUNKS / 2 > 0 ? CHUNKS / 2 : 1];
  if constexpr (dot_bf16)
    for (int g = 0; g < GROUP; ++g)
      for (int c = 0; c < CHUNKS / 2; ++c)
        q_bf16[g][c] = _mm512_cvtne2ps_pbh(q[g][2 * c + 1], q[g][2 * c]);
#endif
  alignas(64) __m512 partial[GROUP][16];
  __m512 maxes[GROUP];
  for (int g = 0; g < GROUP; ++g)
    maxes[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t slot = 0, first = 0;  // tokens gathered in `partial`, position of the first
  auto flush = [&](int64_t n) {
    const __mmask16 mask = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    for (int g = 0; g < GROUP; ++g) {
      for (int64_t t = n; t < 16; ++t) partial[g][t] = _mm512_setzero_ps();
      __m512 s = _mm512_mul_ps(reduce16(partial[g]), vscale);
      if (opt.soft_cap > 0.0f) {  // no vector tanh: 16 scalar ones, rare enough (Gemma 2)
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, s);
        for (int t = 0; t < 16; ++t) lanes[t] = opt.soft_cap * std::tanh(lanes[t] / opt.soft_cap);
        s = _mm512_load_ps(lanes);
      }
      _mm512_storeu_ps(scores.data() + g * padded + first, s);
      maxes[g] = _mm512_mask_max_ps(maxes[g], mask, maxes[g], s);
    }
  };
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  const int64_t start_block = start / block_size;
  for (int64_t j = start_block; j < num_blocks; ++j) {
    const KV* k_block = k_ptr + static_cast<int64_t>(table[j]) * block_stride;
    const int64_t n = std::min(block_size, len - j * block_size);
    if (j + 1 < num_blocks)
      prefetch_block<CHUNKS>(k_ptr + static_cast<int64_t>(table[j + 1]) * block_stride,
                             block_size, token_stride);
    for (int64_t i = std::max<int64_t>(0, start - j * block_size); i < n; ++i) {
      const KV* k = k_block + i * token_stride;
      __m512 acc[GROUP];
#if defined(__AVX512BF16__)
      if constexpr (dot_bf16) {
        for (int g = 0; g < GROUP; ++g) acc[g] = _mm512_setzero_ps();
        for (int c = 0; c < CHUNKS / 2; ++c) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + 32 * c);
          for (int g = 0; g < GROUP; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], q_bf16[g][c], kv);
        }
      } else
#endif
      {
        {
          const __m512 kv = load16(k);
          for (int g = 0; g < GROUP; ++g) acc[g] = _mm512_mul_ps(q[g][0], kv);
        }
        for (int c = 1; c < CHUNKS; ++c) {
          const __m512 kv = load16(k + 16 * c);
          for (int g = 0; g < GROUP; ++g) acc[g] = _mm512_fmadd_ps(q[g][c], kv, acc[g]);
        }
      }
      for (int g = 0; g < GROUP; ++g) partial[g][slot] = acc[g];
      if (++slot == 16) {
        flush(16);
        first += 16;
        slot = 0;
      }
    }
  }
  if (slot) flush(slot);
  float inv_sum[GROUP];
  for (int g = 0; g < GROUP; ++g) {
    float* s = scores.data() + g * padded;
    float m_scalar = _mm512_reduce_max_ps(maxes[g]);
    if (opt.sinks != nullptr) m_scalar = std::max(m_scalar, opt.sinks[g]);
    const __m512 m = _mm512_set1_ps(m_scalar);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const int64_t n = std::min<int64_t>(16, seen - t);
      const __mmask16 mask = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
      _mm512_storeu_ps(s + t, e);
      total = _mm512_mask_add_ps(total, mask, total, e);
    }
    float sum = _mm512_reduce_add_ps(total);
    if (opt.sinks != nullptr) sum += std::exp(opt.sinks[g] - m_scalar);
    inv_sum[g] = 1.0f / sum;
  }
  __m512 out[GROUP][CHUNKS];
  for (int g = 0; g < GROUP; ++g)
    for (int c = 0; c < CHUNKS; ++c) out[g][c] = _mm512_setzero_ps();
  for (int64_t j = start_block; j < num_blocks; ++j) {
    const KV* v_block = v_ptr + static_cast<int64_t>(table[j]) * block_stride;
    const int64_t first_j = j * block_size;
    if (j + 1 < num_blocks)
      prefetch_block<CHUNKS>(v_ptr + static_cast<int64_t>(table[j + 1]) * block_stride,
                             block_size, token_stride);
    const int64_t n = std::min(block_size, len - first_j);
    for (int64_t i = std::max<int64_t>(0, start - first_j); i < n; ++i) {
      const KV* v = v_block + i * token_stride;
      __m512 p[GROUP];
      for (int g = 0; g < GROUP; ++g)
        p[g] = _mm512_set1_ps(scores[g * padded + first_j + i - start]);
      for (int c = 0; c < CHUNKS; ++c) {
        const __m512 vv = load16(v + 16 * c);
        for (int g = 0; g < GROUP; ++g) out[g][c] = _mm512_fmadd_ps(p[g], vv, out[g][c]);
      }
    }
  }
  for (int g = 0; g < GROUP; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int c = 0; c < CHUNKS; ++c)
      _mm512_storeu_ps(out_group + g * head_dim + 16 * c, _mm512_mul_ps(out[g][c], inv));
  }
}

// Calls the specialisation for (group, head_dim) if there is one; false otherwise.
template <int CHUNKS, typename KV>
bool dispatch_group(int64_t group, const float* q_group, const KV* k, const KV* v,
                    const int32_t* table, int64_t len, int64_t block_size, int64_t token_stride,
                    int64_t block_stride, float scale, float* out, std::vector<float>& scores,
                    const Options& opt) {
#define BOXCAR_GROUP_CASE(G)                                                                  \
  case G:                                                                                     \
    attend_one_avx512<G, CHUNKS, KV>(q_group, k, v, table, len, block_size, token_stride,         \
                                 block_stride, scale, out, scores, opt);                      \
    return true;
  switch (group) {
    BOXCAR_GROUP_CASE(1)
    BOXCAR_GROUP_CASE(2)
    BOXCAR_GROUP_CASE(3)
    BOXCAR_GROUP_CASE(4)
    BOXCAR_GROUP_CASE(5)
    BOXCAR_GROUP_CASE(6)
    BOXCAR_GROUP_CASE(7)
    BOXCAR_GROUP_CASE(8)
    default:
      return false;
  }
#undef BOXCAR_GROUP_CASE
}
#endif

// Every (sequence, kv head) pair of the batch; KV is the cache's element type.
template <typename KV>
void attend_all(const float* q_ptr, const KV* k_ptr, const KV* v_ptr, const int32_t* tables,
                const int32_t* lens, float* out_ptr, int64_t num_seqs, int64_t num_heads,
                int64_t head_dim, int64_t block_size, int64_t num_kv_heads, int64_t max_blocks,
                float fscale, int64_t window, float soft_cap, const float* sinks) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  // One work item per sequence, its KV heads in turn: the first head's pass pulls the sequence's
  // blocks into L2 and the others read them from there (the heads of a token share cache lines).
  // at::parallel_for is an inline OpenMP loop: it runs on torch's threads only because the
  // extension is built with -fopenmp (without it, measured: 1 thread, half the speed).
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc;
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        const float* q_group = q_ptr + (seq * num_heads + kv_head * group) * head_dim;
        float* out_group = out_ptr + (seq * num_heads + kv_head * group) * head_dim;
        if (len <= 0) {
          std::fill(out_group, out_group + group * head_dim, 0.0f);
          continue;
        }
        const KV* k_head = k_ptr + kv_head * head_dim;
        const KV* v_head = v_ptr + kv_head * head_dim;
        const Options opt{window, soft_cap, sinks == nullptr ? nullptr : sinks + kv_head * group};
        auto run = [&](auto kernel) {
          kernel(q_group, k_head, v_head, table, len, group, head_dim, block_size, token_stride,
                 block_stride, fscale, out_group, scores, acc, opt);
        };
#if defined(__AVX512F__)
        if (head_dim == 64 && dispatch_group<4>(group, q_group, k_head, v_head, table, len,
                                                block_size, token_stride, block_stride, fscale,
                                                out_group, scores, opt)) {
          continue;
        }
        if (head_dim == 128 && dispatch_group<8>(group, q_group, k_head, v_head, table, len,
                                                 block_size, token_stride, block_stride, fscale,
                                                 out_group, scores, opt)) {
          continue;
        }
#endif
        if (head_dim == 64) {
          run(attend_one<64, KV>);
        } else if (head_dim == 128) {
          run(attend_one<128, KV>);
        } else {
          run(attend_one<0, KV>);
        }
      }
    }
  });
}

}  // namespace

void paged_decode_attention(const torch::Tensor& q_in, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& context_lens, double scale,
                            torch::Tensor& out_in, int64_t window, double soft_cap,
                            const c10::optional<torch::Tensor>& sinks_in) {
  // A bf16 query is widened here (exact) and the fp32 result rounded into the bf16 output once:
  // as torch ops called from Python, the two conversions and a copy cost more than the kernel
  // at a few decode rows.
  const bool bf16_io = q_in.scalar_type() == at::kBFloat16;
  const torch::Tensor q = bf16_io ? q_in.to(at::kFloat).contiguous() : q_in;
  torch::Tensor out = bf16_io ? torch::empty(q.sizes(), q.options()) : out_in;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const float* q_ptr = q.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(soft_cap);
  torch::Tensor sinks_f;
  const float* sinks = nullptr;
  if (sinks_in.has_value()) {
    sinks_f = sinks_in->to(at::kFloat).contiguous();
    sinks = sinks_f.data_ptr<float>();
  }
  if (k_cache.scalar_type() == at::kBFloat16) {
    // c10::BFloat16 is one uint16_t of bits; the kernels read the bits.
    const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    attend_all(q_ptr, k_ptr, v_ptr, tables, lens, out_ptr, num_seqs, num_heads, head_dim,
               block_size, num_kv_heads, max_blocks, fscale, window, fcap, sinks);
  } else {
    attend_all(q_ptr, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables, lens,
               out_ptr, num_seqs, num_heads, head_dim, block_size, num_kv_heads, max_blocks,
               fscale, window, fcap, sinks);
  }
  if (bf16_io) out_in.copy_(out);
}

// Which code path this build runs, for tests and reports.
static const char* isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "generic";
#endif
}

void register_fused_ops(pybind11::module& m);  // cpu_fused_ops.cpp, built into this library
void register_packed_attention(pybind11::module& m);  // packed_attention.cpp, the same
void register_lora_segments(pybind11::module& m);  // lora_segments.cpp, the same
void register_quant_gemm(pybind11::module& m);  // quant_gemm.cpp, the same

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL while it runs, like torch's own ops: other Python threads of the process
  // (an API beside the engine, a result writer) go on meanwhile.
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", &isa, "the instruction set this build was compiled for");
  register_fused_ops(m);
  register_packed_attention(m);
  register_lora_segments(m);
  register_quant_gemm(m);
}
