"""The CUDA step runner (``runner.StepRunner``): Triton kernels, CUDA graphs, and asynchronous results.

``execute`` launches a step and returns at once with a ``PendingStepResult``: the sampled
tokens are copied into pinned host memory (``non_blocking``) and an event is recorded after the
copy. The host waits on that event only when it processes the step's outputs, so with
zero-overhead scheduling the worker thread is already launching step N+1 while the device
runs step N. Nothing in a step calls ``.item()`` / ``.tolist()`` on a device tensor.

On CPU tensors the same code runs under Triton's interpreter (``TRITON_INTERPRET=1``): the tests
check it there against ``CpuRunner``.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from pdinfer.config import RunnerOptions
from pdinfer.layers.attention.triton_mla import mla_decode_programs, use_triton_mla
from pdinfer.layers.attention.triton_paged import use_triton_attention
from pdinfer.layers.moe import SparseMoE
from pdinfer.models.llama import LlamaForCausalLM
from pdinfer.worker import batch_invariant
from pdinfer.worker.cache_engine import CacheEngine
from pdinfer.worker.gpu_input import GpuInputBuilder, GpuStep
from pdinfer.worker.runner_base import RunnerBase
from pdinfer.worker.sampler import SamplerOutput, constraint_tensors, score_prompt
from pdinfer.worker.step_input import StepInput, StepResult

if TYPE_CHECKING:
    from pdinfer.models.loader import CausalLM
    from pdinfer.worker.cuda_graph import CudaGraphRunner

logger = logging.getLogger("pdinfer")

_RESULT_FIELDS = (
    "token_ids",
    "logprobs",
    "top_ids",
    "top_logprobs",
    "prompt_logprobs",
    "prompt_ranks",
    "prompt_top_ids",
    "prompt_top_logprobs",
)


class PendingStepResult:
    """A launched step's outputs on their way to pinned host memory."""

    def __init__(self, step_id: int, out: SamplerOutput | None, hidden: torch.Tensor | None = None):
        self.step_id = step_id
        self.host: dict[str, torch.Tensor] = {}
        self.event = None
        self.hidden = hidden  # stays on the device (``StepResult.hidden``)
        if out is None:
            return
        pin = out.token_ids.is_cuda
        for name in _RESULT_FIELDS:
            value = getattr(out, name)
            if value is not None:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
                host.copy_(value, non_blocking=pin)
                self.host[name] = host
        if pin:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()  # releases the GIL while the device finishes
        lists = {name: t.tolist() for name, t in self.host.items()}
        token_ids = lists.pop("token_ids", [])
        return StepResult(step_id=self.step_id, token_ids=token_ids, hidden=self.hidden, **lists)


