// Helpers of the native CPU kernels (cpu_kernels.cpp, decode_attention.cpp, prefill_attention.cpp,
// quant_gemm.cpp, amx_gemm.cpp): the serial-work threshold, a vectorizable exp, the softmax's
// numerators, the GGUF block kind and the KV cache's element type.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include "simd.h"

// Work below this many elements runs on the calling thread: waking the pool costs more than
// it saves (a decode step of a few sequences), and far more when the cores are shared.
constexpr int64_t kSerialElems = 1 << 17;

// exp(x) for x <= 0 as 2^n * e^r, |r| <= ln2/2, degree-7 Taylor (rel. error < 1e-7); plain
// arithmetic so the loop that calls it vectorizes.
static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720; p = p * r + 1.0f / 120; p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6; p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// max(x[0..n)), n >= 1: vector lanes, since the compiler keeps a float max reduction scalar
// (NaN order), a chain of 4-cycle dependent instructions.
static inline float row_max(const float* __restrict x, int64_t n) {
  float m = x[0];
  int64_t t = 0;
#if PD_SIMD
  if (n >= Simd::W) {
    Simd::V mv = Simd::load(x);
    for (t = Simd::W; t + Simd::W <= n; t += Simd::W) mv = Simd::max(mv, Simd::load(x + t));
    m = Simd::hmax(mv);
  }
#endif
  for (; t < n; t++) m = std::max(m, x[t]);
  return m;
}

// x[0..n) -> exp(x - max x) in place, the softmax's numerators; returns their sum (and the
// max in *max_out when asked).
static inline float softmax_numerators(float* __restrict x, int64_t n, float* max_out = nullptr) {
  const float m = row_max(x, n);
  if (max_out != nullptr) *max_out = m;
  float sum = 0.f;
  for (int64_t t = 0; t < n; t++) { x[t] = exp_nonpositive(x[t] - m); sum += x[t]; }
  return sum;
}

static inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// f(std::true_type) for Q4 blocks (a minimum per block: mn != nullptr), f(std::false_type) for
// Q8; the quantized GEMMs' entry points pass it on as their template argument.
template <typename F>
static inline void with_block_kind(const float* mn, F&& f) {
  if (mn != nullptr)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// f(kv as the cache's element pointer): bfloat16 bits (kv_bf16) or float.
template <typename F>
static inline void with_kv_type(const void* kv, int64_t kv_bf16, F&& f) {
  if (kv_bf16)
    f(static_cast<const uint16_t*>(kv));
  else
    f(static_cast<const float*>(kv));
}
