"""Block manager unit tests: no model, no torch. Expectations are worked out by hand."""

from __future__ import annotations

import pytest

from pdinfer.core.block_manager import ROOT_HASH, BlockManager, chain_hash
from pdinfer.sampling_params import SamplingParams
from pdinfer.sequence import Sequence

BS = 4


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(), seed=0)


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler does for a whole prompt: take cached blocks, allocate the rest."""
    hits = bm.lookup_prefix(seq)
    bm.allocate_prefill(seq, hits, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return hits


@pytest.fixture
def bm():
    manager = BlockManager(num_blocks=10, block_size=BS)
    yield manager
    # every test returns every block
    assert manager.num_free_blocks == manager.num_total_blocks
    assert all(count == 0 for count in manager.ref_counts)


def test_allocate_and_free(bm):
    seq = seq_of(list(range(10)))  # 10 tokens -> 3 blocks
    prefill(bm, seq)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 7
    assert bm.usage() == pytest.approx(0.3)
    bm.free(seq)
    assert seq.block_table == []


def test_allocate_more_than_free_raises(bm):
    with pytest.raises(RuntimeError):
        bm.allocate_blocks(11)
    assert bm.num_free_blocks == 10


def test_double_free_is_an_error(bm):
    blocks = bm.allocate_blocks(1)
    bm.free_blocks(blocks)
    with pytest.raises(RuntimeError):
        bm.free_blocks(blocks)


def test_chain_hash_depends_on_the_whole_prefix():
    a = chain_hash(ROOT_HASH, [1, 2, 3, 4])
    b = chain_hash(ROOT_HASH, [9, 2, 3, 4])
    assert chain_hash(a, [5, 6, 7, 8]) != chain_hash(b, [5, 6, 7, 8])
    assert chain_hash(a, [5, 6, 7, 8]) == chain_hash(chain_hash(ROOT_HASH, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_prefix_hit_shares_full_blocks(bm):
    first = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # full blocks [1-4], [5-8]
    prefill(bm, first)
    second = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44])
    hits = prefill(bm, second)
    assert hits == first.block_table[:2]
    assert second.block_table[:2] == first.block_table[:2]
    assert bm.ref_counts[first.block_table[0]] == 2
    # 3 blocks for first, 1 new block for the second's tail (11 tokens -> 3 blocks, 2 shared)
    assert bm.num_free_blocks == 10 - 3 - 1
    assert bm.num_prefix_hits == 8
    bm.free(first)
    bm.free(second)


def test_prefix_hit_leaves_at_least_one_token_to_compute(bm):
    first = seq_of(list(range(8)))  # exactly two full blocks
    prefill(bm, first)
    again = seq_of(list(range(8)))
    hits = bm.lookup_prefix(again)
    assert hits == first.block_table[:1]  # the last block is recomputed, so a token is left
    bm.free(first)


def test_prefix_differing_in_an_early_block_does_not_hit(bm):
    first = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, first)
    other = seq_of([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.lookup_prefix(other) == []
    bm.free(first)


def test_freed_cached_blocks_are_reused_by_a_later_prompt(bm):
    first = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, first)
    cached = first.block_table[:2]
    bm.free(first)
    assert bm.num_free_blocks == 10
    later = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 100])
    assert prefill(bm, later) == cached  # revived from the free pool
    assert bm.num_free_blocks == 10 - 3
    bm.free(later)


def test_eviction_takes_least_recently_freed_first(bm):
    a = seq_of([1, 1, 1, 1, 9])
    prefill(bm, a)
    bm.free(a)  # a's full block is cached but free
    b = seq_of([2, 2, 2, 2, 9])
    prefill(bm, b)
    bm.free(b)
    # Taking 9 fresh blocks must evict never-used blocks first, then a's (freed earlier).
    taken = bm.allocate_blocks(9)
    assert bm.lookup_prefix(seq_of([2, 2, 2, 2, 7])) != []  # b's block survived
    assert bm.lookup_prefix(seq_of([1, 1, 1, 1, 7])) == []  # a's block was evicted
    bm.free_blocks(taken)


def test_copy_on_write_of_a_shared_partial_block(bm):
    parent = seq_of([1, 2, 3, 4, 5, 6])  # blocks: [1-4] full, [5,6] partial
    prefill(bm, parent)
    shared = bm.share(parent.block_table)
    child = seq_of([1, 2, 3, 4, 5, 6])
    child.block_table, child.num_computed_tokens = shared, 6
    assert bm.num_free_blocks == 8  # sharing costs nothing
    assert bm.can_append_slot(child)
    copies = bm.append_slot(child)  # writes position 6, inside the shared partial block
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[1] != parent.block_table[1]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert bm.ref_counts[parent.block_table[1]] == 1
    assert bm.num_free_blocks == 7
    assert bm.append_slot(parent) == []  # the parent owns its block alone now
    bm.free(parent)
    bm.free(child)


def test_append_slot_at_block_boundary_allocates(bm):
    seq = seq_of([1, 2, 3, 4])
    prefill(bm, seq)
    seq.append_token(5)
    assert bm.append_slot(seq) == []
    assert len(seq.block_table) == 2
    bm.free(seq)


def test_num_blocks_needed_counts_revived_blocks(bm):
    first = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, first)
    bm.free(first)
    later = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 10, 11])
    hits = bm.lookup_prefix(later)
    # 2 revived from the free pool + 1 new block for tokens 9-10
    assert bm.num_blocks_needed(later, hits, later.num_tokens) == 3


def test_block_hashes_chain_block_by_block_when_extended_in_steps(bm):
    """A sequence's block hashes, however many calls extend them, are the chain of
    ``chain_hash`` over its full blocks (the hash the KV store and the router compute)."""
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # 3 full blocks and 2 tokens
    seq = seq_of(tokens)
    bm._extend_hashes(seq, 5)  # one block
    bm._extend_hashes(seq, 14)  # then the next two at once
    expected, parent = [], ROOT_HASH
    for i in range(3):
        parent = chain_hash(parent, tokens[i * BS : (i + 1) * BS])
        expected.append(parent)
    assert seq.block_hashes == expected
