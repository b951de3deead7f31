"""Expert parallelism and EPLB in engines, on the tiny random Qwen3-MoE and DeepSeek-V3
checkpoints of test_moe_models.py (8 routed experts, top-2):

- a DP-2 / EP-2 NORMAL group of two rank processes (gloo), requests arriving unevenly on the
  ranks, two redundant experts and a short EPLB interval (expert weights cross between the
  processes mid-run): greedy tokens equal transformers' and one engine's holding every expert;
- a forced rearrangement in one engine: tokens before, after, and without EPLB are equal;
- the step at which each role rearranges, in real engines (NORMAL, and a PE -> CE pair);
- a PE with EP 1 handing off to a CE of two EP ranks (threads in lockstep): the K/V hand-off
  does not see the EP sizes.

Pure pieces (placement, timer, workspace, two ranks as threads) are in test_eplb.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from dp_helpers import Client, quiesce, step_logs
from test_moe_models import NEW_TOKENS, PROMPT_LENS, Case, _generate, _prompts

from pdinfer import LLM, EngineArgs, SamplingParams
from pdinfer.distributed.dp_front import DPFront, DPOptions
from pdinfer.distributed.ep_group import TorchExpertGroup

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3-moe", "deepseek-v3"])
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


# --- DP-2 / EP-2 across processes ------------------------------------------------------------------
@pytest.fixture()
def ep_front(case, tmp_path, monkeypatch):
    monkeypatch.setenv("PDINFER_STEP_LOG", str(tmp_path / "steps.log"))
    monkeypatch.setenv("PDINFER_PREFILL_ANY_ATTEMPT_INTERVAL", "3")
    args = EngineArgs(
        model=case.folder,
        data_parallel_size=2,
        expert_parallel_size=2,
        num_redundant_experts=2,
        eplb_interval=4,
        num_kv_blocks=64,
        max_num_seqs=2,
    )
    front = DPFront(args, DPOptions(timeout_s=30.0))
    front.step_log = tmp_path / "steps.log"
    front.start()
    try:
        front.wait_ready(300)
        yield front
    finally:
        front.shutdown()


def test_dp2_ep2_group_equals_one_engine_and_transformers(case, ep_front):
    prompts = _prompts(PROMPT_LENS + (17, 41))
    client = Client(ep_front)
    # Rank 0 gets four requests (more than max_num_seqs=2), one arriving while others decode;
    # rank 1 gets two, the second late: its idle and empty steps still join every all-to-all.
    client.submit("r0", {"prompt_token_ids": prompts[0]}, GREEDY, rank=0)
    client.wait(lambda: client.tokens("r0") >= 2, "r0 to decode")
    client.submit("r1", {"prompt_token_ids": prompts[1]}, GREEDY, rank=0)
    client.submit("r2", {"prompt_token_ids": prompts[2]}, GREEDY, rank=0)
    client.submit("s0", {"prompt_token_ids": prompts[3]}, GREEDY, rank=1)
    client.wait(lambda: client.tokens("r1") >= 3, "r1 to decode")
    client.submit("r3", {"prompt_token_ids": prompts[4]}, GREEDY, rank=0)
    client.submit("s1", {"prompt_token_ids": prompts[5]}, GREEDY, rank=1)
    client.wait(lambda: len(client.final) == 6, "every request to finish")
    names = ["r0", "r1", "r2", "s0", "r3", "s1"]
    outputs = [client.final[n] for n in names]
    assert [o.extra["dp_rank"] for o in outputs] == [0, 0, 0, 1, 0, 1]
    case.check(prompts, outputs, "DP-2/EP-2")
    single = _generate(LLM(model=case.folder, num_kv_blocks=64), prompts)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in single]
    quiesce(ep_front)
    logs = step_logs(ep_front)
    assert [t for t, _ in logs[0]] == [t for t, _ in logs[1]]  # same step type, every step
    assert any(n0 > 0 and n1 == 0 for (_, n0), (_, n1) in zip(*logs))  # rank 1 ran empty steps
    stats = ep_front.rank_stats()
    # every rank rearranged at the same steps, and expert weights crossed between the processes
    assert stats[0].num_expert_rearrangements == stats[1].num_expert_rearrangements >= 3
    assert stats[0].num_expert_slots_received + stats[1].num_expert_slots_received > 0


# --- in one engine -----------------------------------------------------------------------------------
def test_a_forced_rearrangement_keeps_the_tokens(case):
    prompts = _prompts(PROMPT_LENS)
    plain = _generate(LLM(model=case.folder, num_kv_blocks=64), prompts)
    llm = LLM(model=case.folder, num_kv_blocks=64, num_redundant_experts=3, eplb_interval=0)
    before = _generate(llm, prompts)
    eplb = llm.engine.eplb
    assert eplb is not None and eplb.rearranged_at == []  # interval 0: never by itself
    loads = eplb.loads()
    assert int(loads.sum()) > 0  # counted while generating
    skewed = torch.zeros_like(loads)
    skewed[:, 5], skewed[:, 2] = 1000, 10  # expert 5 takes every spare slot
    eplb.rearrange(skewed)
    for layer in eplb.layers:
        assert layer.experts.slot_experts.count(5) == 4  # moved within the rank: 3 replicas more
        assert int(layer.expert_load.sum()) == 0  # the counting window starts again
    after = _generate(llm, prompts)
    tokens = [[o.outputs[0].token_ids for o in outs] for outs in (plain, before, after)]
    assert tokens[0] == tokens[1] == tokens[2]
    case.check(prompts, after, "after a forced rearrangement")


def test_the_step_at_which_each_role_rearranges(case):
    from pdinfer.engine.completion_engine import CompletionEngine
    from pdinfer.engine.pd_pair import PDPair
    from pdinfer.engine.prefill_engine import PrefillEngine

    few = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    moe = dict(model=case.folder, num_kv_blocks=64, num_redundant_experts=2, eplb_interval=3)
    # NORMAL: two prompts in one prefill step and four decode steps, then one prompt the same
    # way: P D D D D | P D D D D. The prefill sets the counter to 2, so the first decode step
    # rearranges (step 2); steps 3-5 count to 3 (step 5); the second prefill again makes the
    # next decode step rearrange (step 7), and 8-10 count to 3 (step 10).
    llm = LLM(**moe)
    _generate(llm, _prompts((9, 20)), few)
    _generate(llm, _prompts((12,), seed=5), few)
    assert llm.engine.eplb.num_steps == 10
    assert llm.engine.eplb.rearranged_at == [2, 5, 7, 10]
    # PROMPT and COMPLETION count every step: the PE prefills four requests one step each
    # (rearranging at its 3rd), the CE decodes them four steps each (at its 3rd, 6th ... 15th).
    pe = PrefillEngine(EngineArgs(engine_type="prompt", **moe))
    ce = CompletionEngine(EngineArgs(engine_type="completion", **moe))
    try:
        pair = PDPair(pe, ce)
        prompts = _prompts((7, 30, 18, 11), seed=6)
        outputs = [pair.generate([{"prompt_token_ids": p}], few)[0] for p in prompts]
        assert (pe.eplb.num_steps, pe.eplb.rearranged_at) == (4, [3])
        assert (ce.eplb.num_steps, ce.eplb.rearranged_at) == (16, [3, 6, 9, 12, 15])
        reference = _generate(LLM(model=case.folder, num_kv_blocks=64), prompts, few)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    finally:
        pe.shutdown()
        ce.shutdown()


class _ThreadRanks:
    """What an engine asks of its DP group for an expert group, for ranks that are threads of
    this process: each connects its own gloo group at once (both are built concurrently)."""

    def __init__(self, rank: int, size: int, store):
        self.rank, self.size, self.store = rank, size, store

    def all_reduce_min(self, values: list[int]) -> list[int]:
        raise RuntimeError("no vote here: these ranks are PROMPT or COMPLETION engines")

    def expert_group(self, size: int) -> TorchExpertGroup:
        group = TorchExpertGroup(self.rank, size, timeout_s=60)
        group.connect(dist.PrefixStore("ep/", self.store))
        return group


def test_a_pe_with_ep1_hands_off_to_a_ce_with_ep2(case):
    """One PE holds every expert; a CE of two ranks (threads here, stepping in lockstep as a CE
    group does) holds half each plus a replica, and rearranges every 5 steps. The PE hands
    requests to both CE ranks: the K/V is per-rank attention state, so the hand-off does not
    see the EP sizes. Tokens equal transformers'."""
    from pdinfer.engine.completion_engine import CompletionEngine
    from pdinfer.engine.pd_pair import PDPair
    from pdinfer.engine.prefill_engine import PrefillEngine

    store = dist.HashStore()
    ce_args = dict(data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=2, eplb_interval=5)

    def build(rank: int) -> CompletionEngine:
        args = EngineArgs(model=case.folder, engine_type="completion", num_kv_blocks=64, **ce_args)
        return CompletionEngine(args, dp_group=_ThreadRanks(rank, 2, store))

    with ThreadPoolExecutor(2) as pool:
        ce0, ce1 = pool.map(build, range(2))
    pe = PrefillEngine(EngineArgs(model=case.folder, engine_type="prompt", num_kv_blocks=64))
    beside = ThreadPoolExecutor(1)
    try:
        assert ce0.model_runner.moe_layers[0].experts.gate_up_proj.shape[0] == 5  # (8 + 2) / 2
        assert pe.eplb is None and pe.model_runner.moe_layers == []  # EP 1, no replicas: untouched
        prompts = _prompts(PROMPT_LENS + (33, 9))
        pairs = (PDPair(pe, ce0), PDPair(pe, ce1))
        for i, prompt in enumerate(prompts):  # rank 0 gets four requests, rank 1 two
            pairs[int(i % 3 == 2)].add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
        final = {}
        while any(e.has_unfinished_requests() for e in (pe, ce0, ce1)):
            pe.step()
            ce1_step = beside.submit(ce1.step)  # the CE group's lockstep: one step for one
            outputs = ce0.step() + ce1_step.result()
            final.update({o.request_id: o for o in outputs if o.finished})
        case.check(prompts, [final[f"r{i}"] for i in range(len(prompts))], "EP1 -> EP2")
        assert ce0.eplb.rearranged_at == ce1.eplb.rearranged_at != []
        assert ce0.eplb.stats.num_slots_received + ce1.eplb.stats.num_slots_received > 0
    finally:
        beside.shutdown()
        for engine in (pe, ce0, ce1):
            engine.shutdown()


def test_expert_parallelism_needs_a_dp_group_and_a_moe_model(case, tiny_model):
    from pdinfer.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="needs a DP group"):
        LLMEngine(EngineArgs(model=case.folder, num_kv_blocks=16, expert_parallel_size=2, data_parallel_size=2))
    model, tokenizer = tiny_model
    with pytest.raises(ValueError, match="need a mixture-of-experts model"):
        LLM(model=model, tokenizer=tokenizer, load_format="dummy", num_kv_blocks=16, num_redundant_experts=2)
