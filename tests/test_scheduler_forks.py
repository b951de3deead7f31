"""Scheduler unit tests of forks (what `n > 1` and the P/D hand-off build on): shared KV blocks
copied before a write, a fork of an incomplete prefix, a fork onto given blocks; and the state
slots of models with per-sequence state, which forks clone (the cache engine's copy of a slot
is the one test here that needs torch)."""

from __future__ import annotations

import pytest
from scheduler_helpers import (
    COMPLETION,
    NORMAL,
    assert_all_blocks_free,
    finish_all,
    land_tokens,
    make,
    seq_of,
)

from pdinfer.config import SchedulerConfig
from pdinfer.core.block_manager import BlockManager
from pdinfer.core.scheduler import Scheduler


# --- fork_seq ---------------------------------------------------------------------------------------
def test_fork_shares_blocks_and_copies_the_partial_block_before_writing():
    sched = make()
    parent = seq_of(6)
    sched.add_sequence(parent)
    land_tokens(sched, sched.schedule())  # 6 computed, 7 tokens
    bm = sched.block_manager
    free_before = bm.num_free_blocks
    fork = sched.fork_seq(parent, replace_last_token_id=99)
    assert bm.num_free_blocks == free_before  # shared, not copied yet
    assert fork.token_ids[-1] == 99 and fork.num_computed_tokens == 6
    assert sched.prompted[0] == (fork, True)
    plan = sched.schedule()
    # block 1 holds positions 4..7 and is shared: the fork gets a copy before it writes 6
    assert plan.clone_blocks == [(parent.block_table[1], fork.block_table[1])]
    assert set(plan.scheduled_seqs) == {parent, fork}
    land_tokens(sched, plan)
    finish_all(sched)
    assert_all_blocks_free(sched)


def test_fork_with_an_incomplete_prefix_goes_back_to_waiting():
    sched = make(chunked_prefill=True, max_num_batched_tokens=4)
    parent = seq_of(10)
    sched.add_sequence(parent)
    land_tokens(sched, sched.schedule())  # 4 of 10 computed
    fork = sched.fork_seq(parent)
    # behind its parent, whose prefill is under way (it holds the blocks they share)
    assert list(sched.waiting) == [parent, fork] and fork.num_computed_tokens == 4
    with pytest.raises(ValueError, match="computed prefix"):
        sched.fork_seq(seq_of(3))  # nothing computed, nothing sampled


def test_fork_with_explicit_blocks_is_decoded_without_prefill():
    sched = make(COMPLETION)
    source = seq_of(6)
    source.num_computed_tokens, source.token_ids = 6, source.token_ids + [50]
    blocks = sched.block_manager.allocate_blocks(2)
    fork = sched.fork_seq(source, blocks=blocks)
    assert fork.block_table == blocks
    plan = sched.schedule()
    assert not plan.prompt_run and plan.scheduled_seqs == [fork] and plan.clone_blocks == []
    with pytest.raises(ValueError, match="allocated KV blocks"):
        sched.fork_seq(source, blocks=[])
    land_tokens(sched, plan)
    finish_all(sched)
    assert_all_blocks_free(sched)


# --- state slots (models with per-sequence state) ------------------------------------------------
def test_forks_clone_their_state_slot_and_slots_come_back():
    from pdinfer.core.state_manager import StateManager

    sm = StateManager(4)
    sched = Scheduler(
        SchedulerConfig(engine_type=NORMAL, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
        BlockManager(64, 4),
        state_manager=sm,
    )
    parent = seq_of(6)
    sched.add_sequence(parent)
    land_tokens(sched, sched.schedule())
    assert parent.state_id >= 0 and sm.num_free_slots == 3
    fork = sched.fork_seq(parent, replace_last_token_id=3)
    assert fork.state_id == -1  # gets its own slot when it joins running
    plan = sched.schedule()
    assert fork.state_id not in (-1, parent.state_id)
    assert plan.clone_states == [(parent.state_id, fork.state_id)]
    land_tokens(sched, plan)
    finish_all(sched)
    assert sm.num_free_slots == 4
    assert_all_blocks_free(sched)


def test_cache_engine_clones_state_slots():
    import torch

    from pdinfer.models.presets import PRESETS
    from pdinfer.models.spec import ModelSpec
    from pdinfer.worker.cache_engine import CacheEngine

    cache = CacheEngine(ModelSpec.from_hf_config(PRESETS["smollm2-135m"]), 2, 4, torch.float32, torch.device("cpu"))
    cache.init_states(3, (5,))
    cache.states[0] = torch.arange(5.0)
    cache.copy_states([(0, 2)])
    assert torch.equal(cache.states[2], torch.arange(5.0)) and cache.states[1].sum() == 0
