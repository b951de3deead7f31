// The FMA register tile shared by the quantized GEMM (quant_gemm.cpp) and prefill attention
// (prefill_attention.cpp): up to MR rows of x times a panel of TILE columns.
#pragma once
#include <cstdint>
#include "simd.h"

// With AVX-512 (32 vector registers), 32 columns in two registers by 8 rows (16 accumulators);
// with AVX2 (16 registers), 16 columns in two registers by 6 rows (BLIS's 6x16).
#if defined(__AVX512F__)
constexpr int64_t TILE = 32;
constexpr int MR = 8;
#else
constexpr int64_t TILE = 16;
constexpr int MR = 6;
#endif

// out[i][0:TILE] (+)= sum over c < kc of x[i][c] * b[c][0:TILE], for R <= MR rows: x row i at
// x + i * ldx, b row c at b + c * ldb, out row i at out + i * ldo. One broadcast of x[i][c] per
// row and position, one FMA per vector of the row's accumulators. `first`: start from zero,
// else add to what out holds.
template <int R>
static inline void tile_kernel(const float* __restrict x, int64_t ldx, int64_t kc,
                               const float* __restrict b, int64_t ldb, float* __restrict out,
                               int64_t ldo, bool first) {
#if PD_SIMD
  using vec = Simd::V;
  constexpr int W = Simd::W;
  constexpr int NV = TILE / W;
  vec acc[R][NV];
  for (int i = 0; i < R; i++)
    for (int v = 0; v < NV; v++) acc[i][v] = first ? Simd::zero() : Simd::load(out + i * ldo + W * v);
  for (int64_t c = 0; c < kc; c++) {
    vec w[NV];
    for (int v = 0; v < NV; v++) w[v] = Simd::load(b + c * ldb + W * v);
    for (int i = 0; i < R; i++) {
      const vec xb = Simd::set1(x[i * ldx + c]);
      for (int v = 0; v < NV; v++) acc[i][v] = Simd::fma(xb, w[v], acc[i][v]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int v = 0; v < NV; v++) Simd::store(out + i * ldo + W * v, acc[i][v]);
#else
  for (int i = 0; i < R; i++)
    for (int64_t q = 0; q < TILE; q++) {
      float a = first ? 0.f : out[i * ldo + q];
      for (int64_t c = 0; c < kc; c++) a += x[i * ldx + c] * b[c * ldb + q];
      out[i * ldo + q] = a;
    }
#endif
}

// tile_kernel<rows> for 1 <= rows <= R.
template <int R>
static inline void tile_rows(int64_t rows, const float* x, int64_t ldx, int64_t kc, const float* b,
                             int64_t ldb, float* out, int64_t ldo, bool first) {
  if constexpr (R > 1)
    if (rows < R) return tile_rows<R - 1>(rows, x, ldx, kc, b, ldb, out, ldo, first);
  tile_kernel<R>(x, ldx, kc, b, ldb, out, ldo, first);
}
