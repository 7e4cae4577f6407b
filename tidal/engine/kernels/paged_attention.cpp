// Decode attention straight over the paged KV cache, float32 (torch.ops.tidal.paged_decode_attention); a
// bfloat16 cache is read into float32 a span at a time (exact), then attended in float32 the same way.
//
// The eager path gathers every decode's blocks into one padded [n, ctx, KVH, D] tensor per layer
// and calls SDPA with a mask; this reads each token's K and V where the block table says they are,
// once per KV head for all the query heads that share it (grouped-query attention), with no copy
// and no padding. Softmax is exact up to rounding (max subtracted, float32 throughout).
//
// Work is split into tasks of (decode, span of the context), all heads in one task (so it reads its
// blocks front to back), with enough spans that a lone decode still keeps every core busy; each span
// returns its running max, its sum of exponentials and its unnormalized output, and the spans are
// merged as in split-K ("flash-decoding") attention:
//   m = max_c m_c,  out = sum_c e^{m_c - m} o_c / sum_c e^{m_c - m} l_c.
//
// The scores and the weighted sum of V run 8 floats wide (AVX2) or, built for AVX-512, 16 (1.09x over
// the AVX2 code on a 2-core AVX-512 Xeon at 32 decodes of 96-256 tokens; the pass is then near the
// memory's read bandwidth: ~22 of ~26 GB/s).
//
//   q            [n, H, D]                 float32
//   k, v cache   [blocks, bs, KVH, D]      float32 or bfloat16
//   block_tables [n, W] int64              (W * bs >= each context)
//   positions    [n] int64                 the decode's position: it attends to tokens 0..position
// Returns [n, H, D].
#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

#ifdef TIDAL_AVX2
using tidal::hsum;
#endif

constexpr int64_t kMinSpan = 64;  // tokens: a shorter span costs more to merge than it saves
// keys: the scores prefetch K rows this far ahead (1.1-1.2x on the cold cache in paired timings; the
// hardware prefetcher alone leaves each pass at half the rate a plain read of the rows reaches; 32 or
// 64 keys ahead, or V prefetched during the scores, gained less)
constexpr int64_t kAhead = 16;

#ifdef TIDAL_AVX2
// the lane sums of a[0..3] as one vector (two rounds of pairwise adds and one of halves)
inline __m128 hsum4(const __m256* a) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// s[a * L + u] = scale * q_a . k_u for NG query heads (rows D apart) sharing a KV head, four keys:
// each K load serves all NG heads and the NG x 4 accumulators stay in registers (a loop over a
// runtime head count kept them in memory, and loaded each K row once per query head)
template <int NG>
inline void score_tile(const float* const* k, const float* q, int64_t D, __m128 scale, float* s, int64_t L) {
  __m256 acc[NG][4];
  for (int a = 0; a < NG; ++a)
    for (int u = 0; u < 4; ++u) acc[a][u] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[NG];
    for (int a = 0; a < NG; ++a) qv[a] = _mm256_loadu_ps(q + a * D + d);
    for (int u = 0; u < 4; ++u) {
      const __m256 kv = _mm256_loadu_ps(k[u] + d);
      for (int a = 0; a < NG; ++a) acc[a][u] = _mm256_fmadd_ps(qv[a], kv, acc[a][u]);
    }
  }
  for (int a = 0; a < NG; ++a) _mm_storeu_ps(s + a * L, _mm_mul_ps(scale, hsum4(acc[a])));
}

