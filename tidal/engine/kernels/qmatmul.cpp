// Weight-only matmuls over GGUF's own 4-bit (Q4_1) and 8-bit (Q8_0) blocks, float32 activations.
//
// Built at first use by tidal/engine/native.py (torch.utils.cpp_extension, -O3 and -mavx2 -mfma -mf16c where torch found AVX2) and
// registered as torch.ops.tidal.q4_1_mm / q8_0_mm (and q8_0_argmax, greedy decoding's token from a Q8_0 LM head
// without its logits). A step of few tokens is bound by reading the
// weights; these read 0.625 (Q4_1) and 1.06 (Q8_0) bytes a weight instead of float32's 4, and unpack
// in registers. Activations stay float32 (no Q8 activation rounding as llama.cpp's dot products do):
// a Q4_1 block of 32 weights w = q * d + m gives sum_i w_i x_i = d * sum_i q_i x_i + m * sum_i x_i,
// so the result differs from a float matmul over the dequantized weights only in rounding order.
// Steps of 16 rows or more (prefill chunks, batches of decodes) are bound by arithmetic instead: there
// a panel of 16 or 32 outputs is dequantized once, block by block of K, into a float32 buffer and a
// register-blocked GEMM micro-kernel runs every row over it (the panel kernels below), near the core's
// float peak.
//
// Layouts (tidal/engine/native.py packs them):
//   q4_1: eight output rows make a tile: qs uint8 [N/8, K/32, 16, 8], byte (j, c) of a block = q_j | q_{j+16} << 4
//         of the tile's row c; dm float16 [N/8, K/32, 2, 8]: the tile's eight d of the block, then its eight m
//   q8_0: the same tiles: qs int8 [N/8, K/32, 32, 8] (byte (j, c) = q_j of row c), d float16 [N/8, K/32, 8]
// AVX2 + FMA + F16C when the compiler targets them (the panels' micro-kernel 512 bits wide where it also
// targets AVX-512F), portable C++ otherwise.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using tidal::kBlock;
constexpr int64_t kRowTile = 4;  // activation rows sharing one unpacked weight block

// n float16 values to float32 (F16C eight at a time where compiled for it)
inline void halves_to_floats(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#ifdef TIDAL_AVX2
inline __m256 i8x8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
#endif

// Q4_1, eight output rows at a time (a tile): each nibble pair, widened once, serves every activation
// row of the tile as an 8-wide vector over the outputs (no horizontal sums; the activation is a
// broadcast). out[r, 8t..8t+8) for rows r in [r0, r0 + NR) and tiles t in [t0, t1); NR is a
// compile-time count so that the accumulators stay in registers.
template <int64_t NR>
void q4_1_tiles(const float* x, const float* xsum, const uint8_t* qs, const c10::Half* dm, float* out,
                int64_t K, int64_t N, int64_t r0, int64_t t0, int64_t t1) {
  const int64_t G = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
#ifdef TIDAL_AVX2
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256 acc[NR];
    for (int64_t r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = qs + (t * G + g) * 128;
      const c10::Half* h = dm + (t * G + g) * 16;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)));
      // sum_j q_j x_j over the block's first and second halves, in NC interleaved chains per row: with one
      // or two rows, two chains would wait on the FMA latency, not on the loads
      constexpr int64_t NC = NR <= 2 ? 2 : 1;
      __m256 slo[NC][NR], shi[NC][NR];
      for (int64_t c = 0; c < NC; ++c)
        for (int64_t r = 0; r < NR; ++r) slo[c][r] = shi[c][r] = _mm256_setzero_ps();
      for (int64_t j = 0; j < 16; j += NC) {
        for (int64_t c = 0; c < NC; ++c) {
          const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + (j + c) * 8)));
          const __m256 wlo = _mm256_cvtepi32_ps(_mm256_and_si256(w, low));
          const __m256 whi = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
          for (int64_t r = 0; r < NR; ++r) {
            const float* xr = x + (r0 + r) * K + g * kBlock;
            slo[c][r] = _mm256_fmadd_ps(wlo, _mm256_broadcast_ss(xr + j + c), slo[c][r]);
            shi[c][r] = _mm256_fmadd_ps(whi, _mm256_broadcast_ss(xr + 16 + j + c), shi[c][r]);
          }
        }
      }
      for (int64_t c = 1; c < NC; ++c)
        for (int64_t r = 0; r < NR; ++r) {
          slo[0][r] = _mm256_add_ps(slo[0][r], slo[c][r]);
          shi[0][r] = _mm256_add_ps(shi[0][r], shi[c][r]);
        }
      for (int64_t r = 0; r < NR; ++r) {  // + d * sum q x + m * sum x
        acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(slo[0][r], shi[0][r]), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xsum + (r0 + r) * G + g), acc[r]);
      }
    }
    for (int64_t r = 0; r < NR; ++r) _mm256_storeu_ps(out + (r0 + r) * N + t * 8, acc[r]);
