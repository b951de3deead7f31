"""Per-step attention metadata, built by the model runner and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One sequence of a prefill step: its query rows and the context it attends to."""

    query_start: int
    query_len: int
    context_len: int  # cached prefix + this chunk
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass
class DecodeGroup:
    """Decode sequences of similar context length, padded to the group's longest only."""

    rows: torch.Tensor  # [B] query rows of these sequences
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padding points at block 0)
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] additive (0 or -inf)


@dataclass
class AttentionMetadata:
    is_prompt: bool
    slot_blocks: torch.Tensor  # [T] block id each new token's K/V goes to
    slot_offsets: torch.Tensor  # [T] offset inside that block
    prefill_seqs: list[PrefillSeq] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    num_tokens: int = 0
