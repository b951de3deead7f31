"""One rank of a DP group: ``python -m pdinfer.distributed.dp_rank '<RankConfig JSON>'``.

Each rank runs its own engine of the group's role (``LLMEngine`` with its role: a NORMAL
engine, a PE or a CE) and step loop; the front (``dp_front``) starts the ranks, sends them requests and reads
back their answers and outputs over ZeroMQ. A CE rank listens on a K/V port of its own: the
reservations it makes name that port, so a PE pushes to the rank that reserved.

Lockstep (a NORMAL group, whose scheduler votes, and any group with expert parallelism, whose
every step meets the other ranks in each MoE layer's all-to-all). Every loop iteration starts
with one MIN all-reduce of [group idle?, no step anywhere?, keep going?]:
- if any rank has a step to run, every rank calls ``engine.step_deltas()`` (a NORMAL
  scheduler votes on the step type with its own collectives; a rank with nothing runs an empty
  step, whose forward still takes part in every all-to-all);
- if no rank has a step but some wait for another engine (a CE's reservation waiting for its
  K/V, a PE's hand-off waiting for its ack), those ranks take what arrived (``poll_peers``)
  and every rank waits a moment: no empty forwards while the group only waits;
- if no rank has work, every rank sleeps -- a back-off that doubles up to ``max_idle_sleep_ms``
  and wakes early when the front sends something -- so an idle group burns no CPU;
- if any rank was asked to stop (the front said so, or went silent), all stop at the same
  iteration, so nobody is left waiting in a collective.
A collective that fails (a peer died, or exceeded the group timeout) ends this process with an
error report to the front, which restarts the group. Without lockstep (PE or CE replicas with
no expert parallelism) each rank runs the same loop on its own values.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import msgspec
import zmq

from pdinfer import env as pdinfer_env
from pdinfer.distributed.messages import (
    AbortRequest,
    AddAnswer,
    AddRequest,
    Drain,
    Drained,
    Ping,
    RankConfig,
    RankFailed,
    RankReady,
    RankStats,
    StepReport,
    StopRanks,
    StopSeq,
    ToFront,
    decode_to_rank,
    encode,
    engine_args_from_dict,
)
from pdinfer.outputs import RequestDelta

logger = logging.getLogger("pdinfer")

HEARTBEAT_INTERVAL_S = 0.5
PEER_WAIT_MS = 2.0  # the longest nap while a rank waits for another engine (K/V, an ack)


class FrontChannel:
    """This rank's DEALER socket to the front's ROUTER."""

    def __init__(self, address: str, identity: bytes):
        self._socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, identity)
        self._socket.setsockopt(zmq.LINGER, 2000)  # let a last failure report out
        self._socket.connect(address)

    def send(self, message: ToFront) -> None:
        self._socket.send(encode(message))

    def receive(self, timeout_ms: float) -> list:
        messages = []
        if self._socket.poll(max(0, int(timeout_ms))):
            while True:
                try:
                    messages.append(decode_to_rank(self._socket.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return messages

    def close(self) -> None:
        self._socket.close()


def needs_lockstep(engine) -> bool:
    """Whether the ranks must take every loop iteration together: a NORMAL scheduler's vote is
    a collective, and so is each MoE layer of an expert-parallel step."""
    return engine.engine_type.votes_on_step_type or engine.moe_config.expert_parallel_size > 1


class RankLoop:
    def __init__(self, cfg: RankConfig, engine, group, channel: FrontChannel):
        self.cfg, self.engine, self.group, self.channel = cfg, engine, group, channel
        self.lockstep = group.size > 1 and needs_lockstep(engine)
        self.stopping = False
        self.last_front_message_s = time.monotonic()
        self.last_report_s = 0.0
        self.num_steps = 0

    def run(self) -> None:
        sleep_ms, idle_rounds = 0.0, 0
        while True:
            for message in self.channel.receive(sleep_ms):
                self._apply(message)
            if time.monotonic() - self.last_front_message_s > self.cfg.front_timeout_s and not self.stopping:
                logger.error("the DP front has been silent for %.0f s: stopping", self.cfg.front_timeout_s)
                self.stopping = True
            busy = self.engine.has_unfinished_requests()
            steps = self.engine.has_step_work()
            group_idle, no_steps, keep_going = self._agree([not busy, not steps, not self.stopping])
            if not keep_going:
                return
            if no_steps:  # nobody has a step to run; some ranks may wait for another engine
                outputs = self.engine.poll_peers() if busy else []
                idle_rounds += 1
                cap_ms = self.cfg.max_idle_sleep_ms if group_idle else PEER_WAIT_MS
                sleep_ms = min(cap_ms, 0.25 * 2 ** min(idle_rounds, 16))
                self._report(outputs)
                continue
            sleep_ms, idle_rounds = 0.0, 0
            outputs = self.engine.step_deltas()
            self.num_steps += 1
            self._report(outputs)

    def _agree(self, flags: list[bool]) -> list[int]:
        values = [int(flag) for flag in flags]
        return self.group.all_reduce_min(values) if self.lockstep else values

    def _apply(self, message) -> None:
        self.last_front_message_s = time.monotonic()
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequest):
            self.engine.abort_request(message.request_id)
        elif isinstance(message, StopSeq):
            self.engine.stop_seq(message.request_id, message.index)
        elif isinstance(message, Drain):
            self.channel.send(Drained(self.cfg.rank, self.cfg.generation, self.engine.drain()))
        elif isinstance(message, StopRanks):
            self.stopping = True
        elif not isinstance(message, Ping):
            raise RuntimeError(f"unexpected message from the DP front: {message!r}")

    def _add(self, message: AddRequest) -> None:
        from pdinfer.engine.core import refusal_kind
        from pdinfer.engine.pd_common import Reservation
        from pdinfer.sampling_params import SamplingParams

        cfg, request_id = self.cfg, message.request_id
        prompt = {"prompt": message.prompt, "prompt_token_ids": message.prompt_token_ids}
        try:
            reservation = None if message.reservation is None else msgspec.convert(message.reservation, Reservation)
            params = SamplingParams(**message.params)
            answer = self.engine.admit(request_id, prompt, params, reservation=reservation, resume=message.resume)
        except Exception as exc:  # the front validated; a refusal is reported, and we keep serving
            kind = refusal_kind(exc)
            if kind is None:
                raise
            self.channel.send(AddAnswer(cfg.rank, cfg.generation, request_id, refused=kind, error=str(exc)))
            return
        answer = None if answer is None else msgspec.to_builtins(answer)
        self.channel.send(AddAnswer(cfg.rank, cfg.generation, request_id, answer=answer))

    def _report(self, outputs: list[RequestDelta]) -> None:
        now = time.monotonic()
        if not outputs and now - self.last_report_s < HEARTBEAT_INTERVAL_S:
            return
        self.last_report_s = now
        self.channel.send(StepReport(self.cfg.rank, self.cfg.generation, outputs, self.stats()))

    def stats(self) -> RankStats:
        sched, blocks = self.engine.scheduler, self.engine.block_manager
        eplb = self.engine.eplb.stats if self.engine.eplb is not None else None
        handoffs = self.engine.role.handoff_stats or {}  # a PE's
        return RankStats(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_prompted=len(sched.prompted),
            num_requests=len(self.engine.requests),
            waiting_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting),
            running_kv_tokens=sum(s.num_computed_tokens for s in sched.running),
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=blocks.num_total_blocks,
            num_prefix_hit_tokens=blocks.num_prefix_hits,
            num_prefix_query_tokens=blocks.num_prefix_queries,
            num_preemptions=sched.num_preemptions,
            num_steps=self.num_steps,
            num_allreduce=self.group.num_calls,
            allreduce_ns=self.group.total_ns,
            num_expert_rearrangements=eplb.num_rearrangements if eplb else 0,
            num_expert_slots_received=eplb.num_slots_received if eplb else 0,
            num_aborted=self.engine.num_aborted,
            num_migrated=self.engine.num_migrated,
            num_handoffs=handoffs.get("count", 0),
            handoff_bytes=handoffs.get("bytes", 0),
            handoff_seconds=handoffs.get("seconds", 0.0),
            num_handoffs_failed=handoffs.get("failed", 0),
            draining=self.engine.draining,
        )


def run_rank(cfg: RankConfig) -> int:
    from pdinfer.distributed.dp_group import TorchDPGroup
    from pdinfer.engine.heap import freeze_startup_heap
    from pdinfer.engine.llm_engine import LLMEngine

    identity = f"rank{cfg.rank}.gen{cfg.generation}".encode()
    channel = FrontChannel(cfg.front_address, identity)
    engine = group = None
    try:
        group = TorchDPGroup(
            cfg.rank,
            cfg.size,
            cfg.master_addr,
            cfg.master_port,
            generation=cfg.generation,
            backend=cfg.backend,
            timeout_s=cfg.timeout_s,
        )
        engine = LLMEngine(rank_engine_args(cfg), dp_group=group)
        freeze_startup_heap()  # the rank's process hosts this engine until it exits
        group.join(cfg.startup_timeout_s, device=engine.device)
        kv_address = engine.role.kv_address  # a CE's
        block_size = engine.cache_config.block_size
        channel.send(RankReady(cfg.rank, cfg.generation, os.getpid(), engine.num_blocks, block_size, kv_address))
        RankLoop(cfg, engine, group, channel).run()
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        # A peer's failure, or a setting that cannot work (as the engine core reports it): one line
        setting = engine is None and isinstance(exc, (ValueError, FileNotFoundError))
        logger.error("DP rank %d failed: %s", cfg.rank, exc, exc_info=not (_is_peer_failure(exc) or setting))
        channel.send(RankFailed(cfg.rank, cfg.generation, f"{type(exc).__name__}: {exc}", peer=_is_peer_failure(exc)))
        channel.close()
        return 1
    engine.shutdown()
    group.close()
    channel.close()
    return 0


def rank_engine_args(cfg: RankConfig):
    """The group's engine settings for this rank: a fixed K/V port (``--kv-port P``) becomes
    P + rank, so each CE rank listens on a port of its own."""
    values = dict(cfg.engine_args)
    kv = dict(values.get("kv_transfer") or {})
    if kv.get("port"):
        kv["port"] = int(kv["port"]) + cfg.rank
        values["kv_transfer"] = kv
    return engine_args_from_dict(values)


def _is_peer_failure(exc: BaseException) -> bool:
    from pdinfer.distributed.dp_group import DPGroupError

    return isinstance(exc, DPGroupError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = msgspec.json.decode(argv[0], type=RankConfig)
    # A rank must not outlive its launcher (no orphans holding memory and ports); not Linux: the
    # front-silence timeout applies.
    if not pdinfer_env.die_with_parent(signal.SIGKILL, cfg.parent_pid):
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):  # they reach the front too, which stops us in order
        signal.signal(sig, signal.SIG_IGN)
    import pdinfer  # noqa: F401  (sets up the pdinfer logger)

    for handler in logger.handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s pdinfer[dp{cfg.rank}]: %(message)s"))
    return run_rank(cfg)


if __name__ == "__main__":
    code = main()
    # Nothing is left to flush but the logs; a torch process's normal teardown takes seconds.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
