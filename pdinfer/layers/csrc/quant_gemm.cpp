// Block-quantized GEMMs for CPU decode steps (pdinfer/layers/cpu_kernels.py builds and loads
// this file together with the other kernel sources).
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <vector>
#include "kernel_common.h"
#include "parallel.h"
#include "tile.h"

// Block-quantized weights (GGUF's Q4_0/Q4_1/Q8_0, see cpu_linear.py), 32 weights a block:
//   q4: w = d * q + mn, q in [0, 16): element j < 16 in the low nibble of qs[j], j + 16 in its
//       high nibble; qs [n, k/32, 16] bytes, d and mn [n, k/32] floats.
//   q8: w = d * q, q in [-128, 128); qs [n, k] bytes, d [n, k/32].
// d * q is exact in float32 (an fp16 scale times a 4- or 8-bit integer), so the weights are
// bit-identical to the float32 de-quantization; only the rounding of the sums differs from a
// float32 GEMV (their order, and in the AVX-512 row-streaming loop the scale applied to each
// block's sum). A decode step of a few rows is bound by reading the weights: 5 or 8.5 bits a
// weight here instead of 32.
// Block b of one weight row (qr: the row's bytes) de-quantized: 32 weights, in four vectors
// with AVX2, else in w[0..32).
#if defined(__AVX2__) && defined(__FMA__)
template <bool Q4>
static inline void dequant_block(const uint8_t* __restrict qr, int64_t b, float db, float mb, __m256 w[4]) {
  const __m256 vd = _mm256_set1_ps(db);
  if constexpr (Q4) {
    const __m256 vm = _mm256_set1_ps(mb);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + b * 16));
    const __m128i lo = _mm_and_si128(raw, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int g = 0; g < 4; g++)
      w[g] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[g])), vm);
  } else {
    for (int g = 0; g < 4; g++) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr + b * 32 + g * 8));
      w[g] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
    }
  }
}
#else
template <bool Q4>
static inline void dequant_block(const uint8_t* __restrict qr, int64_t b, float db, float mb, float* w) {
  for (int j = 0; j < 32; j++) {
    const int q = Q4 ? (qr[b * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 15 : static_cast<int8_t>(qr[b * 32 + j]);
    w[j] = Q4 ? db * q + mb : db * q;
  }
}
#endif

// Weight rows prefetched ahead of the one in use: one row's three streams (quants, scales,
// minimums) alone stay far below the memory's read rate. 4 ahead beat 2 and 8.
constexpr int64_t PF_ROWS = 4;

template <bool Q4>
static inline void prefetch_row(const uint8_t* qs, const float* d, const float* mn, int64_t r,
                                int64_t r1, int64_t row_bytes, int64_t nb) {
  if (r + PF_ROWS >= r1) return;
  for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(qs + (r + PF_ROWS) * row_bytes + o);
  for (int64_t o = 0; o < nb; o += 16) {
    __builtin_prefetch(d + (r + PF_ROWS) * nb + o);
    if constexpr (Q4) __builtin_prefetch(mn + (r + PF_ROWS) * nb + o);
  }
}

#if defined(__AVX512F__)
// With AVX-512 the scale comes out of the block's sum: sum_j (d q_j + mn) x_j = d (sum_j q_j x_j)
// + mn (sum_j x_j), with each block's input sums (xsum [M][nb]) computed once per call. Per
// block: two integer-to-float conversions of 16 quants, two FMAs with the input and one with the
// scale for each row, instead of de-quantizing every weight first (batch-1 decode is bound by
// these instructions, not by memory). The minimum's term is one dot product per weight row.
template <int M, bool Q4>
static void qgemm_rows(const float* __restrict x, const uint8_t* __restrict qs,
                       const float* __restrict d, const float* __restrict mn,
                       const float* __restrict bias, float* __restrict y, int64_t r0, int64_t r1,
                       int64_t n, int64_t k, const float* __restrict xsum) {
  const int64_t nb = k / 32, row_bytes = Q4 ? nb * 16 : k;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* __restrict qr = qs + r * row_bytes;
    const float* __restrict dr = d + r * nb;
    prefetch_row<Q4>(qs, d, mn, r, r1, row_bytes, nb);
    __m512 tot[M];
    for (int i = 0; i < M; i++) tot[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      __m512 q0, q1;
      if constexpr (Q4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + b * 16));
        q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
        q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
      } else {
        q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + b * 32))));
        q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + b * 32 + 16))));
      }
      const __m512 vd = _mm512_set1_ps(dr[b]);
      for (int i = 0; i < M; i++) {
        const float* __restrict xb = x + i * k + b * 32;
        const __m512 a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
        tot[i] = _mm512_fmadd_ps(vd, a, tot[i]);
      }
    }
    for (int i = 0; i < M; i++) {
      float s = _mm512_reduce_add_ps(tot[i]);
      if constexpr (Q4) {
        const float* __restrict mr = mn + r * nb;
        const float* __restrict xs = xsum + i * nb;
        __m512 acc = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 16 <= nb; b += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(mr + b), _mm512_loadu_ps(xs + b), acc);
        s += _mm512_reduce_add_ps(acc);
        for (; b < nb; b++) s += mr[b] * xs[b];
      }
      y[i * n + r] = s + (bias ? bias[r] : 0.f);
    }
  }
}
#else
template <int M, bool Q4>
static void qgemm_rows(const float* __restrict x, const uint8_t* __restrict qs,
                       const float* __restrict d, const float* __restrict mn,
                       const float* __restrict bias, float* __restrict y, int64_t r0, int64_t r1,
                       int64_t n, int64_t k, const float* __restrict) {
  const int64_t nb = k / 32, row_bytes = Q4 ? nb * 16 : k;
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* __restrict qr = qs + r * row_bytes;
    const float* __restrict dr = d + r * nb;
    const float* __restrict mr = Q4 ? mn + r * nb : nullptr;
    prefetch_row<Q4>(qs, d, mn, r, r1, row_bytes, nb);
    float sums[M];
#if defined(__AVX2__) && defined(__FMA__)
    constexpr int C = M <= 2 ? 4 : 2;  // independent FMA chains per input row
    __m256 acc[M][C];
    for (int i = 0; i < M; i++)
      for (int c = 0; c < C; c++) acc[i][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      __m256 w[4];
      dequant_block<Q4>(qr, b, dr[b], Q4 ? mr[b] : 0.f, w);
      for (int i = 0; i < M; i++) {
        const float* __restrict xb = x + i * k + b * 32;
        for (int g = 0; g < 4; g++)
          acc[i][g % C] = _mm256_fmadd_ps(w[g], _mm256_loadu_ps(xb + 8 * g), acc[i][g % C]);
      }
    }
    for (int i = 0; i < M; i++) {
      __m256 s8 = acc[i][0];
      for (int c = 1; c < C; c++) s8 = _mm256_add_ps(s8, acc[i][c]);
      __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
      s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
      sums[i] = _mm_cvtss_f32(s4);
    }
#else
    for (int i = 0; i < M; i++) sums[i] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
      float w[32];
      dequant_block<Q4>(qr, b, dr[b], Q4 ? mr[b] : 0.f, w);
      for (int i = 0; i < M; i++)
        for (int j = 0; j < 32; j++) sums[i] += w[j] * x[i * k + b * 32 + j];
    }
