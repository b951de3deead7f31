"""Helpers of the DP tests (tests/test_dp*.py): a tiny model, a client of the DP front, process checks."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import time

from pdinfer import SamplingParams
from pdinfer.distributed.dp_front import DPFront
from pdinfer.distributed.tracked import QueueSink
from pdinfer.outputs import RequestOutput

WAIT_S = 600  # liveness bound of every wait: a hang fails the test instead of blocking it
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


def ids(n: int, start: int) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


def long_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def alive(pid: int) -> bool:
    """Running, or stopped; a zombie (dead, not yet reaped by its parent) does not count."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int]) -> list[int]:
    """The pids still alive after a while (a process needs a moment to die)."""
    deadline = time.monotonic() + 30
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


class Client:
    """Submits to a front and collects outputs (latest and final) from one queue."""

    def __init__(self, front: DPFront):
        self.front, self.items = front, queue.Queue()
        self.latest: dict[str, RequestOutput] = {}
        self.final: dict[str, RequestOutput] = {}

    def submit(self, request_id, prompt, params, rank=None, final_only=False) -> None:
        self.front.submit(request_id, prompt, params, QueueSink(self.items), final_only=final_only, dp_rank=rank)

    def pump(self, timeout_s: float = 0.0) -> None:
        try:
            item = self.items.get(timeout=timeout_s) if timeout_s else self.items.get_nowait()
            while True:
                if isinstance(item, BaseException):
                    raise item
                self.latest[item.request_id] = item
                if item.finished:
                    self.final[item.request_id] = item
                item = self.items.get_nowait()
        except queue.Empty:
            pass

    def tokens(self, request_id: str) -> int:
        out = self.latest.get(request_id)
        return len(out.outputs[0].token_ids) if out and out.outputs else 0

    def wait(self, done, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.pump(0.05)


def quiesce(front: DPFront) -> None:
    """Wait until no request is left and both ranks report the same, settled step count."""
    deadline, last = time.monotonic() + WAIT_S, None
    while True:
        stats = front.rank_stats()
        steps = [s.num_steps for s in stats]
        settled = (
            front.is_healthy and not front.requests and len(set(steps)) == 1 and all(s.num_requests == 0 for s in stats)
        )
        if settled and steps == last:
            return
        last = steps if settled else None
        assert time.monotonic() < deadline, "the DP group did not go idle"
        time.sleep(1.2)  # a little over two heartbeats


def step_logs(front: DPFront) -> list[list[tuple[str, int]]]:
    logs = []
    for rank in range(2):
        path = f"{front.step_log}.rank{rank}"
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        logs.append([(line.split()[0], int(line.split()[1])) for line in lines])  # type, sequences
    return logs


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def two_free_ports() -> int:
    """A port P with P + 1 free too (the store and the front's socket)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
                    return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")
