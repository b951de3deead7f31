"""The KV write of the CUDA attention backend: a step's new K/V into their cache slots.

The cache is the engine's one tensor ``[num_blocks, num_layers, 2, block_size, kv_heads,
head_dim]``; a layer's view ``kv[:, layer]`` is what the kernels take, with its strides.

- ``write_kv``: one program per new token stores its K and V into its slot (slot -1: skip, the
  padding rows of a CUDA-graph batch).
- ``rotary_write_kv``: the same after rotating Q and K in place (the rotary embedding and the
  KV write in one launch, the values of ``triton_ops.rotary_qk_`` then ``write_kv`` bit for bit);
  with ``rotate_q=False`` Q is left as it is, for an attention kernel that rotates its query
  tiles as it loads them (``triton_prefill``: one pass over Q fewer).

An FP8 cache (``float8_e4m3fn``) stores k / k_scale and v / v_scale, clamped to e4m3's range
and rounded (round to nearest even); ``layers/fp8.py`` says why the scales are static.
"""

from __future__ import annotations

import torch

from pdinfer.layers.triton_ops import HAS_TRITON, ROUNDED_PRODUCTS, next_pow2, tl, triton

if HAS_TRITON:
    from pdinfer.layers.triton_ops import rotate_halves

    @triton.jit
    def cache_value(x, scale_inv, ty, KV_FP8: tl.constexpr):
        """``x`` as the cache stores it: an FP8 cache's divided by the scale and clamped to
        e4m3's range (it has no infinity) before the cast rounds it."""
        if KV_FP8:
            x = tl.minimum(tl.maximum(x.to(tl.float32) * scale_inv, -448.0), 448.0)
        return x.to(ty)

    @triton.jit
    def write_kv_kernel(
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
        k_scale_inv,
        v_scale_inv,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        KV_FP8: tl.constexpr = False,
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
            ty = cache_ptr.dtype.element_ty
            tl.store(dst, cache_value(k, k_scale_inv, ty, KV_FP8), mask=mask)
            tl.store(dst + stride_ckv, cache_value(v, v_scale_inv, ty, KV_FP8), mask=mask)

    @triton.jit
    def rotary_write_kv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        cache_ptr,
        slot_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cos,
        stride_cb,
        stride_ckv,
        stride_ct,
        stride_ch,
        num_q_heads,
        num_kv_heads,
        k_scale_inv,
        v_scale_inv,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        Q_HEADS_PAD: tl.constexpr,
        KV_HEADS_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        KV_FP8: tl.constexpr = False,
        ROTATE_Q: tl.constexpr = True,
    ):
        """Program (t, 0) rotates token t's query heads in place; program (t, 1) rotates its key
        heads in place and stores them, with its value heads, into the token's slot (the
        rotation is ``rotate_halves``, so the values are ``_rotary_qk_kernel``'s bit for bit).
        Without ``ROTATE_Q`` the grid is (T, 1) and its programs do the keys' part."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF_PAD)
        dmask = d < HALF
        c = tl.load(cos_ptr + t * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        if ROTATE_Q and tl.program_id(1) == 0:  # (names apart from the other branch's: their shapes differ)
            qh = tl.arange(0, Q_HEADS_PAD)
            qmask = (qh[:, None] < num_q_heads) & dmask[None, :]
            qp = q_ptr + t * stride_qt + qh[:, None] * stride_qh + d[None, :]
            r1, r2 = rotate_halves(tl.load(qp, mask=qmask), tl.load(qp + HALF, mask=qmask), c, s)
            tl.store(qp, r1, mask=qmask)
            tl.store(qp + HALF, r2, mask=qmask)
        else:
            heads = tl.arange(0, KV_HEADS_PAD)
            mask = (heads[:, None] < num_kv_heads) & dmask[None, :]
            ptr = k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :]
            k1, k2 = rotate_halves(tl.load(ptr, mask=mask), tl.load(ptr + HALF, mask=mask), c, s)
            tl.store(ptr, k1, mask=mask)
            tl.store(ptr + HALF, k2, mask=mask)
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:  # -1: a CUDA graph's padding row
                vp = v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :]
                dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
                dst = dst + heads[:, None] * stride_ch + d[None, :]
                ty = cache_ptr.dtype.element_ty
                tl.store(dst, cache_value(k1, k_scale_inv, ty, KV_FP8), mask=mask)
                tl.store(dst + HALF, cache_value(k2, k_scale_inv, ty, KV_FP8), mask=mask)
                v1, v2 = tl.load(vp, mask=mask), tl.load(vp + HALF, mask=mask)
                tl.store(dst + stride_ckv, cache_value(v1, v_scale_inv, ty, KV_FP8), mask=mask)
                tl.store(dst + stride_ckv + HALF, cache_value(v2, v_scale_inv, ty, KV_FP8), mask=mask)


def is_fp8(layer_cache: torch.Tensor) -> bool:
    return layer_cache.dtype == torch.float8_e4m3fn


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store k/v [T, KVH, D] into ``layer_cache`` [num_blocks, 2, block_size, KVH, D]; an FP8
    cache stores k / k_scale and v / v_scale."""
    t, kvh, dim = k.shape
    if t == 0:
        return
    c = layer_cache
    write_kv_kernel[(t,)](
        k,
        v,
        c,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *c.stride()[:4],  # block, K/V, slot, head
        kvh,
        1.0 / k_scale,
        1.0 / v_scale,
        BLOCK_SIZE=c.shape[2],
        HEAD_DIM=dim,
        D_PAD=next_pow2(dim),
        HEADS_PAD=next_pow2(kvh),
        KV_FP8=is_fp8(c),
        num_warps=4,
    )


def check_rotary_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor) -> None:
    """The kernels that rotate q and k take a full-width rotary and unit stride in the head dim."""
    dim = q.shape[-1]
    if cos.shape[-1] != dim or dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the fused rotary kernels need a full-width rotary and unit stride in the head dim")


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    rotate_q: bool = True,
) -> None:
    """``rotary_qk_(q, k, cos, sin)`` then ``write_kv(k, v, ...)`` in one launch, the same values
    bit for bit: q [T, H, D] and k [T, KVH, D] rotated in place (strided views of one QKV
    output, unit stride in the last dim), the rotated k and v stored into their slots. The
    rotary embedding must cover the whole head (``cos`` [T, D]). ``rotate_q=False``: q is left
    unrotated (its attention kernel rotates it)."""
    t, h, dim = q.shape
    kvh = k.shape[1]
    if t == 0:
        return
    check_rotary_shapes(q, k, v, cos)
    c = layer_cache
    half = dim // 2
    rotary_write_kv_kernel[(t, 2 if rotate_q else 1)](
        q,
        k,
        v,
        cos,
        sin,
        c,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        *c.stride()[:4],
        h,
        kvh,
        1.0 / k_scale,
        1.0 / v_scale,
        HALF=half,
        HALF_PAD=next_pow2(half),
        Q_HEADS_PAD=next_pow2(h),
        KV_HEADS_PAD=next_pow2(kvh),
        BLOCK_SIZE=c.shape[2],
        KV_FP8=is_fp8(c),
        ROTATE_Q=rotate_q,
        num_warps=4,
        **ROUNDED_PRODUCTS,
    )
