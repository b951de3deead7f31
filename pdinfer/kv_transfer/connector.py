"""The KV connector interface: one hand-off transaction, the same verbs for every transport.

A connector is a control plane (the messages: handshake, pushes, acks, aborts; ZeroMQ in
``tcp.py``, queues in ``local.py``) composed with a data plane (the bytes: ``data_plane.py``).
Engines never touch sockets or bytes; they call these verbs from their hooks, on their own
thread (``stage_blocks`` and ``land`` on the step thread, in step order).

    register(layout)               both: what our KV looks like (used for the handshake)
    register_kv_cache(kv)          CE: the KV tensor a plane that writes in place writes into
    check_address(address)         PE: ValueError unless ``address`` is one this transport can reach
    start_connect(address)         PE: begin a handshake with a CE; a Future, never blocks
    finish_connect(address, f)     PE: its result: the CE's instance id, or HandshakeError
    connect(address)               PE: both in one (blocks until the CE answers or the timeout)

    The transaction, PE side:
    stage_blocks(cache, blocks)    copy-out, after the forward that wrote them: a ``Staged``,
                                   whose ``finish()`` gives (payload, nbytes, checksum) and whose
                                   ``release()`` gives the copy back if it is never sent
    send(address, push, payload)   payload completion and the push (non-blocking)
    abort(address, KVAbort)        cancel it (a CE then frees its reservation)
    events() -> [KVAck]            the CE's answers; staging is released on them
    The transaction, CE side:
    gate                           the transfers it waits for (``TransferGate``); the transport
                                   refuses every other push and abort as it arrives
    receive() -> [Arrival]         pushes that arrived (handshaken and authenticated)
    land(arrival, cache) -> error  landing with verification: the K/V into its reserved blocks,
                                   checksum checked there; why it was refused, or None
    confirm(arrival, ok, err)      tell the PE (it releases its staging)
    events() -> [KVAbort]          aborts that came in
    close()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass

from pdinfer.kv_transfer.data_plane import DataPlane, Staged
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
    plane: DataPlane

    @property
    def writes_in_place(self) -> bool:
        """The K/V of an arrival is already in the CE's blocks (the payload is empty), and a
        reserved block may be written by the PE at any time until its push or abort arrives."""
        return self.plane.writes_in_place

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

    def stage_blocks(self, cache, block_ids: list[int]) -> Staged:
        """Step thread, after the forward that wrote ``block_ids``: copy their K/V out."""
        return self.plane.stage(cache, block_ids)

    def land(self, arrival: Arrival, cache) -> str | None:
        """Step thread: the arrival's K/V into its blocks of ``cache``, checked there; why it was
        refused, or None."""
        return self.plane.land(arrival, cache)

    @property
    def staged_bytes(self) -> int:
        """PE: bytes of staging held by transfers not answered yet."""
        return self.plane.staged_bytes

    def close(self) -> None:  # noqa: B027 - optional: transports without resources keep it
        return None
