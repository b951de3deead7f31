"""How fast the multiprocessors read from L2, and what the batch-256 decode GEMMs ask of it.

    python benchmarks/gpu_l2.py

At M = 256 the 8B shape's GEMMs sit at the H100's ridge point, and they run at about 70 % of
either their bytes or their FLOPs (docs/performance.md). A tiled GEMM reads each operand tile
from L2 once per tile of the other operand: with 128-row tiles the weights are read twice (two
row tiles) and the activations once per column tile. So its L2-to-multiprocessor traffic is
several times its DRAM traffic, and the L2's own read rate can bound it before DRAM or the
tensor cores do. This measures:
- a streaming read (one float32 sum a program) over buffers of 4 MiB to 1 GiB, replayed from a
  CUDA graph: the small ones stay in L2 between replays, so their rate is the L2's;
- the engine's batch-256 GEMMs (cuBLASLt for qkv, o and down; the SiLU GEMM for gate/up with its
  ``MID_M`` tiles), and the L2 traffic of 128 x 128 and 256 x 128 output tiles at the time each
  takes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_micro import graph_timed, log  # noqa: E402
from benchmarks.gpu_thin_gemm import SHAPES  # noqa: E402
from pdinfer.layers import triton_gate_up  # noqa: E402
from pdinfer.layers.triton_gate_up import gate_up_silu, multiprocessors  # noqa: E402


@triton.jit
def read_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    base = x_ptr + tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_rate(nbytes: int, programs: int) -> float:
    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(programs, device="cuda", dtype=torch.float32)
    block = 4096
    per = x.numel() // programs // block * block
    sec = graph_timed(lambda: read_kernel[(programs,)](x, out, per, BLOCK=block, num_warps=8))
    return programs * per * 2 / sec


def tile_traffic(m: int, n: int, k: int, bm: int, bn: int) -> int:
    """Bytes a GEMM with ``bm`` x ``bn`` output tiles reads from L2 (bf16 operands)."""
    return 2 * k * (m * triton.cdiv(n, bn) + n * triton.cdiv(m, bm))


def main() -> None:
    sms = multiprocessors(0)
    log(f"{torch.cuda.get_device_name()}, {sms} multiprocessors")
    for mib in (4, 8, 16, 24, 32, 48, 64, 128, 1024):
        rates = [read_rate(mib << 20, p) for p in (sms * 4, sms * 8)]
        log(f"read {mib:5d} MiB: {max(rates) / 1e12:.2f} TB/s (programs {sms * 4}: {rates[0] / 1e12:.2f})")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    m = 256
    x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    shapes = {**{s: SHAPES[s] for s in ("qkv", "o", "down")}, "gate_up": (2 * SHAPES["down"][1], SHAPES["qkv"][1])}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        a = x[:, :k].contiguous()
        if name == "gate_up":
            sec = graph_timed(lambda a=a, w=w: gate_up_silu(a, w, sms, triton_gate_up.MID_M))
            # MID_M's 128-column tiles hold 128 gate and 128 up columns: 256 wide in w
            traffic = {"128x256 (MID_M)": tile_traffic(m, n, k, 128, 256), "256x256": tile_traffic(m, n, k, 256, 256)}
        else:
            sec = graph_timed(lambda a=a, w=w: F.linear(a, w))
            traffic = {"128x128": tile_traffic(m, n, k, 128, 128), "256x128": tile_traffic(m, n, k, 256, 128)}
        dram = 2 * (n * k + m * k + m * n)
        parts = ", ".join(f"{t}: {b / 2**20:.0f} MiB = {b / sec / 1e12:.2f} TB/s" for t, b in traffic.items())
        log(
            f"M={m} {name}: {sec * 1e6:.1f} us, DRAM {dram / sec / 1e12:.2f} TB/s, "
            f"{2 * m * n * k / sec / 1e12:.0f} TFLOP/s; L2 reads with tiles {parts}"
        )


if __name__ == "__main__":
    main()
