"""One typed config tree. Frozen dataclasses, validated in ``__post_init__`` with real errors.

No torch import here: the scheduler reads ``SchedulerConfig`` and must stay torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pdinfer import env
from pdinfer.engine_type import EngineType

MiB = 1 << 20
GiB = 1 << 30

SPECULATIVE_METHODS = ("ngram", "mtp")
DEFAULT_NUM_DRAFT_TOKENS = 3  # k when speculation is on and num_draft_tokens is left at 0


@dataclass(frozen=True)
class SchedulerConfig:
    engine_type: int  # EngineType value; an int because it crosses process boundaries
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    chunked_prefill: bool = False
    stop_preempted_request: bool = False
    prefill_attempt_interval: int = 70
    prefill_any_attempt_interval: int = 100
    prefill_kv_watermark: float = 0.95

    def __post_init__(self) -> None:
        role = EngineType.from_int(self.engine_type)
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "prefill_attempt_interval",
            "prefill_any_attempt_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): without chunked prefill the longest "
                "prompt must fit in one step; raise max_num_batched_tokens, lower max_model_len, "
                "or enable chunked_prefill"
            )
        if role is EngineType.COMPLETION and not self.stop_preempted_request:
            raise ValueError(
                "a COMPLETION engine cannot recompute preempted requests (it has no prefill "
                "channel); it must run with stop_preempted_request=True (--stop-preempted-request)"
            )

    @property
    def role(self) -> EngineType:
        return EngineType.from_int(self.engine_type)

    @property
    def prompt_limit(self) -> int:
        if self.chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # fixed count (tests); else sized from the memory budget
    kv_cache_memory_bytes: int | None = None  # CPU budget for KV + activations
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class ParallelConfig:
    engine_type: int
    data_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        role = EngineType.from_int(self.engine_type)
        if min(self.data_parallel_size, self.context_parallel_size, self.expert_parallel_size) < 1:
            raise ValueError("parallel sizes must be >= 1")
        if self.data_parallel_size % self.expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size ({self.expert_parallel_size}) must divide data_parallel_size "
                f"({self.data_parallel_size}): an expert-parallel group is made of DP ranks (DP attention, "
                "EP MoE)"
            )
        if role is EngineType.COMPLETION and self.context_parallel_size > 1:
            raise ValueError(
                "context parallelism is refused for a COMPLETION engine: a decode step has one "
                "query token per sequence, so splitting its context over ranks only adds traffic"
            )


@dataclass(frozen=True)
class MoEConfig:
    """Expert parallelism, EPLB and the role-sized MoE workspace (seed 7.4 and 7.5).

    A batch holds at most ``max_num_decoding_tokens`` (decode: every sequence with its draft
    tokens) or ``max_num_prefilling_tokens`` (prefill: the step's token budget, split over the
    context-parallel ranks) tokens per rank; each batch picks its bound by whether it is a
    prefill (``max_tokens_per_rank``). The all-to-all buffers are sized once for the largest
    batch the role can run (``workspace_tokens``).
    """

    engine_type: int
    max_num_decoding_tokens: int
    max_num_prefilling_tokens: int
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0
    eplb_interval: int = 0  # counted steps between rearrangements; 0: never
    rearrange_after_prefill: bool = True  # NORMAL: a prefill schedules one for the next decode step

    def __post_init__(self) -> None:
        EngineType.from_int(self.engine_type)
        if self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        if self.num_redundant_experts < 0 or self.eplb_interval < 0:
            raise ValueError("num_redundant_experts and eplb_interval must be >= 0")
        if self.max_num_decoding_tokens < 1 or self.max_num_prefilling_tokens < 1:
            raise ValueError("the MoE workspace bounds must be positive")

    @property
    def role(self) -> EngineType:
        return EngineType.from_int(self.engine_type)

    def max_tokens_per_rank(self, is_prompt: bool) -> int:
        """The bound of one batch's tokens on this rank: the prefill or the decode one."""
        return self.max_num_prefilling_tokens if is_prompt else self.max_num_decoding_tokens

    @property
    def workspace_tokens(self) -> int:
        """Tokens per rank the MoE buffers hold: a CE only decodes, a PE only prefills, a
        NORMAL engine does both (its bound is the prefill one unless decoding is larger)."""
        match self.role:
            case EngineType.COMPLETION:
                return self.max_num_decoding_tokens
            case EngineType.PROMPT:
                return self.max_num_prefilling_tokens
        return max(self.max_num_prefilling_tokens, self.max_num_decoding_tokens)


