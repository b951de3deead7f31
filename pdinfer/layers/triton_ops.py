"""Fused elementwise kernels for CUDA (Triton): RMSNorm (alone and after the residual add), rotary
embedding of Q and K, SiLU-and-mul.

Each replaces 5-10 small torch kernels with one. The rounding follows the Hugging Face bf16
reference step by step (each product rounded to the activation dtype where torch rounds it), so
the fused path and transformers agree bit for bit on most elements.

Triton is optional: on a machine without it ``HAS_TRITON`` is False and callers keep the torch
code. Tests run these kernels on the CPU with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the torch path is used
    triton = tl = None
    HAS_TRITON = False


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Launch option of the kernels that rotate (``rotate_halves``, ``rotate_full``): no contraction
# of a multiply and an add into one FMA. HF's bf16 rotary rounds each product to bf16 before the
# sum; with contraction allowed, the compiler turns round(x * cos) - round(y * sin) into one bf16
# FMA that skips the first rounding, and the rotated K then differs from transformers' by a bf16
# step (docs/performance.md#measurements-behind-design-choices). The interpreter, which the CPU
# tests run, never contracts, so benchmarks/gpu_floor.py checks the kernels against torch on the
# device.
ROUNDED_PRODUCTS = {"enable_fp_fusion": False}

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, n_cols, eps, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        total = (r + x).to(res_ptr.dtype.element_ty)  # rounded as torch's residual add rounds it
        tl.store(res_ptr + row * stride_res + cols, total, mask=mask)
        s = total.to(tl.float32)
        var = tl.sum(s * s, axis=0) / n_cols
        normed = (s * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_heads(
        x_ptr,
        row,
        stride_t,
        stride_h,
        num_heads,
        c,
        s,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        HEADS_PAD: tl.constexpr,
    ):
        heads = tl.arange(0, HEADS_PAD)
        d = tl.arange(0, HALF_PAD)
        mask = (heads[:, None] < num_heads) & (d[None, :] < HALF)
        ptr = x_ptr + row * stride_t + heads[:, None] * stride_h + d[None, :]
        x1 = tl.load(ptr, mask=mask, other=0.0)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
        r1, r2 = rotate_halves(x1, x2, c, s)
        tl.store(ptr, r1, mask=mask)
        tl.store(ptr + HALF, r2, mask=mask)

    @triton.jit
    def rotate_halves(x1, x2, c, s):
        """The two halves of a head rotated: x * cos + rotate_half(x) * sin, in x's dtype.
        Kernels that call it launch with ``ROUNDED_PRODUCTS`` (see there)."""
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        # each product rounded as torch rounds it in bf16
        a1 = (x1 * c).to(dtype).to(tl.float32)
        b1 = (x2 * s).to(dtype).to(tl.float32)
        a2 = (x2 * c).to(dtype).to(tl.float32)
        b2 = (x1 * s).to(dtype).to(tl.float32)
        return (a1 - b1).to(dtype), (a2 + b2).to(dtype)

    @triton.jit
    def rotate_full(x, partner, c, s, first):
        """``rotate_halves`` on whole heads: ``partner`` is x with its halves swapped, ``c``/``s``
        the half-width cos/sin repeated over both halves, ``first`` where the first half is;
        each element's value is ``rotate_halves``'s bit for bit (with ``ROUNDED_PRODUCTS``)."""
        dtype = x.dtype
        a = (x.to(tl.float32) * c).to(dtype).to(tl.float32)
        b = (partner.to(tl.float32) * s).to(dtype).to(tl.float32)
        return tl.where(first, a - b, a + b).to(dtype)

    @triton.jit
    def _rotary_qk_kernel(
        q_ptr,
        k_ptr,
        cos_ptr,
        sin_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_ct,
        num_q_heads,
        num_k_heads,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        HEADS_PAD: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF_PAD)
        dmask = d < HALF
        # cos/sin are cat(freqs, freqs): the first half serves both halves of a head
        c = tl.load(cos_ptr + row * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + row * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        if tl.program_id(1) == 0:
            _rotate_heads(q_ptr, row, stride_qt, stride_qh, num_q_heads, c, s, HALF, HALF_PAD, HEADS_PAD)
        else:
            _rotate_heads(k_ptr, row, stride_kt, stride_kh, num_k_heads, c, s, HALF, HALF_PAD, HEADS_PAD)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = gate.dtype
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dimension, in one kernel."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        n = shape[-1]
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), n, eps, BLOCK=next_pow2(n), num_warps=4 if n <= 4096 else 8
        )
    return out.view(shape)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then ``rms_norm(residual)``: the residual add and the next
    norm in one kernel (two fewer passes over the hidden states, one launch fewer). Both are
    [T, hidden] with unit stride along hidden; the sum is rounded to the residual's dtype before
    the norm reads it, as the unfused ``x + h`` then ``rms_norm`` does, so the two agree bit for bit."""
    if x.shape != residual.shape or x.stride(-1) != 1 or residual.stride(-1) != 1 or x.dim() != 2:
        raise ValueError(f"add_rms_norm_ takes two [T, hidden] row-major tensors, got {x.shape} and {residual.shape}")
    out = torch.empty_like(residual)
    if residual.shape[0]:
        n = residual.shape[-1]
        _add_rms_norm_kernel[(residual.shape[0],)](
            x,
            residual,
            weight,
            out,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            n,
            eps,
            BLOCK=next_pow2(n),
            num_warps=4 if n <= 4096 else 8,
        )
    return out


def rotary_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [T, H, D] and k [T, KVH, D] in place (rotate-half form); returns (q, k).

    q and k may be strided views (e.g. splits of one fused QKV output); the last dim must be
    contiguous. Only the first ``cos.shape[-1]`` dims of a head rotate (partial rotary).
    """
    t = q.shape[0]
    rotary_dim = cos.shape[-1]
    if t == 0:
        return q, k
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(0) != cos.stride(0):
        raise ValueError("rotary_qk_ needs unit stride in the last dim and matching cos/sin")
    half = rotary_dim // 2
    heads_pad = next_pow2(max(q.shape[1], k.shape[1]))
    _rotary_qk_kernel[(t, 2)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        q.shape[1],
        k.shape[1],
        HALF=half,
        HALF_PAD=next_pow2(half),
        HEADS_PAD=heads_pad,
        num_warps=4,
        **ROUNDED_PRODUCTS,
    )
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = cat(gate, up)`` along the last dim."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(2048, next_pow2(n))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], n)