#endif
    for (int i = 0; i < M; i++) y[i * n + r] = sums[i] + (bias ? bias[r] : 0.f);
  }
}
#endif

template <bool Q4>
static void qgemm(const float* x, const uint8_t* qs, const float* d, const float* mn,
                  const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  const int64_t nb = k / 32;
#if defined(__AVX512F__)
  constexpr bool kBlockSums = Q4;  // the AVX-512 rows' minimum term reads them
#else
  constexpr bool kBlockSums = false;
#endif
  std::vector<float> xsum(kBlockSums ? m * nb : 0);  // each block's input sum
  for (int64_t i = 0; i < (int64_t)xsum.size(); i++) {
    float s = 0.f;
    for (int64_t j = 0; j < 32; j++) s += x[(i / nb) * k + (i % nb) * 32 + j];
    xsum[i] = s;
  }
  // A static split: each thread streams one contiguous half of the rows (handing out chunks is
  // slower at batch 1: each thread's streams restart every chunk).
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i0 = 0; i0 < m; i0 += 4) {  // up to four input rows share one weight pass
      const float* xi = x + i0 * k;
      const float* si = xsum.data() + (kBlockSums ? i0 * nb : 0);
      float* yi = y + i0 * n;
      switch (std::min<int64_t>(4, m - i0)) {
        case 1: qgemm_rows<1, Q4>(xi, qs, d, mn, bias, yi, r0, r1, n, k, si); break;
        case 2: qgemm_rows<2, Q4>(xi, qs, d, mn, bias, yi, r0, r1, n, k, si); break;
        case 3: qgemm_rows<3, Q4>(xi, qs, d, mn, bias, yi, r0, r1, n, k, si); break;
        default: qgemm_rows<4, Q4>(xi, qs, d, mn, bias, yi, r0, r1, n, k, si); break;
      }
    }
  });
}

// The tiled loop's own layout of the same blocks (cpu_linear.QuantWeight.tiles): weight rows in
// tiles of QTILE (the last tile padded with zero rows), each tile's quants input position by
// input position, so de-quantizing gives the [position][QTILE] panel the register tile reads
// with no transposes:
//   q4: qt [tiles][k][16] bytes, byte j of a position holding row j's quant in its low nibble
//       and row j + 16's in its high nibble;  q8: qt [tiles][k][32] int8;
//   dt (q4 also mt) [tiles][k/32][32]: the tile's 32 scales (minimums) of each block.
constexpr int64_t QTILE = 32;

// Input positions per pass over the rows: the panel (KC x QTILE floats) stays in L1.
constexpr int64_t KC = 256;

