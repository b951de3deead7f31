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

An FP8 cache (``float8_e4m3fn``, ``kv_cache_dtype="fp8"``) takes the same kernels with
``KV_FP8`` set: quantized on write, dequantized in registers on read, with the layer's static K
and V scales (``layers/fp8.py`` says why static, and 1.0).

The batch-invariant mode (``EngineArgs(batch_invariant=True)``, ``GpuAttentionMetadata.
batch_invariant``) keeps a row's reduction order free of its batch and of how its prompt was
chunked:
- decode: a context of ``ctx`` tokens is cut into ``min(BI_MAX_SPLITS, ceil(ctx /
  BI_SPLIT_TOKENS))`` splits (of ``BLOCK_N``-rounded equal length), whatever the batch; the merge
  reads those splits only, in one fixed-shape reduction. The grid's split dimension
  (``batch_invariant_splits``: from the longest context of the step, or of the model for a CUDA
  graph) only has to be large enough: a program past its row's count stores nothing.
- prefill: every key tile goes through the masked code path (``MASK_EVERY_TILE``); key tiles
  start at multiples of ``BLOCK_N`` from the first key whatever the chunk, and a tile entirely
  after a row's position adds exact zeros to it, so a row's keys are reduced alike in any chunk.
  In this mode a prompt step always runs the prefill kernel, even when all its chunks are one
  token long (the default mode runs such a step as a decode).
A prompt row and the decode row of the same position still reduce differently (two kernels),
as on the CPU; a sequence recomputed after preemption may therefore change its last bits.

The ``@triton.jit`` kernels live in ``triton_kernels`` (the KV write's in ``triton_kv_write``);
this module holds the per-step metadata, the launch settings and wrappers, and the backend
class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdinfer.layers.attention import triton_kernels as kernels
from pdinfer.layers.attention.triton_kv_write import check_rotary_shapes, is_fp8, rotary_write_kv, write_kv
from pdinfer.layers.attention.triton_prefill import (
    fresh_prefill_attention,
    fresh_prefill_supported,
    fresh_rotary_supported,
)
from pdinfer.layers.triton_ops import HAS_TRITON, ROUNDED_PRODUCTS, next_pow2

LOG2E = 1.4426950408889634


@dataclass
class GpuAttentionMetadata:
    """One step's attention inputs, all on the device, built once per step (not per layer)."""

    is_decode: bool  # one query per sequence, query row i belongs to sequence i
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset); -1 = no write
    block_tables: torch.Tensor  # [S, max_blocks] int
    context_lens: torch.Tensor  # [S] int: cached prefix + this step's tokens
    num_splits: int = 1  # decode: KV splits per sequence (flash-decoding); the grid's in batch_invariant
    query_start: torch.Tensor | None = None  # prefill: [S + 1] cumulative query rows
    work_seq: torch.Tensor | None = None  # prefill: [W] sequence of each query tile
    work_tile: torch.Tensor | None = None  # prefill: [W] tile index inside its sequence
    num_work: int = 0
    num_tokens: int = 0
    # MLA prefill (``triton_mla``): the cache blocks of each sequence's context, sequence after
    # sequence ([NB]), and the first token row of each sequence's context among them ([S])
    context_blocks: torch.Tensor | None = None
    context_starts: torch.Tensor | None = None
    batch_invariant: bool = False  # the mode's kernels (module docstring)
    fresh: bool = False  # prefill: no sequence has a cached prefix (``triton_prefill``'s case)


