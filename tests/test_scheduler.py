"""Scheduler unit tests: no model, no torch. Every expectation is worked out by hand."""

from __future__ import annotations

import sys
import threading

import pytest

from pdinfer.config import SchedulerConfig
from pdinfer.core.block_manager import BlockManager
from pdinfer.core.scheduler import Scheduler
from pdinfer.engine_type import EngineType
from pdinfer.sampling_params import SamplingParams
from pdinfer.sequence import Sequence, SequenceStatus

NORMAL, PROMPT, COMPLETION = EngineType.NORMAL.value, EngineType.PROMPT.value, EngineType.COMPLETION.value


def make(engine_type=NORMAL, num_blocks=64, block_size=4, dp_group=None, **cfg):
    cfg.setdefault("max_num_batched_tokens", 64)
    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("stop_preempted_request", engine_type == COMPLETION)
    config = SchedulerConfig(engine_type=engine_type, **cfg)
    return Scheduler(config, BlockManager(num_blocks, block_size), dp_group)


_distinct = iter(range(1000, 10**9, 1000))


def seq_of(n: int, rid: str = "r", max_tokens: int = 100) -> Sequence:
    """A prompt of n tokens sharing no prefix with any other (no accidental cache hits)."""
    start = next(_distinct)
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(range(start, start + n)),
        sampling_params=SamplingParams(),
        seed=0,
        max_tokens=max_tokens,
    )


def land_tokens(sched: Scheduler, plan) -> None:
    """What the engine does when a step's sampled tokens arrive."""
    for seq, do_sample in zip(plan.scheduled_seqs, plan.do_sample):
        if do_sample:
            seq.num_pending_tokens -= 1
            seq.append_token(7)


def finish_all(sched: Scheduler):
    """Finish every running sequence; the next plan carries them and frees their blocks (as
    the engine's finalize_seq does). Returns that plan, which may schedule new work."""
    for seq in list(sched.running):
        seq.finish(SequenceStatus.FINISHED_STOPPED)
        sched.finish_seq(seq)
    plan = sched.schedule()
    for seq in plan.finished_seqs:
        sched.free_seq(seq)
    return plan


def assert_all_blocks_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


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
    assert sched.waiting[0] is fork
    with pytest.raises(ValueError, match="computed prefix"):
        sched.fork_seq(seq_of(3))


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


# --- the NORMAL vote (single process) ------------------------------------------------------------
def _step_types(sched, steps, arrivals=None):
    types = []
    for i in range(steps):
        for seq in (arrivals or {}).get(i, []):
            sched.add_sequence(seq)
        plan = sched.schedule()
        types.append("P" if plan.prompt_run else ("D" if plan.scheduled_seqs else "-"))
        land_tokens(sched, plan)
    return "".join(types)


def test_prefill_only_at_attempt_points_while_decoding():
    sched = make(prefill_attempt_interval=3, prefill_any_attempt_interval=5)
    # step 0: a arrives, nothing runs -> prefill at once (and decode_step 0 right after a
    # prefill is an ALL point again). b arrives at step 2 while a decodes: decode_step counts
    # 1, 2, 3 -> the ALL point after three decode steps prefills b.
    types = _step_types(sched, 7, {0: [seq_of(4, "a")], 2: [seq_of(4, "b")]})
    assert types == "PDDDPDD"


def test_running_full_and_waiting_does_not_loop_on_empty_prefills():
    sched = make(max_num_seqs=1, prefill_attempt_interval=1, prefill_any_attempt_interval=1)
    types = _step_types(sched, 6, {0: [seq_of(4, "a"), seq_of(4, "b")]})
    # b can never be scheduled while a runs; every step is a vote point, yet all are decodes.
    assert types == "PDDDDD"


def test_an_idle_engine_prefills_at_once():
    sched = make(prefill_attempt_interval=50, prefill_any_attempt_interval=60)
    assert _step_types(sched, 3, {2: [seq_of(4, "a")]}) == "--P"


def test_kv_watermark_blocks_prefill():
    sched = make(num_blocks=4, prefill_attempt_interval=1, prefill_any_attempt_interval=1, prefill_kv_watermark=0.5)
    types = _step_types(sched, 3, {0: [seq_of(12, "a")], 1: [seq_of(2, "b")]})
    # a holds 3 of 4 blocks (75% > 50%): b is not prefilled while a runs
    assert types == "PDD"


# --- the NORMAL vote across ranks (threads stand in for processes) --------------------------------
class ThreadGroup:
    """A real MIN all-reduce between threads (the DPGroup interface), one instance per rank."""

    def __init__(self, shared, rank, size):
        self.shared, self.rank, self.size = shared, rank, size

    def all_reduce_min(self, values):
        barrier, slots = self.shared
        slots[self.rank] = list(values)
        barrier.wait()
        result = [min(column) for column in zip(*slots)]
        barrier.wait()
        return result


def _run_ranks(arrivals_per_rank, steps, **cfg):
    size = len(arrivals_per_rank)
    shared = (threading.Barrier(size), [None] * size)
    scheds = [make(dp_group=ThreadGroup(shared, r, size), **cfg) for r in range(size)]
    logs = [None] * size

    def run(rank):
        logs[rank] = _step_types(scheds[rank], steps, arrivals_per_rank[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return logs


def _kinds(log):
    return log.replace("-", "D")  # an empty decode step is still a decode step


def test_ranks_take_identical_step_types_with_uneven_arrivals():
    cfg = dict(prefill_attempt_interval=2, prefill_any_attempt_interval=3)
    rank0 = {0: [seq_of(4, "a")], 1: [seq_of(4, "b"), seq_of(4, "c")], 4: [seq_of(4, "d")]}
    rank1 = {}
    logs = _run_ranks([rank0, rank1], 12, **cfg)
    assert _kinds(logs[0]) == _kinds(logs[1])
    # rank 1 has nothing: it runs companion empty prefill steps alongside rank 0
    assert "P" in logs[0]


def test_a_lone_request_on_one_rank_is_prefilled_by_the_any_point():
    cfg = dict(prefill_attempt_interval=2, prefill_any_attempt_interval=3)
    # both ranks decode; rank 1 gets a request while rank 0 does not want to prefill: ALL
    # points fail, the ANY point (decode_step 3) lets it in.
    rank0 = {0: [seq_of(4, "a")]}
    rank1 = {0: [seq_of(4, "x")], 1: [seq_of(4, "lonely")]}
    logs = _run_ranks([rank0, rank1], 6, **cfg)
    # step 1 is an ALL point (right after a prefill) that fails; 2 and 3 are not ANY points;
    # at decode_step 3 the ANY point prefills "lonely" and rank 0 runs an empty prefill step.
    assert _kinds(logs[0]) == _kinds(logs[1]) == "PDDDPD"


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
