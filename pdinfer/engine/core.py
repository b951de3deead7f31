"""The engine core: one engine's step loop in a process of its own.

``pdinfer serve`` starts it (``mp_client.start_engine_core``) and talks to it over one ZeroMQ
ROUTER socket (an IPC socket on this host) with the typed messages of ``core_messages``. The
loop never shares its interpreter with HTTP, JSON, SSE or detokenization: it applies what the
clients sent (adds, aborts, stops, a drain), runs ``engine.step_deltas()`` and sends each client one
``StepOutputs`` per step with the new tokens of its requests. Several API-server processes may
be its clients (``--api-server-count``); each request belongs to the client that added it.

    python -m pdinfer.engine.core   (a ``CoreConfig`` as JSON on stdin; secrets stay off argv)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections import defaultdict

import msgspec
import zmq

from pdinfer.engine.core_messages import (
    AbortRequests,
    Accepted,
    AddRequest,
    CoreFailed,
    Drain,
    Drained,
    Hello,
    Ready,
    Refused,
    Shutdown,
    StepOutputs,
    StopSeqs,
    decode_to_core,
    encode,
    take_stats,
)

logger = logging.getLogger("pdinfer")

HEARTBEAT_INTERVAL_S = 0.1  # stats reach idle clients this often (they also tell it is alive)
_PEER_WAIT_MS = 2  # a step that ran nothing waits on a peer (K/V, an ack): poll, don't spin


class CoreConfig(msgspec.Struct):
    engine_args: dict  # EngineArgs fields (``engine_args_to_dict``)
    address: str  # the ROUTER socket the core binds, ipc://...
    parent_pid: int  # exit at once when this process is no longer our parent


def refusal_kind(exc: BaseException) -> str | None:
    """How a refused add is reported to the client; None: not a refusal (a bug: fail loudly)."""
    from pdinfer.engine.pd_common import NoRoomError
    from pdinfer.kv_transfer.connector import HandshakeError

    if isinstance(exc, ValueError | TypeError | msgspec.ValidationError):  # the last: a DP rank's convert
        return "invalid"
    if isinstance(exc, NoRoomError):
        return "no_room"
    if isinstance(exc, HandshakeError):
        return "handshake"
    return None


def refusal_error(kind: str, message: str) -> BaseException:
    """The exception a client raises for a refused add (``refusal_kind``'s inverse)."""
    if kind == "no_room":
        from pdinfer.engine.pd_common import NoRoomError

        return NoRoomError(message)
    if kind == "handshake":
        from pdinfer.kv_transfer.connector import HandshakeError

        return HandshakeError(message)
    return ValueError(message)


class EngineCore:
    def __init__(self, engine, socket: zmq.Socket):
        self.engine = engine
        self.socket = socket
        self.clients: set[bytes] = set()
        self.owners: dict[str, bytes] = {}  # request id -> the client that added it
        self.num_steps = 0
        self.stopping = False
        self._last_heartbeat_s = 0.0

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            busy = engine.has_unfinished_requests()
            self._receive(0 if busy else int(HEARTBEAT_INTERVAL_S * 1000))
            if self.stopping:
                break
            if engine.has_unfinished_requests():
                deltas = engine.step_deltas()
                self.num_steps += 1
                if deltas:
                    self._publish(deltas)
                elif not engine.last_step_ran:
                    self._receive(_PEER_WAIT_MS)
            self._heartbeat()

    # --- in --------------------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> None:
        socket = self.socket
        if not socket.poll(timeout_ms):
            return
        while True:
            try:
                identity, data = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode_to_core(data)
            except msgspec.DecodeError as exc:
                logger.warning("engine core: an undecodable message from a client: %s", exc)
                continue
            self._apply(identity, message)

    def _apply(self, identity: bytes, message) -> None:
        if isinstance(message, AddRequest):
            self._add(identity, message)
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                if self.owners.get(request_id) == identity:
                    self.engine.abort_request(request_id)
        elif isinstance(message, StopSeqs):
            for request_id, index in message.items:
                if self.owners.get(request_id) == identity:
                    self.engine.stop_seq(request_id, index)
        elif isinstance(message, Drain):
            self._send(identity, Drained(self.engine.drain()))
        elif isinstance(message, Hello):
            self.clients.add(identity)
            self._send(identity, self._ready())
        elif isinstance(message, Shutdown):
            self.stopping = True

    def _add(self, identity: bytes, message: AddRequest) -> None:
        from pdinfer.sampling_params import SamplingParams

        prompt = {"prompt": message.prompt, "prompt_token_ids": message.prompt_token_ids}
        try:
            params = SamplingParams(**message.params)
            answer = self.engine.admit(
                message.request_id, prompt, params, reservation=message.reservation, resume=message.resume
            )
        except Exception as exc:
            kind = refusal_kind(exc)
            if kind is None:
                raise
            self._send(identity, Refused(message.request_id, kind, str(exc)))
            return
        self.owners[message.request_id] = identity
        self._send(identity, Accepted(message.request_id, answer))

    # --- out -------------------------------------------------------------------------------------
    def _publish(self, deltas) -> None:
        by_client: dict[bytes, list] = defaultdict(list)
        owners = self.owners
        for delta in deltas:
            owner = owners.get(delta.request_id)
            if owner is None:
                continue
            by_client[owner].append(delta)
            if delta.finished:
                del owners[delta.request_id]
        if not by_client:
            return
        stats = take_stats(self.engine, self.num_steps)
        for owner, owned in by_client.items():
            self._send(owner, StepOutputs(owned, stats))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat_s < HEARTBEAT_INTERVAL_S or not self.clients:
            return
        self._last_heartbeat_s = now
        message = encode(StepOutputs([], take_stats(self.engine, self.num_steps)))
        for identity in self.clients:
            self.socket.send_multipart([identity, message])

    def _send(self, identity: bytes, message) -> None:
        self.socket.send_multipart([identity, encode(message)])

    def _ready(self) -> Ready:
        engine = self.engine
        sc = engine.scheduler_config
        source = engine.args.tokenizer if engine.args.tokenizer != engine.args.model else None
        return Ready(
            pid=os.getpid(),
            engine_type=int(engine.engine_type.value),
            model_folder=str(engine.model_folder),
            tokenizer=source,
            max_model_len=sc.max_model_len,
            prompt_limit=sc.prompt_limit,
            vocab_size=engine.spec.vocab_size,
            num_total_blocks=engine.block_manager.num_total_blocks,
            block_size=engine.cache_config.block_size,
            kv_address=engine.role.kv_address,  # a CE's K/V port
        )

    def fail(self, error: str) -> None:
        for identity in self.clients | set(self.owners.values()):
            self._send(identity, CoreFailed(error))


def run_core(cfg: CoreConfig) -> int:
    from pdinfer.distributed.messages import engine_args_from_dict
    from pdinfer.engine.heap import freeze_startup_heap
    from pdinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_args_from_dict(cfg.engine_args))  # the role's engine
    freeze_startup_heap()  # this process hosts the one engine until it exits (engine/heap.py)
    socket: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)  # never drop an output: the clients read as fast as they can
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 1000)  # let a last failure report out
    socket.bind(cfg.address)
    core = EngineCore(engine, socket)
    try:
        core.run()
    except BaseException as exc:  # noqa: BLE001 - the engine is in an unknown state: report, exit
        logger.exception("the engine loop died")
        core.fail(f"the engine loop died: {exc!r}")
        socket.close()
        return 1
    engine.shutdown()
    socket.close()
    return 0


def main() -> int:
    from pdinfer import env

    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=CoreConfig)
    if not env.die_with_parent(signal.SIGKILL, cfg.parent_pid):
        return 1
    # Ctrl-C, and a SIGTERM sent to the whole process group or cgroup (launch, systemd), reach
    # the server too, which stops its API servers and then us: a core that died first would fail
    # their last requests and log an error. We die with the server all the same (the death signal).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    import pdinfer  # noqa: F401  (sets up the pdinfer logger)

    for handler in logger.handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s pdinfer[core]: %(message)s"))
    try:
        return run_core(cfg)
    except (ValueError, FileNotFoundError) as exc:  # a setting that cannot work: one line, no trace
        print(f"pdinfer: the engine cannot start: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a torch process's normal teardown takes seconds and has nothing to flush
