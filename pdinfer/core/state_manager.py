"""Per-sequence state slots, for models whose sequences carry state beside their paged K/V
(recurrent layers, a sliding-window copy). Pure Python, like the block manager.

Llama-family models have none, so engines running them build no StateManager; the scheduler
then leaves ``state_id`` at -1 and ``clone_states`` empty.
"""

from __future__ import annotations


class StateManager:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot < 0:
            return
        if slot in self._free or slot >= self.num_slots:
            raise RuntimeError(f"state slot {slot} freed twice or out of range")
        self._free.append(slot)
