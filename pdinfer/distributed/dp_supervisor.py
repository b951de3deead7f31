"""The DP front's I/O thread: owns the sockets, the rank processes and the group's generations.

Only this thread touches the front's sockets (``front_socket``) and the launcher (rank processes
die with the thread that spawned them, so it must be this long-lived one). Callers hand it
commands through the front's queue and wake it through an inproc socket. Failures found while
handling messages are recorded and acted on at the end of each round, never re-entrantly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from pdinfer.distributed.dp_group import default_backend, host_store
from pdinfer.distributed.dp_requests import RequestBook
from pdinfer.distributed.failure_cause import FailureCause
from pdinfer.distributed.front_socket import FrontSocket
from pdinfer.distributed.launcher import RankLauncher, visible_devices
from pdinfer.distributed.messages import (
    AddAnswer,
    AgentHello,
    Drain,
    Drained,
    Ping,
    RankConfig,
    RankExited,
    RankFailed,
    RankReady,
    RankStats,
    StartGeneration,
    StepReport,
    StopRanks,
    StopSeq,
    engine_args_to_dict,
)
from pdinfer.engine.client import EngineDeadError

if TYPE_CHECKING:
    from pdinfer.distributed.dp_front import DPFront

logger = logging.getLogger("pdinfer")

POLL_MS = 50
PING_INTERVAL_S = 1.0
CAUSE_GRACE_S = 1.0  # a peer's collective can fail before the dead rank's exit is visible


@dataclass
class _Rank:
    last_seen_s: float
    ready: bool = False
    stats: RankStats = field(default_factory=RankStats)
    kv_address: str | None = None  # a CE rank's K/V port


@dataclass
class _DrainWait:
    """A drain the front asked for, until every rank of the generation answered."""

    on_done: Callable[[int], None]  # called with the requests the ranks sent away
    ranks: set[int]  # the ranks yet to answer
    num_migrated: int = 0


class GroupSupervisor:
    def __init__(self, front: DPFront):
        self.front, self.options = front, front.options
        self.size = front.size
        self.generation = -1
        self.ranks: list[_Rank] = []
        self.is_ready = False
        self.book = RequestBook(front, self.size, self.options.max_attempts, self._send)
        self.pending: list[str] = []  # request ids waiting for the group, in arrival order
        self.agents: set[bytes] = set()
        self.drains: list[_DrainWait] = []
        self.failure = FailureCause(CAUSE_GRACE_S)
        self._ever_ready = False
        self._restarts: list[float] = []
        self._stopping = False
        self._last_ping_s = 0.0
        self._started_s = 0.0
        opts = self.options
        self._store = host_store(opts.master_addr, opts.master_port)
        self.socket = FrontSocket(opts.master_addr, opts.master_port, opts.front_port)
        num_local = opts.num_local_ranks or self.size
        device = front.engine_args.device
        backend = opts.backend
        if backend == "auto":  # resolved once here, so every host's ranks agree
            backend = default_backend(device, exclusive_gpus=visible_devices(num_local) is not None)
        self.template = RankConfig(
            rank=0,
            size=self.size,
            generation=0,
            master_addr=opts.master_addr,
            master_port=self._store.port,
            front_address=self.socket.address,
            engine_args=engine_args_to_dict(front.engine_args),
            parent_pid=0,
            backend=backend,
            timeout_s=opts.timeout_s,
            startup_timeout_s=opts.startup_timeout_s,
            front_timeout_s=opts.heartbeat_s,
            max_idle_sleep_ms=opts.max_idle_sleep_ms,
        )
        self.launcher = RankLauncher(range(num_local), self.template, device)

    # --- called from other threads ---------------------------------------------------------------
    def wake(self) -> None:
        self.socket.wake()

    def rank_stats(self) -> list[RankStats]:
        return [r.stats for r in list(self.ranks)]

    def rank_pids(self) -> list[int]:
        return self.launcher.pids()

    # --- the thread ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._start_generation()
            while not self._stopping:
                self._round()
            self._stop_ranks()
        except BaseException as exc:  # noqa: BLE001 - the front must not hang its callers
            logger.exception("the DP front's I/O thread failed")
            self._go_dead(f"the DP front's I/O thread failed: {exc!r}")
        finally:
            self.launcher.kill()
            self._settle_drains(every=True)
            self.book.fail_all(self.front.error or EngineDeadError("the DP front was shut down"))
            self.front.ready_event.set()
            self.socket.close()

    def _round(self) -> None:
        readable = self.socket.poll(POLL_MS)
        with self.front.lock:
            if readable:
                self._read_ranks()
            self._apply_commands()
            self._watch(time.monotonic())

    def _read_ranks(self) -> None:
        for identity, message in self.socket.receive():
            if isinstance(message, AgentHello):
                self._on_agent(identity, message)
                continue
            if message.generation != self.generation or not 0 <= message.rank < self.size:
                continue  # from a generation that was already replaced
            self.ranks[message.rank].last_seen_s = time.monotonic()
            if isinstance(message, AddAnswer):
                self.book.on_answer(message)
            elif isinstance(message, StepReport):
                self.ranks[message.rank].stats = message.stats
                for delta in message.outputs:
                    self.book.on_output(message.rank, delta)
            elif isinstance(message, Drained):
                self._on_drained(message)
            elif isinstance(message, RankReady):
                self._on_ready(message)
            elif isinstance(message, RankFailed):
                self.failure.rank_failed(message.rank, message.error, message.peer, time.monotonic())
            elif isinstance(message, RankExited):
                self.failure.rank_exited(message.rank, message.returncode, time.monotonic())

    def _apply_commands(self) -> None:
        commands = list(self.front.commands)
        self.front.commands.clear()
        for command in commands:
            if command[0] == "add":
                self.pending.append(command[1])
            elif command[0] == "abort":
                self.book.abort(command[1])
            elif command[0] == "stop_seq":
                tracked = self.front.requests.get(command[1])
                if tracked is not None and tracked.rank is not None:
                    self._send(tracked.rank, StopSeq(command[1], command[2]))
            elif command[0] == "drain":
                self._drain(command[1])
            else:
                self._stopping = True
        if self.is_ready and self.pending:
            pending, self.pending = self.pending, []
            for request_id in pending:
                tracked = self.front.requests.get(request_id)
                if tracked is not None and tracked.rank is None:
                    self.book.dispatch(tracked)

    def _watch(self, now: float) -> None:
        for rank, generation, returncode in self.launcher.poll_exited():
            if generation == self.generation:
                self.failure.rank_exited(rank, returncode, now)
        if self.is_ready:
            for i, state in enumerate(self.ranks):
                if now - state.last_seen_s > self.options.heartbeat_s:
                    self.failure.record(
                        f"DP rank {i} sent nothing for {self.options.heartbeat_s:g} s", now, suspect=True
                    )
        elif now - self._started_s > self.options.startup_timeout_s:
            self.failure.record(f"the DP group did not start within {self.options.startup_timeout_s:g} s", now)
        if now - self._last_ping_s >= PING_INTERVAL_S:  # ranks and agents stop if we go silent
            self._last_ping_s = now
            for i in range(self.size) if self.is_ready else ():
                self._send(i, Ping(self.generation))
            for agent in list(self.agents):
                self._send_to(agent, Ping(self.generation))
        reason = None if self._stopping else self.failure.take(now)
        if reason is not None:
            self._restart(reason)

    # --- the group -----------------------------------------------------------------------------
    def _send(self, rank: int, message) -> None:
        self._send_to(f"rank{rank}.gen{self.generation}".encode(), message, rank)

    def _send_to(self, identity: bytes, message, rank: int | None = None) -> None:
        try:
            self.socket.send(identity, message)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that peer is gone
            if rank is not None:
                self.failure.record(f"DP rank {rank} is unreachable ({exc})", time.monotonic(), suspect=True)
            else:
                self.agents.discard(identity)

    def _start_generation(self) -> None:
        self.generation += 1
        now = time.monotonic()
        self.ranks = [_Rank(last_seen_s=now) for _ in range(self.size)]
        self.failure.new_generation()
        self.is_ready = False
        self._started_s = now
        self.launcher.start(self.generation)
        for agent in self.agents:
            self._send_to(agent, StartGeneration(self.generation, self.template))

    def _on_ready(self, message: RankReady) -> None:
        self.ranks[message.rank].ready = True
        self.ranks[message.rank].kv_address = message.kv_address
        if message.kv_address is not None:
            logger.info("DP rank %d: K/V hand-offs arrive at %s", message.rank, message.kv_address)
        self.book.lb.set_capacity(message.rank, message.num_total_blocks * message.block_size)
        if all(r.ready for r in self.ranks):
            logger.info(
                "DP group of %d ranks ready (generation %d) after %.1f s",
                self.size,
                self.generation,
                time.monotonic() - self._started_s,
            )
            self.is_ready = self._ever_ready = True
            self.front.ready_event.set()
            if self.front.draining:  # a generation that replaced a drained one is drained too
                self._drain()

    def _on_agent(self, identity: bytes, hello: AgentHello) -> None:
        logger.info(
            "DP agent for ranks %d..%d connected", hello.rank_offset, hello.rank_offset + hello.num_local_ranks - 1
        )
        self.agents.add(identity)
        if self.generation >= 0:
            self._send_to(identity, StartGeneration(self.generation, self.template))

    def _restart(self, reason: str) -> None:
        """Tear the failed generation down, settle its requests, start the next one."""
        logger.error("DP group generation %d failed: %s", self.generation, reason)
        self.launcher.kill()
        self.is_ready = False
        self.front.ready_event.clear()
        self.book.lb.reset()
        now = time.monotonic()
        self._settle_drains(every=True)  # the failed ranks answer no more; their requests ended
        retry = self.book.settle(reason)
        self.pending = retry + self.pending
        self._restarts = [t for t in self._restarts if now - t < self.options.restart_window_s]
        if not self._ever_ready:
            return self._go_dead(f"the DP group failed to start: {reason}")
        if len(self._restarts) >= self.options.max_restarts:
            return self._go_dead(
                f"the DP group failed {len(self._restarts) + 1} times within "
                f"{self.options.restart_window_s:g} s; last: {reason}"
            )
        self._restarts.append(now)
        logger.warning("restarting the DP group (%d requests queued again)", len(retry))
        self._start_generation()

    def _drain(self, on_done: Callable[[int], None] | None = None) -> None:
        """Drain every rank of the generation; a group not up yet is drained when it is
        (``_on_ready``). ``on_done``: the front's caller, told once every rank answered."""
        ranks = set(range(self.size)) if self.is_ready else set()
        for rank in ranks:
            self._send(rank, Drain())
        if on_done is not None:
            self.drains.append(_DrainWait(on_done, ranks))
            self._settle_drains()

    def _on_drained(self, message: Drained) -> None:
        for wait in self.drains:
            if message.rank in wait.ranks:
                wait.ranks.discard(message.rank)
                wait.num_migrated += message.num_migrated
        self._settle_drains()

    def _settle_drains(self, every: bool = False) -> None:
        done = [wait for wait in self.drains if every or not wait.ranks]
        self.drains = [wait for wait in self.drains if wait not in done]
        for wait in done:
            try:
                wait.on_done(wait.num_migrated)
            except RuntimeError:  # the caller's event loop is closed
                pass

    def _go_dead(self, reason: str) -> None:
        from pdinfer.distributed.dp_group import DPGroupError

        logger.error("the DP front gives up: %s", reason)
        self.front.error = DPGroupError(reason)
        self.is_ready = False
        self._stopping = True
        self.launcher.kill()
        self.front.ready_event.set()

    def _stop_ranks(self) -> None:
        """Ask every rank to stop (they stop together at their next collective), then reap."""
        for i in range(self.size):
            if self.ranks and self.ranks[i].ready:
                self._send(i, StopRanks())
        for agent in self.agents:
            self._send_to(agent, StopRanks())
        if not self.launcher.wait(10.0):
            logger.warning("DP ranks did not stop within 10 s: killing them")
