"""Paged attention for CUDA GPUs, in Triton: KV write, decode (flash-decoding), prefill.

All kernels read the KV cache in place through block tables. The cache is the engine's one
tensor ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``; a layer sees the view
``kv[:, layer]`` and the kernels take its strides, so the block-major layout (one block's K/V
over all layers contiguous, which hand-off and store rely on) stays as it is.

- ``write_kv``: one program per new token stores its K and V into its slot (slot -1: skip,
  the padding rows of a CUDA-graph batch).
- decode: one program per (sequence, KV head, split) computes all query heads of that KV head
  (GQA: each K/V tile is loaded once for the whole group); with several splits a second kernel
  merges the partial softmaxes. The grid depends on the batch only, never on context lengths,
  so a CUDA graph captured once serves every step of that batch size.
- prefill: one program per (query tile of a sequence, query head); a query at position p
  attends to keys 0..p of its sequence, read from the cache (cached prefix and this chunk
  alike, since ``write_kv`` runs first). Variable lengths, chunked prefill and prefix-cache
  hits are the same case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdinfer.layers.triton_ops import HAS_TRITON, next_pow2, tl, triton

LOG2E = 1.4426950408889634


@dataclass
class GpuAttentionMetadata:
    """One step's attention inputs, all on the device, built once per step (not per layer)."""

    is_decode: bool  # one query per sequence, query row i belongs to sequence i
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset); -1 = no write
    block_tables: torch.Tensor  # [S, max_blocks] int
    context_lens: torch.Tensor  # [S] int: cached prefix + this step's tokens
    num_splits: int = 1  # decode: KV splits per sequence (flash-decoding)
    query_start: torch.Tensor | None = None  # prefill: [S + 1] cumulative query rows
    work_seq: torch.Tensor | None = None  # prefill: [W] sequence of each query tile
    work_tile: torch.Tensor | None = None  # prefill: [W] tile index inside its sequence
    num_work: int = 0
    num_tokens: int = 0


