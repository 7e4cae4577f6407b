// Decode attention straight over the paged KV cache, float32 (torch.ops.tidal.paged_decode_attention).
//
// The eager path gathers every decode's blocks into one padded [n, ctx, KVH, D] tensor per layer
// and calls SDPA with a mask; this reads each token's K and V where the block table says they are,
// once per KV head for all the query heads that share it (grouped-query attention), with no copy
// and no padding. Softmax is exact (scores kept, max subtracted, float32), as SDPA computes it.
//
//   q            [n, H, D]                 float32
//   k, v cache   [blocks, bs, KVH, D]      float32
//   block_tables [n, W] int64              (W * bs >= each context)
//   positions    [n] int64                 the decode's position: it attends to tokens 0..position
// Returns [n, H, D].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIDAL_AVX2 1
#endif

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
#ifdef TIDAL_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t d) {  // y += p * x
  int64_t i = 0;
#ifdef TIDAL_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < d; ++i) y[i] += p * x[i];
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& positions, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "paged_decode_attention: q must be a contiguous [n, heads, head_dim] float32 CPU tensor");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: the K and V caches must be contiguous float32 [blocks, block_size, kv_heads, "
              "head_dim]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t nblocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && KVH > 0 && H % KVH == 0, "paged_decode_attention: q has ", H, " heads of ", D,
              ", the cache ", KVH, " KV heads of ", k_cache.size(3));
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == n &&
                  block_tables.is_contiguous() && positions.scalar_type() == at::kLong && positions.numel() == n &&
                  positions.is_contiguous(),
              "paged_decode_attention: block_tables must be [n, width] int64 and positions [n] int64");
  const int64_t W = block_tables.size(1), G = H / KVH;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < W * bs, "paged_decode_attention: position ", pos[i], " is outside the ",
                W, " blocks of its table");
    for (int64_t b = 0; b <= pos[i] / bs; ++b)
      TORCH_CHECK(tables[i * W + b] >= 0 && tables[i * W + b] < nblocks, "paged_decode_attention: block ",
                  tables[i * W + b], " is outside the cache's ", nblocks);
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // one task per (decode, KV head): its G query heads read each K and V row once
  at::parallel_for(0, n * KVH, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / KVH, h = t % KVH, ctx = pos[i] + 1;
      scores.assign(G * ctx, 0.f);
      const float* qi = qp + (i * H + h * G) * D;
      for (int64_t j = 0; j < ctx; ++j) {
        const float* kj = kp + ((tables[i * W + j / bs] * bs + j % bs) * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * ctx + j] = sc * dot(qi + g * D, kj, D);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * ctx;
        const float mx = *std::max_element(s, s + ctx);
        float sum = 0.f;
        for (int64_t j = 0; j < ctx; ++j) sum += (s[j] = std::exp(s[j] - mx));
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < ctx; ++j) s[j] *= inv;
        std::fill(op + (i * H + h * G + g) * D, op + (i * H + h * G + g + 1) * D, 0.f);
      }
#ifdef TIDAL_AVX2
      if (D == 64) {  // the common head size: each query head's output stays in eight registers
        for (int64_t g = 0; g < G; ++g) {
          __m256 acc[8];
          for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
          const float* s = scores.data() + g * ctx;
          for (int64_t j = 0; j < ctx; ++j) {
            const float* vj = vp + ((tables[i * W + j / bs] * bs + j % bs) * KVH + h) * D;
            const __m256 p = _mm256_set1_ps(s[j]);
            for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * u), acc[u]);
          }
          float* o = op + (i * H + h * G + g) * D;
          for (int u = 0; u < 8; ++u) _mm256_storeu_ps(o + 8 * u, acc[u]);
        }
        continue;
      }
#endif
      for (int64_t j = 0; j < ctx; ++j) {
        const float* vj = vp + ((tables[i * W + j / bs] * bs + j % bs) * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * ctx + j], vj, op + (i * H + h * G + g) * D, D);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor positions, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
