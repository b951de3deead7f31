"""The gate/up GEMM with SiLU-and-mul in its epilogue (``layers/triton_gate_up.py``) against the pair.

    python benchmarks/gpu_gemm_silu.py [--rows 8192,256,64]

``triton_ops.silu_and_mul`` reads the gate/up GEMM's [M, 2 x 14,336] output back and writes
half of it. A GEMM that applies it before storing saves that pass, but only where the GEMM
itself stays within a few per cent of cuBLAS. This script times, per row count M (K = 4,096, I = 14,336, bf16, CUDA-graph replays):
- cuBLAS ``F.linear(x, w_gate_up)`` alone, and followed by ``silu_and_mul`` (what the engine runs);
- ``triton_gate_up.gate_up_silu``, a persistent Triton GEMM over tensor descriptors (TMA) whose
  program accumulates a gate tile and the matching up tile and stores ``silu(gate) * up`` with
  the engine's rounding, in a few launch settings; its output is compared with the engine's.

Rows from 65 to 1,024 (``MID_M``) try every setting, 256-row tiles too.
``--best FILE`` writes the fastest settings for large, mid and small row counts as JSON
(``gpu_floor.py --silu-configs FILE`` runs the engine with them); the engine's own are
``triton_gate_up.LARGE_M``, ``MID_M`` and ``SMALL_M``. ``--silu-alone`` times ``silu_and_mul`` alone.
``--interpret`` runs it under Triton's interpreter on small float16 shapes against the
torch reference (a check of the indexing, not of bf16 rounding or speed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdinfer.layers import triton_gate_up, triton_ops  # noqa: E402
from pdinfer.layers.triton_gate_up import gate_up_silu  # noqa: E402
from pdinfer.layers.triton_ops import triton  # noqa: E402

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
# 65-1,024 rows (large decode batches, small prefills; the engine's MID_M): the settings above
# and these, with 256-row tiles (every weight tile read once at 256 rows)
MID_M_CONFIGS = (
    {"block_m": 256, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 256, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 4},
    {"block_m": 256, "block_n": 32, "block_k": 64, "num_warps": 8, "num_stages": 4},
    {"block_m": 128, "block_n": 64, "block_k": 128, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4},
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 5},
)


def interpret_check() -> None:
    """Small float16 shapes under the interpreter against torch (rows past M, columns past I)."""
    torch.manual_seed(0)
    cfg = {"block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 2, "group_m": 2}
    for m, inter, k in ((40, 48, 32), (16, 16, 64)):
        x = torch.randn(m, k).half()
        w = (torch.randn(2 * inter, k) * 0.1).half()
        ref = triton_ops.silu_and_mul(x.float() @ w.float().T)
        out = gate_up_silu(x, w, 5, cfg)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"interpreter M={m} I={inter} K={k}: relative error {err:.1e} ({'ok' if err < 2e-3 else 'WRONG'})")


def silu_alone(rows: str, graph_timed, log) -> None:
    """``triton_ops.silu_and_mul`` alone at each row count, its kernel under other block sizes
    and warp counts: GB/s of the [M, 2 I] read and [M, I] write against the copy rate."""
    inter = 14336
    for m in (int(r) for r in rows.split(",")):
        x = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, inter, device="cuda", dtype=torch.bfloat16)
        moved = 3 * m * inter * 2
        t = graph_timed(lambda x=x: triton_ops.silu_and_mul(x))
        log(f"M={m}: silu_and_mul {t * 1e6:.1f} us ({moved / t / 1e12:.2f} TB/s)")
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                grid = (m, triton.cdiv(inter, block))
                t = graph_timed(
                    lambda x=x, o=out, b=block, w=warps, g=grid: triton_ops._silu_mul_kernel[g](
                        x, o, x.stride(0), o.stride(0), inter, BLOCK=b, num_warps=w
                    )
                )
                log(f"  BLOCK {block} warps {warps}: {t * 1e6:.1f} us ({moved / t / 1e12:.2f} TB/s)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="8192,256,64")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--silu-alone", action="store_true", help="time silu_and_mul alone under launch settings")
    p.add_argument("--best", help="write the fastest settings ({'large': ..., 'small': ...}) to this JSON file")
    args = p.parse_args()
    if args.interpret:
        interpret_check()
        return
    from benchmarks.gpu_micro import graph_timed, log

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    k, inter = 4096, 14336
    w = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) * 0.02
    if args.silu_alone:
        silu_alone(args.rows, graph_timed, log)
        return
    best: dict[str, tuple[float, dict]] = {}  # row-count class: (fused time / pair time, settings)
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
        if m <= triton_gate_up.SMALL_M_ROWS:
            size, configs = "small", SMALL_M_CONFIGS
        elif m <= triton_gate_up.MID_M_ROWS:
            size, configs = "mid", SMALL_M_CONFIGS + MID_M_CONFIGS + CONFIGS
        else:
            size, configs = "large", CONFIGS
        for cfg in configs:
            try:
                out = gate_up_silu(x, w, num_sms, cfg)
                bad = (out != ref).float().mean().item()
                sec = graph_timed(lambda x=x, cfg=cfg: gate_up_silu(x, w, num_sms, cfg))
                log(
                    f"  fused {cfg}: {sec * 1e6:.0f} us ({flops / sec / 1e12:.0f} TFLOP/s), "
                    f"{pair / sec:.3f}x the pair; elements unlike the pair's {bad:.2%}"
                )
                if bad < 0.05 and (size not in best or sec / pair < best[size][0]):
                    best[size] = (sec / pair, cfg)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit is a result
                log(f"  fused {cfg}: FAIL {type(e).__name__}: {str(e)[:160]}")
    log(
        "best: " + ", ".join(f"{size} {ratio:.3f} of the pair's time with {cfg}" for size, (ratio, cfg) in best.items())
    )
    if args.best:
        Path(args.best).write_text(json.dumps({size: cfg for size, (_, cfg) in best.items()}))


if __name__ == "__main__":
    main()