// Positions [c0, c0 + kc) of one tile (c0 and kc multiples of 32) de-quantized into
// buf [kc][QTILE].
template <bool Q4>
static void dequant_panel(const uint8_t* __restrict qt, const float* __restrict dt,
                          const float* __restrict mt, int64_t c0, int64_t kc, float* __restrict buf) {
  constexpr int64_t QB = Q4 ? 16 : 32;  // bytes per position
  for (int64_t b = c0 / 32; b < (c0 + kc) / 32; b++) {
    const float* __restrict db = dt + b * QTILE;
    const float* __restrict mb = Q4 ? mt + b * QTILE : nullptr;
#if defined(__AVX512F__)
    const __m512 d0 = _mm512_loadu_ps(db), d1 = _mm512_loadu_ps(db + 16);
    const __m512 m0 = Q4 ? _mm512_loadu_ps(mb) : d0, m1 = Q4 ? _mm512_loadu_ps(mb + 16) : d1;
#endif
    for (int64_t c = b * 32; c < b * 32 + 32; c++) {
      const uint8_t* __restrict q = qt + c * QB;
      float* __restrict o = buf + (c - c0) * QTILE;
#if defined(__AVX512F__)
      if constexpr (Q4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(lo), m0));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(hi), m1));
      } else {
        const __m128i* p = reinterpret_cast<const __m128i*>(q);
        _mm512_storeu_ps(o, _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)))));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)))));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      __m128i parts[4];
      if constexpr (Q4) {
        const __m128i low4 = _mm_set1_epi8(0x0F);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        parts[0] = lo, parts[1] = _mm_srli_si128(lo, 8), parts[2] = hi, parts[3] = _mm_srli_si128(hi, 8);
      }
      for (int g = 0; g < 4; g++) {
        const __m256 vd = _mm256_loadu_ps(db + 8 * g);
        if constexpr (Q4)
          _mm256_storeu_ps(o + 8 * g, _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[g])),
                                                       _mm256_loadu_ps(mb + 8 * g)));
        else
          _mm256_storeu_ps(o + 8 * g, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * g))))));
      }
#else
      for (int j = 0; j < QTILE; j++) {
        const int v = Q4 ? (q[j & 15] >> (j < 16 ? 0 : 4)) & 15 : static_cast<int8_t>(q[j]);
        o[j] = Q4 ? db[j] * v + mb[j] : db[j] * v;
      }
#endif
    }
  }
}

// Many input rows (a decode step of a large batch): each thread de-quantizes KC positions of a
// tile of QTILE weight rows at a time (about 1/m of the arithmetic) into an L1 panel and runs
// every input row past it, TILE columns at a time (the AVX2 tile is half a panel wide).
template <bool Q4>
static void qgemm_tiled(const float* x, const uint8_t* qt, const float* dt, const float* mt,
                        const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  const int64_t nb = k / 32, tile_bytes = k * (Q4 ? 16 : 32);
  parallel_items((n + QTILE - 1) / QTILE, false, [&](auto next) {  // tiles handed out one at a time
    std::vector<float> buf(KC * QTILE), out(m * QTILE);
    for (int64_t t; next(t);) {
      const int64_t r0 = t * QTILE, nr = std::min(QTILE, n - r0);
      for (int64_t c0 = 0; c0 < k; c0 += KC) {
        const int64_t kc = std::min(KC, k - c0);
        dequant_panel<Q4>(qt + t * tile_bytes, dt + t * nb * QTILE, Q4 ? mt + t * nb * QTILE : nullptr,
                          c0, kc, buf.data());
        for (int64_t i = 0; i < m; i += MR)
          for (int64_t h = 0; h < QTILE; h += TILE)
            tile_rows<MR>(std::min<int64_t>(MR, m - i), x + i * k + c0, k, kc, buf.data() + h, QTILE,
                          out.data() + i * QTILE + h, QTILE, c0 == 0);
      }
      for (int64_t i = 0; i < m; i++)
        for (int64_t q = 0; q < nr; q++) y[i * n + r0 + q] = out[i * QTILE + q] + (bias ? bias[r0 + q] : 0.f);
    }
  });
}

// Input rows up to which the row-streaming loop beats the tiled one on this build: 4 with
// AVX-512, 8 with AVX2 (timings in docs/performance.md).
extern "C" int64_t pd_quant_stream_rows() {
#if defined(__AVX512F__)
  return 4;
#else
  return 8;
#endif
}

// Entry points for both block kinds: mn (mt) == nullptr means q8 blocks. pd_quant_gemm streams
// the GGUF rows (a few input rows); pd_quant_gemm_tiled reads the tiled layout (many rows).
extern "C" void pd_quant_gemm(const float* x, const uint8_t* qs, const float* d, const float* mn,
                              const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  with_block_kind(mn, [&](auto q4) { qgemm<decltype(q4)::value>(x, qs, d, mn, bias, y, m, n, k); });
}

extern "C" void pd_quant_gemm_tiled(const float* x, const uint8_t* qt, const float* dt, const float* mt,
                                    const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  with_block_kind(mt, [&](auto q4) { qgemm_tiled<decltype(q4)::value>(x, qt, dt, mt, bias, y, m, n, k); });
}
