"""Decode-sized linears on CUDA: a persistent Triton GEMM over tensor descriptors (TMA).

A decode step of a few dozen rows reads each weight once and does little arithmetic with it, so
a linear is as fast as its weight streams through the multiprocessors. cuBLASLt (the decode
graphs' library) runs the 8B shape's qkv_proj and o_proj below the copy rate at 64 rows; this
kernel, the plain-GEMM twin of ``triton_gate_up`` (64-row tiles, 64 columns and 128 of K a step,
six stages in flight), streams them faster.

So the kernel takes the logits projection (``WIDE``: 128-column tiles, three stages) from
``MIN_ROWS`` to ``MAX_ROWS`` rows, and qkv_proj and o_proj from ``NARROW_MIN_ROWS``; the model
calls ``linear`` for those three. down_proj keeps ``nn.Linear`` (no faster on this kernel), and so
does every linear of other row counts. 256-row steps keep cuBLASLt: o_proj on this kernel is
faster there alone but made the batch-256 graph slower in the engine. The figures are in
docs/performance.md#measurements-behind-design-choices.

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
