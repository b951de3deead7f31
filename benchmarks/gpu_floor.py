"""Issue 29's floor targets in one device call: each GPU-path change on and off in one process.

    python benchmarks/gpu_floor.py [--skip micro,tokens]

On the Llama-3.1-8B shape (dummy bf16 weights) it measures, for every variant, the decode step
of batch 64 and 256 (CUDA graph replay, and the engine's tok/s) against the byte floor, and a
4 x 2048 and 1 x 8191 prefill against the matmul rate. The variants switch off, one at a time
and then all together (the code before them):
- ``rotary+kv``: the rotary embedding fused into the KV write (``rotary_write_kv``);
- ``fresh``: fresh prompts' prefill attention through tensor descriptors (``triton_prefill``);
- ``decode-kv``: at decode, the rotary embedding and the KV write inside the attention kernel
  (``decode_attention(rotary=...)``; off: ``rotary_write_kv`` then the attention);
- ``silu-gemm``: the gate/up GEMM with SiLU-and-mul in its epilogue (``layers/triton_gate_up.py``;
  off: cuBLAS then ``silu_and_mul``; ``--silu-configs`` takes its launch settings from
  ``gpu_gemm_silu.py --best``);
- ``silu-mid``: that GEMM from 65 to 1,024 rows (``triton_gate_up.MID_M``; off: the pair there);
- ``bf16-logits``: the logits left in the model's dtype for a greedy step's argmax
  (``final_logits``; off: upcast to float32 inside the step, as before);
- ``triton-linear``: qkv_proj and o_proj of 41-64-row steps and the logits projection of
  17-64-row steps on the persistent Triton GEMM (``layers/triton_linear.py``; off: cuBLASLt);
- ``q-rotary``: a fresh prompts' step rotating its queries in the prefill attention kernel
  (``TritonPagedAttention.fresh_rotates_q``; off: ``rotary_write_kv`` rotates them in place).
Greedy tokens of every variant are compared with the first. ``micro`` times the prefill
attention kernels alone, with launch settings around the chosen ones.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_correctness import random_prompts  # noqa: E402
from benchmarks.gpu_micro import FIG, ROWS, device_clocks, graph_timed, llama_8b, log  # noqa: E402
from benchmarks.gpu_speed import (  # noqa: E402
    bench_decode,
    bench_prefill,
    ceilings,
    decode_floor,
    decode_roofline_ms,
    graph_step_ms,
    prefill_flops,
)
from pdinfer import LLM, SamplingParams  # noqa: E402
from pdinfer.engine.speculative import decode_graph_rows  # noqa: E402
from pdinfer.layers import triton_gate_up, triton_linear  # noqa: E402
from pdinfer.layers.attention import triton_paged as tp  # noqa: E402
from pdinfer.layers.attention import triton_prefill  # noqa: E402
from pdinfer.models.llama import LlamaForCausalLM  # noqa: E402


@contextlib.contextmanager
def variant(off: set[str]):
    """The named changes switched off for the block (module switches; graphs recaptured)."""
    backend = tp.TritonPagedAttention
    saved = (backend.fuses_rotary, backend.decode_writes_kv, tp.fresh_prefill_supported, triton_gate_up.ENABLED)
    rotates_q = backend.fresh_rotates_q
    backend.fresh_rotates_q = "q-rotary" not in off
    linear_enabled = triton_linear.ENABLED
    triton_linear.ENABLED = "triton-linear" not in off
    config_for = triton_gate_up.config_for
    compute_logits = LlamaForCausalLM.compute_logits
    if "bf16-logits" in off:
        LlamaForCausalLM.compute_logits = lambda self, hidden: compute_logits(self, hidden).float()  # type: ignore[method-assign]
    if "silu-mid" in off:  # the pair from 65 to 1,024 rows (where MID_M runs)
        triton_gate_up.config_for = lambda rows: (
            None if triton_gate_up.SMALL_M_ROWS < rows <= triton_gate_up.MID_M_ROWS else config_for(rows)
        )
    backend.fuses_rotary = "rotary+kv" not in off
    backend.decode_writes_kv = "decode-kv" not in off
    triton_gate_up.ENABLED = "silu-gemm" not in off
    if "fresh" in off:
        tp.fresh_prefill_supported = lambda q, k, v: False
    try:
        yield
    finally:
        backend.fuses_rotary, backend.decode_writes_kv, tp.fresh_prefill_supported, triton_gate_up.ENABLED = saved
        triton_gate_up.config_for = config_for
        LlamaForCausalLM.compute_logits = compute_logits  # type: ignore[method-assign]
        triton_linear.ENABLED = linear_enabled
        backend.fresh_rotates_q = rotates_q


def compiled_kernels() -> dict[str, int]:
    """How many compiled variants each attention kernel has (``GpuRunner._compile_prefix_prefill``
    compiles the paged prefill one at start-up: it must not be 0 after the engine is built)."""
    from pdinfer.layers.attention import triton_kernels

    fns = {
        "paged prefill": triton_kernels.prefill_kernel,
        "fresh prefill": triton_prefill.fresh_prefill_kernel,
        "decode": triton_kernels.decode_kernel,
    }
    return {name: sum(len(cache[0]) for cache in fn.device_caches.values()) for name, fn in fns.items()}


def recapture(llm: LLM) -> None:
    runner = llm.engine.model_runner
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_cuda_graphs(decode_graph_rows(llm.engine.args), llm.engine.scheduler_config.max_model_len)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    prompts = random_prompts([300, 700, 1500, 64], llm.engine.spec.vocab_size, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def measure(llm: LLM, name: str, reference_tokens) -> list[list[int]]:
    res = {}
    for b in (64, 256):
        with device_clocks(f"{name} decode {b}"):
            d = bench_decode(llm, b)
        g = graph_step_ms(llm, b)
        floor, roofline = decode_floor(llm, b), decode_roofline_ms(llm, b)
        res[f"decode_{b}"] = {"tok_s": d["tok_s"], "graph_ms": g, "floor_tok_s": floor, "roofline_ms": roofline}
        log(
            f"  [{name}] decode {b}: {d['tok_s']:.0f} tok/s ({d['tok_s'] / floor:.1%} of floor), "
            f"graph {g:.3f} ms ({1e3 * b / floor / g:.1%}; kernel rooflines {roofline:.2f} ms, {roofline / g:.1%})"
        )
    for n, length in ((4, 2048), (1, 8191)):
        with device_clocks(f"{name} prefill {n}x{length}"):
            tok_s = bench_prefill(llm, n, length, seed=1000 * len(FIG) + length)  # fresh prompts per variant
        rate = prefill_flops(llm, n, length) * tok_s / (n * length)
        sustained = rate / FIG["matmul_rate_sustained"]
        res[f"prefill_{n}x{length}"] = {"tok_s": tok_s, "frac": rate / FIG["matmul_rate"], "frac_sustained": sustained}
        log(
            f"  [{name}] prefill {n}x{length}: {tok_s:.0f} tok/s, {rate / FIG['matmul_rate']:.1%} of matmul "
            f"({sustained:.1%} of the sustained rate)"
        )
    tokens = greedy_tokens(llm)
    same = sum(a == b for a, b in zip(tokens, reference_tokens or tokens))
    res["greedy_same"] = same
    log(f"  [{name}] greedy sequences equal to the first variant's: {same}/{len(tokens)}")
    FIG[name] = res
    ROWS.append((name, *(f"{res[k]['graph_ms']:.3f}" for k in ("decode_64", "decode_256")), ""))
    return tokens


def micro_decode_kv(llm: LLM) -> None:
    """The decode attention that rotates q and writes the new K/V itself, against
    ``rotary_write_kv`` then the attention, each timed alone from a CUDA graph: the rotated K in
    the cache against HF's bf16 rotary in torch (the interpreter's tests cannot check bf16), and
    whether the two outputs are equal bit for bit (they may differ in rounding: the one launch is
    compiled without FMA contraction, ``triton_ops.ROUNDED_PRODUCTS``)."""
    from pdinfer.layers.rotary import RotaryEmbedding

    runner = llm.engine.model_runner
    spec = runner.spec
    h, kvh, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    bs = runner.require_cache().block_size
    g = torch.Generator(device="cuda").manual_seed(5)
    for b in (1, 64, 256):
        ctx = torch.randint(256, 1025, (b,), device="cuda", generator=g)  # mean about 640
        per_seq = -(-1024 // bs)
        tables = torch.randperm(b * per_seq, device="cuda", generator=g).view(b, per_seq)
        pos = ctx - 1
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        cos, sin = (x.cuda() for x in RotaryEmbedding(dim, 500000.0, {}).cos_sin(pos.cpu(), runner.dtype))
        qkv0 = torch.randn(b, (h + 2 * kvh) * dim, device="cuda", dtype=runner.dtype, generator=g)
        splits = tp.decode_num_splits(b, kvh, None)
        for kv_dtype in (runner.dtype, torch.float8_e4m3fn):
            # one layer of the engine's cache layout [blocks, layers, 2, block_size, kv_heads, dim]
            shape = (b * per_seq, 1, 2, bs, kvh, dim)
            kv0 = torch.randn(shape, device="cuda", dtype=runner.dtype, generator=g).to(kv_dtype)
            results = []
            for fused in (False, True):
                qkv, kv = qkv0.clone(), kv0.clone()
                layer = kv[:, 0]
                q = qkv[:, : h * dim].view(b, h, dim)
                k = qkv[:, h * dim : (h + kvh) * dim].view(b, kvh, dim)
                v = qkv[:, (h + kvh) * dim :].view(b, kvh, dim)
                args = (layer, tables, ctx, dim**-0.5, splits)

                def run(fused=fused, q=q, k=k, v=v, layer=layer, args=args, rot=(cos, sin, slots)):
                    if fused:
                        return tp.decode_attention(q, *args, rotary=tp.DecodeRotary(k, v, *rot))
                    tp.rotary_write_kv(q, k, v, rot[0], rot[1], layer, rot[2])
                    return tp.decode_attention(q, *args)

                out = run()
                results.append((out.clone(), kv.view(torch.uint8).clone()))
                torch.cuda.synchronize()  # the timing replays on its own stream, and the pair rotates in place
                sec = graph_timed(run)  # the pair's replays rotate q and k again: other values, same work
                FIG[f"decode_kv_{b}_{kv_dtype}_{fused}"] = sec
                log(
                    f"  decode attention b={b} {str(kv_dtype).split('.')[-1]} splits {splits} "
                    f"{'one launch' if fused else 'rotary_write_kv + attention'}: {sec * 1e6:.1f} us"
                )
            (out_a, kv_a), (out_b, kv_b) = results
            same = torch.equal(out_a, out_b) and torch.equal(kv_a, kv_b)
            log(f"  decode attention b={b} {str(kv_dtype).split('.')[-1]}: fused equal to the pair bit for bit: {same}")
            FIG[f"decode_kv_{b}_{kv_dtype}_equal"] = same
            if kv_dtype == runner.dtype:  # the rotated K in the cache against HF's bf16 rotary in torch
                k_in = qkv0[:, h * dim : (h + kvh) * dim].view(b, kvh, dim)
                half = dim // 2
                ref = k_in * cos[:, None] + torch.cat((-k_in[..., half:], k_in[..., :half]), -1) * sin[:, None]
                for label, kv_out in (("rotary_write_kv", kv_a), ("one launch", kv_b)):
                    cached = kv_out.view(runner.dtype)[slots // bs, 0, 0, slots % bs]
                    wrong = (cached != ref).sum().item()
                    log(f"  decode b={b} {label}: rotated K elements unlike torch's: {wrong} of {ref.numel()}")
                    FIG[f"decode_kv_{b}_{label}_rotary_wrong"] = wrong
            torch.cuda.empty_cache()


def micro_prefill(llm: LLM) -> None:
    for n, length in ((4, 2048), (1, 8191)):
        micro_shape(llm, n, length)
        torch.cuda.empty_cache()


def fresh_attention(q, k, v, meta, scale, out, rotary=None):
    """The fresh prefill kernel over ``meta``'s tiles (``rotary``: the queries still to rotate)."""
    triton_prefill.fresh_prefill_attention(
        q,
        k,
        v,
        meta.query_start,
        meta.work_seq,
        meta.work_tile,
        meta.num_work,
        scale * tp.LOG2E,
        tp.PREFILL_BLOCK_M,
        out,
        rotary,
    )


