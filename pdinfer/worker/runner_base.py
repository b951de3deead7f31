"""What the CPU and the GPU runner share: the model (loaded, its experts sharded, FP8 applied),
the sampler, the KV cache, and the tokens sampled by the last few steps (``runner.py``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from pdinfer.config import MoEConfig, RunnerOptions
from pdinfer.layers import fp8
from pdinfer.layers.moe import SparseMoE
from pdinfer.models.loader import build_model
from pdinfer.models.spec import ModelSpec
from pdinfer.moe.sharding import needs_sharding, shard_experts
from pdinfer.worker import batch_invariant
from pdinfer.worker.cache_engine import CacheEngine, block_bytes
from pdinfer.worker.sampler import Sampler

if TYPE_CHECKING:
    from pdinfer.distributed.ep_group import TorchExpertGroup

# Sampled tokens kept on the device: zero-overhead scheduling feeds a step's tokens to the next
# step before the host has seen them, so a pending token names a step at most this far back.
RECENT_STEPS = 4


class RunnerBase:
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
        self.sampler = Sampler()
        self.cache: CacheEngine | None = None
        # A hidden-state drafter (MTP) reads every row's last-layer hidden state: the last
        # layer then computes all rows, and ``StepResult.hidden`` carries them (on the device).
        self.keep_hidden = False
        self._recent: OrderedDict[int, torch.Tensor] = OrderedDict()  # sampled tokens by step id
        self._prepare_model(load_format, options)

    def _prepare_model(self, load_format: str, options: RunnerOptions) -> None:
        """The device's kernels and layouts for the loaded model (each runner's own)."""
        raise NotImplementedError

    def init_cache(self, num_blocks: int, block_size: int) -> CacheEngine:
        self.cache = CacheEngine(self.spec, num_blocks, block_size, self.kv_dtype, self.device)
        return self.cache

    def require_cache(self) -> CacheEngine:
        """``cache``, which ``init_cache`` must have made."""
        if self.cache is None:
            raise RuntimeError("init_cache first")
        return self.cache

    def _bytes_per_block(self, block_size: int, extra_layers: int) -> int:
        """One block's K/V over the model's layers and ``extra_layers`` more (a drafter's)."""
        layers = self.spec.num_layers
        return block_bytes(self.spec, block_size, self.kv_dtype) * (layers + extra_layers) // layers

    def _remember(self, step_id: int, token_ids: torch.Tensor) -> None:
        self._recent[step_id] = token_ids
        while len(self._recent) > RECENT_STEPS:
            self._recent.popitem(last=False)

    def _recent_tokens(self, step_id: int) -> torch.Tensor:
        tokens = self._recent.get(step_id)
        if tokens is None:
            raise RuntimeError(f"a pending token refers to step {step_id}, which this runner did not run recently")
        return tokens
