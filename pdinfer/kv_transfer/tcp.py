"""The KV connector over ZeroMQ TCP: any two processes, any two hosts.

One background thread owns every socket (ZeroMQ sockets are not thread-safe): a ROUTER that
PEs push to (CE side) and one DEALER per CE we push to (PE side). The engine thread talks to
it through queues and a wake-up pipe. Frames: [envelope] or [envelope, payload]; the payload is
raw tensor bytes, the envelope a msgspec message; nothing is unpickled.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from concurrent.futures import Future

import msgspec
import zmq

from pdinfer.kv_transfer.connector import Arrival, HandshakeError, KVConnector
from pdinfer.kv_transfer.protocol import (
    AuthError,
    Hello,
    HelloAck,
    KVAbort,
    KVAck,
    KVPush,
    decode,
    encode,
)

logger = logging.getLogger("pdinfer")


class TcpConnector(KVConnector):
    data_plane = "zmq"  # K/V bytes ride in the push's payload frame

    def __init__(
        self, listen_host: str | None = None, listen_port: int = 0, secret: str | None = None, engine_type: int = 0
    ):
        self.secret = secret.encode() if secret else None
        self.engine_type = engine_type
        self.instance_id = uuid.uuid4().hex
        self._ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self._commands: queue.Queue = queue.Queue()
        self._inbox: queue.Queue[Arrival] = queue.Queue()
        self._events: queue.Queue = queue.Queue()
        self._wake_addr = f"inproc://pdinfer-kv-wake-{self.instance_id}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_addr)
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._router: zmq.Socket | None = None
        self._address = ""
        if listen_host is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            if listen_port:
                self._router.bind(f"tcp://{listen_host}:{listen_port}")
                port = listen_port
            else:
                port = self._router.bind_to_random_port(f"tcp://{listen_host}")
            self._address = f"tcp://{listen_host}:{port}"
        self._handshaken: set[bytes] = set()
        self._dealers: dict[str, zmq.Socket] = {}
        self._pending_hello: dict[str, Future] = {}
        self._peer_instance: dict[str, str] = {}
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="pdinfer-kv-tcp", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        if not self._address:
            raise RuntimeError("this connector does not listen (no listen_host)")
        return self._address

    # --- engine-thread API ---------------------------------------------------------------------
    def connect(self, address: str, timeout_s: float = 10.0) -> str:
        if self.layout is None:
            raise RuntimeError("register(layout) before connect")
        future: Future = Future()
        self._command(("connect", address, future))
        try:
            ack: HelloAck = future.result(timeout=timeout_s)
        except TimeoutError:
            self._command(("drop", address, None))
            raise HandshakeError(f"no handshake answer from {address} within {timeout_s:.0f} s") from None
        if not ack.ok:
            self._command(("drop", address, None))
            raise HandshakeError(f"{address} refused the KV hand-off: {ack.error}")
        try:
            self._check_peer(address, ack)
        except HandshakeError:
            self._command(("drop", address, None))
            raise
        self._peer_instance[address] = ack.instance_id
        return ack.instance_id

    def _check_peer(self, address: str, ack: HelloAck) -> None:
        """What a data plane needs from the CE's HelloAck (nothing: ours rides on this socket)."""

    def peer_instance(self, address: str) -> str | None:
        return self._peer_instance.get(address)

    def send(self, address: str, push: KVPush, payload) -> None:
        self._command(("send", address, [encode(push, self.secret), payload]))

    def abort(self, address: str, message: KVAbort) -> None:
        self._command(("send", address, [encode(message, self.secret)]))

    def receive(self) -> list[Arrival]:
        return _drain(self._inbox)

    def confirm(self, arrival: Arrival, ok: bool, error: str | None = None) -> None:
        ack = KVAck(transfer_id=arrival.push.transfer_id, ok=ok, error=error)
        self._command(("reply", arrival.peer, [encode(ack, self.secret)]))

    def events(self) -> list:
        return _drain(self._events)

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        self._command(("stop", None, None))
        self._thread.join(timeout=5)

    def _command(self, command) -> None:
        self._commands.put(command)
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)

    # --- the socket thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while self._running:
                for sock, _ in poller.poll(500):
                    if sock is self._wake_recv:
                        _drain_socket(self._wake_recv)
                        self._run_commands(poller)
                    elif self._router is not None and sock is self._router:
                        self._on_router(self._router)
                    else:
                        self._on_dealer(sock)
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in [*self._dealers.values(), self._router, self._wake_recv, self._wake_send]:
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
                self._open_dealer(poller, target, arg)
            elif kind == "drop":
                sock = self._dealers.pop(target, None)
                if sock is not None:
                    poller.unregister(sock)
                    sock.close(linger=0)
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

    def _open_dealer(self, poller, address: str, future: Future) -> None:
        old = self._dealers.pop(address, None)
        if old is not None:  # re-handshake: a restarted CE is never trusted from stale state
            poller.unregister(old)
            old.close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        poller.register(sock, zmq.POLLIN)
        self._dealers[address] = sock
        self._pending_hello[address] = future
        sock.send(encode(self._hello(), self.secret))

    def _hello(self) -> Hello:
        if self.layout is None:  # connect() checked it
            raise RuntimeError("register(layout) before connect")
        return Hello(layout=self.layout, engine_type=self.engine_type, data_plane=self.data_plane)

    def _on_dealer(self, sock) -> None:
        address = next(a for a, s in self._dealers.items() if s is sock)
        frames = sock.recv_multipart()
        try:
            message = decode(frames[0], self.secret)
        except AuthError:
            refusal = _unsigned_refusal(frames[0])
            if refusal is None:
                logger.warning("dropping a message from %s not signed with our secret", address)
                return
            message = refusal
        except msgspec.DecodeError as exc:
            logger.warning("dropping an unreadable message from %s: %s", address, exc)
            return
        if isinstance(message, HelloAck):
            future = self._pending_hello.pop(address, None)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, KVAck):
            self._on_ack(message)
            self._events.put(message)

    def _on_ack(self, ack: KVAck) -> None:
        """Socket thread: an ack arrived (a device transport frees its staging here)."""

    def _on_router(self, router: zmq.Socket) -> None:
        frames = router.recv_multipart(copy=False)
        identity = frames[0].bytes
        try:
            message = decode(frames[1].bytes, self.secret)
        except AuthError as exc:
            # Refusals go out unsigned: the sender may not know our secret, and a refusal grants nothing.
            refusal = HelloAck(ok=False, instance_id=self.instance_id, error=f"authentication failed: {exc}")
            router.send_multipart([identity, encode(refusal, None)])
            return
        except msgspec.DecodeError as exc:
            logger.warning("dropping a malformed KV message: %s", exc)
            return
        if isinstance(message, Hello):
            router.send_multipart([identity, encode(self._answer_hello(identity, message), self.secret)])
        elif isinstance(message, KVPush):
            if identity not in self._handshaken:
                ack = KVAck(transfer_id=message.transfer_id, ok=False, error="no handshake on this connection")
                router.send_multipart([identity, encode(ack, self.secret)])
                return
            payload = frames[2].buffer if len(frames) > 2 else b""
            self._inbox.put(Arrival(push=message, payload=payload, peer=identity))
        elif isinstance(message, KVAbort):
            self._events.put(message)

    def _answer_hello(self, identity: bytes, hello: Hello) -> HelloAck:
        from pdinfer.kv_transfer.protocol import PROTOCOL_VERSION

        if hello.version != PROTOCOL_VERSION:
            return HelloAck(
                ok=False, instance_id=self.instance_id, error=f"protocol version {hello.version} != {PROTOCOL_VERSION}"
            )
        if self.layout is None:
            return HelloAck(ok=False, instance_id=self.instance_id, error="KV cache not ready")
        if hello.data_plane != self.data_plane:
            return HelloAck(
                ok=False,
                instance_id=self.instance_id,
                error=f"the PE sends K/V over {hello.data_plane}, this CE takes it over "
                f"{self.data_plane}: give both the same kv connector",
            )
        mismatch = self.layout.mismatch(hello.layout)
        if mismatch:
            return HelloAck(ok=False, instance_id=self.instance_id, error=f"KV layout mismatch ({mismatch})")
        self._handshaken.add(identity)
        return HelloAck(ok=True, instance_id=self.instance_id)


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
