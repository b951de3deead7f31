"""Start and stop this host's rank processes, one generation of the DP group at a time.

Used by the front (the ranks on its host) and by the agent of every other host. Rank processes
die with their launcher (PR_SET_PDEATHSIG, which fires when the *thread* that spawned them ends:
always spawn from one long-lived thread) and are reaped here, so none is left behind.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import msgspec

from pdinfer import env as pdinfer_env
from pdinfer.distributed.messages import RankConfig

logger = logging.getLogger("pdinfer")


@dataclass
class RankProcess:
    rank: int
    generation: int
    process: subprocess.Popen
    reported: bool = False  # its exit was already returned by poll_exited


class RankLauncher:
    def __init__(self, ranks: range, template: RankConfig, device: str = "auto"):
        self.ranks = ranks
        self.template = template  # rank and generation are filled in per process
        self.device = device
        self.processes: list[RankProcess] = []

    def start(self, generation: int) -> None:
        """Kill what is left of older generations, then start this one's ranks."""
        self.kill()
        devices = visible_devices(len(self.ranks)) if self.device in ("auto", "cuda") else None
        for local, rank in enumerate(self.ranks):
            cfg = msgspec.structs.replace(self.template, rank=rank, generation=generation, parent_pid=os.getpid())
            env = pdinfer_env.child_environ()
            step_log = env.get("PDINFER_STEP_LOG")
            if step_log:
                env["PDINFER_STEP_LOG"] = f"{step_log}.rank{rank}"
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices[local]
            cmd = [sys.executable, "-m", "pdinfer.distributed.dp_rank", msgspec.json.encode(cfg).decode()]
            self.processes.append(RankProcess(rank, generation, subprocess.Popen(cmd, env=env)))
        logger.info(
            "DP generation %d: started ranks %s (pids %s)",
            generation,
            list(self.ranks),
            [p.process.pid for p in self.processes],
        )

    def poll_exited(self) -> list[tuple[int, int, int]]:
        """(rank, generation, return code) of processes that exited since the last call."""
        exited = []
        for p in self.processes:
            if not p.reported and p.process.poll() is not None:
                p.reported = True
                exited.append((p.rank, p.generation, p.process.returncode))
        return exited

    def pids(self) -> list[int]:
        return [p.process.pid for p in self.processes if p.process.poll() is None]

    def wait(self, timeout_s: float) -> bool:
        """Wait for every process to exit on its own; True if all did."""
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            try:
                p.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self) -> None:
        """SIGKILL every process still alive and reap them all."""
        for p in self.processes:
            if p.process.poll() is None:
                p.process.kill()
        for p in self.processes:
            try:
                p.process.wait(10)
            except subprocess.TimeoutExpired:  # unkillable (D state): nothing more to do
                logger.error("DP rank %d (pid %d) did not die", p.rank, p.process.pid)
        self.processes = []


def visible_devices(num_local: int) -> list[str] | None:
    """One GPU per rank: the i-th local rank sees the i-th visible device."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ids[:num_local] if len(ids) >= num_local else None
