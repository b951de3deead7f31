"""A CE's KV port: the ROUTER socket PEs push to, as its owner (``TcpConnector``'s socket
thread) reads it. Everything a stranger may send is checked here, as it arrives, whether the
engine is busy or idle:

- with a secret, a peer must show the connect key in ZeroMQ's handshake (PLAIN, checked by the
  connector's ZAP handler): without it, none of its frames is read at all;
- a frame larger than the largest legal push never arrives (ZMQ_MAXMSGSIZE drops the peer);
- a message not signed with the cluster secret gets an unsigned refusal;
- a Hello must carry a nonce never seen before (a replayed Hello is refused) and a matching KV
  layout; its answer echoes the nonce and names a session for the connection;
- a push or abort must name the session of its connection, and its transfer must be one the
  engine waits for (``TransferGate``), from the PE that owns it, with the reserved byte count.
  Anything else is refused at once and never reaches the engine's inbox.

Each kind of refusal is logged once per peer host.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING

import msgspec
import zmq

from pdinfer.kv_transfer.connector import Arrival
from pdinfer.kv_transfer.protocol import (
    CONNECT_USER,
    PROTOCOL_VERSION,
    AuthError,
    Hello,
    HelloAck,
    KVAbort,
    KVAck,
    KVPush,
    decode,
    encode,
)

if TYPE_CHECKING:
    from pdinfer.kv_transfer.tcp import TcpConnector

logger = logging.getLogger("pdinfer")

MAX_REMEMBERED_NONCES = 100_000  # legitimate Hellos are rare: one per PE and CE (re)start


class RefusalLog:
    """Log each kind of refusal once per peer, in bounded memory (one thread uses it)."""

    def __init__(self, max_entries: int = 4096):
        self._seen: set[tuple[str, str]] = set()
        self._max_entries = max_entries

    def note(self, peer: str, kind: str, message: str, *args) -> None:
        key = (peer, kind)
        if key in self._seen:
            return
        if len(self._seen) >= self._max_entries:
            if len(self._seen) == self._max_entries:
                self._seen.add(("", "full"))
                logger.warning("KV transport: refusals from too many peers; no more are logged")
            return
        self._seen.add(key)
        logger.warning("KV transport: " + message + " (logged once per peer)", *args)


class KVPort:
    def __init__(self, connector: TcpConnector, router: zmq.Socket):
        self.connector, self.router = connector, router
        self.sessions: dict[bytes, str] = {}  # ROUTER identity -> the session its Hello got
        self._nonces: OrderedDict[str, None] = OrderedDict()
        self.refusals = connector._refusals

    def on_message(self) -> None:
        frames = self.router.recv_multipart(copy=False)
        identity, peer = frames[0].bytes, _peer_host(frames[-1])
        if len(frames) not in (2, 3):
            self.refusals.note(peer, "frames", "refused a message of %d frames from %s", len(frames) - 1, peer)
            return
        connector = self.connector
        try:
            message = decode(frames[1].bytes, connector.secret)
        except AuthError as exc:
            self.refusals.note(peer, "unsigned", "refused messages from %s not signed with this CE's secret", peer)
            # Refusals go out unsigned: the sender may not know our secret, and a refusal grants nothing.
            nonce = _unverified_nonce(frames[1].bytes)
            refusal = HelloAck(
                ok=False, instance_id=connector.instance_id, error=f"authentication failed: {exc}", nonce=nonce
            )
            self.router.send_multipart([identity, encode(refusal, None)])
            return
        except (msgspec.DecodeError, ValueError) as exc:
            self.refusals.note(peer, "malformed", "refused a malformed message from %s: %s", peer, exc)
            return
        if isinstance(message, Hello):
            ack = connector._answer_hello(identity, message)
            if not ack.ok:
                self.refusals.note(
                    peer, "hello " + _kind(ack.error), "refused a handshake from %s: %s", peer, ack.error
                )
            self.router.send_multipart([identity, encode(ack, connector.secret)])
        elif isinstance(message, KVPush):
            self._on_push(identity, peer, message, frames)
        elif isinstance(message, KVAbort):
            self._on_abort(identity, peer, message)
        else:
            self.refusals.note(peer, "unexpected", "refused a %s from %s", type(message).__name__, peer)

    def accept_hello(self, identity: bytes, hello: Hello) -> HelloAck:
        """The base checks of a Hello; a session for the connection if it passes."""
        connector = self.connector
        error = None
        if hello.version != PROTOCOL_VERSION:
            error = f"protocol version {hello.version} != {PROTOCOL_VERSION}"
        elif not hello.nonce or len(hello.nonce) > 64:
            error = "the handshake carries no nonce"
        elif hello.nonce in self._nonces:
            error = "replayed handshake (its nonce was seen before)"
        if error is None:
            self._nonces[hello.nonce] = None
            while len(self._nonces) > MAX_REMEMBERED_NONCES:
                self._nonces.popitem(last=False)
            if connector.layout is None:
                error = "KV cache not ready"
            elif hello.data_plane != connector.plane.name:
                error = (
                    f"the PE sends K/V over {hello.data_plane}, this CE takes it over "
                    f"{connector.plane.name}: give both the same kv connector"
                )
            elif mismatch := connector.layout.mismatch(hello.layout):
                error = f"KV layout mismatch ({mismatch})"
        if error is not None:
            return connector._refuse_hello(identity, hello, error)
        session = uuid.uuid4().hex
        self.sessions[identity] = session
        return HelloAck(ok=True, instance_id=connector.instance_id, nonce=hello.nonce, session=session)

    def _on_push(self, identity: bytes, peer: str, push: KVPush, frames: list) -> None:
        connector = self.connector
        session = self.sessions.get(identity)
        if session is None or push.session != session:
            self._refuse_push(identity, peer, push, "no handshake on this connection")
            return
        nbytes = push.nbytes
        if connector.plane.carries_payload:
            nbytes = len(frames[2]) if len(frames) > 2 else 0
            if nbytes != push.nbytes:
                self._refuse_push(identity, peer, push, f"{nbytes} bytes of payload, the push says {push.nbytes}")
                return
        error = connector.gate.admit_push(push.transfer_id, session, nbytes)
        if error is not None:
            self._refuse_push(identity, peer, push, error)
            return
        payload = frames[2].buffer if len(frames) > 2 else b""
        connector._inbox.put(Arrival(push=push, payload=payload, peer=identity))

    def _refuse_push(self, identity: bytes, peer: str, push: KVPush, error: str) -> None:
        self.refusals.note(peer, "push " + _kind(error), "refused a push from %s: %s", peer, error)
        ack = KVAck(transfer_id=push.transfer_id, ok=False, error=error)
        self.router.send_multipart([identity, encode(ack, self.connector.secret)])
        self.connector._refused_push(identity, push)

    def _on_abort(self, identity: bytes, peer: str, abort: KVAbort) -> None:
        session = self.sessions.get(identity)
        if session is None or abort.session != session:
            error: str | None = "no handshake on this connection"
        else:
            error, request_id = self.connector.gate.admit_abort(abort.transfer_id, session)
        if error is not None:
            self.refusals.note(peer, "abort " + _kind(error), "refused an abort from %s: %s", peer, error)
            return
        # The gate's request id, not the message's: an abort ends only its own transfer's request.
        self.connector._events.put(KVAbort(transfer_id=abort.transfer_id, request_id=request_id))


def _peer_host(frame) -> str:
    try:
        return frame.get("Peer-Address") or "?"
    except (zmq.ZMQError, AttributeError):
        return "?"


def _kind(error: str | None) -> str:
    """The kind of an error message: its words before any detail, digits dropped."""
    return re.sub(r"[0-9]+", "", re.split(r"[(:]", error or "", maxsplit=1)[0]).strip()


def _unverified_nonce(frame: bytes) -> str:
    try:
        message = decode(frame, None)
    except Exception:  # noqa: BLE001 - anything unreadable has no nonce to echo
        return ""
    return message.nonce if isinstance(message, Hello) else ""


def answer_zap(zap: zmq.Socket, key: bytes, refusals: RefusalLog) -> None:
    """Answer one ZAP request (ZeroMQ asks while a peer's handshake waits): admit PLAIN with the
    connect key, refuse anything else. A refused peer is dropped before any message of its."""
    frames = zap.recv_multipart()
    version, request_id, _domain, address, _identity, mechanism, *credentials = frames + [b""] * 6
    ok = mechanism == b"PLAIN" and len(credentials) >= 2 and hmac.compare_digest(credentials[1], key)
    if not ok:
        peer = address.decode(errors="replace")
        refusals.note(peer, "connect", "refusing a KV connection from %s without the cluster's key", peer)
    status = (b"200", b"OK") if ok else (b"400", b"the cluster's KV key is required")
    zap.send_multipart([version, request_id, *status, CONNECT_USER if ok else b"", b""])
