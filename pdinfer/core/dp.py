"""The data-parallel group interface the NORMAL scheduler votes through.

All ranks of a NORMAL engine's DP group take the same step type (all prefill or all decode),
because MoE expert-parallel all-to-all needs every rank at the same beat. The scheduler only
needs rank, size and a MIN all-reduce of a few small ints; a single process is the identity.
"""

from __future__ import annotations

from typing import Protocol


class DPGroup(Protocol):
    rank: int
    size: int

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Element-wise MIN over all ranks; every rank must call it at the same point."""
        ...


class SingleProcessDPGroup:
    rank = 0
    size = 1

    def all_reduce_min(self, values: list[int]) -> list[int]:
        return list(values)
