// The kernels one source calls from another (each is also registered as a torch op by its own source).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

// the SIMD code paths: AVX2 + FMA + F16C when the compiler targets them (native.py's flags), else portable C++
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TIDAL_AVX2 1
#endif

namespace tidal {

constexpr int64_t kBlock = 32;  // weights per GGUF Q4_1 / Q8_0 block

// the rows [0, M) in ceil(M / most) groups of near-equal size (32 rows by 12 as 11+11+10, not 12+12+8:
// each group keeps as many accumulator chains busy as it can); f(r0, rows) for each
template <class F>
void for_row_groups(int64_t M, int64_t most, const F& f) {
  const int64_t groups = (M + most - 1) / most;
  for (int64_t gi = 0, r0 = 0; gi < groups; ++gi) {
    const int64_t rows = (M - r0) / (groups - gi);
    f(r0, rows);
    r0 += rows;
  }
}

// f(t, scratch) for every task t in [0, n), on up to at::get_num_threads() threads that each take the next
// task from a shared counter (each with a Scratch of its own) rather than one fixed share: a thread that the
// machine slows (a busy sibling hyperthread, a preemption) takes fewer tasks instead of holding up the call
template <class Scratch, class F>
void run_tasks(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch{};
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(t, scratch);
  });
}

#ifdef TIDAL_AVX2
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// the largest of the eight lanes (no NaN among them: _mm_max_ps would pass one on or drop it by position)
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// e^x for x <= 0: x = n ln2 + r (|r| <= ln2/2), e^r by a degree-6 polynomial, 2^n by the exponent bits;
// relative error ~2 ulp; below -87 it returns 0 (float's own e^x is then a denormal or 0). Both vector
// widths take these constants and the same operations lane by lane, so they give the same floats.
namespace expc {
constexpr float kMin = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace expc

inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(expc::kMin);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(expc::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(expc::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(expc::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(expc::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(expc::kPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#ifdef __AVX512F__
inline __m512 exp_nonpos16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(expc::kMin);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(expc::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(expc::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(expc::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(expc::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(expc::kPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}
#endif

// s[i] <- e^{s[i] - mx} for i < n (every s[i] <= mx), in place; returns their sum (a softmax's numerators).
// The sum runs in eight lanes on both SIMD builds (AVX-512 adds its two halves in order): the same floats.
inline float exp_shift_sum(float* s, int64_t n, float mx) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef TIDAL_AVX2
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
#ifdef __AVX512F__
  const __m512 mv16 = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv16));
    _mm512_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - mx));
  return sum;
}

// x [M, k] float32 times a Q4_1 matrix of n outputs (qmatmul.cpp)
at::Tensor q4_1_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm, int64_t n, int64_t k);

// decode attention over the paged KV cache (paged_attention.cpp)
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& positions, double scale);

// bfloat16 <-> float32 for a KV cache in bfloat16 (uint16 bit patterns: the float's upper half). Widening is
// exact; narrowing rounds to nearest, ties to even, as torch's .to(torch.bfloat16) does (NaN stays NaN).
inline void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#endif
#ifdef TIDAL_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN: keep it quiet
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

}  // namespace tidal
