"""The KV connector over Mooncake's Transfer Engine (TCP mode): K/V written straight into the
CE's KV cache, the ZeroMQ connector's messages for everything else.

Data plane: the CE registers its whole KV tensor with Mooncake once; the PE registers a
staging buffer (grown when a push needs more), copies the blocks of a push into it and writes
them with one ``batch_transfer_sync_write`` into the CE's blocks (block-major cache: each block
is one contiguous chunk). No metadata server: ``P2PHANDSHAKE`` session ids (``host:rpc_port``).
Control plane (the ZeroMQ one, ``tcp.py``, composed with ``MooncakePlane``): Hello/HelloAck with the layout check and the shared secret
(the HelloAck adds the CE's session id and where its KV cache lives), then a KVPush with the
checksum and no payload frame, sent only after the write returned 0; the CE checks the crc32
over the blocks in its own memory.

Order: a PE's writes, pushes and aborts leave from one writer thread, one after another, so a
KVAbort or a push tells the CE that nothing more will be written into that transfer's blocks.
Mooncake's data plane has no authentication: keep its ports on loopback or a trusted network.

Install: ``apt-get install libibverbs1 && pip install mooncake-transfer-engine-non-cuda`` (the
CUDA build, ``mooncake-transfer-engine``, needs libcudart and libcuda to import).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdinfer import env
from pdinfer.kv_transfer.connector import HandshakeError
from pdinfer.kv_transfer.data_plane import DataPlane
from pdinfer.kv_transfer.protocol import Hello, HelloAck, KVAbort, KVAck, KVPush, block_runs, checksum_blocks
from pdinfer.kv_transfer.tcp import TcpConnector

logger = logging.getLogger("pdinfer")

INSTALL_HINT = (
    "the mooncake KV connector needs Mooncake's Transfer Engine: "
    "apt-get install libibverbs1 && pip install mooncake-transfer-engine-non-cuda "
    "(the CUDA build, mooncake-transfer-engine, also needs libcudart and libcuda)"
)
MIN_STAGING_BYTES = 1 << 20


def load_transfer_engine():
    """Mooncake's ``TransferEngine`` class; a RuntimeError naming what to install if it is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # no wheel, or a wheel whose shared libraries are missing
        raise RuntimeError(f"{INSTALL_HINT}. Import failed: {exc}") from exc
    return TransferEngine


def mooncake_available() -> bool:
    try:
        load_transfer_engine()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class PeerKV:
    """Where a CE's KV cache is, from its HelloAck."""

    session: str
    address: int
    block_bytes: int
    num_blocks: int


