"""The Triton kernels of the paged attention backend: KV write, decode (flash-decoding), prefill.

Launched by the wrappers in ``triton_paged``, which hold the launch settings. All kernels read
the KV cache in place through block tables, given the strides of one layer's view
``kv[:, layer]`` ([num_blocks, 2, block_size, kv_heads, head_dim]).

- The KV write (with or without the rotary embedding) is in ``triton_kv_write``.
- ``decode_kernel``: one program per (sequence, KV head, split) computes all query heads of that
  KV head (GQA: each K/V tile is loaded once for the whole group); with several splits
  ``decode_merge_kernel`` merges the partial softmaxes.
- ``prefill_kernel``: one program per (query tile of a sequence, query head); a query at
  position p attends to keys 0..p of its sequence, read from the cache.

FP8 caches (``KV_FP8``, a float8 e4m3 cache): the write kernels (``triton_kv_write``) divide by
the layer's K or V scale, clamp to e4m3's range and round; the attention kernels convert
the loaded tiles to the query's dtype (exact: every e4m3 value is a bf16/fp16/fp32 value), fold
the K scale into ``qk_scale`` (the wrapper does) and multiply the output by the V scale.

The batch-invariant mode (``triton_paged``'s ``batch_invariant`` arguments) sets two constexpr
flags: ``SPLIT_TOKENS`` > 0 makes decode's split count a function of the context alone (grid and
partial buffers stay batch-shaped; splits past a context's count store nothing and are not
merged), and ``MASK_EVERY_TILE`` runs every key tile of prefill through the masked code, so a
key tile is reduced by the same instructions whichever query tile, and so whichever chunk, a row
sits in.

Defined only where Triton is installed (``HAS_TRITON``); the module imports without it.
"""

from __future__ import annotations

from pdinfer.layers.triton_ops import HAS_TRITON, tl, triton

