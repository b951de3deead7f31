"""Reads runs of stored blocks into host memory, in parallel, a chunk at a time.

Reads and checksums release the GIL, so the blocks of a chunk are read by a few threads. On CUDA
the chunks land in two pinned staging buffers, allocated once and used in turn: the
host-to-device copy of one chunk overlaps the reads of the next, and a buffer is refilled only
after the write that copies it out has finished.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pdinfer.kv_store.store import KVStore
from pdinfer.worker.cache_engine import CacheEngine

READ_THREADS = min(8, max(4, os.cpu_count() or 1))
STAGING_BYTES = 256 << 20  # CUDA: each of the two pinned staging buffers


class BlockLoader:
    def __init__(self, store: KVStore, cache: CacheEngine, max_blocks: int):
        self.store, self.cache = store, cache
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="pdinfer-kv-load")
        self.staging: list[torch.Tensor] = []
        self.busy: list[Future | None] = []
        self.chunk_blocks = max(1, max_blocks)
        if cache.device.type == "cuda":
            self.chunk_blocks = max(1, min(max_blocks, STAGING_BYTES // cache.bytes_per_block))
            self.staging = [self._host(self.chunk_blocks, pin=True) for _ in range(2)]
            self.busy = [None, None]
        self._turn = 0

    def chunks(self, keys: list[bytes]) -> Iterator[tuple[torch.Tensor, list[bytes]]]:
        """(blocks ``[n, *block_shape]``, their keys) for the longest run of ``keys``, from the
        first, that reads intact. Hand each chunk's write to ``hold`` before taking the next."""
        for i in range(0, len(keys), self.chunk_blocks):
            chunk = keys[i : i + self.chunk_blocks]
            staging = self._buffer(len(chunk))
            flat, size = staging.view(-1).view(torch.uint8).numpy(), self.cache.bytes_per_block
            outs = [flat[j * size : (j + 1) * size].data for j in range(len(chunk))]
            read = self.store.read_run(chunk, outs, self.readers)
            if read:
                yield staging[:read], chunk[:read]
            if read < len(chunk):
                return

    def hold(self, write: Future) -> None:
        """``write`` reads the last chunk's buffer until it completes."""
        if self.staging:
            self.busy[self._turn] = write
            self._turn ^= 1

    def _buffer(self, num_blocks: int) -> torch.Tensor:
        if not self.staging:
            return self._host(num_blocks, pin=False)
        write = self.busy[self._turn]
        if write is not None:
            write.result()
            self.busy[self._turn] = None
        return self.staging[self._turn][:num_blocks]

    def _host(self, num_blocks: int, pin: bool) -> torch.Tensor:
        return torch.empty((num_blocks, *self.cache.block_shape), dtype=self.cache.dtype, pin_memory=pin)

    def close(self) -> None:
        self.readers.shutdown()
