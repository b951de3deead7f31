"""The CUDA Triton kernels, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

Each kernel is compared with a plain float64 reference on random inputs, with the paged layout
the engine uses (scrambled block tables, padding rows, cached prefixes, GQA). The last test
runs whole engine steps through ``GpuRunner`` (the CUDA step path: packed inputs, Triton
attention, pending tokens) against ``CpuRunner`` on the same weights. The dev extra
installs Triton, so CI runs them; skipped only where Triton is missing.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pdinfer.layers import triton_ops  # noqa: E402
from pdinfer.layers.attention import triton_paged as tp  # noqa: E402
from pdinfer.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

if not triton_ops.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs Triton's interpreter", allow_module_level=True)


def _fix_interpreter_scalars() -> None:
    """Triton's interpreter turns a scalar (a 1-element array) into an int with ``int(array)``,
    which numpy >= 2.4 refuses; loops with run-time bounds need it."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_pdinfer_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pdinfer_fixed = True
    interpreter._patch_lang_tensor = patched


_fix_interpreter_scalars()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def split_qkv(x: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as views of one QKV projection's rows ``x`` [T, (heads + 2 * KV_HEADS) * HEAD_DIM]."""
    t = x.shape[0]
    q = x[:, : heads * HEAD_DIM].view(t, heads, HEAD_DIM)
    k = x[:, heads * HEAD_DIM : (heads + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)
    v = x[:, (heads + KV_HEADS) * HEAD_DIM :].view(t, KV_HEADS, HEAD_DIM)
    return q, k, v


# --- fused elementwise ops ----------------------------------------------------------------------
def test_rms_norm_matches_torch():
    x = torch.randn(7, 96)
    w = torch.randn(96)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert rel_err(triton_ops.rms_norm(x, w, 1e-5), ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    x = torch.randn(5, 96).to(dtype)
    residual = torch.randn(5, 96).to(dtype)
    w = torch.randn(96).to(dtype)
    expected_sum = residual + x  # torch's add, rounded to dtype
    expected = triton_ops.rms_norm(expected_sum, w, 1e-5)
    out = triton_ops.add_rms_norm_(x, residual, w, 1e-5)
    assert torch.equal(residual, expected_sum)  # the residual stream, updated in place
    assert torch.equal(out, expected)  # bit for bit: the fused kernel rounds where the pair does


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_qk_in_place_on_strided_views(rotary_dim):
    qkv = torch.randn(9, (4 + 2 + 2) * 32)
    q = qkv[:, :128].view(9, 4, 32)
    k = qkv[:, 128:192].view(9, 2, 32)
    v_before = qkv[:, 192:].clone()
    rot = RotaryEmbedding(32, 10000.0, {"partial_rotary_factor": rotary_dim / 32})
    cos, sin = rot.cos_sin(torch.arange(9) * 5 + 3, torch.float32)
    ref_q, ref_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    triton_ops.rotary_qk_(q, k, cos, sin)
    assert rel_err(q, ref_q) < 1e-6 and rel_err(k, ref_k) < 1e-6
    assert torch.equal(qkv[:, 192:], v_before)  # V untouched


def test_silu_and_mul():
    x = torch.randn(5, 2 * 300)
    ref = torch.nn.functional.silu(x[:, :300]) * x[:, 300:]
    assert rel_err(triton_ops.silu_and_mul(x), ref) < 1e-6


@pytest.mark.parametrize("m, inter, k", [(40, 48, 32), (16, 16, 64), (3, 40, 48)])
def test_gate_up_gemm_with_silu_epilogue_is_the_pair(m, inter, k):
    """``triton_gate_up.gate_up_silu`` equals the GEMM then ``silu_and_mul``: float16 tiles with
    rows past M and columns past I (partial tiles: I = 40 with 16-column tiles, where the gate
    tile's last columns read up rows and the up tile's read past the weight), more tiles than
    programs (the persistent loop), the gate and up halves of one weight."""
    from pdinfer.layers import triton_gate_up

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).half()
    w = (torch.randn(2 * inter, k, generator=g) * 0.1).half()
    cfg = {"block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 2, "group_m": 2}
    out = triton_gate_up.gate_up_silu(x, w, 5, cfg)
    gate_up = (x.double() @ w.double().T).half()  # the GEMM's output, rounded as cuBLAS stores it
    ref = triton_ops.silu_and_mul(gate_up.float())
    assert out.dtype == torch.float16 and out.shape == (m, inter)
    assert rel_err(out, ref) < 2e-3  # float16 rounding of the three steps, not a wrong tile


@pytest.mark.parametrize("m, n, k", [(40, 48, 32), (17, 16, 64), (64, 40, 48)])
def test_decode_linear_gemm_is_the_matmul(m, n, k):
    """``triton_linear.matmul`` equals ``x @ w.T`` rounded once from exact sums: partial row
    tiles (M under the tile), a partial column tile (N = 40 with 16-column tiles, whose last
    columns read past the weight), a K that is not a multiple of the K step (48 with 32), and more
    tiles than programs (the persistent loop)."""
    from pdinfer.layers import triton_linear

    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) * 0.1).half()
    cfg = {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}
    out = triton_linear.matmul(x, w, 3, cfg)
    ref = (x.double() @ w.double().T).half()
    assert out.dtype == torch.float16 and out.shape == (m, n)
    assert rel_err(out, ref) < 1e-3  # float32 sums rounded once: at most a float16 step apart


# --- paged attention ----------------------------------------------------------------------------
NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 96, 3, 4, 2, 32


def make_cache(dtype=torch.float32):
    kv = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)
    return kv, kv[:, 1]  # the engine's tensor and one layer's view (strided)


