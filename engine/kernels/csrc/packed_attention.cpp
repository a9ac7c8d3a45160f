// Packed (varlen) attention on the CPU: ragged sequences back to back, no padding, no KV cache.
//
// Sequence s owns rows cu_seqlens[s]..cu_seqlens[s+1] of q, k and v ([num_tokens, heads,
// head_dim], the last dim contiguous, rows strided); each of its queries attends over its own
// keys only (all of them, or up to its own position when causal). One parallel region covers
// the step: a work item is one (sequence, query head), its scores in a per-thread buffer, the
// softmax and the weighted sum of values in fp32, the output rounded once. Query head h reads
// KV head h / (heads / kv_heads). The launcher in engine/kernels/packed_attention.py checks the
// shapes; its torch reference (packed_attention_ref) is what the tests compare against.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
void packed_attention_impl(const T* q, const T* k, const T* v, T* out, const int32_t* cu,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t sq, int64_t sqh, int64_t sk, int64_t skh,
                           int64_t sv, int64_t svh, int64_t so, int64_t soh, float scale,
                           bool causal) {
  const int64_t group = num_heads / num_kv_heads;
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