if HAS_TRITON:
    from pdinfer.layers.attention.triton_kv_write import cache_value
    from pdinfer.layers.triton_ops import rotate_full

    @triton.jit
    def _attend_one_key(q, k, v, present, qk_scale, m_i, l_i, acc):
        """One more step of the online softmax of ``q`` [G, D] for a single key ``k`` and value
        ``v`` [D] (as the cache stores them), when ``present``; else (m_i, l_i, acc) unchanged."""
        k = k.to(q.dtype).to(tl.float32)
        s = tl.sum(q.to(tl.float32) * k[None, :], axis=1) * qk_scale
        s = tl.where(present, s, float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row: no keys at all
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s - m_ref)
        v = v.to(q.dtype).to(tl.float32)
        acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v[None, :]
        return m_new, l_i * alpha + p, acc

    @triton.jit(do_not_specialize=["stride_bt"])  # the table width changes every step
    def decode_kernel(
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
        v_scale,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr = False,
        SPLIT_TOKENS: tl.constexpr = 0,
        ROTARY: tl.constexpr = False,
        k_ptr=None,
        v_ptr=None,
        cos_ptr=None,
        sin_ptr=None,
        slot_ptr=None,
        stride_kt=0,
        stride_kh=0,
        stride_vt=0,
        stride_vh=0,
        stride_cos=0,
        k_scale_inv=1.0,
        v_scale_inv=1.0,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b)
        if SPLIT_TOKENS > 0:  # batch-invariant: the context alone sets its splits
            count = tl.maximum(tl.minimum(tl.cdiv(ctx, SPLIT_TOKENS), NUM_SPLITS), 1)
            split_len = tl.cdiv(tl.cdiv(ctx, count), BLOCK_N) * BLOCK_N
        else:
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
        q_rows = q_ptr + b64 * stride_qt + heads[:, None] * stride_qh
        qmask = gmask[:, None] & dmask[None, :]
        q = tl.load(q_rows + d[None, :], mask=qmask, other=0.0)
        loop_end = end
        if ROTARY:  # q and the new K arrive unrotated: rotate them here (see decode_attention)
            half = HEAD_DIM // 2
            first = d < half
            partner = tl.where(first, d + half, d - half)
            rot_cos = tl.load(cos_ptr + b64 * stride_cos + d % half, mask=dmask, other=0.0).to(tl.float32)
            rot_sin = tl.load(sin_ptr + b64 * stride_cos + d % half, mask=dmask, other=0.0).to(tl.float32)
            q_partner = tl.load(q_rows + partner[None, :], mask=qmask, other=0.0)
            q = rotate_full(q, q_partner, rot_cos[None, :], rot_sin[None, :], first[None, :])
            # The new token (position ctx - 1) belongs to one split: that program stores its K/V
            # into the slot and attends to it from registers, so no program reads it from the
            # cache in this launch (no store-then-load within the launch).
            last = ctx - 1
            owner = (start <= last) & (last < end)
            new_mask = d < tl.where(owner, HEAD_DIM, 0)  # the new token's elements, on its split only
            k_row = k_ptr + b64 * stride_kt + kvh * stride_kh
            k_new = tl.load(k_row + d, mask=new_mask, other=0.0)
            k_new = rotate_full(k_new, tl.load(k_row + partner, mask=new_mask, other=0.0), rot_cos, rot_sin, first)
            ty = cache_ptr.dtype.element_ty
            k_new = cache_value(k_new, k_scale_inv, ty, KV_FP8)  # as the cache holds it
            v_new = cache_value(
                tl.load(v_ptr + b64 * stride_vt + kvh * stride_vh + d, mask=new_mask), v_scale_inv, ty, KV_FP8
            )
            slot = tl.load(slot_ptr + b).to(tl.int64)
            dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kvh * stride_ch + d
            store_mask = d < tl.where(owner & (slot >= 0), HEAD_DIM, 0)  # slot -1: a graph's padding row
            tl.store(dst, k_new, mask=store_mask)
            tl.store(dst + stride_ckv, v_new, mask=store_mask)
            loop_end = tl.where(owner, last, end)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        k_base = cache_ptr + kvh * stride_ch
        for n0 in range(start, loop_end, BLOCK_N):
            pos = n0 + n
            pmask = pos < loop_end
            blk = tl.load(bt_ptr + b64 * stride_bt + pos // BLOCK_SIZE, mask=pmask, other=0)
            off = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct
            kv_mask = pmask[:, None] & dmask[None, :]
            k = tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if KV_FP8:
                k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(k_base + stride_ckv + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if ROTARY:  # the new token's key and value, held in registers (by its split only)
            m_i, l_i, acc = _attend_one_key(q, k_new, v_new, owner, qk_scale, m_i, l_i, acc)
        if KV_FP8:  # the merge of splits is linear in acc: scaling the partials is enough
            acc = acc * v_scale
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
            if SPLIT_TOKENS > 0:  # a split past the context's count: nothing to store
                gmask = gmask & (g * 0 + split < count)
                omask = gmask[:, None] & dmask[None, :]
            tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=omask)
            tl.store(part_ml_ptr + row * 2, m_i, mask=gmask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=gmask)

    @triton.jit
    def decode_merge_kernel(
        part_acc_ptr,
        part_ml_ptr,
        out_ptr,
        ctx_ptr,
        stride_ot,
        stride_oh,
        num_heads,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLIT_TOKENS: tl.constexpr = 0,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, D_PAD)
        row = (b * num_heads + h) * NUM_SPLITS + sp
        if SPLIT_TOKENS > 0:  # batch-invariant: the context's own splits only (as decode_kernel)
            ctx = tl.load(ctx_ptr + b)
            valid = sp < tl.maximum(tl.minimum(tl.cdiv(ctx, SPLIT_TOKENS), NUM_SPLITS), 1)
            m = tl.load(part_ml_ptr + row * 2, mask=valid, other=float("-inf"))
            l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=valid, other=0.0)
            acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + d[None, :], mask=valid[:, None], other=0.0)
        else:
            m = tl.load(part_ml_ptr + row * 2)
            l_s = tl.load(part_ml_ptr + row * 2 + 1)
            acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + d[None, :])
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row: no keys at all
        w = tl.math.exp2(m - m_max)
        den = tl.sum(w * l_s, axis=0)
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
        KV_FP8: tl.constexpr,
    ):
        n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + n
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < ctx, other=0)
            off = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct
            kv_mask = (pos < ctx)[:, None] & dmask[None, :]
            k = tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if KV_FP8:
                k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if MASKED:
                s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit(do_not_specialize=["stride_bt"])  # the table width changes every step
    def prefill_kernel(
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
        v_scale,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr = False,
        MASK_EVERY_TILE: tl.constexpr = False,
    ):
        # the tiles of one head are launched together: they read the same keys (measured faster
        # than launching the query heads of one K/V head together)
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
        if MASK_EVERY_TILE:  # batch-invariant: one code path for every key tile (module docstring)
            unmasked_end = first_q * 0
        else:
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
            KV_FP8,
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
            KV_FP8,
        )
        if KV_FP8:
            acc = acc * v_scale
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mmask[:, None] & dmask[None, :],
        )
