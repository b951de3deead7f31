"""``TorchExpertGroup``: the ranks of a DP group that share one model's routed experts.

DP attention, EP MoE (DeepInfer's layout): every rank runs attention on its own sequences, and
each MoE layer sends every (token, expert) pair to the rank holding that expert and takes the
result back, with two all-to-alls. The group is a process group of its own (gloo on CPU, NCCL
on GPUs), not the DP group's default one: the step-type vote and the MoE all-to-alls may be
issued from different threads (on a GPU the forward runs on the step thread), and each process
group keeps its own order of collectives. Both are formed at the same rendezvous
(``TorchDPGroup.join`` connects the expert groups it handed out).

Every rank of the group must run the same sequence of MoE layers, step for step: a rank with no
tokens still takes part with zero rows (see ``LLMEngine._launch``); the DP vote keeps the step
types equal.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class TorchExpertGroup:
    def __init__(self, rank: int, size: int, backend: str = "gloo", timeout_s: float = 60.0):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"expert-parallel rank {rank} is outside a group of {size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"the expert-parallel backend must be gloo or nccl, got {backend!r}")
        self.rank, self.size = rank, size
        self.backend, self.timeout_s = backend, timeout_s
        # a gloo or NCCL backend object; the stubs declare its collectives on ProcessGroup only
        self._pg: Any = None

    @property
    def is_connected(self) -> bool:
        return self._pg is not None

    def connect(self, store: dist.Store, device: torch.device | None = None) -> None:
        """Form the group on ``store`` (a prefix of its own per group); every member calls it."""
        timeout = timedelta(seconds=self.timeout_s)
        if self.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            if device is not None:
                torch.cuda.set_device(device)
            self._pg = dist.ProcessGroupNCCL(store, self.rank, self.size, options)

    def _require(self) -> Any:
        if self._pg is None:
            raise RuntimeError("the expert-parallel group is not connected yet (TorchDPGroup.join connects it)")
        return self._pg

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        """Rows ``input_splits[r]`` of ``input`` go to rank r; ``output`` receives
        ``output_splits[r]`` rows from rank r, in rank order."""
        pg = self._require()
        try:
            pg.alltoall_base(output, input, output_splits, input_splits, dist.AllToAllOptions()).wait()
        except RuntimeError as exc:
            raise _group_error(self, "all-to-all", exc) from exc

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        pg = self._require()
        try:
            pg.allreduce([tensor]).wait()
        except RuntimeError as exc:
            raise _group_error(self, "all-reduce", exc) from exc


def _group_error(group: TorchExpertGroup, what: str, exc: RuntimeError) -> RuntimeError:
    # A DPGroupError: the rank reports a peer failure and the DP front restarts the group.
    from pdinfer.distributed.group_error import DPGroupError

    return DPGroupError(
        f"expert-parallel rank {group.rank}/{group.size}: {what} failed (a peer died or did not answer "
        f"within {group.timeout_s:g} s): {str(exc).splitlines()[0]}"
    )
