"""Paged KV blocks: reference counts, prefix caching over full blocks, copy-on-write.

A block is free when its reference count is 0. A free block may still hold the K/V of a
full, hashed block; a later prompt with the same prefix takes it back without recomputing.
Free blocks are reused least-recently-freed first, so popular prefixes stay longest.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence as IntSequence
from hashlib import blake2b

from pdinfer.sequence import Sequence


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Hash of a full block given its parent's hash: equal hashes mean equal prefixes.

    Stable across processes and hosts (the KV store and the router rely on that).
    """
    return blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def chain_hashes(parent: bytes, token_ids: IntSequence[int], block_size: int) -> list[bytes]:
    """``chain_hash`` of each full block of ``token_ids`` in turn, the first one's parent being
    ``parent`` (a partial last block is left out). One conversion to bytes and one call per
    block: a 2,048-token prompt has 128 blocks."""
    raw = array("q", token_ids).tobytes()
    width = 8 * block_size
    hashes = []
    for start in range(0, len(raw) - width + 1, width):
        parent = blake2b(parent + raw[start : start + width], digest_size=16).digest()
        hashes.append(parent)
    return hashes


ROOT_HASH = b"pdinfer-kv-root!"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found cached

    # --- counts ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- raw blocks ------------------------------------------------------------------------
    def allocate_blocks(self, count: int) -> list[int]:
        """Take ``count`` blocks (reference 1 each); raises if fewer are free."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free_blocks} free")
        # One loop over local names: a 2,048-token prompt takes 128 blocks.
        free, ref_counts, block_hash, hash_to_block = (
            self.free_block_ids,
            self.ref_counts,
            self.block_hash,
            self.hash_to_block,
        )
        block_ids = []
        for _ in range(count):
            block_id, _ = free.popitem(last=False)
            old = block_hash[block_id]
            if old is not None:  # a cached block is reused: its prefix is no longer cached
                if hash_to_block.get(old) == block_id:
                    del hash_to_block[old]
                block_hash[block_id] = None
            ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop a reference to each block; a block whose last reference goes becomes free."""
        free, ref_counts = self.free_block_ids, self.ref_counts
        # Tail blocks first: they are the least likely to be shared by a later prefix.
        for block_id in reversed(block_ids):
            if ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed twice")
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                free[block_id] = None

    def _incref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_block_ids[block_id]
        self.ref_counts[block_id] += 1

    # --- prefix caching --------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the sequence's full blocks of known tokens up to ``num_tokens``."""
        bs = self.block_size
        num_full = min(num_tokens, len(seq.token_ids)) // bs
        hashes = seq.block_hashes
        first = len(hashes)
        if first >= num_full:
            return
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.extend(chain_hashes(parent, seq.token_ids[first * bs : num_full * bs], bs))

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``; at least one token stays to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks * self.block_size)
        hits = []
        for h in seq.block_hashes[:max_blocks]:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's full blocks whose K/V is computed (or being computed now)."""
        if not self.enable_prefix_caching:
            return
        covered = min(seq.num_computed_tokens, len(seq.block_table) * self.block_size, len(seq.token_ids))
        self._extend_hashes(seq, covered)
        # Newest first, stopping at the first published block: blocks fill in order and every
        # step publishes those that filled, so a decode step looks at one block, not all of
        # them. (A block left out because another block held its hash stays out.)
        table, hashes = seq.block_table, seq.block_hashes
        block_hash, hash_to_block = self.block_hash, self.hash_to_block  # a prompt: 128 blocks
        for i in range(covered // self.block_size - 1, -1, -1):
            block_id = table[i]
            if block_hash[block_id] is not None:
                break
            h = hashes[i]
            if h not in hash_to_block:
                hash_to_block[h] = block_id
                block_hash[block_id] = h

    def hash_full_blocks(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Chained hashes of the sequence's full blocks of known tokens up to ``num_tokens``."""
        self._extend_hashes(seq, num_tokens)
        return seq.block_hashes[: min(num_tokens, len(seq.token_ids)) // self.block_size]

    def adopt_cached_blocks(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """Publish blocks the caller allocated and filled with K/V computed elsewhere (a KV
        store) under their hashes, then free them: cached and free, a prefix lookup takes them."""
        for block_id, h in zip(block_ids, hashes, strict=True):
            if self.ref_counts[block_id] != 1 or self.block_hash[block_id] is not None:
                raise RuntimeError(f"block {block_id} is not a freshly allocated block")
            if self.enable_prefix_caching and h not in self.hash_to_block:
                self.hash_to_block[h] = block_id
                self.block_hash[block_id] = h
        self.free_blocks(block_ids)

    # --- prefill ---------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, hits: list[int], num_tokens: int) -> int:
        """Free blocks consumed if ``seq`` (taking ``hits`` first) must cover ``num_tokens``."""
        held = len(seq.block_table) if seq.block_table else len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0) if not seq.block_table else 0
        return max(0, self.blocks_for(num_tokens) - held) + revived

    def allocate_prefill(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Give ``seq`` blocks covering ``num_tokens`` tokens; a fresh one takes ``hits`` first."""
        if not seq.block_table and hits:
            for block_id in hits:
                self._incref(block_id)
            seq.block_table = list(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            self.num_prefix_hits += seq.num_computed_tokens
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > 0:
            seq.block_table.extend(self.allocate_blocks(missing))

    # --- decode ----------------------------------------------------------------------------
    def can_append_slot(self, seq: Sequence, num_tokens: int = 1) -> bool:
        return self._append_cost(seq, num_tokens) <= self.num_free_blocks

    def _append_cost(self, seq: Sequence, num_tokens: int) -> int:
        first = seq.num_computed_tokens // self.block_size  # the block this decode writes first
        last = (seq.num_computed_tokens + num_tokens - 1) // self.block_size
        cost = max(0, last + 1 - len(seq.block_table))
        if first < len(seq.block_table) and self.ref_counts[seq.block_table[first]] > 1:
            cost += 1  # copy-on-write of a shared, partly written block
        return cost

    def append_slot(self, seq: Sequence, num_tokens: int = 1) -> list[tuple[int, int]]:
        """Make room for ``num_tokens`` more tokens (a decode token and its drafts); returns
        block copies (copy-on-write) to apply first. ``seq.num_draft_blocks``: blocks added."""
        first = seq.num_computed_tokens // self.block_size
        missing = self.blocks_for(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        copy = self.copy_on_write(seq, first) if first < len(seq.block_table) else None
        seq.num_draft_blocks = max(0, missing)
        if missing > 0:
            seq.block_table.extend(self.allocate_blocks(missing))
        return [copy] if copy else []

    def trim(self, seq: Sequence) -> None:
        """Free the blocks a step appended that now hold no computed token (rejected drafts
        only). Such blocks were never published to the prefix cache: publishing stops at the
        sequence's known tokens, and drafts are not among them."""
        keep = max(self.blocks_for(seq.num_computed_tokens), len(seq.block_table) - seq.num_draft_blocks)
        if keep < len(seq.block_table):
            self.free_blocks(seq.block_table[keep:])
            del seq.block_table[keep:]
        seq.num_draft_blocks = 0

    def must_copy_before_write(self, block_id: int) -> bool:
        """Writing into the block would change what another reader sees: another sequence
        shares it, or the prefix cache published it (a later prompt may hit it)."""
        return self.ref_counts[block_id] > 1 or self.block_hash[block_id] is not None

    def copy_on_write(self, seq: Sequence, index: int) -> tuple[int, int] | None:
        """Give ``seq`` a private copy of its block ``index`` if the block is shared."""
        if self.ref_counts[seq.block_table[index]] <= 1:
            return None
        return self.copy_block(seq, index)

    def copy_block(self, seq: Sequence, index: int) -> tuple[int, int]:
        """Give ``seq`` a new block in place of its block ``index``; returns (old, new), whose
        contents the runner copies before the step writes. The old block keeps its hash."""
        block_id = seq.block_table[index]
        new_block = self.allocate_blocks(1)[0]
        self.free_blocks([block_id])
        seq.block_table[index] = new_block
        return block_id, new_block

    def share(self, block_ids: list[int]) -> list[int]:
        """Add a reference to each block (a fork reading the same prefix)."""
        for block_id in block_ids:
            self._incref(block_id)
        return list(block_ids)

    def free(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
