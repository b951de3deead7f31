"""Scheduler unit tests: no model, no torch. Every expectation is worked out by hand.
Config, prefill (token budget, chunking, the roles), decode and preemption; forks are in
test_scheduler_forks.py, the prefill vote in test_scheduler_vote.py."""

from __future__ import annotations

import sys

import pytest
from scheduler_helpers import (
    COMPLETION,
    NORMAL,
    PROMPT,
    assert_all_blocks_free,
    finish_all,
    land_tokens,
    make,
    seq_of,
)

from pdinfer.config import SchedulerConfig
from pdinfer.sampling_params import SamplingParams
from pdinfer.sequence import SequenceStatus


# --- config -----------------------------------------------------------------------------------
def test_prompt_limit_and_validation():
    cfg = SchedulerConfig(engine_type=NORMAL, max_num_batched_tokens=100, max_num_seqs=4, max_model_len=80)
    assert cfg.prompt_limit == 80
    chunked = SchedulerConfig(
        engine_type=NORMAL, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=80, chunked_prefill=True
    )
    assert chunked.prompt_limit == 80
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(engine_type=NORMAL, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=80)
    with pytest.raises(ValueError, match="no prefill"):
        SchedulerConfig(engine_type=COMPLETION, max_num_batched_tokens=80, max_num_seqs=4, max_model_len=80)
    with pytest.raises(ValueError, match="unknown engine_type"):
        SchedulerConfig(engine_type=3, max_num_batched_tokens=80, max_num_seqs=4, max_model_len=80)


def test_scheduler_module_does_not_import_torch():
    import subprocess

    code = "import sys, pdinfer.core.scheduler, pdinfer.core.block_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- prefill ----------------------------------------------------------------------------------
def test_token_budget_without_chunking():
    sched = make(max_num_batched_tokens=40, max_model_len=40)
    a, b, c = seq_of(10, "a"), seq_of(20, "b"), seq_of(30, "c")
    for s in (a, b, c):
        sched.add_sequence(s)
    plan = sched.schedule()
    assert plan.prompt_run and plan.scheduled_seqs == [a, b]  # 10 + 20; 30 does not fit in 10
    assert plan.num_scheduled_tokens == [10, 20]
    land_tokens(sched, plan)
    plan = sched.schedule()  # decode_step 0 is an ALL point and c still waits
    assert plan.prompt_run and plan.scheduled_seqs == [c]
    land_tokens(sched, plan)
    finish_all(sched)
    assert_all_blocks_free(sched)


def test_prompt_over_limit_is_refused_with_an_error():
    sched = make(max_model_len=32, max_num_batched_tokens=32)
    long, short = seq_of(33, "long"), seq_of(5, "short")
    sched.add_sequence(long)
    sched.add_sequence(short)
    plan = sched.schedule()
    assert plan.ignored_seqs == [long]
    assert long.status is SequenceStatus.FINISHED_IGNORED
    assert "exceeds the limit of 32" in long.error
    assert plan.scheduled_seqs == [short]
    land_tokens(sched, plan)
    finish_all(sched)
    assert_all_blocks_free(sched)


def test_normal_chunked_prefill_takes_one_chunked_request_per_step():
    sched = make(chunked_prefill=True, max_num_batched_tokens=16, max_model_len=64)
    a, b = seq_of(40, "a"), seq_of(5, "b")
    sched.add_sequence(a)
    sched.add_sequence(b)
    for _ in range(2):
        plan = sched.schedule()
        assert plan.scheduled_seqs == [a]  # NORMAL stops after one chunked request
        assert plan.num_scheduled_tokens == [16] and plan.do_sample == [False]
        land_tokens(sched, plan)
    plan = sched.schedule()
    # a's last chunk (8 tokens) completes its prompt, so it is not a chunked request and b
    # (5 tokens) joins the same step within the 16-token budget.
    assert plan.scheduled_seqs == [a, b] and plan.num_scheduled_tokens == [8, 5]
    assert plan.do_sample == [True, True]
    finish_all(sched)
    assert_all_blocks_free(sched)


