// Greedy decoding's token from a Q8_0 LM head by bound and verify (torch.ops.tidal.q8_0_argmax_bounded):
// the same token as argmax(q8_0_mm(x)), for steps of at least 16 rows on CPUs with AVX-512 VNNI.
//
// At a step of 32 decodes the head (49152 x 576 for SmolLM2) is ~14% of the step, bound by float32
// FMAs. Here every logit is first estimated with int8 dot products (VNNI: 64 multiply-adds an
// instruction against float32's 16) with a rigorous bound on its error, and only the few logits whose
// upper bound reaches the best lower bound are computed exactly, by the same chain of float32 FMAs as the
// panel kernels of qmatmul.cpp (acc = fma(x_k, q_jk * d_jb, acc) for k = 0 .. K-1 from zero), so the
// token is bit for bit argmax(q8_0_mm) (lowest index among equal maxima).
//
// The estimate. Each row x is quantized per block b of 32: s_b = max|x_b| / 127, xq_k = round(x_k / s_b),
// so |x_k - s_b xq_k| <= s_b (0.5 + 3e-5). The weights are stored as u8 = q + 128 for vpdpbusd (unsigned
// times signed), and I_jb = sum_k (q_jk + 128) xq_k - 128 sum_k xq_k = sum_k q_jk xq_k exactly in int32.
//   A_j = sum_b I_jb (d_jb s_b)                                   (float32)
//   |A_j - F_j| <= 0.5005 sum_b s_b N_jb + 2^-22 (K + G + 8) max|x| W1_j = margin_j
// with N_jb = |d_jb| sum_k |q_jk| and W1_j = sum_b N_jb (precomputed, Q8_0Weight.pack): the first term is
// the quantization of x, the second four times the float32 rounding of both A_j and the exact F_j
// (gamma_K sum_k |x_k w_jk| <= K 2^-24 max|x| W1_j for a chain of K FMAs, and G + 2 roundings of A_j).
// So argmax F lies among {j : A_j + margin_j >= max_i (A_i - margin_i)}, the candidates; a row with
// more than kMaxCandidates of them (or a non-finite x) gives -1, and the caller runs q8_0_argmax instead.
//
// Layouts (native.Q8_0Weight.pack): wu8 uint8 [N/16, G, 8, 16, 4]: group g of 16 outputs, block b,
// four-k step s, output lane, byte i = q[16 g + lane, 32 b + 4 s + i] + 128; scales and norms float32
// [N/16, G, 16] (d_jb, N_jb); w1 float32 [N]. The exact pass gathers the candidates' codes and scales
// from the same copy.
#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

using tidal::kBlock;
constexpr int64_t kMinRows = 16;  // qmatmul.cpp's panel kernels from here: one FMA chain per output

#if defined(__AVX512F__)
constexpr int64_t kMaxCandidates = 1024;   // a row with more runs the exact kernel instead
constexpr int64_t kGroupsPerTask = 32;     // 512 outputs a task
constexpr float kQuantSlack = 0.5005f;     // >= 0.5 + 3e-5: the quantization of x, with room for E's rounding
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Rows {  // the step's rows, quantized per block
  std::vector<int8_t> xq;     // [M][K]
  std::vector<int32_t> corr;  // [M][G]: 128 sum_k xq_k
  std::vector<float> s;       // [M][G]
  std::vector<float> c;       // [M]: 2^-22 (K + G + 8) max|x_r|
};

