// Fused elementwise ops of a bf16 decoder layer on the CPU, each one pass over its rows.
//
// In bf16 a decode step's elementwise work is a few dozen rows of 576 values a layer: each torch
// op over it costs more in dispatch, allocation and the bf16 <-> fp32 round trips than in
// arithmetic. These kernels widen bf16 to fp32 in registers, compute in fp32 and round once.
//
// fused_add_rms_norm: residual = x + residual, in fp32 (the residual stream is fp32 in every
//                     dtype: engine/layers/norm.py);
//                     x = bf16(residual * rsqrt(mean(residual^2) + eps) * weight), in place,
//                     rounded once (Hugging Face's LlamaRMSNorm rounds the normalized value
//                     before it scales: a second rounding that only moves bf16 from fp32).
// silu_and_mul:       out = bf16(silu(gate) * up) for gate_up = [gate | up] along the last dim.
// rotary_neox:        in place, each head's halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
//                     with fp32 cos/sin tables indexed by position.
// store_kvcache:      k and v rows (each token's heads one contiguous run) into the paged caches'
//                     slots: one memcpy a row instead of two index_copy_ calls.
// screen_candidates:  the greedy screen's candidate tokens (engine/layers/greedy_screen.py): per
//                     row, bound = h_r * w_norm[v] + |y~| * u', and the tokens whose y~ + bound
//                     reaches the row's best y~ - bound; two passes over the bf16 screen instead
//                     of ten torch ops over an fp32 copy of it.
//
// Every tensor here is bf16 except the residual and the tables (fp32) and positions (int64);
// rows may be strided (a row stride is passed), the last dim is contiguous. The launchers in
// engine/kernels/cpu_fused_ops.py check that.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as c10::BFloat16 does for finite values (the ops here see no NaNs a
// model could recover from, so NaN keeps no special case).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_round(float f) { return bf16_to_float(float_to_bf16(f)); }

// torch's elementwise grain: below ~32k values one thread does the whole tensor, since an
// OpenMP region costs more than the work (and far more when a peer thread waits for a core).
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
uint16_t* mutable_bits(torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

void fused_add_rms_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                        double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  uint16_t* x_ptr = mutable_bits(x);
  float* r_ptr = residual.data_ptr<float>();
  const uint16_t* w = bits(weight);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      uint16_t* xr = x_ptr + row * x_stride;
      float* rr = r_ptr + row * r_stride;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < hidden; ++d) {
        const float f = bf16_to_float(xr[d]) + rr[d];
        rr[d] = f;
        sum += f * f;
      }
      const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + feps);
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) {
        xr[d] = float_to_bf16(rr[d] * inv_rms * bf16_to_float(w[d]));
      }
    }
  });
}

void silu_and_mul(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = out.size(0), width = out.size(1);
  const int64_t in_stride = gate_up.stride(0), out_stride = out.stride(0);
  const uint16_t* in_ptr = bits(gate_up);
  uint16_t* out_ptr = mutable_bits(out);
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint16_t* gate = in_ptr + row * in_stride;
      const uint16_t* up = gate + width;
      uint16_t* o = out_ptr + row * out_stride;
#pragma omp simd
      for (int64_t d = 0; d < width; ++d) {
        const float g = bf16_to_float(gate[d]);
        o[d] = float_to_bf16(g / (1.0f + std::exp(-g)) * bf16_to_float(up[d]));
      }
    }
  });
}

void rotary_neox(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos_cache,
                 const torch::Tensor& sin_cache) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const int64_t half = head_dim / 2;
  const int64_t table_stride = cos_cache.stride(0);
  uint16_t* x_ptr = mutable_bits(x);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_ptr = cos_cache.data_ptr<float>();
  const float* sin_ptr = sin_cache.data_ptr<float>();
  const int64_t max_position = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " is outside the ",
                "rotary tables' [0, ", max_position, ")");
  }
  at::parallel_for(0, tokens, grain_rows(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + pos[t] * table_stride;
      const float* s = sin_ptr + pos[t] * table_stride;
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* x1 = x_ptr + t * token_stride + h * head_stride;
        uint16_t* x2 = x1 + half;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = bf16_to_float(x1[d]), b = bf16_to_float(x2[d]);
          x1[d] = float_to_bf16(a * c[d] - b * s[d]);
          x2[d] = float_to_bf16(b * c[d] + a * s[d]);
        }
      }
    }
  });
}

