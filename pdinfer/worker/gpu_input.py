"""One step's device inputs on CUDA, built from a ``StepInput`` with a single host->device copy.

Every integer the step needs (token ids, positions, KV slots, block tables, context lengths,
prefill tiles, sample rows, pending-token references, sampling settings) is packed into one
pinned int64 buffer (floats travel as float64 bit patterns) and copied with ``non_blocking``;
the tensors the step uses are views of that one device buffer. No ``torch.tensor(list,
device=cuda)``: a pageable copy synchronizes the stream and would stall the overlap of host and
device. The pinned buffer is a fresh block of torch's caching host allocator, which reuses a
block only after the copy that read it has completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from pdinfer.layers.attention.triton_paged import (
    PREFILL_BLOCK_M,
    GpuAttentionMetadata,
    batch_invariant_splits,
    decode_num_splits,
)
from pdinfer.worker.sampler import SamplingTensors, constraint_tensors
from pdinfer.worker.step_input import StepInput


@dataclass
class GpuStep:
    """Device views of one step's inputs (rows padded to ``padded`` for a CUDA graph)."""

    batch: int  # real tokens of the step
    padded: int  # rows the forward runs over (>= batch)
    input_ids: torch.Tensor  # [padded]
    positions: torch.Tensor  # [padded]
    meta: GpuAttentionMetadata
    sample_rows: torch.Tensor | None  # [R] rows of the hidden states to sample; None: rows 0..R-1
    num_samples: int
    sampling: SamplingTensors
    # (step id, input rows, indices into that step's sampled tokens)
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (step id, sample row, column in output_tokens, index into that step's tokens): penalties
    pending_penalty: list[tuple[int, int, int, int]] = field(default_factory=list)
    clone_src: torch.Tensor | None = None
    clone_dst: torch.Tensor | None = None
    # prompt log-probs: rows of the hidden states that score a prompt token, and that token
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None


class _Packer:
    """Collects int64 arrays, then ships them to the device in one copy."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.shapes: list[tuple[int, ...]] = []

    def add(self, values, dtype=np.int64) -> int:
        arr = np.ascontiguousarray(values, dtype=dtype)
        if dtype is not np.int64:
            arr = arr.astype(np.float64).view(np.int64)
        self.parts.append(arr.reshape(-1))
        self.shapes.append(arr.shape)
        return len(self.parts) - 1

    def ship(self, device: torch.device) -> list[torch.Tensor]:
        # Every part starts on a 16-byte boundary: Triton specializes a kernel on whether each
        # pointer is 16-byte aligned, and parts packed back to back would make a step's alignment
        # pattern new now and then, each time compiling kernels in the middle of serving.
        starts = np.cumsum([0] + [p.size + (p.size & 1) for p in self.parts])
        total = max(1, int(starts[-1]))
        pin = device.type == "cuda"
        host = torch.empty(total, dtype=torch.int64, pin_memory=pin)
        flat = host.numpy()
        views = []
        for part, shape, offset in zip(self.parts, self.shapes, starts.tolist()):
            flat[offset : offset + part.size] = part
            views.append((offset, part.size, shape))
        dev = host.to(device, non_blocking=pin)
        return [dev[o : o + n].view(shape) for o, n, shape in views]


def _floats(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float64).to(torch.float32)


class GpuInputBuilder:
    """``decode_programs``: decode attention programs per sequence and split (KV heads for dense
    attention, head groups for MLA); ``latent_cache``: an MLA model, whose prefill gathers each
    sequence's context blocks (``GpuAttentionMetadata.context_blocks``); ``batch_invariant``: the
    attention kernels of that mode (``triton_paged``), and a prompt step is always a prefill."""

    def __init__(
        self,
        block_size: int,
        vocab_size: int,
        decode_programs: int,
        device: torch.device,
        num_sms: int = 132,
        latent_cache: bool = False,
        batch_invariant: bool = False,
    ):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.decode_programs = decode_programs
        self.device = device
        self.num_sms = num_sms
        self.latent_cache = latent_cache
        self.batch_invariant = batch_invariant

    def build(self, inp: StepInput, pad_to: int | None = None, num_splits: int | None = None) -> GpuStep:
        """``pad_to``/``num_splits``: the CUDA-graph batch this decode step replays with."""
        bs = self.block_size
        num_seqs = len(inp.query_lens)
        qlens = np.asarray(inp.query_lens, dtype=np.int64)
        ctx = np.asarray(inp.context_lens, dtype=np.int64)
        is_decode = num_seqs > 0 and int(qlens.max()) == 1 and not (self.batch_invariant and inp.is_prompt)
        t = inp.num_tokens
        padded = pad_to or t
        rows_pad = padded if is_decode else num_seqs
        p = _Packer()

        ids = np.zeros(padded, dtype=np.int64)
        ids[:t] = inp.input_ids
        ids[:t][ids[:t] < 0] = 0  # pending tokens: filled on the device
        pos = np.zeros(padded, dtype=np.int64)
        pos[:t] = inp.positions
        tables = _block_table_array(inp.block_tables, rows_pad)
        seq_of_token = np.repeat(np.arange(num_seqs), qlens)
        slots = np.full(padded, -1, dtype=np.int64)
        slots[:t] = tables[seq_of_token, pos[:t] // bs] * bs + pos[:t] % bs
        ctx_pad = np.zeros(rows_pad, dtype=np.int64)
        ctx_pad[:num_seqs] = ctx
        i_ids, i_pos, i_slots, i_bt, i_ctx = (p.add(ids), p.add(pos), p.add(slots), p.add(tables), p.add(ctx_pad))
        prefill = None if is_decode else _pack_prefill_tiles(p, qlens, ctx)
        context = (
            _pack_context_blocks(p, inp.block_tables, ctx, bs) if prefill is not None and self.latent_cache else None
        )

        sample_rows = [s.row for s in inp.samples]
        identity = sample_rows == list(range(len(sample_rows)))
        i_rows = None if identity else p.add(sample_rows)
        i_pending = self._pack_pending(p, inp)
        i_sampling = self._pack_sampling(p, inp)
        i_clone = p.add(np.asarray(inp.clone_blocks, dtype=np.int64).reshape(-1, 2)) if inp.clone_blocks else None
        i_prompt = (p.add(inp.prompt_rows), p.add(inp.prompt_targets)) if inp.prompt_rows else None

        dev = p.ship(self.device)
        if prefill is None:  # a decode step
            if self.batch_invariant:
                splits = num_splits or batch_invariant_splits(int(ctx.max()))
            else:
                splits = num_splits or decode_num_splits(num_seqs, self.decode_programs, int(ctx.max()), self.num_sms)
            meta = GpuAttentionMetadata(True, dev[i_slots], dev[i_bt], dev[i_ctx], num_splits=splits, num_tokens=padded)
        else:
            i_qs, i_ws, i_wt, num_work = prefill
            meta = GpuAttentionMetadata(
                False,
                dev[i_slots],
                dev[i_bt],
                dev[i_ctx],
                query_start=dev[i_qs],
                work_seq=dev[i_ws],
                work_tile=dev[i_wt],
                num_work=num_work,
                num_tokens=t,
                fresh=bool((ctx == qlens).all()),
            )
            if context is not None:
                meta.context_blocks, meta.context_starts = dev[context[0]], dev[context[1]]
        meta.batch_invariant = self.batch_invariant
        step = GpuStep(
            batch=t,
            padded=padded,
            input_ids=dev[i_ids],
            positions=dev[i_pos],
            meta=meta,
            sample_rows=None if i_rows is None else dev[i_rows],
            num_samples=len(sample_rows),
            sampling=self._sampling_tensors(dev, i_sampling, inp),
            pending=[(sid, dev[a], dev[b]) for sid, a, b in i_pending],
            pending_penalty=self._pending_penalty(inp),
        )
        if i_clone is not None:
            step.clone_src, step.clone_dst = dev[i_clone][:, 0], dev[i_clone][:, 1]
        if i_prompt is not None:
            step.prompt_rows, step.prompt_targets = dev[i_prompt[0]], dev[i_prompt[1]]
        return step

    def _pack_pending(self, p: _Packer, inp: StepInput) -> list[tuple[int, int, int]]:
        by_step: dict[int, tuple[list[int], list[int]]] = {}
        for row, step_id, index in inp.pending:
            rows, indices = by_step.setdefault(step_id, ([], []))
            rows.append(row)
            indices.append(index)
        return [(sid, p.add(rows), p.add(idx)) for sid, (rows, idx) in by_step.items()]

    def _pack_sampling(self, p: _Packer, inp: StepInput) -> dict[str, int]:
        samples = inp.samples
        if not samples or self._only_argmax(inp):
            return {}
        vocab = self.vocab_size
        out = {
            "temperatures": p.add([s.temperature for s in samples], np.float64),
            "top_k": p.add([s.top_k if s.top_k > 0 else vocab for s in samples]),
            "top_p": p.add([s.top_p for s in samples], np.float64),
            "min_p": p.add([s.min_p for s in samples], np.float64),
            "seeds": p.add([s.seed & 0x7FFFFFFFFFFFFFFF for s in samples]),
            "positions": p.add([s.position for s in samples]),
        }
        if any(s.needs_penalties for s in samples):
            out["presence"] = p.add([s.presence for s in samples], np.float64)
            out["frequency"] = p.add([s.frequency for s in samples], np.float64)
            out["repetition"] = p.add([s.repetition for s in samples], np.float64)
            out["output_tokens"] = p.add(_padded([s.output_tokens or [] for s in samples]))
            out["prompt_tokens"] = p.add(_padded([s.prompt_tokens or [] for s in samples]))
        return out

    @staticmethod
    def _only_argmax(inp: StepInput) -> bool:
        return all(s.temperature == 0 and not s.needs_penalties and not s.constrained for s in inp.samples)

    def _sampling_tensors(self, dev: list[torch.Tensor], idx: dict[str, int], inp: StepInput) -> SamplingTensors:
        samples = inp.samples
        requested = [s.logprobs for s in samples if s.logprobs is not None]
        max_logprobs = max(requested) if requested else -1
        if not idx:  # greedy without penalties: the sampler reads only the flags
            empty = torch.zeros(len(samples), dtype=torch.int64, device=self.device) if not dev else dev[0][:0]
            return SamplingTensors(
                empty,
                empty,
                empty,
                empty,
                empty,
                empty,
                all_greedy=True,
                any_top_k=False,
                any_top_p=False,
                any_min_p=False,
                max_logprobs=max_logprobs,
            )
        vocab = self.vocab_size
        t = SamplingTensors(
            temperatures=_floats(dev[idx["temperatures"]]),
            top_k=dev[idx["top_k"]],
            top_p=_floats(dev[idx["top_p"]]),
            min_p=_floats(dev[idx["min_p"]]),
            seeds=dev[idx["seeds"]],
            positions=dev[idx["positions"]],
            all_greedy=all(s.temperature == 0 for s in samples),
            any_top_k=any(0 < s.top_k < vocab for s in samples),
            any_top_p=any(s.top_p < 1.0 for s in samples),
            any_min_p=any(s.min_p > 0.0 for s in samples),
            max_logprobs=max_logprobs,
        )
        if "presence" in idx:
            t.presence = _floats(dev[idx["presence"]])
            t.frequency = _floats(dev[idx["frequency"]])
            t.repetition = _floats(dev[idx["repetition"]])
            t.output_tokens = dev[idx["output_tokens"]]
            t.prompt_tokens = dev[idx["prompt_tokens"]]
        for name, value in constraint_tensors(samples, self.device).items():  # their own copies
            setattr(t, name, value)
        return t

    @staticmethod
    def _pending_penalty(inp: StepInput) -> list[tuple[int, int, int, int]]:
        from pdinfer.worker.step_input import PENDING_TOKEN

        if not inp.pending or not any(s.needs_penalties for s in inp.samples):
            return []
        pending_of_row = {row: (step_id, index) for row, step_id, index in inp.pending}
        out = []
        for i, spec in enumerate(inp.samples):
            if spec.output_tokens and spec.output_tokens[-1] == PENDING_TOKEN:
                step_id, index = pending_of_row[spec.row]
                out.append((step_id, i, len(spec.output_tokens) - 1, index))
        return out


def _pack_prefill_tiles(p: _Packer, qlens: np.ndarray, ctx: np.ndarray) -> tuple[int, int, int, int]:
    """Prefill grid: (query_start, work_seq, work_tile) indices in the packer, and the tile count.

    Tiles go heaviest first (most keys to read: a causal tile near a sequence's end reads up to
    its whole context, its first tile only the cached prefix), so the long programs start in the
    first wave and short ones fill the tail instead of the other way round."""
    n = qlens.size
    tiles = -(-qlens // PREFILL_BLOCK_M)
    work_seq = np.repeat(np.arange(n), tiles)
    starts = np.concatenate(([0], np.cumsum(tiles)[:-1])) if n else np.zeros(0, np.int64)
    work_tile = np.arange(work_seq.size) - np.repeat(starts, tiles)
    keys = (ctx - qlens)[work_seq] + np.minimum((work_tile + 1) * PREFILL_BLOCK_M, qlens[work_seq])
    order = np.argsort(-keys, kind="stable")
    work_seq, work_tile = work_seq[order], work_tile[order]
    qstart = np.concatenate(([0], np.cumsum(qlens)))
    return p.add(qstart), p.add(work_seq), p.add(work_tile), work_seq.size


def _pack_context_blocks(p: _Packer, tables: list[list[int]], ctx: np.ndarray, bs: int) -> tuple[int, int]:
    """MLA prefill: the blocks covering each sequence's context, concatenated, and the first
    token row of each sequence's context in that list of blocks."""
    counts = -(-ctx // bs)
    blocks = [b for table, n in zip(tables, counts.tolist()) for b in table[:n]]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])) * bs if counts.size else counts
    return p.add(np.asarray(blocks, dtype=np.int64)), p.add(starts)


def _block_table_array(tables: list[list[int]], rows: int) -> np.ndarray:
    """Ragged block tables -> [rows, width] int64, zero padded (vectorized: no per-row loop)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = max(1, int(lens.max()) if lens.size else 1)
    out = np.zeros((rows, width), dtype=np.int64)
    if lens.size and lens.sum():
        flat = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
        row_idx = np.repeat(np.arange(lens.size), lens)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        col_idx = np.arange(flat.size) - np.repeat(starts, lens)
        out[row_idx, col_idx] = flat
    return out


def _padded(rows: list[list[int]]) -> np.ndarray:
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
