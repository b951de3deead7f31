"""``TorchDPGroup``: the DP group of real processes, over ``torch.distributed``.

The NORMAL scheduler only needs rank, size and ``all_reduce_min`` of a few ints (the interface
is ``pdinfer.core.dp.DPGroup``). Backend: gloo on CPU, NCCL when every rank has a GPU of its own (the front resolves "auto";
ranks sharing a GPU vote over gloo). With NCCL the all-reduce runs on a side stream: the
vote's host sync then waits for the vote alone, not for the forward still in flight on the
default stream (zero-overhead scheduling keeps one there).

Rendezvous. The DP front hosts a ``TCPStore`` at (master_addr, master_port): on one host it
picks a free port itself; across hosts the operator passes ``--dp-master-addr/--dp-master-port``
to every host (see ``pdinfer.distributed.dp_front``). Each generation of the group (the front
restarts the whole group after a failure) uses its own key prefix in that store, so a restart
never needs a new port and never meets stale keys.

Timeouts. Ranks load their models at different speeds, so they first wait for each other on the
store with the generous ``startup_timeout_s``; only then is the process group formed, with
``timeout_s``. From then on a collective whose peer died fails at once (gloo sees the closed
connection) and one whose peer is stuck fails after ``timeout_s`` -- a rank never hangs forever.
With NCCL the watchdog enforces the same timeout by aborting the process.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pdinfer.distributed.ep_group import TorchExpertGroup
from pdinfer.distributed.group_error import DPGroupError


def host_store(host: str, port: int = 0, timeout_s: float = 30.0) -> dist.TCPStore:
    """A rendezvous store served on ``host`` only (port 0: a free one, read it back from
    ``.port``): the DP front's, and the CE's for NCCL K/V pairs.

    TCPStore's own server listens on every interface whatever host it is given, and it has no
    authentication; so we bind the listening socket to ``host`` ourselves and hand it over
    (``master_listen_fd``; the store owns it from then on)."""
    timeout = timedelta(seconds=timeout_s)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        return dist.TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=sock.detach(),
        )
    except BaseException:
        sock.close()
        raise


def default_backend(device: str = "auto", exclusive_gpus: bool = True) -> str:
    """nccl when the ranks run on GPUs, one each; gloo otherwise."""
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if on_gpu and exclusive_gpus and dist.is_nccl_available() else "gloo"


class TorchDPGroup:
    """One rank's membership of the DP group. Build it, hand it to ``LLMEngine``, load, then
    ``join()``; ``all_reduce_min`` before ``join`` is an error."""

    def __init__(
        self,
        rank: int,
        size: int,
        master_addr: str,
        master_port: int,
        *,
        generation: int = 0,
        backend: str = "auto",
        timeout_s: float = 60.0,
    ):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"DP rank {rank} is outside a group of {size}")
        if timeout_s <= 0:
            raise ValueError(f"the DP group timeout must be positive, got {timeout_s}")
        self.rank, self.size = rank, size
        self.master_addr, self.master_port = master_addr, master_port
        self.generation = generation
        self.backend = default_backend() if backend == "auto" else backend
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"DP backend must be auto, gloo or nccl, got {backend!r}")
        self.timeout_s = timeout_s
        self.device = torch.device("cpu")
        self._stream: torch.cuda.Stream | None = None
        self.num_calls = 0
        self.total_ns = 0  # time inside all_reduce_min, waiting for the slowest rank included
        self._joined = False
        self._expert_groups: list[tuple[int, TorchExpertGroup]] = []  # (index, group), connected by join

    def expert_group(self, size: int) -> TorchExpertGroup:
        """This rank's expert-parallel group: ranks [i * size, (i + 1) * size) of the DP group
        share one model's experts. Ask before ``join``, which connects it."""
        if self._joined:
            raise RuntimeError("ask for the expert group before TorchDPGroup.join()")
        if size < 1 or self.size % size:
            raise ValueError(f"an expert group of {size} ranks does not divide a DP group of {self.size}")
        group = TorchExpertGroup(self.rank % size, size, self.backend, self.timeout_s)
        self._expert_groups.append((self.rank // size, group))
        return group

    def join(self, startup_timeout_s: float = 600.0, device: torch.device | str | None = None) -> None:
        """Wait for every rank's model, then form the group. ``device``: the engine's GPU, where
        an NCCL vote runs (default: the current CUDA device, right when CUDA_VISIBLE_DEVICES
        gives each rank one GPU; a rank given ``cuda:N`` among several must pass it)."""
        startup = timedelta(seconds=startup_timeout_s)
        client = dist.TCPStore(self.master_addr, self.master_port, is_master=False, timeout=startup)
        store = dist.PrefixStore(f"pdinfer-dp/{self.generation}/", client)
        store.set(f"loaded/{self.rank}", "1")
        store.wait([f"loaded/{r}" for r in range(self.size)], startup)
        if self.backend == "nccl":
            device = torch.device(device if device is not None else "cuda")
            if device.type != "cuda":
                raise ValueError(f"the NCCL DP backend needs a CUDA device, got {device}")
            self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
            self._stream = torch.cuda.Stream(self.device)
        dist.init_process_group(
            self.backend, store=store, rank=self.rank, world_size=self.size, timeout=timedelta(seconds=self.timeout_s)
        )
        for index, group in self._expert_groups:
            group.connect(dist.PrefixStore(f"ep{group.size}/{index}/", store), self.device)
        self._joined = True

    def all_reduce_min(self, values: list[int]) -> list[int]:
        if not self._joined:
            raise RuntimeError("TorchDPGroup.join() first")
        start = time.perf_counter_ns()
        try:
            if self._stream is None:
                tensor = torch.tensor(values, dtype=torch.int64)
                dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
                result = tensor.tolist()
            else:
                with torch.cuda.stream(self._stream):
                    tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
                    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
                    result = tensor.tolist()  # syncs the side stream only
        except RuntimeError as exc:
            raise DPGroupError(
                f"DP rank {self.rank}/{self.size}: all-reduce failed (a peer died or did not "
                f"answer within {self.timeout_s:g} s): {str(exc).splitlines()[0]}"
            ) from exc
        self.total_ns += time.perf_counter_ns() - start
        self.num_calls += 1
        return result

    def close(self) -> None:
        if self._joined and dist.is_initialized():
            dist.destroy_process_group()
        self._joined = False
