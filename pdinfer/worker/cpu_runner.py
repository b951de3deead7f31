"""The CPU step runner (``runner.StepRunner``): native kernels and oneDNN-packed linears, the
decode stack, prefill in sub-batches, and results computed on the calling thread.

Knows nothing about roles: the engine tells it the shape of its largest step (``profile_num_blocks``);
its settings come as ``RunnerOptions``, never from the environment.
"""

from __future__ import annotations

import contextlib

import torch

from pdinfer.config import RunnerOptions
from pdinfer.layers import cpu_kernels
from pdinfer.layers.cpu_decode_stack import DecodeStack
from pdinfer.layers.cpu_linear import pack_linears
from pdinfer.models.llama import LlamaForCausalLM
from pdinfer.models.loader import load_quantized_blocks
from pdinfer.worker import batch_invariant
from pdinfer.worker.input_builder import build_attention_metadata, build_sampling_tensors
from pdinfer.worker.runner_base import RunnerBase
from pdinfer.worker.sampler import SamplerOutput, score_prompt
from pdinfer.worker.step_input import PENDING_TOKEN, StepInput, StepResult

# A prefill step runs as forwards over whole sequences of about this many tokens, so the
# activations stay in the last-level cache (faster than one forward over a large step).
PREFILL_SUBBATCH_TOKENS = 2048


class CpuRunner(RunnerBase):
    async_results = False

    def _prepare_model(self, load_format: str, options: RunnerOptions) -> None:
        self.native_kernels = None
        if self.device.type == "cpu" and self.dtype in cpu_kernels.KV_DTYPES:
            # Native kernels (None: plain torch) for attention and small linears, then oneDNN-packed linears (faster than F.linear),
            # which also read a GGUF model's quantized blocks in small decode steps and, on CPUs
            # with AMX, in every step of 32+ rows (float32 only: a bfloat16 model runs every
            # linear through oneDNN's bf16 GEMM).
            self.native_kernels = cpu_kernels.load(options.cache_dir)
            use_blocks = (
                self.native_kernels is not None
                and load_format != "dummy"
                and self.dtype == torch.float32
                and options.cpu_quant_gemm
            )
            if self.batch_invariant:
                batch_invariant.check_model(self.model, self.native_kernels)
            pack_linears(
                self.model,
                self.native_kernels,
                load_quantized_blocks(self.folder) if use_blocks else None,
                amx=bool(use_blocks and options.cpu_amx),
                batch_invariant=self.batch_invariant,
            )
            if options.cpu_decode_stack and isinstance(self.model, LlamaForCausalLM):
                self.model.decode_stack = DecodeStack.build(self.model, self.native_kernels, self.batch_invariant)

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
        """``runner.StepRunner.profile_num_blocks``: ``memory_bytes`` less an estimate of the
        peak activations (``activation_bytes``), in blocks."""
        peak = self.activation_bytes(tokens, rows)
        if self.dispatcher is not None:  # the all-to-all buffers, sized by the role's MoE workspace
            peak += self.dispatcher.workspace_bytes
        num_blocks = (memory_bytes - peak) // self._bytes_per_block(block_size, extra_layers)
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

    def capture_cuda_graphs(self, max_rows: int, max_model_len: int) -> None:
        """No graphs on the CPU: a decode step's layers run as one native call (``DecodeStack``)."""

    # --- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inp: StepInput) -> StepResult:
        cache = self.require_cache()
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
        self._remember(inp.step_id, out.token_ids)
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
        return self._recent_tokens(step_id)[index]

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
