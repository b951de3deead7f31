"""Decode-sized GEMMs (M = 64 and 256 rows) of the 8B layer: cuBLASLt against a persistent Triton
GEMM over tensor descriptors, with and without split-K (one device call).

    python benchmarks/gpu_thin_gemm.py [--rows 64,256] [--shapes qkv,o,down,lm_head]

Before ``layers/triton_linear.py`` the decode graphs ran qkv, o_proj and down_proj on cuBLASLt at
72-84 % of the copy rate at 64 rows (docs/performance.md), while the gate/up GEMM with SiLU
(``layers/triton_gate_up.py``), a persistent TMA kernel with 64 x 64 tiles, reached 92 %. This
times that kernel (``triton_linear.matmul``) on the other shapes over launch settings, and a
split-K form of it (float32 partial sums in a workspace, then a reduction in a fixed order),
each as the median of CUDA-graph replays, and checks each result against cuBLASLt's. GB/s counts the weight bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_micro import (  # noqa: E402
    FIG,  # noqa: E402
    graph_timed,
    log,
)
from benchmarks.gpu_speed import ceilings  # noqa: E402
from pdinfer.layers import triton_linear  # noqa: E402
from pdinfer.layers.triton_gate_up import matrix_descriptor  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}


@triton.jit(do_not_specialize=["m"])
def split_k_kernel(
    x_desc,
    w_desc,
    part_ptr,
    m,
    n,
    k,
    split,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``triton_linear.linear_kernel`` with K cut into ``split`` parts: float32 partial sums
    [split, M, N] for ``reduce_kernel``."""
    num_m = tl.cdiv(m, BLOCK_M)
    k_steps = tl.cdiv(tl.cdiv(k, BLOCK_K), split)
    for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(n, BLOCK_N) * split, NUM_PROGRAMS):
        s = tile % split
        t = tile // split
        row = (t % num_m) * BLOCK_M
        col = (t // num_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = s * k_steps * BLOCK_K
        for k0 in range(k_lo, tl.minimum(k, k_lo + k_steps * BLOCK_K), BLOCK_K):
            acc = tl.dot(x_desc.load([row, k0]), w_desc.load([col, k0]).T, acc)
        r = row + tl.arange(0, BLOCK_M)
        c = col + tl.arange(0, BLOCK_N)
        tl.store(part_ptr + (s * m + r)[:, None].to(tl.int64) * n + c[None, :], acc, mask=(r < m)[:, None])


@triton.jit
def reduce_kernel(part_ptr, out_ptr, total, split, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.load(part_ptr + i, mask=mask, other=0.0)
    for s in range(1, split):
        acc += tl.load(part_ptr + s * total + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=mask)


def make_linear(x, w, cfg, num_sms):
    """The timed call: the engine's ``triton_linear.matmul`` unsplit, else ``split_k_kernel`` then
    ``reduce_kernel``."""
    split = cfg["split"]
    if split == 1:
        return lambda: triton_linear.matmul(x, w, num_sms, cfg)
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    x_desc, w_desc = matrix_descriptor(x, [bm, bk]), matrix_descriptor(w, [bn, bk])
    programs = min(num_sms, triton.cdiv(m, bm) * triton.cdiv(n, bn) * split)

    def run():
        split_k_kernel[(programs,)](
            x_desc,
            w_desc,
            part,
            m,
            n,
            k,
            split,
            NUM_PROGRAMS=programs,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        total = m * n
        reduce_kernel[(triton.cdiv(total, 2048),)](part, out, total, split, BLOCK=2048, num_warps=4)
        return out

    return run


def configs(rows: int, k: int):
    out = []
    for bm in (64,) if rows <= 64 else (64, 128):
        for bn, bk, stages in (
            (32, 128, 6),
            (32, 256, 4),
            (64, 128, 4),
            (64, 128, 6),
            (64, 256, 3),
            (128, 64, 6),
            (128, 128, 3),
        ):
            if (bm + bn) * bk * 2 * stages > 200 * 1024:
                continue
            for split in (1, 2, 4) if k > 8192 else (1, 2):
                warps = 4 if bm == 64 else 8  # the keys of triton_linear.CONFIG, plus split
                out.append(
                    {
                        "block_m": bm,
                        "block_n": bn,
                        "block_k": bk,
                        "num_stages": stages,
                        "num_warps": warps,
                        "split": split,
                    }
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--shapes", default="qkv,o,down,lm_head")
    args = parser.parse_args()
    ceilings()
    bw = FIG["copy_bw"]
    log(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.backends.cuda.preferred_blas_library("cublaslt")
    for rows in map(int, args.rows.split(",")):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            ref = F.linear(x, w)
            floor = w.numel() * 2 / bw
            sec = graph_timed(lambda x=x, w=w: F.linear(x, w))
            log(f"{name} M={rows}: cuBLASLt {sec * 1e6:.1f} us ({floor / sec:.0%} of copy; floor {floor * 1e6:.1f})")
            results = []
            for cfg in configs(rows, k):
                try:
                    run = make_linear(x, w, cfg, num_sms)
                    got = run()
                    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = graph_timed(run)
                    results.append((t, cfg, err))
                except Exception as e:  # noqa: BLE001 - a setting that does not fit is a result too
                    log(f"  {cfg}: FAIL {type(e).__name__}: {str(e)[:100]}")
            results.sort(key=lambda r: r[0])
            for t, cfg, err in results[:6]:
                log(f"  {t * 1e6:6.1f} us ({floor / t:.0%}) {cfg} rel err {err:.1e}")


if __name__ == "__main__":
    main()
