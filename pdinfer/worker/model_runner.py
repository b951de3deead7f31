"""Runs the model for one step: inputs to tensors, forward, logits of sampled rows, sampling.

Knows nothing about roles: the engine tells it the shape of its largest step (``profile_num_blocks``)
and whether to capture CUDA graphs; its settings come as ``RunnerOptions``, never from the
environment.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from pdinfer.config import MoEConfig, RunnerOptions
from pdinfer.layers import cpu_kernels, fp8
from pdinfer.layers.cpu_decode_stack import DecodeStack
from pdinfer.layers.cpu_linear import pack_linears
from pdinfer.layers.moe import SparseMoE
from pdinfer.models.llama import LlamaForCausalLM
from pdinfer.models.loader import build_model, load_quantized_blocks
from pdinfer.models.spec import ModelSpec
from pdinfer.moe.sharding import needs_sharding, shard_experts
from pdinfer.worker import batch_invariant
from pdinfer.worker.cache_engine import CacheEngine, block_bytes
from pdinfer.worker.input_builder import build_attention_metadata, build_sampling_tensors
from pdinfer.worker.sampler import Sampler, SamplerOutput, score_prompt
from pdinfer.worker.step_input import PENDING_TOKEN, StepInput, StepResult

if TYPE_CHECKING:
    from pdinfer.distributed.ep_group import TorchExpertGroup
    from pdinfer.worker.gpu_runner import GpuStepRunner, PendingStepResult

logger = logging.getLogger("pdinfer")

# CPU: a prefill step runs as forwards over whole sequences of about this many tokens, so the
# activations stay in the last-level cache (faster than one forward over a large step).
PREFILL_SUBBATCH_TOKENS = 2048


class StepFuture(Protocol):
    """A launched step: a ``Future``, or on CUDA a ``DeviceStepFuture`` around one."""

    def result(self, timeout: float | None = None) -> StepResult: ...

    def done(self) -> bool: ...


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        folder: str,
        load_format: str,
        dtype: torch.dtype,
        device: torch.device,
        options: RunnerOptions,
        seed: int = 0,
        moe_config: MoEConfig | None = None,
        expert_group: TorchExpertGroup | None = None,
    ):
        self.spec = spec
        self.folder = folder
        self.dtype = dtype
        self.device = device
        self.moe_layers: list[SparseMoE] = []  # sharded sparse layers (expert parallelism, EPLB)
        transform = None
        if moe_config is not None and needs_sharding(moe_config):

            def transform(model):
                self.moe_layers = shard_experts(model, moe_config, expert_group, dtype, device)

        self.batch_invariant = options.batch_invariant
        if self.batch_invariant:
            batch_invariant.check_device(device, dtype)
        fp8.check_support(
            device,
            options.kv_cache_dtype,
            options.quantization,
            latent_cache=spec.mla is not None,
            moe=spec.moe is not None,
        )
        # The KV cache's element type: the model's, or e4m3 (layers/fp8.py: static scale 1.0).
        self.kv_dtype = fp8.FP8_DTYPE if options.kv_cache_dtype == "fp8" else dtype
        self.model = build_model(spec, folder, load_format, dtype, device, seed, transform)
        if options.quantization == "fp8":  # checkpoint and dummy weights alike, after loading
            fp8.quantize_linears(self.model)
        self.dispatcher = self.moe_layers[0].dispatcher if self.moe_layers else None
        self.native_kernels = None
        if device.type == "cpu" and dtype in cpu_kernels.KV_DTYPES:
            # Native kernels (None: plain torch) for attention and small linears, then oneDNN-packed linears (faster than F.linear),
            # which also read a GGUF model's quantized blocks in small decode steps and, on CPUs
            # with AMX, in every step of 32+ rows (float32 only: a bfloat16 model runs every
            # linear through oneDNN's bf16 GEMM).
            self.native_kernels = cpu_kernels.load(options.cache_dir)
            use_blocks = (
                self.native_kernels is not None
                and load_format != "dummy"
                and dtype == torch.float32
                and options.cpu_quant_gemm
            )
            if self.batch_invariant:
                batch_invariant.check_model(self.model, self.native_kernels)
            pack_linears(
                self.model,
                self.native_kernels,
                load_quantized_blocks(folder) if use_blocks else None,
                amx=bool(use_blocks and options.cpu_amx),
                batch_invariant=self.batch_invariant,
            )
            if options.cpu_decode_stack and isinstance(self.model, LlamaForCausalLM):
                self.model.decode_stack = DecodeStack.build(self.model, self.native_kernels, self.batch_invariant)
        self.sampler = Sampler()
        self.cache: CacheEngine | None = None
        # A hidden-state drafter (MTP) reads every row's last-layer hidden state: the last
        # layer then computes all rows, and ``StepResult.hidden`` carries them (on the device).
        self.keep_hidden = False
        # Sampled tokens of the last few steps, on the device, by step id (zero-overhead
        # scheduling feeds them to the next step before the host has seen them).
        self._recent: OrderedDict[int, torch.Tensor] = OrderedDict()
        # CUDA: Triton kernels, CUDA graphs, asynchronous results (pdinfer/worker/gpu_runner.py)
        self.gpu: GpuStepRunner | None = None
        if device.type == "cuda":
            from pdinfer.worker.gpu_runner import GpuStepRunner

            self.gpu = GpuStepRunner(self)

    # --- KV capacity ---------------------------------------------------------------------------
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
        """KV blocks that fit next to the peak activations of the largest step: ``tokens``
        tokens with ``rows`` logit rows, a decode step or not (the engine's role decides);
        ``graphs``: room is kept for CUDA graphs (an engine that captures them);
        ``extra_layers``: cache layers outside the model's (the MTP drafter's), per block."""
        if self.gpu is not None:  # measured: a dummy step of this shape, real peak memory
            return self.gpu.profile_num_blocks(
                block_size, tokens, rows, decode, gpu_memory_utilization, graphs, extra_layers
            )
        peak = self.activation_bytes(tokens, rows)
        if self.dispatcher is not None:  # the all-to-all buffers, sized by the role's MoE workspace
            peak += self.dispatcher.workspace_bytes
        layers = self.spec.num_layers
        per_block = block_bytes(self.spec, block_size, self.kv_dtype) * (layers + extra_layers) // layers
        num_blocks = (memory_bytes - peak) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV memory budget {memory_bytes / 2**20:.0f} MiB is too small: the role's peak "
                f"step needs {peak / 2**20:.0f} MiB of activations; raise --kv-cache-memory"
            )
        return int(num_blocks)

    def activation_bytes(self, num_tokens: int, num_logit_rows: int) -> int:
        """Peak activation memory of a forward over ``num_tokens`` (an upper estimate on CPU)."""
        s = self.spec
        item = torch.empty((), dtype=self.dtype).element_size()
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        per_token = (4 * s.hidden_size + 2 * qkv + 3 * s.intermediate_size) * item
        if s.moe is not None:  # the rows sorted by expert and their outputs (layers/moe.py)
            per_token += 2 * s.moe.top_k * s.hidden_size * item
        logits = num_logit_rows * s.vocab_size * 4 * 4  # logits, probs, noise, sort
        return num_tokens * per_token + logits

    def init_cache(self, num_blocks: int, block_size: int) -> CacheEngine:
        self.cache = CacheEngine(self.spec, num_blocks, block_size, self.kv_dtype, self.device)
        if self.gpu is not None:
            self.gpu.init_cache(self.cache)
        return self.cache

    def require_cache(self) -> CacheEngine:
        """``cache``, which ``init_cache`` must have made."""
        if self.cache is None:
            raise RuntimeError("init_cache first")
        return self.cache

    def capture_cuda_graphs(self, max_rows: int, max_model_len: int) -> None:
        """Capture decode CUDA graphs for steps of up to ``max_rows`` one-query rows (after the
        KV cache exists; CUDA only)."""
        if self.gpu is not None:
            self.gpu.capture_cuda_graphs(max_rows, max_model_len)

    # --- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inp: StepInput) -> StepResult | PendingStepResult:
        cache = self.require_cache()
        if self.gpu is not None:
            return self.gpu.execute(inp)  # a PendingStepResult; DeviceStepFuture waits for it
        cache.copy_blocks(inp.clone_blocks)
        cache.copy_states(inp.clone_states)
        with self._moe_step(inp.is_prompt):
            return self._execute(inp)

    def _moe_step(self, is_prompt: bool):
        return self.dispatcher.step(is_prompt) if self.dispatcher is not None else contextlib.nullcontext()

    def _execute(self, inp: StepInput) -> StepResult:
        if inp.num_tokens == 0:
            if self.dispatcher is not None:  # the other ranks' MoE layers need this rank's (empty) share
                self._empty_moe_step()
            return StepResult(step_id=inp.step_id, token_ids=[])
        input_ids = torch.tensor(inp.input_ids, dtype=torch.int64, device=self.device)
        if inp.pending:
            self._fill_pending(input_ids, inp)
        positions = torch.tensor(inp.positions, dtype=torch.int64, device=self.device)
        keep = [s.row for s in inp.samples] + inp.prompt_rows
        rows = list(range(inp.num_tokens)) if self.keep_hidden else keep
        # Not with expert parallelism: every rank must run the same number of forwards.
        if inp.is_prompt and inp.num_tokens > PREFILL_SUBBATCH_TOKENS and self.dispatcher is None:
            hidden = self._prefill_in_subbatches(inp, input_ids, positions, rows)
        else:
            hidden = self._forward(inp, input_ids, positions, rows)
        every_row = None
        if self.keep_hidden:
            every_row, hidden = hidden, hidden[torch.tensor(keep, dtype=torch.int64, device=self.device)]
        num_samples = len(inp.samples)
        logits = self.model.compute_logits(hidden[:num_samples])
        if inp.masks_later is not None:
            inp.masks_later.fill(inp.samples)
        tensors = build_sampling_tensors(inp.samples, self.spec.vocab_size, self.device)
        if tensors.output_tokens is not None and inp.pending:
            self._fill_pending_penalty_tokens(tensors.output_tokens, inp)
        out = self.sampler(logits, tensors)
        if inp.prompt_rows:
            targets = torch.tensor(inp.prompt_targets, dtype=torch.int64, device=self.device)
            score_prompt(self.model.compute_logits, hidden[num_samples:], targets, inp.prompt_top_k, out)
        self._recent[inp.step_id] = out.token_ids
        while len(self._recent) > 4:
            self._recent.popitem(last=False)
        result = _to_host(inp.step_id, out)
        result.hidden = every_row
        return result

    def _empty_moe_step(self) -> None:
        """A step without tokens still runs every sparse layer, in order, on zero rows."""
        empty = torch.empty(0, self.spec.hidden_size, dtype=self.dtype, device=self.device)
        for layer in self.moe_layers:
            layer(empty)

    def _forward(
        self, inp: StepInput, input_ids: torch.Tensor, positions: torch.Tensor, keep: list[int]
    ) -> torch.Tensor:
        """Last-layer hidden states of the rows ``keep`` names, in its order."""
        kv = self.require_cache().kv
        model_meta = getattr(self.model, "build_attention_metadata", None)  # a model's own cache layout (MLA)
        if model_meta is not None:
            meta = model_meta(inp, kv)
        else:
            meta = build_attention_metadata(inp, kv, self.native_kernels, self.batch_invariant)
        if keep == list(range(inp.num_tokens)):  # a decode step: every row is sampled
            return self.model(input_ids, positions, kv, meta)
        # only the kept rows leave the last layer
        rows = torch.tensor(keep, dtype=torch.int64, device=self.device)
        return self.model(input_ids, positions, kv, meta, keep_rows=rows)

    def _prefill_in_subbatches(
        self, inp: StepInput, input_ids: torch.Tensor, positions: torch.Tensor, keep: list[int]
    ) -> torch.Tensor:
        """A large prefill step as several forwards over whole sequences (same results)."""
        parts, order = [], []
        for sub, lo, picked in _prefill_subbatches(inp, PREFILL_SUBBATCH_TOKENS, keep):
            hi = lo + sub.num_tokens
            parts.append(self._forward(sub, input_ids[lo:hi], positions[lo:hi], [keep[i] - lo for i in picked]))
            order += picked
        hidden = torch.cat(parts)
        if order != list(range(len(order))):
            hidden = hidden[torch.tensor(order).argsort()]
        return hidden

    def _pending_token(self, step_id: int, index: int) -> torch.Tensor:
        tokens = self._recent.get(step_id)
        if tokens is None:
            raise RuntimeError(f"a pending token refers to step {step_id}, which this runner did not run recently")
        return tokens[index]

    def _fill_pending(self, input_ids: torch.Tensor, inp: StepInput) -> None:
        for row, step_id, index in inp.pending:
            input_ids[row] = self._pending_token(step_id, index)

    def _fill_pending_penalty_tokens(self, tokens: torch.Tensor, inp: StepInput) -> None:
        pending_of_row = {row: (step_id, index) for row, step_id, index in inp.pending}
        for i, spec in enumerate(inp.samples):
            if spec.output_tokens and spec.output_tokens[-1] == PENDING_TOKEN:
                tokens[i, len(spec.output_tokens) - 1] = self._pending_token(*pending_of_row[spec.row])


def _prefill_subbatches(inp: StepInput, max_tokens: int, keep: list[int]):
    """(sub-step, its first row, indices into ``keep`` of its rows) over whole sequences of
    about ``max_tokens`` tokens each (a longer sequence goes alone)."""
    bounds, start, tokens = [], 0, 0
    for i, qlen in enumerate(inp.query_lens):
        if tokens and tokens + qlen > max_tokens:
            bounds.append((start, i))
            start, tokens = i, 0
        tokens += qlen
    bounds.append((start, len(inp.query_lens)))
    row = 0
    for first, end in bounds:
        num_rows = sum(inp.query_lens[first:end])
        picked = [i for i, r in enumerate(keep) if row <= r < row + num_rows]
        yield (
            StepInput(
                step_id=inp.step_id,
                is_prompt=True,
                input_ids=inp.input_ids[row : row + num_rows],
                positions=inp.positions[row : row + num_rows],
                query_lens=inp.query_lens[first:end],
                context_lens=inp.context_lens[first:end],
                block_tables=inp.block_tables[first:end],
            ),
            row,
            picked,
        )
        row += num_rows


def _to_host(step_id: int, out: SamplerOutput) -> StepResult:
    result = StepResult(step_id=step_id, token_ids=out.token_ids.tolist())
    if out.logprobs is not None:
        result.logprobs = out.logprobs.tolist()
    if out.top_ids is not None and out.top_logprobs is not None:  # set together
        result.top_ids = out.top_ids.tolist()
        result.top_logprobs = out.top_logprobs.tolist()
    for name in ("prompt_logprobs", "prompt_ranks", "prompt_top_ids", "prompt_top_logprobs"):
        value = getattr(out, name)
        if value is not None:
            setattr(result, name, value.tolist())
    return result


def _bind_device(device: torch.device) -> None:
    """The step thread works on the engine's GPU ("cuda:N"; the current device is per thread)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