#else
    float dm_f[16];
    for (int64_t r = 0; r < NR; ++r)
      for (int64_t c = 0; c < 8; ++c) out[(r0 + r) * N + t * 8 + c] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = qs + (t * G + g) * 128;
      halves_to_floats(dm + (t * G + g) * 16, dm_f, 16);
      for (int64_t r = 0; r < NR; ++r) {
        const float* xr = x + (r0 + r) * K + g * kBlock;
        for (int64_t c = 0; c < 8; ++c) {
          float s = 0.f;
          for (int64_t j = 0; j < 16; ++j) s += (b[j * 8 + c] & 0x0F) * xr[j] + (b[j * 8 + c] >> 4) * xr[16 + j];
          out[(r0 + r) * N + t * 8 + c] += dm_f[c] * s + dm_f[8 + c] * xsum[(r0 + r) * G + g];
        }
      }
    }
#endif
  }
}

// Q8_0 in the same tiles of eight output rows: out[r, 8t..8t+8) for rows [r0, r0 + NR), tiles [t0, t1)
template <int64_t NR>
void q8_0_tiles(const float* x, const int8_t* qs, const c10::Half* dq, float* out, int64_t K, int64_t N,
                int64_t r0, int64_t t0, int64_t t1) {
  const int64_t G = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
#ifdef TIDAL_AVX2
    __m256 acc[NR];
    for (int64_t r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* b = qs + (t * G + g) * 256;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dq + (t * G + g) * 8)));
      // NC interleaved chains per row (columns j mod NC): four with one or two rows, else two
      constexpr int64_t NC = NR <= 2 ? 4 : 2;
      __m256 sc[NC][NR];
      for (int64_t c = 0; c < NC; ++c)
        for (int64_t r = 0; r < NR; ++r) sc[c][r] = _mm256_setzero_ps();
      for (int64_t j = 0; j < kBlock; j += NC) {
        for (int64_t c = 0; c < NC; ++c) {
          const __m256 w = i8x8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + (j + c) * 8)));
          for (int64_t r = 0; r < NR; ++r)
            sc[c][r] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + (r0 + r) * K + g * kBlock + j + c), sc[c][r]);
        }
      }
      for (int64_t c = 1; c < NC; ++c)
        for (int64_t r = 0; r < NR; ++r) sc[0][r] = _mm256_add_ps(sc[0][r], sc[c][r]);
      for (int64_t r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(d, sc[0][r], acc[r]);
    }
    for (int64_t r = 0; r < NR; ++r) _mm256_storeu_ps(out + (r0 + r) * N + t * 8, acc[r]);
