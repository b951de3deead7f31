"""Weight prefetch into L2 for small decode steps on CUDA.

At a few dozen rows a decode step is a chain of bandwidth-bound GEMMs separated by
latency-bound kernels (the norms, SiLU-and-mul): while a norm runs, the memory system is
nearly idle, and the next GEMM then starts its weight stream cold (its first wave of tiles
waits out the full memory latency). ``WeightPrefetcher`` fills those windows: just before such a
kernel it forks a side stream that reads the first columns of every row of the next GEMM's
weight, so they sit in L2 when the GEMM's tiles ask for them (each tile walks its rows from
column 0, so a prefix of every row, not a prefix of the matrix, is what its first loads need).
The GEMM never waits for the prefetch; the side stream joins the main one at the end of the
forward. The budget, a few MiB a GEMM, is about what the memory system moves while a small
kernel runs. ``docs/performance.md`` has the measurement.
"""

from __future__ import annotations

import torch

from pdinfer.layers.triton_ops import HAS_TRITON, tl, triton

PREFETCH_BYTES = 8 << 20  # a GEMM's share: about 3 us of the H100's bandwidth
PREFETCH_MAX_ROWS = 128  # decode steps up to this many rows (their GEMMs are bandwidth-bound)
_ROWS, _BLOCK_C = 64, 128

if HAS_TRITON:

    @triton.jit
    def _l2_prefetch_kernel(
        w_ptr, out_ptr, n_rows, stride_w, COLS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr
    ):
        pid = tl.program_id(0)
        rows = pid * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        acc = tl.zeros([ROWS, BLOCK_C], tl.float32)
        for c0 in range(0, COLS, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :]
            acc += tl.load(ptr, mask=rmask[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc))  # keeps the loads alive; nobody reads it


def prefetch_columns(weight: torch.Tensor, budget_bytes: int = PREFETCH_BYTES) -> int:
    """How many leading columns of every row of ``weight`` [N, K] fit the budget (whole
    128-column chunks, at least one, at most K rounded down)."""
    n, k = weight.shape
    cols = budget_bytes // max(1, n * weight.element_size())
    return max(_BLOCK_C, min(k - k % _BLOCK_C, cols - cols % _BLOCK_C))


class WeightPrefetcher:
    """A side stream and a scratch word per program; ``fork(weight)`` before a latency-bound
    kernel, ``join()`` once at the end of the forward."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.scratch = torch.empty(16384, dtype=torch.float32, device=device)
        self.forked = False

    def fork(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.stride(1) != 1 or not weight.is_cuda:
            return
        n = weight.shape[0]
        grid = triton.cdiv(n, _ROWS)
        if grid > self.scratch.numel():
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # after the GEMM before it
        with torch.cuda.stream(self.stream):
            _l2_prefetch_kernel[(grid,)](
                weight,
                self.scratch,
                n,
                weight.stride(0),
                COLS=prefetch_columns(weight),
                ROWS=_ROWS,
                BLOCK_C=_BLOCK_C,
                num_warps=4,
            )
        self.forked = True

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False