def scrambled_tables(context_lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = []
    for ctx in context_lens:
        n = -(-ctx // BLOCK_SIZE)
        tables.append(free[:n])
        free = free[n:]
    return tables


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


def ref_attention(q, layer_cache, table, ctx, q_positions, scale):
    """q [n, H, D] at the given positions attends to keys 0..pos of the sequence (float64)."""
    blocks = layer_cache[torch.tensor(table, dtype=torch.int64)].double()  # [nb, 2, bs, KVH, D]
    keys = blocks[:, 0].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx]
    values = blocks[:, 1].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx]
    group = q.shape[1] // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    visible = torch.arange(ctx)[None, :] <= torch.tensor(q_positions)[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def test_write_kv_skips_padding_slots():
    kv, layer = make_cache()
    before = kv.clone()
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([5 * BLOCK_SIZE + 2, -1, 17 * BLOCK_SIZE + 0])
    tp.write_kv(k, v, layer, slots)
    assert torch.equal(layer[5, 0, 2], k[0]) and torch.equal(layer[5, 1, 2], v[0])
    assert torch.equal(layer[17, 0, 0], k[2]) and torch.equal(layer[17, 1, 0], v[2])
    before[:, 1, :, :, :, :][5, :, 2] = layer[5, :, 2]
    before[:, 1, :, :, :, :][17, :, 0] = layer[17, :, 0]
    assert torch.equal(kv, before)  # nothing else written (other layers included)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
