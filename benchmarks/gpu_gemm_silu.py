"""An experiment for issue 29's prefill target: the gate/up GEMM with SiLU-and-mul in its epilogue.

    python benchmarks/gpu_gemm_silu.py [--rows 8192,256,64]

A 4 x 2048 prefill step of the 8B shape spends about 7 ms on SiLU-and-mul (``triton_ops.
silu_and_mul``: it reads the gate/up GEMM's [M, 2 x 14,336] output back and writes half of it,
at the copy rate). A GEMM that applies it before storing saves that pass, but only if the GEMM
itself stays within a few per cent of cuBLAS (a plain Triton GEMM was 5-15 % slower at decode
shapes). This script times, per row count M (K = 4,096, I = 14,336, bf16, CUDA-graph replays):
- cuBLAS ``F.linear(x, w_gate_up)`` alone, and followed by ``silu_and_mul`` (what the engine runs);
- ``gate_up_silu`` below, a persistent Triton GEMM over tensor descriptors (TMA) whose program
  accumulates a gate tile and the matching up tile and stores ``silu(gate) * up`` with the
  engine's rounding, in a few launch settings; its output is compared with the engine's.

The kernel is not used by the engine: it lives here until a device run shows it faster than the
pair. ``--interpret`` runs it under Triton's interpreter on small float16 shapes against the
torch reference (a check of the indexing, not of bf16 rounding or speed).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdinfer.layers import triton_ops  # noqa: E402
from pdinfer.layers.triton_ops import tl, triton  # noqa: E402

if triton_ops.HAS_TRITON:
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def gate_up_silu_kernel(
        x_desc,
        w_desc,
        out_desc,
        m,
        inter,
        k,
        NUM_PROGRAMS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        FLATTEN: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
    ):
        """Tiles of ``out`` [M, I] = silu(x @ w[:I].T) * (x @ w[I:].T), ``GROUP_M`` row tiles
        after each other on one column tile (its weights stay in L2), each program taking every
        NUM_PROGRAMS-th tile."""
        num_m = tl.cdiv(m, BLOCK_M)
        num_n = tl.cdiv(inter, BLOCK_N)
        per_group = GROUP_M * num_n
        for tile in tl.range(
            tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
        ):
            first_m = (tile // per_group) * GROUP_M
            size_m = tl.minimum(num_m - first_m, GROUP_M)
            row = (first_m + (tile % per_group) % size_m) * BLOCK_M
            col = ((tile % per_group) // size_m) * BLOCK_N
            acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                a = x_desc.load([row, k0])
                acc_gate = tl.dot(a, w_desc.load([col, k0]).T, acc_gate)
                acc_up = tl.dot(a, w_desc.load([inter + col, k0]).T, acc_up)
            dtype = out_desc.dtype
            # the engine's rounding: the GEMM's output, silu(gate), then the product, each in dtype
            gate = acc_gate.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out_desc.store([row, col], (act * up).to(dtype))


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, cfg: dict, num_programs: int) -> torch.Tensor:
    """``silu_and_mul(x @ w.T)`` for ``w`` [2 I, K] (gate rows, then up rows) in one kernel."""
    m, k = x.shape
    inter = w.shape[0] // 2
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [bm, bk])
    w_desc = TensorDescriptor(w, [2 * inter, k], [w.stride(0), 1], [bn, bk])
    out_desc = TensorDescriptor(out, [m, inter], [out.stride(0), 1], [bm, bn])
    tiles = triton.cdiv(m, bm) * triton.cdiv(inter, bn)
    programs = min(num_programs, tiles)
    gate_up_silu_kernel[(programs,)](
        x_desc,
        w_desc,
        out_desc,
        m,
        inter,
        k,
        NUM_PROGRAMS=programs,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=cfg.get("group_m", 8),
        FLATTEN=cfg.get("flatten", False),
        WARP_SPECIALIZE=cfg.get("ws", False),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


CONFIGS = (
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4},
    {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 5},
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "flatten": True, "ws": True},
    {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4, "flatten": True, "ws": True},
)
# decode row counts (64, 256): fewer rows than one 128-row tile or two, so narrower tiles and
# deeper pipelines (the weights are streamed once; what matters is keeping loads in flight)
SMALL_M_CONFIGS = (
    {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4},
    {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 6},
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 5},
    {"block_m": 64, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 5},
    {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "flatten": True, "ws": True},
)


def interpret_check() -> None:
    """Small float16 shapes under the interpreter against torch (rows past M, columns past I)."""
    torch.manual_seed(0)
    cfg = {"block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 2, "group_m": 2}
    for m, inter, k in ((40, 48, 32), (16, 16, 64)):
        x = torch.randn(m, k).half()
        w = (torch.randn(2 * inter, k) * 0.1).half()
        ref = triton_ops.silu_and_mul(x.float() @ w.float().T)
        out = gate_up_silu(x, w, cfg, num_programs=5)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"interpreter M={m} I={inter} K={k}: relative error {err:.1e} ({'ok' if err < 2e-3 else 'WRONG'})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="8192,256,64")
    p.add_argument("--interpret", action="store_true")
    args = p.parse_args()
    if args.interpret:
        interpret_check()
        return
    from benchmarks.gpu_micro import graph_timed, log

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    k, inter = 4096, 14336
    w = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) * 0.02
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        # the engine's libraries: cuBLAS for eager prefill, cuBLASLt in the decode graphs
        torch.backends.cuda.preferred_blas_library("cublaslt" if m <= 512 else "cublas")
        flops = 2 * m * k * 2 * inter
        ref = triton_ops.silu_and_mul(F.linear(x, w))
        gemm = graph_timed(lambda x=x: F.linear(x, w))
        pair = graph_timed(lambda x=x: triton_ops.silu_and_mul(F.linear(x, w)))
        log(
            f"M={m}: cuBLAS GEMM {gemm * 1e6:.0f} us ({flops / gemm / 1e12:.0f} TFLOP/s); with silu_and_mul {pair * 1e6:.0f} us"
        )
        for cfg in CONFIGS if m > 512 else SMALL_M_CONFIGS:
            try:
                out = gate_up_silu(x, w, cfg, num_sms)
                bad = (out != ref).float().mean().item()
                sec = graph_timed(lambda x=x, cfg=cfg: gate_up_silu(x, w, cfg, num_sms))
                log(
                    f"  fused {cfg}: {sec * 1e6:.0f} us ({flops / sec / 1e12:.0f} TFLOP/s), "
                    f"{pair / sec:.3f}x the pair; elements unlike the pair's {bad:.2%}"
                )
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit is a result
                log(f"  fused {cfg}: FAIL {type(e).__name__}: {str(e)[:160]}")


if __name__ == "__main__":
    main()
