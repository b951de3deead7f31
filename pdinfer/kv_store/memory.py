"""An in-process LRU tier: block payloads in a dict, bounded in bytes. Thread-safe (the engine
thread reads while the background saver writes)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from pdinfer.kv_store.blockfile import check_key
from pdinfer.kv_store.store import KVStore


class MemoryStore(KVStore):
    def __init__(self, namespace: str, block_size: int, max_bytes: int):
        super().__init__(namespace, block_size, max_bytes)
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            payload = self._blocks.get(key)
            if payload is not None:
                self._blocks.move_to_end(key)
        if payload is None:
            self._count(misses=1)
        else:
            self._count(hits=1, bytes_read=len(payload))
        return payload

    def put(self, key: bytes, payload) -> bool:
        check_key(key)
        data = bytes(payload)
        if len(data) > self.max_bytes:
            return False
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return False
            self._blocks[key] = data
            self._bytes += len(data)
        self._count(puts=1, bytes_written=len(data))
        self.evict()
        return True

    def evict(self, max_bytes: int | None = None) -> int:
        limit = self.max_bytes if max_bytes is None else max_bytes
        freed = evicted = 0
        with self._lock:
            while self._bytes > limit and self._blocks:
                _, data = self._blocks.popitem(last=False)
                self._bytes -= len(data)
                freed += len(data)
                evicted += 1
        if evicted:
            self._count(evictions=evicted)
        return freed

    def size_bytes(self) -> int:
        return self._bytes
