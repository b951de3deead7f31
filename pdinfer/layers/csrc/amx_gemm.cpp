// Block-quantized GEMMs on AMX tiles (Sapphire Rapids and later) for steps of 32 rows or more
// (prefill, large decode batches), in float32 accuracy (pdinfer/layers/cpu_kernels.py builds and loads this file
// together with the other kernel sources).
//
// AMX multiplies bfloat16 pairs and sums in float32. The blocks' quants are small integers
// (Q4: 0..15, Q8: -128..127), exact in bfloat16; each input value x is split into three
// bfloat16 parts, x = hi + mid + lo (8 significant bits each: the 24 of a float32). So every
// product of a part and a quant is exact and the sums are float32 sums, as in a float32 GEMM:
//   y[i][r] = sum_b d[r][b] * (sum_{j in b} x[i][j] q[r][j]) + mn[r][b] * xsum[i][b]
// with the three parts' tile products summed for each block before its scale d. Measured
// against float64, the largest error over |x| |w| is ~1e-7 (oneDNN's float32 GEMM: ~4e-7).
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include "kernel_common.h"
#include "parallel.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// Input rows per 16-row A tile, weight rows per 32-column output tile (two B tiles of 16).
constexpr int64_t AROWS = 16, NTILE = 32;
// Work items: 64 input rows by up to 8 output tiles (256 weight rows); of 16-256 rows by 4-16
// tiles, the best at 8,192 rows (a layer's four GEMMs) and at 64 (the vocabulary projection).
// Fewer tiles an item where that gives too few items to share out: a 64-row decode step of a
// 576-wide output (o_proj, down_proj) would make 3 items for 2 threads, one thread idle a third
// of the time, where 6 items of 3 tiles keep both busy.
constexpr int64_t ITEM_ROWS = 64, ITEM_TILES = 8;

// Palette 1, all eight tiles 16 rows of 64 bytes (C: 16 x 16 floats; A: 16 x 32 bfloat16;
// B: 16 pairs of rows x 16 columns).
void configure_tiles() {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

inline __m512 widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }

// x [m][k] -> xp [mpad / 16][k / 32][3][16][32] bfloat16 (each block's A tiles of the three
// parts, 1 KB each, contiguous) and xsum [mpad][k / 32]; rows from m to mpad are zeros.
void split_rows(const float* x, int64_t m, int64_t mpad, int64_t k, uint16_t* xp, float* xsum) {
  const int64_t nb = k / 32;
  parallel_items(mpad / AROWS, mpad * k < kSerialElems, [&](auto next) {
    for (int64_t g; next(g);)
      for (int64_t i = g * AROWS; i < g * AROWS + AROWS; i++)
        for (int64_t b = 0; b < nb; b++) {
          float s = 0.f;
          for (int64_t h = 0; h < 2; h++) {
            const __m512 v = i < m ? _mm512_loadu_ps(x + i * k + b * 32 + h * 16) : _mm512_setzero_ps();
            const __m256i hi = (__m256i)_mm512_cvtneps_pbh(v);
            const __m512 r1 = _mm512_sub_ps(v, widen(hi));  // exact: v minus v rounded
            const __m256i mid = (__m256i)_mm512_cvtneps_pbh(r1);
            const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(r1, widen(mid)));
            uint16_t* o = xp + ((g * nb + b) * 3 * AROWS + i % AROWS) * 32 + h * 16;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), hi);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + AROWS * 32), mid);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 2 * AROWS * 32), lo);
            s += _mm512_reduce_add_ps(v);
          }
          xsum[i * nb + b] = s;
        }
  });
}

