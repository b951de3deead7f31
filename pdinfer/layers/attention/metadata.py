"""Per-step attention metadata of the torch backend, built by the model runner, passed down.

Index tensors address the KV cache ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``
through row views of one layer (see ``torch_paged``) and are the same for every layer: they are
built once per step, never per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PrefillSeq:
    """One sequence of a prefill step: its query rows and the context it attends to."""

    query_start: int
    query_len: int
    context_len: int  # cached prefix + this chunk
    kv_rows: torch.Tensor | None = None  # [2 * num_blocks] block rows, K then V; only with a prefix


@dataclass
class DecodeGroup:
    """Decode sequences of similar context length, padded to the group's longest only."""

    rows: torch.Tensor | None  # [B] query rows of these sequences; None: all rows, in order
    kv_rows: torch.Tensor  # [B * 2 * max_blocks] block rows: per sequence its K blocks, then V
    mask: torch.Tensor | None  # [B, 1, max_blocks * block_size] additive (0 / -inf); None: B == 1
    num_seqs: int
    context_len: int  # the longest context in the group


@dataclass
class NativeKernelInput:
    """Attention through the native kernels (``cpu_kernels``), prefill or decode: straight from
    the block tables, no groups, no padding, no gather."""

    kernel: Any  # the loaded library
    block_tables: torch.Tensor  # [B, max_blocks] int64
    context_lens: torch.Tensor  # [B] int64
    kv_strides: torch.Tensor  # see ``cpu_kernels.kv_strides``
    query_starts: torch.Tensor | None = None  # [B] int64, prefill only: first query row, ...
    query_lens: torch.Tensor | None = None  # ... and query rows of each sequence
    # Decode: a lone long context may be cut into chunks across threads (merged after); False in
    # the batch-invariant mode, where how it is cut would depend on the batch size.
    split_context: bool = True


@dataclass
class AttentionMetadata:
    is_prompt: bool
    slot_rows: torch.Tensor  # [T] token row where each new token's K goes (its V: + block_size)
    block_size: int
    prefill_seqs: list[PrefillSeq] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # the torch decode path
    native: NativeKernelInput | None = None  # the native kernels instead of the above
    num_tokens: int = 0