def test_prompt_engine_fills_the_budget_across_requests():
    sched = make(PROMPT, chunked_prefill=True, max_num_batched_tokens=32, max_model_len=64)
    a, b = seq_of(10, "a"), seq_of(40, "b")
    sched.add_sequence(a)
    sched.add_sequence(b)
    plan = sched.schedule()
    assert plan.scheduled_seqs == [a, b]
    assert plan.num_scheduled_tokens == [10, 22]
    assert plan.do_sample == [True, False]
    land_tokens(sched, plan)
    plan = sched.schedule()
    assert plan.scheduled_seqs == [b] and plan.num_scheduled_tokens == [18]
    land_tokens(sched, plan)
    finish_all(sched)
    assert_all_blocks_free(sched)


def test_prompt_engine_returns_an_empty_prefill_plan_when_idle():
    plan = make(PROMPT).schedule()
    assert plan is not None and plan.prompt_run and plan.is_empty


def test_prefill_scheduling_returns_none_only_for_normal_with_nothing_scheduled():
    # DESIGN section 2: `_schedule_prefill` returns None only for NORMAL with nothing scheduled
    # and nothing ignored; a PE gets an empty prefill plan instead.
    normal, prompt = make(NORMAL, num_blocks=2), make(PROMPT, num_blocks=2)
    assert normal._schedule_prefill() is None  # nothing waiting
    plan = prompt._schedule_prefill()
    assert plan is not None and plan.prompt_run and plan.is_empty
    for sched in (normal, prompt):  # a prompt that needs 3 blocks of the 2: waits, not ignored
        sched.add_sequence(seq_of(10))
    assert normal._schedule_prefill() is None
    plan = prompt._schedule_prefill()
    assert plan is not None and plan.is_empty and not plan.ignored_seqs


def test_completion_engine_only_decodes():
    sched = make(COMPLETION)
    sched.add_sequence(seq_of(5))  # a CE never prefills, even with a waiting sequence
    plan = sched.schedule()
    assert not plan.prompt_run and plan.is_empty


def test_max_num_seqs_bounds_the_batch():
    sched = make(max_num_seqs=2)
    seqs = [seq_of(4, str(i)) for i in range(3)]
    for s in seqs:
        sched.add_sequence(s)
    plan = sched.schedule()
    assert plan.scheduled_seqs == seqs[:2]
    land_tokens(sched, plan)
    plan = finish_all(sched)  # two slots free again: the third is prefilled
    assert plan.scheduled_seqs == seqs[2:]
    land_tokens(sched, plan)
    finish_all(sched)
    assert_all_blocks_free(sched)


# --- decode and preemption ----------------------------------------------------------------------
def _three_running(stop: bool):
    # 6 blocks of 4 tokens; three 7-token prompts take 2 blocks each -> cache full.
    sched = make(num_blocks=6, stop_preempted_request=stop)
    seqs = [seq_of(7, str(i)) for i in range(3)]
    for s in seqs:
        sched.add_sequence(s)
    plan = sched.schedule()
    assert plan.scheduled_seqs == seqs
    land_tokens(sched, plan)  # each now has 8 tokens, 7 computed
    return sched, seqs


def test_preemption_takes_the_latest_arrival_and_recomputes():
    sched, (a, b, c) = _three_running(stop=False)
    plan = sched.schedule()  # position 7 fits in each second block: no new block needed
    assert plan.scheduled_seqs == [a, b, c]
    land_tokens(sched, plan)  # 9 tokens: the next decode needs a third block each
    plan = sched.schedule()
    # a needs a block: c (latest) is preempted; b then needs one: c is gone, so b goes too?
    # No: freeing c gives 2 blocks, enough for a and b.
    assert plan.preempted_seqs == [c]
    assert plan.scheduled_seqs == [a, b]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert sched.waiting[0] is c and c.block_table == []
    land_tokens(sched, plan)
    finish_all(sched)
    sched.waiting.clear()
    assert_all_blocks_free(sched)


