"""The KV connector over CUDA IPC: processes on one host, K/V copied device to device.

Data plane. The PE owns a staging pool (``staging.py``) on its GPU (one segment of ``staging_bytes`` at first,
another one added when a push finds no room) and never writes into the CE's memory. A push:
the PE copies the request's blocks into a region of the pool on a side stream, after the step
that wrote them, and computes ``kv_checksum`` there (``stage_blocks``); once that copy is done
it sends the KVPush with no payload frame, naming the segment (its IPC handle, ``staging_info``)
and the offset. The CE maps the segment (once), copies the region into its reserved blocks (a
peer copy GPU0 -> GPU1), recomputes the checksum over its blocks, and acks. The PE frees the
region on the ack, or when it aborts the push (lease expiry included): a late CE copy then
reads changed bytes, fails the checksum and is refused.

Control plane: ``TcpConnector`` (handshake, layout check, shared secret, acks, aborts). The
Hello carries the PE's first segment, so a CE that cannot map it refuses at the handshake.
Both processes must see both GPUs (don't isolate them with CUDA_VISIBLE_DEVICES; choose the
device with ``EngineArgs.device="cuda:N"``). On a CPU KV cache the pool is POSIX shared memory,
so the same code runs (and is tested) without a GPU.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import msgspec
import torch

from pdinfer.kv_transfer.connector import DEFAULT_HANDSHAKE_TIMEOUT_S
from pdinfer.kv_transfer.protocol import Hello, HelloAck, KVAbort, KVAck, KVPush
from pdinfer.kv_transfer.staging import (
    DEFAULT_STAGING_BYTES,
    Segment,
    StagedKV,
    close_shm,
    land_blocks,
    open_segment,
    segment_info_decoder,
    stage_into,
)
from pdinfer.kv_transfer.tcp import TcpConnector

logger = logging.getLogger("pdinfer")


# --- the connector ----------------------------------------------------------------------------------
class CudaIpcConnector(TcpConnector):
    data_plane = "cuda_ipc"
    device_payload = True  # pushes carry no bytes: the CE calls ``land`` to fetch and check them

    def __init__(
        self,
        listen_host: str | None = None,
        listen_port: int = 0,
        secret: str | None = None,
        engine_type: int = 0,
        device=None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        max_push_blocks: int = 0,
        bytes_per_block: int = 0,
    ):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.staging_bytes = staging_bytes
        self.segments: list[Segment] = []
        self._segments_lock = threading.Lock()
        self._regions: dict[str, StagedKV] = {}  # PE: transfer id -> region until ack or abort
        self._regions_lock = threading.Lock()
        self._opened: dict[str, tuple[torch.Tensor, object]] = {}  # CE: segment key -> mapping
        self._streams: dict[torch.device, object] = {}
        super().__init__(
            listen_host,
            listen_port,
            secret=secret,
            engine_type=engine_type,
            max_push_blocks=max_push_blocks,
            bytes_per_block=bytes_per_block,
        )

    # --- PE ------------------------------------------------------------------------------------------
    def start_connect(self, address: str, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> Future:
        self._first_segment()  # allocated here, not on the socket thread
        return super().start_connect(address, timeout_s)

    def _hello(self) -> Hello:
        hello = super()._hello()
        hello.data_info = self._first_segment().info
        return hello

    def _first_segment(self) -> Segment:
        with self._segments_lock:
            if not self.segments:
                self.segments.append(Segment(self.staging_bytes, self.device))
            return self.segments[0]

    def stage_blocks(self, cache, block_ids: list[int]) -> StagedKV:
        """Step thread, after the forward that wrote the blocks: copy them into the pool."""
        nbytes = len(block_ids) * cache.bytes_per_block
        segment, offset = self._place(nbytes)
        return stage_into(segment, offset, cache.kv, list(block_ids), self._stream(cache.kv.device))

    def _place(self, nbytes: int) -> tuple[Segment, int]:
        self._first_segment()
        with self._segments_lock:
            for segment in self.segments:
                offset = segment.allocator.alloc(nbytes)
                if offset is not None:
                    return segment, offset
            # Full (pushes in flight): another segment; the CE maps it from the push's info.
            segment = Segment(max(self.staging_bytes, 2 * nbytes), self.device)
            self.segments.append(segment)
            logger.info(
                "KV staging: segment %d of %.0f MiB added (%.0f MiB in flight)",
                len(self.segments),
                segment.data.numel() / 2**20,
                sum(s.allocator.used_bytes for s in self.segments) / 2**20,
            )
            offset = segment.allocator.alloc(nbytes)
            if offset is None:  # a bug: the new segment holds at least 2 * nbytes
                raise RuntimeError(f"a fresh staging segment cannot hold {nbytes} bytes")
            return segment, offset

    def send(self, address: str, push: KVPush, payload: StagedKV) -> None:
        push.staging_offset, push.staging_info = payload.offset, payload.segment.info
        with self._regions_lock:
            self._regions[push.transfer_id] = payload
        self._command(("send", address, [self._seal(address, push)]))

    def abort(self, address: str, message: KVAbort) -> None:
        super().abort(address, message)
        self._release(message.transfer_id)

    def _on_ack(self, ack: KVAck) -> None:
        self._release(ack.transfer_id)

    def events(self) -> list:
        events = super().events()
        for event in events:  # acks made up locally ("not connected") skip _on_ack
            if isinstance(event, KVAck):
                self._release(event.transfer_id)
        return events

    def _release(self, transfer_id: str) -> None:
        with self._regions_lock:
            staged = self._regions.pop(transfer_id, None)
        if staged is not None:
            staged.release()

    @property
    def staged_bytes(self) -> int:
        return sum(s.allocator.used_bytes for s in self.segments)

    # --- CE ------------------------------------------------------------------------------------------
    def _answer_hello(self, identity: bytes, hello: Hello) -> HelloAck:
        ack = super()._answer_hello(identity, hello)
        if not ack.ok:
            return ack
        error = self._check_segment(hello.data_info)
        if error is not None:
            return self._refuse_hello(identity, hello, error)
        return ack

    def _check_segment(self, data: bytes) -> str | None:
        try:
            info = segment_info_decoder.decode(data)
        except msgspec.DecodeError:
            return f"the PE sent no staging segment for the {self.data_plane} data plane"
        if (info.kind == "cuda") != (self.device.type == "cuda"):
            return f"the PE stages K/V in {info.kind} memory, this CE's KV cache is on {self.device}"
        if info.kind == "cuda" and info.device >= torch.cuda.device_count():
            return (
                f"the PE's staging is on GPU {info.device}, the CE sees {torch.cuda.device_count()} "
                "GPU(s): don't hide GPUs with CUDA_VISIBLE_DEVICES"
            )
        return None

    def land(self, arrival, cache) -> str | None:
        """Step thread: copy a push's staged blocks into our reserved blocks and check them
        there; returns why they were refused, or None."""
        push = arrival.push
        try:
            source = self._open(push.staging_info)
        except Exception as exc:  # noqa: BLE001 - refused with the reason
            return f"cannot map the prefill engine's staging memory: {exc}"
        end = push.staging_offset + push.nbytes
        if push.staging_offset < 0 or end > source.numel():
            return "the staging region is outside the prefill engine's pool"
        got = land_blocks(
            source[push.staging_offset : end], cache.kv, list(push.block_ids), self._stream(cache.kv.device)
        )
        return None if got == push.checksum else "checksum mismatch: the K/V was corrupted in transit"

    def _open(self, data: bytes) -> torch.Tensor:
        info = segment_info_decoder.decode(data)
        if info.key not in self._opened:
            self._opened[info.key] = open_segment(info)
        return self._opened[info.key][0]

    # --- both ----------------------------------------------------------------------------------------
    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def close(self) -> None:
        if not self._running:
            return
        super().close()
        for _, shm in self._opened.values():
            if shm is not None:
                close_shm(shm)
        self._opened.clear()
        for segment in self.segments:
            segment.close()
        self.segments = []
