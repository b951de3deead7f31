"""The engine's side of the KV store (``engine.kv_store``).

Load (PROMPT and NORMAL), once per new waiting sequence, before ``schedule()``: beyond the prefix
the local prefix cache already holds, read the longest run of consecutive stored blocks
(at least one token stays to compute), write them into freshly taken blocks through the step
executor (so the write lands before the next forward) and publish those blocks as cached and
free. The scheduler's ordinary ``lookup_prefix`` then takes them: ``num_cached_tokens`` counts
them and only the rest of the prompt is computed.

Save (COMPLETION and NORMAL), from ``do_save_kvcache``: the full blocks of finished sequences
(and, with ``save_interval_tokens``, of running ones every that many tokens) that the store does
not hold yet. The copy is queued on the step executor behind the work in flight, so it is taken
before ``finalize_seq`` frees the blocks and before any later step reuses them (K/V of a full
block never changes once written); a background thread writes it to the store.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdinfer.kv_store.backends import open_store
from pdinfer.kv_store.loader import BlockLoader
from pdinfer.kv_store.saver import BackgroundSaver, SaveJob
from pdinfer.kv_store.store import KVStore, layout_namespace
from pdinfer.sequence import Sequence

if TYPE_CHECKING:
    from pdinfer.config import EngineArgs
    from pdinfer.core.block_manager import BlockManager
    from pdinfer.core.scheduler import Scheduler
    from pdinfer.kv_transfer.protocol import KVLayout
    from pdinfer.worker.cache_engine import CacheEngine
    from pdinfer.worker.executor import StepExecutor

logger = logging.getLogger("pdinfer")

MIN_PENDING_SAVE_BYTES = 256 << 20  # saves waiting for the store: at least this much...
MAX_PENDING_SAVE_BYTES = 4 << 30  # ...and room for one longest sequence, up to this much
_SAVE_CHUNK_BLOCKS = 64  # one copy + job per this many blocks: a long sequence saves in part
_KNOWN_KEYS = 1 << 16  # keys known to be stored: saves skip them without asking the store...
_KNOWN_TTL_S = 10.0  # ...for this long (the store may evict them meanwhile)


@dataclass(frozen=True)
class StoreSite:
    """What the agent works with, from its engine: the blocks and their cache, the scheduler
    (its queues), the step executor (copies in step order), and the role's policy
    (``Role.loads_kv_store``, ``saves_kv_store``)."""

    block_manager: BlockManager
    cache: CacheEngine
    scheduler: Scheduler
    executor: StepExecutor
    loads: bool
    saves: bool


class KVStoreAgent:
    def __init__(
        self,
        site: StoreSite,
        store: KVStore,
        save_interval_tokens: int = 0,
        max_pending_save_bytes: int | None = None,
    ):
        self.store = store
        self.block_manager, self.cache = site.block_manager, site.cache
        self.scheduler, self.executor = site.scheduler, site.executor
        self.block_size = self.block_manager.block_size
        self.save_interval_tokens = save_interval_tokens
        # A CE never prefills, so never loads; a PE's prompts are saved by their CE. Loaded
        # blocks reach a prefill only through the prefix cache.
        self.loads = site.loads and self.block_manager.enable_prefix_caching
        if site.loads and not self.loads:
            logger.warning("KV store: prefix caching is off, so this engine never loads from the store")
        max_blocks = self.block_manager.blocks_for(self.scheduler.config.max_model_len)
        self.loader = BlockLoader(store, self.cache, max_blocks) if self.loads else None
        self.saver = None
        if site.saves:
            if max_pending_save_bytes is None:
                max_pending_save_bytes = min(
                    MAX_PENDING_SAVE_BYTES, max(MIN_PENDING_SAVE_BYTES, max_blocks * self.cache.bytes_per_block)
                )
            self.saver = BackgroundSaver(store, max_pending_save_bytes, self._payloads)
        self._looked_up: set[int] = set()  # waiting sequences already looked up
        self._saved_upto: dict[int, int] = {}  # running sequence -> leading blocks saved
        self._known: OrderedDict[bytes, float] = OrderedDict()  # key -> when it was seen stored
        self.loaded_blocks = 0
        self.loaded_requests = 0
        self.load_seconds = 0.0  # engine-thread time spent looking up and reading the store

    @classmethod
    def create(cls, args: EngineArgs, layout: Callable[[], KVLayout], site: StoreSite) -> KVStoreAgent | None:
        """The agent ``args.kv_store`` asks for, or None; ``layout``: the engine's K/V layout
        (the store's namespace: engines of another layout never share blocks)."""
        if not args.kv_store:
            return None
        store = open_store(
            args.kv_store,
            layout_namespace(layout()),
            site.block_manager.block_size,
            args.kv_store_bytes,
            args.kv_store_memory_bytes,
        )
        logger.info("KV store %s (%s)", args.kv_store, store.namespace)
        return cls(site, store, args.kv_store_save_interval_tokens)

    # --- load ------------------------------------------------------------------------------------
    def load_waiting(self) -> None:
        """Load stored prefixes of new waiting sequences, in queue order, for about one step's
        worth of prompt tokens (what the scheduler will take next)."""
        loader = self.loader  # None unless self.loads
        if loader is None:
            return
        scheduler = self.scheduler
        self._looked_up &= {seq.seq_id for seq in scheduler.waiting}
        budget = scheduler.config.max_num_batched_tokens
        for seq in list(scheduler.waiting):
            if budget <= 0:
                break
            if seq.block_table or seq.num_computed_tokens or seq.num_pending_tokens or seq.needs_prompt_logprobs:
                continue  # a chunked prefill under way, not settled yet, or taking no cached prefix
            if seq.seq_id in self._looked_up or seq.num_tokens > scheduler.config.prompt_limit:
                continue
            self._looked_up.add(seq.seq_id)
            start = time.perf_counter()
            budget -= seq.num_tokens - self._load(seq, loader)
            self.load_seconds += time.perf_counter() - start

    def _load(self, seq: Sequence, loader: BlockLoader) -> int:
        """Load what the store adds to the local prefix of ``seq``; returns the tokens cached now."""
        bm, bs = self.block_manager, self.block_size
        hashes = bm.hash_full_blocks(seq, (seq.num_tokens - 1) // bs * bs)
        local = bm.lookup_prefix(seq)
        start = len(local)
        pinned = bm.share(local)  # keep our own prefix out of the blocks we are about to take
        loaded = 0
        try:
            keys = hashes[start : start + bm.num_free_blocks]
            for blocks, chunk_keys in loader.chunks(keys[: self.store.stored_run(keys)]):
                loader.hold(self._write(blocks, chunk_keys))
                loaded += len(chunk_keys)
            self.loaded_requests += int(loaded > 0)
        finally:
            bm.free_blocks(pinned)
        return (start + loaded) * bs

    def _write(self, blocks: torch.Tensor, keys: list[bytes]) -> Future:
        bm, cache = self.block_manager, self.cache
        block_ids = bm.allocate_blocks(len(keys))
        # In step order: after any step or copy still using these blocks, before the next forward.
        write = self.executor.submit_call(cache.write_blocks, block_ids, blocks)
        bm.adopt_cached_blocks(block_ids, keys)
        self.loaded_blocks += len(block_ids)
        for key in keys:
            self._remember(key)
        return write

    # --- save ------------------------------------------------------------------------------------
    def save(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        """Queue the unsaved full blocks of ``finished`` (and of long ``scheduled``) sequences."""
        if self.saver is None:
            return
        jobs = [(seq, self._saved_upto.pop(seq.seq_id, 0)) for seq in finished]
        if self.save_interval_tokens:
            for seq in scheduled:
                done = self._saved_upto.get(seq.seq_id, 0)
                if (
                    not seq.is_finished
                    and seq.num_computed_tokens - done * self.block_size >= self.save_interval_tokens
                ):
                    jobs.append((seq, done))
        block_ids, keys = self._unsaved_blocks(jobs)
        if len(self._saved_upto) > 2 * self.scheduler.config.max_num_seqs:
            running = {seq.seq_id for seq in self.scheduler.running}
            self._saved_upto = {k: v for k, v in self._saved_upto.items() if k in running}
        for i in range(0, len(block_ids), _SAVE_CHUNK_BLOCKS):  # leading blocks first
            ids, chunk_keys = block_ids[i : i + _SAVE_CHUNK_BLOCKS], keys[i : i + _SAVE_CHUNK_BLOCKS]
            nbytes = len(ids) * self.cache.bytes_per_block
            if not self.saver.has_room(nbytes):
                self.saver.drop(len(block_ids) - i)  # never make decode wait for the store
                return
            # Behind the step in flight (which may still write these blocks), before
            # finalize_seq can free them and any later step reuse them.
            copy = self.executor.submit_call(self.cache.read_blocks_async, ids)
            if self.saver.submit(SaveJob(chunk_keys, copy, nbytes)):
                for key in chunk_keys:
                    self._remember(key)

    def save_leaving(self, leaving: list[tuple[Sequence, list[int]]]) -> None:
        """Save the full blocks of sequences that leave this engine for another (request
        migration), so the PE that recomputes them loads these instead. ``leaving``: each with
        the blocks it held, which the scheduler may have freed already: the copies are queued
        before the next step is launched, so nothing has written those blocks yet."""
        for seq, blocks in leaving:
            held, seq.block_table = seq.block_table, blocks
            try:
                self.save([], [seq])
            finally:
                seq.block_table = held

    def _unsaved_blocks(self, jobs: list[tuple[Sequence, int]]) -> tuple[list[int], list[bytes]]:
        """(block ids, keys) of the full blocks past each job's start that the store lacks."""
        block_ids, keys, seen = [], [], set()
        for seq, start in jobs:
            upto = self._full_blocks(seq)
            hashes = self.block_manager.hash_full_blocks(seq, upto * self.block_size)
            for i in range(start, upto):
                if hashes[i] not in seen and not self._stored(hashes[i]):
                    seen.add(hashes[i])
                    block_ids.append(seq.block_table[i])
                    keys.append(hashes[i])
            if not seq.is_finished:
                self._saved_upto[seq.seq_id] = upto
        return block_ids, keys

    def _full_blocks(self, seq: Sequence) -> int:
        """Leading blocks of ``seq`` that are full of K/V of known tokens."""
        tokens = min(seq.num_computed_tokens, len(seq.token_ids), len(seq.block_table) * self.block_size)
        return tokens // self.block_size

    def _stored(self, key: bytes) -> bool:
        seen = self._known.get(key)
        if seen is not None and time.monotonic() - seen < _KNOWN_TTL_S:
            return True
        if self.store.contains(key):
            self._remember(key)
            return True
        return False

    def _remember(self, key: bytes) -> None:
        self._known[key] = time.monotonic()
        self._known.move_to_end(key)
        while len(self._known) > _KNOWN_KEYS:
            self._known.popitem(last=False)

    def _payloads(self, copied) -> list:
        host, event = copied
        event.synchronize()
        flat = host.contiguous().view(-1).view(torch.uint8).numpy()
        size = self.cache.bytes_per_block
        return [memoryview(flat[i * size : (i + 1) * size]) for i in range(host.shape[0])]

    # --- metrics and lifetime --------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        stats = self.store.stats()
        stats.update(
            loaded_blocks=self.loaded_blocks,
            loaded_requests=self.loaded_requests,
            load_ms=round(self.load_seconds * 1e3),
        )
        if self.saver is not None:
            stats.update(
                saved_blocks=self.saver.saved_blocks,
                dropped_saves=self.saver.dropped_blocks,
                failed_saves=self.saver.failed_blocks,
                pending_save_bytes=self.saver.pending_bytes,
            )
        return stats

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued saves are in the store (tests, benchmarks, shutdown)."""
        return self.saver is None or self.saver.flush(timeout)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self.saver is not None:
            self.saver.close()
        self.store.close()
