"""The KV connector interface: a small set of verbs both transports implement.

A PE *sends* (and gets acks back); a CE *receives* pushes and *confirms* or refuses each.
Engines never touch sockets; they call these verbs from their hooks, on their own thread.

    register(layout)            both: what our KV looks like (used for the handshake)
    register_kv_cache(kv)       CE: the KV tensor an in-place transport writes into (else no-op)
    check_address(address)      PE: ValueError unless ``address`` is one this transport can reach
    start_connect(address)      PE: begin a handshake with a CE; a Future, never blocks
    finish_connect(address, f)  PE: its result: the CE's instance id, or HandshakeError
    connect(address)            PE: both in one (blocks until the CE answers or the timeout)
    gate                        CE: the transfers it waits for (``TransferGate``); the transport
                                refuses every other push and abort as it arrives
    send(address, push, data)   PE: queue a push (non-blocking)
    receive() -> [Arrival]      CE: pushes that arrived (already handshaken and authenticated)
    confirm(arrival, ok, err)   CE: tell the PE the K/V landed (ok) or why it was refused
    abort(address, KVAbort)     PE: tell a CE a transfer is cancelled
    events() -> [KVAck|KVAbort] both: acks (PE) or aborts (CE) that came in
    close()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass

from pdinfer.kv_transfer.gate import TransferGate
from pdinfer.kv_transfer.protocol import KVAbort, KVAck, KVLayout, KVPush

DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0


class HandshakeError(RuntimeError):
    """The peer's KV layout or protocol does not match ours, or it refused us."""


@dataclass
class Arrival:
    push: KVPush
    payload: memoryview | bytes
    peer: object  # transport-specific handle to answer the sender
    drain_only: bool = False  # refused already; the transport only takes its bytes off the link


class KVConnector(ABC):
    layout: KVLayout | None = None
    instance_id: str = ""
    gate: TransferGate
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

    def check_address(self, address: object) -> None:  # noqa: B027 - a transport with a syntax overrides it
        if not isinstance(address, str) or not address or len(address) > 256:
            raise ValueError(f"the KV address must be a short string, got {str(address)[:80]!r}")

    def start_connect(self, address: str, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> Future:
        """Begin a handshake with the CE at ``address`` (ValueError for an address that is not
        one); ``finish_connect`` turns the Future into the CE's instance id."""
        self.check_address(address)
        future: Future = Future()
        try:
            future.set_result(self.connect(address, timeout_s))
        except HandshakeError as exc:
            future.set_exception(exc)
        return future

    def finish_connect(self, address: str, future: Future) -> str:
        """The CE's instance id once ``future`` is done; HandshakeError if it refused or never answered."""
        return future.result()

    def peer_instance(self, address: str) -> str | None:
        """The instance id of the CE we last shook hands with at ``address``."""
        return None

    @abstractmethod
    def connect(self, address: str, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> str:
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