#else
    float d[8];
    for (int64_t r = 0; r < NR; ++r)
      for (int64_t c = 0; c < 8; ++c) out[(r0 + r) * N + t * 8 + c] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* b = qs + (t * G + g) * 256;
      halves_to_floats(dq + (t * G + g) * 8, d, 8);
      for (int64_t r = 0; r < NR; ++r) {
        const float* xr = x + (r0 + r) * K + g * kBlock;
        for (int64_t c = 0; c < 8; ++c) {
          float s = 0.f;
          for (int64_t j = 0; j < kBlock; ++j) s += b[j * 8 + c] * xr[j];
          out[(r0 + r) * N + t * 8 + c] += d[c] * s;
        }
      }
    }
#endif
  }
}

#ifdef TIDAL_AVX2
// Steps of many rows: a panel of kPanelTiles tiles (kPanelWidth outputs) is dequantized, all of K or a
// block of it (panel_k), into a float32 buffer that stays in cache, then a register-blocked GEMM
// micro-kernel (MR activation rows x the panel's outputs, all accumulators in registers) runs every row
// group over it, picking its sums up from the output where an earlier block of K left them. The
// dequantization (q * d + m per weight, as the float weights were made) is paid once per panel, not
// once per row group. Each output is one chain of FMAs over k = 0 .. K-1 from zero, whatever the vector
// width and the blocking: the AVX2 and AVX-512 builds give the same floats.
#ifdef __AVX512F__
constexpr int64_t kPanelTiles = 4;  // 32 outputs: two 512-bit vectors a panel row
constexpr int64_t kGroupRows = 12;  // MR at most: 24 accumulators, two panel vectors and a broadcast of 32 registers
#else
constexpr int64_t kPanelTiles = 2;  // 16 outputs: two 256-bit vectors a panel row
constexpr int64_t kGroupRows = 6;   // 12 accumulators, two panel vectors and a broadcast of 16 registers
#endif
constexpr int64_t kPanelWidth = kPanelTiles * 8;
// K rows of a panel dequantized at a time for a step of M rows. Built for AVX-512, a step of fewer than 128
// rows takes K in blocks of 128: 16 KB of panel at 32 outputs, in L1 while the row groups run over it
// (1.2x at 32 rows, cold weights, SmolLM2-135M's shapes; blocks of 64, 192 or 256 were slower). A larger
// step, and the AVX2 build, take all of K at once (blocks of 128 measured 0.9x there)
inline int64_t panel_k(int64_t M, int64_t K) {
#ifdef __AVX512F__
  if (M < 128) return std::min<int64_t>(K, 128);
#endif
  return K;
}

#ifdef __AVX512F__
// two tiles' eight bytes each (rows j of a block) as one 128-bit vector: tile a's in the low half
inline __m128i two_tiles(const void* a, const void* b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(static_cast<const __m128i*>(a)), _mm_loadl_epi64(static_cast<const __m128i*>(b)));
}

// two tiles' eight float16 scales as sixteen floats
inline __m512 two_scales(const c10::Half* a, const c10::Half* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// the panels' dequantization 16 weights a vector (two tiles side by side): the same q * d + m per weight.
// After an odd last tile the second half repeats it (columns the micro-kernel never stores)
void q4_1_panel(const uint8_t* qs, const c10::Half* dm, int64_t K, int64_t t, int64_t nt, int64_t g0, int64_t g1,
                float* P) {
  const int64_t G = K / kBlock;
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t u = 0; u < nt; u += 2) {
    const int64_t a = t + u, b = t + std::min(u + 1, nt - 1);
    for (int64_t g = g0; g < g1; ++g) {
      const c10::Half* ha = dm + (a * G + g) * 16;
      const c10::Half* hb = dm + (b * G + g) * 16;
      const __m512 d = two_scales(ha, hb), m = two_scales(ha + 8, hb + 8);
      const uint8_t* qa = qs + (a * G + g) * 128;
      const uint8_t* qb = qs + (b * G + g) * 128;
      float* dst = P + (g - g0) * kBlock * kPanelWidth + u * 8;
      for (int64_t j = 0; j < 16; ++j) {
        const __m512i w = _mm512_cvtepu8_epi32(two_tiles(qa + j * 8, qb + j * 8));
        _mm512_storeu_ps(dst + j * kPanelWidth, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(w, low)), d, m));
        _mm512_storeu_ps(dst + (j + 16) * kPanelWidth, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4)), d, m));
      }
    }
  }
}