#if defined(__AVX512F__)
inline __m512 bf16x16(const uint16_t* p) {  // 16 bf16 -> 16 fp32, exactly
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// One row of screen_candidates: the tokens v of y (bf16 [vocab]) with y + bound >= the row's
// best y - bound, bound = h * w[v] + |y| * u, appended to `tokens` in order. With AVX-512 16
// tokens a step, explicitly: the compiler's own vectorization of these loops gathered w (a
// [64, 262,144] screen took 26-28 ms on one Zen 4 thread, two passes over 34 MB).
void row_candidates(const uint16_t* y, const float* w, int64_t vocab, float h, float u,
                    std::vector<int64_t>& tokens) {
  auto bound = [&](float a, int64_t v) { return h * w[v] + std::fabs(a) * u; };
  float best_lower = -std::numeric_limits<float>::infinity();
  int64_t v = 0;
#if defined(__AVX512F__)
  const __m512 hv = _mm512_set1_ps(h), uv = _mm512_set1_ps(u);
  auto bound16 = [&](__m512 a, int64_t at) {
    return _mm512_fmadd_ps(hv, _mm512_loadu_ps(w + at), _mm512_mul_ps(_mm512_abs_ps(a), uv));
  };
  __m512 best = _mm512_set1_ps(best_lower);
  for (; v + 16 <= vocab; v += 16) {
    const __m512 a = bf16x16(y + v);
    best = _mm512_max_ps(best, _mm512_sub_ps(a, bound16(a, v)));
  }
  best_lower = _mm512_reduce_max_ps(best);
#endif
  for (; v < vocab; ++v) {
    const float a = bf16_to_float(y[v]);
    best_lower = std::max(best_lower, a - bound(a, v));
  }
  v = 0;
#if defined(__AVX512F__)
  const __m512 lower = _mm512_set1_ps(best_lower);
  for (; v + 16 <= vocab; v += 16) {
    const __m512 a = bf16x16(y + v);
    __mmask16 pass = _mm512_cmp_ps_mask(_mm512_add_ps(a, bound16(a, v)), lower, _CMP_GE_OQ);
    for (; pass; pass &= pass - 1) tokens.push_back(v + __builtin_ctz(pass));
  }
#endif
  for (; v < vocab; ++v) {
    const float a = bf16_to_float(y[v]);
    if (a + bound(a, v) >= best_lower) tokens.push_back(v);
  }
}

std::tuple<torch::Tensor, torch::Tensor> screen_candidates(const torch::Tensor& approx,
                                                           const torch::Tensor& row_bounds,
                                                           const torch::Tensor& weight_norms,
                                                           double output_rounding) {
  const int64_t rows = approx.size(0), vocab = approx.size(1), stride = approx.stride(0);
  const uint16_t* y_ptr = bits(approx);
  const float* h_ptr = row_bounds.data_ptr<float>();
  const float* w_ptr = weight_norms.data_ptr<float>();
  const float u = static_cast<float>(output_rounding);
  std::vector<std::vector<int64_t>> found(rows);
  // A row is ~50k values: one row a work item.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      row_candidates(y_ptr + r * stride, w_ptr, vocab, h_ptr[r], u, found[r]);
    }
  });
  int64_t total = 0;
  for (const auto& tokens : found) total += static_cast<int64_t>(tokens.size());
  auto row_ids = torch::empty({total}, torch::kInt64);
  auto token_ids = torch::empty({total}, torch::kInt64);
  int64_t* row_out = row_ids.data_ptr<int64_t>();
  int64_t* token_out = token_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (const int64_t v : found[r]) {
      *row_out++ = r;
      *token_out++ = v;
    }
  }
  return {row_ids, token_ids};
}

void store_kvcache(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                   torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the ",
                "cache's [0, ", num_slots, ")");
  }
  const uint16_t* k_ptr = bits(k);
  const uint16_t* v_ptr = bits(v);
  uint16_t* kc = mutable_bits(k_cache);
  uint16_t* vc = mutable_bits(v_cache);
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(kc + slots[t] * row, k_ptr + t * k_stride, row * sizeof(uint16_t));
    std::memcpy(vc + slots[t] * row, v_ptr + t * v_stride, row * sizeof(uint16_t));
  }
}

// Called from the extension's one PYBIND11_MODULE (paged_decode_attention.cpp).
void register_fused_ops(pybind11::module& m) {
  // Without the GIL while they run, like torch's own ops.
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual) (bf16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up (bf16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("screen_candidates", &screen_candidates, "the greedy screen's candidates (bf16 screen)",
        py::call_guard<py::gil_scoped_release>());
  m.def("store_kvcache", &store_kvcache, "k and v rows into their cache slots (bf16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_neox", &rotary_neox, "rotary embedding in place, neox halves (bf16)",
        py::call_guard<py::gil_scoped_release>());
}
