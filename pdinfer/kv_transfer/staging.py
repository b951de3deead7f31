"""The staging pool of the device KV transports (cuda_ipc, nccl), and their checksum.

A PE copies a push's blocks into a region of a pool segment on its own device (``stage_into``),
after the step that wrote them, and checksums them there (``kv_checksum``, bit-identical on any
device); the CE copies them into its reserved blocks and checks them again (``land_blocks``).
A segment is device memory that another process can map through a CUDA IPC handle
(``export_cuda`` / ``open_segment``), or POSIX shared memory for a CPU KV cache, so the same
code runs without a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from multiprocessing import resource_tracker, shared_memory

import msgspec
import torch

from pdinfer.kv_transfer.data_plane import DataPlane
from pdinfer.kv_transfer.protocol import KVAbort, block_runs

logger = logging.getLogger("pdinfer")

DEFAULT_STAGING_BYTES = 1 << 30
CHECKSUM_MODULUS = 2**31 - 1
ALIGN_BYTES = 512


# --- checksum and block copies ----------------------------------------------------------------------
def block_sums(blocks: torch.Tensor) -> torch.Tensor:
    """[n] int64: the sum of each block's bytes read as int32 (``blocks`` is [n, ...])."""
    return blocks.reshape(blocks.shape[0], -1).view(torch.uint8).view(torch.int32).sum(dim=1, dtype=torch.int64)


def kv_checksum(sums: torch.Tensor) -> torch.Tensor:
    """Per-block sums weighted by position (reordered blocks change it); every step modulo a
    prime, so int64 never overflows and two devices agree bit for bit."""
    weights = torch.arange(1, sums.shape[0] + 1, dtype=torch.int64, device=sums.device)
    weighted = (sums.remainder(CHECKSUM_MODULUS) * weights).remainder(CHECKSUM_MODULUS)
    return weighted.sum().remainder(CHECKSUM_MODULUS)


def land_blocks(src: torch.Tensor, kv: torch.Tensor, block_ids: list[int], stream) -> int:
    """Copy staged blocks ``src`` (flat uint8, any device) into ``kv[block_ids]``; returns
    kv_checksum over the blocks as they now are in ``kv`` (waits for the copy)."""
    blocks = src.view(kv.dtype).view(len(block_ids), *kv.shape[1:])
    if stream is None:
        for index, first, count in block_runs(block_ids):
            kv[first : first + count].copy_(blocks[index : index + count])
        return int(_checksum_of(kv, block_ids))
    # After every step already queued: a reserved block may still be read or written by a step
    # in flight for its previous owner.
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        for index, first, count in block_runs(block_ids):
            kv[first : first + count].copy_(blocks[index : index + count], non_blocking=True)
        checksum = _checksum_of(kv, block_ids)
        event = torch.cuda.Event()
        event.record(stream)
    event.synchronize()
    return int(checksum)