// o[a * D + 0..32) += sum_j p[a * L + j] v_j[0..32) over cnt tokens (rows stride apart) for NG query
// heads: NG x 4 accumulators in registers, each V load serving all NG heads
template <int NG>
inline void value_tile(const float* v, int64_t stride, const float* p, int64_t L, int64_t cnt, float* o, int64_t D) {
  __m256 acc[NG][4];
  for (int a = 0; a < NG; ++a)
    for (int u = 0; u < 4; ++u) acc[a][u] = _mm256_loadu_ps(o + a * D + 8 * u);
  for (int64_t j = 0; j < cnt; ++j) {
    const float* vj = v + j * stride;
    __m256 vv[4];
    for (int u = 0; u < 4; ++u) vv[u] = _mm256_loadu_ps(vj + 8 * u);
    for (int a = 0; a < NG; ++a) {
      const __m256 pv = _mm256_broadcast_ss(p + a * L + j);
      for (int u = 0; u < 4; ++u) acc[a][u] = _mm256_fmadd_ps(pv, vv[u], acc[a][u]);
    }
  }
  for (int a = 0; a < NG; ++a)
    for (int u = 0; u < 4; ++u) _mm256_storeu_ps(o + a * D + 8 * u, acc[a][u]);
}

#ifdef __AVX512F__
// score_tile with 512-bit vectors (D % 16 == 0): each K load covers 16 of D, and the four keys' lane sums
// fold the halves first, then as in score_tile
template <int NG>
inline void score_tile16(const float* const* k, const float* q, int64_t D, __m128 scale, float* s, int64_t L) {
  __m512 acc[NG][4];
  for (int a = 0; a < NG; ++a)
    for (int u = 0; u < 4; ++u) acc[a][u] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 qv[NG];
    for (int a = 0; a < NG; ++a) qv[a] = _mm512_loadu_ps(q + a * D + d);
    for (int u = 0; u < 4; ++u) {
      const __m512 kv = _mm512_loadu_ps(k[u] + d);
      for (int a = 0; a < NG; ++a) acc[a][u] = _mm512_fmadd_ps(qv[a], kv, acc[a][u]);
    }
  }
  for (int a = 0; a < NG; ++a) {
    __m256 h[4];
    for (int u = 0; u < 4; ++u)
      h[u] = _mm256_add_ps(_mm512_castps512_ps256(acc[a][u]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[a][u]), 1)));
    _mm_storeu_ps(s + a * L, _mm_mul_ps(scale, hsum4(h)));
  }
}

// value_tile over 64 of D with 512-bit vectors: NG x 4 accumulators, each V load serving all NG heads
template <int NG>
inline void value_tile16(const float* v, int64_t stride, const float* p, int64_t L, int64_t cnt, float* o, int64_t D) {
  __m512 acc[NG][4];
  for (int a = 0; a < NG; ++a)
    for (int u = 0; u < 4; ++u) acc[a][u] = _mm512_loadu_ps(o + a * D + 16 * u);
  for (int64_t j = 0; j < cnt; ++j) {
    const float* vj = v + j * stride;
    __m512 vv[4];
    for (int u = 0; u < 4; ++u) vv[u] = _mm512_loadu_ps(vj + 16 * u);
    for (int a = 0; a < NG; ++a) {
      const __m512 pv = _mm512_set1_ps(p[a * L + j]);
      for (int u = 0; u < 4; ++u) acc[a][u] = _mm512_fmadd_ps(pv, vv[u], acc[a][u]);
    }
  }
  for (int a = 0; a < NG; ++a)
    for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o + a * D + 16 * u, acc[a][u]);
}
#endif

// the 512-bit tiles where built for AVX-512 and D allows them (scores: D % 16, values: D % 64), else the
// 256-bit ones (D % 8, D % 32): a head of 32 or 96 floats keeps the vector code on either build
inline bool wide_scores(int64_t D) {
#ifdef __AVX512F__
  return D % 16 == 0;
#else
  return false;
#endif
}

// D per value_tile pass: 64 with the 512-bit tiles, 32 with the 256-bit ones, 0 for neither
inline int64_t value_width(int64_t D) {
#ifdef __AVX512F__
  if (D % 64 == 0) return 64;
#endif
  return D % 32 == 0 ? 32 : 0;
}

// the cache lines of `floats` floats from `rows` on
inline void prefetch_rows(const float* rows, int64_t floats) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t b = 0; b < floats * 4; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// the query heads of a KV head go in groups of up to three (3 x 4 accumulators and their operands
// fill the sixteen registers): fn(NG) with the group's size as a compile-time constant
template <typename Fn>
inline void with_group(int64_t ng, Fn fn) {
  if (ng >= 3) fn(std::integral_constant<int, 3>{});
  else if (ng == 2) fn(std::integral_constant<int, 2>{});
  else fn(std::integral_constant<int, 1>{});
}
#endif

inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
#ifdef TIDAL_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

struct Span {  // one task's share: keys [j0, j1) of decode i, every KV head
  const float *k, *v;
  const int64_t* table;
  int64_t bs, KVH, D, G, j0, j1;
  // token j's K (or V) rows of all KV heads: KVH * D contiguous floats, and a block holds bs tokens
  // side by side, so a task over all heads reads its blocks front to back (a task per KV head read a
  // third of each token's row, with gaps, and was 2-13 % slower in paired timings)
  const float* tok(const float* cache, int64_t j) const { return cache + (table[j / bs] * bs + j % bs) * KVH * D; }
  int64_t block_end(int64_t j) const { return std::min(j1, (j / bs + 1) * bs); }
};

// walks token rows from key j on, one block table entry per block (no division per key)
struct Cursor {
  const float* base;
  const int64_t* entry;
  int64_t off, bs, row;
  Cursor(const Span& sp, const float* cache, int64_t j)
      : base(cache), entry(sp.table + j / sp.bs), off(j % sp.bs), bs(sp.bs), row(sp.KVH * sp.D) {}
  const float* next() {
    const float* r = base + (*entry * bs + off) * row;
    if (++off == bs) off = 0, ++entry;
    return r;
  }
};

// scores s[hq * L + j - j0] = scale * q_hq . k_j for every query head hq (KV head hq / G)
void span_scores(const Span& sp, const float* q, float scale, float* s) {
  const int64_t L = sp.j1 - sp.j0, D = sp.D, H = sp.KVH * sp.G;
  int64_t j = sp.j0;
  Cursor cur(sp, sp.k, j);
#ifdef TIDAL_AVX2
  if (D % 8 == 0) {
    const bool wide = wide_scores(D);
    const __m128 sc = _mm_set1_ps(scale);
    Cursor ahead(sp, sp.k, std::min(sp.j1, j + kAhead));  // the keys kAhead on, for the prefetches
    for (; j + 4 <= sp.j1; j += 4) {
      const float* kr[4];
      for (int u = 0; u < 4; ++u) {
        kr[u] = cur.next();
        if (j + kAhead + u < sp.j1) prefetch_rows(ahead.next(), sp.KVH * D);
      }
      for (int64_t h = 0; h < sp.KVH; ++h) {
        const float* kh[4] = {kr[0] + h * D, kr[1] + h * D, kr[2] + h * D, kr[3] + h * D};
        for (int64_t g0 = 0; g0 < sp.G; g0 += 3) {
          const int64_t hq = h * sp.G + g0;
          with_group(sp.G - g0, [&](auto ng) {
            float* out = s + hq * L + (j - sp.j0);
#ifdef __AVX512F__
            if (wide) {
              score_tile16<decltype(ng)::value>(kh, q + hq * D, D, sc, out, L);
              return;
            }
#endif
            score_tile<decltype(ng)::value>(kh, q + hq * D, D, sc, out, L);
          });
        }
      }
    }
  }
#endif
  for (; j < sp.j1; ++j) {
    const float* kj = cur.next();
    for (int64_t hq = 0; hq < H; ++hq) s[hq * L + (j - sp.j0)] = scale * dot(q + hq * D, kj + (hq / sp.G) * D, D);
  }
}

// s <- e^{s - max} in place; returns (max, sum)
std::pair<float, float> span_softmax(float* s, int64_t L) {
  int64_t i = 0;
  float mx = -std::numeric_limits<float>::infinity();
#ifdef TIDAL_AVX2
  __m256 m8 = _mm256_set1_ps(mx);
  for (; i + 8 <= L; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + i));
  mx = tidal::hmax(m8);
#endif
  for (; i < L; ++i) mx = std::max(mx, s[i]);
  return {mx, tidal::exp_shift_sum(s, L, mx)};
}

