"""The fused MoE experts for CUDA (Triton): a grouped GEMM over the (token, expert) pairs sorted
by expert, the design of vLLM's and SGLang's ``fused_moe``.

1. ``align_block_size`` sorts the T * top_k pairs by expert slot and pads each slot's run to a
   multiple of BLOCK_M, so every M-block of the sorted list belongs to one slot. It gives the
   pair ids in that order (padding: the id T * top_k), the slot of each M-block and the padded
   length. All on the device with torch ops, shapes from T alone: no host sync, so a CUDA graph
   can capture it. The grid covers the largest padded length T * top_k can reach; M-blocks past
   the real one return at once.
2. ``_gate_up_kernel``: each M-block's rows of x against its slot's ``gate_up`` [E, 2I, H],
   the gate and up halves in two accumulators, SiLU(gate) * up stored per pair [T * top_k, I].
3. ``_down_kernel``: those rows against ``down`` [E, H, I], times the pair's routing weight,
   stored per pair [T * top_k, H]; a torch sum over top_k gives each token's output.

The kernels index the weight stack by whatever ``ids`` hold: physical slots when EPLB replicas
are on (``SparseMoE`` maps experts to slots first), logical experts otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdinfer.layers.triton_ops import HAS_TRITON, tl, triton


@dataclass(frozen=True)
class MoEKernelConfig:
    block_m: int  # sorted rows per program; each slot's run is padded to a multiple
    block_n: int  # output columns per program (the gate/up kernel: per half)
    block_k: int
    group_m: int  # M-blocks that sweep the N-blocks together (L2 reuse of their rows)
    num_warps: int
    num_stages: int


# Chosen by the mean rows per slot (T * top_k / E), after vLLM's tuned H100/H200 bf16 tables
# for E=128, I=768: decode reads each touched expert's weights once, so small M-blocks (little
# padding) and wide K steps (fewer loop trips); prefill is compute-bound, so larger tiles. The
# gate/up kernel holds two B tiles and two accumulators: its shared memory is about
# stages * (BM * BK + 2 * BK * BN) * 2 bytes, 192 KiB at most here (H100/H200: 227 KiB).
CONFIGS: list[tuple[float, MoEKernelConfig]] = [
    (8, MoEKernelConfig(16, 64, 128, 1, 4, 3)),
    (32, MoEKernelConfig(32, 64, 128, 1, 4, 3)),
    (128, MoEKernelConfig(64, 64, 64, 8, 4, 4)),
    (float("inf"), MoEKernelConfig(64, 128, 64, 8, 8, 4)),
]


def pick_config(num_tokens: int, top_k: int, num_slots: int) -> MoEKernelConfig:
    rows_per_slot = num_tokens * top_k / num_slots
    return next(cfg for bound, cfg in CONFIGS if rows_per_slot <= bound)


SHARED_MEMORY_BYTES = 220 * 1024  # below the H100/H200's 227 KiB a block, with room to spare


def _fit_shared_memory(cfg: MoEKernelConfig, element_bytes: int) -> MoEKernelConfig:
    """The tables are for 2-byte elements; float32 tiles are twice the bytes (a 32-row, 3-stage
    config needs 240 KiB, more than a block may have, and does not launch): fewer pipeline stages
    until the gate/up kernel's tiles fit."""
    stages = cfg.num_stages
    per_stage = (cfg.block_m * cfg.block_k + 2 * cfg.block_k * cfg.block_n) * element_bytes
    while stages > 1 and stages * per_stage > SHARED_MEMORY_BYTES:
        stages -= 1
    return cfg if stages == cfg.num_stages else replace(cfg, num_stages=stages)


