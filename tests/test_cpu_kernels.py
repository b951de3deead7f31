"""The CPU attention paths and native kernels against plain torch references.

Prefill and decode attention over the paged KV cache (native kernels and the pure-torch
fallback) are compared with ``scaled_dot_product_attention`` over each sequence's contiguous K/V; the small GEMM and
the fused RMSNorm / rotary / SiLU-and-mul with the torch expressions they replace; the
block-quantized GEMMs with gguf's own quantizer and de-quantizer as the reference.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.nn.functional as F

from pdinfer.layers import cpu_kernels
from pdinfer.layers.attention.torch_paged import TorchPagedAttention
from pdinfer.layers.cpu_linear import (
    QUANT_TILED_MAX_ROWS,
    PackedLinear,
    QuantWeight,
)
from pdinfer.layers.rotary import RotaryEmbedding, apply_rotary
from pdinfer.worker.input_builder import build_attention_metadata
from pdinfer.worker.step_input import StepInput

LAYERS, BLOCK, KV_HEADS = 3, 4, 2


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    lib = cpu_kernels.load(str(tmp_path_factory.mktemp("kernels")))
    if lib is None:
        pytest.skip("no C++ compiler: the torch fallback is tested below")
    return lib


# The kernels' code paths: what -march=native picks here, and every narrower one this machine
# can run (the AVX2 code on an AVX-512 machine, the plain loops everywhere).
_NARROWER = {"avx2": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def kernel_paths(request, tmp_path_factory, kernels):
    if request.param == "native":
        return kernels
    if request.param == "avx2" and not {"avx512f", "avx2"} <= cpu_kernels.cpu_flags():
        return kernels  # native is the AVX2 (or the only) code here: nothing narrower to add
    lib = cpu_kernels.build(str(tmp_path_factory.mktemp("kernels")), _NARROWER[request.param])
    assert lib is not None, f"the {request.param} kernels did not compile"
    return lib


def _random_cache(head_dim: int, lengths: list[int], seed: int):
    """A random KV cache and shuffled block tables for sequences of ``lengths`` tokens, and the
    generator that made them (for the caller's next random tensors)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 3
    kv = torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, head_dim, generator=gen)
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    return kv, [[free.pop() for _ in range(-(-n // BLOCK))] for n in lengths], gen


def _decode_case(head_dim: int, group: int, lengths: list[int], seed: int = 0, dtype=torch.float32):
    """A random KV cache, shuffled block tables, queries, and the SDPA reference output (float32
    arithmetic on the values the cache holds, whatever its ``dtype``)."""
    kv, tables, gen = _random_cache(head_dim, lengths, seed)
    heads = KV_HEADS * group
    wide = torch.randn(len(lengths), heads + 4, head_dim, generator=gen)
    kv, wide = kv.to(dtype), wide.to(dtype)
    q = wide[:, :heads]  # strided rows, as a slice of a fused projection
    layer = 1
    ref = []
    for i, n in enumerate(lengths):
        blocks = kv[tables[i], layer].float()  # [nb, 2, BLOCK, KVH, D]
        k = blocks[:, 0].reshape(-1, KV_HEADS, head_dim)[:n].transpose(0, 1)[None]
        v = blocks[:, 1].reshape(-1, KV_HEADS, head_dim)[:n].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q[i].float()[None, :, None], k, v, enable_gqa=group > 1)
        ref.append(out.view(heads, head_dim))
    inp = StepInput(
        step_id=0,
        is_prompt=False,
        input_ids=[0] * len(lengths),
        positions=[n - 1 for n in lengths],
        query_lens=[1] * len(lengths),
        context_lens=list(lengths),
        block_tables=tables,
    )
    return kv, layer, q, inp, torch.stack(ref)


def _run_decode(kv, layer, q, inp, kernel):
    heads, head_dim = q.shape[1], q.shape[2]
    backend = TorchPagedAttention(heads, KV_HEADS, head_dim, head_dim**-0.5)
    meta = build_attention_metadata(inp, kv, kernel)
    k_new = kv.new_zeros(q.shape[0], KV_HEADS, head_dim)
    # The backend first writes the new tokens' K/V: write back what the cache holds there.
    for i, (n, table) in enumerate(zip(inp.context_lens, inp.block_tables)):
        k_new[i] = kv[table[(n - 1) // BLOCK], layer, 0, (n - 1) % BLOCK]
    v_new = torch.stack(
        [kv[t[(n - 1) // BLOCK], layer, 1, (n - 1) % BLOCK] for n, t in zip(inp.context_lens, inp.block_tables)]
    )
    return backend.forward(q, k_new, v_new, kv[:, layer], meta)


@pytest.mark.parametrize("head_dim,group", [(64, 3), (16, 2), (128, 1)])
# Many sequences: one work item per sequence; one or two: one per (sequence, KV head), and a
# long one split across threads.
@pytest.mark.parametrize("lengths", [[1, 5, 17, 64, 3, 40, 33], [9], [2000, 3]])
def test_native_decode_matches_sdpa(kernel_paths, head_dim, group, lengths):
    kv, layer, q, inp, ref = _decode_case(head_dim, group, lengths)
    out = _run_decode(kv, layer, q, inp, kernel_paths)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def num_threads(threads: int):
    """torch's (and the kernels' OpenMP) thread count inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 8])
@pytest.mark.parametrize("lengths", [[2000], [1100, 3]])
def test_native_decode_splits_long_contexts_into_chunks(kernel_paths, threads, lengths):
    """Fewer (sequence, KV head) items than two a thread: each long context is cut into chunks
    of whole blocks, each chunk's softmax alone, merged after; with 8 threads the 3-token
    sequence's later chunks are empty."""
    with num_threads(threads):
        kv, layer, q, inp, ref = _decode_case(64, 3, lengths, seed=2)
        out = _run_decode(kv, layer, q, inp, kernel_paths)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_decode_hands_out_every_item_whatever_the_thread_count(kernel_paths, threads):
    """Enough work for the parallel path (items handed out longest first, parallel.h): one
    thread (as each engine of `pdinfer launch` on two cores) runs every item too."""
    with num_threads(threads):
        kv, layer, q, inp, ref = _decode_case(64, 3, [300, 17, 250, 64, 400, 5, 129, 333], seed=3)
        out = _run_decode(kv, layer, q, inp, kernel_paths)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# A bfloat16 cache (a bfloat16 model's): the kernels widen its values to float32 exactly and do
# float32 arithmetic, so the output is the float32 reference's, rounded once to bfloat16.
BF16_ROUNDING = {"rtol": 2**-8, "atol": 1e-6}


@pytest.mark.parametrize("lengths", [[1, 5, 17, 64, 3, 40, 33], [9], [2000, 3]])
def test_native_decode_reads_a_bfloat16_cache(kernel_paths, lengths):
    kv, layer, q, inp, ref = _decode_case(64, 3, lengths, seed=3, dtype=torch.bfloat16)
    out = _run_decode(kv, layer, q, inp, kernel_paths)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, **BF16_ROUNDING)


@pytest.mark.parametrize("lengths", [[9], [1, 5, 17, 64, 3, 40, 33], [100, 2, 2, 2, 70]])
def test_torch_decode_fallback_matches_sdpa(lengths):
    kv, layer, q, inp, ref = _decode_case(64, 3, lengths, seed=1)
    out = _run_decode(kv, layer, q, inp, None)  # grouped, padded, masked torch path
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _prefill_case(
    head_dim: int, group: int, query_lens: list[int], context_lens: list[int], seed: int = 0, dtype=torch.float32
):
    """A prefill step: random cached prefixes (context - query tokens), new tokens' Q/K/V, and the
    SDPA reference (each query at its position, causal over prefix + new tokens; float32
    arithmetic on the ``dtype`` values)."""
    kv, tables, gen = _random_cache(head_dim, context_lens, seed)
    heads, tokens = KV_HEADS * group, sum(query_lens)
    wide = torch.randn(tokens, heads + 2 * KV_HEADS, head_dim, generator=gen)  # a fused QKV output
    kv, wide = kv.to(dtype), wide.to(dtype)
    q, k_new, v_new = wide.split([heads, KV_HEADS, KV_HEADS], dim=1)
    layer, start, ref = 2, 0, []
    for qlen, ctx, table in zip(query_lens, context_lens, tables):
        cached = kv[table, layer].float().transpose(0, 1).reshape(2, -1, KV_HEADS, head_dim)[:, : ctx - qlen]
        k = torch.cat([cached[0], k_new[start : start + qlen].float()]).transpose(0, 1)[None]
        v = torch.cat([cached[1], v_new[start : start + qlen].float()]).transpose(0, 1)[None]
        mask = torch.arange(ctx)[None] <= torch.arange(ctx - qlen, ctx)[:, None]
        out = F.scaled_dot_product_attention(
            q[start : start + qlen].float().transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=group > 1
        )
        ref.append(out[0].transpose(0, 1))
        start += qlen
    positions = [p for qlen, ctx in zip(query_lens, context_lens) for p in range(ctx - qlen, ctx)]
    inp = StepInput(
        step_id=0,
        is_prompt=True,
        input_ids=[0] * tokens,
        positions=positions,
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_tables=tables,
    )
    backend = TorchPagedAttention(heads, KV_HEADS, head_dim, head_dim**-0.5)
    return kv, layer, backend, (q, k_new, v_new), inp, torch.cat(ref)


# Prompts without a prefix; a prefix-cache hit (ending mid-block) and chunks of longer prompts
# beside a fresh one; a long prompt split across threads; a head_dim that is not a multiple of
# the register tile (80) and a group of 8 query heads per KV head.
_PREFILL_CASES = [
    (64, 3, [5, 33, 1, 70], [5, 33, 1, 70]),
    (64, 3, [7, 16, 40], [30, 80, 40]),
    (64, 3, [700], [700]),
    (80, 1, [19, 3], [19, 42]),
    (16, 8, [21], [45]),
]


@pytest.mark.parametrize("head_dim,group,query_lens,context_lens", _PREFILL_CASES)
def test_native_prefill_matches_sdpa(kernel_paths, head_dim, group, query_lens, context_lens):
    kv, layer, backend, (q, k, v), inp, ref = _prefill_case(head_dim, group, query_lens, context_lens)
    out = backend.forward(q, k, v, kv[:, layer], build_attention_metadata(inp, kv, kernel_paths))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim,group,query_lens,context_lens", _PREFILL_CASES[:3])
def test_native_prefill_reads_a_bfloat16_cache(kernel_paths, head_dim, group, query_lens, context_lens):
    kv, layer, backend, (q, k, v), inp, ref = _prefill_case(
        head_dim, group, query_lens, context_lens, seed=3, dtype=torch.bfloat16
    )
    out = backend.forward(q, k, v, kv[:, layer], build_attention_metadata(inp, kv, kernel_paths))
    assert out.dtype == torch.bfloat16
    # The new tokens' K/V went into the cache as they were (bfloat16 in, bfloat16 out).
    rows = [
        t[(p // BLOCK)]
        for t, (qlen, ctx) in zip(inp.block_tables, zip(query_lens, context_lens))
        for p in range(ctx - qlen, ctx)
    ]
    offsets = [p % BLOCK for qlen, ctx in zip(query_lens, context_lens) for p in range(ctx - qlen, ctx)]
    assert torch.equal(kv[rows, layer, 0, offsets], k) and torch.equal(kv[rows, layer, 1, offsets], v)
    torch.testing.assert_close(out.float(), ref, **BF16_ROUNDING)


@pytest.mark.parametrize("head_dim,group,query_lens,context_lens", _PREFILL_CASES[:2])
def test_torch_prefill_fallback_matches_sdpa(head_dim, group, query_lens, context_lens):
    kv, layer, backend, (q, k, v), inp, ref = _prefill_case(head_dim, group, query_lens, context_lens, seed=1)
    out = backend.forward(q, k, v, kv[:, layer], build_attention_metadata(inp, kv, None))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_small_gemm_matches_linear(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 7 * 64 + 5, generator=gen)[:, 5:]  # strided input rows
    weight, bias = torch.randn(8 * 9 + 3, 7 * 64, generator=gen), torch.randn(8 * 9 + 3, generator=gen)
    out = cpu_kernels.small_linear(kernels, x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        cpu_kernels.small_linear(kernels, x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-4
    )


def _gguf_blocks(gguf_type: str, rows: int, cols: int, seed: int):
    """Weights quantized by gguf (the reference implementation) and gguf's de-quantization."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[gguf_type]
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data[0, :32] += 3.0  # a block with no negative weights: Q4_1's minimum above zero
    raw = quantize(data, qtype)
    return torch.from_numpy(raw), torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols))


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_exactly_like_gguf(gguf_type):
    raw, reference = _gguf_blocks(gguf_type, 21, 96, seed=1)
    quant = QuantWeight.from_gguf(gguf_type, raw)
    assert torch.equal(quant.dequantize(), reference)
    assert quant.matches(reference)
    changed = reference.clone()
    changed[-1, 5] += 1e-3
    assert not quant.matches(changed)  # a row out of order or a wrong layout is refused


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0"])
# Both sides of the row-streaming/tiled crossover of every build (AVX-512 4/5, AVX2 8/9).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 23, *QUANT_TILED_MAX_ROWS.values()])
# One thread too: the tiled GEMM hands out its tiles (parallel.h), and each engine of `pdinfer
# launch` on two cores runs one thread.
@pytest.mark.parametrize("threads", [1, 2])
def test_quantized_gemm_matches_linear_on_dequantized_weights(kernel_paths, gguf_type, rows, threads):
    with num_threads(threads):
        _check_quantized_gemm(kernel_paths, gguf_type, rows)


def _check_quantized_gemm(kernels, gguf_type: str, rows: int) -> None:
    # 75 outputs: a partial last tile; 288 inputs: more than one slice of the tiled loop.
    raw, weight = _gguf_blocks(gguf_type, 8 * 9 + 3, 9 * 32, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 9 * 32 + 5, generator=gen)[:, 5:]  # strided input rows
    bias = torch.randn(weight.shape[0], generator=gen)
    quant = QuantWeight.from_gguf(gguf_type, raw)
    ref = F.linear(x.double(), weight.double(), bias.double()).float()
    torch.testing.assert_close(quant.linear(kernels, x, bias), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        quant.linear(kernels, x, None), F.linear(x.double(), weight.double()).float(), rtol=1e-5, atol=1e-4
    )
    # The packed layer takes the quantized paths up to max_rows rows (the tiled GEMM's limit
    # for the block kind), oneDNN above.
    assert quant.max_rows == QUANT_TILED_MAX_ROWS["q8" if gguf_type == "Q8_0" else "q4"]
    layer = PackedLinear(torch.nn.Parameter(weight), torch.nn.Parameter(bias), kernels, quant)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-4)
    more = torch.randn(quant.max_rows + 1, weight.shape[1], generator=gen)
    torch.testing.assert_close(layer(more), F.linear(more, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0"])
# The AMX GEMM's least rows, a partial 16-row tile, rows over the tiled GEMM's limit and over
# one of its 1,024-row pieces.
@pytest.mark.parametrize("rows", [32, 47, QUANT_TILED_MAX_ROWS["q4"] + 1, 1100])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_gemm_keeps_float32_accuracy(kernels, gguf_type, rows, threads):
    """The AMX GEMM multiplies bfloat16 tiles; with each input split in three bfloat16 parts its
    error against float64 must stay at float32's (below 2^-21 of the sum of |products|: the
    float32 GEMM here gives ~2e-7), and the packed layer must take it from its least rows."""
    if not cpu_kernels.amx_available(kernels):
        pytest.skip("this CPU (or build) has no AMX; the other quantized GEMMs are tested above")
    raw, weight = _gguf_blocks(gguf_type, 8 * 9 + 3, 9 * 32, seed=rows)  # a partial last tile
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 9 * 32 + 5, generator=gen)[:, 5:]  # strided input rows
    x[0] *= 1e4  # rows of very different scales: each value is split by its own exponent
    bias = torch.randn(weight.shape[0], generator=gen)
    quant = QuantWeight.from_gguf(gguf_type, raw)
    ref = F.linear(x.double(), weight.double(), bias.double())
    scale = x.double().abs() @ weight.double().abs().T + bias.double().abs()
    with num_threads(threads):
        out = quant.linear_amx(kernels, x, bias)
        layer = PackedLinear(torch.nn.Parameter(weight), torch.nn.Parameter(bias), kernels, quant, amx=True)
        assert layer.amx
        assert torch.equal(layer(x), out)
        fewer = x[: cpu_kernels.amx_min_rows(kernels) - 1]
        assert torch.equal(layer(fewer), quant.linear(kernels, fewer, bias))  # the tiled GEMM
    assert ((out.double() - ref).abs() / scale).max().item() < 2.0**-21


def test_fused_elementwise_ops_match_torch(kernels):
    ops = cpu_kernels.fused_ops()
    gen = torch.Generator().manual_seed(0)
    x, w = 3 * torch.randn(9, 96, generator=gen), torch.randn(96, generator=gen)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-5)

    g = 6 * torch.randn(9, 2 * 80, generator=gen)
    g[0, :4] = torch.tensor([100.0, -100.0, 0.0, -30.0])  # the tails of silu
    torch.testing.assert_close(ops.silu_and_mul(g), F.silu(g[:, :80]) * g[:, 80:], rtol=1e-5, atol=1e-5)

    for scaling in ({}, {"partial_rotary_factor": 0.5}):
        cos, sin = RotaryEmbedding(32, 10000.0, scaling).cos_sin(torch.arange(9) * 7, torch.float32)
        qkv = torch.randn(9, 7 * 32, generator=gen)
        ref = apply_rotary(qkv[:, : 6 * 32].view(9, 6, 32), cos, sin)
        q, k = qkv[:, : 4 * 32].view(9, 4, 32), qkv[:, 4 * 32 : 6 * 32].view(9, 2, 32)
        ops.rotary_qk_(q, k, cos, sin)
        torch.testing.assert_close(qkv[:, : 6 * 32].view(9, 6, 32), ref, rtol=1e-5, atol=1e-5)


def test_loading_the_kernels_leaves_the_process_floating_point_alone(kernels):
    """The library is compiled with fast math but must not switch on flush-to-zero for the
    process (g++ does that for a library linked with -ffast-math): a subnormal still survives
    arithmetic, in this thread and in a thread started after the load."""
    import threading

    tiny = torch.tensor(1e-45, dtype=torch.float32)  # the smallest float32 subnormal
    assert (tiny * 1.0).item() > 0
    seen: list[float] = []
    worker = threading.Thread(target=lambda: seen.append((tiny * 1.0).item()))
    worker.start()
    worker.join(timeout=30)
    assert seen and seen[0] > 0