// o[hq * D + d] = sum_j p[hq * L + j] v_j[d], block by block: each block's V rows (all heads) are
// read while they sit in L1, each row once for the G query heads that share its KV head
void span_values(const Span& sp, const float* p, float* o) {
  const int64_t L = sp.j1 - sp.j0, D = sp.D, G = sp.G, H = sp.KVH * G;
  std::fill(o, o + H * D, 0.f);
  for (int64_t b0 = sp.j0; b0 < sp.j1;) {
    const int64_t b1 = sp.block_end(b0);
    const float* base = sp.tok(sp.v, b0);  // the block's tokens b0..b1-1 are contiguous
    const int64_t stride = sp.KVH * D;
#ifdef TIDAL_AVX2
    if (const int64_t vw = value_width(D); vw > 0) {
      // the next block's V rows are prefetched a share before each of the KVH x D/vw sub-passes over this
      // block (1.06-1.17x in paired timings; the whole block in one burst gained nothing)
      const int64_t parts = sp.KVH * (D / vw), next = b1 < sp.j1 ? sp.block_end(b1) - b1 : 0;
      const float* next_base = next ? sp.tok(sp.v, b1) : nullptr;  // the next block's tokens are contiguous too
      for (int64_t h = 0; h < sp.KVH; ++h)
        for (int64_t d0 = 0; d0 < D; d0 += vw) {
          const int64_t t = h * (D / vw) + d0 / vw, r0 = t * next / parts, r1 = (t + 1) * next / parts;
          if (r1 > r0) prefetch_rows(next_base + r0 * stride, (r1 - r0) * stride);
          for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const int64_t hq = h * G + g0;
            with_group(G - g0, [&](auto ng) {
              const float* v = base + h * D + d0;
              const float* w = p + hq * L + (b0 - sp.j0);
#ifdef __AVX512F__
              if (vw == 64) {
                value_tile16<decltype(ng)::value>(v, stride, w, L, b1 - b0, o + hq * D + d0, D);
                return;
              }
#endif
              value_tile<decltype(ng)::value>(v, stride, w, L, b1 - b0, o + hq * D + d0, D);
            });
          }
        }
      b0 = b1;
      continue;
    }
#endif
    for (int64_t j = b0; j < b1; ++j) {
      const float* vj = base + (j - b0) * stride;
      for (int64_t hq = 0; hq < H; ++hq) {
        const float pj = p[hq * L + (j - sp.j0)];
        const float* vh = vj + (hq / G) * D;
        float* oh = o + hq * D;
        for (int64_t d = 0; d < D; ++d) oh[d] += pj * vh[d];
      }
    }
    b0 = b1;
  }
}

}  // namespace

