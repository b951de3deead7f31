"""Where one MoE layer's experts live: the logical expert of every physical slot, and how a
token's choice of a logical expert becomes a physical slot.

Slots are numbered across the expert-parallel group: rank r owns slots [r * S, (r + 1) * S).
A logical expert with several replicas spreads its tokens over them round robin: the j-th
(token, expert) pair routed to it in a step, in token order, goes to replica (j + rank) mod
replicas. That is deterministic (no random draw: a batch always runs the same way) and gives
every replica the same share up to one token; the rank offset keeps small decode batches of
different ranks from all picking the first replica.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ExpertPlacement:
    def __init__(self, slot_experts: Sequence[int], num_experts: int, num_ranks: int, rank: int, device: torch.device):
        slots = [int(e) for e in slot_experts]
        if len(slots) % num_ranks or not 0 <= rank < num_ranks:
            raise ValueError(f"{len(slots)} slots do not split over {num_ranks} ranks (rank {rank})")
        missing = set(range(num_experts)) - set(slots)
        if missing or min(slots) < 0 or max(slots) >= num_experts:
            raise ValueError(f"a placement must hold each of {num_experts} experts; missing {sorted(missing)[:4]}")
        self.slot_experts = slots
        self.num_experts, self.num_ranks, self.rank = num_experts, num_ranks, rank
        self.slots_per_rank = len(slots) // num_ranks
        replicas: list[list[int]] = [[] for _ in range(num_experts)]
        for slot, e in enumerate(slots):
            replicas[e].append(slot)
        width = max(len(r) for r in replicas)
        self.replica_count = torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=device)
        self.replica_slots = torch.tensor(
            [r + [r[0]] * (width - len(r)) for r in replicas], dtype=torch.int64, device=device
        )  # [E, most replicas], padded with the first
        self.has_replicas = width > 1

    @classmethod
    def initial(cls, num_experts: int, num_redundant: int, num_ranks: int, rank: int, device: torch.device):
        """Before any load is known: expert e in slot e, the spare slots replicating experts
        0, 1, ... in order (slot p holds p mod E)."""
        return cls([p % num_experts for p in range(num_experts + num_redundant)], num_experts, num_ranks, rank, device)

    @property
    def num_slots(self) -> int:
        return len(self.slot_experts)

    def local_experts(self, rank: int | None = None) -> list[int]:
        """The logical expert of each of ``rank``'s slots (default: this rank's)."""
        r = self.rank if rank is None else rank
        return self.slot_experts[r * self.slots_per_rank : (r + 1) * self.slots_per_rank]

    def to_slots(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, k] -> physical slots [T, k] (global numbering)."""
        if not self.has_replicas:
            return self.replica_slots[expert_ids, 0]
        flat = expert_ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))  # not bincount: no host sync on CUDA
        first = counts.cumsum(0) - counts  # where each expert's pairs start in `order`
        nth_sorted = torch.arange(flat.numel(), device=flat.device) - first.index_select(0, flat.index_select(0, order))
        nth = torch.empty_like(flat).index_copy_(0, order, nth_sorted)  # j: this pair is expert's j-th
        replica = (nth + self.rank) % self.replica_count.index_select(0, flat)
        return self.replica_slots[flat, replica].view_as(expert_ids)