@dataclass(frozen=True)
class RunnerOptions:
    """The worker's settings, read from the environment once (by ``EngineArgs``): the worker and
    the models never read the environment themselves."""

    cache_dir: str  # where native kernels are built (and converted models cached)
    cpu_quant_gemm: bool = True  # PDINFER_CPU_QUANT_GEMM
    cpu_amx: bool = True  # PDINFER_CPU_AMX
    cpu_decode_stack: bool = True  # PDINFER_CPU_DECODE_STACK
    # EngineArgs.batch_invariant: a request's logits do not depend on its batch (docs/usage.md)
    batch_invariant: bool = False
    # EngineArgs.kv_cache_dtype ("auto" or "fp8") and quantization (None or "fp8"), CUDA only
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # Speculative decoding here: a decode step may hold several rows of one sequence (a
    # verifying step), each reading the K/V the rows before it write in the same step.
    verifies_drafts: bool = False


# FP8 (e4m3) on GPUs with FP8 tensor cores (docs/usage.md, "FP8"); "fp8_e4m3" is vLLM's alias.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = (None, "fp8")


def default_kv_cache_memory_bytes() -> int:
    """CPU default: a quarter of physical memory, at most 4 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * GiB
    return int(min(4 * GiB, total // 4))


@dataclass
class EngineArgs:
    """Everything a user can set on an engine. ``create_*`` turn it into the frozen configs."""

    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    load_format: str = "auto"  # "auto" or "dummy"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    seed: int = 0
    engine_type: EngineType | int | str = EngineType.NORMAL
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    chunked_prefill: bool = False
    stop_preempted_request: bool | None = None  # None: True for COMPLETION, False otherwise
    context_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1  # ranks of the DP group that share one model's routed experts
    num_redundant_experts: int = 0  # extra expert replicas EPLB places (per MoE layer, whole group)
    eplb_interval: int | None = None  # steps between rearrangements; None: the role's default
    # Speculative decoding (docs/usage.md): None (off), "ngram" (prompt lookup) or "mtp" (a
    # DeepSeek-V3 checkpoint's multi-token-prediction layer drafts). num_draft_tokens: drafts verified per step (k), which
    # also sizes decode steps (MoE workspace, a CE's KV profiling) as 1 + k tokens a sequence.
    speculative_method: str | None = None
    num_draft_tokens: int = 0
    enforce_eager: bool = False
    num_threads: int | None = None  # torch intra-op threads on CPU
    kv_transfer: dict[str, Any] = field(default_factory=dict)  # P/D connector settings
    kv_store: str | None = None  # KV cache store: a directory (may be shared) or "memory"
    kv_store_bytes: int | None = None  # its bound (default: 16 GiB directory, 1 GiB memory)
    kv_store_memory_bytes: int = 0  # > 0: a memory tier of this size in front of a directory
    kv_store_save_interval_tokens: int = 0  # > 0: also save running sequences every N tokens
    prefill_attempt_interval: int | None = None  # NORMAL's ALL points; None: the environment's
    # A request's logits (so its tokens and log-probs) bit-identical whatever else shares its
    # batch, the batch size and the prefill chunking; CPU float32 only (docs/usage.md).
    batch_invariant: bool = False
    # FP8 (e4m3) on CUDA GPUs of compute capability 8.9+ (docs/usage.md, "FP8"): "fp8" stores K/V
    # as e4m3 with a static per-layer scale of 1.0; quantization="fp8" quantizes the decoder's
    # linear weights at load (per output channel), activations per token on the fly.
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # Resolved in __post_init__ from the role and the environment, the only place pdinfer reads
    # engine settings from it ("rearm"); the engine, worker and models get them from here.
    zero_overhead_scheduling: bool = field(init=False, default=False)
    prefill_any_attempt_interval: int = field(init=False, default=100)
    prefill_kv_watermark: float = field(init=False, default=0.95)
    rearrange_after_prefill: bool = field(init=False, default=True)
    cache_dir: str = field(init=False, default="")
    step_log: str = field(init=False, default="")  # a file every step appends its type to
    kv_secret: str | None = field(init=False, default=None)  # kv_transfer's secret when it names none
    runner_options: RunnerOptions = field(init=False)

    def __post_init__(self) -> None:
        self.engine_type = EngineType.parse(self.engine_type)
        self._check_fp8()
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.stop_preempted_request is None:
            self.stop_preempted_request = self.engine_type is EngineType.COMPLETION
        # The role supplies defaults; an operator's explicit environment value wins.
        env.set_role_default(
            "PDINFER_ZERO_OVERHEAD_SCHEDULING",
            "1" if self.engine_type.default_zero_overhead_scheduling else "0",
        )
        # An engine sees the environment as it is when its arguments are made; an explicit
        # argument wins over it.
        self.zero_overhead_scheduling = bool(env.rearm("PDINFER_ZERO_OVERHEAD_SCHEDULING"))
        if self.prefill_attempt_interval is None:
            self.prefill_attempt_interval = env.rearm("PDINFER_PREFILL_ATTEMPT_INTERVAL")
        self.prefill_any_attempt_interval = env.rearm("PDINFER_PREFILL_ANY_ATTEMPT_INTERVAL")
        self.prefill_kv_watermark = env.rearm("PDINFER_PREFILL_KV_WATERMARK")
        self.enforce_eager = bool(self.enforce_eager or env.rearm("PDINFER_ENFORCE_EAGER"))
        self.rearrange_after_prefill = bool(env.rearm("PDINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE"))
        self.cache_dir = env.rearm("PDINFER_CACHE_DIR")
        self.step_log = env.rearm("PDINFER_STEP_LOG")
        self.runner_options = RunnerOptions(
            self.cache_dir,
            cpu_quant_gemm=bool(env.rearm("PDINFER_CPU_QUANT_GEMM")),
            cpu_amx=bool(env.rearm("PDINFER_CPU_AMX")),
            cpu_decode_stack=bool(env.rearm("PDINFER_CPU_DECODE_STACK")),
            batch_invariant=bool(self.batch_invariant),
            kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization,
            verifies_drafts=self.speculative_method is not None and self.role.drafts_tokens,
        )
        self.kv_secret = env.rearm("PDINFER_KV_SECRET") or None
        env.set_role_default("PDINFER_EPLB_INTERVAL", str(self.engine_type.default_eplb_interval))
        if self.eplb_interval is None:
            self.eplb_interval = env.rearm("PDINFER_EPLB_INTERVAL")
        if self.eplb_interval < 0 or self.num_redundant_experts < 0 or self.expert_parallel_size < 1:
            raise ValueError("eplb_interval and num_redundant_experts must be >= 0, expert_parallel_size >= 1")
        self._check_speculative()
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.kv_store_bytes is not None and self.kv_store_bytes <= 0:
            raise ValueError(f"kv_store_bytes must be positive, got {self.kv_store_bytes}")
        if self.kv_store_memory_bytes < 0 or self.kv_store_save_interval_tokens < 0:
            raise ValueError("kv_store_memory_bytes and kv_store_save_interval_tokens must be >= 0")

    def _check_fp8(self) -> None:
        """The names only; whether the device has FP8 is checked where the device is known
        (``layers/fp8.check_support``, when the model runner is built)."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3":
            self.kv_cache_dtype = "fp8"
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")

    def _check_speculative(self) -> None:
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if self.speculative_method is None:
            return
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative_method {self.speculative_method!r}: use one of {list(SPECULATIVE_METHODS)} "
                "or None (off)"
            )
        if self.num_draft_tokens == 0:
            self.num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS

    @property
    def role(self) -> EngineType:
        assert isinstance(self.engine_type, EngineType)
        return self.engine_type

    def create_scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context ({model_max_len})")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.chunked_prefill else max(max_model_len, 4096)
        return SchedulerConfig(
            engine_type=self.role.value,
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            chunked_prefill=self.chunked_prefill,
            stop_preempted_request=bool(self.stop_preempted_request),
            prefill_attempt_interval=int(self.prefill_attempt_interval or 0),
            prefill_any_attempt_interval=self.prefill_any_attempt_interval,
            prefill_kv_watermark=self.prefill_kv_watermark,
        )

    def create_cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            num_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory or default_kv_cache_memory_bytes(),
            gpu_memory_utilization=self.gpu_memory_utilization,
        )

    def create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            engine_type=self.role.value,
            data_parallel_size=self.data_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
        )

    def create_moe_config(self, scheduler: SchedulerConfig) -> MoEConfig:
        """The seed's workspace bounds (``model_loader.finalize_model_config``), computed here only."""
        return MoEConfig(
            engine_type=self.role.value,
            max_num_decoding_tokens=scheduler.max_num_seqs * (1 + self.num_draft_tokens),
            max_num_prefilling_tokens=scheduler.max_num_batched_tokens // self.context_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
            num_redundant_experts=self.num_redundant_experts,
            eplb_interval=int(self.eplb_interval or 0),
            rearrange_after_prefill=self.rearrange_after_prefill,
        )
