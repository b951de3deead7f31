"""Expert parallelism as a transform of a built model (gpt-fast's way with tensor parallelism:
the model code has none of it).

``shard_experts`` runs on the model while it is still on the meta device, before any storage
exists: each sparse layer's stacked experts shrink to the S = (E + R) / N slots this rank holds,
so a rank never allocates the others' experts, and the checkpoint loader fills each slot with the
logical expert ``Experts.slot_experts`` names. Attention, dense layers and shared experts are
untouched: every rank holds them whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pdinfer.config import MoEConfig
from pdinfer.layers.moe import SparseMoE
from pdinfer.moe.dispatch import ExpertDispatcher
from pdinfer.moe.placement import ExpertPlacement

if TYPE_CHECKING:
    from pdinfer.distributed.ep_group import TorchExpertGroup


def sparse_layers(model: nn.Module) -> list[SparseMoE]:
    """The model's sparse MoE layers, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def expert_group_of(dp_group, config: MoEConfig, device: torch.device) -> TorchExpertGroup | None:
    """The ranks of the engine's DP group that share its experts (None without EP)."""
    size = config.expert_parallel_size
    if size == 1:
        return None
    if device.type != "cpu":
        raise NotImplementedError("expert parallelism runs on CPU ranks only for now (gloo all-to-all)")
    make = getattr(dp_group, "expert_group", None)
    if make is None:
        raise ValueError(
            f"expert_parallel_size={size} needs a DP group to spread the experts over: "
            f"run with data_parallel_size a multiple of {size}"
        )
    return make(size)


def needs_sharding(config: MoEConfig) -> bool:
    return config.expert_parallel_size > 1 or config.num_redundant_experts > 0


def shard_experts(
    model: nn.Module,
    config: MoEConfig,
    group: TorchExpertGroup | None,
    dtype: torch.dtype,
    device: torch.device,
) -> list[SparseMoE]:
    """Give every sparse layer its initial placement, its slots' (meta) parameters, a load
    counter and, across ranks, the shared dispatcher. Returns the sparse layers."""
    layers = sparse_layers(model)
    num_ranks = config.expert_parallel_size
    rank = group.rank if group is not None else 0
    if (group.size if group is not None else 1) != num_ranks:
        raise ValueError(f"expert_parallel_size {num_ranks} needs an expert group of that size")
    if not layers:
        raise ValueError("expert parallelism and redundant experts need a mixture-of-experts model")
    moe = layers[0].gate.moe
    num_slots = moe.num_experts + config.num_redundant_experts
    if num_slots % num_ranks:
        raise ValueError(
            f"{moe.num_experts} experts + {config.num_redundant_experts} redundant do not split evenly over "
            f"expert_parallel_size {num_ranks}: choose num_redundant_experts so that the sum is a multiple"
        )
    dispatcher = None
    if num_ranks > 1:
        assert group is not None
        hidden = layers[0].gate.weight.shape[1]
        dispatcher = ExpertDispatcher(group, config, moe.top_k, hidden, dtype, device)
    for layer in layers:
        placement = ExpertPlacement.initial(moe.num_experts, config.num_redundant_experts, num_ranks, rank, device)
        experts = layer.experts
        local = placement.slots_per_rank
        experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.new_empty((local, *experts.gate_up_proj.shape[1:])))
        experts.down_proj = nn.Parameter(experts.down_proj.new_empty((local, *experts.down_proj.shape[1:])))
        experts.slot_experts = placement.local_experts()
        layer.placement, layer.dispatcher = placement, dispatcher
        layer.expert_load = torch.zeros(moe.num_experts, dtype=torch.int64, device=device)
    return layers
