"""The KV connector over NCCL point-to-point: K/V sent GPU to GPU by ``send``/``recv``.

Staging is a ``StagingPool``, as the CUDA IPC plane's: the PE copies a push's blocks into its device pool and
checksums them there. Then it sends the KVPush (no payload frame) and, behind it, posts a
``send`` of the staged region to the CE. The CE posts the matching ``recv`` into a receive
buffer as soon as it drains the push from the control channel (every push, in order, even one
it will refuse: point-to-point messages of a pair are matched in order), then, in step order,
copies the buffer into its reserved blocks, recomputes the checksum there and acks; the PE
frees the region on the ack (or its abort).

The pair forms a 2-rank process group at the handshake (CE rank 0, PE rank 1) through a
``TCPStore`` the CE hosts; its address rides in the HelloAck (``data_session``). Groups are
built directly (``ProcessGroupNCCL``; ``ProcessGroupGloo`` on a CPU KV cache, which the CPU
tests use), not through ``init_process_group``, so a CE can pair with several PEs and the
process keeps its default group (a DP group) free.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from pdinfer.kv_transfer.connector import Arrival, HandshakeError
from pdinfer.kv_transfer.protocol import Hello, HelloAck, KVPush
from pdinfer.kv_transfer.staging import DEFAULT_STAGING_BYTES, StagedKV, StagingPlane, land_blocks
from pdinfer.kv_transfer.tcp import TcpConnector

logger = logging.getLogger("pdinfer")

GROUP_TIMEOUT_S = 120.0
CE_RANK, PE_RANK = 0, 1


def make_pair_group(store, rank: int, device: torch.device, timeout_s: float = GROUP_TIMEOUT_S):
    """A 2-rank group over ``store``: NCCL for a CUDA device, gloo otherwise. Both ranks block
    here until the other arrives: gloo connects in its constructor; NCCL would connect at the
    first send/recv, so a one-element exchange does it now, at the handshake, and not inside a
    PE's step (where a CE that has not drained the push yet would leave it waiting)."""
    timeout = timedelta(seconds=timeout_s)
    if device.type != "cuda":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    cls = getattr(dist, "ProcessGroupNCCL", None)
    if cls is None:
        raise RuntimeError("this torch build has no NCCL (torch.distributed.ProcessGroupNCCL)")
    try:
        group = cls(store, rank, 2, timeout)
    except TypeError:  # builds that only take Options
        options = cls.Options()
        options._timeout = timeout  # noqa: SLF001 - the documented way to set it on Options
        group = cls(store, rank, 2, options)
    with torch.cuda.device(device):
        probe = torch.full((1,), rank, dtype=torch.int32, device=device)
        work = group.send([probe], CE_RANK, 0) if rank == PE_RANK else group.recv([probe], PE_RANK, 0)
        work.wait()
        torch.cuda.synchronize(device)
    if int(probe.item()) != PE_RANK:
        raise RuntimeError("the NCCL pair's first exchange returned the wrong value")
    return group


