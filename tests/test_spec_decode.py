"""Speculative decoding (issue 28): the n-gram drafter, the acceptance rule, the K/V rollback,
and end to end: output with speculation equals output without it (greedy token for token,
seeded sampling too), through NORMAL with and without zero-overhead scheduling and through a
P/D pair whose PE never drafts."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_blocks_back, make_llm

from pdinfer import EngineArgs, SamplingParams, env
from pdinfer.cli_args import add_engine_args, engine_args_from
from pdinfer.config import SchedulerConfig
from pdinfer.core.block_manager import BlockManager
from pdinfer.core.scheduler import Scheduler
from pdinfer.core.spec_decode import DraftPool, NgramDrafter, num_accepted
from pdinfer.engine.completion_engine import CompletionEngine
from pdinfer.engine.pd_pair import PDPair
from pdinfer.engine.prefill_engine import PrefillEngine
from pdinfer.engine.speculative import build_draft_pool
from pdinfer.engine_type import EngineType
from pdinfer.sequence import Sequence
from pdinfer.worker.sampler import uniform_noise

MEM = 512 << 20
TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
)
REPETITIVE = "Copy this text exactly.\nText: " + TEXT + "\nCopy: " + TEXT[:40]
PROMPTS = [REPETITIVE, "Explain why the sky is blue.", "Once upon a time", "def fibonacci(n):\n    "]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# --- the drafter, the acceptance rule (no model) -------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # the 3-gram [1, 2, 3] matches at 0
        ([1, 2, 3, 4, 1, 2, 3], 1, [4]),
        ([1, 2, 3, 8, 3], 2, [8, 3]),  # no 3- or 2-gram match: the 1-gram [3] at 2
        ([7, 1, 7, 2, 7], 2, [2, 7]),  # the latest match with k tokens after it
        ([7, 1, 7, 2, 7], 3, [1, 7, 2]),  # none has 3 after it but the first
        ([9, 5, 9], 4, [5, 9]),  # a match near the end proposes what there is
        ([1, 2, 3, 4], 3, []),  # nothing repeats
        ([5], 3, []),
        ([5, 5], 0, []),
    ],
)
def test_ngram_drafter(tokens, k, expected):
    assert NgramDrafter().propose(tokens, k) == expected


def test_ngram_drafter_prefers_the_longest_n():
    # the 1-gram [3] last occurs at 5 (-> 9), the 3-gram [1, 2, 3] at 0 (-> 4): n = 3 wins
    tokens = [1, 2, 3, 4, 0, 3, 9, 1, 2, 3]
    assert NgramDrafter().propose(tokens, 1) == [4]
    assert NgramDrafter(max_n=1).propose(tokens, 1) == [9]


def test_num_accepted_is_the_matching_prefix():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3  # all, then the bonus token
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4, 5, 6], [8, 5, 6, 7]) == 0
    assert num_accepted([], [8]) == 0


def _race(probs: torch.Tensor, seeds: torch.Tensor, position: int) -> torch.Tensor:
    """The sampler's draw (``Sampler``): an exponential race over (seed, position) noise."""
    noise = uniform_noise(seeds, torch.full_like(seeds, position), probs.shape[-1])
    return (probs[None, :] / -torch.log(noise)).argmax(dim=-1)


