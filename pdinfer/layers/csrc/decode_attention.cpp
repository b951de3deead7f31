// Paged decode attention on CPU: one query per sequence against its K/V, read through the
// block table (pdinfer/layers/cpu_kernels.py builds and loads this file with the others).
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "kernel_common.h"
#include "parallel.h"

// One work item is (sequence, KV heads [h0, h0 + nh)): their nh * group query heads against
// those heads' K/V, block by block; each query head's accumulators stay in registers over a
// block's tokens (the block's K or V, 16 tokens x nh heads, stays in L1 meanwhile), and the next
// block is prefetched while this one is computed on.
// s: strides of the layer view [blocks, 2, block_size, KVH, D] in cache elements (block, k->v,
// token, head) and the block size. DIM > 0 fixes head_dim at compile time (full unrolling).
// T: the cache's element, float or bfloat16 bits (uint16_t); the arithmetic is float32 either way.
// Every cache line of the next block is prefetched (faster than one line per row, or none).
template <typename T>
static inline void prefetch_block(const T* base, int64_t n, int64_t nh, const int64_t* s, int64_t dim) {
  constexpr int64_t line = 64 / sizeof(T);
  for (int64_t o = 0; o < n; o++)
    for (int64_t hh = 0; hh < nh; hh++)
      for (int64_t c = 0; c < dim; c += line) __builtin_prefetch(base + o * s[2] + hh * s[3] + c);
}

// Query heads handled together against one K or V row, so the row is loaded (and, from a
// bfloat16 cache, widened) once for all of them: as many as fit the vector registers beside
// their accumulators or queries (AVX-512, head_dim 64: 4; AVX2: 1), at most 4.
#if PD_SIMD
template <int DIM>
constexpr int kHeadsTogether =
    std::max(1, std::min(4, ((Simd::W == 16 ? 32 : 16) - 1) / (DIM / Simd::W) - 1));
#endif

// out[h * ld + o] = scale * (q_h . k[o]) for the heads query rows q_h = qg + h * dim, all of
// them against the n rows k[o] = k + o * stride.
template <int DIM, typename T>
static inline void block_scores(const float* __restrict qg, int64_t heads, const T* __restrict k,
                                int64_t n, int64_t stride, int64_t dim, float scale,
                                float* __restrict out, int64_t ld) {
#if PD_SIMD
  if constexpr (DIM > 0 && DIM % Simd::W == 0) {
    constexpr int NV = DIM / Simd::W, HG = kHeadsTogether<DIM>;
    for (int64_t h0 = 0; h0 < heads; h0 += HG) {
      const int64_t hn = std::min<int64_t>(HG, heads - h0);
      Simd::V qr[HG][NV];
      for (int h = 0; h < HG; h++)
        for (int v = 0; v < NV; v++) qr[h][v] = h < hn ? Simd::load(qg + (h0 + h) * DIM + v * Simd::W) : Simd::zero();
      for (int64_t o = 0; o < n; o++) {
        Simd::V kr[NV];
        for (int v = 0; v < NV; v++) kr[v] = Simd::load(k + o * stride + v * Simd::W);
        for (int h = 0; h < HG; h++) {
          if (h >= hn) break;
          Simd::V p = Simd::mul(qr[h][0], kr[0]);
          for (int v = 1; v < NV; v++) p = Simd::fma(qr[h][v], kr[v], p);
          out[(h0 + h) * ld + o] = Simd::sum(p) * scale;
        }
      }
    }
    return;
  }
#endif
  for (int64_t h = 0; h < heads; h++)
    for (int64_t o = 0; o < n; o++) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; d++) dot += qg[h * dim + d] * to_f32(k[o * stride + d]);
      out[h * ld + o] = dot * scale;
    }
}

