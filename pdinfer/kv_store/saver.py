"""Writes block copies to a store on one background thread, so saving never stalls a step.

The queue is bounded in bytes: when it is full a save is dropped (and counted), never waited
for. Each job holds a future of the K/V copy, which the engine queued behind its in-flight work.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pdinfer.kv_store.store import KVStore

logger = logging.getLogger("pdinfer")


@dataclass
class SaveJob:
    keys: list[bytes]
    copy: Future  # resolves to the blocks, in ``keys`` order
    nbytes: int


class BackgroundSaver:
    def __init__(self, store: KVStore, max_pending_bytes: int, to_payloads: Callable[[object], list]):
        """``to_payloads`` turns a resolved copy into one bytes-like payload per key."""
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self.to_payloads = to_payloads
        self.pending_bytes = 0
        self.saved_blocks = 0
        self.dropped_blocks = 0
        self.failed_blocks = 0
        self._jobs: deque[SaveJob | None] = deque()
        self._busy = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="pdinfer-kv-store", daemon=True)
        self._thread.start()

    def has_room(self, nbytes: int) -> bool:
        return self.pending_bytes + nbytes <= self.max_pending_bytes

    def submit(self, job: SaveJob) -> bool:
        with self._cond:
            if not self.has_room(job.nbytes):
                self.dropped_blocks += len(job.keys)
                return False
            self.pending_bytes += job.nbytes
            self._jobs.append(job)
            self._cond.notify_all()
        return True

    def drop(self, num_blocks: int) -> None:
        with self._cond:
            self.dropped_blocks += num_blocks

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._jobs.append(None)
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs))
                job = self._jobs.popleft()
                if job is None:
                    return
                self._busy = True
            written = 0
            try:
                payloads = self.to_payloads(job.copy.result())
                for key, payload in zip(job.keys, payloads, strict=True):
                    self.store.put(key, payload)
                    written += 1
            except Exception:  # noqa: BLE001 - a lost save costs a recompute, never a crash
                logger.exception("KV store: saving %d blocks failed", len(job.keys))
            with self._cond:
                self.saved_blocks += written
                self.failed_blocks += len(job.keys) - written
                self.pending_bytes -= job.nbytes
                self._busy = False
                self._cond.notify_all()
