"""CUDA graphs for decode steps: one graph per bucketed batch size, captured once at start-up.

A decode step of B one-query rows replays the graph of the smallest bucket >= B; rows B.. are
padding (KV slot -1: nothing written; context 0: nothing read). A row is a sequence, or one
position of a sequence verifying drafts (1 + k rows sharing its block table, each with its own
context length), so buckets count rows: the engine asks for max(max_num_seqs, the largest
verifying step) (``engine.speculative.decode_graph_rows``). The graph covers the whole
forward and the logits, and keeps the last-layer hidden states for a drafter that reads them
(MTP); sampling stays outside (its branches depend on the batch's settings).
The attention grid depends only on the bucket (see ``decode_num_splits``), so one graph serves
every context length. Graphs are off for PROMPT engines and with ``enforce_eager``; MoE models
are captured when their experts run the fused Triton path without EPLB (``gpu_runner.graph_blocker``).
In the batch-invariant mode graphs work as they are: its kernels are all Triton (no cuBLAS
heuristics), its decode grid is sized for the longest context a graph can meet
(``batch_invariant_splits``), and a prompt step (even of one-token chunks) never replays one.
"""

from __future__ import annotations

import logging
import time

import torch

from pdinfer.layers.attention.triton_paged import GpuAttentionMetadata, batch_invariant_splits, decode_num_splits
from pdinfer.models.loader import CausalLM
from pdinfer.worker.cache_engine import CacheEngine
from pdinfer.worker.gpu_input import GpuStep
from pdinfer.worker.step_input import StepInput

logger = logging.getLogger("pdinfer")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheEngine,
        max_rows: int,
        max_blocks: int,
        num_sms: int,
        decode_programs: int,
        batch_invariant: bool = False,
    ):
        """``max_rows``: the largest decode step's rows (capped at the largest bucket);
        ``decode_programs``: decode attention programs per row and split (``GpuInputBuilder``)."""
        self.model = model
        self.batch_invariant = batch_invariant
        self.cache = cache
        self.num_sms = num_sms
        self.decode_programs = decode_programs
        self.buckets = sorted({b for b in BUCKETS if b < max_rows} | {min(max_rows, BUCKETS[-1])})
        self.max_rows = self.buckets[-1]
        n, dev = self.max_rows, cache.kv.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int64, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket: graph, logits
        self._hidden: dict[int, torch.Tensor] = {}  # bucket: its last-layer hidden states [bucket, H]
        self.num_replays = 0  # steps run from a graph (benchmarks count them)

    def num_splits(self, bucket: int) -> int:
        if self.batch_invariant:
            return batch_invariant_splits(self.block_tables.shape[1] * self.cache.block_size)
        return decode_num_splits(bucket, self.decode_programs, None, self.num_sms)

    def bucket_for(self, inp: StepInput) -> int | None:
        """The graph bucket for this step's rows (a verifying sequence's 1 + k included), or
        None when it must run eagerly."""
        b = inp.num_tokens
        if b == 0 or b > self.max_rows or len(inp.query_lens) != b:
            return None  # a prefill (some row has several query tokens) or too many rows
        if self.batch_invariant and inp.is_prompt:
            return None  # its rows must go through the prefill kernel
        if max(len(t) for t in inp.block_tables) > self.block_tables.shape[1]:
            return None
        return next(x for x in self.buckets if x >= b)

    def _meta(self, b: int) -> GpuAttentionMetadata:
        return GpuAttentionMetadata(
            True,
            self.slots[:b],
            self.block_tables[:b],
            self.context_lens[:b],
            num_splits=self.num_splits(b),
            num_tokens=b,
            batch_invariant=self.batch_invariant,
        )

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.cache.kv, self._meta(b))
        return self.model.compute_logits(hidden), hidden

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first: smaller ones reuse its pool memory
                self._forward(b)  # warm-up: compiles the kernels of this bucket
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits, hidden = self._forward(b)
                self._graphs[b], self._hidden[b] = (graph, logits), hidden
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (batch %d..%d) in %.1f s",
            len(self._graphs),
            self.buckets[0],
            self.buckets[-1],
            time.perf_counter() - start,
        )

    def run(self, step: GpuStep, fill_pending) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step into the static buffers, fill pending tokens, replay; logits [B, V]
        and hidden states [B, H], both the graph's own buffers (the next replay overwrites them)."""
        b = step.padded
        graph, logits = self._graphs[b]
        self.input_ids[:b].copy_(step.input_ids)
        self.positions[:b].copy_(step.positions)
        self.slots[:b].copy_(step.meta.slot_mapping)
        self.context_lens[:b].copy_(step.meta.context_lens)
        bt = step.meta.block_tables
        self.block_tables[:b, : bt.shape[1]].copy_(bt)
        fill_pending(self.input_ids[:b], step)
        graph.replay()
        self.num_replays += 1
        return logits[: step.batch], self._hidden[b][: step.batch]