// rows x [M, K] quantized as above; false when some x is not finite
bool quantize(const float* x, int64_t M, int64_t K, Rows& q) {
  const int64_t G = K / kBlock;
  q.xq.resize(M * K);
  q.corr.resize(M * G);
  q.s.resize(M * G);
  q.c.resize(M);
  for (int64_t r = 0; r < M; ++r) {
    float rmax = 0.f;
    for (int64_t b = 0; b < G; ++b) {
      const float* xb = x + r * K + b * kBlock;
      float mx = 0.f;
      for (int64_t k = 0; k < kBlock; ++k) mx = std::max(mx, std::fabs(xb[k]));
      if (!std::isfinite(mx)) return false;
      rmax = std::max(rmax, mx);
      // a block below 1e-30 (or all zero) is left out of the estimate (xq = 0) and its whole |x| bounded by
      // s / 2: no denormal scale, whose rounding the bound above does not cover
      const bool tiny = mx < 1e-30f;
      const float s = tiny ? 2.f * mx : mx / 127.f, inv = tiny ? 0.f : 127.f / mx;
      int32_t sum = 0;
      for (int64_t k = 0; k < kBlock; ++k) {
        const int32_t v = static_cast<int32_t>(std::clamp(std::nearbyint(xb[k] * inv), -127.f, 127.f));
        q.xq[r * K + b * kBlock + k] = static_cast<int8_t>(v);
        sum += v;
      }
      q.s[r * G + b] = s;
      q.corr[r * G + b] = 128 * sum;
    }
    q.c[r] = std::ldexp(static_cast<float>(K + G + 8), -22) * rmax;
  }
  return true;
}

bool vnni_cpu() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

constexpr int kRows = 6;  // rows a register block (of two groups: 2 x 2 x 6 accumulators)

// groups g .. g + NGR - 1 of 16 outputs against rows [r0, r0 + R): each output's upper bound A_j + margin_j
// into up [M, N], and the best lower bound A_j - margin_j into lo[r]. Each broadcast code serves NGR groups.
template <int R, int NGR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void estimate(
    const Rows& q, const uint8_t* wu8, const float* ds, const float* nb, const float* w1, int64_t G, int64_t N,
    int64_t g, int64_t r0, float* up, float* lo) {
  const int64_t K = G * kBlock;
  const int8_t* x[R];
  const float* s[R];
  const int32_t* corr[R];
  for (int r = 0; r < R; ++r) x[r] = q.xq.data() + (r0 + r) * K, s[r] = q.s.data() + (r0 + r) * G,
                              corr[r] = q.corr.data() + (r0 + r) * G;
  __m512 acc[NGR][R];
  for (int u = 0; u < NGR; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {
    __m512i dot[NGR][R];
    for (int u = 0; u < NGR; ++u)
      for (int r = 0; r < R; ++r) dot[u][r] = _mm512_setzero_si512();
    for (int k4 = 0; k4 < 8; ++k4) {
      __m512i ws[NGR];
      for (int u = 0; u < NGR; ++u) ws[u] = _mm512_loadu_si512(wu8 + ((g + u) * G + b) * 512 + k4 * 64);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, x[r] + b * kBlock + 4 * k4, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        for (int u = 0; u < NGR; ++u) dot[u][r] = _mm512_dpbusd_epi32(dot[u][r], ws[u], xv);
      }
    }
    for (int u = 0; u < NGR; ++u) {
      const __m512 d = _mm512_loadu_ps(ds + ((g + u) * G + b) * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 i = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[u][r], _mm512_set1_epi32(corr[r][b])));
        acc[u][r] = _mm512_fmadd_ps(i, _mm512_mul_ps(d, _mm512_set1_ps(s[r][b])), acc[u][r]);
      }
    }
  }
  const __m512 slack = _mm512_set1_ps(kQuantSlack);
  for (int u = 0; u < NGR; ++u) {
    const __m512 w1v = _mm512_loadu_ps(w1 + (g + u) * 16);
    for (int r = 0; r < R; ++r) {
      __m512 err = _mm512_setzero_ps();
      for (int64_t b = 0; b < G; ++b)
        err = _mm512_fmadd_ps(_mm512_loadu_ps(nb + ((g + u) * G + b) * 16), _mm512_set1_ps(s[r][b]), err);
      const __m512 margin = _mm512_fmadd_ps(err, slack, _mm512_mul_ps(w1v, _mm512_set1_ps(q.c[r0 + r])));
      _mm512_storeu_ps(up + (r0 + r) * N + (g + u) * 16, _mm512_add_ps(acc[u][r], margin));
      lo[r0 + r] = std::max(lo[r0 + r], _mm512_reduce_max_ps(_mm512_sub_ps(acc[u][r], margin)));
    }
  }
}

