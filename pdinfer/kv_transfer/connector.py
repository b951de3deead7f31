"""The KV connector interface: a small set of verbs both transports implement.

A PE *sends* (and gets acks back); a CE *receives* pushes and *confirms* or refuses each.
Engines never touch sockets; they call these verbs from their hooks, on their own thread.

    register(layout)            both: what our KV looks like (used for the handshake)
    register_kv_cache(kv)       CE: the KV tensor an in-place transport writes into (else no-op)
    connect(address)            PE: handshake with a CE; raises HandshakeError on mismatch
    send(address, push, data)   PE: queue a push (non-blocking)
    receive() -> [Arrival]      CE: pushes that arrived (already handshaken and authenticated)
    confirm(arrival, ok, err)   CE: tell the PE the K/V landed (ok) or why it was refused
    abort(address, KVAbort)     PE: tell a CE a transfer is cancelled
    events() -> [KVAck|KVAbort] both: acks (PE) or aborts (CE) that came in
    close()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdinfer.kv_transfer.protocol import KVAbort, KVAck, KVLayout, KVPush


class HandshakeError(RuntimeError):
    """The peer's KV layout or protocol does not match ours, or it refused us."""


@dataclass
class Arrival:
    push: KVPush
    payload: memoryview | bytes
    peer: object  # transport-specific handle to answer the sender


class KVConnector(ABC):
    layout: KVLayout | None = None
    instance_id: str = ""
    # True: the K/V of an arrival is already in the CE's blocks (the payload is empty), and a
    # reserved block may be written by the PE at any time until its push or abort arrives.
    writes_in_place: bool = False

    def register(self, layout: KVLayout) -> None:
        self.layout = layout

    def register_kv_cache(self, kv) -> None:  # noqa: B027 - only in-place transports need it
        return None

    @property
    def address(self) -> str:
        """Where PEs reach this connector (CE side)."""
        raise NotImplementedError

    @abstractmethod
    def connect(self, address: str, timeout_s: float = 10.0) -> str:
        """Handshake with the CE at ``address``; returns its instance id."""

    @abstractmethod
    def send(self, address: str, push: KVPush, payload) -> None: ...

    @abstractmethod
    def receive(self) -> list[Arrival]: ...

    @abstractmethod
    def confirm(self, arrival: Arrival, ok: bool, error: str | None = None) -> None: ...

    @abstractmethod
    def abort(self, address: str, message: KVAbort) -> None: ...

    @abstractmethod
    def events(self) -> list[KVAck | KVAbort]: ...

    def land(self, arrival: Arrival, cache) -> str | None:
        """Device-payload transports (``device_payload``): copy an arrival's K/V into its blocks
        of ``cache`` and check it there; an error, or None."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional: transports without resources keep it
        return None
