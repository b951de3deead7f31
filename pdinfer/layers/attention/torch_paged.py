"""Paged attention in plain torch, for CPUs (and as the GPU reference).

The KV cache is one tensor ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``
(block-major, so a block's K/V over all layers is one contiguous chunk for hand-off and
store). Each layer sees the view ``kv[:, layer]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
        layer_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # K/V of all new tokens are written first, so a sequence in this batch can read blocks
        # another sequence of the same batch is filling (a same-step prefix-cache hit).
        layer_cache[meta.slot_blocks, 0, meta.slot_offsets] = k
        layer_cache[meta.slot_blocks, 1, meta.slot_offsets] = v
        out = torch.empty_like(q)
        if meta.is_prompt:
            for seq in meta.prefill_seqs:
                out[seq.query_start : seq.query_start + seq.query_len] = self._prefill(
                    q, k, v, layer_cache, seq
                )
        else:
            for group in meta.decode_groups:
                out[group.rows] = self._decode(q, layer_cache, group)
        return out

    def _prefill(self, q, k, v, layer_cache, seq: PrefillSeq) -> torch.Tensor:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        if seq.context_len == seq.query_len:
            ks = k[rows].transpose(0, 1).unsqueeze(0)
            vs = v[rows].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=self.group > 1
            )
        else:
            ks, vs = self._gather(layer_cache, seq.block_table, seq.context_len)
            # Query i sits at position context_len - query_len + i: a bottom-right causal mask.
            offset = seq.context_len - seq.query_len
            q_pos = torch.arange(seq.query_len).unsqueeze(1) + offset
            k_pos = torch.arange(seq.context_len).unsqueeze(0)
            mask = k_pos <= q_pos
            out = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=self.group > 1
            )
        return out.squeeze(0).transpose(0, 1)

    def _gather(self, layer_cache, block_table, context_len):
        blocks = layer_cache[block_table]  # [nb, 2, bs, KVH, D]
        kv = blocks.transpose(0, 1).reshape(2, -1, self.num_kv_heads, self.head_dim)
        ks = kv[0, :context_len].transpose(0, 1).unsqueeze(0)
        vs = kv[1, :context_len].transpose(0, 1).unsqueeze(0)
        return ks, vs

    def _decode(self, q, layer_cache, group: DecodeGroup) -> torch.Tensor:
        b, nb = group.block_tables.shape
        ks = layer_cache[:, 0][group.block_tables]  # [B, nb, bs, KVH, D]
        vs = layer_cache[:, 1][group.block_tables]
        length = ks.shape[1] * ks.shape[2]
        ks = ks.view(b, length, self.num_kv_heads, self.head_dim)
        vs = vs.view(b, length, self.num_kv_heads, self.head_dim)
        qg = q[group.rows].view(b, self.num_kv_heads, self.group, self.head_dim)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, ks) * self.scale
        scores = scores + group.mask.view(b, 1, 1, length)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgl,blhd->bhgd", probs, vs)
        return out.reshape(b, self.num_heads, self.head_dim)
