"""Multi-head latent attention (DeepSeek-V2/V3) on CUDA: the Triton backend of ``MLAttention``.

Same two paths as the CPU backend (``mla``), over the same latent cache (one vector per token
and layer: the normalized latent, then the rotated shared key):
- **Decode absorbs.** W_UK takes q_nope into latent space (one batched matmul for all heads),
  ``mla_decode_kernel`` attends over the cached vectors straight from the block tables
  (flash-decoding splits, merged by the dense backend's merge kernel), and W_UV takes the
  weighted latent sum out. The grid depends on the batch only, so the step is CUDA-graph safe.
- **Prefill decompresses.** The blocks holding each sequence's context (cached prefix and this
  chunk, written first) are gathered in one ``index_select``, ``kv_b_proj`` turns their latents
  into per-head K_nope and V, and ``mla_prefill_kernel`` attends over those and the shared rope
  key (read where it was gathered, never copied per head), bottom-right causal, all sequences
  in one launch: variable lengths, chunks and prefix hits are the same case.

The kernels live in ``triton_mla_kernels``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdinfer.layers.attention import triton_mla_kernels as kernels
from pdinfer.layers.attention.mla import MLAPagedAttention
from pdinfer.layers.attention.triton_paged import (
    LOG2E,
    PREFILL_BLOCK_M,
    GpuAttentionMetadata,
    merge_splits,
    split_buffers,
)
from pdinfer.layers.triton_ops import next_pow2

# Heads per decode program: they share each latent tile (tl.dot needs at least 16 rows).
MLA_BLOCK_H = 16
# Launch settings; benchmarks/gpu_mla.py times the kernel against its memory floor.
MLA_DECODE_CONFIG = {"block_n": 32, "num_warps": 4, "num_stages": 2}
# Prefill: query tiles of PREFILL_BLOCK_M rows (the input builder's tiling); key tiles of
# nope + rope + v (320 for DeepSeek-V2/V3) bf16 values per row; half as many rows for fp32.
MLA_PREFILL_CONFIG = {"block_n": 64, "num_warps": 8, "num_stages": 2}


def mla_decode_programs(num_heads: int) -> int:
    """Decode programs per sequence and split (what ``decode_num_splits`` calls KV heads)."""
    return -(-num_heads // MLA_BLOCK_H)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def write_latent(entries: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``entries`` [T, latent + rope] into ``layer_cache`` [num_blocks, 1, block_size, 1, latent + rope]."""
    t, dim = entries.shape
    if t == 0:
        return
    c = layer_cache
    kernels.write_latent_kernel[(t,)](
        entries,
        c,
        slot_mapping,
        entries.stride(0),
        c.stride(0),
        c.stride(2),
        DIM=dim,
        D_PAD=next_pow2(dim),
        BLOCK_SIZE=c.shape[2],
        num_warps=4,
    )


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_latent [B, H, latent] and q_rope [B, H, rope] (any strides, last dim contiguous) -> the
    softmax-weighted latent sum [B, H, latent] (``out`` may be a strided view, e.g. of [H, B, latent])."""
    b, h, latent = q_latent.shape
    rope = q_rope.shape[-1]
    c = layer_cache
    latent_pad = next_pow2(latent)
    if out is None:
        out = torch.empty((b, h, latent), dtype=q_latent.dtype, device=q_latent.device)
    if b == 0:
        return out
    part_acc, part_ml = split_buffers(out, num_splits, latent_pad)
    cfg = MLA_DECODE_CONFIG
    kernels.mla_decode_kernel[(b, mla_decode_programs(h), num_splits)](
        q_latent,
        q_rope,
        c,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_ml,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        c.stride(0),
        c.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        h,
        scale * LOG2E,
        LATENT=latent,
        LATENT_PAD=latent_pad,
        ROPE=rope,
        ROPE_PAD=max(16, next_pow2(rope)),
        BLOCK_H=MLA_BLOCK_H,
        BLOCK_SIZE=c.shape[2],
        BLOCK_N=cfg["block_n"],
        NUM_SPLITS=num_splits,
        PRECISION=_precision(q_latent),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    merge_splits(part_acc, part_ml, out, num_splits, latent_pad)
    return out


def mla_prefill_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    k_rope: torch.Tensor,
    meta: GpuAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q_nope [T, H, nope] and q_rope [T, H, rope] of variable-length sequences attend causally
    (bottom-right) over their decompressed contexts: ``kv`` [N, H, nope + v] (per-head K_nope,
    then V) and the shared rope key ``k_rope`` [N, rope], each sequence's rows from
    ``meta.context_starts``. Returns [T, H, v]."""
    t, h, nope = q_nope.shape
    rope, v_dim = q_rope.shape[-1], kv.shape[-1] - nope
    out = torch.empty((t, h, v_dim), dtype=q_nope.dtype, device=q_nope.device)
    if meta.num_work == 0:
        return out
    cfg = MLA_PREFILL_CONFIG
    block_n = cfg["block_n"] if q_nope.element_size() <= 2 else cfg["block_n"] // 2
    kernels.mla_prefill_kernel[(meta.num_work, h)](
        q_nope,
        q_rope,
        kv,
        k_rope,
        meta.context_lens,
        meta.query_start,
        meta.context_starts,
        meta.work_seq,
        meta.work_tile,
        out,
        q_nope.stride(0),
        q_nope.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        kv.stride(0),
        kv.stride(1),
        k_rope.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        NOPE=nope,
        NOPE_PAD=max(16, next_pow2(nope)),
        ROPE=rope,
        ROPE_PAD=max(16, next_pow2(rope)),
        V_DIM=v_dim,
        V_PAD=max(16, next_pow2(v_dim)),
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=block_n,
        PRECISION=_precision(q_nope),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


class TritonMLAttention:
    """The CUDA backend behind ``MLAPagedAttention.forward``'s signature (see the module docstring)."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int, scale: float):
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_rope: torch.Tensor,  # [T, H, rope]
        entries: torch.Tensor,  # [T, latent + rope]: this step's cache entries
        kv_b_weight: torch.Tensor,  # [H * (nope + v), latent]
        layer_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, latent + rope]: one layer
        meta: GpuAttentionMetadata,
    ) -> torch.Tensor:
        """Attention output [T, H, v_head_dim]."""
        write_latent(entries, layer_cache, meta.slot_mapping)
        w_kv = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        if meta.is_decode:
            return self._decode(q_nope, q_rope, w_kv, layer_cache, meta)
        return self._prefill(q_nope, q_rope, kv_b_weight, layer_cache, meta)

    def _decode(self, q_nope, q_rope, w_kv, layer_cache, meta: GpuAttentionMetadata) -> torch.Tensor:
        nope = self.qk_nope_head_dim
        # head-major [H, B, .]: each head's W_UK / W_UV is one matrix of a batched matmul
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kv[:, :nope])  # [H, B, latent]
        weighted = torch.empty_like(q_latent)
        mla_decode_attention(
            q_latent.transpose(0, 1),
            q_rope,
            layer_cache,
            meta.block_tables,
            meta.context_lens,
            self.scale,
            meta.num_splits,
            out=weighted.transpose(0, 1),
        )
        return torch.bmm(weighted, w_kv[:, nope:].transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    def _prefill(self, q_nope, q_rope, kv_b_weight, layer_cache, meta: GpuAttentionMetadata) -> torch.Tensor:
        if meta.context_blocks is None or meta.context_starts is None:
            raise RuntimeError("MLA prefill metadata without context blocks (GpuInputBuilder(latent_cache=True))")
        # every sequence's context, sequence after sequence: [N, latent + rope]
        context = layer_cache[:, 0, :, 0].index_select(0, meta.context_blocks).flatten(0, 1)
        latent = context[:, : self.kv_lora_rank].to(q_nope.dtype)
        kv = F.linear(latent, kv_b_weight).view(context.shape[0], self.num_heads, -1)  # [N, H, nope + v]
        return mla_prefill_attention(q_nope, q_rope, kv, context[:, self.kv_lora_rank :], meta, self.scale)


def use_triton_mla(model: torch.nn.Module) -> None:
    """Give every MLA layer of ``model`` the Triton backend (CUDA engines); other models: nothing."""
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if isinstance(backend, MLAPagedAttention):
            new_backend = TritonMLAttention(
                backend.num_heads, backend.kv_lora_rank, backend.qk_nope_head_dim, backend.v_head_dim, backend.scale
            )
            module.backend = new_backend  # type: ignore[assignment]
