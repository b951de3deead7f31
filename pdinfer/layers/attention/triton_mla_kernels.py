"""The Triton kernels of multi-head latent attention (MLA) on CUDA: latent write and absorbed decode.

Launched by the wrappers in ``triton_mla``. One layer's view of the latent cache is
``[num_blocks, 1, block_size, 1, latent + rope]``: one vector per token, the kernels take its
block and token strides.

- ``write_latent_kernel``: one program per new token stores its vector into its slot (slot -1:
  skip, the padding rows of a CUDA-graph batch).
- ``mla_decode_kernel``: one program per (sequence, group of ``BLOCK_H`` heads, split). All heads
  share the one cached vector per token, so each latent tile is loaded once for the whole group
  and serves both products: scores = q_latent . latent + q_rope . rope, then the weighted sum
  of the latent. With several splits the dense backend's ``decode_merge_kernel`` merges the
  partial softmaxes (same partial layout).

Defined only where Triton is installed (``HAS_TRITON``); the module imports without it.
"""

from __future__ import annotations

from pdinfer.layers.triton_ops import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def write_latent_kernel(
        entries_ptr,
        cache_ptr,
        slot_ptr,
        stride_et,
        stride_cb,
        stride_ct,
        DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, D_PAD)
            mask = d < DIM
            x = tl.load(entries_ptr + t.to(tl.int64) * stride_et + d, mask=mask)
            dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + d
            tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def mla_decode_kernel(
        q_lat_ptr,
        q_rope_ptr,
        cache_ptr,
        bt_ptr,
        ctx_ptr,
        out_ptr,
        part_acc_ptr,
        part_ml_ptr,
        stride_qlb,
        stride_qlh,
        stride_qrb,
        stride_qrh,
        stride_cb,
        stride_ct,
        stride_bt,
        stride_ob,
        stride_oh,
        num_heads,
        qk_scale,
        LATENT: tl.constexpr,
        LATENT_PAD: tl.constexpr,
        ROPE: tl.constexpr,
        ROPE_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        group = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b)
        split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, ctx)

        heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
        r = tl.arange(0, LATENT_PAD)
        e = tl.arange(0, ROPE_PAD)
        n = tl.arange(0, BLOCK_N)
        hmask = heads < num_heads
        rmask = r < LATENT
        emask = e < ROPE
        b64 = b.to(tl.int64)
        q_lat = tl.load(
            q_lat_ptr + b64 * stride_qlb + heads[:, None] * stride_qlh + r[None, :],
            mask=hmask[:, None] & rmask[None, :],
            other=0.0,
        )
        q_rope = tl.load(
            q_rope_ptr + b64 * stride_qrb + heads[:, None] * stride_qrh + e[None, :],
            mask=hmask[:, None] & emask[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + n
            pmask = pos < end
            blk = tl.load(bt_ptr + b64 * stride_bt + pos // BLOCK_SIZE, mask=pmask, other=0)
            off = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct
            latent = tl.load(cache_ptr + off[:, None] + r[None, :], mask=pmask[:, None] & rmask[None, :], other=0.0)
            rope = tl.load(
                cache_ptr + off[:, None] + LATENT + e[None, :], mask=pmask[:, None] & emask[None, :], other=0.0
            )
            s = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
            s = tl.dot(q_rope, tl.trans(rope), acc=s, input_precision=PRECISION) * qk_scale
            s = tl.where(pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # the latent tile is also the value tile: W_UV is applied after the kernel
            acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
            m_i = m_new
        omask = hmask[:, None] & rmask[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(
                out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + r[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=omask,
            )
        else:
            # partials [B, H, NUM_SPLITS, LATENT_PAD] and (max, sum) [B, H, NUM_SPLITS, 2], contiguous
            row = (b64 * num_heads + heads) * NUM_SPLITS + split
            tl.store(part_acc_ptr + row[:, None] * LATENT_PAD + r[None, :], acc, mask=omask)
            tl.store(part_ml_ptr + row * 2, m_i, mask=hmask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=hmask)
