"""Paged attention in plain torch, for CPUs (and as the GPU reference).

When the native CPU kernels are built (``cpu_kernels``; float32 or bfloat16 caches, float32
arithmetic), the K/V write and both attention phases run there instead, straight from the
block tables; the torch code below is then the fallback and the tests' second path.

The KV cache is one tensor ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``
(block-major, so a block's K/V over all layers is one contiguous chunk for hand-off and
store). Each layer sees the view ``kv[:, layer]``, which this backend reads through two row views
starting at that layer: "token rows" of ``kv_heads * head_dim`` values and "block rows" of
``block_size`` token rows. Row ``r`` of either view is the same memory for every layer, up to
the layer's offset, so the metadata's row indices are built once per step (``input_builder``).

Decode gathers each group's K/V blocks with one ``index_select`` (contiguous 12 KiB copies), then
computes all query heads against all KV heads in two batched matmuls, with each query row
zero outside its own KV head (grouped-query attention without repeating K/V); the extra
multiply-adds are cheaper than the strided copies a per-head layout would need.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdinfer.layers import cpu_kernels
from pdinfer.layers.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSeq


class TorchPagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.group = num_heads // num_kv_heads

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        layer_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D] view of one layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # K/V of all new tokens are written first, so a sequence in this batch can read blocks
        # another sequence of the same batch is filling (a same-step prefix-cache hit).
        if (native := meta.native) is not None:
            cpu_kernels.write_kv(native.kernel, layer_cache, meta.slot_rows, k, v)
            if meta.is_prompt:
                if native.query_starts is None or native.query_lens is None:
                    raise RuntimeError("native prefill metadata without query_starts / query_lens")
                return cpu_kernels.prefill_attention(
                    native.kernel,
                    q,
                    layer_cache,
                    native.block_tables,
                    native.query_starts,
                    native.query_lens,
                    native.context_lens,
                    native.kv_strides,
                    self.scale,
                )
            return cpu_kernels.paged_decode(
                native.kernel,
                q,
                layer_cache,
                native.block_tables,
                native.context_lens,
                native.kv_strides,
                self.scale,
                native.split_context,
            )
        tokens = _row_view(layer_cache, self.num_kv_heads * self.head_dim)
        tokens.index_copy_(0, meta.slot_rows, k.reshape(k.shape[0], -1))
        tokens.index_copy_(0, meta.slot_rows + meta.block_size, v.reshape(v.shape[0], -1))
        if meta.is_prompt:
            out = torch.empty_like(q)
            for seq in meta.prefill_seqs:
                rows = slice(seq.query_start, seq.query_start + seq.query_len)
                out[rows] = self._prefill(q[rows], k[rows], v[rows], layer_cache, seq, meta.block_size)
            return out
        blocks = _row_view(layer_cache, meta.block_size * self.num_kv_heads * self.head_dim)
        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].rows is None:
            return self._decode(q, blocks, groups[0], meta.block_size)
        out = torch.empty_like(q)
        for group in groups:
            if group.rows is None:  # only a lone group may cover all rows
                raise RuntimeError("a decode group without rows among several")
            out.index_copy_(0, group.rows, self._decode(q.index_select(0, group.rows), blocks, group, meta.block_size))
        return out

    def _prefill(self, q, k, v, layer_cache, seq: PrefillSeq, block_size: int) -> torch.Tensor:
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        gqa = self.group > 1
        if seq.kv_rows is None:  # no cached prefix: the chunk attends to itself
            ks = k.transpose(0, 1).unsqueeze(0)
            vs = v.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            blocks = _row_view(layer_cache, block_size * self.num_kv_heads * self.head_dim)
            kv = blocks.index_select(0, seq.kv_rows).view(2, -1, self.num_kv_heads, self.head_dim)
            ks = kv[0, : seq.context_len].transpose(0, 1).unsqueeze(0)
            vs = kv[1, : seq.context_len].transpose(0, 1).unsqueeze(0)
            # Query i sits at position context_len - query_len + i: a bottom-right causal mask.
            offset = seq.context_len - seq.query_len
            q_pos = torch.arange(seq.query_len).unsqueeze(1) + offset
            mask = torch.arange(seq.context_len).unsqueeze(0) <= q_pos
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)

    def _decode(self, q, blocks: torch.Tensor, group: DecodeGroup, block_size: int) -> torch.Tensor:
        """q [B, H, D] of one group -> out [B, H, D]."""
        b, kvh, d, g = group.num_seqs, self.num_kv_heads, self.head_dim, self.group
        kv = blocks.index_select(0, group.kv_rows).view(b, 2, -1, kvh * d)  # [B, 2, L, KVH*D]
        if group.mask is None:  # one sequence: no padding to mask, so no score matrix by hand
            length = group.context_len
            ks = kv[:, 0, :length].view(1, length, kvh, d).transpose(1, 2)
            vs = kv[:, 1, :length].view(1, length, kvh, d).transpose(1, 2)
            out = F.scaled_dot_product_attention(q.view(1, -1, 1, d), ks, vs, scale=self.scale, enable_gqa=g > 1)
            return out.view(1, -1, d)
        # Query head (h, j) only sees KV head h: put it on the block diagonal of [H, KVH*D].
        q_wide = q.new_zeros(b, kvh, g, kvh, d)
        q_wide.diagonal(dim1=1, dim2=3).copy_(q.view(b, kvh, g, d).permute(0, 2, 3, 1))
        scores = torch.baddbmm(group.mask, q_wide.view(b, kvh * g, kvh * d), kv[:, 0].transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1)
        out_wide = torch.bmm(probs, kv[:, 1]).view(b, kvh, g, kvh, d)
        return out_wide.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, kvh * g, d)


def _row_view(layer_cache: torch.Tensor, row_elems: int) -> torch.Tensor:
    """Rows of ``row_elems`` values from the start of this layer's view to the end of the cache."""
    offset = layer_cache.storage_offset()
    total = layer_cache.untyped_storage().nbytes() // layer_cache.element_size()
    return layer_cache.as_strided(((total - offset) // row_elems, row_elems), (row_elems, 1), offset)
