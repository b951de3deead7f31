"""The DP front's I/O thread: owns the sockets, the rank processes and the group's generations.

Only this thread touches the front's sockets (``front_socket``) and the launcher (rank processes
die with the thread that spawned them, so it must be this long-lived one). Callers hand it
commands through the front's queue and wake it through an inproc socket. Failures found while
handling messages are recorded and acted on at the end of each round, never re-entrantly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from pdinfer.distributed.dp_group import default_backend, host_store
from pdinfer.distributed.failure_cause import FailureCause
from pdinfer.distributed.front_socket import FrontSocket
from pdinfer.distributed.launcher import RankLauncher, visible_devices
from pdinfer.distributed.messages import (
    AbortRequest,
    AddAnswer,
    AddRequest,
    AgentHello,
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
from pdinfer.distributed.replica_lb import ReplicaLoadBalancer
from pdinfer.distributed.tracked import TrackedRequest
from pdinfer.engine.client import EngineDeadError
from pdinfer.engine.core import refusal_error
from pdinfer.outputs import RequestDelta, SeqDelta

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


class GroupSupervisor:
    def __init__(self, front: DPFront):
        self.front, self.options = front, front.options
        self.size = front.size
        self.generation = -1
        self.ranks: list[_Rank] = []
        self.is_ready = False
        self.lb = ReplicaLoadBalancer(self.size)
        self.num_finished = [0] * self.size  # requests each rank ended (all generations)
        self.pending: list[str] = []  # request ids waiting for the group, in arrival order
        self.agents: set[bytes] = set()
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
            self._fail_all(self.front.error or EngineDeadError("the DP front was shut down"))
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
                self._on_answer(message)
            elif isinstance(message, StepReport):
                self.ranks[message.rank].stats = message.stats
                for delta in message.outputs:
                    self._on_output(message.rank, delta)
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
                self._abort(command[1])
            elif command[0] == "stop_seq":
                tracked = self.front.requests.get(command[1])
                if tracked is not None and tracked.rank is not None:
                    self._send(tracked.rank, StopSeq(command[1], command[2]))
            else:
                self._stopping = True
        if self.is_ready and self.pending:
            pending, self.pending = self.pending, []
            for request_id in pending:
                tracked = self.front.requests.get(request_id)
                if tracked is not None and tracked.rank is None:
                    self._dispatch(tracked)

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

    # --- requests ------------------------------------------------------------------------------
    def _dispatch(self, tracked: TrackedRequest) -> None:
        num_tokens = len(tracked.prompt_token_ids)
        rank = tracked.dp_rank
        if rank is None:
            rank = self.lb.choose(num_tokens, exclude=tracked.refused_ranks)
        self.lb.assign(tracked.request_id, rank, num_tokens)
        tracked.rank = rank
        tracked.num_attempts += 1
        add = AddRequest(tracked.request_id, tracked.prompt, tracked.prompt_token_ids, tracked.params)
        add.reservation = tracked.reservation
        self._send(rank, add)

    def _on_answer(self, message: AddAnswer) -> None:
        """The rank's answer to an add. A reservation (a CE's) names this rank's K/V port, so
        a request that handed one out is never retried on another generation. A rank without
        room passes the request to the next least-loaded rank; when none has room, or for any
        other refusal, the caller gets the refusal."""
        tracked = self.front.requests.get(message.request_id)
        if tracked is None or tracked.rank != message.rank:
            return
        if message.refused is None:
            if message.answer is not None:
                tracked.num_delivered += 1
            self._answer(tracked, message.answer)
            return
        self.lb.release(tracked.request_id)
        if message.refused == "no_room" and tracked.dp_rank is None:
            tracked.refused_ranks.add(message.rank)
            if len(tracked.refused_ranks) < self.size:
                return self._dispatch(tracked)
        del self.front.requests[tracked.request_id]
        error = message.error or message.refused
        if tracked.on_answer is not None:
            return self._answer(tracked, refusal_error(message.refused, error))
        self._deliver_final(tracked, RequestDelta(tracked.request_id, [], True, error), message.rank)

    def _answer(self, tracked: TrackedRequest, value) -> None:
        answer, tracked.on_answer = tracked.on_answer, None
        if answer is not None:
            try:
                answer(value)
            except RuntimeError:  # the caller's event loop is closed
                pass

    def _on_output(self, rank: int, delta: RequestDelta) -> None:
        tracked = self.front.requests.get(delta.request_id)
        if tracked is None or tracked.rank != rank:
            return
        tracked.num_output_tokens += sum(len(s.token_ids) for s in delta.seqs)
        if tracked.num_output_tokens and tracked.first_token_s is None:
            tracked.first_token_s = time.monotonic()
        if delta.finished:
            self.lb.release(delta.request_id)
            del self.front.requests[delta.request_id]
            self.num_finished[rank] += 1
        elif tracked.num_output_tokens:
            self.lb.progress(delta.request_id, tracked.num_output_tokens)
        self._deliver_final(tracked, delta, rank)

    def _deliver_final(self, tracked: TrackedRequest, delta: RequestDelta, rank: int) -> None:
        """Hand a delta to the consumer: as it is to a stream, else detokenized here."""
        if tracked.tracker is None:  # a stream: its consumer detokenizes
            self._deliver(tracked, delta)
            return
        for index in tracked.tracker.apply(delta):  # detokenized here
            self._send(rank, StopSeq(delta.request_id, index))
        if delta.finished or not tracked.final_only:
            output = tracked.tracker.output()
            output.extra["dp_rank"] = rank  # which rank ran it (tests, logs)
            self._deliver(tracked, output)

    def _abort(self, request_id: str) -> None:
        tracked = self.front.requests.get(request_id)
        if tracked is None:
            return
        if tracked.rank is not None:
            self._send(tracked.rank, AbortRequest(request_id))  # its final output comes back
            return
        del self.front.requests[request_id]
        self._end(tracked, "aborted")

    def _end(self, tracked: TrackedRequest, error: str, finish_reason: str = "abort") -> None:
        """The final delta of a request that ends at the front: every output still open ends."""
        self._answer(tracked, EngineDeadError(error))  # a caller still waiting for the add
        n = int(tracked.params.get("n", 1))
        delta = RequestDelta(tracked.request_id, [SeqDelta(i, [], finish_reason=finish_reason) for i in range(n)])
        delta.finished, delta.error = True, error
        if tracked.tracker is None:
            self._deliver(tracked, delta)
        else:
            tracked.tracker.apply(delta)
            self._deliver(tracked, tracked.tracker.output())

    def _deliver(self, tracked: TrackedRequest, item) -> None:
        try:
            tracked.sink(item)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens any more
            if tracked.request_id in self.front.requests:
                self._abort(tracked.request_id)
            return
        tracked.num_delivered += 1

    def _settle_requests(self, reason: str, now: float) -> int:
        """After a failed generation: queue again (oldest first) the requests that ran on it and
        streamed nothing, end the others with an error. Returns how many were queued again."""
        retry = []
        for tracked in list(self.front.requests.values()):
            if tracked.rank is None:
                continue
            if tracked.num_delivered == 0 and tracked.num_attempts < self.options.max_attempts:
                tracked.restart()
                retry.append(tracked)
                continue
            why = (
                "it had streamed output already, so it was not retried"
                if tracked.num_delivered
                else f"it failed on {tracked.num_attempts} attempts"
            )
            del self.front.requests[tracked.request_id]
            error = f"the DP group failed while this request ran on rank {tracked.rank} ({reason}); {why}"
            self._end(tracked, error, "error")
        retry.sort(key=lambda t: t.arrival_s)
        self.pending = [t.request_id for t in retry] + self.pending
        return len(retry)

    def _fail_all(self, error: BaseException) -> None:
        with self.front.lock:
            requests = list(self.front.requests.values())
            self.front.requests.clear()
        for tracked in requests:
            self._answer(tracked, EngineDeadError(str(error)))
            try:
                tracked.sink(EngineDeadError(str(error)))
            except RuntimeError:
                pass

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
        self.lb.set_capacity(message.rank, message.num_total_blocks * message.block_size)
        if all(r.ready for r in self.ranks):
            logger.info(
                "DP group of %d ranks ready (generation %d) after %.1f s",
                self.size,
                self.generation,
                time.monotonic() - self._started_s,
            )
            self.is_ready = self._ever_ready = True
            self.front.ready_event.set()

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
        self.lb.reset()
        now = time.monotonic()
        num_retried = self._settle_requests(reason, now)
        self._restarts = [t for t in self._restarts if now - t < self.options.restart_window_s]
        if not self._ever_ready:
            return self._go_dead(f"the DP group failed to start: {reason}")
        if len(self._restarts) >= self.options.max_restarts:
            return self._go_dead(
                f"the DP group failed {len(self._restarts) + 1} times within "
                f"{self.options.restart_window_s:g} s; last: {reason}"
            )
        self._restarts.append(now)
        logger.warning("restarting the DP group (%d requests queued again)", num_retried)
        self._start_generation()

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
