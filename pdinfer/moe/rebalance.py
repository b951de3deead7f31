"""EPLB's placement: which logical expert each physical slot holds, from measured loads.

One MoE layer has E logical experts and P = E + R physical slots, S = P / N on each of the N
ranks of the expert-parallel group. ``rebalance`` (pure Python, deterministic: every rank
computes the same placement from the same all-reduced loads) works in three passes, after
DeepSeek's EPLB (github.com/deepseek-ai/EPLB, its "global" policy):

1. **Replicate.** Every expert gets one slot; each of the R spare slots goes to the expert with
   the highest load per replica (load / replicas), so the hottest experts are split the most.
   An expert gets at most N replicas while that still fills P (more on one rank would not
   spread its load).
2. **Pack.** Replicas, heaviest first (load / replicas each), go to the least loaded rank that
   has a free slot and no replica of the same expert yet (the longest-processing-time rule with
   S items per rank). Unlike DeepSeek's packing this never puts two replicas of one expert on one
   rank when another rank has room for it.
3. **Keep what stays.** The packs are matched to ranks by how many experts they share with the
   current placement, and an expert staying on its rank keeps its slot, so a rearrangement moves
   only the weights it must; a new placement no better than the current one (its most loaded
   rank, then its most loaded slot) is not taken at all.

DeepSeek's hierarchical policy (expert groups packed onto nodes first, to keep traffic inside a
node) is not used: pdinfer's EP groups have no node topology to respect.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence


def rebalance(
    loads: Sequence[float], num_slots: int, num_ranks: int, current: Sequence[int] | None = None
) -> list[int]:
    """The logical expert of each of ``num_slots`` physical slots (rank r owns slots
    [r * S, (r + 1) * S)), given each logical expert's ``loads``; ``current`` (the same shape as
    the result) is kept where the balance allows."""
    num_experts = len(loads)
    if num_slots < num_experts or num_slots % num_ranks:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts over {num_ranks} ranks evenly")
    counts = replicate(loads, num_slots, num_ranks)
    packs = pack(loads, counts, num_ranks)
    slots = place(packs, num_ranks, current)
    if current is not None and imbalance(loads, current, num_ranks) <= imbalance(loads, slots, num_ranks):
        return list(current)  # no better than what is there: move nothing
    return slots


def imbalance(loads: Sequence[float], slots: Sequence[int], num_ranks: int) -> tuple[float, float]:
    """(the most loaded rank's load, the most loaded slot's), each expert's load split evenly
    over its replicas; compared in this order."""
    counts = Counter(slots)
    slot_loads = [float(loads[e]) / counts[e] for e in slots]
    return max(rank_loads(slot_loads, num_ranks)), max(slot_loads)


def replicate(loads: Sequence[float], num_slots: int, num_ranks: int) -> list[int]:
    """Replicas per expert: one each, then every spare slot to the highest load per replica."""
    num_experts = len(loads)
    counts = [1] * num_experts
    spare = num_slots - num_experts
    cap = num_ranks if spare <= num_experts * (num_ranks - 1) else num_slots
    heap = [(-float(load), e) for e, load in enumerate(loads)]  # (-load per replica, expert)
    heapq.heapify(heap)
    while spare:
        _, e = heapq.heappop(heap)
        if counts[e] >= cap:
            continue  # capped: it leaves the heap
        counts[e] += 1
        spare -= 1
        heapq.heappush(heap, (-float(loads[e]) / counts[e], e))
    return counts


def pack(loads: Sequence[float], counts: Sequence[int], num_ranks: int) -> list[list[int]]:
    """The experts of each rank's S slots: heaviest replica first onto the least loaded rank
    with room (and, where possible, without that expert already)."""
    per_rank = sum(counts) // num_ranks
    replicas = sorted(
        ((float(loads[e]) / c, e) for e, c in enumerate(counts) for _ in range(c)),
        key=lambda item: (-item[0], item[1]),
    )
    packs: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for weight, e in replicas:
        open_ranks = [r for r in range(num_ranks) if len(packs[r]) < per_rank]
        fresh = [r for r in open_ranks if e not in packs[r]] or open_ranks
        rank = min(fresh, key=lambda r: (rank_load[r], len(packs[r]), r))
        packs[rank].append(e)
        rank_load[rank] += weight
    return packs


def place(packs: list[list[int]], num_ranks: int, current: Sequence[int] | None) -> list[int]:
    """Slots from packs: each pack to the rank sharing most experts with it, staying experts in
    their slots, the newcomers in the freed slots in expert order."""
    per_rank = len(packs[0])
    if current is None:
        return [e for p in packs for e in sorted(p)]
    old = [list(current[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)]
    overlap = {
        (p, r): sum((Counter(packs[p]) & Counter(old[r])).values()) for p in range(num_ranks) for r in range(num_ranks)
    }
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for (p, r), _ in sorted(overlap.items(), key=lambda item: (-item[1], item[0])):
        if p not in rank_of and r not in taken:
            rank_of[p] = r
            taken.add(r)
    slots: list[int] = []
    pack_of = {r: p for p, r in rank_of.items()}
    for r in range(num_ranks):
        wanted = Counter(packs[pack_of[r]])
        row: list[int | None] = []
        for e in old[r]:
            if wanted[e] > 0:
                wanted[e] -= 1
                row.append(e)
            else:
                row.append(None)
        newcomers = iter(sorted(wanted.elements()))
        slots += [e if e is not None else next(newcomers) for e in row]
    return slots


def rank_loads(slot_loads: Sequence[float], num_ranks: int) -> list[float]:
    """Per-rank sums of per-slot loads (slots in rank order)."""
    per_rank = len(slot_loads) // num_ranks
    return [sum(slot_loads[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)]
