"""An observer of engine steps that appends a line per step to a file: its type, its sequences,
its tokens and the wall-clock time (seconds since the epoch) it was launched.

Attached by ``LLMEngine`` when ``EngineArgs.step_log`` is set (``PDINFER_STEP_LOG``): the DP
tests compare the files of a group's ranks line by line to check they took the same step types.
Observers see every scheduled plan just before it is launched; they must not change it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdinfer.core.outputs import SchedulerOutputs


class StepLog:
    def __init__(self, path: str):
        self.path = path

    def __call__(self, plan: SchedulerOutputs) -> None:
        with open(self.path, "a") as f:
            f.write(f"{plan.step_type} {len(plan.scheduled_seqs)} {plan.num_batched_tokens} {time.time():.6f}\n")
