// Causal attention for a prefill chunk, float32, grouped-query (torch.ops.tidal.prefill_attention).
//
//   q [n, H, D]        the chunk's queries; query i sits at position offset + i
//   k, v [m, KVH, D]   keys and values of positions 0..m-1 (m >= offset + n)
// Query i attends keys 0..offset + i. Rows may be strided (views into a step's QKV rows); heads and
// head dims must be contiguous. Returns [n, H, D].
//
// Tiled as FlashAttention-2 (Dao, 2023, Algorithm 1) on the CPU: a task is (KV head, block of kBQ query
// tokens), its rows the G query heads of each token that share the KV head; keys come in tiles of kBK.
// Each key tile is transposed once per call (keys as columns) for every query block that reads it.
// Per tile: S = Q K^T (a register-blocked kernel: 6 rows x 16 columns in 256-bit vectors, 6 x 64 in
// 512-bit ones where built for AVX-512), the causal mask, the online softmax (m' = max(m, rowmax S),
// l' = e^{m - m'} l + rowsum e^{S - m'}), and O' = e^{m - m'} O + P V with the same kernel shapes. Every
// output is the same chain of operations in both SIMD builds, so they give the same floats.
// benchmarks/native_kernels.py, 2-core Xeon with AVX-512, 2026-11-25: 90-200 GFLOP/s of useful work at
// chunks of 37-512 tokens, 1.0-2.3x torch's masked SDPA (55-150 GFLOP/s); with tiles of 64 keys, 256-bit
// vectors and the keys transposed per task it had run 55-75.
#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBQ = 32;  // query tokens a task
constexpr int64_t kBK = 128;  // keys a tile (1.1-1.2x over 64 at chunks of 128-512: fewer per-row softmax steps)
constexpr int kMR = 6;       // rows a register block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#ifdef TIDAL_AVX2
// s[r][0..15] = a_r . kt[:, 0..15] for R rows; kt is [D][ldk] (keys as columns)
template <int R>
void qk_block(const float* const* a, const float* kt, int64_t ldk, int64_t D, float* s, int64_t lds) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 b0 = _mm256_loadu_ps(kt + d * ldk), b1 = _mm256_loadu_ps(kt + d * ldk + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a[r] + d);
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * lds, acc[r][0]);
    _mm256_storeu_ps(s + r * lds + 8, acc[r][1]);
  }
}

// o[r][0..15] = alpha[r] o[r][0..15] + sum_j p[r][j] v_j[c0..c0+15] for R rows over nk keys
template <int R>
void pv_block(const float* p, int64_t ldp, const float* const* vrows, int64_t c0, int64_t nk, float* o, int64_t ldo,
              const float* alpha) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
    acc[r][0] = _mm256_mul_ps(al, _mm256_loadu_ps(o + r * ldo));
    acc[r][1] = _mm256_mul_ps(al, _mm256_loadu_ps(o + r * ldo + 8));
  }
  for (int64_t j = 0; j < nk; ++j) {
    const __m256 b0 = _mm256_loadu_ps(vrows[j] + c0), b1 = _mm256_loadu_ps(vrows[j] + c0 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 pv = _mm256_broadcast_ss(p + r * ldp + j);
      acc[r][0] = _mm256_fmadd_ps(pv, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pv, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * ldo, acc[r][0]);
    _mm256_storeu_ps(o + r * ldo + 8, acc[r][1]);
  }
}

// a register block of R rows (R <= kMR) by a runtime row count
template <template <int> class K, class... A>
void by_rows(int R, A... args) {
  switch (R) {
    case 1: K<1>::run(args...); break;
    case 2: K<2>::run(args...); break;
    case 3: K<3>::run(args...); break;
    case 4: K<4>::run(args...); break;
    case 5: K<5>::run(args...); break;
    default: K<6>::run(args...); break;
  }
}
template <int R>
struct QK {
  static void run(const float* const* a, const float* kt, int64_t ldk, int64_t D, float* s, int64_t lds) {
    qk_block<R>(a, kt, ldk, D, s, lds);
  }
};
template <int R>
struct PV {
  static void run(const float* p, int64_t ldp, const float* const* vrows, int64_t c0, int64_t nk, float* o,
                  int64_t ldo, const float* alpha) {
    pv_block<R>(p, ldp, vrows, c0, nk, o, ldo, alpha);
  }
};