// acc[r][0..32) += d * (one block's sums c[r]) (+ the Q4 minimum times the block's input sum).
template <bool Q4>
inline void scale_block(const float (*c)[16][16], const float* dt, const float* mt, const float* xsum, int64_t nb,
                        int64_t b, float* __restrict acc) {
  const __m512 d0 = _mm512_loadu_ps(dt + b * 32), d1 = _mm512_loadu_ps(dt + b * 32 + 16);
  const __m512 m0 = Q4 ? _mm512_loadu_ps(mt + b * 32) : d0, m1 = Q4 ? _mm512_loadu_ps(mt + b * 32 + 16) : d1;
  for (int64_t r = 0; r < 16; r++) {
    float* row = acc + r * 32;
    __m512 v0 = _mm512_load_ps(row), v1 = _mm512_load_ps(row + 16);
    if constexpr (Q4) {
      const __m512 s = _mm512_set1_ps(xsum[r * nb + b]);
      v0 = _mm512_fmadd_ps(s, m0, v0);
      v1 = _mm512_fmadd_ps(s, m1, v1);
    }
    _mm512_store_ps(row, _mm512_fmadd_ps(d0, _mm512_load_ps(c[0][r]), v0));
    _mm512_store_ps(row + 16, _mm512_fmadd_ps(d1, _mm512_load_ps(c[1][r]), v1));
  }
}

// acc [16][32] = 16 input rows times one 32-column tile: C tiles 0-1, B tiles 2-3, the three
// parts' A tiles 4-6 (none reloaded while a multiply still reads it). A block's sums are
// scaled while the tiles multiply the next block: read right after their tile store, the
// vector loads would wait for it.
template <bool Q4>
void tile_16x32(const uint16_t* a, const uint16_t* bq, const float* dt, const float* mt, const float* xsum,
                int64_t nb, float* __restrict acc) {
  alignas(64) float c[2][2][16][16];  // two blocks' sums: the one stored, the one being scaled
  for (int64_t e = 0; e < 16 * 32; e += 16) _mm512_store_ps(acc + e, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; b++) {
    const uint16_t* ab = a + b * 3 * AROWS * 32;
    _tile_loadd(2, bq + b * 1024, 64);
    _tile_loadd(3, bq + b * 1024 + 512, 64);
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab + 512, 64);
    _tile_loadd(6, ab + 1024, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 4, 3);
    _tile_dpbf16ps(0, 5, 2);
    _tile_dpbf16ps(1, 5, 3);
    _tile_dpbf16ps(0, 6, 2);
    _tile_dpbf16ps(1, 6, 3);
    if (b > 0) scale_block<Q4>(c[(b - 1) & 1], dt, mt, xsum, nb, b - 1, acc);
    _tile_stored(0, c[b & 1][0], 64);
    _tile_stored(1, c[b & 1][1], 64);
  }
  scale_block<Q4>(c[(nb - 1) & 1], dt, mt, xsum, nb, nb - 1, acc);
}

// Rows split and multiplied at a time: the parts' buffer stays small (1,024 rows x k x 6 bytes,
// 9 MB for SmolLM2's widest input) and warm in cache. Large steps are faster in pieces than in
// one; 256 and 512 rows were no better than 1,024 (docs/performance.md).
constexpr int64_t ROW_CHUNK = 1024;