namespace tidal {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& positions, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "paged_decode_attention: q must be a contiguous [n, heads, head_dim] float32 CPU tensor");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || bf16) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "paged_decode_attention: the K and V caches must be contiguous float32 or bfloat16 [blocks, block_size, "
              "kv_heads, head_dim]");
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
  int64_t max_ctx = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < W * bs, "paged_decode_attention: position ", pos[i], " is outside the ",
                W, " blocks of its table");
    for (int64_t b = 0; b <= pos[i] / bs; ++b)
      TORCH_CHECK(tables[i * W + b] >= 0 && tables[i * W + b] < nblocks, "paged_decode_attention: block ",
                  tables[i * W + b], " is outside the cache's ", nblocks);
    max_ctx = std::max(max_ctx, pos[i] + 1);
  }
  at::Tensor out = at::empty_like(q);
  if (n == 0) return out;
  // spans per decode: enough tasks for four per thread, none shorter than kMinSpan tokens
  const int64_t want = 4 * at::get_num_threads();
  const int64_t C = std::max<int64_t>(1, std::min((want + n - 1) / n, max_ctx / kMinSpan));
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // a span's partial result: H x (D outputs, max, sum); only when a context is split
  std::vector<float> part(C > 1 ? n * C * H * (D + 2) : 0);
  // tasks are handed out one at a time (run_tasks), not in one contiguous range per thread: the engine
  // sorts decodes longest context first, so a static split would give one thread the long contexts;
  // taken in that order the tasks balance as longest-first list scheduling
  const int64_t T = n * C;
  struct Scratch {
    std::vector<float> s, o, mx, sum, kw, vw;  // kw, vw: a bfloat16 cache's span, widened to float32
  };
  const int64_t row = KVH * D;
  const int64_t zero_entry = 0;
  tidal::run_tasks<Scratch>(T, [&](int64_t t, Scratch& w) {
    auto &s = w.s, &o = w.o, &mx = w.mx, &sum = w.sum;
    mx.resize(H);
    sum.resize(H);
    const int64_t i = t / C, c = t % C, ctx = pos[i] + 1;
    const int64_t len = (ctx + C - 1) / C, j0 = std::min(ctx, c * len), j1 = std::min(ctx, j0 + len);
    float* res = C > 1 ? part.data() + t * H * (D + 2) : nullptr;
    if (j0 >= j1) {  // an empty span (a short context): no keys, nothing to add
      for (int64_t hq = 0; hq < H; ++hq) {
        res[hq * (D + 2) + D] = -std::numeric_limits<float>::infinity();
        res[hq * (D + 2) + D + 1] = 0.f;
      }
      return;
    }
    const int64_t L = j1 - j0;
    // a bfloat16 cache: the span's K and V rows widened (exactly) into float32 rows side by side, which the
    // float32 code then reads as one block of L tokens starting at token 0
    Span sp{nullptr, nullptr, tables + i * W, bs, KVH, D, G, j0, j1};
    if (bf16) {
      w.kw.resize(L * row);
      w.vw.resize(L * row);
      const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
      const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t at = (tables[i * W + j / bs] * bs + j % bs) * row;
        tidal::bf16_to_f32(kc + at, w.kw.data() + (j - j0) * row, row);
        tidal::bf16_to_f32(vc + at, w.vw.data() + (j - j0) * row, row);
      }
      sp = Span{w.kw.data(), w.vw.data(), &zero_entry, L, KVH, D, G, 0, L};
    } else {
      sp.k = k_cache.data_ptr<float>();
      sp.v = v_cache.data_ptr<float>();
    }
    s.resize(H * L);
    o.resize(H * D);
    span_scores(sp, qp + i * H * D, sc, s.data());
    for (int64_t hq = 0; hq < H; ++hq) std::tie(mx[hq], sum[hq]) = span_softmax(s.data() + hq * L, L);
    span_values(sp, s.data(), o.data());
    for (int64_t hq = 0; hq < H; ++hq) {
      const float* oh = o.data() + hq * D;
      if (res == nullptr) {  // the whole context: normalize in place
        float* dst = op + (i * H + hq) * D;
        const float inv = 1.f / sum[hq];
        for (int64_t d = 0; d < D; ++d) dst[d] = oh[d] * inv;
      } else {
        std::copy(oh, oh + D, res + hq * (D + 2));
        res[hq * (D + 2) + D] = mx[hq];
        res[hq * (D + 2) + D + 1] = sum[hq];
      }
    }
  });
  if (C > 1) {  // merge the spans of each (decode, query head)
    const int64_t stride = H * (D + 2);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t hq = 0; hq < H; ++hq) {
        const float* r0 = part.data() + i * C * stride + hq * (D + 2);
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < C; ++c) m = std::max(m, r0[c * stride + D]);
        float* dst = op + (i * H + hq) * D;
        std::fill(dst, dst + D, 0.f);
        float l = 0.f;
        for (int64_t c = 0; c < C; ++c) {
          const float* r = r0 + c * stride;
          if (r[D + 1] == 0.f) continue;
          const float w = std::exp(r[D] - m);
          l += w * r[D + 1];
          for (int64_t d = 0; d < D; ++d) dst[d] += w * r[d];
        }
        const float inv = 1.f / l;
        for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
      }
  }
  return out;
}

}  // namespace tidal

TORCH_LIBRARY_FRAGMENT(tidal, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor positions, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal, CPU, m) { m.impl("paged_decode_attention", &tidal::paged_decode_attention); }
