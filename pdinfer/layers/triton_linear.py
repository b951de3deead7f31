"""Decode-sized linears on CUDA: a persistent Triton GEMM over tensor descriptors (TMA).

A decode step of a few dozen rows reads each weight once and does little arithmetic with it, so
a linear is as fast as its weight streams through the multiprocessors. cuBLASLt (the decode
graphs' library) runs the 8B shape's qkv_proj and o_proj below the copy rate at 64 rows; this
kernel, the plain-GEMM twin of ``triton_gate_up`` (64-row tiles, 64 columns and 128 of K a step,
six stages in flight), streams them faster. Measured alone on H100s
(``benchmarks/gpu_thin_gemm.py``, 2026-12-06 19:25 and 19:45, CUDA-graph replays, best setting
against cuBLASLt):

| linear (N x K) | 24 rows | 40 rows | 64 rows | 256 rows |
|---|---|---|---|---|
| qkv_proj (6,144 x 4,096) | 22.2 / 21.3 us | 20.9 / 21.9 | 20.9 / 21.9 | 27.6 / 25.0 |
| o_proj (4,096 x 4,096) | 14.3 / 8.4 | 13.0 / 8.8 | 9.4 / 10.9 | 16.9 / 18.9 |
| lm_head (128,256 x 4,096) | 359 / 381 | 358 / 384 | 360 / 387 | 494 / 463 |
| down_proj (4,096 x 14,336) | | | 43.7 / 43.1 | 62.3 / 62.3 |

(o_proj's 34 MB weight stays in L2 between replays, hence cuBLASLt's times under the copy
floor of 11.1 us; in a step the attention's K/V pass through L2 in between.) o_proj on this
kernel up to 256 rows, faster alone there, made the batch-256 graph slower in the engine
(15.72 against 15.61 ms, H100, 2026-12-06 21:21), so 256-row steps keep cuBLASLt. So the kernel
takes the logits projection (``WIDE``: 128-column tiles, three stages) from ``MIN_ROWS`` to
``MAX_ROWS`` rows, and qkv_proj and o_proj from ``NARROW_MIN_ROWS``; the model calls ``linear``
for those three. down_proj keeps ``nn.Linear``, and so does every linear of other row counts.
In the engine (``gpu_floor.py --variants new,-triton-linear,...``, two H100s, alternating): the
batch-64 decode graph 7.98-8.08 ms against 8.11-8.14, tok/s 84.4-85.2 % of the floor against
83.8-84.3 %; greedy tokens equal.

Each output element is one program's float32 sum over K in ``block_k`` steps, rounded once to
the model's dtype, as cuBLAS's unsplit kernels do.
"""

from __future__ import annotations

import torch
from torch import nn

from pdinfer.layers.triton_gate_up import descriptor_operands, matrix_descriptor, multiprocessors
from pdinfer.layers.triton_ops import HAS_TRITON, tl, triton

ENABLED = True  # the engine's switch (``applies``); benchmarks turn it off to compare
MIN_ROWS = 17  # fewer rows: cuBLASLt (not measured against this kernel there)
NARROW_MIN_ROWS = 41  # outputs narrower than WIDE_COLUMNS (qkv_proj, o_proj) from this many rows
MAX_ROWS = 64  # more rows: cuBLASLt, as fast or faster at 256 rows
CONFIG = {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 6}
WIDE = {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3}
WIDE_COLUMNS = 32768  # an output at least this wide (the logits projection) takes ``WIDE``


if HAS_TRITON:
    # ``m`` not specialized: the row count changes from step to step (one compiled variant)
    @triton.jit(do_not_specialize=["m"])
    def linear_kernel(
        x_desc,
        w_desc,
        out_desc,
        m,
        n,
        k,
        NUM_PROGRAMS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Tiles of ``out`` [M, N] = x @ w.T, each program taking every NUM_PROGRAMS-th tile."""
        num_m = tl.cdiv(m, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(n, BLOCK_N), NUM_PROGRAMS):
            row = (tile % num_m) * BLOCK_M
            col = (tile // num_m) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                acc = tl.dot(x_desc.load([row, k0]), w_desc.load([col, k0]).T, acc)
            out_desc.store([row, col], acc.to(out_desc.dtype))


def matmul(x: torch.Tensor, w: torch.Tensor, num_programs: int, cfg: dict | None = None) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [M, K] and ``w`` [N, K] in one kernel of at most ``num_programs``
    programs; ``cfg``: launch settings, by default ``CONFIG`` (``WIDE`` for wide outputs)."""
    m, k = x.shape
    n = w.shape[0]
    if cfg is None:
        cfg = WIDE if n >= WIDE_COLUMNS else CONFIG
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x_desc, w_desc, out_desc = (matrix_descriptor(t, b) for t, b in ((x, [bm, bk]), (w, [bn, bk]), (out, [bm, bn])))
    programs = min(num_programs, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    linear_kernel[(programs,)](
        x_desc,
        w_desc,
        out_desc,
        m,
        n,
        k,
        NUM_PROGRAMS=programs,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def applies(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module(x)`` takes ``matmul``: switched on, a plain bias-free ``nn.Linear`` (not a
    batch-invariant, FP8 or packed one), ``MIN_ROWS`` (``NARROW_MIN_ROWS`` below ``WIDE_COLUMNS``
    output columns) to ``MAX_ROWS`` rows, operands that tensor descriptors can address
    (``triton_gate_up.descriptor_operands``)."""
    if not (ENABLED and HAS_TRITON and type(module) is nn.Linear and module.bias is None):
        return False
    w = module.weight
    low = MIN_ROWS if w.shape[0] >= WIDE_COLUMNS else NARROW_MIN_ROWS
    return low <= x.shape[0] <= MAX_ROWS and descriptor_operands(x, w, w.shape[0])


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, through ``matmul`` where ``applies`` holds."""
    if applies(module, x):
        assert isinstance(module, nn.Linear)
        return matmul(x, module.weight, multiprocessors(x.get_device()))
    return module(x)
