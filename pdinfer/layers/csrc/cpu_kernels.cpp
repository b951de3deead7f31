// Native CPU kernels: paged prefill and decode attention, the small float GEMM, fused elementwise ops
// (pdinfer/layers/cpu_kernels.py builds and loads this file together with quant_gemm.cpp).
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "parallel.h"
#include "tile.h"

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

// f(kv as the cache's element pointer): bfloat16 bits (kv_bf16) or float.
template <typename F>
static inline void with_kv_type(const void* kv, int64_t kv_bf16, F&& f) {
  if (kv_bf16)
    f(static_cast<const uint16_t*>(kv));
  else
    f(static_cast<const float*>(kv));
}

// One work item is (sequence, KV heads [h0, h0 + nh)): their nh * group query heads against
// those heads' K/V, block by block; each query head's accumulators stay in registers over a
// block's tokens (the block's K or V, 16 tokens x nh heads, stays in L1 meanwhile), and the next
// block is prefetched while this one is computed on.
// s: strides of the layer view [blocks, 2, block_size, KVH, D] in cache elements (block, k->v,
// token, head) and the block size. DIM > 0 fixes head_dim at compile time (full unrolling).
// T: the cache's element, float or bfloat16 bits (uint16_t); the arithmetic is float32 either way.
// Every cache line of the next block is prefetched (measured faster than one line per row or none).
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
                         int64_t kv_heads, int64_t group, int64_t dim, int64_t q_stride, float scale) {
  // A sequence is one item with all its KV heads, unless there are too few sequences to keep
  // every thread busy; then each KV head is an item, and if that still leaves fewer than two
  // items a thread, each context is cut into chunks of whole blocks (at least kMinChunk tokens),
  // each chunk's softmax taken alone and the chunks merged by their maxima and sums after.
  constexpr int64_t kMinChunk = 256;
  const int64_t threads = at::get_num_threads(), bs = strides[4];
  const int64_t split = batch >= 2 * threads ? 1 : kv_heads, nh = kv_heads / split;
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; b++) longest = std::max(longest, lens[b]);
  const int64_t chunks = split == 1 ? 1 : std::max<int64_t>(1, std::min((2 * threads + batch * split - 1) / (batch * split),
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
  if (work * nh * dim < kSerialElems) {  // a few short contexts: this thread alone
    std::vector<float> scores(rows * longest), acc(rows * dim);
    for (int64_t i = 0; i < items; i++) run_item(i, scores.data(), acc.data());
  } else {  // longest items first, handed out one at a time (parallel.h): the threads end together
    std::vector<int64_t> order(items);
    for (int64_t i = 0; i < items; i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tokens(a) > tokens(b); });
    parallel_chunks(items, 1, [&](auto next) {
      std::vector<float> scores(rows * longest), acc(rows * dim);
      for (int64_t j0, j1; next(j0, j1);)
        for (int64_t j = j0; j < j1; j++) run_item(order[j], scores.data(), acc.data());
    });
  }
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
// block, k->v, token-in-block, head (in cache elements), block_size.
extern "C" void pd_paged_decode(const void* kv, const float* q, float* out, const int64_t* tables,
                                const int64_t* lens, int64_t batch, int64_t max_blocks,
                                const int64_t* strides, int64_t kv_heads, int64_t group, int64_t dim,
                                int64_t q_stride, float scale, int64_t kv_bf16) {
  with_kv_type(kv, kv_bf16, [&](auto typed) {
    paged_decode(typed, q, out, tables, lens, batch, max_blocks, strides, kv_heads, group, dim, q_stride, scale);
  });
}

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

// Prefill attention, causal, for every sequence of a step at once, reading K/V through the block
// tables (so a cached prefix and a chunk already written to the cache are read alike).
// Phase 1 packs each (sequence, KV head) into panels of TILE columns: K transposed, TILE keys
// side by side [d][TILE], and V, TILE of its dims side by side [token][TILE] (zeros past the
// context and past head_dim). Phase 2 takes work items (sequence, KV head, QT query positions)
// largest first from a shared counter; an item's QT * group query rows (scaled copies) go
// through the FMA tile twice: S = Q K^T over the keys up to its last position, exact softmax
// per row (causal mask, max, exp, sum), then O = P V in slices of KC keys (a V panel's slice
// stays in L1 while all rows pass), divided by the row's sum.
constexpr int64_t QT = 16, KC_KEYS = 128;

struct PrefillPack {
  int64_t kt, v, keys;  // offsets of the K and V panels in the pack buffer; keys padded to TILE
};

template <typename T>
static void pack_kv(const T* kv, const int64_t* s, const int64_t* table, int64_t ctx, int64_t h,
                    int64_t dim, int64_t dpad, const PrefillPack& p, float* __restrict buf) {
  const int64_t bs = s[4];
  float* __restrict kt = buf + p.kt;
  float* __restrict vp = buf + p.v;
  for (int64_t t = 0; t < p.keys; t++) {
    float* __restrict kcol = kt + (t / TILE) * dpad * TILE + t % TILE;
    float* __restrict vrow = vp + t * TILE;
    const T* __restrict row = t < ctx ? kv + table[t / bs] * s[0] + (t % bs) * s[2] + h * s[3] : nullptr;
    for (int64_t d = 0; d < dpad; d++) {
      const bool in = row != nullptr && d < dim;
      kcol[d * TILE] = in ? to_f32(row[d]) : 0.f;
      vrow[(d / TILE) * p.keys * TILE + d % TILE] = in ? to_f32(row[s[1] + d]) : 0.f;
    }
  }
}

static void prefill_item(const float* __restrict q, int64_t q_row, float* __restrict out,
                         int64_t out_row, const float* __restrict kt, const float* __restrict vp,
                         int64_t keys_pad, int64_t i0, int64_t n, int64_t offset, int64_t h,
                         int64_t group, int64_t dim, int64_t dpad, float scale, float* __restrict qb,
                         float* __restrict sc, float* __restrict ob, float* __restrict inv) {
  const int64_t rows = n * group, keys = offset + i0 + n, ld = round_up(keys, TILE);
  for (int64_t r = 0; r < rows; r++) {  // row r: position i0 + r / group, head h * group + r % group
    const float* __restrict src = q + (i0 + r / group) * q_row + (h * group + r % group) * dim;
    for (int64_t d = 0; d < dpad; d++) qb[r * dpad + d] = d < dim ? src[d] * scale : 0.f;
  }
  for (int64_t t = 0; t < ld / TILE; t++)
    for (int64_t r = 0; r < rows; r += MR)
      tile_rows<MR>(std::min<int64_t>(MR, rows - r), qb + r * dpad, dpad, dpad, kt + t * dpad * TILE,
                    TILE, sc + r * ld + t * TILE, ld, true);
  for (int64_t r = 0; r < rows; r++) {
    float* __restrict sr = sc + r * ld;
    const int64_t last = offset + i0 + r / group;  // the last key this row sees
    inv[r] = 1.f / softmax_numerators(sr, last + 1);
    std::fill(sr + last + 1, sr + keys, 0.f);
  }
  for (int64_t c0 = 0; c0 < dpad; c0 += TILE)
    for (int64_t k0 = 0; k0 < keys; k0 += KC_KEYS)
      for (int64_t r = 0; r < rows; r += MR)
        tile_rows<MR>(std::min<int64_t>(MR, rows - r), sc + r * ld + k0, ld,
                      std::min(KC_KEYS, keys - k0), vp + (c0 / TILE) * keys_pad * TILE + k0 * TILE,
                      TILE, ob + r * dpad + c0, dpad, k0 == 0);
  for (int64_t r = 0; r < rows; r++) {
    float* __restrict dst = out + (i0 + r / group) * out_row + (h * group + r % group) * dim;
    for (int64_t d = 0; d < dim; d++) dst[d] = ob[r * dpad + d] * inv[r];
  }
}

// q: [T, H, D] (row stride q_row, head stride D), the step's query rows, sequence b's from
// starts[b]; out: the same shape, row stride out_row. Sequence b has qlens[b] new tokens at the
// end of its ctxs[b]-token context, whose K/V are already in the cache (float32 or, kv_bf16,
// bfloat16; packed as float32); tables [B, max_blocks]; strides as for pd_paged_decode.
extern "C" void pd_prefill_attention(const void* kv, const int64_t* strides, const float* q,
                                     int64_t q_row, float* out, int64_t out_row,
                                     const int64_t* tables, const int64_t* starts,
                                     const int64_t* qlens, const int64_t* ctxs, int64_t batch,
                                     int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim,
                                     float scale, int64_t kv_bf16) {
  const int64_t group = heads / kv_heads, dpad = round_up(dim, TILE);
  std::vector<PrefillPack> packs(batch * kv_heads);
  int64_t size = 0, longest = 0;
  for (int64_t i = 0; i < batch * kv_heads; i++) {
    const int64_t keys = round_up(ctxs[i / kv_heads], TILE);
    packs[i] = {size, size + keys * dpad, keys};
    size += 2 * keys * dpad;
    longest = std::max(longest, keys);
  }
  // The caller's buffer, kept between calls: a fresh one of many MiB is a fresh mmap (and its
  // page faults) every layer.
  thread_local std::vector<float> buf;
  if ((int64_t)buf.size() < size) buf.resize(size);
  float* packed = buf.data();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    with_kv_type(kv, kv_bf16, [&](auto typed) {
      for (int64_t i = i0; i < i1; i++)
        pack_kv(typed, strides, tables + (i / kv_heads) * max_blocks, ctxs[i / kv_heads], i % kv_heads, dim,
                dpad, packs[i], packed);
    });
  });
  struct Item { int64_t cost, seq, h, i0; };
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t b = 0; b < batch; b++)
    for (int64_t i0 = 0; i0 < qlens[b]; i0 += QT) {
      const int64_t cost = std::min(QT, qlens[b] - i0) * (ctxs[b] - qlens[b] + i0 + QT);
      work += cost * kv_heads;
      for (int64_t h = 0; h < kv_heads; h++) items.push_back({cost, b, h, i0});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t runs = work * group * dim < kSerialElems ? 1 : at::get_num_threads();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, runs, 1, [&](int64_t, int64_t) {
    std::vector<float> qb(QT * group * dpad), sc(QT * group * longest), ob(QT * group * dpad), inv(QT * group);
    for (int64_t i; (i = next.fetch_add(1)) < (int64_t)items.size();) {
      const Item& it = items[i];
      const PrefillPack& p = packs[it.seq * kv_heads + it.h];
      prefill_item(q + starts[it.seq] * q_row, q_row, out + starts[it.seq] * out_row, out_row,
                   packed + p.kt, packed + p.v, p.keys, it.i0, std::min(QT, qlens[it.seq] - it.i0),
                   ctxs[it.seq] - qlens[it.seq], it.h, group, dim, dpad, scale, qb.data(), sc.data(),
                   ob.data(), inv.data());
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