def max_sorted_rows(num_pairs: int, num_slots: int, block_m: int) -> int:
    """The longest padded list: every pair, plus at most BLOCK_M - 1 padding rows for each slot
    that has a pair (at most min(pairs, slots) of them), rounded up to whole M-blocks."""
    rows = num_pairs + min(num_pairs, num_slots) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_block_size(
    ids: torch.Tensor, num_slots: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by slot, each slot's run padded to a multiple of ``block_m``.

    ``ids`` [T, top_k] -> (sorted pair ids [R] int32, padding rows hold T * top_k; the slot of
    each M-block [R / block_m] int32; the padded length [1] int32), with R =
    ``max_sorted_rows``. A pair id p is token p // top_k's choice p % top_k. Blocks past the
    padded length are unused (their slot is clamped into range). Within a slot, pairs keep
    token order.
    """
    flat = ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    rows = max_sorted_rows(num_pairs, num_slots, block_m)
    # scatter_add_, not bincount: bincount reads the largest id on the host.
    counts = torch.zeros(num_slots, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = flat.argsort(stable=True)
    slot_sorted = flat.index_select(0, order)
    first = counts.cumsum(0) - counts  # where each slot's pairs start in `order`
    rank = torch.arange(num_pairs, device=device) - first.index_select(0, slot_sorted)
    dest = padded_start.index_select(0, slot_sorted) + rank
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_slot = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_slots - 1)
    return sorted_ids, block_slot.to(torch.int32), padded_end[-1:].to(torch.int32)


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every row t of ``x`` [T, H]; the
    same contract as ``layers.moe.grouped_experts``, without a host sync."""
    if not HAS_TRITON:
        raise RuntimeError("the fused MoE needs Triton")
    num_tokens, hidden = x.shape
    num_slots, inter, top_k = down.shape[0], down.shape[2], ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = _fit_shared_memory(config or pick_config(num_tokens, top_k, num_slots), x.element_size())
    sorted_ids, block_slot, num_padded = align_block_size(ids, num_slots, cfg.block_m)
    num_pairs, num_blocks = num_tokens * top_k, block_slot.numel()
    x = x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 (as torch's linear)
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    grid = (num_blocks * triton.cdiv(inter, cfg.block_n),)
    _gate_up_kernel[grid](
        x, gate_up, act, sorted_ids, block_slot, num_padded,
        num_pairs, inter, hidden, num_blocks,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), act.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    pair_weights = weights.reshape(-1).to(torch.float32).contiguous()
    grid = (num_blocks * triton.cdiv(hidden, cfg.block_n),)
    _down_kernel[grid](
        act, down, out, sorted_ids, block_slot, num_padded, pair_weights,
        num_pairs, hidden, inter, num_blocks,
        down.stride(0), down.stride(1), down.stride(2), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


if HAS_TRITON:

    @triton.jit
    def _block_coords(num_blocks, n_cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(M-block, N-block) of this program: GROUP_M M-blocks take each N-block in turn."""
        pid = tl.program_id(0)
        blocks_n = tl.cdiv(n_cols, BLOCK_N)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_size = tl.minimum(num_blocks - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # one build for every token count
    def _gate_up_kernel(
        x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_slot_ptr, num_padded_ptr,
        num_pairs, inter, hidden, num_blocks,
        stride_xt, stride_we, stride_wn, stride_wk, stride_ot,
        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = _block_coords(num_blocks, inter, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = pairs < num_pairs  # padding rows hold num_pairs
        slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + (pairs // TOP_K)[:, None] * stride_xt + ks[None, :]
        g_ptrs = w_ptr + slot * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        u_ptrs = g_ptrs + inter * stride_wn  # the up half: rows I.. of gate_up
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = ks < hidden - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            acc_gate = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        out_ptrs = out_ptr + pairs[:, None] * stride_ot + cols[None, :]
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # one build for every token count
    def _down_kernel(
        act_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_slot_ptr, num_padded_ptr, pair_weight_ptr,
        num_pairs, hidden, inter, num_blocks,
        stride_we, stride_wn, stride_wk, stride_ot,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = _block_coords(num_blocks, hidden, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = pairs < num_pairs
        slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + pairs[:, None] * inter + ks[None, :]  # act is [pairs, I], contiguous
        w_ptrs = w_ptr + slot * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = ks < inter - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        acc *= tl.load(pair_weight_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        out_ptrs = out_ptr + pairs[:, None] * stride_ot + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