def _checksum_of(kv: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    return kv_checksum(torch.cat([block_sums(kv[first : first + count]) for _, first, count in block_runs(block_ids)]))


# --- the staging pool -------------------------------------------------------------------------------
class RegionAllocator:
    """First-fit byte ranges of one segment (thread-safe: regions are freed on the socket thread)."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted and coalesced
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        need = max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        with self._lock:
            for i, (offset, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + need, length - need)
                    self._used[offset] = need
                    return offset
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            length = self._used.pop(offset, None)
            if length is None:
                return  # already free: an ack and an abort may both arrive
            merged: list[tuple[int, int]] = []
            for start, size in sorted([*self._free, (offset, length)]):
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((start, size))
            self._free = merged

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())


class SegmentInfo(msgspec.Struct, frozen=True):
    """How another process maps a staging segment: CUDA IPC handle fields, or a shared-memory name."""

    kind: str  # "cuda" or "shm"
    key: str
    pid: int
    nbytes: int
    name: str = ""
    device: int = -1
    handle: bytes = b""
    storage_size: int = 0
    storage_offset: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False


segment_info_decoder = msgspec.msgpack.Decoder(SegmentInfo)
_LOCAL_SEGMENTS: dict[str, torch.Tensor] = {}  # a process cannot open its own IPC handle


class Segment:
    def __init__(self, nbytes: int, device: torch.device):
        self.key = uuid.uuid4().hex
        self._shm = None
        if device.type == "cuda":
            self.data = torch.empty(nbytes, dtype=torch.uint8, device=device)
            info = export_cuda(self.data, self.key)
        else:
            self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
            self.data = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
            info = SegmentInfo(kind="shm", key=self.key, pid=os.getpid(), nbytes=nbytes, name=self._shm.name)
        self.info = msgspec.msgpack.encode(info)
        self.allocator = RegionAllocator(nbytes)
        _LOCAL_SEGMENTS[self.key] = self.data

    def close(self) -> None:
        _LOCAL_SEGMENTS.pop(self.key, None)
        del self.data  # a closed segment has no memory
        if self._shm is not None:
            self._shm.unlink()
            close_shm(self._shm)


def close_shm(shm) -> None:
    try:
        shm.close()
    except BufferError:  # a tensor still views it: the mapping goes with the last one
        pass


def export_cuda(data: torch.Tensor, key: str) -> SegmentInfo:
    """The IPC handle of a CUDA tensor's memory, through torch's own (private) sharing API."""
    from torch.multiprocessing.reductions import reduce_tensor

    try:
        _, args = reduce_tensor(data)
    except Exception as exc:  # noqa: BLE001 - one clear message for a private API
        raise RuntimeError(f"cannot export a CUDA IPC handle with this torch ({torch.__version__}): {exc}") from exc
    (device, handle, storage_size, storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args[6:15]
    return SegmentInfo(
        kind="cuda",
        key=key,
        pid=os.getpid(),
        nbytes=data.numel(),
        device=device,
        handle=handle,
        storage_size=storage_size,
        storage_offset=storage_offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=bool(event_sync),
    )


def open_segment(info: SegmentInfo):
    """Map a peer's segment: (flat uint8 tensor, object that keeps the mapping open or None)."""
    local = _LOCAL_SEGMENTS.get(info.key) if info.pid == os.getpid() else None
    if local is not None:
        return local, None
    if info.kind == "shm":
        shm = shared_memory.SharedMemory(name=info.name)
        # Python < 3.13 registers attached segments too and would unlink the PE's at our exit.
        # (_name, the name with its leading "/", is private: not in the stubs.)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # noqa: SLF001
        return torch.frombuffer(shm.buf, dtype=torch.uint8, count=info.nbytes), shm
    if info.device >= torch.cuda.device_count():
        raise RuntimeError(
            f"the PE's staging is on GPU {info.device}, this process sees "
            f"{torch.cuda.device_count()} GPU(s): don't hide GPUs with CUDA_VISIBLE_DEVICES"
        )
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        data = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([info.nbytes]),
            (1,),
            0,
            torch.UntypedStorage,
            torch.uint8,
            info.device,
            info.handle,
            info.storage_size,
            info.storage_offset,
            False,
            info.ref_counter_handle,
            info.ref_counter_offset,
            info.event_handle,
            info.event_sync_required,
        )
    except Exception as exc:  # noqa: BLE001 - one clear message for a private API
        raise RuntimeError(
            f"cannot open the PE's CUDA IPC handle with this torch ({torch.__version__}): {exc}"
        ) from exc
    return data, None


class StagedKV:
    """A push's blocks in a staging region. ``finish`` waits for the copy and its checksum."""

    def __init__(self, segment: Segment, offset: int, nbytes: int, event, checksum):
        self.segment, self.offset, self.nbytes = segment, offset, nbytes
        self.event, self._checksum = event, checksum
        self.released = False

    def finish(self) -> tuple[StagedKV, int, int]:
        """(payload for ``send``, bytes, checksum), once the staging copy is done."""
        if self.event is not None:
            self.event.synchronize()
        return self, self.nbytes, int(self._checksum)

    def release(self) -> None:
        """Give the region back (after the staging copy: it reads the PE's blocks)."""
        if not self.released:
            self.released = True
            if self.event is not None:
                self.event.synchronize()
            self.segment.allocator.free(self.offset)


