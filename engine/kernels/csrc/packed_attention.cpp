// Packed (varlen) attention on the CPU: ragged sequences back to back, no padding, no KV cache.
//
// Sequence s owns rows cu_seqlens[s]..cu_seqlens[s+1] of q, k and v ([num_tokens, heads,
// head_dim], the last dim contiguous, rows strided); each of its queries attends over its own
// keys only (all of them, or up to its own position when causal). One parallel region covers
// the step: a work item is one (sequence, query head), its scores in a per-thread buffer, the
// softmax and the weighted sum of values in fp32, the output rounded once. Query head h reads
// KV head h / (heads / kv_heads). The launcher in engine/kernels/packed_attention.py checks the
// shapes; its torch reference (packed_attention_ref) is what the tests compare against.
//
// With AVX-512 and a head_dim of 16, 32, 64 or 128 (all_minilm's is 32) an item runs vector code
// (item_avx512): the item's keys transposed once ([head_dim][keys, padded to 16]), so a query's
// scores are 16 keys at a time, summed over d in two register chains (the plain loops kept
// each score in memory and waited on its store every d); the softmax over whole vectors with
// glibc's vector expf; the weighted sum of values in registers, two chains over the keys.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <math.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
constexpr int kVec = 16;  // fp32 lanes of a zmm register
inline int64_t lanes(int64_t n) { return (n + kVec - 1) / kVec * kVec; }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 -> fp32: the bits, shifted up
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  for (int l = 0; l < kVec; ++l) p[l] = static_cast<at::BFloat16>(v[l]);  // nearest even
}

// Scratch rows a thread reuses across its items.
struct Scratch {
  std::vector<float> kt, vf, scores;
};

// One (sequence, query head) item with NB x 16 = head_dim: rows start.. of q, k and v.
template <int NB, typename T>
void item_avx512(const T* q, const T* k, const T* v, T* out, int64_t start, int64_t len,
                 int64_t sq, int64_t sk, int64_t sv, int64_t so, float scale, bool causal,
                 Scratch& scratch) {
  constexpr int64_t kDim = NB * kVec;
  const int64_t width = lanes(len);
  scratch.kt.assign(kDim * width, 0.f);  // keys past len: zeros
  scratch.vf.resize(len * kDim);
  scratch.scores.resize(width);
  float* kt = scratch.kt.data();
  float* vf = scratch.vf.data();
  float* sc = scratch.scores.data();
  for (int64_t j = 0; j < len; ++j) {
    alignas(64) float row[kDim];
    for (int b = 0; b < NB; ++b) {
      store16(row + b * kVec, load16(k + (start + j) * sk + b * kVec));
      store16(vf + j * kDim + b * kVec, load16(v + (start + j) * sv + b * kVec));
    }
    for (int64_t d = 0; d < kDim; ++d) kt[d * width + j] = row[d];
  }
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < len; ++i) {
    alignas(64) float qf[kDim];
    for (int b = 0; b < NB; ++b) {
      _mm512_store_ps(qf + b * kVec,
                      _mm512_mul_ps(load16(q + (start + i) * sq + b * kVec), scale_v));
    }
    const int64_t visible = causal ? i + 1 : len, whole = lanes(visible);
    for (int64_t j = 0; j < whole; j += kVec) {
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      const float* kd = kt + j;
      for (int64_t d = 0; d < kDim; d += 2, kd += 2 * width) {
        even = _mm512_fmadd_ps(_mm512_set1_ps(qf[d]), _mm512_loadu_ps(kd), even);
        odd = _mm512_fmadd_ps(_mm512_set1_ps(qf[d + 1]), _mm512_loadu_ps(kd + width), odd);
      }
      _mm512_storeu_ps(sc + j, _mm512_add_ps(even, odd));
    }
    float best = sc[0];
    for (int64_t j = 1; j < visible; ++j) best = std::max(best, sc[j]);
    for (int64_t j = visible; j < whole; ++j) sc[j] = best;  // exp(0): read by nothing below
    for (int64_t j = 0; j < whole; j += kVec) {
#pragma omp simd
      for (int l = 0; l < kVec; ++l) sc[j + l] = expf(sc[j + l] - best);
    }
    float total = 0.f;
    __m512 acc[2][NB];
    for (int c = 0; c < 2; ++c) {
      for (int b = 0; b < NB; ++b) acc[c][b] = _mm512_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 1 < visible; j += 2) {
      const __m512 p0 = _mm512_set1_ps(sc[j]), p1 = _mm512_set1_ps(sc[j + 1]);
      total += sc[j] + sc[j + 1];
      for (int b = 0; b < NB; ++b) {
        acc[0][b] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vf + j * kDim + b * kVec), acc[0][b]);
        acc[1][b] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vf + (j + 1) * kDim + b * kVec),
                                    acc[1][b]);
      }
    }
    if (j < visible) {
      const __m512 p0 = _mm512_set1_ps(sc[j]);
      total += sc[j];
      for (int b = 0; b < NB; ++b) {
        acc[0][b] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vf + j * kDim + b * kVec), acc[0][b]);
      }
    }
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int b = 0; b < NB; ++b) {
      store16(out + (start + i) * so + b * kVec,
              _mm512_mul_ps(_mm512_add_ps(acc[0][b], acc[1][b]), inv));
    }
  }
}
#endif

