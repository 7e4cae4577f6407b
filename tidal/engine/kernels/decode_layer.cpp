// A decoder layer in C++: torch.ops.tidal.decode_layer for a step of decodes, and its two halves around
// the attention, layer_attn_in and layer_attn_out, for steps with prefills (the attention stays in Python).
//
// What DecoderLayer.forward in engine/model.py computes: RMSNorm, QKV, rotate-half RoPE, KV write,
// attention (decode_layer: tidal's paged kernel), output projection, residual, RMSNorm, gate/up,
// SiLU(gate) * up, down, residual. The matmuls and the attention are tidal's kernels (or at::linear
// for a matrix without a Q4_1 copy); the elementwise steps are plain loops over each row, in place
// where they can be, instead of ~35 ATen calls a layer: those calls (and the Python around them)
// cost more than the arithmetic of a one-decode step. The loops round differently from torch's
// kernels (the sums of squares, SiLU's exponential): results agree to float32 rounding, not bit
// for bit (tests/engine/test_native.py). Weights: each matrix's float weight (float32, or a bfloat16 model's
// bfloat16), and where it has a Q4_1 copy for steps of at most max_tokens rows, that copy (empty tensors when
// not). The hidden states and norms are float32 either way; the KV cache float32 or bfloat16.
#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kGrain = 1 << 14;  // elements: fewer run on the calling thread

// linear i of [qkv, o, gate_up, down]; shapes[3 i .. 3 i + 2] = (outputs, inputs, max_tokens)
at::Tensor linear(const at::Tensor& x, int64_t i, at::TensorList weights, at::TensorList qs, at::TensorList dm,
                  at::IntArrayRef shapes, const std::optional<at::Tensor>& bias) {
  const int64_t n = shapes[3 * i], k = shapes[3 * i + 1], max_tokens = shapes[3 * i + 2];
  if (qs[i].numel() > 0 && x.size(0) <= max_tokens) {
    at::Tensor y = tidal::q4_1_mm(x, qs[i], dm[i], n, k);
    return bias ? y.add_(*bias) : y;
  }
  if (weights[i].scalar_type() != at::kFloat)  // a bfloat16 model's float matrix: its matmul, in its dtype
    return at::linear(x.to(weights[i].scalar_type()), weights[i], bias).to(at::kFloat);
  return at::linear(x, weights[i], bias);
}

void check_weights(at::TensorList weights, at::TensorList qs, at::TensorList dm, at::IntArrayRef shapes) {
  TORCH_CHECK(weights.size() == 4 && qs.size() == 4 && dm.size() == 4 && shapes.size() == 12,
              "decoder layer: four matrices (qkv, o, gate_up, down), each with (outputs, inputs, max_tokens)");
}

