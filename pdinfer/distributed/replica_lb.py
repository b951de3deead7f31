"""Replica load balancing inside a DP group: which rank gets a new request.

A NORMAL DP group steps in lockstep (every rank takes the same step type at the same beat), so
a step lasts as long as the busiest rank's share of it: an uneven group is as slow as its most
loaded rank. The balancer therefore evens out both kinds of per-step work, with DeepSeek's two
load balancers as the two terms. Lower score wins:

    score(r) = waiting_prefill_tokens(r)                  # prefill LB: queued prompt tokens
             + kv_token_weight * running_kv_tokens(r)     # decode LB: KV tokens being decoded
             + request_weight_tokens * num_running(r)     # decode LB: decode batch size

- ``waiting_prefill_tokens``: prompt tokens of requests sent to r that have not produced their
  first token yet. The new request's first token waits for them, and they size r's next
  prefill steps. (DeepSeek counts uncached tokens; the front cannot see r's prefix cache before
  the prefill, so a prefix hit lowers the count only once r reports the request running.)
- ``running_kv_tokens``: prompt + output tokens of requests decoding on r: what attention reads
  every decode step, and the KV memory r has given out.
- ``num_running``: requests decoding on r: the rows of every decode step.

Defaults: ``kv_token_weight=0.25``, ``request_weight_tokens=16``. A rank whose KV cache could
not hold the new request next to what it already has is passed over while another has room.
Ties go round robin, starting after the last rank picked, so an idle group spreads a burst
evenly. The accounting is the front's own, updated when it sends a request, on every output and
when a request ends, so a burst of arrivals is spread at once instead of waiting for reports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplicaLoad:
    waiting_prefill_tokens: int = 0
    running_kv_tokens: int = 0
    num_running: int = 0
    kv_capacity_tokens: int = 0  # 0: unknown (no limit applied)

    @property
    def committed_tokens(self) -> int:
        return self.waiting_prefill_tokens + self.running_kv_tokens


@dataclass
class _Placement:
    rank: int
    prompt_tokens: int
    kv_tokens: int = 0  # 0 until the first output: the request is still waiting for prefill


class ReplicaLoadBalancer:
    def __init__(self, num_ranks: int, kv_token_weight: float = 0.25, request_weight_tokens: float = 16.0):
        if num_ranks < 1:
            raise ValueError(f"a DP group has at least one rank, got {num_ranks}")
        self.kv_token_weight = kv_token_weight
        self.request_weight_tokens = request_weight_tokens
        self.loads = [ReplicaLoad() for _ in range(num_ranks)]
        self._placements: dict[str, _Placement] = {}
        self._last = -1

    def set_capacity(self, rank: int, kv_capacity_tokens: int) -> None:
        self.loads[rank].kv_capacity_tokens = kv_capacity_tokens

    def score(self, rank: int) -> float:
        load = self.loads[rank]
        return (
            load.waiting_prefill_tokens
            + self.kv_token_weight * load.running_kv_tokens
            + self.request_weight_tokens * load.num_running
        )

    def choose(self, num_prompt_tokens: int, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """The rank for a new request; ``exclude``: ranks that refused it (a CE rank with no
        room), passed over unless every rank is in it."""
        n = len(self.loads)
        order = [(self._last + 1 + i) % n for i in range(n)]  # round robin among equals
        order = [r for r in order if r not in exclude] or order
        roomy = [r for r in order if self._fits(r, num_prompt_tokens)]
        rank = min(roomy or order, key=self.score)  # min keeps the first of equal scores
        self._last = rank
        return rank

    def _fits(self, rank: int, num_tokens: int) -> bool:
        load = self.loads[rank]
        return not load.kv_capacity_tokens or (load.committed_tokens + num_tokens <= load.kv_capacity_tokens)

    def assign(self, request_id: str, rank: int, num_prompt_tokens: int) -> None:
        self.release(request_id)
        self._placements[request_id] = _Placement(rank, num_prompt_tokens)
        self.loads[rank].waiting_prefill_tokens += num_prompt_tokens

    def progress(self, request_id: str, num_output_tokens: int) -> None:
        """The request produced output: it is decoding, holding prompt + output KV tokens."""
        p = self._placements.get(request_id)
        if p is None:
            return
        load = self.loads[p.rank]
        if p.kv_tokens == 0:  # first output: from waiting to running
            load.waiting_prefill_tokens -= p.prompt_tokens
            load.num_running += 1
        kv_tokens = p.prompt_tokens + num_output_tokens
        load.running_kv_tokens += kv_tokens - p.kv_tokens
        p.kv_tokens = kv_tokens

    def release(self, request_id: str) -> None:
        p = self._placements.pop(request_id, None)
        if p is None:
            return
        load = self.loads[p.rank]
        if p.kv_tokens == 0:
            load.waiting_prefill_tokens -= p.prompt_tokens
        else:
            load.running_kv_tokens -= p.kv_tokens
            load.num_running -= 1

    def reset(self) -> None:
        """Forget every placement (the group restarted); capacities stay."""
        for request_id in list(self._placements):
            self.release(request_id)