void q8_0_panel(const int8_t* qs, const c10::Half* dq, int64_t K, int64_t t, int64_t nt, int64_t g0, int64_t g1,
                float* P) {
  const int64_t G = K / kBlock;
  for (int64_t u = 0; u < nt; u += 2) {
    const int64_t a = t + u, b = t + std::min(u + 1, nt - 1);
    for (int64_t g = g0; g < g1; ++g) {
      const __m512 d = two_scales(dq + (a * G + g) * 8, dq + (b * G + g) * 8);
      const int8_t* qa = qs + (a * G + g) * 256;
      const int8_t* qb = qs + (b * G + g) * 256;
      float* dst = P + (g - g0) * kBlock * kPanelWidth + u * 8;
      for (int64_t j = 0; j < kBlock; ++j)
        _mm512_storeu_ps(dst + j * kPanelWidth,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two_tiles(qa + j * 8, qb + j * 8))), d));
    }
  }
}
#else
// dequantize tiles [t, t + nt) into the panel P [K, kPanelWidth] (tile u at columns 8u ..)
void q4_1_panel(const uint8_t* qs, const c10::Half* dm, int64_t K, int64_t t, int64_t nt, int64_t g0, int64_t g1,
                float* P) {
  const int64_t G = K / kBlock;
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t u = 0; u < nt; ++u) {
    for (int64_t g = g0; g < g1; ++g) {
      const c10::Half* h = dm + ((t + u) * G + g) * 16;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)));
      const uint8_t* b = qs + ((t + u) * G + g) * 128;
      float* dst = P + (g - g0) * kBlock * kPanelWidth + u * 8;
      for (int64_t j = 0; j < 16; ++j) {
        const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + j * 8)));
        _mm256_storeu_ps(dst + j * kPanelWidth, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w, low)), d, m));
        _mm256_storeu_ps(dst + (j + 16) * kPanelWidth,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4)), d, m));
      }
    }
  }
}

void q8_0_panel(const int8_t* qs, const c10::Half* dq, int64_t K, int64_t t, int64_t nt, int64_t g0, int64_t g1,
                float* P) {
  const int64_t G = K / kBlock;
  for (int64_t u = 0; u < nt; ++u) {
    for (int64_t g = g0; g < g1; ++g) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dq + ((t + u) * G + g) * 8)));
      const int8_t* b = qs + ((t + u) * G + g) * 256;
      float* dst = P + (g - g0) * kBlock * kPanelWidth + u * 8;
      for (int64_t j = 0; j < kBlock; ++j)
        _mm256_storeu_ps(dst + j * kPanelWidth,
                         _mm256_mul_ps(i8x8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + j * 8))), d));
    }
  }
}
#endif