// acc[h * dim + d] += sum over o of p[h * ld + o] * v[o][d] for the heads rows of weights p and
// the n rows v[o] = v + o * stride.
template <int DIM, typename T>
static inline void block_accumulate(const float* __restrict p, int64_t ld, int64_t heads,
                                    const T* __restrict v, int64_t n, int64_t stride, int64_t dim,
                                    float* __restrict acc) {
#if PD_SIMD
  if constexpr (DIM > 0 && DIM % Simd::W == 0) {
    constexpr int NV = DIM / Simd::W, HG = kHeadsTogether<DIM>;
    for (int64_t h0 = 0; h0 < heads; h0 += HG) {
      const int64_t hn = std::min<int64_t>(HG, heads - h0);
      Simd::V a[HG][NV];
      for (int h = 0; h < HG; h++)
        for (int u = 0; u < NV; u++) a[h][u] = h < hn ? Simd::load(acc + (h0 + h) * DIM + u * Simd::W) : Simd::zero();
      for (int64_t o = 0; o < n; o++) {
        Simd::V vr[NV];
        for (int u = 0; u < NV; u++) vr[u] = Simd::load(v + o * stride + u * Simd::W);
        for (int h = 0; h < HG; h++) {
          if (h >= hn) break;
          const Simd::V po = Simd::set1(p[(h0 + h) * ld + o]);
          for (int u = 0; u < NV; u++) a[h][u] = Simd::fma(po, vr[u], a[h][u]);
        }
      }
      for (int h = 0; h < HG; h++)
        if (h < hn)
          for (int u = 0; u < NV; u++) Simd::store(acc + (h0 + h) * DIM + u * Simd::W, a[h][u]);
    }
    return;
  }
#endif
  for (int64_t h = 0; h < heads; h++)
    for (int64_t o = 0; o < n; o++)
      for (int64_t d = 0; d < dim; d++) acc[h * dim + d] += p[h * ld + o] * to_f32(v[o * stride + d]);
}

template <int DIM, typename T>
static void decode_item(const T* __restrict kv, const float* __restrict q, float* __restrict out,
                        const int64_t* __restrict table, int64_t len, int64_t h0, int64_t nh,
                        const int64_t* s, int64_t group, int64_t dim_rt, float scale,
                        float* __restrict scores, float* __restrict acc, float* __restrict stats) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt, bs = s[4], rows = nh * group;
  const int64_t nblocks = (len + bs - 1) / bs;
  for (int64_t j = 0, t0 = 0; j < nblocks; j++, t0 += bs) {
    const T* __restrict base = kv + table[j] * s[0] + h0 * s[3];
    const int64_t n = std::min(bs, len - t0);
    if (j + 1 < nblocks)
      prefetch_block(kv + table[j + 1] * s[0] + h0 * s[3], std::min(bs, len - t0 - bs), nh, s, dim);
    else  // the V rows of the first block come next
      prefetch_block(kv + table[0] * s[0] + s[1] + h0 * s[3], std::min(bs, len), nh, s, dim);
    for (int64_t hh = 0; hh < nh; hh++)
      block_scores<DIM, T>(q + hh * group * dim, group, base + hh * s[3], n, s[2], dim, scale,
                           scores + hh * group * len + t0, len);
  }
  for (int64_t r = 0; r < rows; r++) {
    float* __restrict sg = scores + r * len;
    const float sum = softmax_numerators(sg, len, stats != nullptr ? stats + 2 * r : nullptr), inv = 1.f / sum;
    if (stats != nullptr) stats[2 * r + 1] = sum;
    for (int64_t t = 0; t < len; t++) sg[t] *= inv;
  }
  std::fill(acc, acc + rows * dim, 0.f);
  for (int64_t j = 0, t0 = 0; j < nblocks; j++, t0 += bs) {
    const T* __restrict base = kv + table[j] * s[0] + s[1] + h0 * s[3];
    const int64_t n = std::min(bs, len - t0);
    if (j + 1 < nblocks)
      prefetch_block(kv + table[j + 1] * s[0] + s[1] + h0 * s[3], std::min(bs, len - t0 - bs), nh, s, dim);
    for (int64_t hh = 0; hh < nh; hh++)
      block_accumulate<DIM, T>(scores + hh * group * len + t0, len, group, base + hh * s[3], n, s[2], dim,
                               acc + hh * group * dim);
  }
  std::memcpy(out, acc, sizeof(float) * rows * dim);
}

