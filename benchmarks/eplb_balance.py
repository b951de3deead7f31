"""EPLB's balance on a skewed routing: max/mean load per expert and per rank, before and after.

Each token picks ``top_k`` distinct experts with Zipf-distributed probabilities (expert of rank
i, in a random order per layer, weighs 1 / i^s). The loads of one window of tokens are
measured; ``rebalance`` places ``E + R`` slots over ``N`` ranks for them; a second window drawn
from the same distribution is then routed through the new placement (``ExpertPlacement.to_slots``,
the engine's own round robin over replicas, tokens spread evenly over the ranks they come from).

Before: no replicas, expert e on rank e // (E / N) (the layout a model loads with).
After: the placement EPLB computed from the first window, judged on the second.

    python benchmarks/eplb_balance.py [--tokens 16384] [--layers 4] [--seed 0]

Prints a table (CPU only; a few seconds).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from pdinfer.moe.placement import ExpertPlacement
from pdinfer.moe.rebalance import rank_loads, rebalance

# (shape name, experts, top-k), EP sizes, redundant experts, Zipf exponents
SHAPES = [("deepseek-v3", 256, 8), ("qwen3-30b-a3b", 128, 8)]
EP_SIZES = (8, 32)
REDUNDANT = {256: (0, 32), 128: (0, 16, 32)}
ZIPF = (0.8, 1.2)


def sample_routing(gen: torch.Generator, num_experts: int, top_k: int, tokens: int, s: float, perm) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    choice = torch.multinomial(weights.expand(tokens, -1), top_k, replacement=False, generator=gen)
    return perm[choice]  # [tokens, top_k] logical expert ids


def ratio(values) -> float:
    values = [float(v) for v in values]
    return max(values) / (sum(values) / len(values))


def route(placement_slots: list[int], num_experts: int, num_ranks: int, ids: torch.Tensor) -> list[float]:
    """Rows each slot receives when ``ids`` come evenly from the ranks (each its own offset)."""
    loads = torch.zeros(len(placement_slots), dtype=torch.int64)
    for rank, part in enumerate(ids.chunk(num_ranks)):
        placement = ExpertPlacement(placement_slots, num_experts, num_ranks, rank, torch.device("cpu"))
        loads += torch.bincount(placement.to_slots(part).reshape(-1), minlength=len(placement_slots))
    return loads.tolist()


def measure(num_experts, top_k, num_ranks, redundant, s, tokens, layers, gen):
    rows = {"expert": [], "rank_before": [], "slot": [], "rank_after": [], "ms": []}
    for _ in range(layers):
        perm = torch.randperm(num_experts, generator=gen)
        first = sample_routing(gen, num_experts, top_k, tokens, s, perm)
        second = sample_routing(gen, num_experts, top_k, tokens, s, perm)
        window = torch.bincount(first.reshape(-1), minlength=num_experts).tolist()
        start = time.perf_counter()
        initial = [p % num_experts for p in range(num_experts + redundant)]  # what a model loads with
        slots = rebalance(window, num_experts + redundant, num_ranks, initial)
        rows["ms"].append((time.perf_counter() - start) * 1e3)
        before = torch.bincount(second.reshape(-1), minlength=num_experts).tolist()
        after = route(slots, num_experts, num_ranks, second)
        assert Counter(slots).keys() == set(range(num_experts))
        rows["expert"].append(ratio(before))
        rows["rank_before"].append(ratio(rank_loads(before, num_ranks)))
        rows["slot"].append(ratio(after))
        rows["rank_after"].append(ratio(rank_loads(after, num_ranks)))
    return {k: sum(v) / len(v) for k, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per window")
    parser.add_argument("--layers", type=int, default=4, help="layers (routings) averaged per row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    header = (
        f"{'shape':<14} {'E':>4} {'k':>2} {'EP':>3} {'R':>3} {'zipf':>4} | {'expert max/mean':>15} "
        f"{'rank max/mean':>13} | {'slot max/mean':>13} {'rank max/mean':>13} | {'rebalance ms':>12}"
    )
    print(f"{args.tokens} tokens per window, mean of {args.layers} layers; before: no replicas, e on rank e//(E/N)")
    print(f"{'':<34} | {'before EPLB':^29} | {'after EPLB (next window)':^27} |")
    print(header)
    print("-" * len(header))
    for name, num_experts, top_k in SHAPES:
        for num_ranks in EP_SIZES:
            for redundant in REDUNDANT[num_experts]:
                if (num_experts + redundant) % num_ranks:
                    continue
                for s in ZIPF:
                    r = measure(num_experts, top_k, num_ranks, redundant, s, args.tokens, args.layers, gen)
                    print(
                        f"{name:<14} {num_experts:>4} {top_k:>2} {num_ranks:>3} {redundant:>3} {s:>4} | "
                        f"{r['expert']:>15.2f} {r['rank_before']:>13.2f} | {r['slot']:>13.2f} "
                        f"{r['rank_after']:>13.2f} | {r['ms']:>12.1f}"
                    )


if __name__ == "__main__":
    main()
