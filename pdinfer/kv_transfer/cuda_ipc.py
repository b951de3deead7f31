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

Control plane: the ZeroMQ one (``tcp.py``: handshake, layout check, shared secret, acks,
aborts), composed with this data plane (``CudaIpcPlane``). The Hello carries the PE's first
segment, so a CE that cannot map it refuses at the handshake.
Both processes must see both GPUs (don't isolate them with CUDA_VISIBLE_DEVICES; choose the
device with ``EngineArgs.device="cuda:N"``). On a CPU KV cache the pool is POSIX shared memory,
so the same code runs (and is tested) without a GPU.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from pdinfer.kv_transfer.protocol import Hello, HelloAck, KVPush
from pdinfer.kv_transfer.staging import (
    DEFAULT_STAGING_BYTES,
    StagedKV,
    StagingPlane,
    close_shm,
    land_blocks,
    open_segment,
    segment_info_decoder,
)
from pdinfer.kv_transfer.tcp import TcpConnector

logger = logging.getLogger("pdinfer")


class CudaIpcPlane(StagingPlane):
    name = "cuda_ipc"

    def __init__(self, device=None, staging_bytes: int = DEFAULT_STAGING_BYTES):
        super().__init__(device, staging_bytes)
        self._opened: dict[str, tuple[torch.Tensor, object]] = {}  # CE: segment key -> mapping

    # --- PE ------------------------------------------------------------------------------------------
    def prepare_connect(self) -> None:
        self.pool.first_segment()  # allocated here, not on the socket thread

    def hello_info(self) -> bytes:
        return self.pool.first_segment().info

    def send(self, address: str, push: KVPush, payload: StagedKV) -> None:
        push.staging_offset, push.staging_info = payload.offset, payload.segment.info
        self.pool.hold(push.transfer_id, payload)
        self.link.send_control(address, push)

    # --- CE ------------------------------------------------------------------------------------------
    def answer_hello(self, identity: bytes, hello: Hello, ack: HelloAck) -> str | None:
        try:
            info = segment_info_decoder.decode(hello.data_info)
        except msgspec.DecodeError:
            return f"the PE sent no staging segment for the {self.name} data plane"
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
            source[push.staging_offset : end], cache.kv, list(push.block_ids), self.pool.stream(cache.kv.device)
        )
        return None if got == push.checksum else "checksum mismatch: the K/V was corrupted in transit"

    def _open(self, data: bytes) -> torch.Tensor:
        info = segment_info_decoder.decode(data)
        if info.key not in self._opened:
            self._opened[info.key] = open_segment(info)
        return self._opened[info.key][0]

    def close(self) -> None:
        for _, shm in self._opened.values():
            if shm is not None:
                close_shm(shm)
        self._opened.clear()
        super().close()


def CudaIpcConnector(  # noqa: N802 - a transport's name, as the other connectors
    listen_host: str | None = None,
    listen_port: int = 0,
    *,
    device=None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    **control: Any,
) -> TcpConnector:
    """The ZeroMQ control plane (``control``: ``TcpConnector``'s settings) with the CUDA IPC data plane."""
    return TcpConnector(listen_host, listen_port, plane=CudaIpcPlane(device, staging_bytes), **control)