def micro_shape(llm: LLM, n: int, length: int) -> None:
    import numpy as np

    from pdinfer.worker.cache_engine import CacheEngine

    runner = llm.engine.model_runner
    spec = runner.spec
    h, kvh, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    bs = runner.require_cache().block_size
    t = n * length
    qkv = torch.randn(t, (h + 2 * kvh) * dim, device="cuda", dtype=runner.dtype)
    q = qkv[:, : h * dim].view(t, h, dim)
    k = qkv[:, h * dim : (h + kvh) * dim].view(t, kvh, dim)
    v = qkv[:, (h + kvh) * dim :].view(t, kvh, dim)
    nb = -(-length // bs)
    cache = CacheEngine(spec, n * nb + 1, bs, runner.dtype, runner.device)
    layer = cache.kv[:, 0]
    slots = (torch.arange(n, device="cuda")[:, None] * nb * bs + torch.arange(length, device="cuda")).reshape(-1)
    tp.write_kv(k, v, layer, slots)
    tiles = -(-length // tp.PREFILL_BLOCK_M)
    ws = np.repeat(np.arange(n), tiles)
    wt = np.tile(np.arange(tiles), n)
    order = np.argsort(-wt, kind="stable")
    meta = tp.GpuAttentionMetadata(
        False,
        slots,
        torch.arange(n * nb, device="cuda").view(n, nb),
        torch.full((n,), length, device="cuda"),
        query_start=torch.arange(0, t + 1, length, device="cuda"),
        work_seq=torch.tensor(ws[order], device="cuda"),
        work_tile=torch.tensor(wt[order], device="cuda"),
        num_work=int(ws.size),
    )
    flops = 4 * h * dim * n * length**2 / 2
    scale = dim**-0.5
    ref = tp.prefill_attention(q, layer, meta, scale)
    sec = graph_timed(lambda: tp.prefill_attention(q, layer, meta, scale))
    log(f"  prefill attn {n}x{length} paged: {sec * 1e6:.0f} us, {flops / sec / 1e12:.0f} TFLOP/s")
    FIG[f"attn_paged_{n}x{length}"] = sec
    out = torch.empty_like(q)
    saved = dict(triton_prefill.FRESH_CONFIG)
    for cfg in (
        {},
        {"num_stages": 2},
        {"num_stages": 4},
        {"block_n": 64, "num_stages": 3},
        {"block_n": 64, "num_stages": 4},
        {"num_warps": 4, "block_n": 64, "num_stages": 3},
    ):
        triton_prefill.FRESH_CONFIG.update(cfg)

        def run(out=out, meta=meta, q=q, k=k, v=v):
            fresh_attention(q, k, v, meta, scale, out)

        try:
            run()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            sec = graph_timed(run)
            log(
                f"  prefill attn {n}x{length} fresh {triton_prefill.FRESH_CONFIG}: {sec * 1e6:.0f} us, "
                f"{flops / sec / 1e12:.0f} TFLOP/s, rel err vs paged {err:.1e}"
            )
            FIG[f"attn_fresh_{n}x{length}_{cfg}"] = (sec, err)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is a result too
            log(f"  prefill attn {n}x{length} fresh {cfg}: FAIL {type(e).__name__}: {str(e)[:160]}")
        triton_prefill.FRESH_CONFIG.clear()
        triton_prefill.FRESH_CONFIG.update(saved)
    # the rotary + KV write pass and the fresh kernel: queries rotated in place by the first
    # (``fresh_rotates_q`` off) or in the second, as they are loaded
    cos, sin = runner.model.rotary.cos_sin(torch.arange(length, device="cuda").repeat(n), runner.dtype)
    for in_kernel in (False, True):

        def pair(in_kernel=in_kernel, out=out, meta=meta, q=q, k=k, v=v):
            tp.rotary_write_kv(q, k, v, cos, sin, layer, slots, rotate_q=not in_kernel)
            fresh_attention(q, k, v, meta, scale, out, (cos, sin) if in_kernel else None)

        try:
            sec = graph_timed(pair)
            where = "in the attention kernel" if in_kernel else "in place by rotary_write_kv"
            log(f"  rotary_write_kv + fresh attn {n}x{length}, queries rotated {where}: {sec * 1e6:.0f} us")
            FIG[f"rotary_attn_{n}x{length}_{'kernel' if in_kernel else 'in_place'}"] = sec
        except Exception as e:  # noqa: BLE001
            log(
                f"  rotary_write_kv + fresh attn {n}x{length} (in kernel {in_kernel}): FAIL {type(e).__name__}: {str(e)[:160]}"
            )
    qs = q.view(n, length, h, dim).transpose(1, 2)
    ks = k.view(n, length, kvh, dim).transpose(1, 2).repeat_interleave(h // kvh, 1)
    vs = v.view(n, length, kvh, dim).transpose(1, 2).repeat_interleave(h // kvh, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
                fn()
                sec = graph_timed(fn)
            log(
                f"  prefill attn {n}x{length} torch {backend.name}: {sec * 1e6:.0f} us, {flops / sec / 1e12:.0f} TFLOP/s"
            )
        except Exception as e:  # noqa: BLE001
            log(f"  prefill attn {n}x{length} torch {backend.name}: FAIL {type(e).__name__}: {str(e)[:120]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip", default="")
    parser.add_argument("--variants", default="new,-decode-kv,new,-decode-kv")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument(
        "--tunable",
        action="store_true",
        help="PyTorch's TunableOp times the BLAS algorithms of every GEMM shape the engine meets while "
        "it starts (the KV profile's prefill, the graph captures) and keeps the fastest",
    )
    parser.add_argument(
        "--silu-configs",
        help="JSON of gpu_gemm_silu.py --best: launch settings of the gate/up GEMM with SiLU for large, mid and small row counts",
    )
    args = parser.parse_args()
    if args.silu_configs and Path(args.silu_configs).exists():
        best = json.loads(Path(args.silu_configs).read_text())
        triton_gate_up.LARGE_M.update(best.get("large", {}))
        triton_gate_up.SMALL_M.update(best.get("small", {}))
        triton_gate_up.MID_M.update(best.get("mid", {}))
    skip = set(filter(None, args.skip.split(",")))
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    import triton

    log(f"triton {triton.__version__}")
    ceilings()
    log(
        f"  copy {FIG['copy_bw'] / 1e12:.2f} TB/s, matmul {FIG['matmul_rate'] / 1e12:.0f} TFLOP/s "
        f"(sustained {FIG['matmul_rate_sustained'] / 1e12:.0f})"
    )
    if args.tunable:
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
    start = time.perf_counter()
    llm = llama_8b(args.gpu_memory_utilization)
    log(f"engine built in {time.perf_counter() - start:.1f} s (tunable: {args.tunable})")
    log(f"attention kernels compiled at start-up: {compiled_kernels()}")
    if args.tunable:
        bench_prefill(llm, 4, 2048, rounds=1)  # tunes the prefill steps' shapes too
        bench_prefill(llm, 1, 8191, rounds=1)
        torch.cuda.tunable.tuning_enable(False)  # tuned shapes keep their choice; others the default
    if "decode-kv" not in skip:
        try:
            micro_decode_kv(llm)
        except Exception:  # noqa: BLE001 - the engine's variants still run; the failure is logged
            import traceback

            log(traceback.format_exc())
    if "micro" not in skip:
        micro_prefill(llm)
    names = {
        "new": set(),
        "recaptured": set(),  # "new" with its graphs captured again (after the engine has run)
        "-rotary+kv": {"rotary+kv"},
        "-fresh": {"fresh"},
        "-decode-kv": {"decode-kv"},
        "old": {"rotary+kv", "fresh", "decode-kv", "silu-gemm", "bf16-logits", "triton-linear", "q-rotary"},
        "-silu-gemm": {"silu-gemm"},  # the gate/up GEMM with SiLU-and-mul in its epilogue
        "-silu-mid": {"silu-mid"},  # that GEMM from 65 to 1,024 rows (the pair there)
        "-bf16-logits": {"bf16-logits"},  # float32 logits inside the step
        "-triton-linear": {"triton-linear"},  # cuBLASLt for qkv, o and the logits
        "-q-rotary": {"q-rotary"},  # fresh prompts' queries rotated in place by the KV write's kernel
    }
    reference = None
    labels = []  # a variant named again (to alternate) gets its turn's number
    for i, name in enumerate(args.variants.split(",")):
        label = name if name not in labels else f"{name}#{i}"
        labels.append(label)
        with variant(names[name]):
            if i > 0:  # the graphs of the previous variant
                recapture(llm)
            tokens = measure(llm, label, reference)
            reference = reference or tokens
    log("\nvariant | graph ms B=64 | graph ms B=256")
    for r in ROWS:
        log(" | ".join(r))
    for name in labels:
        f = FIG[name]
        log(
            f"{name:12s} decode64 {f['decode_64']['tok_s']:7.0f} tok/s ({f['decode_64']['tok_s'] / f['decode_64']['floor_tok_s']:.1%}) "
            f"decode256 {f['decode_256']['tok_s']:7.0f} ({f['decode_256']['tok_s'] / f['decode_256']['floor_tok_s']:.1%}) "
            f"prefill4x2048 {f['prefill_4x2048']['frac']:.1%} 1x8191 {f['prefill_1x8191']['frac']:.1%} "
            f"greedy {f['greedy_same']}/4"
        )


if __name__ == "__main__":
    main()
