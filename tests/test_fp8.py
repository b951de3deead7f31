"""FP8 (e4m3): the KV cache kernels, the quantizers and the FP8 linear, on the CPU (Triton's
interpreter), and the refusal where there is no FP8 hardware.

References are plain torch: attention over the dequantized cache in float64 (dequantizing is
exact: every e4m3 value times a power-of-two scale is a float32 value, so the kernels must
match it to float32 rounding), and against the unquantized K/V a bound from e4m3's precision.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_triton_kernels import (
    BLOCK_SIZE,
    HEAD_DIM,
    KV_HEADS,
    NUM_BLOCKS,
    NUM_LAYERS,
    padded_tables,
    ref_attention,
    rel_err,
    scrambled_tables,
)

from pdinfer import EngineArgs
from pdinfer.layers import fp8
from pdinfer.layers.attention import triton_paged as tp

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0  # not 1.0, so a scale the kernels drop or swap shows
# Attention over e4m3 K/V against the unrounded K/V: each element is rounded by at most 2^-4
# relatively (3 mantissa bits). V's rounding passes into the output at most that much; K's moves
# the scores, which a peaked softmax passes on at about as much again.
E4M3_BOUND = 2 * 2**-4


@pytest.fixture(autouse=True)
def hardware_fp8_rounding(monkeypatch):
    """Triton's interpreter rounds float -> e4m3 without carrying a rounded-up mantissa into
    the exponent (7.79 becomes 4.0, not 8.0). The GPU rounds to nearest even (cvt.rn.satfinite),
    as torch's cast does: the interpreter gets torch's cast for that conversion."""
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding):
        if dst.is_fp8() and not src.is_fp8() and src.primitive_bitwidth == 32:
            return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(FP8).view(torch.uint8).numpy()
        return original(data, src, dst, rounding)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def fp8_cache():
    """(e4m3 cache, one layer's view, the float64 values it stands for, those of the layer)."""
    raw = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM) * 3
    scales = torch.tensor([K_SCALE, V_SCALE]).view(1, 1, 2, 1, 1, 1)
    kv = (raw / scales).to(FP8)
    deq = kv.double() * scales.double()
    return kv, kv[:, 1], deq, deq[:, 1], raw[:, 1]


# --- the KV cache kernels -------------------------------------------------------------------
def test_write_kv_quantizes_with_the_layer_scales():
    kv = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.uint8).view(FP8)
    layer = kv[:, 1]
    k = torch.randn(3, KV_HEADS, HEAD_DIM) * 4
    v = torch.randn(3, KV_HEADS, HEAD_DIM) * 4
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 7.79, 1e-3])  # clamped, clamped, a carry, subnormal
    slots = torch.tensor([5 * BLOCK_SIZE + 2, -1, 17 * BLOCK_SIZE])
    tp.write_kv(k, v, layer, slots, K_SCALE, V_SCALE)

    def expected(x, scale):
        return (x / scale).clamp(-448, 448).to(FP8).view(torch.uint8)

    for row, (blk, off) in ((0, (5, 2)), (2, (17, 0))):
        assert torch.equal(layer[blk, 0, off].view(torch.uint8), expected(k[row], K_SCALE))
        assert torch.equal(layer[blk, 1, off].view(torch.uint8), expected(v[row], V_SCALE))
    assert layer[5, 0, 2, 0, :2].float().tolist() == [448.0, -448.0]
    written = kv.view(torch.uint8).count_nonzero().item()
    assert written == (layer[5, :, 2].view(torch.uint8) != 0).sum() + (layer[17, :, 0].view(torch.uint8) != 0).sum()


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("num_heads", [4, 2])  # GQA group 2, and MHA
def test_decode_reads_fp8(num_splits, num_heads):
    _, layer, _, deq, raw = fp8_cache()
    context_lens = [1, 13, 37, 0, 8]  # 0: a CUDA-graph padding row
    tables = scrambled_tables(context_lens)
    q = torch.randn(len(context_lens), num_heads, HEAD_DIM)
    out = tp.decode_attention(
        q, layer, padded_tables(tables), torch.tensor(context_lens), HEAD_DIM**-0.5, num_splits, None, K_SCALE, V_SCALE
    )
    for i, ctx in enumerate(context_lens):
        if ctx == 0:
            assert torch.all(out[i] == 0)
            continue
        ref = ref_attention(q[i : i + 1], deq, tables[i], ctx, [ctx - 1], HEAD_DIM**-0.5)
        assert rel_err(out[i : i + 1], ref) < 1e-5, (i, ctx)
        exact = ref_attention(q[i : i + 1], raw, tables[i], ctx, [ctx - 1], HEAD_DIM**-0.5)
        assert rel_err(out[i : i + 1], exact) < E4M3_BOUND, (i, ctx)