class GpuRunner(RunnerBase):
    async_results = True

    def _prepare_model(self, load_format: str, options: RunnerOptions) -> None:
        if self.device.index is not None:  # "cuda:N": this thread's kernels (Triton too) go there
            torch.cuda.set_device(self.device)
        use_triton_attention(self.model, verifies_drafts=options.verifies_drafts)
        if isinstance(self.model, LlamaForCausalLM):
            self.model.fused_residual = True  # residual add + RMSNorm in one Triton kernel
        use_triton_mla(self.model)
        mla = self.spec.mla
        # decode attention programs per sequence and split: KV heads, or MLA's head groups
        self.decode_programs = mla_decode_programs(self.spec.num_heads) if mla else self.spec.num_kv_heads
        props = torch.cuda.get_device_properties(self.device) if self.device.type == "cuda" else None
        self.num_sms = props.multi_processor_count if props is not None else 132
        if self.batch_invariant:
            batch_invariant.prepare_gpu_model(self.model, self.num_sms)
        self.builder: GpuInputBuilder | None = None
        self.graphs: CudaGraphRunner | None = None
        self.kv_profile: dict[str, int] = {}  # the last profile_num_blocks: peak, free, ... (bytes)
        # Benchmarks set this to time each step's device span (idle gaps between steps).
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    def init_cache(self, num_blocks: int, block_size: int) -> CacheEngine:
        cache = super().init_cache(num_blocks, block_size)
        self.builder = builder = self._input_builder(block_size)
        self._compile_prefix_prefill(builder, block_size)
        return cache

    @torch.inference_mode()
    def _compile_prefix_prefill(self, builder: GpuInputBuilder, block_size: int) -> None:
        """One block of a prompt after a cached block, on a scratch cache: Triton compiles the
        prefill attention of chunks over a cached prefix (prefix hits, chunked prompts, prefills
        beside decodes) here, at start-up. The KV profile's step is a fresh prompt, which takes
        the other kernel (``triton_prefill``); without this the first such chunk would compile it
        in the middle of serving, a stall that costs throughput and TTFT
        (docs/performance.md#measurements-behind-design-choices)."""
        scratch = CacheEngine(self.spec, 2, block_size, self.kv_dtype, self.device)
        step = builder.build(
            StepInput(
                step_id=-1,
                is_prompt=True,
                input_ids=[0] * block_size,
                positions=list(range(block_size, 2 * block_size)),
                query_lens=[block_size],
                context_lens=[2 * block_size],
                block_tables=[[0, 1]],
                samples=[],
            )
        )
        self.model(step.input_ids, step.positions, scratch.kv, step.meta)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _input_builder(self, block_size: int) -> GpuInputBuilder:
        latent = self.spec.mla is not None
        return GpuInputBuilder(
            block_size,
            self.spec.vocab_size,
            self.decode_programs,
            self.device,
            self.num_sms,
            latent_cache=latent,
            batch_invariant=self.batch_invariant,
        )

    def capture_cuda_graphs(self, max_rows: int, max_model_len: int) -> None:
        from pdinfer.worker.cuda_graph import CudaGraphRunner

        reason = graph_blocker(self.model)
        if reason is not None:
            logger.info("%s runs without CUDA graphs: %s", self.spec.architecture, reason)
            return
        cache = self.require_cache()
        max_blocks = -(-max_model_len // cache.block_size)
        self.graphs = CudaGraphRunner(
            self.model, cache, max_rows, max_blocks, self.num_sms, self.decode_programs, self.batch_invariant
        )
        # Decode graphs hold cuBLASLt's GEMMs: at decode sizes they are faster than cuBLAS's
        # (down_proj without a split-K reduce); eager prefill keeps cuBLAS, no faster on cuBLASLt
        # (docs/performance.md#measurements-behind-design-choices). The choice is the process's:
        # set for the capture only.
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            self.graphs.capture()
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    # --- one step ----------------------------------------------------------------------------
    def execute(self, inp: StepInput) -> PendingStepResult:
        if self.device.type != "cuda":  # the Triton interpreter's CPU tests
            return self._execute(inp)
        with torch.cuda.device(self.device):  # the current device is per thread (and per engine)
            return self._execute(inp)

    @torch.inference_mode()
    def _execute(self, inp: StepInput) -> PendingStepResult:
        cache, graphs, builder = self.require_cache(), self.graphs, self.builder
        if builder is None:
            raise RuntimeError("init_cache first")
        # A graph keeps only the sampled rows' logits: prompt log-probs run eagerly.
        bucket = graphs.bucket_for(inp) if graphs is not None and not inp.prompt_rows else None
        splits = graphs.num_splits(bucket) if graphs is not None and bucket is not None else None
        step = builder.build(inp, pad_to=bucket, num_splits=splits)
        start = self._mark()
        if step.clone_src is not None and step.clone_dst is not None:
            cache.clone_blocks(step.clone_src, step.clone_dst)
        if inp.num_tokens == 0:
            return PendingStepResult(inp.step_id, None)
        if graphs is not None and bucket is not None:
            logits, hidden = graphs.run(step, self._fill_pending)
        else:
            self._fill_pending(step.input_ids, step)
            keep = self._keep_rows(inp, step)
            hidden = self.model(step.input_ids, step.positions, cache.kv, step.meta, keep_rows=keep)
            logits = self.model.compute_logits(hidden if keep is not None else self._sampled_rows(hidden, step))
        if bucket is not None and step.sample_rows is not None:
            logits = logits.index_select(0, step.sample_rows)
        self._fill_pending_penalty(step)
        if inp.masks_later is not None:  # computed on the host while the forward ran
            inp.masks_later.fill(inp.samples)
            masks = constraint_tensors(inp.samples, self.device)
            step.sampling.mask_rows, step.sampling.masks = masks.get("mask_rows"), masks.get("masks")
        out = self.sampler(logits, step.sampling)
        if step.prompt_rows is not None and step.prompt_targets is not None:  # an eager step
            prompt_hidden = hidden.index_select(0, step.prompt_rows)
            score_prompt(self.model.compute_logits, prompt_hidden, step.prompt_targets, inp.prompt_top_k, out)
        self._remember(inp.step_id, out.token_ids)
        # A hidden-state drafter (MTP) reads every row's; a graph's buffer is copied (the next
        # replay overwrites it, possibly before the host has processed this step).
        kept = None
        if self.keep_hidden:
            kept = hidden.clone() if bucket is not None else hidden[: step.batch]
        result = PendingStepResult(inp.step_id, out, kept)
        if start is not None and self.step_events is not None:
            self.step_events.append((start, self._mark()))
        return result

    def _mark(self):
        if self.step_events is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _keep_rows(self, inp: StepInput, step: GpuStep) -> torch.Tensor | None:
        """The rows whose last hidden states the step needs, when they are fewer than its rows
        (a prefill samples one row a sequence): the last layer then runs its o_proj and MLP on
        those rows only, about 3 % of a 4 x 2048 prefill's FLOPs on the 8B shape. None where
        every row is needed: prompt log-probs, a hidden-state drafter."""
        if step.sample_rows is None or inp.prompt_rows or self.keep_hidden:
            return None
        return step.sample_rows

    @staticmethod
    def _sampled_rows(hidden: torch.Tensor, step: GpuStep) -> torch.Tensor:
        if step.sample_rows is None:
            return hidden[: step.num_samples]
        return hidden.index_select(0, step.sample_rows)

    def _fill_pending(self, input_ids: torch.Tensor, step: GpuStep) -> None:
        for step_id, rows, indices in step.pending:
            input_ids.index_copy_(0, rows, self._recent_tokens(step_id).index_select(0, indices))

    def _fill_pending_penalty(self, step: GpuStep) -> None:
        tokens = step.sampling.output_tokens
        if tokens is None:  # no row has penalties, so none waits for a pending token there
            return
        for step_id, row, col, index in step.pending_penalty:
            tokens[row, col] = self._recent_tokens(step_id)[index]

    # --- KV capacity -------------------------------------------------------------------------
    def profile_num_blocks(
        self,
        memory_bytes: int,
        block_size: int,
        tokens: int,
        rows: int,
        decode: bool,
        gpu_memory_utilization: float = 0.9,
        graphs: bool = True,
        extra_layers: int = 0,
    ) -> int:
        """KV blocks that fit in ``gpu_memory_utilization`` of the device next to the real peak
        of this role's largest step, measured by running it (``max_memory_allocated``);
        ``memory_bytes`` (the CPU's budget) does not apply;
        ``extra_layers``: cache layers outside the model's (the MTP drafter's), per block."""
        spec = self.spec
        peak = self._measure_peak_bytes(block_size, tokens, rows, decode)
        free, total = torch.cuda.mem_get_info()
        # CUDA graphs keep one pool for the largest decode batch: logits (the model's dtype) plus
        # a margin. A PE captures no graphs, so it keeps no room for them.
        graph_reserve = 256 * 2**20 + rows * spec.vocab_size * self.dtype.itemsize if graphs else 0
        budget = free - (1.0 - gpu_memory_utilization) * total - peak - graph_reserve
        per_block = self._bytes_per_block(block_size, extra_layers)
        num_blocks = int(budget // per_block)
        # what decided it, for the GPU suite's role check (benchmarks/gpu_micro.py)
        self.kv_profile = {"peak": peak, "free": free, "total": total, "reserve": graph_reserve}
        self.kv_profile.update(per_block=per_block, num_blocks=num_blocks)
        logger.info(
            "profile (%s, %d tokens): activation peak %.0f MiB, free %.1f GiB -> %d KV blocks",
            "decode" if decode else "prefill",
            tokens,
            peak / 2**20,
            free / 2**30,
            num_blocks,
        )
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: {free / 2**30:.1f} GiB free, the role's peak step needs "
                f"{peak / 2**30:.1f} GiB, and {1 - gpu_memory_utilization:.0%} of the device is "
                "kept free; raise gpu_memory_utilization"
            )
        return num_blocks

    @torch.inference_mode()
    def _measure_peak_bytes(self, block_size: int, num_tokens: int, num_rows: int, decode: bool) -> int:
        """Device memory a dummy step of this shape takes at its peak, beyond what was allocated."""
        seqs = num_tokens if decode else 1
        blocks_per_seq = 1 if decode else -(-num_tokens // block_size)
        scratch = CacheEngine(self.spec, seqs * blocks_per_seq, block_size, self.kv_dtype, self.device)
        inp = _profile_input(seqs, num_tokens, num_rows, blocks_per_seq, decode)
        builder = self._input_builder(block_size)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.inference_mode():
            step = builder.build(inp)
            hidden = self.model(step.input_ids, step.positions, scratch.kv, step.meta)
            logits = self.model.compute_logits(self._sampled_rows(hidden, step))
            del hidden
            self.sampler(logits, step.sampling)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del scratch, step, logits
        gc.collect()
        torch.cuda.empty_cache()
        return peak


def graph_blocker(model: CausalLM) -> str | None:
    """Why decode steps of ``model`` cannot be replayed from CUDA graphs; None if they can."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return None if isinstance(model, LlamaForCausalLM) else "not a graph-tested architecture"
    for layer in layers:
        if layer.placement is not None:  # a rearrangement swaps the slot map a graph would keep
            return "EPLB's placement changes between steps"
        if not layer.experts.fused(layer.experts.down_proj):  # the torch path reads counts on the host
            return "the MoE experts run the torch path (no Triton)"
    return None


def _profile_input(seqs: int, num_tokens: int, num_rows: int, blocks_per_seq: int, decode: bool) -> StepInput:
    """A synthetic step of the role's largest shape; samples take the top-p path (its sort is
    the sampler's largest buffer)."""
    from pdinfer.worker.step_input import SampleSpec

    if decode:
        qlens, ctx = [1] * seqs, [1] * seqs
        positions = [0] * seqs
    else:
        qlens, ctx = [num_tokens], [num_tokens]
        positions = list(range(num_tokens))
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(seqs)]
    rows = list(range(num_rows)) if decode else [num_tokens - 1] * num_rows
    samples = [
        SampleSpec(row=r, temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=i, position=0)
        for i, r in enumerate(rows)
    ]
    return StepInput(
        step_id=-1,
        is_prompt=not decode,
        input_ids=[0] * num_tokens,
        positions=positions,
        query_lens=qlens,
        context_lens=ctx,
        block_tables=tables,
        samples=samples,
    )
