"""The KV connector over ZeroMQ TCP: any two processes, any two hosts.

This is the control plane of every networked transport; a data plane (``data_plane.py``) is
composed into it: the plain one (``BytesPlane``: the K/V rides in the push's payload frame,
the "tcp" transport), CUDA IPC, NCCL or Mooncake.

One background thread owns every socket (ZeroMQ sockets are not thread-safe): a ROUTER that
PEs push to (CE side, the "KV port", its checks in ``tcp_port``) and one DEALER per CE we push
to (PE side). The engine thread talks to it through queues and a wake-up pipe. Frames:
[envelope] or [envelope, payload]; the payload is raw tensor bytes, the envelope a msgspec
message; nothing is unpickled. The thread survives anything one message or address does: a bad
one fails that handshake or is refused, and the rest goes on.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdinfer.kv_transfer.connector import DEFAULT_HANDSHAKE_TIMEOUT_S, Arrival, HandshakeError, KVConnector
from pdinfer.kv_transfer.data_plane import BytesPlane, DataPlane
from pdinfer.kv_transfer.gate import TransferGate
from pdinfer.kv_transfer.protocol import (
    CONNECT_USER,
    CONTROL_FRAME_BYTES,
    ZAP_DOMAIN,
    AuthError,
    Hello,
    HelloAck,
    KVAbort,
    KVAck,
    KVPush,
    connect_key,
    decode,
    encode,
    frame_limit,
)
from pdinfer.kv_transfer.tcp_port import KVPort, RefusalLog, answer_zap

logger = logging.getLogger("pdinfer")

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})")


def check_tcp_address(address: object) -> None:
    """ValueError unless ``address`` is ``tcp://host:port`` (a name or an IP, no wildcard)."""
    match = _ENDPOINT.fullmatch(address) if isinstance(address, str) and len(address) <= 256 else None
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise ValueError(
            f"the KV address {str(address)[:80]!r} is not a ZeroMQ TCP endpoint (tcp://host:port, port 1-65535)"
        )


@dataclass
class _PendingHello:
    nonce: str
    deadline: float
    timeout_s: float
    futures: list[Future] = field(default_factory=list)


