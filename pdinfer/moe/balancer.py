"""EPLB in the engine: count expert loads, decide when to rearrange (by role, seed 7.4), and
rearrange: place the experts anew (``rebalance``) and move their weights between ranks.

Timing (``RearrangementTimer.update``, the seed's ``_update_rearrangement``): every step that
ran a forward is offered, with whether it was a prefill. Interval 0 never rearranges. A NORMAL
engine does not count prefill steps; by default (PDINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE)
a prefill step sets the counter so that the next non-prefill step rearranges: the experts a
prefill made hot are rebalanced at once, and never inside a (long) prefill step. PROMPT and
COMPLETION engines count every step. Every rank of an expert group sees the same steps of the
same types (the DP vote; lockstep), so they all rearrange at the same step.

A rearrangement runs in step order (``StepExecutor.submit_call``), after the forward of the step
that triggered it and before the next one; it is a collective of the expert group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdinfer.config import MoEConfig
from pdinfer.layers.moe import SparseMoE
from pdinfer.moe.placement import ExpertPlacement
from pdinfer.moe.rebalance import rebalance

if TYPE_CHECKING:
    from pdinfer.distributed.ep_group import TorchExpertGroup
    from pdinfer.worker.executor import StepExecutor

logger = logging.getLogger("pdinfer")


class RearrangementTimer:
    def __init__(self, interval: int, is_normal_engine: bool, rearrange_after_prefill: bool = True):
        if interval < 0:
            raise ValueError(f"the EPLB interval must be >= 0, got {interval}")
        self.interval = interval
        self.schedule_after_prefill = is_normal_engine and rearrange_after_prefill
        self.skip_on_prefill = is_normal_engine and not self.schedule_after_prefill
        self.counter = 0

    def update(self, is_prompt: bool) -> bool:
        """Offer one step; True when the experts are to be rearranged after it."""
        if self.interval == 0:
            return False
        if is_prompt and self.skip_on_prefill:
            return False
        if is_prompt and self.schedule_after_prefill:
            self.counter = self.interval - 1  # the next non-prefill step rearranges
            return False
        self.counter += 1
        if self.counter < self.interval:
            return False
        self.counter = 0
        return True


@dataclass
class RearrangementStats:
    num_rearrangements: int = 0
    num_slots_copied: int = 0  # a slot took an expert this rank already held
    num_slots_received: int = 0  # a slot took an expert from another rank


class ExpertLoadBalancer:
    def __init__(
        self,
        layers: list[SparseMoE],
        config: MoEConfig,
        group: TorchExpertGroup | None,
        executor: StepExecutor | None = None,
    ):
        self.layers, self.config, self.group, self.executor = layers, config, group, executor
        self.timer = RearrangementTimer(
            config.eplb_interval, not config.role.eplb_counts_prefill_steps, config.rearrange_after_prefill
        )
        self.num_steps = 0  # steps offered (steps that ran a forward)
        self.rearranged_at: list[int] = []  # the steps after which a rearrangement ran
        self.stats = RearrangementStats()

    def on_step(self, is_prompt: bool) -> None:
        """A step was launched; rearrange after it if the timer says so."""
        self.num_steps += 1
        if self.timer.update(is_prompt):
            self.rearranged_at.append(self.num_steps)
            if self.executor is not None:
                self.executor.submit_call(self.rearrange)
            else:
                self.rearrange()

    def loads(self) -> torch.Tensor:
        """[sparse layers, E]: tokens routed to each logical expert since the last rearrangement,
        this rank's only."""
        return torch.stack([layer.expert_load for layer in self.layers if layer.expert_load is not None])

    def rearrange(self, loads: torch.Tensor | None = None) -> None:
        """Place every layer's experts for ``loads`` (default: the counted loads, summed over
        the group) and move the weights; the counters start again."""
        if loads is None:
            loads = self.loads().clone()
            if self.group is not None:
                self.group.all_reduce_sum(loads)
        num_ranks = self.config.expert_parallel_size
        for layer, layer_loads in zip(self.layers, loads.tolist()):
            old = layer.placement
            assert old is not None and layer.expert_load is not None
            slots = rebalance(layer_loads, old.num_slots, num_ranks, old.slot_experts)
            if slots != old.slot_experts:
                self._move_weights(layer, old, slots)
            layer.expert_load.zero_()
        self.stats.num_rearrangements += 1

    @torch.inference_mode()
    def _move_weights(self, layer: SparseMoE, old: ExpertPlacement, slots: list[int]) -> None:
        new = ExpertPlacement(slots, old.num_experts, old.num_ranks, old.rank, old.replica_count.device)
        experts = layer.experts
        rank = old.rank
        gate_up, down = experts.gate_up_proj, experts.down_proj
        rows = torch.cat([gate_up.flatten(1), down.flatten(1)], dim=1)  # one row per local slot
        plan = _transfer_plan(old, new)
        send_slots = [s for dest in range(old.num_ranks) for s in plan.sends[rank][dest]]
        recv_from = [plan.receives[rank][src] for src in range(old.num_ranks)]
        received = rows.new_empty((sum(len(r) for r in recv_from), rows.shape[1]))
        if self.group is not None and old.num_ranks > 1:
            sent = rows.index_select(0, torch.tensor(send_slots, dtype=torch.int64, device=rows.device))
            self.group.all_to_all(
                received,
                sent,
                [len(r) for r in recv_from],
                [len(plan.sends[rank][dest]) for dest in range(old.num_ranks)],
            )
        new_rows = torch.empty_like(rows)
        offset = 0
        for src in range(old.num_ranks):
            for new_slot in recv_from[src]:
                new_rows[new_slot] = received[offset]
                offset += 1
        for new_slot, old_slot in plan.copies[rank]:
            new_rows[new_slot] = rows[old_slot]
        self.stats.num_slots_copied += len(plan.copies[rank])
        self.stats.num_slots_received += offset
        split = gate_up[0].numel()
        gate_up.copy_(new_rows[:, :split].view_as(gate_up))
        down.copy_(new_rows[:, split:].view_as(down))
        experts.slot_experts = new.local_experts()
        layer.placement = new


@dataclass
class _TransferPlan:
    copies: list[list[tuple[int, int]]]  # per rank: (new local slot, old local slot)
    sends: list[list[list[int]]]  # [src][dest]: old local slots src sends, in dest's slot order
    receives: list[list[list[int]]]  # [dest][src]: new local slots filled from src, in order


def _transfer_plan(old: ExpertPlacement, new: ExpertPlacement) -> _TransferPlan:
    """Where each new slot's weights come from: a slot of the same rank holding that expert if
    there is one, else the lowest rank holding it (every rank computes the same plan)."""
    n = old.num_ranks
    copies: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    sends: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(n)]
    receives: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(n)]
    holders = [old.local_experts(r) for r in range(n)]
    for dest in range(n):
        for new_slot, e in enumerate(new.local_experts(dest)):
            if e in holders[dest]:
                copies[dest].append((new_slot, holders[dest].index(e)))
                continue
            src = next(r for r in range(n) if e in holders[r])
            sends[src][dest].append(holders[src].index(e))
            receives[dest][src].append(new_slot)
    return _TransferPlan(copies, sends, receives)