// s[i] *= scale for i < n; returns the largest of mx and the scaled values (the row max of a tile)
inline float scale_max(float* s, int64_t n, float scale, float mx) {
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 m8 = _mm256_set1_ps(mx);
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 sc16 = _mm512_set1_ps(scale);
  __m512 m16 = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + i), sc16);
    _mm512_storeu_ps(s + i, x);
    m16 = _mm512_max_ps(m16, x);
  }
  m8 = _mm256_max_ps(_mm512_castps512_ps256(m16), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m16), 1)));
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + i), sc);
    _mm256_storeu_ps(s + i, x);
    m8 = _mm256_max_ps(m8, x);
  }
  mx = tidal::hmax(m8);
  for (; i < n; ++i) mx = std::max(mx, s[i] *= scale);
  return mx;
}
#endif

#ifdef __AVX512F__
// The same two products 16 floats a vector, C vectors (16 C columns) by R rows (R C <= 24 accumulators): each
// output is the same FMA chain as in the 8-wide blocks above, so both builds give the same floats.
template <int R, int C>
void qk_block16(const float* const* a, const float* kt, int64_t ldk, int64_t D, float* s, int64_t lds) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_ps(kt + d * ldk + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r][d]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(av, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(s + r * lds + 16 * c, acc[r][c]);
}

template <int R, int C>
void pv_block16(const float* p, int64_t ldp, const float* const* vrows, int64_t c0, int64_t nk, float* o,
                int64_t ldo, const float* alpha) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(al, _mm512_loadu_ps(o + r * ldo + 16 * c));
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_ps(vrows[j] + c0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * ldp + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(pv, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * ldo + 16 * c, acc[r][c]);
}

template <int R>
struct QK16 {
  static void run(int C, const float* const* a, const float* kt, int64_t ldk, int64_t D, float* s, int64_t lds) {
    switch (C) {
      case 1: qk_block16<R, 1>(a, kt, ldk, D, s, lds); break;
      case 2: qk_block16<R, 2>(a, kt, ldk, D, s, lds); break;
      case 3: qk_block16<R, 3>(a, kt, ldk, D, s, lds); break;
      default: qk_block16<R, 4>(a, kt, ldk, D, s, lds); break;
    }
  }
};
template <int R>
struct PV16 {
  static void run(int C, const float* p, int64_t ldp, const float* const* vrows, int64_t c0, int64_t nk, float* o,
                  int64_t ldo, const float* alpha) {
    switch (C) {
      case 1: pv_block16<R, 1>(p, ldp, vrows, c0, nk, o, ldo, alpha); break;
      case 2: pv_block16<R, 2>(p, ldp, vrows, c0, nk, o, ldo, alpha); break;
      case 3: pv_block16<R, 3>(p, ldp, vrows, c0, nk, o, ldo, alpha); break;
      default: pv_block16<R, 4>(p, ldp, vrows, c0, nk, o, ldo, alpha); break;
    }
  }
};
#endif

struct Task {  // the inputs, shared by every task
  const float *q, *k, *v;
  int64_t sq, sk, sv, n, H, KVH, D, G, offset;
  float scale;
  float* out;       // [n, H, D]
  const float* kt;  // [KVH][tiles][D][kBK]: each key tile transposed (keys as columns), zero past the last key
  int64_t tiles;
};

struct Scratch {  // one thread's tiles
  std::vector<float> s, o, m, l, alpha;
  std::vector<const float*> arow, vrow;
};