#ifdef __AVX512F__
// out[r0 .. r0 + MR, the panel's 8 nt outputs at column c0] (+)= x rows @ P over K of P's rows: a = the
// group's first row at the block's first k, XS the row stride; first: the block starts the sums
template <int64_t MR>
void panel_rows(const float* a, const float* P, float* out, int64_t K, int64_t N, int64_t r0, int64_t c0, int64_t nt,
                bool first, int64_t XS) {
  __m512 acc0[MR], acc1[MR];
  // nt tiles of eight outputs kept: the first vector holds tiles 0-1, the second 2-3
  const __mmask16 keep0 = nt >= 2 ? 0xFFFF : 0x00FF;
  const __mmask16 keep1 = nt >= 4 ? 0xFFFF : nt == 3 ? 0x00FF : 0;
#pragma GCC unroll 16
  for (int64_t r = 0; r < MR; ++r) {
    if (first) {
      acc0[r] = acc1[r] = _mm512_setzero_ps();
    } else {  // the chains go on from the earlier K blocks' sums
      acc0[r] = _mm512_maskz_loadu_ps(keep0, out + (r0 + r) * N + c0);
      acc1[r] = _mm512_maskz_loadu_ps(keep1, out + (r0 + r) * N + c0 + 16);
    }
  }
  for (int64_t k = 0; k < K; ++k, ++a) {
    const __m512 b0 = _mm512_loadu_ps(P + k * kPanelWidth), b1 = _mm512_loadu_ps(P + k * kPanelWidth + 16);
#pragma GCC unroll 16
    for (int64_t r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * XS]);
      acc0[r] = _mm512_fmadd_ps(x, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x, b1, acc1[r]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(out + (r0 + r) * N + c0, keep0, acc0[r]);
    if (keep1) _mm512_mask_storeu_ps(out + (r0 + r) * N + c0 + 16, keep1, acc1[r]);
  }
}
#else
// the same with 256-bit vectors: 16 outputs, 2 MR accumulators
template <int64_t MR>
void panel_rows(const float* a, const float* P, float* out, int64_t K, int64_t N, int64_t r0, int64_t c0, int64_t nt,
                bool first, int64_t XS) {
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int64_t r = 0; r < MR; ++r) {
    if (first) {
      acc0[r] = acc1[r] = _mm256_setzero_ps();
    } else {  // the chains go on from the earlier K blocks' sums
      acc0[r] = _mm256_loadu_ps(out + (r0 + r) * N + c0);
      acc1[r] = nt == 2 ? _mm256_loadu_ps(out + (r0 + r) * N + c0 + 8) : _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < K; ++k, ++a) {
    const __m256 b0 = _mm256_loadu_ps(P + k * kPanelWidth), b1 = _mm256_loadu_ps(P + k * kPanelWidth + 8);
#pragma GCC unroll 8
    for (int64_t r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * XS);
      acc0[r] = _mm256_fmadd_ps(x, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(x, b1, acc1[r]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + (r0 + r) * N + c0, acc0[r]);
    if (nt == 2) _mm256_storeu_ps(out + (r0 + r) * N + c0 + 8, acc1[r]);
  }
}
#endif

// every row of x against tiles [t0, t1), a panel of kPanelTiles tiles at a time; dequant(t, nt, g0, g1, P)
// fills the panel's first nt tiles with blocks [g0, g1) of K. The panel is the thread's own buffer,
// kept between calls: after a short last panel its other tiles hold weights of an earlier panel (or
// zeros), whose products the micro-kernel computes but never stores.
template <class Dequant>
void run_panels(const float* x, float* out, int64_t M, int64_t K, int64_t N, int64_t t0, int64_t t1,
                const Dequant& dequant) {
  const int64_t G = K / kBlock, KB = panel_k(M, K) / kBlock;  // blocks of K per panel block
  thread_local std::vector<float> panel;
  if (static_cast<int64_t>(panel.size()) < KB * kBlock * kPanelWidth) panel.resize(KB * kBlock * kPanelWidth);
  float* P = panel.data();
  for (int64_t t = t0; t < t1; t += kPanelTiles) {
    const int64_t nt = std::min<int64_t>(kPanelTiles, t1 - t);
    for (int64_t g0 = 0; g0 < G; g0 += KB) {
      const int64_t g1 = std::min(G, g0 + KB), k0 = g0 * kBlock, kc = (g1 - g0) * kBlock;
      dequant(t, nt, g0, g1, P);
      tidal::for_row_groups(M, kGroupRows, [&](int64_t r0, int64_t rows) {
        const float* a = x + r0 * K + k0;
        switch (rows) {  // M >= kPanelMinRows (16) makes groups of kGroupRows * 2/3 or more
#ifdef __AVX512F__
          case 8: panel_rows<8>(a, P, out, kc, N, r0, t * 8, nt, g0 == 0, K); break;
          case 9: panel_rows<9>(a, P, out, kc, N, r0, t * 8, nt, g0 == 0, K); break;
          case 10: panel_rows<10>(a, P, out, kc, N, r0, t * 8, nt, g0 == 0, K); break;
          case 11: panel_rows<11>(a, P, out, kc, N, r0, t * 8, nt, g0 == 0, K); break;
#else
          case 4: panel_rows<4>(a, P, out, kc, N, r0, t * 8, nt, g0 == 0, K); break;
          case 5: panel_rows<5>(a, P, out, kc, N, r0, t * 8, nt, g0 == 0, K); break;
#endif
          default: panel_rows<kGroupRows>(a, P, out, kc, N, r0, t * 8, nt, g0 == 0, K); break;
        }
      });
    }
  }
}
#endif

void check(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, int64_t n, int64_t k,
           at::ScalarType qtype, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              name, ": x must be a contiguous 2-d float32 CPU tensor");
  TORCH_CHECK(k % kBlock == 0 && x.size(1) == k, name, ": x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(qs.scalar_type() == qtype && qs.is_contiguous() && qs.numel() == n * k / (qtype == at::kByte ? 2 : 1),
              name, ": packed weights of the wrong type or size");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), name, ": scales must be float16");
}

