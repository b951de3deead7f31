"""The MLP's gate/up GEMM with SiLU-and-mul in its epilogue, for CUDA.

An 8B layer's MLP ran ``down(silu_and_mul(x @ w_gate_up.T))``: the GEMM writes [M, 2 I] and
``triton_ops.silu_and_mul`` reads it back to write [M, I]. ``gate_up_silu`` computes a gate tile
and the matching up tile in one program (the same rows of ``x`` feed both dots, a 128 x 256
product: cuBLAS's tile shape on Hopper) and stores ``silu(gate) * up`` only. It is a persistent
Triton GEMM over tensor descriptors (TMA).

Where it runs (``applies``, ``config_for``): from ``FIRST_ROWS`` rows up, in three launch
settings: ``SMALL_M`` up to ``SMALL_M_ROWS`` rows (narrow tiles: the weight streams through every
multiprocessor), ``MID_M`` up to ``MID_M_ROWS`` (large decode batches, small prefills) and
``LARGE_M`` above. Below ``FIRST_ROWS`` the pair stays: cuBLAS's kernels for a row or a few are
faster. The bounds come from timing each setting against the pair, alone
(``benchmarks/gpu_gemm_silu.py``) and in the engine (``benchmarks/gpu_floor.py``); the figures
are in docs/performance.md#measurements-behind-design-choices.

Rounding is the pair's: the GEMM's float32 sums rounded to the model's dtype, then ``silu``,
then the product, each rounded as ``silu_and_mul`` does; only the GEMM's order of summation is
Triton's instead of cuBLAS's.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pdinfer.layers.triton_ops import HAS_TRITON, tl, triton

ENABLED = True  # the engine's switch (``applies``); benchmarks turn it off to compare

# Launch settings by row count (``config_for``): prefill-sized steps take 128 x 128 tiles (a
# gate and an up accumulator: a 128 x 256 product a program, cuBLAS's shape on Hopper), with a
# stage more from SMALL_M_ROWS to MID_M_ROWS rows; decode steps of up to SMALL_M_ROWS narrower
# ones, so that the weight streams through every multiprocessor.
LARGE_M = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
MID_M = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4}
SMALL_M = {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}
FIRST_ROWS = 8  # fewer rows: cuBLAS and silu_and_mul
SMALL_M_ROWS = 64  # FIRST_ROWS to this many: SMALL_M
MID_M_ROWS = 1024  # above SMALL_M_ROWS and up to this many: MID_M; above: LARGE_M


def config_for(rows: int) -> dict | None:
    """The launch settings for a GEMM of ``rows`` rows; None where the pair is faster."""
    if rows < FIRST_ROWS:
        return None
    if rows <= SMALL_M_ROWS:
        return SMALL_M
    return MID_M if rows <= MID_M_ROWS else LARGE_M


if HAS_TRITON:
    from triton.tools.tensor_descriptor import TensorDescriptor

    # ``m`` not specialized: a step's row count changes from step to step, and Triton would compile
    # a second variant the first time it is not a multiple of 16, in the middle of serving
    @triton.jit(do_not_specialize=["m"])
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
            # the pair's rounding: the GEMM's output, silu(gate), then the product, each in dtype
            gate = acc_gate.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out_desc.store([row, col], (act * up).to(dtype))


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, num_programs: int, cfg: dict | None = None) -> torch.Tensor:
    """``silu_and_mul(x @ w.T)`` for ``w`` [2 I, K] (gate rows, then up rows) in one kernel of at
    most ``num_programs`` programs (the device's multiprocessors); ``cfg``: launch settings,
    by default ``config_for``'s (``LARGE_M`` where that is None)."""
    m, k = x.shape
    inter = w.shape[0] // 2
    if cfg is None:
        cfg = config_for(m) or LARGE_M
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x_desc, w_desc, out_desc = (matrix_descriptor(t, b) for t, b in ((x, [bm, bk]), (w, [bn, bk]), (out, [bm, bn])))
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


def mlp_gate_up_silu(gate_up: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The MLP's ``silu_and_mul(gate_up(x))`` through ``gate_up_silu`` (``applies`` holds)."""
    return gate_up_silu(x, gate_up.weight, multiprocessors(x.get_device()))


def applies(gate_up: nn.Module, x: torch.Tensor) -> bool:
    """Whether the MLP's ``gate_up`` linear on ``x`` takes ``gate_up_silu``: switched on, a plain
    bias-free ``nn.Linear`` (not a batch-invariant, FP8 or packed one) in 16-bit floats on CUDA,
    with rows and weight that tensor descriptors can address (``descriptor_operands``)."""
    if not (ENABLED and HAS_TRITON and type(gate_up) is nn.Linear and gate_up.bias is None):
        return False
    if config_for(x.shape[0]) is None:  # the pair is faster there (module doc)
        return False
    return descriptor_operands(x, gate_up.weight, gate_up.weight.shape[0] // 2)


def matrix_descriptor(t: torch.Tensor, block: list[int]):
    """A tensor descriptor of the row-major matrix ``t`` (unit stride along its rows) that loads
    and stores ``block``-shaped tiles (``descriptor_operands`` says which operands qualify)."""
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block)


def descriptor_operands(x: torch.Tensor, w: torch.Tensor, out_columns: int) -> bool:
    """Whether a GEMM of ``x`` [M, K] and ``w`` [N, K] with an output ``out_columns`` wide can run
    on tensor descriptors: both CUDA tensors in one 16-bit float dtype, ``x`` two-dimensional,
    unit stride along K, 16-byte aligned starts and rows, output rows a multiple of 16 bytes."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == x.dtype
        and x.stride(-1) == 1
        and w.stride(-1) == 1
        and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, w))
        and out_columns * w.element_size() % 16 == 0
    )


@functools.cache
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