// tile j of KV head h transposed into kt [D][kBK], columns past the last key zero (so 16-column blocks read 0s)
void pack_keys(const float* k, int64_t sk, int64_t m, int64_t h, int64_t D, int64_t j, float* kt) {
  const int64_t j0 = j * kBK, nk = std::min(kBK, m - j0);
  for (int64_t jj = 0; jj < nk; ++jj) {
    const float* kr = k + (j0 + jj) * sk + h * D;
    for (int64_t d = 0; d < D; ++d) kt[d * kBK + jj] = kr[d];
  }
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * kBK + nk, kt + (d + 1) * kBK, 0.f);
}

// queries [i0, i1) of KV head h
void run_task(const Task& t, int64_t h, int64_t i0, int64_t i1, Scratch& w) {
  const int64_t G = t.G, D = t.D, rows = (i1 - i0) * G, kmax = t.offset + i1;
  [[maybe_unused]] const bool simd16 =
#ifdef TIDAL_AVX2
      D % 16 == 0;
#else
      false;
#endif
  w.s.resize(rows * kBK);
  w.o.assign(rows * D, 0.f);
  w.m.assign(rows, kNegInf);
  w.l.assign(rows, 0.f);
  w.alpha.resize(rows);
  w.arow.resize(rows);
  w.vrow.resize(kBK);
  for (int64_t r = 0; r < rows; ++r) w.arow[r] = t.q + (i0 + r / G) * t.sq + (h * G + r % G) * D;
  for (int64_t j0 = 0; j0 < kmax; j0 += kBK) {
    const int64_t nk = std::min(kBK, kmax - j0), ncol = (nk + 15) / 16 * 16;
    const float* kt = t.kt + (h * t.tiles + j0 / kBK) * D * kBK;  // K^T of the tile: kt[d][jj]
    for (int64_t jj = 0; jj < nk; ++jj) w.vrow[jj] = t.v + (j0 + jj) * t.sv + h * D;
    // S = Q K^T
    for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
      const int R = static_cast<int>(std::min<int64_t>(kMR, rows - r0));
#ifdef TIDAL_AVX2
      if (simd16) {
#ifdef __AVX512F__
        for (int64_t c0 = 0; c0 < ncol; c0 += 64)
          by_rows<QK16>(R, static_cast<int>(std::min<int64_t>(4, (ncol - c0) / 16)), w.arow.data() + r0, kt + c0,
                        kBK, D, w.s.data() + r0 * kBK + c0, kBK);
#else
        for (int64_t c0 = 0; c0 < ncol; c0 += 16)
          by_rows<QK>(R, w.arow.data() + r0, kt + c0, kBK, D, w.s.data() + r0 * kBK + c0, kBK);
#endif
        continue;
      }
#endif
      for (int r = 0; r < R; ++r)
        for (int64_t jj = 0; jj < nk; ++jj) {
          float acc = 0.f;
          for (int64_t d = 0; d < D; ++d) acc += w.arow[r0 + r][d] * kt[d * kBK + jj];
          w.s[(r0 + r) * kBK + jj] = acc;
        }
    }
    // mask, online softmax: P = e^{S - m'} over each row's visible keys, 0 past them
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = w.s.data() + r * kBK;
      const int64_t pos = t.offset + i0 + r / G, vis = std::clamp<int64_t>(pos - j0 + 1, 0, nk);
#ifdef TIDAL_AVX2
      const float mx = scale_max(sr, vis, t.scale, w.m[r]);
#else
      float mx = w.m[r];
      for (int64_t jj = 0; jj < vis; ++jj) mx = std::max(mx, sr[jj] *= t.scale);
#endif
      if (vis == 0) {  // the whole tile is past this query
        w.alpha[r] = 1.f;
        std::fill(sr, sr + ncol, 0.f);
        continue;
      }
      const float sum = tidal::exp_shift_sum(sr, vis, mx);
      std::fill(sr + vis, sr + ncol, 0.f);
      w.alpha[r] = std::exp(w.m[r] - mx);  // 0 on the first tile (m = -inf)
      w.l[r] = w.l[r] * w.alpha[r] + sum;
      w.m[r] = mx;
    }
    // O = alpha O + P V
    for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
      const int R = static_cast<int>(std::min<int64_t>(kMR, rows - r0));
      const int64_t pos_last = t.offset + i0 + (r0 + R - 1) / G;  // the block's last row sees the most keys
      const int64_t nv = std::clamp<int64_t>(pos_last - j0 + 1, 0, nk);
