// A CPU decode step's whole decoder stack in one native call (pdinfer/layers/cpu_decode_stack.py):
// the same kernels the torch modules call, one after another, without the ~15 Python calls a
// layer costs (a large share of a small model's batch-1 step). The CPU counterpart of a CUDA
// graph: same arithmetic, same order, so the output equals the modules' bit for bit.
#include <ATen/Parallel.h>
#include <cstdint>
#include <vector>

extern "C" {
void pd_rms_norm(const float* x, int64_t x_stride, const float* w, float* out, int64_t rows, int64_t dim,
                 float eps);
void pd_rotary_qk(float* q, int64_t q_row, int64_t q_head, int64_t hq, float* k, int64_t k_row,
                  int64_t k_head, int64_t hk, const float* cos, const float* sin, int64_t cs_row,
                  int64_t tokens, int64_t rot);
void pd_silu_and_mul(const float* x, int64_t x_stride, float* out, int64_t rows, int64_t n);
void pd_write_kv(void* layer, const int64_t* slots, const void* k, int64_t k_stride, const void* v,
                 int64_t v_stride, int64_t tokens, int64_t row, int64_t block_size, int64_t elem_bytes);
void pd_paged_decode(const void* kv, const float* q, float* out, const int64_t* tables,
                     const int64_t* lens, int64_t batch, int64_t max_blocks, const int64_t* strides,
                     int64_t kv_heads, int64_t group, int64_t dim, int64_t q_stride, float scale,
                     int64_t kv_bf16, int64_t split_context);
void pd_small_gemm(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
                   int64_t k);
void pd_gemm_panels(const float* x, const float* wp, const float* bias, float* y, int64_t m, int64_t n,
                    int64_t k);
void pd_quant_gemm(const float* x, const uint8_t* qs, const float* d, const float* mn, const float* bias,
                   float* y, int64_t m, int64_t n, int64_t k);
void pd_quant_gemm_tiled(const float* x, const uint8_t* qt, const float* dt, const float* mt,
                         const float* bias, float* y, int64_t m, int64_t n, int64_t k);
int64_t pd_quant_stream_rows();
void pd_amx_quant_gemm(const float* x, const uint16_t* bq, const float* dt, const float* mt, const float* bias,
                       float* y, int64_t m, int64_t n, int64_t k);
int64_t pd_amx_min_rows();
}

// One linear layer as PackedLinear runs it: up to pd_quant_stream_rows() rows the row-streaming
// GEMM over GGUF blocks (qs != nullptr), else the small float GEMM; above that the AMX GEMM
// from pd_amx_min_rows() rows where the layer has its layout (aq != nullptr), else the tiled
// GEMM (blocks only; the caller never sends more rows than it allows). In the batch-invariant
// mode one GEMM for every row count, as PackedLinear runs it there: AMX, else the tiled GEMM
// (blocks), else the float GEMM over panels (wp).
struct PdLinear {
  const float* weight;  // [n, k] floats
  const float* wp;      // the panels of pd_gemm_panels (nullptr: not in the batch-invariant mode)
  const uint8_t* qs;    // GGUF layout (nullptr: no blocks)
  const float* d;
  const float* mn;      // nullptr: q8 blocks
  const uint8_t* qt;    // the tiled layout
  const float* dt;
  const float* mt;
  const uint16_t* aq;   // the AMX layout (nullptr: not used)
  const float* bias;    // nullptr: none
  int64_t n, k;
};

struct PdLayer {
  const float* input_norm;
  const float* post_norm;
  const float* q_norm;  // QK-norm (Qwen3): per-head RMSNorm weights; nullptr: none
  const float* k_norm;
  PdLinear qkv, o, gate_up, down;
};

struct PdStack {
  const PdLayer* layers;
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, rot;
  float eps, scale;
  int64_t batch_invariant;
};