def stage_into(segment: Segment, offset: int, kv: torch.Tensor, block_ids: list[int], stream) -> StagedKV:
    """Copy ``kv[block_ids]`` into the segment at ``offset`` and checksum them there; on CUDA
    on ``stream``, after the work already queued on the current stream."""
    n = len(block_ids)
    nbytes = n * kv[0].numel() * kv.element_size()
    region = segment.data[offset : offset + nbytes].view(kv.dtype).view(n, *kv.shape[1:])
    if stream is None:
        for dst, src, count in block_runs(block_ids):
            region[dst : dst + count].copy_(kv[src : src + count])
        return StagedKV(segment, offset, nbytes, None, kv_checksum(block_sums(region)).item())
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        for dst, src, count in block_runs(block_ids):
            region[dst : dst + count].copy_(kv[src : src + count], non_blocking=True)
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(kv_checksum(block_sums(region)), non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return StagedKV(segment, offset, nbytes, event, host)


class StagingPool:
    """A PE's staging segments on its device, and the regions of transfers in flight (freed on
    the transfer's ack or abort). Segment 0 is made before the first handshake (its info rides
    in the Hello); another one is added when a push finds no room."""

    def __init__(self, device: torch.device, staging_bytes: int = DEFAULT_STAGING_BYTES):
        self.device, self.staging_bytes = device, staging_bytes
        self.segments: list[Segment] = []
        self._segments_lock = threading.Lock()
        self._regions: dict[str, StagedKV] = {}  # transfer id -> region until ack or abort
        self._regions_lock = threading.Lock()
        self._streams: dict[torch.device, object] = {}

    def first_segment(self) -> Segment:
        with self._segments_lock:
            if not self.segments:
                self.segments.append(Segment(self.staging_bytes, self.device))
            return self.segments[0]

    def stage(self, cache, block_ids: list[int]) -> StagedKV:
        """Step thread, after the forward that wrote the blocks: copy them into the pool."""
        nbytes = len(block_ids) * cache.bytes_per_block
        segment, offset = self._place(nbytes)
        return stage_into(segment, offset, cache.kv, list(block_ids), self.stream(cache.kv.device))

    def _place(self, nbytes: int) -> tuple[Segment, int]:
        self.first_segment()
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

    def hold(self, transfer_id: str, staged: StagedKV) -> None:
        """The region stays taken until ``release(transfer_id)``."""
        with self._regions_lock:
            self._regions[transfer_id] = staged

    def release(self, transfer_id: str) -> None:
        with self._regions_lock:
            staged = self._regions.pop(transfer_id, None)
        if staged is not None:
            staged.release()

    @property
    def staged_bytes(self) -> int:
        return sum(s.allocator.used_bytes for s in self.segments)

    def stream(self, device: torch.device):
        """A side stream per CUDA device (None on CPU)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def close(self) -> None:
        for segment in self.segments:
            segment.close()
        self.segments = []


class StagingPlane(DataPlane):
    """What the device data planes (cuda_ipc, nccl) share: the PE stages a push's blocks in a
    ``StagingPool`` on its device and frees the region on the transfer's ack or abort."""

    carries_payload = False

    def __init__(self, device=None, staging_bytes: int = DEFAULT_STAGING_BYTES):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pool = StagingPool(self.device, staging_bytes)

    def stage(self, cache, block_ids: list[int]) -> StagedKV:
        return self.pool.stage(cache, block_ids)

    def abort(self, address: str, message: KVAbort) -> None:
        self.link.send_control(address, message)
        self.on_ack(message.transfer_id)

    def on_ack(self, transfer_id: str) -> None:
        self.pool.release(transfer_id)

    @property
    def staged_bytes(self) -> int:
        return self.pool.staged_bytes

    def close(self) -> None:
        self.pool.close()