class TcpConnector(KVConnector):
    def __init__(
        self,
        listen_host: str | None = None,
        listen_port: int = 0,
        secret: str | None = None,
        engine_type: int = 0,
        max_push_blocks: int = 0,
        bytes_per_block: int = 0,
        plane: DataPlane | None = None,
    ):
        self.plane = plane if plane is not None else BytesPlane()
        self.secret = secret.encode() if secret else None
        self._connect_key = connect_key(self.secret) if self.secret else b""  # shown in every handshake
        self.engine_type = engine_type
        self.instance_id = uuid.uuid4().hex
        self.gate = TransferGate()
        # A CE with a secret authenticates connections with a ZAP handler, which ZeroMQ allows
        # one of per context: such a CE has a context of its own.
        self._own_ctx = bool(self.secret) and listen_host is not None
        self._ctx: zmq.Context[zmq.Socket] = zmq.Context() if self._own_ctx else zmq.Context.instance()
        self._zap: zmq.Socket | None = None
        self._monitors: dict[zmq.Socket, str] = {}  # a dealer's handshake events -> its CE address
        self._commands: queue.Queue = queue.Queue()
        self._inbox: queue.Queue[Arrival] = queue.Queue()
        self._events: queue.Queue = queue.Queue()
        self._wake_addr = f"inproc://pdinfer-kv-wake-{self.instance_id}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_addr)
        # Any thread may send on _wake_send (under _wake_lock); only close() closes it, after
        # the socket thread has ended, so no command can meet a closed socket.
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._closed = False
        self._refusals = RefusalLog()
        self.max_message_bytes = -1  # a PE reads only control messages (its dealers' own bound)
        self.max_push_bytes = max_push_blocks * bytes_per_block  # 0: not known
        self.plane.max_push_bytes = self.max_push_bytes
        self.plane.attach(self)
        self._router: zmq.Socket | None = None
        self._port: KVPort | None = None
        self._address = ""
        if listen_host is not None:
            payload_bytes = bytes_per_block if self.plane.carries_payload else 0
            self.max_message_bytes = frame_limit(max_push_blocks, payload_bytes) if max_push_blocks > 0 else -1
            self._router, self._address = self._bind(listen_host, listen_port)
            self._port = KVPort(self, self._router)
        self._dealers: dict[str, zmq.Socket] = {}
        self._pending_hello: dict[str, _PendingHello] = {}
        self._peer_instance: dict[str, str] = {}
        self._sessions_out: dict[str, str] = {}  # CE address -> our session there
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="pdinfer-kv-tcp", daemon=True)
        self._thread.start()

    def _bind(self, host: str, port: int) -> tuple[zmq.Socket, str]:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        # Before bind: a listener copies the options into every connection it accepts.
        router.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # a larger frame drops the peer
        router.setsockopt(zmq.RCVHWM, 64)  # messages queued per peer before TCP pushes back
        # A PE that reconnects (a reset or flapping link) keeps its routing id, and with it its
        # session; its new connection replaces the old one, which may linger half-open here.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.secret:  # only a peer with the connect key gets past the handshake (ZAP)
            self._zap = self._ctx.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind("inproc://zeromq.zap.01")
            router.setsockopt(zmq.PLAIN_SERVER, 1)
            router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        if port:
            router.bind(f"tcp://{host}:{port}")
        else:
            port = router.bind_to_random_port(f"tcp://{host}")
        return router, f"tcp://{host}:{port}"

    @property
    def address(self) -> str:
        if not self._address:
            raise RuntimeError("this connector does not listen (no listen_host)")
        return self._address

    # --- engine-thread API ---------------------------------------------------------------------
    def check_address(self, address: object) -> None:
        check_tcp_address(address)

    def start_connect(self, address: str, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> Future:
        self.check_address(address)
        if self.layout is None:
            raise RuntimeError("register(layout) before connect")
        self.plane.prepare_connect()
        future: Future = Future()
        self._command(("connect", address, (future, timeout_s)))
        return future

    def finish_connect(self, address: str, future: Future) -> str:
        ack: HelloAck = future.result()  # the socket thread resolves it by the handshake's deadline
        if not ack.ok:
            self._command(("drop", address, None))
            raise HandshakeError(f"{address} refused the KV hand-off: {ack.error}")
        try:
            self._check_peer(address, ack)
        except HandshakeError:
            self._command(("drop", address, None))
            raise
        self._peer_instance[address] = ack.instance_id
        self._sessions_out[address] = ack.session
        return ack.instance_id

    def connect(self, address: str, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> str:
        return self.finish_connect(address, self.start_connect(address, timeout_s))

    def _check_peer(self, address: str, ack: HelloAck) -> None:
        self.plane.check_peer(address, ack)

    def peer_instance(self, address: str) -> str | None:
        return self._peer_instance.get(address)

    def _seal(self, address: str, message: KVPush | KVAbort) -> bytes:
        """``message`` in its envelope, naming our session with the CE at ``address``."""
        message.session = self._sessions_out.get(address, "")
        return encode(message, self.secret)

    # The hand-off transaction: the data plane's part, then ours.
    def stage_blocks(self, cache, block_ids: list[int]):
        return self.plane.stage(cache, block_ids)

    def send(self, address: str, push: KVPush, payload) -> None:
        self.plane.send(address, push, payload)

    def abort(self, address: str, message: KVAbort) -> None:
        self.plane.abort(address, message)

    def register_kv_cache(self, kv) -> None:
        self.plane.register_kv_cache(kv)

    def receive(self) -> list[Arrival]:
        return self.plane.receive(_drain(self._inbox))

    def land(self, arrival: Arrival, cache) -> str | None:
        return self.plane.land(arrival, cache)

    def confirm(self, arrival: Arrival, ok: bool, error: str | None = None) -> None:
        self.plane.before_confirm(arrival, ok)
        ack = KVAck(transfer_id=arrival.push.transfer_id, ok=ok, error=error)
        self._command(("reply", arrival.peer, [encode(ack, self.secret)]))

    def events(self) -> list:
        events = _drain(self._events)
        for event in events:  # acks made up here ("not connected") never passed _on_ack
            if isinstance(event, KVAck):
                self.plane.on_ack(event.transfer_id)
        return events

    @property
    def staged_bytes(self) -> int:
        return self.plane.staged_bytes

    def close(self) -> None:
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
        self.plane.drain()
        self._command(("stop", None, None))  # the socket thread ends once it reads this
        self._thread.join(timeout=5)
        with self._wake_lock:
            self._wake_send.close(linger=0)
        self.plane.close()
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    # --- what the data plane may ask (``data_plane.Link``) -------------------------------------
    def send_control(self, address: str, message: KVPush | KVAbort, payload=None) -> None:
        frames = [self._seal(address, message)]
        if payload is not None:
            frames.append(payload)
        self._command(("send", address, frames))

    def post_event(self, event) -> None:
        self._events.put(event)

    def _command(self, command) -> None:
        """Queue ``command`` for the socket thread and wake it (after ``close`` nothing runs it)."""
        self._commands.put(command)
        with self._wake_lock:
            if not self._wake_send.closed:
                self._wake_send.send(b"", zmq.NOBLOCK)

    # --- the socket thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        try:
            while self._running:
                for sock, _ in poller.poll(200):
                    try:
                        if sock is self._wake_recv:
                            _drain_socket(self._wake_recv)
                            self._run_commands(poller)
                        elif self._port is not None and sock is self._router:
                            self._port.on_message()
                        elif sock is self._zap:
                            answer_zap(self._zap, self._connect_key, self._refusals)
                        elif sock in self._monitors:
                            self._on_monitor(poller, sock)
                        else:
                            self._on_dealer(sock)
                    except zmq.ContextTerminated:
                        raise
                    except Exception:  # one bad message or address must not end the thread
                        logger.exception("KV transport: error handling a message (carrying on)")
                self._expire_hellos(poller)
        except zmq.ContextTerminated:
            pass
        finally:
            for pending in self._pending_hello.values():
                _fail(pending.futures, HandshakeError("the KV connector was closed"))
            for monitor in list(self._monitors):
                monitor.close(linger=0)
            for sock in [*self._dealers.values(), self._router, self._zap, self._wake_recv]:
                if sock is not None:
                    sock.close(linger=0)

    def _run_commands(self, poller) -> None:
        while True:
            try:
                kind, target, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "stop":
                self._running = False
                return
            if kind == "connect":
                self._open_dealer(poller, target, *arg)
            elif kind == "drop":
                self._close_dealer(poller, target)
            elif kind == "send":
                sock = self._dealers.get(target)
                if sock is None:
                    self._events.put(
                        KVAck(
                            transfer_id=_transfer_id(arg[0], self.secret), ok=False, error=f"not connected to {target}"
                        )
                    )
                else:
                    sock.send_multipart(arg, copy=False)
            elif kind == "reply" and self._router is not None:
                self._router.send_multipart([target, *arg])

    def _open_dealer(self, poller, address: str, future: Future, timeout_s: float) -> None:
        pending = self._pending_hello.get(address)
        if pending is not None:  # a handshake with it is under way: answer both with it
            pending.futures.append(future)
            return
        self._close_dealer(poller, address)  # a re-handshake: a restarted CE is never trusted from stale state
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_FRAME_BYTES)  # a CE sends nothing larger
        # ZeroMQ reconnects by itself; a fixed id (ours alone, unguessable) keeps the CE's session
        # for us valid across reconnects, which would otherwise refuse every later push.
        sock.setsockopt(zmq.ROUTING_ID, b"pe-" + uuid.uuid4().hex.encode())
        if self.secret:
            sock.setsockopt(zmq.PLAIN_USERNAME, CONNECT_USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, self._connect_key)
        # A CE that refuses the handshake (another secret, or none) answers nothing: its
        # refusal shows only as an event of our socket's.
        monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        self._monitors[monitor] = address
        poller.register(monitor, zmq.POLLIN)
        try:
            sock.connect(address)
            hello = self._hello()
        except Exception as exc:  # noqa: BLE001 - e.g. a host name that does not resolve
            self._close_monitor(poller, sock, address)
            sock.close(linger=0)
            _fail([future], HandshakeError(f"cannot connect to {address}: {exc}"))
            return
        poller.register(sock, zmq.POLLIN)
        self._dealers[address] = sock
        self._pending_hello[address] = _PendingHello(hello.nonce, time.monotonic() + timeout_s, timeout_s, [future])
        sock.send(encode(hello, self.secret))

    def _close_dealer(self, poller, address: str) -> None:
        sock = self._dealers.pop(address, None)
        if sock is not None:
            self._close_monitor(poller, sock, address)
            poller.unregister(sock)
            sock.close(linger=0)

    def _close_monitor(self, poller, sock, address: str) -> None:
        for monitor in [m for m, a in self._monitors.items() if a == address]:
            del self._monitors[monitor]
            poller.unregister(monitor)
            sock.disable_monitor()
            monitor.close(linger=0)

    def _on_monitor(self, poller, monitor) -> None:
        """A dealer's handshake failed: the CE does not share our secret. Its handshake fails now."""
        event = recv_monitor_message(monitor)
        address = self._monitors[monitor]
        pending = self._pending_hello.pop(address, None)
        self._close_dealer(poller, address)
        if pending is not None:
            reason = (
                "authentication failed" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "protocol mismatch"
            )
            error = f"the CE at {address} refused our connection ({reason}): is --kv-secret the same on both sides?"
            _fail(pending.futures, HandshakeError(error))

    def _expire_hellos(self, poller) -> None:
        now = time.monotonic()
        for address, pending in list(self._pending_hello.items()):
            if now > pending.deadline:
                del self._pending_hello[address]
                self._close_dealer(poller, address)
                error = f"no handshake answer from {address} within {pending.timeout_s:.0f} s"
                _fail(pending.futures, HandshakeError(error))

    def _hello(self) -> Hello:
        if self.layout is None:  # start_connect checked it
            raise RuntimeError("register(layout) before connect")
        return Hello(
            layout=self.layout,
            engine_type=self.engine_type,
            data_plane=self.plane.name,
            nonce=uuid.uuid4().hex,
            data_info=self.plane.hello_info(),
        )

    def _on_dealer(self, sock) -> None:
        address = next((a for a, s in self._dealers.items() if s is sock), None)
        frames = sock.recv_multipart()
        if address is None:
            return
        try:
            message = decode(frames[0], self.secret)
        except AuthError:
            refusal = _unsigned_refusal(frames[0])
            if refusal is None:
                self._refusals.note(
                    address, "unsigned", "dropping messages from %s not signed with our secret", address
                )
                return
            message = refusal
        except msgspec.DecodeError as exc:
            self._refusals.note(address, "unreadable", "dropping an unreadable message from %s: %s", address, exc)
            return
        if isinstance(message, HelloAck):
            pending = self._pending_hello.get(address)
            if pending is None or message.nonce != pending.nonce:  # stale, or replayed to us
                self._refusals.note(
                    address, "stray-ack", "ignoring a handshake answer from %s we did not ask for", address
                )
                return
            del self._pending_hello[address]
            for future in pending.futures:
                if not future.done():
                    future.set_result(message)
        elif isinstance(message, KVAck):
            self._on_ack(message)
            self._events.put(message)

    def _on_ack(self, ack: KVAck) -> None:
        """Socket thread: an ack arrived (a device transport frees its staging here)."""
        self.plane.on_ack(ack.transfer_id)

    # --- the CE's side of the handshake (hooks of the KV port) -------------------------------------------
    def _answer_hello(self, identity: bytes, hello: Hello) -> HelloAck:
        """Layout, protocol and data plane checked by the port; a data plane adds its own."""
        if self._port is None:
            return self._refuse_hello(identity, hello, "not listening")
        ack = self._port.accept_hello(identity, hello)
        if ack.ok and (error := self.plane.answer_hello(identity, hello, ack)) is not None:
            return self._refuse_hello(identity, hello, error)
        return ack

    def _refuse_hello(self, identity: bytes, hello: Hello, error: str) -> HelloAck:
        if self._port is not None:
            self._port.sessions.pop(identity, None)
        return HelloAck(ok=False, instance_id=self.instance_id, error=error, nonce=hello.nonce)

    def _refused_push(self, identity: bytes, push: KVPush) -> None:
        """Socket thread: the port refused ``push`` (a transport whose bytes follow on another
        link takes them off it here)."""
        drain = self.plane.refused_push(identity, push)
        if drain is not None:
            self._inbox.put(drain)


def _fail(futures: list[Future], error: Exception) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)


def _unsigned_refusal(frame: bytes) -> HelloAck | None:
    try:
        message = decode(frame, None)
    except Exception:  # noqa: BLE001 - anything unreadable is simply not a refusal
        return None
    return message if isinstance(message, HelloAck) and not message.ok else None


def _drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def _drain_socket(sock) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def _transfer_id(frame, secret) -> str:
    try:
        message = decode(bytes(frame), secret)
        return getattr(message, "transfer_id", "")
    except Exception:  # noqa: BLE001 - only used to label a failure
        return ""