static void linear(const PdLinear& l, const float* x, float* y, int64_t m, bool batch_invariant) {
  if (batch_invariant) {
    if (l.aq != nullptr)
      pd_amx_quant_gemm(x, l.aq, l.dt, l.mt, l.bias, y, m, l.n, l.k);
    else if (l.qs != nullptr)
      pd_quant_gemm_tiled(x, l.qt, l.dt, l.mt, l.bias, y, m, l.n, l.k);
    else
      pd_gemm_panels(x, l.wp, l.bias, y, m, l.n, l.k);
  } else if (l.qs == nullptr)
    pd_small_gemm(x, l.weight, l.bias, y, m, l.n, l.k);
  else if (m <= pd_quant_stream_rows())
    pd_quant_gemm(x, l.qs, l.d, l.mn, l.bias, y, m, l.n, l.k);
  else if (l.aq != nullptr && m >= pd_amx_min_rows())
    pd_amx_quant_gemm(x, l.aq, l.dt, l.mt, l.bias, y, m, l.n, l.k);
  else
    pd_quant_gemm_tiled(x, l.qt, l.dt, l.mt, l.bias, y, m, l.n, l.k);
}

static void add_into(float* x, const float* h, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] += h[i];
}

// x [T, hidden]: the embeddings in, the last layer's output out. kv: the cache
// [blocks, layers, 2, block_size, KVH, D]; layer_stride: floats from one layer to the next;
// strides, slots, tables, lens: as for pd_paged_decode and pd_write_kv (one query per sequence);
// cos/sin [T, rot] at row stride cs_row.
extern "C" void pd_decode_stack(const PdStack* s, float* x, int64_t tokens, float* kv, int64_t layer_stride,
                                const int64_t* strides, const int64_t* slots, const int64_t* tables,
                                const int64_t* lens, int64_t max_blocks, const float* cos,
                                const float* sin, int64_t cs_row) {
  const int64_t T = tokens, H = s->hidden, D = s->head_dim;
  const bool inv = s->batch_invariant != 0;
  const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D, qkv_w = q_size + 2 * kv_size;
  std::vector<float> normed(T * H), qkv(T * qkv_w), attn(T * q_size), h(T * H),
      gate_up(T * 2 * s->intermediate), act(T * s->intermediate);
  for (int64_t i = 0; i < s->num_layers; i++) {
    const PdLayer& L = s->layers[i];
    float* layer_kv = kv + i * layer_stride;
    pd_rms_norm(x, H, L.input_norm, normed.data(), T, H, s->eps);
    linear(L.qkv, normed.data(), qkv.data(), T, inv);
    float *q = qkv.data(), *k = q + q_size, *v = k + kv_size;
    if (L.q_norm != nullptr)
      for (int64_t t = 0; t < T; t++) {  // in place: each row is read before it is written
        pd_rms_norm(q + t * qkv_w, D, L.q_norm, q + t * qkv_w, s->heads, D, s->eps);
        pd_rms_norm(k + t * qkv_w, D, L.k_norm, k + t * qkv_w, s->kv_heads, D, s->eps);
      }
    pd_rotary_qk(q, qkv_w, D, s->heads, k, qkv_w, D, s->kv_heads, cos, sin, cs_row, T, s->rot);
    pd_write_kv(layer_kv, slots, k, qkv_w, v, qkv_w, T, kv_size, strides[4], sizeof(float));
    pd_paged_decode(layer_kv, q, attn.data(), tables, lens, T, max_blocks, strides, s->kv_heads,
                    s->heads / s->kv_heads, D, qkv_w, s->scale, 0, !inv);
    linear(L.o, attn.data(), h.data(), T, inv);
    add_into(x, h.data(), T * H);
    pd_rms_norm(x, H, L.post_norm, normed.data(), T, H, s->eps);
    linear(L.gate_up, normed.data(), gate_up.data(), T, inv);
    pd_silu_and_mul(gate_up.data(), 2 * s->intermediate, act.data(), T, s->intermediate);
    linear(L.down, act.data(), h.data(), T, inv);
    add_into(x, h.data(), T * H);
  }
}