def test_rotary_write_kv_is_rotary_then_write(kv_dtype):
    """The fused kernel leaves q, k and the cache exactly as rotary_qk_ followed by write_kv
    does, padding slot included (an FP8 cache with its scales too)."""
    t, heads = 5, 2 * KV_HEADS
    qkv = torch.randn(t, (heads + 2 * KV_HEADS) * HEAD_DIM).half()
    rot = RotaryEmbedding(HEAD_DIM, 10000.0, {})
    cos, sin = rot.cos_sin(torch.arange(t) * 7 + 1, torch.float16)
    slots = torch.tensor([5 * BLOCK_SIZE + 2, -1, 17 * BLOCK_SIZE, 17 * BLOCK_SIZE + 3, 40 * BLOCK_SIZE + 1])
    kv0 = make_cache(torch.float16)[0].to(kv_dtype)
    outs = []
    for fused in (False, True):
        x = qkv.clone()
        q, k, v = split_qkv(x, heads)
        kv = kv0.clone()
        layer = kv[:, 1]
        if fused:
            tp.rotary_write_kv(q, k, v, cos, sin, layer, slots, k_scale=0.5, v_scale=2.0)
        else:
            triton_ops.rotary_qk_(q, k, cos, sin)
            tp.write_kv(k, v, layer, slots, k_scale=0.5, v_scale=2.0)
        outs.append((x, kv.view(torch.uint8)))
    (x_ref, kv_ref), (x_fused, kv_fused) = outs
    assert not torch.equal(x_ref, qkv) and not torch.equal(kv_ref, kv0.view(torch.uint8))  # both did something
    assert torch.equal(x_fused, x_ref) and torch.equal(kv_fused, kv_ref)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("num_heads", [4, 2])  # GQA group 2, and MHA
