"""Turn a ``StepInput`` into device tensors: attention metadata and sampling tensors."""

from __future__ import annotations

import torch

from pdinfer.layers.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSeq
from pdinfer.worker.sampler import SamplingTensors
from pdinfer.worker.step_input import SampleSpec, StepInput

# A decode group pads its sequences to its longest; a sequence joins the current group while
# its context is at least this fraction of the group's longest (bounds the wasted work).
DECODE_GROUP_MIN_FILL = 0.6


def build_attention_metadata(inp: StepInput, block_size: int, device: torch.device) -> AttentionMetadata:
    slot_blocks, slot_offsets = [], []
    for qlen, ctx, table in zip(inp.query_lens, inp.context_lens, inp.block_tables):
        for pos in range(ctx - qlen, ctx):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
    meta = AttentionMetadata(
        is_prompt=inp.is_prompt,
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.int64, device=device),
        slot_offsets=torch.tensor(slot_offsets, dtype=torch.int64, device=device),
        num_tokens=inp.num_tokens,
    )
    if inp.is_prompt:
        start = 0
        for qlen, ctx, table in zip(inp.query_lens, inp.context_lens, inp.block_tables):
            num_blocks = -(-ctx // block_size)
            meta.prefill_seqs.append(PrefillSeq(
                query_start=start, query_len=qlen, context_len=ctx,
                block_table=torch.tensor(table[:num_blocks], dtype=torch.int64, device=device),
            ))
            start += qlen
    else:
        meta.decode_groups = _decode_groups(inp, block_size, device)
    return meta


def _decode_groups(inp: StepInput, block_size: int, device: torch.device) -> list[DecodeGroup]:
    order = sorted(range(len(inp.context_lens)), key=lambda i: -inp.context_lens[i])
    groups, current = [], []
    for i in order:
        if current and inp.context_lens[i] < DECODE_GROUP_MIN_FILL * inp.context_lens[current[0]]:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return [_decode_group(inp, g, block_size, device) for g in groups]


def _decode_group(inp: StepInput, rows: list[int], block_size: int, device) -> DecodeGroup:
    max_blocks = -(-inp.context_lens[rows[0]] // block_size)
    tables = [inp.block_tables[r][:max_blocks] + [0] * (max_blocks - len(inp.block_tables[r][:max_blocks])) for r in rows]
    lengths = torch.tensor([inp.context_lens[r] for r in rows], device=device)
    positions = torch.arange(max_blocks * block_size, device=device)
    mask = torch.zeros(len(rows), max_blocks * block_size, device=device)
    mask.masked_fill_(positions[None, :] >= lengths[:, None], float("-inf"))
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
        mask=mask.view(len(rows), 1, 1, -1),
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
    return t


def _padded(rows: list[list[int]], device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)