def test_acceptance_keeps_the_target_distribution():
    """A point-mass draft x is accepted with probability p(x); a rejection emits a token of p
    with x removed and renormalised; so the emitted token follows p. 40,000 fixed seeds: the
    bounds are 5 standard deviations or more, and the check is deterministic."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1, 0.0])
    n = 40_000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    for x in (1, 3, 5):
        sampled = _race(p, seeds, position=17)
        emitted, accepted = [], 0
        for token in sampled.tolist():
            a = num_accepted([x], [token, -1])  # the draft row's sample decides; -1: the bonus row
            accepted += a
            emitted.append(x if a else token)
        emitted_t = torch.tensor(emitted)
        assert abs(accepted / n - p[x].item()) < 5 * (0.25 / n) ** 0.5 + 1e-9
        freq = torch.bincount(emitted_t, minlength=6).double() / n
        assert (freq - p.double()).abs().max() < 0.012  # emitted ~ p
        rejected = emitted_t[emitted_t != x]
        if len(rejected):
            residual = p.double().clone()
            residual[x] = 0
            residual /= residual.sum()
            rfreq = torch.bincount(rejected, minlength=6).double() / len(rejected)
            assert rfreq[x] == 0
            assert (rfreq - residual).abs().max() < 0.015  # the renormalised residual


# --- the K/V rollback (scheduler and block manager, no model) ---------------------------------------
class _FixedDrafter(NgramDrafter):
    def __init__(self, drafts):
        super().__init__()
        self.drafts = drafts

    def draft(self, seq, k):
        return self.drafts[:k]


def _scheduler(drafts, num_blocks=8):
    config = SchedulerConfig(engine_type=0, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    pool = DraftPool(_FixedDrafter(drafts), num_slots=4, num_draft_tokens=3)
    return Scheduler(config, BlockManager(num_blocks, 4), draft_pool=pool)


def _decoding_seq(scheduler, prompt):
    seq = Sequence("r", list(prompt), SamplingParams(temperature=0.0, max_tokens=20), seed=0, max_tokens=20)
    scheduler.add_sequence(seq)
    plan = scheduler.schedule()
    assert plan.prompt_run and plan.scheduled_seqs == [seq]
    seq.num_pending_tokens -= 1
    seq.append_token(50)  # the prefill's sampled token
    return seq


def test_rejected_drafts_give_back_their_blocks_and_are_never_published():
    scheduler = _scheduler([60, 61, 62])
    bm = scheduler.block_manager
    seq = _decoding_seq(scheduler, range(7))  # 8 tokens, 7 computed: 2 blocks of 4
    assert len(seq.block_table) == 2
    free_before = bm.num_free_blocks
    plan = scheduler.schedule()
    assert not plan.prompt_run and plan.num_scheduled_tokens == [4]  # 1 + 3 drafts
    assert seq.num_computed_tokens == 11 and len(seq.block_table) == 3  # positions 7..10
    assert bm.num_free_blocks == free_before - 1
    published = set(bm.hash_to_block.values())
    assert seq.block_table[2] not in published  # its slots hold drafts only
    # the first draft is rejected: one token comes out (the target's), positions 8.. roll back
    seq.num_pending_tokens -= 1
    seq.append_token(70)
    scheduler.rollback_drafts(seq)
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 2
    assert bm.num_free_blocks == free_before
    plan = scheduler.schedule()  # the next step writes position 8 into a fresh block
    assert plan.num_scheduled_tokens == [4] and seq.num_computed_tokens == 12
    assert bm.block_hash[seq.block_table[1]] is not None  # tokens 4..7: known and computed
    assert bm.block_hash[seq.block_table[2]] is None


def test_all_drafts_accepted_keep_their_blocks():
    scheduler = _scheduler([60, 61, 62])
    seq = _decoding_seq(scheduler, range(7))
    scheduler.schedule()
    seq.num_pending_tokens -= 1
    for token in (60, 61, 62, 63):  # three drafts and the bonus token
        seq.append_token(token)
    scheduler.rollback_drafts(seq)
    assert seq.num_computed_tokens == 11 and len(seq.block_table) == 3


def test_drafts_stop_short_of_max_tokens_and_of_free_blocks():
    scheduler = _scheduler([60, 61, 62], num_blocks=3)
    seq = _decoding_seq(scheduler, range(5))  # 2 blocks (the next token goes into the second), 1 free
    seq.max_tokens = 3  # 1 output token so far: at most 2 more, so 1 draft
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [2]
    seq.num_pending_tokens -= 1
    seq.append_token(99)
    scheduler.rollback_drafts(seq)
    seq.max_tokens = 20
    scheduler.block_manager.allocate_blocks(scheduler.block_manager.num_free_blocks)  # no room for drafts
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [1] and not seq.draft_token_ids


def test_steps_of_more_sequences_than_max_batch_draft_nothing():
    """A batch above the pool's ``max_batch`` decodes plainly (one row a sequence); once it is
    small enough again its sequences draft."""
    scheduler = _scheduler([60, 61, 62], num_blocks=16)
    scheduler.draft_pool.max_batch = 1
    first = _decoding_seq(scheduler, range(7))
    second = Sequence("s", list(range(7)), SamplingParams(temperature=0.0, max_tokens=20), seed=0, max_tokens=20)
    scheduler.add_sequence(second)
    plan = scheduler.schedule()  # the second prefill runs with the first's decode or alone
    for seq in plan.scheduled_seqs:
        seq.num_pending_tokens -= 1
        seq.append_token(50)
        scheduler.rollback_drafts(seq)
    plan = scheduler.schedule()
    assert sorted(plan.num_scheduled_tokens) == [1, 1]  # two sequences: nobody drafts
    for seq in plan.scheduled_seqs:
        seq.num_pending_tokens -= 1
        seq.append_token(51)
        scheduler.rollback_drafts(seq)
    scheduler.abort("s")
    plan = scheduler.schedule()
    assert plan.scheduled_seqs == [first] and plan.num_scheduled_tokens == [4]  # alone: 1 + 3 drafts


def test_back_off_after_misses():
    pool = DraftPool(_FixedDrafter([1, 2]), num_slots=2, num_draft_tokens=2, miss_limit=2, first_pause=3)
    seq = Sequence("r", [1, 2, 1], SamplingParams(), seed=0)
    assert pool.propose(seq, 5) == [1, 2]
    pool.record(seq, 2, 0)
    assert pool.propose(seq, 5) == [1]  # one more than the last step accepted
    pool.record(seq, 1, 0)
    assert [pool.propose(seq, 5) for _ in range(3)] == [[], [], []]  # two misses: paused for 3 steps
    assert pool.propose(seq, 5) == [1]
    pool.record(seq, 1, 1)  # an accepted draft resets the run, and the next step drafts more
    assert pool.propose(seq, 5) == [1, 2]
    assert pool.propose(seq, 1) == [1]  # never past what the caller has room for
    pool.release(seq)
    assert seq.draft_slot == -1 and pool.stats()["accepted_tokens"] == 1


# --- configuration ----------------------------------------------------------------------------------
def test_flags_and_refusals():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--speculative-method", "ngram", "--num-draft-tokens", "5"]))
    assert (args.speculative_method, args.num_draft_tokens) == ("ngram", 5)
    assert EngineArgs(speculative_method="ngram").num_draft_tokens == 3  # the default k
    assert EngineArgs(num_draft_tokens=2).speculative_method is None  # sizing only: no speculation
    with pytest.raises(ValueError, match="unknown speculative_method"):
        EngineArgs(speculative_method="eagle")
    mtp = EngineArgs(speculative_method="mtp")
    with pytest.raises(ValueError, match="MTP"):
        build_draft_pool(mtp, {"architectures": ["LlamaForCausalLM"]}, _runner("cpu"), 8, 16)
    ngram = EngineArgs(speculative_method="ngram")
    assert build_draft_pool(ngram, {}, _runner("cuda"), 8, 16) is not None  # CUDA verifies drafts too
    prompt = EngineArgs(speculative_method="ngram", engine_type="prompt")
    assert build_draft_pool(prompt, {}, _runner("cpu"), 8, 16) is None  # a PE never drafts
    assert not EngineType.PROMPT.drafts_tokens and EngineType.COMPLETION.drafts_tokens


def _runner(device: str) -> SimpleNamespace:
    """What ``build_draft_pool`` reads of a model runner (a Llama-family model)."""
    spec = SimpleNamespace(architecture="LlamaForCausalLM", mla=None, moe=None)
    return SimpleNamespace(model=object(), device=torch.device(device), spec=spec, moe_layers=[])


# --- end to end ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base():
    return make_llm(kv_cache_memory=MEM)


def _spec_llm(monkeypatch, zos: bool, k: int = 3):
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1" if zos else "0")
    monkeypatch.delitem(env._role_defaults, "PDINFER_ZERO_OVERHEAD_SCHEDULING", raising=False)
    llm = make_llm(kv_cache_memory=MEM, speculative_method="ngram", num_draft_tokens=k)
    assert llm.engine.zero_overhead is zos
    return llm


@pytest.fixture(scope="module")
def spec_zos():
    with pytest.MonkeyPatch.context() as mp:
        yield _spec_llm(mp, zos=True)


@pytest.fixture(scope="module")
def spec_plain():
    with pytest.MonkeyPatch.context() as mp:
        yield _spec_llm(mp, zos=False, k=4)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("which", ["spec_zos", "spec_plain"])
def test_greedy_equals_no_speculation(base, which, request):
    spec = request.getfixturevalue(which)
    pool = spec.engine.draft_pool
    before = pool.num_accepted_tokens
    expected = base.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert pool.num_accepted_tokens > before  # the repetitive prompt's drafts were taken
    assert_blocks_back(spec.engine)
    # the non-repetitive prompts alone
    assert _tokens(spec.generate(PROMPTS[1:], GREEDY, use_tqdm=False)) == _tokens(expected[1:])
    assert_blocks_back(spec.engine)


def test_stops_and_max_tokens_cut_exactly(base, spec_zos):
    greedy = base.generate(REPETITIVE, GREEDY, use_tqdm=False)[0].outputs[0]
    stop_at = greedy.text[len(greedy.text) // 2 :][:6]  # a stop string inside the output
    stop_id = greedy.token_ids[7]
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5, 9)]
    cases += [
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_at]),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_at], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=200),  # EOS, where the model ends
    ]
    for params in cases:
        expected = base.generate(PROMPTS[:2], params, use_tqdm=False)
        got = spec_zos.generate(PROMPTS[:2], params, use_tqdm=False)
        for e, g in zip(expected, got):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, params
            assert (g.outputs[0].text, g.outputs[0].finish_reason) == (e.outputs[0].text, e.outputs[0].finish_reason)
            assert g.outputs[0].stop_reason == e.outputs[0].stop_reason
    assert_blocks_back(spec_zos.engine)


def test_logprobs_and_seeded_sampling_equal_no_speculation(base, spec_plain):
    """Seeded sampling draws the same tokens (the same (seed, position) noise decides every
    position, see core/spec_decode.py); log-probs agree within float rounding."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=16, ignore_eos=True, repetition_penalty=1.2),
    ]
    for p in params:
        expected = base.generate(PROMPTS[:2], p, use_tqdm=False)
        got = spec_plain.generate(PROMPTS[:2], p, use_tqdm=False)
        assert _tokens(got) == _tokens(expected), p
        for e, g in zip(expected, got):
            for ec, gc in zip(e.outputs, g.outputs):
                if p.logprobs is None:
                    continue
                assert [list(d) for d in gc.logprobs] == [list(d) for d in ec.logprobs]
                for ed, gd in zip(ec.logprobs, gc.logprobs):
                    assert list(gd.values()) == pytest.approx(list(ed.values()), abs=2e-3)
            if p.prompt_logprobs is not None:
                assert [list(d or ()) for d in g.prompt_logprobs] == [list(d or ()) for d in e.prompt_logprobs]
    assert spec_plain.engine.draft_pool.num_accepted_tokens > 0
    assert_blocks_back(spec_plain.engine)


def test_pd_pair_drafts_on_the_ce_only(base):
    def args(role):
        return EngineArgs(
            engine_type=role, kv_cache_memory=640 << 20, speculative_method="ngram", kv_transfer={"connector": "tcp"}
        )

    pe, ce = PrefillEngine(args("prompt")), CompletionEngine(args("completion"))
    try:
        assert pe.draft_pool is None and pe.scheduler.draft_pool is None  # no pool on a PE
        assert ce.draft_pool is not None and ce.draft_pool.num_slots == ce.scheduler_config.max_num_seqs
        got = PDPair(pe, ce).generate(PROMPTS, GREEDY)
        expected = base.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _tokens(got) == _tokens(expected)
        assert ce.draft_pool.num_accepted_tokens > 0
        for engine in (pe, ce):
            assert engine.get_num_free_blocks() == engine.num_blocks
    finally:
        pe.shutdown()
        ce.shutdown()
