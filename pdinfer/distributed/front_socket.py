"""The DP front's sockets: one ROUTER every rank and agent connects to, and an inproc pair
through which other threads wake the front's I/O thread.

Only the I/O thread uses them, except ``wake`` (thread-safe, and a no-op once closed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import msgspec
import zmq

from pdinfer.distributed.messages import ToFront, decode_to_front, encode

logger = logging.getLogger("pdinfer")


class FrontSocket:
    def __init__(self, master_addr: str, master_port: int, front_port: int | None):
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.setsockopt(zmq.LINGER, 0)
        host = "127.0.0.1" if master_addr in ("127.0.0.1", "localhost") else "*"
        port = front_port or (master_port + 1 if master_port else 0)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{master_addr}:{port}"
        wake_addr = f"inproc://pdinfer-dp-wake-{id(self)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(wake_addr)
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_recv, zmq.POLLIN)

    def wake(self) -> None:
        with self._wake_lock:
            if not self._wake_send.closed:
                self._wake_send.send(b"", zmq.NOBLOCK)

    def poll(self, timeout_ms: int) -> bool:
        """Wait for a message or a wake-up (at most ``timeout_ms``); True if messages wait."""
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_recv in events:
            while self._wake_recv.poll(0):
                self._wake_recv.recv()
        return self._router in events

    def receive(self) -> Iterator[tuple[bytes, ToFront]]:
        """(identity, message) of every message waiting now; malformed ones are dropped."""
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, payload = frames
                message = decode_to_front(payload)
            except (ValueError, msgspec.DecodeError) as exc:  # not from a rank of ours
                logger.warning("DP front: dropped a malformed message (%s)", exc)
                continue
            yield identity, message

    def send(self, identity: bytes, message: msgspec.Struct) -> None:
        """Raises ``zmq.ZMQError`` (EHOSTUNREACH) when that peer is gone."""
        self._router.send_multipart([identity, encode(message)], zmq.NOBLOCK)

    def close(self) -> None:
        with self._wake_lock:
            for sock in (self._router, self._wake_recv, self._wake_send):
                sock.close(0)
        self._ctx.term()