template <bool Q4>
void amx_rows(const float* x, const uint16_t* bq, const float* dt, const float* mt, const float* bias, float* y,
              int64_t m, int64_t n, int64_t k) {
  const int64_t nb = k / 32, mpad = round_up(m, AROWS), tiles = (n + NTILE - 1) / NTILE;
  thread_local std::vector<uint16_t> xp;  // kept from call to call (a decode step makes ~120)
  thread_local std::vector<float> xsum;
  xp.resize(3 * mpad * k + 32);
  xsum.resize(mpad * nb);
  // Plain pointers for the workers: inside their lambda the thread_local names would be theirs.
  // The parts start on a 64-byte line: a tile load whose rows straddle two cache lines is much
  // slower; vector's own alignment is 16 bytes.
  uint16_t* parts = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(xp.data()) + 63) & ~uintptr_t{63});
  float* sums = xsum.data();
  split_rows(x, m, mpad, k, parts, sums);
  const int64_t row_items = (mpad + ITEM_ROWS - 1) / ITEM_ROWS;
  const int64_t want = 4 * at::get_num_threads();  // items, at least, to share out evenly
  const int64_t item_tiles = std::clamp((tiles * row_items + want - 1) / want, int64_t{1}, ITEM_TILES);
  const int64_t tile_items = (tiles + item_tiles - 1) / item_tiles;
  parallel_items(row_items * tile_items, false, [&](auto next) {
    configure_tiles();
    alignas(64) float acc[AROWS * NTILE];
    for (int64_t item; next(item);) {
      const int64_t i0 = item / tile_items * ITEM_ROWS, t0 = item % tile_items * item_tiles;
      for (int64_t t = t0; t < std::min(tiles, t0 + item_tiles); t++)
        for (int64_t i = i0; i < std::min(mpad, i0 + ITEM_ROWS); i += AROWS) {
          tile_16x32<Q4>(parts + i * 3 * k, bq + t * nb * 1024, dt + t * nb * 32, Q4 ? mt + t * nb * 32 : nullptr,
                         sums + i * nb, nb, acc);
          const int64_t cols = std::min(NTILE, n - t * NTILE);  // the last tile may be partial
          const __mmask16 k0 = cols >= 16 ? 0xFFFF : (1u << cols) - 1, k1 = cols > 16 ? (1u << (cols - 16)) - 1 : 0;
          const float* bt = bias ? bias + t * NTILE : nullptr;
          const __m512 b0 = bt ? _mm512_maskz_loadu_ps(k0, bt) : _mm512_setzero_ps();
          const __m512 b1 = bt ? _mm512_maskz_loadu_ps(k1, bt + 16) : _mm512_setzero_ps();
          for (int64_t r = 0; r < AROWS && i + r < m; r++) {
            float* yr = y + (i + r) * n + t * NTILE;
            _mm512_mask_storeu_ps(yr, k0, _mm512_add_ps(_mm512_load_ps(acc + r * 32), b0));
            _mm512_mask_storeu_ps(yr + 16, k1, _mm512_add_ps(_mm512_load_ps(acc + r * 32 + 16), b1));
          }
        }
    }
    _tile_release();
  });
}

template <bool Q4>
void amx_gemm(const float* x, const uint16_t* bq, const float* dt, const float* mt, const float* bias, float* y,
              int64_t m, int64_t n, int64_t k) {
  for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK)
    amx_rows<Q4>(x + r0 * k, bq, dt, mt, bias, y + r0 * n, std::min(ROW_CHUNK, m - r0), n, k);
}

}  // namespace

// Rows from which the AMX GEMM beats the tiled one (pd_quant_gemm_tiled), for the Q4 layers and
// the Q8_0 vocabulary projection alike; below it the tiled GEMM is faster (docs/performance.md).
extern "C" int64_t pd_amx_min_rows() { return 32; }

// 1 if this build has the AMX GEMM and Linux lets the process use the tiles (asked once).
extern "C" int pd_amx_enable() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const int ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

// y [m][n] = x [m][k] w^T (+ bias) for the blocks in pd_amx_quant_gemm's layout
// (cpu_linear.QuantWeight.amx_tiles): bq [tiles][k/32][2][16][16][2] bfloat16 quants, each
// 32-column tile's blocks as two B tiles (16 weight rows each, pairs of positions side by
// side); dt (q4 also mt) [tiles][k/32][32], the tiled GEMM's scales (minimums). mt == nullptr
// means q8 blocks. Call only after pd_amx_enable() returned 1.
extern "C" void pd_amx_quant_gemm(const float* x, const uint16_t* bq, const float* dt, const float* mt,
                                  const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  with_block_kind(mt, [&](auto q4) { amx_gemm<decltype(q4)::value>(x, bq, dt, mt, bias, y, m, n, k); });
}

#else  // no AMX in this build: callers see pd_amx_enable() == 0 and never call the GEMM

extern "C" int pd_amx_enable() { return 0; }
extern "C" int64_t pd_amx_min_rows() { return 0; }
extern "C" void pd_amx_quant_gemm(const float*, const uint16_t*, const float*, const float*, const float*, float*,
                                  int64_t, int64_t, int64_t) {}

#endif