class _CallerStep(Future):
    """A launched CPU step that the calling thread runs: in ``StepExecutor.overlap_with`` while
    the helper thread does host work, or when first waited for, whichever comes first."""

    def __init__(self, executor: StepExecutor, inp: StepInput):
        super().__init__()
        self._executor = executor
        self._inp: StepInput | None = inp  # None once run
        self.overlapped = False  # run by ``overlap_with``, whose helper settles deferred masks

    def run(self) -> None:
        if self.done():  # without the lock: the helper must not wait for the step running now
            return
        deferred = self._inp.masks_later if self._inp is not None else None
        if deferred is not None and not self.overlapped:
            deferred.settle()  # run before its host work (a step-ordered call): settle it here
        with self._executor._lock:  # steps and step-ordered calls never interleave
            if self.done() or self._inp is None:
                return
            try:
                self.set_result(self._executor.runner.execute(self._inp))
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits on it
                self.set_exception(exc)
            finally:
                self._inp = None

    def result(self, timeout=None):
        self.run()
        return super().result(timeout)


class StepExecutor:
    """Runs steps in order, and lets host work overlap them (zero-overhead scheduling).

    Without overlap every step runs inline in ``launch``. With overlap on a GPU, steps run on one
    worker thread: the host schedules and processes outputs of step N while the device computes
    step N+1. On the CPU the overlap goes the other way round: the forward runs on the calling
    thread (``overlap_with``) while the helper thread processes the previous step's outputs. A CPU
    forward already uses every core through OpenMP, and starting its parallel regions from a
    second thread gives the process a second OpenMP pool, more threads than cores, and libgomp's
    throttled spinning, which makes batch-1 decode markedly slower. Steps still execute
    strictly in launch order.
    """

    def __init__(self, runner: ModelRunner, overlap: bool):
        self.runner = runner
        self.overlap = overlap
        self.forward_on_caller = overlap and runner.gpu is None
        self._pool = (
            ThreadPoolExecutor(
                1, thread_name_prefix="pdinfer-step", initializer=_bind_device, initargs=(runner.device,)
            )
            if overlap
            else None
        )
        self._lock = threading.Lock()
        self._last: _CallerStep | None = None

    def launch(self, inp: StepInput) -> StepFuture:
        if self.forward_on_caller:
            if self._last is not None:
                self._last.run()  # launch order is execution order
            self._last = _CallerStep(self, inp)
            return self._last
        future: Future  # of a StepResult; on CUDA of a PendingStepResult
        if self._pool is not None:
            future = self._pool.submit(self._run, inp)
        else:
            future = Future()
            try:
                future.set_result(self._run(inp))
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits on it
                future.set_exception(exc)
        if self.runner.gpu is not None:
            from pdinfer.worker.gpu_runner import DeviceStepFuture

            return DeviceStepFuture(future)  # result() also waits for the device
        return future

    def overlap_with(self, step: StepFuture | None, host_work):
        """``host_work()``'s result, computed while ``step`` (just launched) runs."""
        if isinstance(step, _CallerStep) and not step.done() and self._pool is not None:
            helper = self._pool.submit(host_work)
            step.overlapped = True
            step.run()
            return helper.result()
        return host_work()

    def _run(self, inp: StepInput) -> StepResult | PendingStepResult:
        with self._lock:
            return self.runner.execute(inp)

    def submit_call(self, fn, *args) -> Future:
        """Run ``fn`` in step order (after every launched step), e.g. a KV copy."""
        if self._pool is not None and not self.forward_on_caller:
            return self._pool.submit(self._locked, fn, *args)
        if self._last is not None:
            self._last.run()  # a launched step not yet run goes first
        future: Future = Future()
        future.set_result(self._locked(fn, *args))
        return future

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
