"""Helpers of the scheduler unit tests (tests/test_scheduler*.py): a scheduler over a block
manager alone, prompts that share no prefix, and the engine's side of a step (landing sampled
tokens, finishing sequences)."""

from __future__ import annotations

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