def test_preemption_with_stop_finishes_the_victim():
    sched, (a, b, c) = _three_running(stop=True)
    land_tokens(sched, sched.schedule())
    plan = sched.schedule()
    assert plan.preempted_seqs == [c]
    assert c.status is SequenceStatus.FINISHED_PREEMPTED and "preempted" in c.error
    assert c not in sched.waiting and c not in sched.running
    land_tokens(sched, plan)
    finish_all(sched)
    assert_all_blocks_free(sched)


def test_a_sequence_at_its_output_limit_is_not_scheduled():
    sched = make()
    s = seq_of(5, max_tokens=1)
    sched.add_sequence(s)
    plan = sched.schedule()
    assert plan.scheduled_seqs == [s]
    plan = sched.schedule()  # its one output token is in flight: nothing more to compute
    assert plan.is_empty and not plan.prompt_run
    land_tokens(sched, sched.schedule())
    finish_all(sched)
    assert_all_blocks_free(sched)


# --- admission: what the KV cache can never hold ------------------------------------------------
# 4 blocks of 4 tokens: 16 K/V slots in all. A request's last output token needs no slot, so a
# prompt of P tokens with max_tokens M needs P + M - 1.
def test_admission_refuses_what_the_cache_can_never_hold():
    sched = make(num_blocks=4)
    with pytest.raises(ValueError, match="prompt of 17 tokens"):
        sched.admit(seq_of(17, max_tokens=1))  # the prompt alone needs 5 blocks of the 4
    sched.admit(seq_of(10, max_tokens=7))  # 10 + 7 - 1 = 16 slots: fits exactly
    with pytest.raises(ValueError, match="max_tokens 8"):
        sched.admit(seq_of(10, max_tokens=8))  # 17 slots
    make(PROMPT, num_blocks=4).admit(seq_of(16, max_tokens=100))  # a PE holds the prompt only
    with pytest.raises(ValueError, match="prompt of 17 tokens"):
        make(PROMPT, num_blocks=4).admit(seq_of(17, max_tokens=1))


def test_an_open_ended_output_is_bounded_by_the_cache_and_ends_at_its_bound():
    sched = make(num_blocks=4)
    seq = seq_of(10, max_tokens=54)  # 54: the room left by max_model_len 64
    seq.sampling_params = SamplingParams(max_tokens=None)
    sched.admit(seq)
    assert seq.max_tokens == 7  # 16 slots - 10 prompt tokens + 1
    sched.add_sequence(seq)
    land_tokens(sched, sched.schedule())  # prefill: 3 blocks, first output token
    decode_steps = 0
    while not seq.reached_max_tokens:
        plan = sched.schedule()
        assert plan.scheduled_seqs == [seq] and not plan.preempted_seqs
        land_tokens(sched, plan)
        decode_steps += 1
    assert decode_steps == 6 and seq.num_output_tokens == 7  # positions 10..15
    assert sched.block_manager.num_free_blocks == 0  # every slot used, none more asked for
    assert sched.schedule().is_empty
    finish_all(sched)
    assert_all_blocks_free(sched)


def test_a_running_sequence_that_outgrows_the_cache_ends_with_length():
    # Admission bounds an engine's requests; one added without it must still end, not preempt
    # itself and recompute forever.
    sched = make(num_blocks=4)
    seq = seq_of(10, max_tokens=100)
    sched.add_sequence(seq)
    land_tokens(sched, sched.schedule())  # prefill: 3 blocks, 11 tokens
    for _ in range(6):  # positions 10..15: the 4th block
        plan = sched.schedule()
        assert plan.scheduled_seqs == [seq]
        land_tokens(sched, plan)
    plan = sched.schedule()  # position 16 would need a 5th block of the 4
    assert plan.is_empty and plan.preempted_seqs == [seq]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.finish_reason == "length"
    assert seq.num_output_tokens == 7 and sched.num_preemptions == 0
    assert seq not in sched.running and not sched.waiting
    assert_all_blocks_free(sched)
