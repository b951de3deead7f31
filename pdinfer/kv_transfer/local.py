"""An in-process KV connector (tests, and a PE and CE sharing one process).

Same verbs and the same checks as the TCP connector (handshake, layout comparison, shared
secret, the CE's transfer gate), with queues instead of sockets: a control plane of queues
composed with the plain data plane (``BytesPlane``: the bytes ride with the push). Addresses
look like ``local://<name>``.
"""

from __future__ import annotations

import queue
import threading
import uuid
from typing import cast

from pdinfer.kv_transfer.connector import DEFAULT_HANDSHAKE_TIMEOUT_S, Arrival, HandshakeError, KVConnector
from pdinfer.kv_transfer.data_plane import BytesPlane
from pdinfer.kv_transfer.gate import TransferGate
from pdinfer.kv_transfer.protocol import KVAbort, KVAck, KVPush, decode, encode

_registry: dict[str, LocalConnector] = {}
_lock = threading.Lock()


class LocalConnector(KVConnector):
    def __init__(self, name: str | None = None, secret: str | None = None, listen: bool = True):
        self.secret = secret.encode() if secret else None
        self.instance_id = uuid.uuid4().hex
        self.gate = TransferGate()
        self.plane = BytesPlane()
        self._inbox: queue.Queue[Arrival] = queue.Queue()
        self._events: queue.Queue = queue.Queue()
        self._address = f"local://{name or self.instance_id}" if listen else ""
        self._peers: dict[str, LocalConnector] = {}
        self._handshaken: set[str] = set()
        if listen:
            with _lock:
                _registry[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    def check_address(self, address: object) -> None:
        if not isinstance(address, str) or not address.startswith("local://") or len(address) > 256:
            raise ValueError(f"the KV address {str(address)[:80]!r} is not a local:// address")

    def peer_instance(self, address: str) -> str | None:
        peer = self._peers.get(address)
        return peer.instance_id if peer is not None else None

    def connect(self, address: str, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> str:
        with _lock:
            peer = _registry.get(address)
        if peer is None:
            raise HandshakeError(f"nothing listens at {address}")
        if (peer.secret or b"") != (self.secret or b""):
            raise HandshakeError(f"{address} refused the KV hand-off: authentication failed")
        if peer.layout is None or self.layout is None:
            raise HandshakeError(f"{address}: KV cache not ready")
        mismatch = peer.layout.mismatch(self.layout)
        if mismatch:
            raise HandshakeError(f"{address} refused the KV hand-off: KV layout mismatch ({mismatch})")
        peer._handshaken.add(self.instance_id)
        self._peers[address] = peer
        return peer.instance_id

    def send(self, address: str, push: KVPush, payload) -> None:
        peer = self._peers.get(address)
        if peer is None:
            self._events.put(KVAck(transfer_id=push.transfer_id, ok=False, error=f"not connected to {address}"))
            return
        # encode/decode on the way, like the wire: the CE gets its own copy of everything
        message = decode(encode(push, self.secret), peer.secret)
        assert isinstance(message, KVPush)  # it was one before the round trip
        data = bytes(payload)
        error = peer.gate.admit_push(message.transfer_id, self.instance_id, len(data))
        if error is not None:
            self._events.put(KVAck(transfer_id=push.transfer_id, ok=False, error=error))
            return
        peer._inbox.put(Arrival(push=message, payload=data, peer=self))

    def abort(self, address: str, message: KVAbort) -> None:
        peer = self._peers.get(address)
        if peer is not None:
            error, request_id = peer.gate.admit_abort(message.transfer_id, self.instance_id)
            if error is None:
                peer._events.put(KVAbort(transfer_id=message.transfer_id, request_id=request_id))

    def receive(self) -> list[Arrival]:
        return _drain(self._inbox)

    def confirm(self, arrival: Arrival, ok: bool, error: str | None = None) -> None:
        cast(LocalConnector, arrival.peer)._events.put(KVAck(transfer_id=arrival.push.transfer_id, ok=ok, error=error))

    def events(self) -> list:
        return _drain(self._events)

    def close(self) -> None:
        with _lock:
            if _registry.get(self._address) is self:
                del _registry[self._address]


def _drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