#ifdef TIDAL_AVX2
      if (simd16) {
#ifdef __AVX512F__
        for (int64_t c0 = 0; c0 < D; c0 += 64)
          by_rows<PV16>(R, static_cast<int>(std::min<int64_t>(4, (D - c0) / 16)), w.s.data() + r0 * kBK, kBK,
                        w.vrow.data(), c0, nv, w.o.data() + r0 * D + c0, D, w.alpha.data() + r0);
#else
        for (int64_t c0 = 0; c0 < D; c0 += 16)
          by_rows<PV>(R, w.s.data() + r0 * kBK, kBK, w.vrow.data(), c0, nv, w.o.data() + r0 * D + c0, D,
                      w.alpha.data() + r0);
#endif
        continue;
      }
#endif
      for (int r = 0; r < R; ++r) {
        float* orow = w.o.data() + (r0 + r) * D;
        const float* pr = w.s.data() + (r0 + r) * kBK;
        for (int64_t d = 0; d < D; ++d) orow[d] *= w.alpha[r0 + r];
        for (int64_t jj = 0; jj < nv; ++jj)
          for (int64_t d = 0; d < D; ++d) orow[d] += pr[jj] * w.vrow[jj][d];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / w.l[r];
    const float* orow = w.o.data() + r * D;
    float* dst = t.out + ((i0 + r / G) * t.H + h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = orow[d] * inv;
  }
}

bool rows_ok(const at::Tensor& x) { return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2); }

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t offset,
                             double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "prefill_attention: q, k and v must be float32 CPU tensors");
  TORCH_CHECK(rows_ok(q) && rows_ok(k) && rows_ok(v) && k.sizes() == v.sizes(),
              "prefill_attention: q [n, heads, head_dim], k and v [m, kv_heads, head_dim] with contiguous heads");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), m = k.size(0), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == D && KVH > 0 && H % KVH == 0, "prefill_attention: q has ", H, " heads of ", D,
              ", k and v ", KVH, " of ", k.size(2));
  TORCH_CHECK(offset >= 0 && offset + n <= m, "prefill_attention: queries at ", offset, "..", offset + n - 1,
              " need keys up to there; there are ", m);
  at::Tensor out = at::empty({n, H, D}, q.options());
  if (n == 0) return out;
  // the key tiles transposed once for every query block that reads them (tiles of keys 0..offset + n - 1)
  const int64_t tiles = (offset + n + kBK - 1) / kBK;
  std::vector<float> kt(KVH * tiles * D * kBK);
  const float* kp = k.data_ptr<float>();
  tidal::run_tasks<char>(KVH * tiles, [&](int64_t i, char&) {
    pack_keys(kp, k.stride(0), offset + n, i / tiles, D, i % tiles, kt.data() + i * D * kBK);
  });
  const Task t{q.data_ptr<float>(), kp, v.data_ptr<float>(), q.stride(0), k.stride(0), v.stride(0),
               n, H, KVH, D, H / KVH, offset, static_cast<float>(scale), out.data_ptr<float>(), kt.data(), tiles};
  // tasks (query block, KV head), the last blocks (the most keys) first, handed out one at a time
  const int64_t nqb = (n + kBQ - 1) / kBQ, T = nqb * KVH;
  tidal::run_tasks<Scratch>(T, [&](int64_t i, Scratch& w) {
    const int64_t b = nqb - 1 - i / KVH, h = i % KVH;
    run_task(t, h, b * kBQ, std::min(n, (b + 1) * kBQ), w);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int offset, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