class MooncakePlane(DataPlane):
    name = "mooncake"
    carries_payload = False
    writes_in_place = True

    def __init__(self, host: str = "127.0.0.1"):
        transfer_engine = load_transfer_engine()
        env.set_mooncake_defaults(host)
        self._engine = transfer_engine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', 'tcp') returned {rc}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._kv: tuple[int, int, int] | None = None  # CE: (address, bytes per block, blocks) registered
        self._peer_kv: dict[str, PeerKV] = {}
        self._staging: np.ndarray | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pdinfer-kv-mooncake")

    # --- CE: our KV cache is the target -------------------------------------------------------------
    def register_kv_cache(self, kv) -> None:
        if kv.device.type != "cpu" or not kv.is_contiguous():
            raise ValueError(
                "the mooncake connector (TCP) writes into host memory: the KV cache must "
                f"be a contiguous CPU tensor, not one on {kv.device}"
            )
        address, nbytes = kv.data_ptr(), kv.numel() * kv.element_size()
        _check(self._engine.register_memory(address, nbytes), "register_memory (KV cache)")
        self._kv = (address, nbytes // kv.shape[0], kv.shape[0])

    def answer_hello(self, identity: bytes, hello: Hello, ack: HelloAck) -> str | None:
        if self._kv is None:
            return "KV cache not registered yet"
        ack.data_session = self.session_id
        ack.kv_address, ack.kv_block_bytes, ack.kv_num_blocks = self._kv
        return None

    def land(self, arrival, cache) -> str | None:
        """The PE wrote the blocks already: check what landed in our own memory (the push's size
        against its reserved blocks is the CE's own check, before landing)."""
        push = arrival.push
        blocks = [cache.kv[b].view(-1).view(torch.uint8).numpy() for b in push.block_ids]
        return (
            None if checksum_blocks(blocks) == push.checksum else "checksum mismatch: the K/V was corrupted in transit"
        )

    # --- PE: write, then push ------------------------------------------------------------------------
    def check_peer(self, address: str, ack: HelloAck) -> None:
        if not ack.data_session or not ack.kv_address or ack.kv_block_bytes <= 0:
            raise HandshakeError(
                f"{address} offers no Mooncake data plane (start it with the mooncake kv connector too)"
            )
        self._peer_kv[address] = PeerKV(ack.data_session, ack.kv_address, ack.kv_block_bytes, ack.kv_num_blocks)

    def send(self, address: str, push: KVPush, payload) -> None:
        self._writer.submit(self._write_then_push, address, push, payload)

    def abort(self, address: str, message: KVAbort) -> None:
        # Behind any write still going to that CE: its abort means "nothing more will be written".
        self._writer.submit(self.link.send_control, address, message)

    def _write_then_push(self, address: str, push: KVPush, payload) -> None:
        try:
            self._write(address, push, np.frombuffer(payload, dtype=np.uint8))
        except Exception as exc:  # noqa: BLE001 - reported to the engine as a refused push
            logger.warning("K/V write for transfer %s failed: %s", push.transfer_id, exc)
            self.link.send_control(address, KVAbort(transfer_id=push.transfer_id, request_id=push.request_id))
            self.link.post_event(KVAck(transfer_id=push.transfer_id, ok=False, error=str(exc)))
            return
        self.link.send_control(address, push)

    def _write(self, address: str, push: KVPush, data: np.ndarray) -> None:
        peer = self._peer_kv.get(address)
        if peer is None:
            raise RuntimeError(f"not connected to {address}")
        if data.nbytes > len(push.block_ids) * peer.block_bytes or any(
            not 0 <= b < peer.num_blocks for b in push.block_ids
        ):
            raise ValueError("the K/V does not fit the CE blocks it targets")
        staging = self._staging_buffer(data.nbytes)
        staging[: data.nbytes] = data
        sources, targets, lengths = [], [], []
        for index, first, count in block_runs(push.block_ids):
            offset = index * peer.block_bytes
            length = min(count * peer.block_bytes, data.nbytes - offset)
            if length <= 0:
                break
            sources.append(staging.ctypes.data + offset)
            targets.append(peer.address + first * peer.block_bytes)
            lengths.append(length)
        rc = self._engine.batch_transfer_sync_write(peer.session, sources, targets, lengths)
        if rc != 0:
            raise RuntimeError(f"Mooncake write of {data.nbytes} bytes to {peer.session} failed (rc={rc})")

    def _staging_buffer(self, nbytes: int) -> np.ndarray:
        """The registered buffer pushes are written from (writer thread only)."""
        old = self._staging
        if old is not None and old.nbytes >= nbytes:
            return old
        if old is not None:
            self._engine.unregister_memory(old.ctypes.data)
        size = max(nbytes, 2 * (old.nbytes if old is not None else 0), MIN_STAGING_BYTES)
        self._staging = None
        staging = np.empty(size, dtype=np.uint8)
        _check(self._engine.register_memory(staging.ctypes.data, size), "register_memory (staging)")
        self._staging = staging
        return staging

    def drain(self) -> None:
        """Before the control plane stops: a write in flight finishes before anything goes away."""
        self._writer.shutdown(wait=True)

    def close(self) -> None:
        # After this, writes aimed at our KV cache fail at the sender instead of landing.
        for buffer in (self._kv[0] if self._kv else None, self._staging):
            if buffer is not None:
                self._engine.unregister_memory(buffer if isinstance(buffer, int) else buffer.ctypes.data)
        self._kv, self._staging = None, None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"Mooncake {what} returned {rc}")


def MooncakeConnector(  # noqa: N802 - a transport's name, as the other connectors
    listen_host: str | None = None, listen_port: int = 0, *, host: str = "127.0.0.1", **control: Any
) -> TcpConnector:
    """The ZeroMQ control plane (``control``: ``TcpConnector``'s settings) with the Mooncake's data plane."""
    return TcpConnector(listen_host, listen_port, plane=MooncakePlane(host), **control)
