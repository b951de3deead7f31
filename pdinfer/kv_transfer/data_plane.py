"""Data planes: how a hand-off's K/V bytes travel, composed with a control plane that carries the
messages (the ZeroMQ one in ``tcp.py``, or the in-process one in ``local.py``).

A data plane owns both ends of the bytes of one transfer, so that its copy-out, its checksum and
its landing always match:

    stage(cache, block_ids) -> Staged   PE, step thread after the forward that wrote the blocks:
                                        copy them out (``Staged.finish()`` waits for the copy and
                                        gives ``(payload, nbytes, checksum)``; ``release()`` gives
                                        the copy back if it is never sent)
    send(address, push, payload)        PE: complete the payload and send the push (before, with
                                        or after the bytes, as the plane needs)
    abort(address, message)             PE: cancel a transfer (behind anything it still writes)
    on_ack(transfer_id)                 PE: the CE answered (or the transfer failed): free staging
    land(arrival, cache) -> error       CE, step thread: put the bytes into their blocks and
                                        verify the checksum there; why they were refused, or None

and the handshake's part (``hello_info``, ``answer_hello``, ``check_peer``). The control plane calls
these; the engine sees only the connector's verbs (``connector.py``). A new transport is one
file: a ``DataPlane`` subclass and a connector that composes it.

``BytesPlane`` is the plain one: the bytes ride in the push's payload frame.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdinfer.kv_transfer.protocol import checksum

if TYPE_CHECKING:
    from pdinfer.kv_transfer.connector import Arrival
    from pdinfer.kv_transfer.protocol import Hello, HelloAck, KVAbort, KVPush


class Staged(Protocol):
    """A transfer's K/V copied out of the PE's blocks."""

    def finish(self) -> tuple[Any, int, int]:
        """``(payload for send, bytes, checksum)`` once the copy is done."""
        ...

    def release(self) -> None:
        """Give the copy back (after it is done: it reads the PE's blocks)."""
        ...


class Link(Protocol):
    """What a data plane may ask of its control plane."""

    instance_id: str

    def send_control(self, address: str, message: KVPush | KVAbort, payload: Any = None) -> None: ...

    def post_event(self, event: Any) -> None: ...


class HostStaged:
    """Blocks copied to host memory: a CPU tensor, or (CUDA) a pinned one with its copy event."""

    def __init__(self, copy):
        self._copy = copy

    def finish(self) -> tuple[Any, int, int]:
        kv = self._copy
        if isinstance(kv, tuple):  # pinned host copy and its event
            kv, event = kv
            event.synchronize()
        data = kv.contiguous().view(-1).view(dtype=torch.uint8).numpy()
        return data, data.nbytes, checksum(data)

    def release(self) -> None:
        if isinstance(self._copy, tuple):
            self._copy[1].synchronize()


def stage_to_host(cache, block_ids: list[int]) -> HostStaged:
    if cache.kv.device.type == "cuda":  # into pinned memory, asynchronously
        return HostStaged(cache.read_blocks_async(block_ids))
    return HostStaged(cache.read_blocks(block_ids))


class DataPlane:
    """The bytes ride in the push's payload frame (``name`` "zmq": ZeroMQ, or the in-process
    queue). Subclasses override what their bytes need."""

    name = "zmq"  # what the Hello names; both sides of a pair must use the same
    carries_payload = True  # the bytes are a frame of the push (the KV port bounds it)
    # True: the PE writes into the CE's reserved blocks itself, at any time until its push or
    # abort arrives (the CE quarantines such blocks when it drops a reservation).
    writes_in_place = False
    max_push_bytes = 0  # the largest push the CE takes (set by the connector; 0: not known)
    link: Link

    def attach(self, link: Link) -> None:
        self.link = link

    # --- PE ---------------------------------------------------------------------------------------
    def stage(self, cache, block_ids: list[int]) -> Staged:
        return stage_to_host(cache, block_ids)

    def prepare_connect(self) -> None:
        """Engine thread, before a handshake: allocate what the Hello describes."""

    def hello_info(self) -> bytes:
        """Socket thread: what the CE needs to check at the handshake (``Hello.data_info``)."""
        return b""

    def check_peer(self, address: str, ack: HelloAck) -> None:
        """Engine thread: what this plane needs from the CE's HelloAck (HandshakeError if absent)."""

    def send(self, address: str, push: KVPush, payload) -> None:
        self.link.send_control(address, push, payload)

    def abort(self, address: str, message: KVAbort) -> None:
        self.link.send_control(address, message)

    def on_ack(self, transfer_id: str) -> None:
        """An ack came (socket thread) or was made up (engine thread): staging may go."""

    @property
    def staged_bytes(self) -> int:
        return 0

    # --- CE ---------------------------------------------------------------------------------------
    def register_kv_cache(self, kv) -> None:
        """The KV tensor a plane that writes in place writes into."""

    def answer_hello(self, identity: bytes, hello: Hello, ack: HelloAck) -> str | None:
        """Socket thread: refuse a PE this plane cannot serve (an error), or fill ``ack``."""
        return None

    def refused_push(self, identity: bytes, push: KVPush) -> Arrival | None:
        """Socket thread: the port refused ``push``; a plane whose bytes follow on another link
        returns an arrival to take them off it (``drain_only``)."""
        return None

    def receive(self, arrivals: list[Arrival]) -> list[Arrival]:
        """Engine thread: the arrivals the engine sees (a plane may post receives here)."""
        return arrivals

    def land(self, arrival: Arrival, cache) -> str | None:
        push = arrival.push
        if len(arrival.payload) != push.nbytes:
            return f"payload of {len(arrival.payload)} bytes, the push says {push.nbytes}"
        if checksum(arrival.payload) != push.checksum:
            return "checksum mismatch: the K/V was corrupted in transit"
        with warnings.catch_warnings():  # read-only receive buffer: we only copy out of it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(arrival.payload, dtype=torch.uint8)
        cache.write_blocks(
            list(push.block_ids), data.view(cache.kv.dtype).view(len(push.block_ids), *cache.kv.shape[1:])
        )
        return None

    def before_confirm(self, arrival: Arrival, ok: bool) -> None:
        """Engine thread, before the CE's answer goes out."""

    def drain(self) -> None:
        """Before the control plane stops: let what is in flight leave."""

    def close(self) -> None:
        """After the control plane stopped."""


BytesPlane = DataPlane
