"""Which store backs a location: memory, a directory, or a memory tier in front of a directory.
(Apart from ``store``, which the backends import for their base class.)"""

from __future__ import annotations

from pdinfer.kv_store.directory import DirectoryStore
from pdinfer.kv_store.memory import MemoryStore
from pdinfer.kv_store.store import DEFAULT_DIRECTORY_BYTES, DEFAULT_MEMORY_BYTES, MEMORY, KVStore, TieredStore


def open_store(
    location: str, namespace: str, block_size: int, max_bytes: int | None = None, memory_bytes: int = 0
) -> KVStore:
    """``location``: "memory", or a directory (created if missing; may be shared by processes
    and hosts). ``memory_bytes`` > 0 puts a memory tier of that size in front of a directory."""
    if location == MEMORY:
        return MemoryStore(namespace, block_size, max_bytes or memory_bytes or DEFAULT_MEMORY_BYTES)
    store: KVStore = DirectoryStore(location, namespace, block_size, max_bytes or DEFAULT_DIRECTORY_BYTES)
    if memory_bytes > 0:
        store = TieredStore(MemoryStore(namespace, block_size, memory_bytes), store)
    return store