constexpr int64_t kPanelMinRows = 16;  // a step of at least this many rows runs the panel kernels
static_assert(kPanelMinRows >= 16, "run_panels' row groups assume at least four rows each");

// whether a step of M rows runs the panel kernels
inline bool panel_step(int64_t M) {
#ifdef TIDAL_AVX2
  return M >= kPanelMinRows;
#else
  return false;
#endif
}

#ifdef TIDAL_AVX2
constexpr int64_t kTaskTiles = kPanelTiles;  // a task's tiles come in whole panels
#else
constexpr int64_t kTaskTiles = 2;
#endif

// tiles of eight outputs in tasks of whole panels (kTaskTiles tiles), taken by
// run_tasks: kTasksPerThread a thread for the panel kernels (a step of many rows), one a thread for a step of
// few rows (short tasks, where more of them measured slower at one row). A task walks its tiles in chunks of
// kTileChunk, each chunk once per group of rows (NR a compile-time count, so that the accumulators stay in
// registers), or with the panel kernels
constexpr int64_t kTileChunk = 8;
constexpr int64_t kTasksPerThread = 8;

// run_tiles' work for tiles [t0, t1) on the calling thread
template <class K, typename... A>
void tile_range(int64_t M, int64_t t0, int64_t t1, A... args) {
#ifdef TIDAL_AVX2
  if (panel_step(M)) {
    K::panels(args..., M, t0, t1);
    return;
  }
#endif
  for (int64_t tc = t0; tc < t1; tc += kTileChunk) {
    const int64_t te = std::min(tc + kTileChunk, t1);
    int64_t r0 = 0;
    for (; r0 + kRowTile <= M; r0 += kRowTile) K::template narrow<kRowTile>(args..., r0, tc, te);
    switch (M - r0) {
      case 1: K::template narrow<1>(args..., r0, tc, te); break;
      case 2: K::template narrow<2>(args..., r0, tc, te); break;
      case 3: K::template narrow<3>(args..., r0, tc, te); break;
      default: break;
    }
  }
}

template <class K, typename... A>
void run_tiles(int64_t M, int64_t T, A... args) {
  const int64_t per = panel_step(M) ? kTasksPerThread : 1;
  int64_t tiles = std::max<int64_t>(kTaskTiles, T / (per * std::max<int64_t>(1, at::get_num_threads())));
  tiles = (tiles + kTaskTiles - 1) / kTaskTiles * kTaskTiles;
  struct None {};
  tidal::run_tasks<None>((T + tiles - 1) / tiles,
                         [&](int64_t i, None&) { tile_range<K>(M, i * tiles, std::min(T, (i + 1) * tiles), args...); });
}

