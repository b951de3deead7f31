"""Prefill attention and decode GEMM variants on the GPU, each checked then timed in CUDA graphs.

Prefill attention of fresh prompts (no cached prefix), Llama-3.1-8B heads (32 query, 8 K/V,
head_dim 128), bf16, 4 x 2048 and 1 x 8191 tokens:
- ``triton``: the engine's paged kernel (``triton_paged.prefill_attention``), K/V read from the cache;
- ``fa2_varlen``: PyTorch's FlashAttention-2 varlen kernel (``aten._flash_attention_forward``)
  on the step's own [T, H, D] q and [T, Hkv, D] k/v, GQA native;
- ``sdpa_<backend>``: ``scaled_dot_product_attention`` on dense [B, H, L, D] tensors per backend.
Each output is compared with a float32 reference (relative L2) before it is timed.

Decode GEMMs of the 8B shape at M = 64 and 256: cuBLAS against cuBLASLt
(``torch.backends.cuda.preferred_blas_library``), bytes over time against the copy rate.

    python benchmarks/gpu_attention_variants.py      (writes attention_variants.json to $OUT)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_micro import graph_timed, log  # noqa: E402

from pdinfer.layers.attention import triton_paged as tp  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 16
OUT: dict[str, object] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def reference(q, k, v, lens):
    """float32 causal attention per sequence, GQA by repeating K/V heads."""
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start : start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(H // HKV, 0), vs.repeat_interleave(H // HKV, 0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


def prefill_variants(lens: list[int]) -> None:
    t = sum(lens)
    q, k, v = (torch.randn(t, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV))
    scale = D**-0.5
    flops = sum(4 * H * D * n * n / 2 for n in lens)
    ref = reference(q, k, v, lens)
    name = f"{len(lens)}x{lens[0]}"
    # the engine's kernel, over a paged cache holding the same K/V
    blocks = [-(-n // BS) for n in lens]
    cache = torch.zeros(sum(blocks), 2, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int64, device="cuda")
    slots, first = [], 0
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        table[i, :nb] = torch.arange(first, first + nb)
        slots += [(first + p // BS) * BS + p % BS for p in range(n)]
        first += nb
    slots_t = torch.tensor(slots, device="cuda")
    blk, off = slots_t // BS, slots_t % BS
    cache[blk, 0, off] = k
    cache[blk, 1, off] = v
    tiles = [-(-n // tp.PREFILL_BLOCK_M) for n in lens]
    ws = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(tiles)).cuda()
    wt = torch.cat([torch.arange(x) for x in tiles]).cuda()
    qstart = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda")
    meta = tp.GpuAttentionMetadata(
        False,
        slots_t,
        table,
        torch.tensor(lens, device="cuda"),
        query_start=qstart,
        work_seq=ws,
        work_tile=wt,
        num_work=int(ws.numel()),
    )
    # [blocks, 2, bs, hkv, d]: the layout of one layer's view of the engine's cache
    variants = {"triton": lambda: tp.prefill_attention(q, cache, meta, scale)}
    cu = qstart.to(torch.int32)
    mx = max(lens)

    def fa2():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=scale)[0]

    variants["fa2_varlen"] = fa2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    starts = qstart.tolist()

    def cudnn_per_seq():
        out = torch.empty_like(q)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for s, e in zip(starts, starts[1:]):
                qs, ks, vs = (x[s:e].unsqueeze(0).transpose(1, 2) for x in (q, k, v))
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                out[s:e] = o[0].transpose(0, 1)
        return out

    variants["cudnn_per_seq"] = cudnn_per_seq
    if len(set(lens)) == 1:
        b, n = len(lens), lens[0]
        qd, kd, vd = (x.view(b, n, -1, D).transpose(1, 2) for x in (q, k, v))
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):

            def sdpa(backend=getattr(SDPBackend, backend)):
                with sdpa_kernel(backend):
                    o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
                return o.transpose(1, 2).reshape(t, H, D)

            variants[f"sdpa_{backend.lower()}"] = sdpa
    for vname, fn in variants.items():
        try:
            err = rel(fn(), ref)
            seconds = graph_timed(fn)
        except Exception as exc:  # a backend this build lacks
            log(f"  {name} {vname}: failed: {type(exc).__name__}: {str(exc)[:160]}")
            OUT[f"prefill_{name}_{vname}"] = {"error": str(exc)[:300]}
            continue
        OUT[f"prefill_{name}_{vname}"] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "rel_err": err}
        log(f"  {name} {vname}: {seconds * 1e3:.3f} ms, {flops / seconds / 1e12:.0f} TFLOP/s, rel err {err:.1e}")


def cudnn_plan_cost() -> None:
    """Host seconds of cuDNN attention's first call at a new sequence length (its plan is built
    and cached per shape) against a repeated call: what a prefill of an unseen length pays."""
    import time

    from torch.nn.attention import SDPBackend, sdpa_kernel

    firsts, repeats = [], []
    for i in range(8):
        n = 1000 + 37 * i
        q, k = (
            torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16),
        )
        for bucket in (firsts, repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
            bucket.append(time.perf_counter() - start)
    OUT["cudnn_first_call_ms"] = [x * 1e3 for x in firsts]
    OUT["cudnn_repeat_call_ms"] = [x * 1e3 for x in repeats]
    log(
        f"  cuDNN first call at a new length: {[round(x * 1e3, 1) for x in firsts]} ms; repeated: {[round(x * 1e3, 2) for x in repeats]} ms"
    )


def gemm_variants() -> None:
    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / graph_timed(lambda x=x, y=y: y.copy_(x))
    OUT["copy_tb_s"] = copy / 1e12
    log(f"  copy {copy / 1e12:.2f} TB/s")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in (64, 256):
            total_s, total_bytes = 0.0, 0
            for sname, (k, n) in shapes.items():
                ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = a.float() @ ws[0].float().t()
                err = rel(torch.nn.functional.linear(a, ws[0]), ref)
                # rotate weights (3 x more than L2) so each product reads its weight from HBM
                s = graph_timed(lambda a=a, ws=ws: [torch.nn.functional.linear(a, w) for w in ws]) / 3
                nbytes = 2 * (n * k + m * k + m * n)
                total_s += s
                total_bytes += nbytes
                OUT[f"gemm_{lib}_{m}_{sname}"] = {"us": s * 1e6, "of_copy": nbytes / s / copy, "rel_err": err}
                log(f"  {lib} M={m} {sname}: {s * 1e6:.1f} us, {nbytes / s / copy:.0%} of copy, err {err:.1e}")
            OUT[f"gemm_{lib}_{m}_layer"] = {"us": total_s * 1e6, "of_copy": total_bytes / total_s / copy}
            log(f"  {lib} M={m} a layer's GEMMs: {total_s * 1e6:.1f} us, {total_bytes / total_s / copy:.0%} of copy")
    torch.backends.cuda.preferred_blas_library("cublas")


def main() -> None:
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    from torch.nn import attention

    OUT["flash_impls"] = str(attention.list_flash_attention_impls())
    log(f"  flash attention implementations: {OUT['flash_impls']}")
    for lens in ([2048] * 4, [8191], [1500, 700, 3000, 2992]):
        prefill_variants(lens)
    cudnn_plan_cost()
    gemm_variants()
    out = Path(os.environ.get("OUT", "."))
    (out / "attention_variants.json").write_text(json.dumps(OUT, indent=1))


if __name__ == "__main__":
    main()