class NcclPlane(StagingPlane):
    name = "nccl"

    def __init__(self, device=None, staging_bytes: int = DEFAULT_STAGING_BYTES, listen_host: str | None = None):
        super().__init__(device, staging_bytes)
        self._store = None
        self._store_address = ""
        if listen_host is not None:  # CE: the rendezvous of every pair it forms
            from pdinfer.distributed.dp_group import host_store

            self._store = host_store(listen_host, 0, GROUP_TIMEOUT_S)  # bound to listen_host only
            self._store_address = f"{listen_host}:{self._store.port}"
        self._groups: dict[bytes, Future] = {}  # CE: PE identity -> its pair group
        self._received: dict[str, tuple[torch.Tensor, dist.Work]] = {}  # CE: transfer id -> (buffer, recv)
        self._draining: list[tuple[torch.Tensor, dist.Work]] = []  # CE: receives of refused pushes
        # PE: CE address -> pair group (a c10d Backend: Any, its stubs declare no send/recv)
        self._peer_groups: dict[str, Any] = {}
        self._sending: set[str] = set()  # PE: transfer ids whose send is in flight
        self._release_after_send: set[str] = set()  # PE: acked or aborted while still sending
        self._sends_lock = threading.Lock()
        self._send_queues: dict[int, queue.Queue] = {}  # PE: pair group -> its send waiter

    # --- handshake ----------------------------------------------------------------------------------
    def answer_hello(self, identity: bytes, hello: Hello, ack: HelloAck) -> str | None:
        key = f"pair-{uuid.uuid4().hex}"
        ack.data_session = f"{self._store_address}/{key}"
        future: Future = Future()
        self._groups[identity] = future  # a re-handshake (new identity) gets a new group
        threading.Thread(target=self._form_group, args=(key, future), daemon=True, name="pdinfer-kv-nccl-pair").start()
        return None

    def _form_group(self, key: str, future: Future) -> None:
        try:
            if self._store is None:  # a bug: only a listening connector (a CE) answers hellos
                raise RuntimeError("a pair group needs the CE's rendezvous store")
            future.set_result(make_pair_group(dist.PrefixStore(key, self._store), CE_RANK, self.device))
        except Exception as exc:  # noqa: BLE001 - reported when a push from that PE arrives
            future.set_exception(exc)

    def check_peer(self, address: str, ack: HelloAck) -> None:
        if not ack.data_session or "/" not in ack.data_session:
            raise HandshakeError(f"{address} offers no NCCL rendezvous (start it with the nccl kv connector)")
        where, key = ack.data_session.rsplit("/", 1)
        host, port = where.rsplit(":", 1)
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
            self._peer_groups[address] = make_pair_group(dist.PrefixStore(key, store), PE_RANK, self.device)
        except Exception as exc:  # noqa: BLE001 - a handshake that cannot form the group fails
            raise HandshakeError(f"cannot form the NCCL pair with {address}: {exc}") from exc

    # --- PE: control message, then the bytes --------------------------------------------------------
    def send(self, address: str, push: KVPush, payload: StagedKV) -> None:
        self.pool.hold(push.transfer_id, payload)
        self.link.send_control(address, push)
        group = self._peer_groups.get(address)
        if group is None or push.nbytes <= 0:
            return  # "not connected": the socket thread answers with a refusal
        data = payload.segment.data[payload.offset : payload.offset + payload.nbytes]
        with self._sends_lock:
            self._sending.add(push.transfer_id)
        self._waiter(group).put((push.transfer_id, group.send([data], CE_RANK, 0)))

    def _waiter(self, group) -> queue.Queue:
        """The queue of the thread that waits for ``group``'s sends, in the order they were posted
        (one thread per pair: a CE that never receives holds up only its own sends)."""
        key = id(group)
        if key not in self._send_queues:
            self._send_queues[key] = queue.Queue()
            threading.Thread(
                target=self._wait_sends, args=(self._send_queues[key],), daemon=True, name="pdinfer-kv-nccl-send"
            ).start()
        return self._send_queues[key]

    def _wait_sends(self, sends: queue.Queue) -> None:
        while (item := sends.get()) is not None:
            transfer_id, work = item
            done = self._wait_send(transfer_id, work)
            with self._sends_lock:
                self._sending.discard(transfer_id)
                release = done and transfer_id in self._release_after_send
                self._release_after_send.discard(transfer_id)
            if release:
                self.pool.release(transfer_id)

    def _wait_send(self, transfer_id: str, work) -> bool:
        """Wait for one send; False if it failed (its region then stays out of the pool)."""
        try:
            if self.device.type != "cuda":  # gloo: a send is complete only once waited for
                work.wait()
                return True
            deadline = time.monotonic() + GROUP_TIMEOUT_S  # NCCL: wait() would only order streams
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no matching receive in {GROUP_TIMEOUT_S:.0f} s")
                time.sleep(0.0002)
            return True
        except Exception as exc:  # noqa: BLE001 - reported; the region is never reused
            logger.warning(
                "KV send of transfer %s did not complete (%s): its staging region stays reserved", transfer_id, exc
            )
            return False

    def on_ack(self, transfer_id: str) -> None:
        """Free a push's region on its ack or abort, or, while its send is still in flight (an
        abort can come first), once the send completes: the region is reused only then."""
        with self._sends_lock:
            if transfer_id in self._sending:
                self._release_after_send.add(transfer_id)
                return
        self.pool.release(transfer_id)

    # --- CE: post every recv in order, land in step order --------------------------------------------
    def refused_push(self, identity: bytes, push: KVPush) -> Arrival | None:
        # The PE sends the bytes of every push it made: the pair's receives must stay matched to
        # its sends in order, so a refused push is still received (and dropped), in turn.
        limit = self.max_push_bytes or push.nbytes
        if identity in self._groups and 0 < push.nbytes <= limit:
            return Arrival(push=push, payload=b"", peer=identity, drain_only=True)
        return None

    def receive(self, arrivals: list[Arrival]) -> list[Arrival]:
        kept = []
        for arrival in arrivals:
            push, future = arrival.push, self._groups.get(cast(bytes, arrival.peer))  # the ROUTER identity
            if future is None or push.nbytes <= 0:
                if not arrival.drain_only:
                    kept.append(arrival)
                continue
            group = future.result(timeout=GROUP_TIMEOUT_S)
            buffer = torch.empty(push.nbytes, dtype=torch.uint8, device=self.device)
            work = group.recv([buffer], PE_RANK, 0)
            if arrival.drain_only:
                self._draining.append((buffer, work))
            else:
                self._received[push.transfer_id] = (buffer, work)
                kept.append(arrival)
        self._draining = [(buffer, work) for buffer, work in self._draining if not work.is_completed()]
        return kept

    def land(self, arrival, cache) -> str | None:
        push = arrival.push
        received = self._received.pop(push.transfer_id, None)
        if received is None:
            return "no NCCL pair with the prefill engine that sent this push"
        buffer, work = received
        work.wait()  # NCCL: the current stream waits for the recv; gloo: the host does
        got = land_blocks(buffer, cache.kv, list(push.block_ids), self.pool.stream(cache.kv.device))
        return None if got == push.checksum else "checksum mismatch: the K/V was corrupted in transit"

    def before_confirm(self, arrival, ok: bool) -> None:
        received = self._received.pop(arrival.push.transfer_id, None)
        if received is not None:  # refused before landing: let its bytes arrive, then drop them
            try:
                received[1].wait()
            except Exception as exc:  # noqa: BLE001 - refused anyway
                logger.warning("KV receive of a refused transfer failed: %s", exc)

    def close(self) -> None:
        for sends in self._send_queues.values():
            sends.put(None)
        super().close()


def NcclConnector(  # noqa: N802 - a transport's name, as the other connectors
    listen_host: str | None = None,
    listen_port: int = 0,
    *,
    device=None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    **control: Any,
) -> TcpConnector:
    """The ZeroMQ control plane (``control``: ``TcpConnector``'s settings) with the NCCL data plane."""
    return TcpConnector(listen_host, listen_port, plane=NcclPlane(device, staging_bytes, listen_host), **control)