// groups g .. g + NGR - 1 against every row, in row groups of at most kRows (the groups' weights stay in
// L1 meanwhile)
template <int NGR>
void estimate_groups(const Rows& q, const uint8_t* wu8, const float* ds, const float* nb, const float* w1, int64_t G,
                     int64_t N, int64_t g, int64_t M, float* up, float* lo) {
  tidal::for_row_groups(M, kRows, [&](int64_t r0, int64_t rows) {
    switch (rows) {
      case 1: estimate<1, NGR>(q, wu8, ds, nb, w1, G, N, g, r0, up, lo); break;
      case 2: estimate<2, NGR>(q, wu8, ds, nb, w1, G, N, g, r0, up, lo); break;
      case 3: estimate<3, NGR>(q, wu8, ds, nb, w1, G, N, g, r0, up, lo); break;
      case 4: estimate<4, NGR>(q, wu8, ds, nb, w1, G, N, g, r0, up, lo); break;
      case 5: estimate<5, NGR>(q, wu8, ds, nb, w1, G, N, g, r0, up, lo); break;
      default: estimate<kRows, NGR>(q, wu8, ds, nb, w1, G, N, g, r0, up, lo); break;
    }
  });
}

// the outputs j of row up [N] with up[j] >= t, in order
void candidates(const float* up, int64_t N, float t, std::vector<int32_t>& js) {
  const __m512 tv = _mm512_set1_ps(t);
  for (int64_t j0 = 0; j0 < N; j0 += 16)
    for (__mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(up + j0), tv, _CMP_GE_OQ); m; m &= m - 1)
      js.push_back(static_cast<int32_t>(j0 + __builtin_ctz(m)));
}

// logits of candidates js (at most 16, one a lane) for row x, exactly as qmatmul.cpp's panels compute them:
// acc = fma(x_k, q_jk * d_jb, acc) from zero, k = 0 .. K-1. Each step gathers every lane's four codes of
// k = 4 k4 .. 4 k4 + 3 from the u8 copy (q = u8 - 128) and its scale of block b.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void exact(
    const float* x, const uint8_t* wu8, const float* ds, int64_t G, const int32_t* js, int nj, float* out) {
  alignas(64) int32_t code[16], scale[16];
  for (int l = 0; l < 16; ++l) {
    const int32_t j = js[std::min(l, nj - 1)];  // lanes past nj repeat the last candidate
    code[l] = (j / 16) * G * 512 + (j % 16) * 4;  // byte offset of (group, block 0, k4 0, lane)
    scale[l] = (j / 16) * G * 16 + j % 16;
  }
  const __m512i co = _mm512_load_si512(code), so = _mm512_load_si512(scale), mask = _mm512_set1_epi32(0xFF),
                off = _mm512_set1_epi32(128);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {
    const __m512 d = _mm512_i32gather_ps(_mm512_add_epi32(so, _mm512_set1_epi32(static_cast<int32_t>(b * 16))), ds, 4);
    for (int k4 = 0; k4 < 8; ++k4) {
      const __m512i w4 = _mm512_i32gather_epi32(
          _mm512_add_epi32(co, _mm512_set1_epi32(static_cast<int32_t>(b * 512 + k4 * 64))), wu8, 1);
      const float* xk = x + b * kBlock + 4 * k4;
      for (int i = 0; i < 4; ++i) {
        const __m512i qi = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(w4, 8 * i), mask), off);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(xk[i]), _mm512_mul_ps(_mm512_cvtepi32_ps(qi), d), acc);
      }
    }
  }
  alignas(64) float v[16];
  _mm512_store_ps(v, acc);
  std::copy(v, v + nj, out);
}

#endif