template <typename T>
void packed_attention_impl(const T* q, const T* k, const T* v, T* out, const int32_t* cu,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t sq, int64_t sqh, int64_t sk, int64_t skh,
                           int64_t sv, int64_t svh, int64_t so, int64_t soh, float scale,
                           bool causal) {
  const int64_t group = num_heads / num_kv_heads;
#if defined(__AVX512F__)
  // the item function for this head_dim (NB blocks of 16), or none: the plain loops below
  auto* const item_fn = head_dim == 16 ? &item_avx512<1, T>
                        : head_dim == 32 ? &item_avx512<2, T>
                        : head_dim == 64 ? &item_avx512<4, T>
                        : head_dim == 128 ? &item_avx512<8, T> : nullptr;
  if (item_fn != nullptr) {
    at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / num_heads, h = item % num_heads, kh = h / group;
        const int64_t start = cu[s], len = cu[s + 1] - cu[s];
        if (len <= 0) continue;
        item_fn(q + h * sqh, k + kh * skh, v + kh * svh, out + h * soh, start, len, sq, sk, sv,
                so, scale, causal, scratch);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(head_dim), acc(head_dim), kf, vf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_heads, h = item % num_heads, kh = h / group;
      const int64_t start = cu[s], len = cu[s + 1] - cu[s];
      if (len <= 0) continue;
      // This (sequence, KV head)'s keys and values in fp32, once for all its queries.
      kf.resize(len * head_dim);
      vf.resize(len * head_dim);
      for (int64_t j = 0; j < len; ++j) {
        const T* kr = k + (start + j) * sk + kh * skh;
        const T* vr = v + (start + j) * sv + kh * svh;
        for (int64_t d = 0; d < head_dim; ++d) {
          kf[j * head_dim + d] = to_float(kr[d]);
          vf[j * head_dim + d] = to_float(vr[d]);
        }
      }
      scores.resize(len);
      for (int64_t i = 0; i < len; ++i) {
        const T* qr = q + (start + i) * sq + h * sqh;
        for (int64_t d = 0; d < head_dim; ++d) qf[d] = to_float(qr[d]) * scale;
        const int64_t visible = causal ? i + 1 : len;
        float best = -INFINITY;
        for (int64_t j = 0; j < visible; ++j) {
          const float* kr = kf.data() + j * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qf[d] * kr[d];
          scores[j] = dot;
          best = std::max(best, dot);
        }
        float total = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < visible; ++j) {
          const float p = std::exp(scores[j] - best);
          total += p;
          const float* vr = vf.data() + j * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * vr[d];
        }
        const float inv = 1.f / total;
        T* orow = out + (start + i) * so + h * soh;
        for (int64_t d = 0; d < head_dim; ++d) orow[d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

void packed_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& cu_seqlens, torch::Tensor& out, double scale,
                      bool causal) {
  const int64_t num_seqs = cu_seqlens.size(0) - 1;
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  if (q.scalar_type() == at::kFloat) {
    packed_attention_impl<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                 out.data_ptr<float>(), cu, num_seqs, q.size(1), k.size(1),
                                 q.size(2), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                 v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                                 static_cast<float>(scale), causal);
  } else {
    packed_attention_impl<at::BFloat16>(
        q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
        out.data_ptr<at::BFloat16>(), cu, num_seqs, q.size(1), k.size(1), q.size(2),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), static_cast<float>(scale), causal);
  }
}

}  // namespace

// Called from the extension's one PYBIND11_MODULE (paged_decode_attention.cpp).
void register_packed_attention(pybind11::module& m) {
  m.def("packed_attention", &packed_attention, "packed varlen attention (CPU, fp32/bf16)",
        py::call_guard<py::gil_scoped_release>());
}
