// Paged prefill attention on CPU: a step's new tokens, causal, against each sequence's whole
// context in the cache (pdinfer/layers/cpu_kernels.py builds and loads this file with the others).
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <vector>
#include "kernel_common.h"
#include "parallel.h"
#include "tile.h"

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
  parallel_items((int64_t)items.size(), work * group * dim < kSerialElems, [&](auto next) {
    std::vector<float> qb(QT * group * dpad), sc(QT * group * longest), ob(QT * group * dpad), inv(QT * group);
    for (int64_t i; next(i);) {
      const Item& it = items[i];
      const PrefillPack& p = packs[it.seq * kv_heads + it.h];
      prefill_item(q + starts[it.seq] * q_row, q_row, out + starts[it.seq] * out_row, out_row,
                   packed + p.kt, packed + p.v, p.keys, it.i0, std::min(QT, qlens[it.seq] - it.i0),
                   ctxs[it.seq] - qlens[it.seq], it.h, group, dim, dpad, scale, qb.data(), sc.data(),
                   ob.data(), inv.data());
    }
  });
}
