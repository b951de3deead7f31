"""The Triton kernels of multi-head latent attention (MLA) on CUDA: latent write, prefill, decode.

Launched by the wrappers in ``triton_mla``. One layer's view of the latent cache is
``[num_blocks, 1, block_size, 1, latent + rope]``: one vector per token, the kernels take its
block and token strides.

- ``write_latent_kernel``: one program per new token stores its vector into its slot (slot -1:
  skip, the padding rows of a CUDA-graph batch).
- ``mla_prefill_kernel``: one program per (query tile of a sequence, head) over the context
  the wrapper decompressed: per-head K_nope and V side by side in ``kv`` [N, H, nope + v], the
  shared rope key [N, rope] beside them (no copy per head); a sequence's context is the rows
  ``cstart[seq]`` onwards. A query at position p attends to keys 0..p (bottom-right causal).
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

    @triton.jit(do_not_specialize=["stride_bt"])  # the table width changes every step
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

    @triton.jit
    def _mla_prefill_tile(
        q_nope,
        q_rope,
        acc,
        m_i,
        l_i,
        kv_head,
        k_rope_ptr,
        c0,
        lo,
        hi,
        q_pos,
        ctx,
        dn,
        de,
        dv,
        stride_kv_t,
        stride_kr_t,
        qk_scale,
        NOPE: tl.constexpr,
        ROPE: tl.constexpr,
        V_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + n
            pmask = pos < ctx
            rows = (c0 + pos).to(tl.int64)
            k_nope = tl.load(
                kv_head + rows[:, None] * stride_kv_t + dn[None, :],
                mask=pmask[:, None] & (dn < NOPE)[None, :],
                other=0.0,
            )
            k_rope = tl.load(
                k_rope_ptr + rows[:, None] * stride_kr_t + de[None, :],
                mask=pmask[:, None] & (de < ROPE)[None, :],
                other=0.0,
            )
            s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PRECISION)
            s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=PRECISION) * qk_scale
            if MASKED:
                s = tl.where((pos[None, :] <= q_pos[:, None]) & pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                kv_head + NOPE + rows[:, None] * stride_kv_t + dv[None, :],
                mask=pmask[:, None] & (dv < V_DIM)[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def mla_prefill_kernel(
        q_nope_ptr,
        q_rope_ptr,
        kv_ptr,
        k_rope_ptr,
        ctx_ptr,
        qstart_ptr,
        cstart_ptr,
        work_seq_ptr,
        work_tile_ptr,
        out_ptr,
        stride_qn_t,
        stride_qn_h,
        stride_qr_t,
        stride_qr_h,
        stride_kv_t,
        stride_kv_h,
        stride_kr_t,
        stride_ot,
        stride_oh,
        qk_scale,
        NOPE: tl.constexpr,
        NOPE_PAD: tl.constexpr,
        ROPE: tl.constexpr,
        ROPE_PAD: tl.constexpr,
        V_DIM: tl.constexpr,
        V_PAD: tl.constexpr,
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
        c0 = tl.load(cstart_ptr + seq)
        prefix = ctx - qlen

        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        dn = tl.arange(0, NOPE_PAD)
        de = tl.arange(0, ROPE_PAD)
        dv = tl.arange(0, V_PAD)
        mmask = m < qlen
        rows = (q0 + m).to(tl.int64)
        q_nope = tl.load(
            q_nope_ptr + rows[:, None] * stride_qn_t + h * stride_qn_h + dn[None, :],
            mask=mmask[:, None] & (dn < NOPE)[None, :],
            other=0.0,
        )
        q_rope = tl.load(
            q_rope_ptr + rows[:, None] * stride_qr_t + h * stride_qr_h + de[None, :],
            mask=mmask[:, None] & (de < ROPE)[None, :],
            other=0.0,
        )
        q_pos = prefix + m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)
        kv_head = kv_ptr + h * stride_kv_h
        # keys before the tile's first query position are visible to every row: no causal mask
        first_q = prefix + tile * BLOCK_M
        unmasked_end = (first_q // BLOCK_N) * BLOCK_N
        hi = tl.minimum(ctx, first_q + BLOCK_M)
        acc, m_i, l_i = _mla_prefill_tile(
            q_nope,
            q_rope,
            acc,
            m_i,
            l_i,
            kv_head,
            k_rope_ptr,
            c0,
            0,
            unmasked_end,
            q_pos,
            ctx,
            dn,
            de,
            dv,
            stride_kv_t,
            stride_kr_t,
            qk_scale,
            NOPE,
            ROPE,
            V_DIM,
            BLOCK_N,
            False,
            PRECISION,
        )
        acc, m_i, l_i = _mla_prefill_tile(
            q_nope,
            q_rope,
            acc,
            m_i,
            l_i,
            kv_head,
            k_rope_ptr,
            c0,
            unmasked_end,
            hi,
            q_pos,
            ctx,
            dn,
            de,
            dv,
            stride_kv_t,
            stride_kr_t,
            qk_scale,
            NOPE,
            ROPE,
            V_DIM,
            BLOCK_N,
            True,
            PRECISION,
        )
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mmask[:, None] & (dv < V_DIM)[None, :],
        )
