"""Turn a ``StepInput`` into device tensors: attention metadata and sampling tensors."""

from __future__ import annotations

import itertools

import torch

from pdinfer.layers import cpu_kernels
from pdinfer.layers.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    NativeKernelInput,
    PrefillSeq,
)
from pdinfer.worker.sampler import SamplingTensors, constraint_tensors
from pdinfer.worker.step_input import SampleSpec, StepInput

# A decode group pads its sequences to its longest; a sequence joins the current group while
# its context is at least this fraction of the group's longest (bounds the wasted work) ...
DECODE_GROUP_MIN_FILL = 0.6
# ... and while the group's gathered K/V stays below this size: a temporary of 32 MiB or more
# is a fresh mmap from glibc on every call, and its page faults cost more than the copy.
DECODE_GROUP_MAX_BYTES = 16 << 20


def build_attention_metadata(
    inp: StepInput, kv_cache: torch.Tensor, native_kernels=None, batch_invariant: bool = False
) -> AttentionMetadata:
    """Metadata of the torch backend for the cache ``[blocks, layers, 2, block_size, KVH, D]``;
    attention runs in ``native_kernels`` (``cpu_kernels.load()``) when given, and with
    ``batch_invariant`` never cuts a decode context into chunks."""
    _, num_layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    rows_per_block = 2 * num_layers  # block rows from one block of a layer to the next block
    device = kv_cache.device
    slot_rows = []
    for qlen, ctx, table in zip(inp.query_lens, inp.context_lens, inp.block_tables):
        for pos in range(ctx - qlen, ctx):
            slot_rows.append(table[pos // block_size] * rows_per_block * block_size + pos % block_size)
    meta = AttentionMetadata(
        is_prompt=inp.is_prompt,
        slot_rows=torch.tensor(slot_rows, dtype=torch.int64, device=device),
        block_size=block_size,
        num_tokens=inp.num_tokens,
    )
    if native_kernels is not None:
        meta.native = _native_input(inp, block_size, kv_cache, native_kernels)
        meta.native.split_context = not batch_invariant
    elif inp.is_prompt:
        start = 0
        for qlen, ctx, table in zip(inp.query_lens, inp.context_lens, inp.block_tables):
            seq = PrefillSeq(query_start=start, query_len=qlen, context_len=ctx)
            if ctx > qlen:  # a cached prefix: attention reads the whole context from the cache
                blocks = torch.tensor(table[: -(-ctx // block_size)], dtype=torch.int64, device=device)
                seq.kv_rows = torch.cat([blocks * rows_per_block, blocks * rows_per_block + 1])
            meta.prefill_seqs.append(seq)
            start += qlen
    else:
        token_bytes = 2 * kv_heads * head_dim * kv_cache.element_size()
        max_tokens = max(block_size, DECODE_GROUP_MAX_BYTES // token_bytes)
        groups = _decode_groups(inp.context_lens, max_tokens)
        if len(groups) == 1:  # one group: keep the step's row order, no gather of queries
            groups = [list(range(len(inp.context_lens)))]
        meta.decode_groups = [
            _decode_group(inp, g, block_size, rows_per_block, kv_cache, ordered=len(groups) == 1) for g in groups
        ]
    return meta


def _native_input(inp: StepInput, block_size: int, kv_cache: torch.Tensor, kernel) -> NativeKernelInput:
    max_blocks = -(-max(inp.context_lens) // block_size)
    tables = [table[:max_blocks] + [0] * (max_blocks - len(table[:max_blocks])) for table in inp.block_tables]
    device = kv_cache.device
    native = NativeKernelInput(
        kernel=kernel,
        block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
        context_lens=torch.tensor(inp.context_lens, dtype=torch.int64, device=device),
        kv_strides=cpu_kernels.kv_strides(kv_cache[:, 0]),
    )
    if inp.is_prompt:
        starts = [0, *itertools.accumulate(inp.query_lens[:-1])]
        native.query_starts = torch.tensor(starts, dtype=torch.int64, device=device)
        native.query_lens = torch.tensor(inp.query_lens, dtype=torch.int64, device=device)
    return native


def _decode_groups(context_lens: list[int], max_tokens: int) -> list[list[int]]:
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = context_lens[current[0]] if current else 0
        if current and (context_lens[i] < DECODE_GROUP_MIN_FILL * longest or (len(current) + 1) * longest > max_tokens):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _decode_group(
    inp: StepInput, rows: list[int], block_size: int, rows_per_block: int, kv_cache: torch.Tensor, ordered: bool
) -> DecodeGroup:
    device, dtype = kv_cache.device, kv_cache.dtype
    lengths = [inp.context_lens[r] for r in rows]
    longest = max(lengths)
    max_blocks = -(-longest // block_size)
    tables = []
    for r in rows:
        table = inp.block_tables[r][:max_blocks]
        tables.append(table + [0] * (max_blocks - len(table)))
    blocks = torch.tensor(tables, dtype=torch.int64, device=device) * rows_per_block
    kv_rows = torch.stack([blocks, blocks + 1], dim=1).reshape(-1)  # per sequence: K, then V
    mask = None
    if len(rows) > 1:
        positions = torch.arange(max_blocks * block_size, device=device)
        ends = torch.tensor(lengths, device=device)
        mask = torch.zeros(len(rows), 1, max_blocks * block_size, dtype=dtype, device=device)
        mask.masked_fill_(positions[None, None, :] >= ends[:, None, None], float("-inf"))
    return DecodeGroup(
        rows=None if ordered else torch.tensor(rows, dtype=torch.int64, device=device),
        kv_rows=kv_rows,
        mask=mask,
        num_seqs=len(rows),
        context_len=longest,
    )


def build_sampling_tensors(samples: list[SampleSpec], vocab_size: int, device: torch.device) -> SamplingTensors:
    def col(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    top_k = [s.top_k if s.top_k > 0 else vocab_size for s in samples]
    requested = [s.logprobs for s in samples if s.logprobs is not None]
    t = SamplingTensors(
        temperatures=col([s.temperature for s in samples], torch.float32),
        top_k=col(top_k, torch.int64),
        top_p=col([s.top_p for s in samples], torch.float32),
        min_p=col([s.min_p for s in samples], torch.float32),
        seeds=col([s.seed for s in samples], torch.int64),
        positions=col([s.position for s in samples], torch.int64),
        all_greedy=all(s.temperature == 0 for s in samples),
        any_top_k=any(k < vocab_size for k in top_k),
        any_top_p=any(s.top_p < 1.0 for s in samples),
        any_min_p=any(s.min_p > 0.0 for s in samples),
        max_logprobs=max(requested) if requested else -1,
    )
    if any(s.needs_penalties for s in samples):
        t.presence = col([s.presence for s in samples], torch.float32)
        t.frequency = col([s.frequency for s in samples], torch.float32)
        t.repetition = col([s.repetition for s in samples], torch.float32)
        t.output_tokens = _padded([s.output_tokens or [] for s in samples], device)
        t.prompt_tokens = _padded([s.prompt_tokens or [] for s in samples], device)
    for name, value in constraint_tensors(samples, device).items():
        setattr(t, name, value)
    return t


def _padded(rows: list[list[int]], device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)