// rows over threads when there is enough work, else on this thread
template <class F>
void rows(int64_t T, int64_t width, const F& f) {
  at::parallel_for(0, T, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

// y = w * x / sqrt(mean(x^2) + eps), row by row (RMSNorm as HF's Llama and Qwen2 define it)
void rms_norm(const float* x, const float* w, float* y, int64_t T, int64_t C, float eps) {
  rows(T, C, [&](int64_t r) {
    const float* xr = x + r * C;
    float* yr = y + r * C;
    int64_t i = 0;
    float ss = 0.f;
#ifdef TIDAL_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= C; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = tidal::hsum(acc);
#endif
    for (; i < C; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
    for (int64_t j = 0; j < C; ++j) yr[j] = w[j] * (xr[j] * inv);
  });
}

// rotate-half RoPE in place on the first `heads` heads of each row: [x1 c - x2 s, x2 c + x1 s]
void rope(float* qkv, int64_t row_stride, const float* cos, const float* sin, int64_t T, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  rows(T, heads * D, [&](int64_t r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = qkv + r * row_stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  });
}

// out[r, :I] = silu(gu[r, :I]) * gu[r, I:]
void silu_mul(const float* gu, float* out, int64_t T, int64_t I) {
  rows(T, I, [&](int64_t r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* o = out + r * I;
    int64_t i = 0;
#ifdef TIDAL_AVX2
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= I; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 e = tidal::exp_nonpos(_mm256_or_ps(x, sign));  // e^-|x|, never overflows
      const __m256 p = _mm256_div_ps(one, _mm256_add_ps(one, e));  // sigmoid(|x|)
      const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
      const __m256 sig = _mm256_blendv_ps(p, _mm256_mul_ps(e, p), neg);  // sigmoid(x)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  });
}

// the first half of a layer: RMSNorm, QKV (+ bias), RoPE on q and k, the new K and V into their slots.
// Returns qkv [T, (H + 2 KVH) D] with q and k rotated; attention reads q (and, for a prefill, k and v) from it
at::Tensor attn_in(const at::Tensor& h, const at::Tensor& norm1, at::TensorList weights, at::TensorList qs,
                   at::TensorList dm, at::IntArrayRef shapes, const std::optional<at::Tensor>& qkv_bias,
                   const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads, double eps) {
  check_weights(weights, qs, dm, shapes);
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat && k_cache.dim() == 4 &&
                  (k_cache.scalar_type() == at::kFloat || bf16) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  norm1.scalar_type() == at::kFloat,
              "decoder layer: h and the norm weight must be contiguous float32, the caches contiguous float32 or "
              "bfloat16 4-d");
  const int64_t T = h.size(0), C = h.size(1), D = k_cache.size(3), H = num_heads, KVH = num_kv_heads;
  const int64_t q_size = H * D, kv_size = KVH * D, width = q_size + 2 * kv_size;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D / 2 && sin.numel() == T * D / 2 &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T &&
                  k_cache.size(2) == KVH,
              "decoder layer: cos/sin [tokens, 1, head_dim/2], one int64 slot per token, the caches' KV heads");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  for (int64_t r = 0; r < T; ++r)  // checked before anything is written
    TORCH_CHECK(sl[r] >= 0 && sl[r] < slots_total, "decoder layer: slot ", sl[r], " is outside the cache");
  at::Tensor x = at::empty_like(h);
  rms_norm(h.data_ptr<float>(), norm1.data_ptr<float>(), x.data_ptr<float>(), T, C, static_cast<float>(eps));
  at::Tensor qkv = linear(x, 0, weights, qs, dm, shapes, qkv_bias).contiguous();
  TORCH_CHECK(qkv.size(1) == width, "decoder layer: QKV has ", qkv.size(1), " outputs, heads need ", width);
  float* qkvp = qkv.data_ptr<float>();
  rope(qkvp, width, cos.data_ptr<float>(), sin.data_ptr<float>(), T, H + KVH, D);
  if (bf16) {  // a bfloat16 cache (a bfloat16 model): K and V rounded as torch rounds them
    auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    rows(T, 2 * kv_size, [&](int64_t r) {
      const float* row = qkvp + r * width;
      tidal::f32_to_bf16(row + q_size, kc + sl[r] * kv_size, kv_size);
      tidal::f32_to_bf16(row + q_size + kv_size, vc + sl[r] * kv_size, kv_size);
    });
    return qkv;
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  rows(T, 2 * kv_size, [&](int64_t r) {
    const float* row = qkvp + r * width;
    std::memcpy(kc + sl[r] * kv_size, row + q_size, kv_size * sizeof(float));
    std::memcpy(vc + sl[r] * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
  });
  return qkv;
}

// the second half: output projection + residual, RMSNorm, gate/up, SiLU(gate) * up, down + residual
at::Tensor attn_out(const at::Tensor& a, const at::Tensor& h, const at::Tensor& norm2, at::TensorList weights,
                    at::TensorList qs, at::TensorList dm, at::IntArrayRef shapes, double eps) {
  check_weights(weights, qs, dm, shapes);
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                  a.size(0) == h.size(0) && norm2.scalar_type() == at::kFloat,
              "decoder layer: h must be a contiguous float32 [tokens, hidden] and the attention one row per token");
  const int64_t T = h.size(0), C = h.size(1);
  at::Tensor hs = linear(a.reshape({T, -1}).contiguous(), 1, weights, qs, dm, shapes, std::nullopt).add_(h);
  at::Tensor x = at::empty_like(h);
  rms_norm(hs.data_ptr<float>(), norm2.data_ptr<float>(), x.data_ptr<float>(), T, C, static_cast<float>(eps));
  at::Tensor gu = linear(x, 2, weights, qs, dm, shapes, std::nullopt).contiguous();
  const int64_t I = gu.size(1) / 2;
  at::Tensor y = at::empty({T, I}, h.options());
  silu_mul(gu.data_ptr<float>(), y.data_ptr<float>(), T, I);
  return linear(y, 3, weights, qs, dm, shapes, std::nullopt).add_(hs);
}

// a whole layer for a step of decodes: attn_in, tidal's paged decode attention, attn_out
at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& norm1, const at::Tensor& norm2, at::TensorList weights,
                        at::TensorList qs, at::TensorList dm, at::IntArrayRef shapes,
                        const std::optional<at::Tensor>& qkv_bias, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                        const at::Tensor& block_tables, const at::Tensor& positions, int64_t num_heads,
                        int64_t num_kv_heads, double eps, double scale) {
  const at::Tensor qkv = attn_in(h, norm1, weights, qs, dm, shapes, qkv_bias, cos, sin, k_cache, v_cache, slots,
                                 num_heads, num_kv_heads, eps);
  const int64_t T = h.size(0), D = k_cache.size(3);
  const at::Tensor q = qkv.narrow(1, 0, num_heads * D).contiguous().view({T, num_heads, D});
  const at::Tensor a = tidal::paged_decode_attention(q, k_cache, v_cache, block_tables, positions, scale);
  return attn_out(a, h, norm2, weights, qs, dm, shapes, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal, m) {
  m.def("decode_layer(Tensor h, Tensor norm1, Tensor norm2, Tensor[] weights, Tensor[] qs, Tensor[] dm, "
        "int[] shapes, Tensor? qkv_bias, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, Tensor block_tables, Tensor positions, int num_heads, int num_kv_heads, float eps, "
        "float scale) -> Tensor");
  m.def("layer_attn_in(Tensor h, Tensor norm1, Tensor[] weights, Tensor[] qs, Tensor[] dm, int[] shapes, "
        "Tensor? qkv_bias, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int num_heads, int num_kv_heads, float eps) -> Tensor");
  m.def("layer_attn_out(Tensor a, Tensor h, Tensor norm2, Tensor[] weights, Tensor[] qs, Tensor[] dm, int[] shapes, "
        "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("layer_attn_in", &attn_in);
  m.impl("layer_attn_out", &attn_out);
}
