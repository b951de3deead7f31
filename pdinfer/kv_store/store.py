"""The KV cache store: K/V of full blocks kept outside any engine, keyed by chained prefix hash.

Completion (and NORMAL) engines save the full blocks of finished sequences; prefill (and NORMAL)
engines load the longest stored run of a new prompt's blocks instead of recomputing it. DeepSeek
runs this on 3FS; the embedded default is a directory, which also works on a shared file system
across hosts, optionally with an in-memory LRU tier in front.

A key is the block's chained hash (``BlockManager``'s ``block_hashes``: equal hashes mean equal
prefixes). A block is only valid for the KV layout it was computed with (model, dtype, layers,
heads, head size, block size), so every store serves one layout, its ``namespace``.

Backends never raise for I/O trouble: a block they cannot read or verify is a miss, a block they
cannot write is not stored. No pickle anywhere: raw bytes behind a small binary header.
"""

from __future__ import annotations

import hashlib
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass

from pdinfer.core.block_manager import ROOT_HASH, chain_hashes

MEMORY = "memory"  # EngineArgs.kv_store value for a memory-only store
DEFAULT_DIRECTORY_BYTES = 16 << 30
DEFAULT_MEMORY_BYTES = 1 << 30


@dataclass
class StoreCounters:
    hits: int = 0  # get() that returned a block
    misses: int = 0  # get() that did not (absent, unreadable or corrupt)
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0  # blocks written
    evictions: int = 0  # blocks evicted to stay under the bound
    corrupt: int = 0  # blocks that failed verification (and were deleted)
    write_errors: int = 0


class KVStore(ABC):
    """A bounded map from block key to the raw K/V bytes of one block, for one KV layout."""

    def __init__(self, namespace: str, block_size: int, max_bytes: int):
        if block_size <= 0 or max_bytes <= 0:
            raise ValueError(f"need block_size > 0 and max_bytes > 0, got {block_size}, {max_bytes}")
        self.namespace = namespace
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.counters = StoreCounters()
        self._count_lock = threading.Lock()

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored (cheap; a later ``get`` may still miss)."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The verified payload of ``key``, or None."""

    @abstractmethod
    def put(self, key: bytes, payload) -> bool:
        """Store ``payload`` (bytes-like) under ``key``; False if it was already there or failed."""

    @abstractmethod
    def evict(self, max_bytes: int | None = None) -> int:
        """Drop least-recently-used blocks until at most ``max_bytes`` (default: the bound) are
        stored; returns the bytes freed."""

    @abstractmethod
    def size_bytes(self) -> int:
        """Bytes stored now (for a shared directory: as of the last scan plus own writes)."""

    def stats(self) -> dict[str, int]:
        with self._count_lock:
            values = asdict(self.counters)
        return {**values, "bytes": self.size_bytes(), "max_bytes": self.max_bytes}

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release what the backend holds."""

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def get_into(self, key: bytes, out: memoryview) -> bool:
        """Read the verified payload of ``key`` into ``out`` (exactly its size); False on a
        miss. Backends that can read straight into ``out`` override this."""
        payload = self.get(key)
        if payload is None or len(payload) != out.nbytes:
            return False
        out[:] = payload
        return True

    def stored_run(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (existence only; the key that ends
        the run counts as one miss)."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                self._count(misses=1)
                return i
        return len(keys)

    def read_run(self, keys: Sequence[bytes], outs: Sequence[memoryview], executor: Executor | None = None) -> int:
        """Read ``keys[i]`` into ``outs[i]``; returns how many from the first were read intact.
        With an ``executor`` the blocks are read in parallel (reads and checksums release the
        GIL)."""
        done = (executor.map if executor else map)(self.get_into, keys, outs)
        for i, ok in enumerate(done):
            if not ok:  # vanished or corrupt since the lookup: the run ends here
                return i
        return len(keys)

    def longest_stored_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` whose K/V a prefill could load from here: the longest run of
        stored full blocks from the start, leaving at least one token to compute (what an
        engine would reuse). Cheap: hashing and existence checks, no reads."""
        hashes = prefix_hashes(token_ids, self.block_size, (len(token_ids) - 1) // self.block_size)
        stored = 0
        for key in hashes:
            if not self.contains(key):
                break
            stored += 1
        return stored * self.block_size


def prefix_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Chained hashes of the first ``num_blocks`` full blocks (the block manager's keys)."""
    return chain_hashes(ROOT_HASH, token_ids[: max(0, num_blocks) * block_size], block_size)


def layout_namespace(layout) -> str:
    """A readable directory-safe name for a ``KVLayout``, covering all of its fields."""
    fields = {name: getattr(layout, name) for name in layout.__struct_fields__}
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=6).hexdigest()
    return f"{layout.model}-{layout.dtype}-b{layout.block_size}-{digest}"


class TieredStore(KVStore):
    """A fast tier (memory) in front of a shared one (directory): reads fill the front, writes go
    through to the back, which is the truth other processes see."""

    def __init__(self, front: KVStore, back: KVStore):
        super().__init__(back.namespace, back.block_size, back.max_bytes)
        self.front, self.back = front, back

    def contains(self, key: bytes) -> bool:
        return self.front.contains(key) or self.back.contains(key)

    def get(self, key: bytes) -> bytes | None:
        payload = self.front.get(key)
        if payload is None:
            payload = self.back.get(key)
            if payload is not None:
                self.front.put(key, payload)
        return payload

    def get_into(self, key: bytes, out: memoryview) -> bool:
        payload = self.front.get(key)
        if payload is not None and len(payload) == out.nbytes:
            out[:] = payload
            return True
        if not self.back.get_into(key, out):
            return False
        self.front.put(key, out)
        return True

    def put(self, key: bytes, payload) -> bool:
        written = self.back.put(key, payload)
        self.front.put(key, payload)
        return written

    def evict(self, max_bytes: int | None = None) -> int:
        return self.front.evict(max_bytes) + self.back.evict(max_bytes)

    def size_bytes(self) -> int:
        return self.back.size_bytes()

    def stats(self) -> dict[str, int]:
        front, back = self.front.stats(), self.back.stats()
        merged = dict(back)
        merged["hits"] = front["hits"] + back["hits"]  # a front miss that the back serves is a hit
        merged.update({f"memory_{name}": value for name, value in front.items()})
        with self._count_lock:  # what the tiered view counted itself (get_run's misses)
            for name, value in asdict(self.counters).items():
                merged[name] += value
        return merged

    def close(self) -> None:
        self.front.close()
        self.back.close()