@pytest.mark.parametrize("num_heads", [4, 2])
def test_prefill_reads_fp8(num_heads):
    _, layer, _, deq, raw = fp8_cache()
    query_lens = [7, 150, 1, 20]
    context_lens = [7, 160, 30, 20]  # seqs 1 and 2 continue a cached prefix (chunked prefill)
    tables = scrambled_tables(context_lens, seed=1)
    qstart = [0]
    for n in query_lens:
        qstart.append(qstart[-1] + n)
    tiles = [-(-n // tp.PREFILL_BLOCK_M) for n in query_lens]
    work_seq = [s for s, n in enumerate(tiles) for _ in range(n)]
    meta = tp.GpuAttentionMetadata(
        False,
        torch.zeros(0, dtype=torch.int64),
        padded_tables(tables),
        torch.tensor(context_lens),
        query_start=torch.tensor(qstart),
        work_seq=torch.tensor(work_seq),
        work_tile=torch.tensor([t for n in tiles for t in range(n)]),
        num_work=len(work_seq),
    )
    q = torch.randn(qstart[-1], num_heads, HEAD_DIM)
    out = tp.prefill_attention(q, layer, meta, HEAD_DIM**-0.5, None, K_SCALE, V_SCALE)
    for s, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        rows = slice(qstart[s], qstart[s + 1])
        positions = list(range(ctx - qlen, ctx))
        assert rel_err(out[rows], ref_attention(q[rows], deq, tables[s], ctx, positions, HEAD_DIM**-0.5)) < 1e-5, s
        assert (
            rel_err(out[rows], ref_attention(q[rows], raw, tables[s], ctx, positions, HEAD_DIM**-0.5)) < E4M3_BOUND
        ), s


def test_fp8_cache_blocks_move_as_bytes_and_cost_half():
    from pdinfer.models.spec import ModelSpec
    from pdinfer.worker.cache_engine import CacheEngine, block_bytes

    spec = ModelSpec.from_hf_config(_TINY)
    cache = CacheEngine(spec, 8, 4, FP8, torch.device("cpu"))
    assert cache.kv.dtype == FP8 and cache.kv.view(torch.uint8).count_nonzero() == 0
    data = torch.randn(2, *cache.block_shape).to(FP8)
    cache.write_blocks([3, 6], data)
    cache.copy_blocks([(6, 1)])
    cache.clone_blocks(torch.tensor([3]), torch.tensor([0]))
    got = cache.read_blocks([0, 1, 3, 6])
    assert got.dtype == FP8
    expected = torch.stack([data[0], data[1], data[0], data[1]])
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert 2 * block_bytes(spec, 16, FP8) == block_bytes(spec, 16, torch.bfloat16)
    assert 2 * cache.bytes_per_block == CacheEngine(spec, 1, 4, torch.bfloat16, torch.device("cpu")).bytes_per_block


# --- weights and activations ------------------------------------------------------------------
def test_quantize_round_trip_within_e4m3_precision():
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]  # channels of very different size
    q, scale = fp8.quantize_per_row(w)
    assert q.dtype == FP8 and scale.shape == (48, 1)
    back = fp8.dequantize(q, scale)
    # each channel's largest value lands on 448 exactly, so it comes back exactly
    rows = torch.arange(48)
    top = w.abs().argmax(-1)
    assert torch.allclose(back[rows, top], w[rows, top], rtol=1e-6)
    # normal e4m3 numbers (>= 2^-6 of the scale's unit) keep 3 mantissa bits: error <= 2^-4
    # relative; below that the subnormal step is 2^-9 units, half of it the largest error
    units = w / scale
    normal = units.abs() >= 2**-6
    assert ((back - w).abs() <= 2**-4 * w.abs() + 1e-7)[normal].all()
    assert ((back - w).abs() <= 2**-10 * scale.expand_as(w) * (1 + 1e-6))[~normal].all()


def test_quantize_rows_kernel_matches_torch():
    x = torch.randn(5, 300) * torch.tensor([1e-2, 1.0, 30.0, 500.0, 0.0])[:, None]
    q, scale = fp8.quantize_rows(x)
    ref_q, ref_scale = fp8.quantize_per_row(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.all(q[4].float() == 0)  # an all-zero row: zeros, a finite scale


def test_fp8_linear_against_the_dequantized_and_the_original_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48, bias=True)
    layer = fp8.Fp8Linear.from_linear(linear)
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (1, 48)
    x = torch.randn(2, 3, 96)
    out = layer(x)
    assert out.shape == (2, 3, 48) and out.dtype == x.dtype
    xq, xs = fp8.quantize_per_row(x.reshape(-1, 96))
    w = fp8.dequantize(layer.weight, layer.weight_scale.reshape(-1, 1)).double()
    ref = fp8.dequantize(xq, xs).double() @ w.T + linear.bias.double()
    assert rel_err(out.reshape(-1, 48), ref) < 2**-8  # only the bf16 output's rounding
    # weights and activations each round by <= 2^-4 relatively, independently per element
    assert rel_err(out, linear(x).detach()) < 0.05


def test_quantize_linears_replaces_the_decoder_linears_only():
    from pdinfer.models.llama import LlamaForCausalLM
    from pdinfer.models.loader import init_dummy_weights
    from pdinfer.models.spec import ModelSpec

    spec = ModelSpec.from_hf_config({**_TINY, "tie_word_embeddings": False})
    model = LlamaForCausalLM(spec)
    init_dummy_weights(model.named_parameters(), spec.num_layers, 0)
    assert fp8.quantize_linears(model) == 4 * spec.num_layers
    assert isinstance(model.layers[0].self_attn.qkv_proj, fp8.Fp8Linear)
    assert isinstance(model.layers[1].mlp.down_proj, fp8.Fp8Linear)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.float32


# --- the options ------------------------------------------------------------------------------
_TINY = {
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


@pytest.mark.parametrize(
    "options",
    [{"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}, {"kv_cache_dtype": "fp8_e4m3", "quantization": "fp8"}],
)
def test_refused_on_cpu_at_construction(options):
    from pdinfer.models.spec import ModelSpec
    from pdinfer.worker.runner import make_runner

    args = EngineArgs(**options)
    spec = ModelSpec.from_hf_config(_TINY)
    with pytest.raises(ValueError, match="needs a CUDA GPU with FP8 support .* runs on cpu"):
        make_runner(spec, "", "dummy", torch.float32, torch.device("cpu"), args.runner_options)


def test_option_names():
    assert EngineArgs(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"  # vLLM's alias
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="int4")
    from pdinfer.cli import build_parser
    from pdinfer.cli_args import engine_args_from
    from pdinfer.serving.launch import engine_flags

    for command in (["serve"], ["generate", "hi"]):
        args = engine_args_from(
            build_parser().parse_args([*command, "--kv-cache-dtype", "fp8", "--quantization", "fp8"])
        )
        assert args.runner_options.kv_cache_dtype == "fp8" and args.runner_options.quantization == "fp8"
    launched = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1", "--kv-cache-dtype", "fp8"])
    assert engine_flags(launched)[-2:] == ["--kv-cache-dtype", "fp8"]


def test_engine_steps_over_an_fp8_cache():
    """Whole steps through the CUDA step path (``GpuRunner``, on CPU tensors) with an e4m3
    cache, against the CPU runner's float32 cache: the cache holds what the kernels wrote (e4m3's
    rounding of the float32 K/V, in the same slots) and the log-probs move little."""
    from test_triton_kernels import _tiny_runner

    from pdinfer.worker.step_input import SampleSpec, StepInput

    cpu, gpu = _tiny_runner(), _tiny_runner(gpu=True)
    gpu.kv_dtype = FP8  # what a CUDA runner with kv_cache_dtype="fp8" holds (refused on CPU tensors)
    for r in (cpu, gpu):
        r.init_cache(num_blocks=32, block_size=4)
    assert gpu.cache.kv.dtype == FP8
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 14)]
    tables = [[7, 2, 9], [11, 4, 30, 1]]

    def greedy(rows):
        return [SampleSpec(row=r, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0) for r in rows]

    prefill = StepInput(
        step_id=0,
        is_prompt=True,
        input_ids=prompts[0] + prompts[1],
        positions=list(range(9)) + list(range(14)),
        query_lens=[9, 14],
        context_lens=[9, 14],
        block_tables=tables,
        samples=greedy([8, 22]),
        prompt_rows=list(range(8)) + list(range(9, 22)),
        prompt_targets=prompts[0][1:] + prompts[1][1:],
    )
    decode = StepInput(
        step_id=1,
        is_prompt=False,
        input_ids=[5, 17],
        positions=[9, 14],
        query_lens=[1, 1],
        context_lens=[10, 15],
        block_tables=tables,
        samples=greedy([0, 1]),
        prompt_rows=[0, 1],
        prompt_targets=[3, 4],
    )
    for inp in (prefill, decode):
        ref = cpu.execute(inp)
        out = gpu.execute(inp).wait()
        # measured 5e-3 and 1e-3: the attention outputs move by e4m3's rounding (a few percent),
        # a small part of the residual stream of a random model
        assert out.prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=2e-2), inp.step_id
    slots = (cpu.cache.kv != 0).any(-1).any(-1)  # [blocks, layers, 2, block_size]
    assert torch.equal((gpu.cache.kv.view(torch.uint8) != 0).any(-1).any(-1), slots)  # the same, nothing else
    # layer 0's K/V come from the same embeddings and weights: e4m3's rounding of them (normal
    # numbers: <= 2^-4 relatively, beside float32 noise between the two paths)
    ref_kv, got = cpu.cache.kv[:, 0], gpu.cache.kv[:, 0].float()
    normal = ref_kv.abs() >= 2**-6
    assert ((got - ref_kv).abs() <= (2**-4 + 1e-4) * ref_kv.abs())[normal].all()