PREFILL_BLOCK_M = 128  # query rows per prefill program; the metadata builder tiles with it
# Launch settings (benchmarks/gpu_suite.py times alternatives; change them only with a measurement).
DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2}
PREFILL_CONFIG = {"block_n": 128, "num_warps": 8, "num_stages": 2}


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int | None = None, num_sms: int = 132) -> int:
    """Splits per sequence so that a decode launch has about two programs per multiprocessor
    (measured on the H200, batch 64 x 8 KV heads: one split 45 us, two 50 us, four 53 us).

    Depends on the batch (and, outside CUDA graphs, on the longest context: a short context is
    not worth splitting).
    """
    programs = max(1, batch * num_kv_heads)
    splits = min(32, next_pow2(-(-2 * num_sms // programs)))
    if max_context is not None:
        splits = min(splits, next_pow2(max(1, -(-max_context // 256))))
    return max(1, splits)


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_ckv,
        stride_ct,
        stride_ch,
        num_kv_heads,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        HEADS_PAD: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            heads = tl.arange(0, HEADS_PAD)
            d = tl.arange(0, D_PAD)
            mask = (heads[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
            blk = slot // BLOCK_SIZE
            dst = cache_ptr + blk * stride_cb + (slot % BLOCK_SIZE) * stride_ct
            dst = dst + heads[:, None] * stride_ch + d[None, :]
            t64 = t.to(tl.int64)
            k = tl.load(k_ptr + t64 * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
            v = tl.load(v_ptr + t64 * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
            tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _decode_kernel(
        q_ptr,
        cache_ptr,
        bt_ptr,
        ctx_ptr,
        out_ptr,
        part_acc_ptr,
        part_ml_ptr,
        stride_qt,
        stride_qh,
        stride_cb,
        stride_ckv,
        stride_ct,
        stride_ch,
        stride_bt,
        stride_ot,
        stride_oh,
        qk_scale,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b)
        split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, ctx)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        b64 = b.to(tl.int64)
        q = tl.load(
            q_ptr + b64 * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        )
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        k_base = cache_ptr + kvh * stride_ch
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + n
            pmask = pos < end
            blk = tl.load(bt_ptr + b64 * stride_bt + pos // BLOCK_SIZE, mask=pmask, other=0)
            off = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct
            kv_mask = pmask[:, None] & dmask[None, :]
            k = tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(k_base + stride_ckv + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        omask = gmask[:, None] & dmask[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(
                out_ptr + b64 * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=omask,
            )
        else:
            # partials [B, H, NUM_SPLITS, D] and (max, sum) [B, H, NUM_SPLITS, 2], contiguous
            row = (b64 * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
            tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=omask)
            tl.store(part_ml_ptr + row * 2, m_i, mask=gmask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=gmask)

    @triton.jit
    def _decode_merge_kernel(
        part_acc_ptr,
        part_ml_ptr,
        out_ptr,
        stride_ot,
        stride_oh,
        num_heads,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, D_PAD)
        row = (b * num_heads + h) * NUM_SPLITS + sp
        m = tl.load(part_ml_ptr + row * 2)
        l_s = tl.load(part_ml_ptr + row * 2 + 1)
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row: no keys at all
        w = tl.math.exp2(m - m_max)
        den = tl.sum(w * l_s, axis=0)
        acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + d[None, :])
        num = tl.sum(w[:, None] * acc, axis=0)
        out = num / tl.maximum(den, 1e-30)
        tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _prefill_tile(
        q,
        acc,
        m_i,
        l_i,
        k_base,
        v_base,
        bt_row,
        lo,
        hi,
        q_pos,
        ctx,
        d,
        dmask,
        stride_cb,
        stride_ct,
        qk_scale,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + n
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < ctx, other=0)
            off = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct
            kv_mask = (pos < ctx)[:, None] & dmask[None, :]
            k = tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if MASKED:
                s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        cache_ptr,
        bt_ptr,
        ctx_ptr,
        qstart_ptr,
        work_seq_ptr,
        work_tile_ptr,
        out_ptr,
        stride_qt,
        stride_qh,
        stride_cb,
        stride_ckv,
        stride_ct,
        stride_ch,
        stride_bt,
        stride_ot,
        stride_oh,
        qk_scale,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        w = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(work_seq_ptr + w)
        tile = tl.load(work_tile_ptr + w)
        q0 = tl.load(qstart_ptr + seq)
        qlen = tl.load(qstart_ptr + seq + 1) - q0
        ctx = tl.load(ctx_ptr + seq)
        prefix = ctx - qlen

        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        mmask = m < qlen
        dmask = d < HEAD_DIM
        rows = (q0 + m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=mmask[:, None] & dmask[None, :],
            other=0.0,
        )
        q_pos = prefix + m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        k_base = cache_ptr + (h // GROUP) * stride_ch
        v_base = k_base + stride_ckv
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        # keys before the tile's first query position are visible to every row: no mask
        first_q = prefix + tile * BLOCK_M
        unmasked_end = (first_q // BLOCK_N) * BLOCK_N
        hi = tl.minimum(ctx, first_q + BLOCK_M)
        acc, m_i, l_i = _prefill_tile(
            q,
            acc,
            m_i,
            l_i,
            k_base,
            v_base,
            bt_row,
            0,
            unmasked_end,
            q_pos,
            ctx,
            d,
            dmask,
            stride_cb,
            stride_ct,
            qk_scale,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            PRECISION,
        )
        acc, m_i, l_i = _prefill_tile(
            q,
            acc,
            m_i,
            l_i,
            k_base,
            v_base,
            bt_row,
            unmasked_end,
            hi,
            q_pos,
            ctx,
            d,
            dmask,
            stride_cb,
            stride_ct,
            qk_scale,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            PRECISION,
        )
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mmask[:, None] & dmask[None, :],
        )


def _precision(q: torch.Tensor) -> str:
    # float32 models get exact float32 dots (Triton's default for them is tf32)
    return "ieee" if q.dtype == torch.float32 else "tf32"


def write_kv(k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, KVH, D] into ``layer_cache`` [num_blocks, 2, block_size, KVH, D]."""
    t, kvh, dim = k.shape
    if t == 0:
        return
    c = layer_cache
    _write_kv_kernel[(t,)](
        k,
        v,
        c,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        c.stride(0),
        c.stride(1),
        c.stride(2),
        c.stride(3),
        kvh,
        BLOCK_SIZE=c.shape[2],
        HEAD_DIM=dim,
        D_PAD=next_pow2(dim),
        HEADS_PAD=next_pow2(kvh),
        num_warps=4,
    )


def decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one query per sequence) -> out [B, H, D]."""
    b, h, dim = q.shape
    c = layer_cache
    kvh = c.shape[3]
    group = h // kvh
    d_pad = next_pow2(dim)
    if out is None:
        out = torch.empty((b, h, dim), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if num_splits > 1:
        part_acc = torch.empty((b, h, num_splits, d_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b, h, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    cfg = DECODE_CONFIG
    block_n = cfg["block_n"] if d_pad <= 128 else 32
    _decode_kernel[(b, kvh, num_splits)](
        q,
        c,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_ml,
        q.stride(0),
        q.stride(1),
        c.stride(0),
        c.stride(1),
        c.stride(2),
        c.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=dim,
        D_PAD=d_pad,
        BLOCK_SIZE=c.shape[2],
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        PRECISION=_precision(q),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _decode_merge_kernel[(b, h)](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            h,
            HEAD_DIM=dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
            num_warps=4,
        )
    return out


def prefill_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: GpuAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] of variable-length sequences (see ``GpuAttentionMetadata``) -> out [T, H, D]."""
    t, h, dim = q.shape
    c = layer_cache
    group = h // c.shape[3]
    if out is None:
        out = torch.empty((t, h, dim), dtype=q.dtype, device=q.device)
    if meta.num_work == 0:
        return out
    d_pad = next_pow2(dim)
    cfg = PREFILL_CONFIG
    warps = cfg["num_warps"] if d_pad >= 128 else 4
    # fp32 tiles are twice the bytes: 128 x 128 K/V tiles in two stages need 256 KiB of shared
    # memory at head_dim 128, above the H200's 227 KiB; half-width key tiles fit.
    block_n = cfg["block_n"] if q.element_size() <= 2 else 64
    bt = meta.block_tables
    _prefill_kernel[(meta.num_work, h)](
        q,
        c,
        bt,
        meta.context_lens,
        meta.query_start,
        meta.work_seq,
        meta.work_tile,
        out,
        q.stride(0),
        q.stride(1),
        c.stride(0),
        c.stride(1),
        c.stride(2),
        c.stride(3),
        bt.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        GROUP=group,
        HEAD_DIM=dim,
        D_PAD=d_pad,
        BLOCK_SIZE=c.shape[2],
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=block_n,
        PRECISION=_precision(q),
        num_warps=warps,
        num_stages=cfg["num_stages"],
    )
    return out


class TritonPagedAttention:
    """The CUDA backend behind the same ``forward(q, k, v, layer_cache, meta)`` as the torch one."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor, meta: GpuAttentionMetadata
    ) -> torch.Tensor:
        # New K/V first, so queries read their own chunk (and same-step prefix hits) from the cache.
        write_kv(k, v, layer_cache, meta.slot_mapping)
        out = torch.empty((q.shape[0], self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        if meta.is_decode:
            return decode_attention(
                q, layer_cache, meta.block_tables, meta.context_lens, self.scale, meta.num_splits, out
            )
        return prefill_attention(q, layer_cache, meta, self.scale, out)


def use_triton_attention(model: torch.nn.Module) -> None:
    """Give every attention layer of ``model`` the Triton backend (CUDA engines)."""
    if not HAS_TRITON:
        raise RuntimeError("CUDA inference needs Triton: pip install triton")
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if backend is not None and hasattr(backend, "num_kv_heads"):
            module.backend = TritonPagedAttention(
                backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale
            )
