"""Prefill attention of fresh prompts: queries, keys and values read straight from the step's
QKV projection through tensor descriptors (TMA on Hopper), not gathered from the paged cache.

A step whose every sequence starts at position 0 (no cached prefix: a fresh prompt, not a later
chunk) has all the keys it attends to in its own K/V rows, contiguous per sequence. The paged
kernel (``triton_kernels.prefill_kernel``) reads them back from the cache through the block
table, 16 tokens a block, with per-row pointer arithmetic; this kernel loads each [BLOCK_N,
head_dim] tile with one descriptor load, which Triton turns into the tensor memory
accelerator's bulk copies into a pipelined shared-memory ring on Hopper. The K/V are still
written to the cache first (decode reads them there). The paged kernel stays for chunks over a
cached prefix, FP8 caches (queries must see the cache's rounded values) and the batch-invariant
mode. ``docs/performance.md`` has the measurement behind the choice.

The tiling is the paged kernel's: one program per (128-row query tile, query head), tiles
heaviest first, key tiles below the tile's first query unmasked, the diagonal tile masked. A key
tile that runs past its sequence into the next one's rows is masked by causality (those keys sit
at positions after every query of the sequence); rows of a query tile past the sequence are
computed and not stored.

With ``rotary`` the query tiles arrive unrotated (``rotary_write_kv(rotate_q=False)`` rotated
and stored only the keys): the kernel loads each tile's two halves, rotates them with
``rotate_halves`` (compiled without FMA contraction, ``ROUNDED_PRODUCTS``, so the values are the
rotary kernels' bit for bit) and joins them, once per program. That saves the step a read and a
write of every query (2 x 64 MiB a layer at 8,192 tokens of the 8B shape).
"""

from __future__ import annotations

import torch

from pdinfer.layers.triton_ops import HAS_TRITON, ROUNDED_PRODUCTS, tl, triton

if HAS_TRITON:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from pdinfer.layers.triton_ops import rotate_halves

    @triton.jit
    def _rotated_query_tile(q_desc, cos_desc, sin_desc, row0, col, HALF: tl.constexpr):
        """The query tile at (row0, col), rotated: ``q_desc``'s blocks are half a head wide,
        ``cos_desc``/``sin_desc`` the step's [T, 2 * HALF] rotary rows with blocks as tall and
        HALF wide (rows past the step's last token load zeros and are never stored)."""
        q1 = q_desc.load([row0, col])
        q2 = q_desc.load([row0, col + HALF])
        c = cos_desc.load([row0, 0]).to(tl.float32)
        s = sin_desc.load([row0, 0]).to(tl.float32)
        r1, r2 = rotate_halves(q1, q2, c, s)
        return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (q1.shape[0], 2 * HALF))

    @triton.jit
    def _fresh_key_tiles(
        q,
        acc,
        m_i,
        l_i,
        k_desc,
        v_desc,
        row0,
        col,
        lo,
        hi,
        q_pos,
        qk_scale,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            k = k_desc.load([row0 + n0, col])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            if MASKED:
                s = tl.where((n0 + n)[None, :] <= q_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = v_desc.load([row0 + n0, col])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def fresh_prefill_kernel(
        q_desc,
        k_desc,
        v_desc,
        qstart_ptr,
        work_seq_ptr,
        work_tile_ptr,
        out_ptr,
        cos_desc,
        sin_desc,
        stride_ot,
        stride_oh,
        qk_scale,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ROTARY: tl.constexpr,
    ):
        w = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(work_seq_ptr + w)
        tile = tl.load(work_tile_ptr + w).to(tl.int32)
        q0 = tl.load(qstart_ptr + seq).to(tl.int32)
        qlen = tl.load(qstart_ptr + seq + 1).to(tl.int32) - q0
        first = tile * BLOCK_M
        if ROTARY:
            q = _rotated_query_tile(q_desc, cos_desc, sin_desc, q0 + first, h * HEAD_DIM, HEAD_DIM // 2)
        else:
            q = q_desc.load([q0 + first, h * HEAD_DIM])
        q_pos = first + tl.arange(0, BLOCK_M)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        col = (h // GROUP) * HEAD_DIM
        unmasked_end = (first // BLOCK_N) * BLOCK_N  # keys every row of the tile sees
        hi = tl.minimum(qlen, first + BLOCK_M)
        acc, m_i, l_i = _fresh_key_tiles(
            q, acc, m_i, l_i, k_desc, v_desc, q0, col, 0, unmasked_end, q_pos, qk_scale, BLOCK_N, False
        )
        acc, m_i, l_i = _fresh_key_tiles(
            q, acc, m_i, l_i, k_desc, v_desc, q0, col, unmasked_end, hi, q_pos, qk_scale, BLOCK_N, True
        )
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        d = tl.arange(0, HEAD_DIM)
        rows = (q0 + q_pos).to(tl.int64)
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=(q_pos < qlen)[:, None],
        )


# Launch settings (the micro part of benchmarks/gpu_floor.py times alternatives).
FRESH_CONFIG = {"block_n": 128, "num_warps": 8, "num_stages": 3}


def fresh_prefill_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``fresh_prefill_attention`` takes these views: 16-bit, a power-of-two head
    dim of at least 16, heads contiguous in each row, 16-byte aligned rows (TMA's rules)."""
    dim = q.shape[-1]
    if not HAS_TRITON or q.element_size() != 2 or dim < 16 or dim & (dim - 1):
        return False
    for x in (q, k, v):
        if x.stride(-1) != 1 or x.stride(-2) != dim or (x.stride(0) * 2) % 16 or x.data_ptr() % 16:
            return False
    return True


def fresh_rotary_supported(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``fresh_prefill_attention`` can rotate the queries with these [T, D] rotary rows
    (tensor descriptors: unit stride, 16-byte aligned rows and start)."""
    return all(
        x.dim() == 2 and x.stride(-1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
        for x in (cos, sin)
    )


def fresh_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start: torch.Tensor,
    work_seq: torch.Tensor,
    work_tile: torch.Tensor,
    num_work: int,
    scale_log2: float,
    block_m: int,
    out: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D] (views of one QKV output) of sequences without a cached
    prefix -> out [T, H, D]; ``scale_log2``: softmax scale times log2(e). ``rotary``: the
    full-width (cos, sin) [T, D] that q still needs (k comes rotated)."""
    t, h, dim = q.shape
    group = h // k.shape[1]
    cfg = FRESH_CONFIG
    block_n = cfg["block_n"]
    if rotary is None:
        q_desc = TensorDescriptor(q, [t, h * dim], [q.stride(0), 1], [block_m, dim])
        cos_desc = sin_desc = q_desc  # unread without ROTARY
    else:
        half = [block_m, dim // 2]
        q_desc = TensorDescriptor(q, [t, h * dim], [q.stride(0), 1], half)
        cos_desc, sin_desc = (TensorDescriptor(x, [t, dim], [x.stride(0), 1], half) for x in rotary)
    k_desc = TensorDescriptor(k, [t, k.shape[1] * dim], [k.stride(0), 1], [block_n, dim])
    v_desc = TensorDescriptor(v, [t, v.shape[1] * dim], [v.stride(0), 1], [block_n, dim])
    fresh_prefill_kernel[(num_work, h)](
        q_desc,
        k_desc,
        v_desc,
        query_start,
        work_seq,
        work_tile,
        out,
        cos_desc,
        sin_desc,
        out.stride(0),
        out.stride(1),
        scale_log2,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ROTARY=rotary is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **(ROUNDED_PRODUCTS if rotary is not None else {}),
    )
    return out
