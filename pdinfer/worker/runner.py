"""The step runner: what the engine and the step executor use of the device side, and the one
factory that picks its implementation by device.

- ``cpu_runner.CpuRunner``: native CPU kernels and oneDNN-packed linears, synchronous results.
- ``gpu_runner.GpuRunner``: Triton kernels, CUDA graphs, results copied to pinned memory
  behind an event (``async_results``). It also runs on CPU tensors under Triton's interpreter,
  which is how the tests drive it without a GPU.

Both load the model and hold the KV cache through ``runner_base.RunnerBase``; neither imports
the other. A runner knows no roles: the engine hands it the shape of its largest step
(``profile_num_blocks``) and says whether to capture CUDA graphs. The step contract (``StepInput``,
``StepResult``, the pending-token marker) is ``step_input.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from pdinfer.config import MoEConfig, RunnerOptions
from pdinfer.models.spec import ModelSpec
from pdinfer.worker.cpu_runner import CpuRunner
from pdinfer.worker.step_input import StepInput, StepResult

if TYPE_CHECKING:
    from pdinfer.distributed.ep_group import TorchExpertGroup
    from pdinfer.layers.moe import SparseMoE
    from pdinfer.models.loader import CausalLM
    from pdinfer.moe.dispatch import ExpertDispatcher
    from pdinfer.worker.cache_engine import CacheEngine
    from pdinfer.worker.sampler import Sampler


class PendingResult(Protocol):
    """A launched step's result on its way to the host; ``wait()`` is the sampling sync."""

    def wait(self) -> StepResult: ...


@runtime_checkable
class StepRunner(Protocol):
    spec: ModelSpec
    folder: str
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's element type: the model's, or e4m3 (FP8)
    device: torch.device
    model: CausalLM
    sampler: Sampler
    moe_layers: list[SparseMoE]  # sharded sparse layers (expert parallelism, EPLB)
    dispatcher: ExpertDispatcher | None  # the all-to-all of expert parallelism
    cache: CacheEngine | None  # ``init_cache`` makes it
    keep_hidden: bool  # a hidden-state drafter (MTP) reads every row's last hidden state
    # True: ``execute`` returns a ``PendingResult`` while the device works (CUDA); False: it
    # returns the ``StepResult`` once computed, on the calling thread (CPU).
    async_results: bool

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
        tokens with ``rows`` logit rows, a decode step or not (the engine's role decides).
        ``memory_bytes`` is the CPU's budget; a GPU fills ``gpu_memory_utilization`` of the
        device and keeps room for CUDA graphs if ``graphs``. ``extra_layers``: cache layers
        outside the model's (the MTP drafter's), per block."""
        ...

    def init_cache(self, num_blocks: int, block_size: int) -> CacheEngine: ...

    def require_cache(self) -> CacheEngine:
        """``cache``, which ``init_cache`` must have made."""
        ...

    def capture_cuda_graphs(self, max_rows: int, max_model_len: int) -> None:
        """Capture decode CUDA graphs for steps of up to ``max_rows`` one-query rows, over the KV
        cache (a no-op on the CPU)."""
        ...

    def execute(self, inp: StepInput) -> StepResult | PendingResult: ...


def make_runner(
    spec: ModelSpec,
    folder: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    options: RunnerOptions,
    seed: int = 0,
    moe_config: MoEConfig | None = None,
    expert_group: TorchExpertGroup | None = None,
) -> StepRunner:
    """The runner for ``device``: ``GpuRunner`` on CUDA, ``CpuRunner`` otherwise."""
    args = (spec, folder, load_format, dtype, device, options, seed, moe_config, expert_group)
    if device.type == "cuda":
        from pdinfer.worker.gpu_runner import GpuRunner  # Triton and CUDA graphs only where used

        return GpuRunner(*args)
    return CpuRunner(*args)