at::Tensor q8_0_argmax_bounded(const at::Tensor& x, const at::Tensor& wu8, const at::Tensor& ds, const at::Tensor& nb,
                               const at::Tensor& w1, int64_t n, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == k && k % kBlock == 0,
              "q8_0_argmax_bounded: x must be a contiguous [rows, ", k, "] float32 CPU tensor");
  TORCH_CHECK(n % 16 == 0 && n > 0 && x.size(0) >= kMinRows, "q8_0_argmax_bounded: needs outputs in groups of 16 "
              "and at least ", kMinRows, " rows");
  const int64_t M = x.size(0), G = k / kBlock, NG = n / 16;
  TORCH_CHECK(wu8.scalar_type() == at::kByte && wu8.numel() == n * k && ds.scalar_type() == at::kFloat &&
                  ds.numel() == n * G && nb.scalar_type() == at::kFloat && nb.numel() == n * G &&
                  w1.scalar_type() == at::kFloat && w1.numel() == n && wu8.is_contiguous() && ds.is_contiguous() &&
                  nb.is_contiguous() && w1.is_contiguous(),
              "q8_0_argmax_bounded: packed head of the wrong type or size");
  at::Tensor out = at::full({M}, -1, x.options().dtype(at::kLong));
#if defined(__AVX512F__)
  TORCH_CHECK(vnni_cpu(), "q8_0_argmax_bounded: this CPU has no AVX-512 VNNI");
  Rows q;
  if (!quantize(x.data_ptr<float>(), M, k, q)) return out;
  const int64_t tasks = (NG + kGroupsPerTask - 1) / kGroupsPerTask;
  std::vector<float> lo(tasks * M, kNegInf);
  std::unique_ptr<float[]> up(new float[M * n]);  // every element written before it is read
  const uint8_t* wp = wu8.data_ptr<uint8_t>();
  const float *dp = ds.data_ptr<float>(), *np = nb.data_ptr<float>(), *w1p = w1.data_ptr<float>();
  struct None {};
  tidal::run_tasks<None>(tasks, [&](int64_t t, None&) {
    const int64_t g0 = t * kGroupsPerTask, g1 = std::min(NG, g0 + kGroupsPerTask);
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2) estimate_groups<2>(q, wp, dp, np, w1p, G, n, g, M, up.get(), lo.data() + t * M);
    if (g < g1) estimate_groups<1>(q, wp, dp, np, w1p, G, n, g, M, up.get(), lo.data() + t * M);
  });
  // each row: the outputs whose upper bound reaches the best lower bound, computed exactly
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  struct Exact {
    std::vector<int32_t> js;
  };
  tidal::run_tasks<Exact>(M, [&](int64_t r, Exact& w) {
    float best_lo = kNegInf;
    for (int64_t t = 0; t < tasks; ++t) best_lo = std::max(best_lo, lo[t * M + r]);
    w.js.clear();
    candidates(up.get() + r * n, n, best_lo, w.js);
    if (w.js.empty() || static_cast<int64_t>(w.js.size()) > kMaxCandidates) return;  // -1: the exact kernel
    float bv = kNegInf;
    int64_t bi = -1;
    float v[16];
    for (size_t i = 0; i < w.js.size(); i += 16) {
      const int nj = static_cast<int>(std::min<size_t>(16, w.js.size() - i));
      exact(xp + r * k, wp, dp, G, w.js.data() + i, nj, v);
      for (int l = 0; l < nj; ++l)
        if (bi < 0 || v[l] > bv) bv = v[l], bi = w.js[i + l];
    }
    op[r] = bi;
  });
#endif
  return out;
}

bool q8_0_argmax_bounded_supported() {
#if defined(__AVX512F__)
  return vnni_cpu();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal, m) {
  m.def("q8_0_argmax_bounded(Tensor x, Tensor wu8, Tensor ds, Tensor nb, Tensor w1, int n, int k) -> Tensor");
  m.def("q8_0_argmax_bounded_supported() -> bool", &q8_0_argmax_bounded_supported);
}

TORCH_LIBRARY_IMPL(tidal, CPU, m) { m.impl("q8_0_argmax_bounded", &q8_0_argmax_bounded); }