struct Q4Tiles {
  template <int64_t NR>
  static void narrow(const float* x, const float* xs, const uint8_t* q, const c10::Half* dm, float* o, int64_t k,
                     int64_t n, int64_t r0, int64_t t0, int64_t t1) {
    q4_1_tiles<NR>(x, xs, q, dm, o, k, n, r0, t0, t1);
  }
#ifdef TIDAL_AVX2
  static void panels(const float* x, const float*, const uint8_t* q, const c10::Half* dm, float* o, int64_t k,
                     int64_t n, int64_t M, int64_t t0, int64_t t1) {
    run_panels(x, o, M, k, n, t0, t1, [&](int64_t t, int64_t nt, int64_t g0, int64_t g1, float* P) { q4_1_panel(q, dm, k, t, nt, g0, g1, P); });
  }
#endif
};

struct Q8Tiles {
  template <int64_t NR>
  static void narrow(const float* x, const int8_t* q, const c10::Half* d, float* o, int64_t k, int64_t n, int64_t r0,
                     int64_t t0, int64_t t1) {
    q8_0_tiles<NR>(x, q, d, o, k, n, r0, t0, t1);
  }
#ifdef TIDAL_AVX2
  static void panels(const float* x, const int8_t* q, const c10::Half* d, float* o, int64_t k, int64_t n, int64_t M,
                     int64_t t0, int64_t t1) {
    run_panels(x, o, M, k, n, t0, t1, [&](int64_t t, int64_t nt, int64_t g0, int64_t g1, float* P) { q8_0_panel(q, d, k, t, nt, g0, g1, P); });
  }
#endif
};

at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t n, int64_t k) {
  check(x, qs, d, n, k, at::kChar, "q8_0_mm");
  TORCH_CHECK(n % 8 == 0, "q8_0_mm: the output size must be a multiple of 8");
  TORCH_CHECK(d.numel() == n * (k / kBlock), "q8_0_mm: d must hold a scale per block");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  run_tiles<Q8Tiles>(x.size(0), n / 8, x.data_ptr<float>(), qs.data_ptr<int8_t>(), d.data_ptr<c10::Half>(),
                     out.data_ptr<float>(), k, n);
  return out;
}