PREFILL_BLOCK_M = 128  # query rows per prefill program; the metadata builder tiles with it
# Launch settings (benchmarks/gpu_suite.py times alternatives; change them only with a measurement).
DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2}
PREFILL_CONFIG = {"block_n": 128, "num_warps": 8, "num_stages": 3}


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int | None = None, num_sms: int = 132) -> int:
    """Splits per sequence so that a decode launch has about two programs per multiprocessor:
    more splits add programs and merge work without making a launch shorter (docs/performance.md).

    Depends on the batch (and, outside CUDA graphs, on the longest context: a short context is
    not worth splitting).
    """
    programs = max(1, batch * num_kv_heads)
    splits = min(32, next_pow2(-(-2 * num_sms // programs)))
    if max_context is not None:
        splits = min(splits, next_pow2(max(1, -(-max_context // 256))))
    return max(1, splits)


# The batch-invariant decode: splits of about this many tokens, at most this many per context.
BI_SPLIT_TOKENS = 512
BI_MAX_SPLITS = 16


def batch_invariant_splits(max_context: int) -> int:
    """The split dimension of a batch-invariant decode grid whose longest context is
    ``max_context``: every row's own split count fits in it (the count is the row's alone)."""
    return max(1, min(BI_MAX_SPLITS, -(-max_context // BI_SPLIT_TOKENS)))


def _precision(q: torch.Tensor) -> str:
    # float32 models get exact float32 dots (Triton's default for them is tf32)
    return "ieee" if q.dtype == torch.float32 else "tf32"


def decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    batch_invariant: bool = False,
    rotary: DecodeRotary | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one query per sequence) -> out [B, H, D]; ``k_scale``/``v_scale``: an FP8
    cache's dequantization scales. ``batch_invariant``: each row's splits from its context alone;
    ``num_splits`` is then the grid's split dimension, at least ``batch_invariant_splits`` of the
    longest context. ``rotary``: q and the step's new K come unrotated and the new K/V are not in
    the cache yet; the kernel rotates q in registers (q is left as it is), and the program whose
    split holds a row's last position rotates that token's K, stores it with its V into the slot
    and attends to them from registers (nothing is read back in the launch): ``rotary_write_kv``
    and the attention in one launch, one kernel fewer a layer in every decode step. The cache
    and the rotated q are ``rotary_write_kv``'s bit for bit (the launch is compiled without FMA
    contraction, ``ROUNDED_PRODUCTS``); the output equals the pair's up to rounding (the new
    token's score is summed elementwise, not by the tiles' dot)."""
    b, h, dim = q.shape
    c = layer_cache
    kvh = c.shape[3]
    group = h // kvh
    d_pad = next_pow2(dim)
    if out is None:
        out = torch.empty((b, h, dim), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if rotary is not None:
        check_rotary_shapes(q, rotary.k, rotary.v, rotary.cos)
    splits = BI_MAX_SPLITS if batch_invariant else num_splits  # the partial buffers' and the merge's
    split_tokens = BI_SPLIT_TOKENS if batch_invariant else 0
    part_acc, part_ml = split_buffers(out, splits, d_pad)
    cfg = DECODE_CONFIG
    block_n = cfg["block_n"] if d_pad <= 128 else 32
    kernels.decode_kernel[(b, kvh, num_splits)](
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
        scale * LOG2E * (k_scale if is_fp8(c) else 1.0),
        v_scale,
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=dim,
        D_PAD=d_pad,
        BLOCK_SIZE=c.shape[2],
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        PRECISION=_precision(q),
        KV_FP8=is_fp8(c),
        SPLIT_TOKENS=split_tokens,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **({} if rotary is None else {**ROUNDED_PRODUCTS, **rotary.kernel_args(k_scale, v_scale)}),
    )
    merge_splits(part_acc, part_ml, out, splits, d_pad, context_lens if batch_invariant else None)
    return out


@dataclass
class DecodeRotary:
    """What ``decode_attention`` needs to rotate q and write the new K/V itself: the step's
    unrotated k and v [B, KVH, D], the full-width cos/sin [B, D] of its positions and its slots."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor

    def kernel_args(self, k_scale: float, v_scale: float) -> dict:
        k, v = self.k, self.v
        return {
            "ROTARY": True,
            "k_ptr": k,
            "v_ptr": v,
            "cos_ptr": self.cos,
            "sin_ptr": self.sin,
            "slot_ptr": self.slot_mapping,
            "stride_kt": k.stride(0),
            "stride_kh": k.stride(1),
            "stride_vt": v.stride(0),
            "stride_vh": v.stride(1),
            "stride_cos": self.cos.stride(0),
            "k_scale_inv": 1.0 / k_scale,
            "v_scale_inv": 1.0 / v_scale,
        }


def split_buffers(out: torch.Tensor, num_splits: int, d_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding's per-split partial sums and (max, sum) pairs for ``out`` [b, h, dim];
    with one split the kernel writes ``out`` itself and these are not read."""
    if num_splits <= 1:
        return out, out
    b, h = out.shape[:2]
    acc = torch.empty((b, h, num_splits, d_pad), dtype=torch.float32, device=out.device)
    return acc, torch.empty((b, h, num_splits, 2), dtype=torch.float32, device=out.device)


def merge_splits(
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    d_pad: int,
    context_lens: torch.Tensor | None = None,
) -> None:
    """Joins the splits of a decode into ``out`` [b, h, dim] (nothing to do for one split).
    ``context_lens``: the batch-invariant decode, whose rows have their own split counts."""
    if num_splits <= 1:
        return
    b, h, dim = out.shape
    kernels.decode_merge_kernel[(b, h)](
        part_acc,
        part_ml,
        out,
        context_lens if context_lens is not None else part_ml,
        out.stride(0),
        out.stride(1),
        h,
        HEAD_DIM=dim,
        D_PAD=d_pad,
        NUM_SPLITS=num_splits,
        SPLIT_TOKENS=BI_SPLIT_TOKENS if context_lens is not None else 0,
        num_warps=4,
    )


def prefill_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: GpuAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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
    # A third stage of 16-bit 128 x 128 tiles fits (224 KiB at head_dim 128) and is faster
    # (docs/performance.md#measurements-behind-design-choices); fp32 tiles and wider heads keep two.
    stages = cfg["num_stages"] if q.element_size() <= 2 and d_pad <= 128 else 2
    bt = meta.block_tables
    kernels.prefill_kernel[(meta.num_work, h)](
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
        scale * LOG2E * (k_scale if is_fp8(c) else 1.0),
        v_scale,
        GROUP=group,
        HEAD_DIM=dim,
        D_PAD=d_pad,
        BLOCK_SIZE=c.shape[2],
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=block_n,
        PRECISION=_precision(q),
        KV_FP8=is_fp8(c),
        MASK_EVERY_TILE=meta.batch_invariant,
        num_warps=warps,
        num_stages=stages,
    )
    return out


class TritonPagedAttention:
    """The CUDA backend behind the same ``forward(q, k, v, layer_cache, meta)`` as the torch one."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # An FP8 cache's per-layer scales: static, 1.0 (layers/fp8.py); unused for other caches.
        self.k_scale = 1.0
        self.v_scale = 1.0

    # ``forward`` takes ``rotary``: the rotary embedding goes into the KV write's kernel
    fuses_rotary = True
    # and at decode the KV write with it into the attention kernel (benchmarks/gpu_floor.py
    # switches it off to time the difference). Each row's program writes only its own new K/V,
    # so an engine whose decode steps hold several rows of one sequence (speculative decoding's
    # verifying steps: row i reads what rows < i write) turns it off (``use_triton_attention``).
    decode_writes_kv = True
    # and a fresh prompts' step rotates its queries in the prefill attention kernel (the KV
    # write's kernel then rotates only the keys); benchmarks switch it off to compare
    fresh_rotates_q = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: GpuAttentionMetadata,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``rotary``: (cos, sin) of a full-width rotary embedding that q and k still need
        (rotated in place by the KV write's kernel, or at decode inside the attention kernel);
        None: q and k come rotated."""
        ks, vs = self.k_scale, self.v_scale
        out = torch.empty((q.shape[0], self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        qs, ws, wt = meta.query_start, meta.work_seq, meta.work_tile
        fresh = (
            not meta.is_decode
            and meta.fresh
            and not meta.batch_invariant
            and not is_fp8(layer_cache)
            and qs is not None
            and ws is not None
            and wt is not None
            and fresh_prefill_supported(q, k, v)
        )
        # Fresh prompts' queries are rotated by their attention kernel as it loads them (one pass
        # over Q fewer), the keys by the KV write's kernel.
        rotates_q = fresh and rotary is not None and self.fresh_rotates_q and fresh_rotary_supported(*rotary)
        q_rotary = rotary if rotates_q else None
        # At decode the attention kernel rotates and writes the new K/V itself (one launch); FP8
        # caches keep the pair: on them the one launch is slower
        # (docs/performance.md#measurements-behind-design-choices).
        fused = None
        if meta.is_decode and rotary is not None and self.decode_writes_kv and not is_fp8(layer_cache):
            fused = DecodeRotary(k, v, rotary[0], rotary[1], meta.slot_mapping)
        elif rotary is not None:  # new K/V first: queries read their chunk (and same-step prefix hits) from the cache
            rotary_write_kv(q, k, v, rotary[0], rotary[1], layer_cache, meta.slot_mapping, ks, vs, q_rotary is None)
        else:
            write_kv(k, v, layer_cache, meta.slot_mapping, ks, vs)
        if meta.is_decode:
            return decode_attention(
                q,
                layer_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                meta.num_splits,
                out,
                ks,
                vs,
                meta.batch_invariant,
                fused,
            )
        if fresh:
            assert qs is not None and ws is not None and wt is not None
            return fresh_prefill_attention(
                q, k, v, qs, ws, wt, meta.num_work, self.scale * LOG2E, PREFILL_BLOCK_M, out, q_rotary
            )
        return prefill_attention(q, layer_cache, meta, self.scale, out, ks, vs)


def use_triton_attention(model: torch.nn.Module, verifies_drafts: bool = False) -> None:
    """Give every attention layer of ``model`` the Triton backend (CUDA engines).
    ``verifies_drafts``: decode steps may hold several rows of one sequence, so every row's K/V
    is written before any row attends (no ``DecodeRotary``)."""
    if not HAS_TRITON:
        raise RuntimeError("CUDA inference needs Triton: pip install triton")
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if backend is not None and hasattr(backend, "num_kv_heads"):
            new_backend = TritonPagedAttention(backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale)
            if verifies_drafts:
                new_backend.decode_writes_kv = False
            # the backend is a plain object, which nn.Module's attribute type (Tensor | Module) omits
            module.backend = new_backend  # type: ignore[assignment]