def test_decode_attention(num_splits, num_heads):
    _, layer = make_cache()
    context_lens = [1, 13, 37, 0, 8]  # 0: a CUDA-graph padding row
    tables = scrambled_tables(context_lens)
    q = torch.randn(len(context_lens), num_heads, HEAD_DIM)
    out = tp.decode_attention(q, layer, padded_tables(tables), torch.tensor(context_lens), HEAD_DIM**-0.5, num_splits)
    for i, ctx in enumerate(context_lens):
        if ctx == 0:
            assert torch.all(out[i] == 0)
            continue
        ref = ref_attention(q[i : i + 1], layer, tables[i], ctx, [ctx - 1], HEAD_DIM**-0.5)
        assert rel_err(out[i : i + 1], ref) < 1e-5, (i, ctx)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_with_rotary_is_rotary_write_then_decode(num_splits, kv_dtype):
    """A decode step through the one fused launch (q and the new K unrotated, the new K/V not
    yet in the cache) leaves the cache of ``rotary_write_kv`` then ``decode_attention`` bit for
    bit, padding row included, gives their output (the new token's score is summed in another
    order: equal to rounding), and leaves q and k as they came."""
    heads = 2 * KV_HEADS
    context_lens = [1, 13, 37, 0, 70]  # 0: a CUDA-graph padding row (slot -1)
    b = len(context_lens)
    tables = scrambled_tables(context_lens, seed=4)
    slots = torch.tensor(
        [
            t[(c - 1) // BLOCK_SIZE] * BLOCK_SIZE + (c - 1) % BLOCK_SIZE if c else -1
            for t, c in zip(tables, context_lens)
        ]
    )
    qkv = torch.randn(b, (heads + 2 * KV_HEADS) * HEAD_DIM).half()
    cos, sin = RotaryEmbedding(HEAD_DIM, 10000.0, {}).cos_sin(
        torch.tensor([max(c - 1, 0) for c in context_lens]), torch.float16
    )
    kv0 = make_cache(torch.float16)[0].to(kv_dtype)
    outs = []
    for fused in (False, True):
        x = qkv.clone()
        q, k, v = split_qkv(x, heads)
        kv = kv0.clone()
        layer = kv[:, 1]
        args = (layer, padded_tables(tables), torch.tensor(context_lens), HEAD_DIM**-0.5, num_splits)
        scales = {"k_scale": 0.5, "v_scale": 2.0}
        if fused:
            out = tp.decode_attention(q, *args, **scales, rotary=tp.DecodeRotary(k, v, cos, sin, slots))
            assert torch.equal(x, qkv)  # q and k as they came
        else:
            tp.rotary_write_kv(q, k, v, cos, sin, layer, slots, **scales)
            out = tp.decode_attention(q, *args, **scales)
        outs.append((out, kv.view(torch.uint8)))
    (out_ref, kv_ref), (out_fused, kv_fused) = outs
    assert not torch.equal(kv_ref, kv0.view(torch.uint8))  # the new K/V were written
    assert torch.equal(kv_fused, kv_ref)
    assert torch.all(out_fused[3] == 0)  # the padding row
    assert rel_err(out_fused, out_ref) < 2e-3


def test_a_verifying_step_writes_every_row_before_any_row_attends():
    """Speculative decoding's verifying step: one sequence's 1 + k rows in one decode step, row
    i attending to the K/V of rows < i. The one-launch decode writes only each row's own K/V,
    so on a GPU (programs in any order) a row may read a slot before its row wrote it: an
    engine that verifies drafts gets backends that write every row first. Here the rows come
    last position first, so the interpreter (programs in order) runs a row before the rows it
    reads; the output must still be the write-then-attend reference."""
    from pdinfer.layers.attention.torch_paged import TorchPagedAttention

    heads, ctx = 2 * KV_HEADS, 23
    positions = [ctx - 1, ctx - 2, ctx - 3, ctx - 4]  # the last known token and 3 drafts, reversed
    table = scrambled_tables([ctx], seed=5)[0]
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])
    tables = padded_tables([table] * len(positions))
    lens = torch.tensor([p + 1 for p in positions])
    qkv = torch.randn(len(positions), (heads + 2 * KV_HEADS) * HEAD_DIM).half()
    cos, sin = RotaryEmbedding(HEAD_DIM, 10000.0, {}).cos_sin(torch.tensor(positions), torch.float16)
    kv0 = make_cache(torch.float16)[0]

    module = torch.nn.Module()
    module.backend = TorchPagedAttention(heads, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    tp.use_triton_attention(module, verifies_drafts=True)
    meta = tp.GpuAttentionMetadata(True, slots, tables, lens, num_splits=2, num_tokens=len(positions))
    q, k, v = split_qkv(qkv.clone(), heads)
    kv = kv0.clone()
    out = module.backend.forward(q, k, v, kv[:, 1], meta, rotary=(cos, sin))

    q, k, v = split_qkv(qkv.clone(), heads)
    kv_ref = kv0.clone()
    tp.rotary_write_kv(q, k, v, cos, sin, kv_ref[:, 1], slots)
    ref = tp.decode_attention(q, kv_ref[:, 1], tables, lens, HEAD_DIM**-0.5, 2)
    assert torch.equal(kv, kv_ref)
    assert rel_err(out, ref) < 2e-3


def test_decode_num_splits_depends_on_batch_not_context():
    assert tp.decode_num_splits(1, 8, None) > tp.decode_num_splits(64, 8, None) >= 1
    assert tp.decode_num_splits(1, 8, 100) == 1  # a short context is not split


@pytest.mark.parametrize("num_heads", [4, 2])
def test_prefill_attention_with_cached_prefix(num_heads):
    _, layer = make_cache()
    query_lens = [7, 150, 1, 20]
    context_lens = [7, 160, 30, 20]  # seqs 1 and 2 continue a cached prefix (chunked prefill)
    tables = scrambled_tables(context_lens, seed=1)
    qstart = [0]
    for n in query_lens:
        qstart.append(qstart[-1] + n)
    tiles = [-(-n // tp.PREFILL_BLOCK_M) for n in query_lens]
    work_seq = [s for s, n in enumerate(tiles) for _ in range(n)]
    work_tile = [t for n in tiles for t in range(n)]
    meta = tp.GpuAttentionMetadata(
        False,
        torch.zeros(0, dtype=torch.int64),
        padded_tables(tables),
        torch.tensor(context_lens),
        query_start=torch.tensor(qstart),
        work_seq=torch.tensor(work_seq),
        work_tile=torch.tensor(work_tile),
        num_work=len(work_seq),
    )
    q = torch.randn(qstart[-1], num_heads, HEAD_DIM)
    out = tp.prefill_attention(q, layer, meta, HEAD_DIM**-0.5)
    for s, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        rows = slice(qstart[s], qstart[s + 1])
        ref = ref_attention(q[rows], layer, tables[s], ctx, list(range(ctx - qlen, ctx)), HEAD_DIM**-0.5)
        assert rel_err(out[rows], ref) < 1e-5, s


def fresh_tiles(query_lens: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A fresh prompts' step's query starts and its (sequence, tile) work list, in order."""
    qstart = [0]
    for n in query_lens:
        qstart.append(qstart[-1] + n)
    tiles = [-(-n // tp.PREFILL_BLOCK_M) for n in query_lens]
    work_seq = torch.tensor([s for s, n in enumerate(tiles) for _ in range(n)])
    work_tile = torch.tensor([i for n in tiles for i in range(n)])
    return qstart, work_seq, work_tile


@pytest.mark.parametrize("num_heads", [4, 2])
def test_fresh_prefill_reads_qkv_rows(num_heads):
    """Fresh prompts (no cached prefix): the descriptor kernel reads K/V from the QKV rows and
    gives the causal attention of each sequence alone, however the tiles cut the sequences
    (a tile past a sequence's end runs into the next one's rows)."""
    from pdinfer.layers.attention import triton_prefill

    query_lens = [7, 150, 1, 20]
    qstart, work_seq, work_tile = fresh_tiles(query_lens)
    t = qstart[-1]
    # float16: the interpreter emulates bfloat16 dots incorrectly; bf16 is checked on the GPU
    qkv = torch.randn(t, (num_heads + 2 * KV_HEADS) * HEAD_DIM).half()
    q, k, v = split_qkv(qkv, num_heads)
    assert triton_prefill.fresh_prefill_supported(q, k, v)
    out = torch.full((t, num_heads, HEAD_DIM), float("nan"), dtype=torch.float16)
    triton_prefill.fresh_prefill_attention(
        q, k, v, torch.tensor(qstart), work_seq, work_tile, len(work_seq), HEAD_DIM**-0.5 * tp.LOG2E, 128, out
    )
    group = num_heads // KV_HEADS
    for s in range(len(query_lens)):
        rows = slice(qstart[s], qstart[s + 1])
        keys, values = k[rows].double().repeat_interleave(group, 1), v[rows].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), keys) * HEAD_DIM**-0.5
        n = query_lens[s]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril()[None], float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        assert rel_err(out[rows], ref) < 2e-3, s


@pytest.mark.parametrize("num_heads", [4, 2])
def test_fresh_prefill_rotating_queries_is_rotary_write_then_attention(num_heads):
    """A fresh prompts' step through the backend (its prefill kernel rotating the query tiles as
    it loads them, ``rotary_write_kv`` rotating and storing only the keys) gives the output and
    cache of rotating q and k in place first, bit for bit, and leaves q as it was."""
    from pdinfer.layers.attention import triton_prefill

    query_lens = [7, 150, 1, 20]
    qstart, work_seq, work_tile = fresh_tiles(query_lens)
    t = qstart[-1]
    slots = torch.arange(t) + 3  # any slots: only the cache's bytes are compared
    meta = tp.GpuAttentionMetadata(
        False,
        slots,
        torch.zeros(len(query_lens), 1, dtype=torch.int32),  # unread by the fresh kernel
        torch.tensor(query_lens),
        query_start=torch.tensor(qstart),
        work_seq=work_seq,
        work_tile=work_tile,
        num_work=len(work_seq),
        num_tokens=t,
        fresh=True,
    )
    qkv = torch.randn(t, (num_heads + 2 * KV_HEADS) * HEAD_DIM).half()
    rot = RotaryEmbedding(HEAD_DIM, 10000.0, {})
    cos, sin = rot.cos_sin(torch.cat([torch.arange(n) for n in query_lens]), torch.float16)
    assert triton_prefill.fresh_rotary_supported(cos, sin)
    backend = tp.TritonPagedAttention(num_heads, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    kv0 = make_cache(torch.float16)[0]
    results = []
    for in_kernel in (False, True):
        x, kv = qkv.clone(), kv0.clone()
        q, k, v = split_qkv(x, num_heads)
        if in_kernel:
            out = backend.forward(q, k, v, kv[:, 1], meta, rotary=(cos, sin))
        else:  # the reference: the rotary kernel, then the fresh kernel on rotated queries
            tp.rotary_write_kv(q, k, v, cos, sin, kv[:, 1], slots)
            out = torch.full((t, num_heads, HEAD_DIM), float("nan"), dtype=torch.float16)
            triton_prefill.fresh_prefill_attention(
                q, k, v, meta.query_start, meta.work_seq, meta.work_tile, meta.num_work,
                HEAD_DIM**-0.5 * tp.LOG2E, tp.PREFILL_BLOCK_M, out,
            )  # fmt: skip
        results.append((x, kv, out))
    (x_ref, kv_ref, out_ref), (x_new, kv_new, out_new) = results
    q_cols = num_heads * HEAD_DIM
    assert torch.equal(x_new[:, :q_cols], qkv[:, :q_cols])  # q left unrotated
    assert not torch.equal(x_ref[:, :q_cols], qkv[:, :q_cols])  # the reference rotated it
    assert torch.equal(x_new[:, q_cols:], x_ref[:, q_cols:]) and torch.equal(kv_new, kv_ref)
    assert not out_new.isnan().any() and torch.equal(out_new, out_ref)


def test_half_precision_decode_close_to_reference():
    # float16: the interpreter emulates bfloat16 dots incorrectly; bf16 is checked on the GPU
    _, layer = make_cache(torch.float16)
    context_lens = [29, 64]
    tables = scrambled_tables(context_lens, seed=2)
    q = torch.randn(2, 4, HEAD_DIM).to(torch.float16)
    out = tp.decode_attention(q, layer, padded_tables(tables), torch.tensor(context_lens), HEAD_DIM**-0.5, 2)
    for i, ctx in enumerate(context_lens):
        ref = ref_attention(q[i : i + 1], layer, tables[i], ctx, [ctx - 1], HEAD_DIM**-0.5)
        assert rel_err(out[i : i + 1], ref) < 2e-2


# --- whole steps through the CUDA step path (GpuRunner), on the CPU --------------------------------
TINY_LLAMA = {  # the tiny Llama of the CUDA-path tests (test_triton_spec_decode too)
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 96,
    "max_position_embeddings": 256,
}


def _tiny_runner(gpu: bool = False, **engine_args):
    """A tiny Llama with dummy weights: ``CpuRunner``, or with ``gpu`` the CUDA runner on CPU tensors."""
    from pdinfer.config import EngineArgs
    from pdinfer.models.spec import ModelSpec
    from pdinfer.worker.cpu_runner import CpuRunner
    from pdinfer.worker.gpu_runner import GpuRunner

    spec = ModelSpec.from_hf_config(TINY_LLAMA)
    runner_class = GpuRunner if gpu else CpuRunner
    options = EngineArgs(**engine_args).runner_options
    return runner_class(spec, "", "dummy", torch.float32, torch.device("cpu"), options, seed=3)


@pytest.mark.parametrize("method, writes_first", [(None, False), ("ngram", True)])
def test_an_engine_that_verifies_drafts_writes_kv_before_decode_attention(method, writes_first):
    """The CUDA runner of an engine that speculates keeps the KV write apart from the decode
    attention (see the verifying-step test above); one that does not, fuses them."""
    runner = _tiny_runner(gpu=True, speculative_method=method)
    backends = [
        m.backend for m in runner.model.modules() if isinstance(getattr(m, "backend", None), tp.TritonPagedAttention)
    ]
    assert backends and all(b.decode_writes_kv is not writes_first for b in backends)


def test_gpu_step_path_matches_cpu_runner():
    from pdinfer.worker.step_input import SampleSpec, StepInput

    cpu, gpu = _tiny_runner(), _tiny_runner(gpu=True)
    for r in (cpu, gpu):
        r.init_cache(num_blocks=32, block_size=4)

    def sample(row, position, temperature=0.0, seed=0):
        return SampleSpec(
            row=row,
            temperature=temperature,
            top_k=5 if temperature else 0,
            top_p=0.9 if temperature else 1.0,
            min_p=0.0,
            seed=seed,
            position=position,
        )

    tables = [[7, 2, 9], [11, 4, 30, 1, 5, 6], [8, 3, 12]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 17, 9)]
    # step 0: prefill, the third sequence only its first 6 tokens (a chunk)
    lens = [5, 17, 6]
    prefill = StepInput(
        step_id=0,
        is_prompt=True,
        input_ids=[t for p, n in zip(prompts, lens) for t in p[:n]],
        positions=[i for n in lens for i in range(n)],
        query_lens=lens,
        context_lens=lens,
        block_tables=tables,
        samples=[sample(4, 5), sample(21, 17, temperature=0.8, seed=11)],
        # prompt log-probs of the first sequence and of the chunk (rows 22.. are the third's)
        prompt_rows=[0, 1, 2, 3, 22, 23, 24, 25, 26, 27],
        prompt_targets=prompts[0][1:5] + prompts[2][1:7],
        prompt_top_k=3,
    )
    # step 1: the rest of the third prompt, attending to its cached chunk
    chunk = StepInput(
        step_id=1,
        is_prompt=True,
        input_ids=prompts[2][6:],
        positions=[6, 7, 8],
        query_lens=[3],
        context_lens=[9],
        block_tables=[tables[2]],
        samples=[sample(2, 9)],
        prompt_rows=[0, 1],
        prompt_targets=prompts[2][7:9],
    )
    # step 2: decode all three; two tokens are still pending (sampled by step 0 and step 1)
    decode = StepInput(
        step_id=2,
        is_prompt=False,
        input_ids=[-1, 42, -1],
        positions=[5, 17, 9],
        query_lens=[1, 1, 1],
        context_lens=[6, 18, 10],
        block_tables=tables,
        samples=[sample(0, 6), sample(1, 18), sample(2, 10, temperature=1.0, seed=5)],
        pending=[(0, 0, 0), (2, 1, 0)],
    )
    # step 3: two fresh prompts without prompt log-probs: the GPU runner's last layer runs on
    # the sampled rows only (``GpuRunner._keep_rows``); their log-probs say which row is whose
    more = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 4)]
    fresh = StepInput(
        step_id=3,
        is_prompt=True,
        input_ids=more[0] + more[1],
        positions=list(range(7)) + list(range(4)),
        query_lens=[7, 4],
        context_lens=[7, 4],
        block_tables=[[13, 14], [15]],
        samples=[sample(6, 7), sample(10, 4)],
    )
    for spec in fresh.samples:
        spec.logprobs = 2
    for inp in (prefill, chunk, decode, fresh):
        ref = cpu.execute(inp)
        out = gpu.execute(inp).wait()
        assert out.token_ids == ref.token_ids, inp.step_id
        if ref.logprobs is not None:
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            assert out.top_ids == ref.top_ids
        assert out.prompt_ranks == ref.prompt_ranks and out.prompt_top_ids == ref.prompt_top_ids
        if inp.prompt_rows:
            assert len(out.prompt_logprobs) == len(inp.prompt_rows)
            assert out.prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=1e-4)
    assert rel_err(gpu.cache.kv, cpu.cache.kv) < 1e-5  # every K/V slot written in the same place