// The best of one row's W outputs (columns col0 ..) folded into (bv, bi) by torch.argmax's rule: the
// largest value, the lowest column among equal ones, a NaN above everything (the first NaN wins).
void fold_best(const float* v, int64_t W, int64_t col0, float& bv, int64_t& bi) {
  if (bi >= 0 && std::isnan(bv)) return;  // a NaN already won
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef TIDAL_AVX2
  __m256 vm = _mm256_set1_ps(m), un = _mm256_setzero_ps();
  for (; i + 8 <= W; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    vm = _mm256_max_ps(vm, x);
    un = _mm256_or_ps(un, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  nan = _mm256_movemask_ps(un) != 0;
  m = tidal::hmax(vm);  // not read when a NaN was seen
#endif
  for (; i < W; ++i) {
    nan = nan || std::isnan(v[i]);
    m = std::max(m, v[i]);
  }
  if (nan) {
    for (int64_t j = 0; j < W; ++j)
      if (std::isnan(v[j])) {
        bv = v[j];
        bi = col0 + j;
        return;
      }
  }
  if (bi >= 0 && !(m > bv)) return;
  for (int64_t j = 0; j < W; ++j)
    if (v[j] == m) {
      bv = m;
      bi = col0 + j;
      return;
    }
}

// Greedy decoding over a Q8_0 LM head: argmax_j (x @ W^T)[r, j] for each row r, without the [M, n] logits
// ever reaching memory: each part of the outputs is computed kArgmaxTiles tiles (512 outputs) at a time into
// a buffer that stays in cache, and each row keeps its best; the parts' bests are then folded in column order.
// The logits are those of q8_0_mm (the same kernels over the same tiles), so the token is argmax(q8_0_mm).
constexpr int64_t kArgmaxTiles = 64;

at::Tensor q8_0_argmax(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t n, int64_t k) {
  check(x, qs, d, n, k, at::kChar, "q8_0_argmax");
  TORCH_CHECK(n % 8 == 0 && n > 0, "q8_0_argmax: the output size must be a positive multiple of 8");
  TORCH_CHECK(d.numel() == n * (k / kBlock), "q8_0_argmax: d must hold a scale per block");
  const int64_t M = x.size(0), G = k / kBlock, T = n / 8;
  const int64_t parts = std::min<int64_t>(T, kTasksPerThread * std::max<int64_t>(1, at::get_num_threads()));
  std::vector<float> best_v(parts * M);
  std::vector<int64_t> best_i(parts * M, -1);
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const c10::Half* dp = d.data_ptr<c10::Half>();
  tidal::run_tasks<std::vector<float>>(parts, [&](int64_t p, std::vector<float>& buf) {
    buf.resize(M * kArgmaxTiles * 8);
    const int64_t t1 = T * (p + 1) / parts;
    for (int64_t t = T * p / parts; t < t1; t += kArgmaxTiles) {
      const int64_t nt = std::min(kArgmaxTiles, t1 - t), W = nt * 8;  // tiles [t, t + nt) as a matrix of their own
      tile_range<Q8Tiles>(M, 0, nt, xp, qp + t * G * 256, dp + t * G * 8, buf.data(), k, W);
      for (int64_t r = 0; r < M; ++r) fold_best(buf.data() + r * W, W, t * 8, best_v[p * M + r], best_i[p * M + r]);
    }
  });
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    float bv = best_v[r];
    int64_t bi = best_i[r];
    for (int64_t p = 1; p < parts && !std::isnan(bv); ++p) {
      const float v = best_v[p * M + r];
      if (std::isnan(v) || v > bv) bv = v, bi = best_i[p * M + r];
    }
    op[r] = bi;
  }
  return out;
}

}  // namespace

namespace tidal {

at::Tensor q4_1_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm, int64_t n, int64_t k) {
  check(x, qs, dm, n, k, at::kByte, "q4_1_mm");
  TORCH_CHECK(n % 8 == 0, "q4_1_mm: the output size must be a multiple of 8");
  TORCH_CHECK(dm.numel() == n * (k / kBlock) * 2, "q4_1_mm: dm must hold (d, m) per block");
  const int64_t M = x.size(0), G = k / kBlock, T = n / 8;
  at::Tensor out = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum;  // sum_i x_i per block and row: the few-row kernels' m term (the panels add m per weight)
  if (!panel_step(M)) {
    xsum.resize(M * G);
    for (int64_t b = 0; b < M * G; ++b) {
      float t = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) t += xp[b * kBlock + j];
      xsum[b] = t;
    }
  }
  const float* sp = xsum.data();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const c10::Half* dp = dm.data_ptr<c10::Half>();
  float* op = out.data_ptr<float>();
  run_tiles<Q4Tiles>(M, T, xp, sp, qp, dp, op, k, n);
  return out;
}

}  // namespace tidal

TORCH_LIBRARY(tidal, m) {
  m.def("q4_1_mm(Tensor x, Tensor qs, Tensor dm, int n, int k) -> Tensor");
  m.def("q8_0_mm(Tensor x, Tensor qs, Tensor d, int n, int k) -> Tensor");
  m.def("q8_0_argmax(Tensor x, Tensor qs, Tensor d, int n, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal, CPU, m) {
  m.impl("q4_1_mm", &tidal::q4_1_mm);
  m.impl("q8_0_mm", &q8_0_mm);
  m.impl("q8_0_argmax", &q8_0_argmax);
}
