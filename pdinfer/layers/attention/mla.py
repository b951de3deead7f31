"""Paged multi-head latent attention (DeepSeek-V2/V3) in plain torch.

The paged cache holds, per token and layer, one vector: the normalized KV latent
(``kv_lora_rank``) followed by the rotated shared key (``qk_rope_head_dim``): the cache tensor
is ``[num_blocks, num_layers, 1, block_size, 1, latent + rope]`` (``KVCacheSpec`` with one
part), about 1/7 of full K and V for DeepSeek-V2-Lite. Heads exist only after the up-projection
``kv_b_proj`` = [W_UK; W_UV] per head.

- Prefill decompresses: the context's latents (cached prefix and this chunk, read back from
  the cache) go through ``kv_b_proj`` into per-head K (with the shared rope key) and V, and
  attend like ordinary multi-head attention with a bottom-right causal mask.
- Decode absorbs: q_nope goes through W_UK into latent space, the scores are q_latent . c +
  q_rope . k_rope over the cached vectors directly, and the weighted latent sum goes through
  W_UV; no per-head K or V is ever built.

Index tensors are built once per step (``build_mla_metadata``) and serve every layer. This is
the CPU backend; on CUDA the model runner swaps in ``triton_mla.TritonMLAttention`` (same
paths, Triton kernels, the CUDA step's metadata).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # the step contract, read by field
    from pdinfer.worker.step_input import StepInput


@dataclass
class MLASeq:
    """One sequence of a prefill step."""

    query_start: int
    query_len: int
    context_len: int  # cached prefix + this chunk
    block_ids: torch.Tensor  # [blocks covering context_len]
    # First position attended to: 0, except for the MTP drafter, whose latent layer holds a
    # sequence's entries from where it first saw the target's hidden states (mtp_drafter.py).
    context_start: int = 0


@dataclass
class MLAMetadata:
    is_prompt: bool
    slot_blocks: torch.Tensor  # [T] the block of each new token's entry ...
    slot_offsets: torch.Tensor  # ... and its slot in that block
    prefill_seqs: list[MLASeq] = field(default_factory=list)
    block_tables: torch.Tensor | None = None  # decode: [B, max_blocks], padded with block 0
    mask: torch.Tensor | None = None  # decode: [B, 1, max_blocks * block_size] additive, None: B == 1
    context_len: int = 0  # decode: the longest context


def build_mla_metadata(inp: StepInput, kv_cache: torch.Tensor) -> MLAMetadata:
    """Metadata for the latent cache ``[blocks, layers, 1, block_size, 1, D]``."""
    block_size, device = kv_cache.shape[3], kv_cache.device
    blocks, offsets = [], []
    for qlen, ctx, table in zip(inp.query_lens, inp.context_lens, inp.block_tables):
        for pos in range(ctx - qlen, ctx):
            blocks.append(table[pos // block_size])
            offsets.append(pos % block_size)

    def ids(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    meta = MLAMetadata(inp.is_prompt, ids(blocks), ids(offsets))
    if inp.is_prompt:
        start = 0
        for qlen, ctx, table in zip(inp.query_lens, inp.context_lens, inp.block_tables):
            meta.prefill_seqs.append(MLASeq(start, qlen, ctx, ids(table[: -(-ctx // block_size)])))
            start += qlen
        return meta
    if any(q != 1 for q in inp.query_lens):
        raise NotImplementedError("MLA decode takes one query token per sequence")
    longest = max(inp.context_lens)
    num_blocks = -(-longest // block_size)
    tables = [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in inp.block_tables]
    meta.block_tables, meta.context_len = ids(tables), longest
    if len(tables) > 1:
        positions = torch.arange(num_blocks * block_size, device=device)
        ends = ids(inp.context_lens)
        mask = torch.zeros(len(tables), 1, num_blocks * block_size, dtype=kv_cache.dtype, device=device)
        meta.mask = mask.masked_fill_(positions[None, None, :] >= ends[:, None, None], float("-inf"))
    return meta


class MLAPagedAttention:
    """Writes latent entries and attends over them; see the module docstring."""

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
        meta: MLAMetadata,
    ) -> torch.Tensor:
        """Attention output [T, H, v_head_dim]."""
        slots = layer_cache[:, 0, :, 0]  # [num_blocks, block_size, D], a view
        slots[meta.slot_blocks, meta.slot_offsets] = entries.to(slots.dtype)
        # Per head: rows [0, nope) of its slice are W_UK, rows [nope, nope + v) W_UV.
        w_kv = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        if meta.is_prompt:
            out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
            for seq in meta.prefill_seqs:
                rows = slice(seq.query_start, seq.query_start + seq.query_len)
                out[rows] = self._prefill(q_nope[rows], q_rope[rows], slots, w_kv, kv_b_weight, seq)
            return out
        return self._decode(q_nope, q_rope, slots, w_kv, meta)

    def _prefill(self, q_nope, q_rope, slots, w_kv, kv_b_weight, seq: MLASeq) -> torch.Tensor:
        start = seq.context_start
        ctx = slots.index_select(0, seq.block_ids).flatten(0, 1)[start : seq.context_len].to(q_nope.dtype)
        latent, k_rope = ctx.split([self.kv_lora_rank, ctx.shape[-1] - self.kv_lora_rank], dim=-1)
        kv = F.linear(latent, kv_b_weight).view(ctx.shape[0], self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        # Query i sits at position context_len - query_len + i: a bottom-right causal mask.
        q_pos = torch.arange(seq.query_len, device=q.device).unsqueeze(1) + (seq.context_len - seq.query_len)
        mask = torch.arange(start, seq.context_len, device=q.device).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=self.scale
        )
        return out.transpose(0, 1)

    def _decode(self, q_nope, q_rope, slots, w_kv, meta: MLAMetadata) -> torch.Tensor:
        if meta.block_tables is None:
            raise RuntimeError("MLA decode metadata without block tables")
        b, r = q_nope.shape[0], self.kv_lora_rank
        cached = slots[meta.block_tables].flatten(1, 2).to(q_nope.dtype)  # [B, L, latent + rope]
        w_uk, w_uv = w_kv[:, : self.qk_nope_head_dim], w_kv[:, self.qk_nope_head_dim :]
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        q_full = torch.cat([q_latent, q_rope], dim=-1)  # [B, H, latent + rope]
        scores = torch.bmm(q_full, cached.transpose(1, 2)).mul_(self.scale)  # [B, H, L]
        if meta.mask is not None:
            scores.add_(meta.mask)
        else:  # one sequence: its padding is past its context
            scores = scores[..., : meta.context_len]
            cached = cached[:, : meta.context_len]
        probs = torch.softmax(scores, dim=-1)
        out_latent = torch.bmm(probs, cached[..., :r])  # [B, H, latent]
        return torch.einsum("bhr,hvr->bhv", out_latent, w_uv).reshape(b, self.num_heads, self.v_head_dim)