template <typename T>
static void paged_decode(const T* kv, const float* q, float* out, const int64_t* tables,
                         const int64_t* lens, int64_t batch, int64_t max_blocks, const int64_t* strides,
                         int64_t kv_heads, int64_t group, int64_t dim, int64_t q_stride, float scale,
                         bool split_context) {
  // A sequence is one item with all its KV heads, unless there are too few sequences to keep
  // every thread busy; then each KV head is an item, and if that still leaves fewer than two
  // items a thread, each context is cut into chunks of whole blocks (at least kMinChunk tokens),
  // each chunk's softmax taken alone and the chunks merged by their maxima and sums after.
  // Without split_context (the batch-invariant mode) a context is never cut: the chunks depend
  // on the batch size, and merging them rounds differently from one pass.
  constexpr int64_t kMinChunk = 256;
  const int64_t threads = at::get_num_threads(), bs = strides[4];
  const int64_t split = batch >= 2 * threads ? 1 : kv_heads, nh = kv_heads / split;
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; b++) longest = std::max(longest, lens[b]);
  const int64_t chunks = split == 1 || !split_context ? 1 : std::max<int64_t>(1, std::min((2 * threads + batch * split - 1) / (batch * split),
                                                                           longest / kMinChunk));
  const int64_t items = batch * split * chunks;
  // Item i: sequence i / (split * chunks), KV heads ((i / chunks) % split) * nh.., chunk i % chunks.
  auto first_block = [&](int64_t i) {
    const int64_t nb = (lens[i / (split * chunks)] + bs - 1) / bs;
    return (i % chunks) * ((nb + chunks - 1) / chunks);
  };
  auto tokens = [&](int64_t i) {
    const int64_t len = lens[i / (split * chunks)], nb = (len + bs - 1) / bs, per = (nb + chunks - 1) / chunks;
    return std::max<int64_t>(0, std::min(len, (i % chunks + 1) * per * bs) - first_block(i) * bs);
  };
  int64_t work = 0;
  for (int64_t i = 0; i < items; i++) work += tokens(i);
  const int64_t rows = nh * group;  // query heads of an item
  // Per chunk and query head: its normalized output, and (max, sum); an empty chunk keeps
  // (-inf, 0) and zeros, so it weighs nothing in the merge.
  std::vector<float> parts(chunks > 1 ? items * rows * dim : 0), stats(chunks > 1 ? items * rows * 2 : 0);
  for (size_t i = 0; i < stats.size(); i += 2) stats[i] = -INFINITY;
  auto run_item = [&](int64_t i, float* scores, float* acc) {
    const int64_t len = tokens(i);
    if (len == 0) return;
    const int64_t b = i / (split * chunks), h0 = ((i / chunks) % split) * nh;
    const float* qi = q + b * q_stride + h0 * group * dim;
    float* oi = chunks > 1 ? parts.data() + i * rows * dim : out + (b * kv_heads + h0) * group * dim;
    float* st = chunks > 1 ? stats.data() + i * rows * 2 : nullptr;
    const int64_t* ti = tables + b * max_blocks + first_block(i);
    if (dim == 64)
      decode_item<64, T>(kv, qi, oi, ti, len, h0, nh, strides, group, dim, scale, scores, acc, st);
    else if (dim == 128)
      decode_item<128, T>(kv, qi, oi, ti, len, h0, nh, strides, group, dim, scale, scores, acc, st);
    else
      decode_item<0, T>(kv, qi, oi, ti, len, h0, nh, strides, group, dim, scale, scores, acc, st);
  };
  // Longest items first, handed out one at a time (parallel.h): the threads end together.
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; i++) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tokens(a) > tokens(b); });
  parallel_items(items, work * nh * dim < kSerialElems, [&](auto next) {
    std::vector<float> scores(rows * longest), acc(rows * dim);
    for (int64_t j; next(j);) run_item(order[j], scores.data(), acc.data());
  });
  if (chunks == 1) return;
  for (int64_t first = 0; first < items; first += chunks) {  // one (sequence, KV heads) at a time
    const int64_t b = first / (split * chunks), h0 = ((first / chunks) % split) * nh;
    for (int64_t r = 0; r < rows; r++) {
      float m = -INFINITY, total = 0.f;
      for (int64_t i = first; i < first + chunks; i++) m = std::max(m, stats[(i * rows + r) * 2]);
      float* o = out + (b * kv_heads + h0) * group * dim + r * dim;
      std::fill(o, o + dim, 0.f);
      for (int64_t i = first; i < first + chunks; i++) {
        const float w = stats[(i * rows + r) * 2 + 1] * std::exp(stats[(i * rows + r) * 2] - m);
        total += w;
        const float* p = parts.data() + (i * rows + r) * dim;
        for (int64_t d = 0; d < dim; d++) o[d] += w * p[d];
      }
      for (int64_t d = 0; d < dim; d++) o[d] /= total;
    }
  }
}

// q: [B, H, D] float32 (token stride q_stride, head stride D); out: [B, H, D] float32, contiguous;
// kv: the layer's cache, float32 or (kv_bf16) bfloat16; tables: [B, max_blocks]; strides:
// block, k->v, token-in-block, head (in cache elements), block_size; split_context 0: never cut a
// context into chunks (each output row then depends only on its own sequence).
extern "C" void pd_paged_decode(const void* kv, const float* q, float* out, const int64_t* tables,
                                const int64_t* lens, int64_t batch, int64_t max_blocks,
                                const int64_t* strides, int64_t kv_heads, int64_t group, int64_t dim,
                                int64_t q_stride, float scale, int64_t kv_bf16, int64_t split_context) {
  with_kv_type(kv, kv_bf16, [&](auto typed) {
    paged_decode(typed, q, out, tables, lens, batch, max_blocks, strides, kv_heads, group, dim, q_stride, scale,
                 split_context != 0);
  });
}
