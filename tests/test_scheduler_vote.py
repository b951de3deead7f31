"""Scheduler unit tests of the NORMAL prefill vote: prefill only at attempt points while
decoding, in one process and across ranks (threads stand in for the rank processes, with a real
MIN all-reduce between them). No model, no torch; the rank processes are in test_dp.py."""

from __future__ import annotations

import threading

from scheduler_helpers import land_tokens, make, seq_of


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
        barrier.wait(timeout=30)  # a rank that never votes breaks the barrier: the test fails
        result = [min(column) for column in zip(*slots)]
        barrier.wait(timeout=30)
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
