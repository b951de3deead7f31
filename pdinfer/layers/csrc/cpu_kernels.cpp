// Native CPU kernels: the K/V cache write, the small float GEMM and fused elementwise ops
// (pdinfer/layers/cpu_kernels.py builds and loads this file together with decode_attention.cpp,
// prefill_attention.cpp, quant_gemm.cpp and decode_stack.cpp).
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "kernel_common.h"
#include "parallel.h"
#include "tile.h"

// The new tokens' K and V (rows of `row` elements of elem_bytes each: kv_heads * head_dim, at
// strides k_stride and v_stride, in elements, of the cache's own dtype) into the cache: token t's
// K row at layer + slots[t] * row, its V row block_size rows further (the layout of torch_paged's
// row views).
extern "C" void pd_write_kv(void* layer, const int64_t* slots, const void* k, int64_t k_stride,
                            const void* v, int64_t v_stride, int64_t tokens, int64_t row,
                            int64_t block_size, int64_t elem_bytes) {
  auto* base = static_cast<char*>(layer);
  const auto* kb = static_cast<const char*>(k);
  const auto* vb = static_cast<const char*>(v);
  const int64_t row_bytes = row * elem_bytes;
  at::parallel_for(0, tokens, std::max<int64_t>(1, kSerialElems / row), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      char* dst = base + slots[t] * row_bytes;
      std::memcpy(dst, kb + t * k_stride * elem_bytes, row_bytes);
      std::memcpy(dst + block_size * row_bytes, vb + t * v_stride * elem_bytes, row_bytes);
    }
  });
}

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for a few rows m: eight weight rows at a time, so
// each weight byte is read once while the m input rows stay in L1.
extern "C" void pd_small_gemm(const float* __restrict x, const float* __restrict w,
                              const float* __restrict bias, float* __restrict y, int64_t m,
                              int64_t n, int64_t k) {
  at::parallel_for(0, (n + 7) / 8, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t r = g0 * 8; r < std::min(n, g1 * 8); r += 8) {
      const float* __restrict w0 = w + r * k;
      for (int64_t i = 0; i < m; i++) {
        const float* __restrict xi = x + i * k;
        float* __restrict yi = y + i * n + r;
        if (r + 8 <= n) {
          float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          for (int64_t j = 0; j < k; j++) {
            const float xv = xi[j];
            a[0] += xv * w0[j]; a[1] += xv * w0[k + j]; a[2] += xv * w0[2 * k + j];
            a[3] += xv * w0[3 * k + j]; a[4] += xv * w0[4 * k + j]; a[5] += xv * w0[5 * k + j];
            a[6] += xv * w0[6 * k + j]; a[7] += xv * w0[7 * k + j];
          }
          for (int q = 0; q < 8; q++) yi[q] = a[q] + (bias ? bias[r + q] : 0.f);
        } else {
          for (int64_t q = 0; q < n - r; q++) {
            float a = 0.f;
            for (int64_t j = 0; j < k; j++) a += xi[j] * w0[q * k + j];
            yi[q] = a + (bias ? bias[r + q] : 0.f);
          }
        }
      }
    }
  });
}

// y [m][n] = x [m][k] w^T (+ bias) for float weights packed by panels of PANEL weight rows
// (cpu_linear.PackedLinear's batch-invariant layout: wp [n / PANEL][k][PANEL], the last panel
// padded with zero rows). The batch-invariant mode's float GEMM: every output element is one
// chain of FMAs over k in order, whatever m, however the rows are grouped by the register tile
// and however the panels are shared out among the threads, so a row's result does not depend on
// the other rows of the call.
constexpr int64_t PANEL = 32, PANEL_KC = 256;  // KC positions of a panel (32 KiB) stay in L1

extern "C" void pd_gemm_panels(const float* x, const float* wp, const float* bias, float* y, int64_t m,
                               int64_t n, int64_t k) {
  const int64_t panels = (n + PANEL - 1) / PANEL;
  parallel_items(panels, m * n * k < kSerialElems, [&](auto next) {
    std::vector<float> out(m * PANEL);
    for (int64_t p; next(p);) {
      const int64_t r0 = p * PANEL, nr = std::min(PANEL, n - r0);
      const float* w = wp + p * k * PANEL;
      for (int64_t c0 = 0; c0 < k; c0 += PANEL_KC) {
        const int64_t kc = std::min(PANEL_KC, k - c0);
        for (int64_t i = 0; i < m; i += MR)
          for (int64_t h = 0; h < PANEL; h += TILE)
            tile_rows<MR>(std::min<int64_t>(MR, m - i), x + i * k + c0, k, kc, w + c0 * PANEL + h, PANEL,
                          out.data() + i * PANEL + h, PANEL, c0 == 0);
      }
      for (int64_t i = 0; i < m; i++)
        for (int64_t q = 0; q < nr; q++) y[i * n + r0 + q] = out[i * PANEL + q] + (bias ? bias[r0 + q] : 0.f);
    }
  });
}

// out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), the Llama RMSNorm, one row per iteration.
extern "C" void pd_rms_norm(const float* __restrict x, int64_t x_stride, const float* __restrict w,
                            float* __restrict out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kSerialElems / dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* __restrict xr = x + r * x_stride;
      float* __restrict o = out + r * dim;
      float sq = 0.f;
      for (int64_t d = 0; d < dim; d++) sq += xr[d] * xr[d];
      const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sq / dim) + eps));
      for (int64_t d = 0; d < dim; d++) o[d] = w[d] * (xr[d] * inv);
    }
  });
}

// Rotate-half rotary embedding of q [T, HQ, D] and k [T, HK, D] in place (strided rows, unit
// head_dim stride); cos/sin [T, R] (R <= D rotary dims, first R/2 and next R/2 paired).
extern "C" void pd_rotary_qk(float* q, int64_t q_row, int64_t q_head, int64_t hq, float* k,
                             int64_t k_row, int64_t k_head, int64_t hk, const float* cos,
                             const float* sin, int64_t cs_row, int64_t tokens, int64_t rot) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, std::max<int64_t>(1, kSerialElems / ((hq + hk) * rot)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const float* __restrict c = cos + t * cs_row;
      const float* __restrict sn = sin + t * cs_row;
      for (int64_t h = 0; h < hq + hk; h++) {
        float* __restrict x = h < hq ? q + t * q_row + h * q_head : k + t * k_row + (h - hq) * k_head;
        for (int64_t i = 0; i < half; i++) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] - b * sn[i];
          x[i + half] = b * c[i + half] + a * sn[i + half];
        }
      }
    }
  });
}

// out[r] = silu(x[r, :n]) * x[r, n:2n]
extern "C" void pd_silu_and_mul(const float* __restrict x, int64_t x_stride, float* __restrict out,
                                int64_t rows, int64_t n) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kSerialElems / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* __restrict g = x + r * x_stride;
      const float* __restrict u = g + n;
      float* __restrict o = out + r * n;
      for (int64_t i = 0; i < n; i++) {
        const float e = exp_nonpositive(-std::fabs(g[i]));  // exp(-|g|): never overflows
        o[i] = g[i] * ((g[i] >= 0.f ? 1.f : e) / (1.f + e)) * u[i];
      }
    }
  });
}
