"""One engine class, three roles: the seed's invariants, the hook order, fork_seq and n > 1,
a plain ``LLMEngine`` of each role (the role is a component built from ``EngineArgs``) and the
in-process shape of a P/D hand-off. Model output is checked against transformers."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import pytest
import torch
from conftest import assert_blocks_back

from pdinfer import EngineArgs, EngineType, LLMEngine, SamplingParams, env
from pdinfer.core.outputs import SchedulerOutputs
from pdinfer.engine.pd_pair import PDPair
from pdinfer.engine.roles import CompletionRole, NormalRole, PrefillRole

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL = dict(kv_cache_memory=640 << 20)

HOOKS = [
    "post_schedule",
    "should_copy_state",
    "do_copy_state",
    "do_save_kvcache",
    "pe_prepare_save_kvcache",
    "finalize_seq",
    "post_process",
    "pe_do_save_kvcache",
    "send_processed_prompts",
]


class Traced(LLMEngine):
    """Records every hook call (and each launch) in order; behaviour is the base class's."""

    def __init__(self, *args, copy_state_for_all=False, **kwargs):
        self.trace: list[str] = []
        self.pd_split_saw_cache = None
        self.copy_all = copy_state_for_all
        super().__init__(*args, **kwargs)

    def init_pd_split(self):
        self.trace.append("init_pd_split")
        self.pd_split_saw_cache = self.model_runner.cache is not None and not hasattr(self, "scheduler")
        super().init_pd_split()

    def _launch(self, plan, in_flight=None):
        inflight = super()._launch(plan, in_flight)
        if inflight is not None:
            self.trace.append("launch")
        return inflight

    def should_copy_state(self, seq):
        self.trace.append("should_copy_state")
        return self.copy_all

    def do_save_kvcache(self, scheduled, finished):
        self.trace.append("do_save_kvcache")
        super().do_save_kvcache(scheduled, finished)


def _traced_method(name):
    def method(self, *args, **kwargs):
        self.trace.append(name)
        return getattr(LLMEngine, name)(self, *args, **kwargs)

    return method


for _name in [
    "post_schedule",
    "do_copy_state",
    "pe_prepare_save_kvcache",
    "finalize_seq",
    "post_process",
    "pe_do_save_kvcache",
    "send_processed_prompts",
]:
    setattr(Traced, _name, _traced_method(_name))


def engine(role=EngineType.NORMAL, cls=LLMEngine, copy_state_for_all=False, **kwargs):
    if role is not EngineType.NORMAL:
        kwargs.setdefault("kv_transfer", {"connector": "local"})  # a CE listens at its own name
    args = EngineArgs(engine_type=role, **{**SMALL, **kwargs})
    if cls is Traced:
        return Traced(args, copy_state_for_all=copy_state_for_all)
    return cls(args)


def run_all(e):
    outputs = {}
    while e.has_unfinished_requests():
        for out in e.step():
            outputs[out.request_id] = out
    return outputs


@pytest.fixture(autouse=True)
def _zos_off_unless_asked(monkeypatch):
    # exact per-step hook order; tests that want the overlap set it to 1
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "0")


# --- invariants of the seed ----------------------------------------------------------------------
def test_engine_type_ints_are_validated():
    assert [EngineType.from_int(i) for i in (0, 1, 2)] == [EngineType.NORMAL, EngineType.PROMPT, EngineType.COMPLETION]
    for bad in (3, -1, True, "1", 1.0):
        with pytest.raises(ValueError):
            EngineType.from_int(bad)
    assert EngineType.parse("completion") is EngineType.COMPLETION
    with pytest.raises(ValueError):
        EngineArgs(engine_type=7)
    assert [r.default_zero_overhead_scheduling for r in EngineType] == [True, False, True]


def test_role_defaults_yield_to_an_operator_env(monkeypatch):
    monkeypatch.delenv("PDINFER_ZERO_OVERHEAD_SCHEDULING")
    assert EngineArgs(engine_type="prompt").zero_overhead_scheduling is False
    assert EngineArgs(engine_type="normal").zero_overhead_scheduling is True
    assert EngineArgs(engine_type="prompt").zero_overhead_scheduling is False  # not sticky
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1")
    assert EngineArgs(engine_type="prompt").zero_overhead_scheduling is True  # operator wins


def test_child_processes_do_not_inherit_role_defaults(monkeypatch):
    """A role default exported by an in-process engine is not an operator's choice for a child."""
    monkeypatch.delenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", raising=False)
    EngineArgs(engine_type="normal")
    assert os.environ["PDINFER_ZERO_OVERHEAD_SCHEDULING"] == "1"  # the seed's setdefault
    assert "PDINFER_ZERO_OVERHEAD_SCHEDULING" not in env.child_environ()
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "0")  # the operator's own value
    EngineArgs(engine_type="normal")
    assert env.child_environ({"X": "1"})["PDINFER_ZERO_OVERHEAD_SCHEDULING"] == "0"


def test_prompt_engine_idle_step_is_an_empty_prompt_run():
    pe = engine(EngineType.PROMPT)
    plan = pe.scheduler.schedule()
    assert plan is not None and plan.prompt_run and plan.is_empty
    assert pe.step() == []


def test_prompt_engine_refuses_a_decode_step(monkeypatch):
    pe = engine(EngineType.PROMPT)
    monkeypatch.setattr(pe.scheduler, "schedule", lambda: SchedulerOutputs(prompt_run=False))
    with pytest.raises(RuntimeError, match="PROMPT engine scheduled a decode step"):
        pe.step()


def test_completion_engine_refuses_recompute_preemption_and_context_parallel():
    with pytest.raises(ValueError, match="no prefill channel"):
        engine(EngineType.COMPLETION, stop_preempted_request=False)
    with pytest.raises(ValueError, match="context parallelism is refused"):
        engine(EngineType.COMPLETION, context_parallel_size=2)
    assert EngineArgs(engine_type="completion").stop_preempted_request is True


def test_prompt_never_finalizes_while_normal_does():
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    counts = {}
    for role in (EngineType.PROMPT, EngineType.NORMAL):
        e = engine(role, cls=Traced)
        ce = engine(EngineType.COMPLETION) if role is EngineType.PROMPT else None
        for rid in ("waiting", "prefilled"):
            e.add_request(rid, prompt, GREEDY, reservation=ce.admit(rid, prompt, GREEDY) if ce else None)
        e.abort_request("waiting")  # the next plan carries it as finished
        e.step()  # prefills the other (a PE pushes it to the CE)
        e.abort_request("prefilled")
        e.step()  # the plan carries it as finished (on a PE: its hand-off was failed at once)
        counts[role] = e.trace.count("finalize_seq")
        assert_blocks_back(e)
        if ce is not None:
            run_all(ce)  # the PE's aborts free the CE's reservations
            assert_blocks_back(ce)
            ce.shutdown()
        e.shutdown()
    assert counts == {EngineType.PROMPT: 0, EngineType.NORMAL: 2}


class RunWhenWaited(Future):
    """Work that runs only when someone waits for it: the latest an asynchronous copy (a CUDA side
    stream, a helper thread) may finish."""

    def __init__(self, work):
        super().__init__()
        self._work = work

    def result(self, timeout=None):
        if not self.done():
            try:
                self.set_result(self._work())
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
                self.set_exception(exc)
        return super().result(timeout)


class LateCopies(Traced):
    """Copies every decode sequence's state through the engine's executor, each copy completing
    only when waited for; ``do_save_kvcache`` records the snapshot it finds next to the live K/V."""

    def __init__(self, args):
        super().__init__(args, copy_state_for_all=True)
        submit_call = self.executor.submit_call
        self.executor.submit_call = lambda fn, *a: RunWhenWaited(lambda: submit_call(fn, *a).result())
        self.copied_num_tokens: dict[int, int] = {}
        self.seen: list[tuple] = []

    def do_copy_state(self, seqs):
        self.copied_num_tokens = {seq.seq_id: seq.num_computed_tokens - 1 for seq in seqs}
        super().do_copy_state(seqs)

    def do_save_kvcache(self, scheduled, finished):
        super().do_save_kvcache(scheduled, finished)
        cache = self.model_runner.require_cache()
        for seq in scheduled:
            num_tokens, copy = self.copy_state.get(seq.seq_id, (None, None))
            self.seen.append((self.copied_num_tokens[seq.seq_id], num_tokens, copy, cache.read_blocks(seq.block_table)))


def test_copied_state_is_synchronised_before_do_save_kvcache(monkeypatch, prompt_ids):
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1")  # the copy races the forward
    e = LateCopies(EngineArgs(**SMALL))
    assert e.zero_overhead
    for i, ids in enumerate(prompt_ids[:3]):
        e.add_request(str(i), {"prompt_token_ids": ids}, GREEDY)
    run_all(e)
    assert len(e.seen) >= 3 * (GREEDY.max_tokens - 1)  # every decode step of every sequence
    bs = e.cache_config.block_size
    for copied_num_tokens, num_tokens, copy, live in e.seen:
        assert num_tokens == copied_num_tokens  # this step's snapshot: not missing, not the last step's
        positions = torch.arange(num_tokens)
        got = copy[positions // bs, :, :, positions % bs]
        want = live[positions // bs, :, :, positions % bs]
        assert torch.equal(got, want) and got.abs().sum() > 0


# --- the hook order ----------------------------------------------------------------------------------
PREFILL_STEP = ["post_schedule", "launch", "pe_prepare_save_kvcache", "post_process", "pe_do_save_kvcache"]
DECODE_STEP = ["post_schedule", "should_copy_state", "launch", "do_save_kvcache", "post_process"]


def _split_steps(trace):
    steps, current = [], []
    for call in trace:
        if call == "post_schedule" and current:
            steps.append(current)
            current = []
        current.append(call)
    return steps + [current]


def test_hook_order_normal():
    e = engine(cls=Traced)
    e.add_request("r", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=3))
    run_all(e)
    assert "init_pd_split" not in e.trace
    steps = _split_steps(e.trace)
    assert steps[0] == PREFILL_STEP
    assert steps[1] == DECODE_STEP and steps[2] == DECODE_STEP
    # the finished sequence is finalized in the next step's pre_sampler_sync, before post_process
    assert steps[3] == ["post_schedule", "do_save_kvcache", "finalize_seq"]


def test_hook_order_prompt():
    e = engine(EngineType.PROMPT, cls=Traced)
    assert e.trace == ["init_pd_split"] and e.pd_split_saw_cache
    ce = engine(EngineType.COMPLETION)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    e.add_request("r", prompt, GREEDY, reservation=ce.admit("r", prompt, GREEDY))
    e.step()
    assert _split_steps(e.trace[1:]) == [PREFILL_STEP + ["send_processed_prompts"]]
    run_all(PDPair(e, ce))
    e.shutdown()
    ce.shutdown()


def test_hook_order_with_zero_overhead_scheduling(monkeypatch):
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1")
    e = engine(cls=Traced)
    e.add_request("r", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=3))
    run_all(e)
    steps = _split_steps(e.trace)
    # post_process of step N runs after step N+1 was launched and its pre_sampler_sync ran
    assert steps[0] == ["post_schedule", "launch", "pe_prepare_save_kvcache"]
    assert steps[1] == [
        "post_schedule",
        "should_copy_state",
        "launch",
        "do_save_kvcache",
        "post_process",
        "pe_do_save_kvcache",
    ]


class OverlapProbe(LLMEngine):
    """Records, at the start of each forward, whether the previous step's post_process has run
    by then; waits for it a while first (it runs on the helper thread meanwhile)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.processed: set[int] = set()
        self.saw_previous: list[bool] = []
        self._cond = threading.Condition()
        execute, last = self.model_runner.execute, []

        def probed_execute(inp):
            if last and all(self.saw_previous):
                with self._cond:  # host work that waits for this forward would never come
                    self.saw_previous.append(self._cond.wait_for(lambda: last[-1] in self.processed, 30))
            last.append(inp.step_id)
            return execute(inp)

        self.model_runner.execute = probed_execute

    def post_process(self, inflight, result):
        outputs = super().post_process(inflight, result)
        with self._cond:
            self.processed.add(inflight.inp.step_id)
            self._cond.notify_all()
        return outputs


def test_cpu_zero_overhead_scheduling_processes_step_n_during_step_n_plus_1(monkeypatch, reference):
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1")
    e = engine(cls=OverlapProbe)
    assert e.executor.forward_on_caller  # the CPU flavour: the forward runs on this thread
    ids = [5, 6, 7, 8, 9]
    e.add_request("r", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outputs = run_all(e)
    # The helper thread processed each step while the next forward was running (before the fix
    # it waited for the step lock, so processing ran after that forward, never beside it).
    assert len(e.saw_previous) == 5 and all(e.saw_previous)
    assert outputs["r"].outputs[0].token_ids == reference(ids, 6)
    assert_blocks_back(e)


# --- fork_seq, n > 1 and the P/D shape --------------------------------------------------------------
def _prefill_one(e, ids, params=GREEDY, rid="parent"):
    seq = e.add_request(rid, {"prompt_token_ids": ids}, params)
    outputs = e.step()
    assert e.scheduler.running == [seq] and len(seq.output_token_ids) == 1
    return seq, outputs


def test_forks_share_blocks_then_copy_and_follow_forced_tokens(prompt_ids, reference):
    ids = next(p for p in prompt_ids if len(p) % 16 not in (0, 15))
    e = engine(cls=Traced)
    parent, _ = _prefill_one(e, ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3))
    first = parent.output_token_ids[0]
    alternatives = [t for t in parent.output_logprobs[0] if t != first][:2]
    free_before = e.get_num_free_blocks()
    forks = [e.fork_request(parent, request_id=f"fork{i}", replace_last_token_id=t) for i, t in enumerate(alternatives)]
    assert e.get_num_free_blocks() == free_before  # the forks share every block
    e.step()
    assert e.get_num_free_blocks() == free_before - len(forks)  # each copied the partial block
    outputs = run_all(e)
    assert outputs["parent"].outputs[0].token_ids == reference(ids, 10)
    for i, t in enumerate(alternatives):
        got = outputs[f"fork{i}"].outputs[0].token_ids
        assert got == [t] + reference(ids + [t], 9)
    assert_blocks_back(e)


class CountingPrefill(LLMEngine):
    prefill_tokens = decode_tokens = 0

    def post_schedule(self, outputs):
        if outputs.prompt_run:
            self.prefill_tokens += outputs.num_batched_tokens
        else:
            self.decode_tokens += outputs.num_batched_tokens


def test_n_outputs_compute_the_prompt_once(prompt_ids):
    ids = prompt_ids[3]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    runs = []
    for _ in range(2):
        e = engine(cls=CountingPrefill)
        e.add_request("r", {"prompt_token_ids": ids}, params)
        out = run_all(e)["r"]
        assert e.prefill_tokens == len(ids)
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 16 for c in out.outputs)
        runs.append([c.token_ids for c in out.outputs])
        assert_blocks_back(e)
    assert runs[0] == runs[1]  # seeded
    assert len({tuple(t) for t in runs[0]}) == 3  # the three outputs differ


@pytest.mark.parametrize("zos", [False, True])
def test_n_outputs_of_one_token_each_all_come_back(prompt_ids, reference, monkeypatch, zos):
    """n = 3, max_tokens = 1: output 0 ends on its first token, in the same step that samples
    the other two; they must still be made, and the request end (greedy: transformers' next
    token, three times)."""
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1" if zos else "0")
    e = engine()
    for i, ids in enumerate(prompt_ids[:3]):
        e.add_request(f"r{i}", {"prompt_token_ids": ids}, SamplingParams(n=3, temperature=0.0, max_tokens=1))
    outputs = run_all(e)
    for i, ids in enumerate(prompt_ids[:3]):
        out = outputs[f"r{i}"]
        assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [reference(ids, 1)] * 3
        assert {c.finish_reason for c in out.outputs} == {"length"}
    assert not e.requests
    assert_blocks_back(e)


def test_a_fork_that_stops_on_its_first_token_leaves_the_others_running(prompt_ids):
    """n = 2, seeded: with output 1's first token made a stop token id (one output 0 never
    samples), output 1 is that one token and output 0 is what it was without the stop token."""
    ids = prompt_ids[3]
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    e = engine(cls=CountingPrefill)
    e.add_request("free", {"prompt_token_ids": ids}, params)
    free = [c.token_ids for c in run_all(e)["free"].outputs]
    stop = free[1][0]
    assert stop not in free[0]  # else this seed tests something else: pick another
    e.decode_tokens = 0
    e.add_request("stopped", {"prompt_token_ids": ids}, params.clone(stop_token_ids=[stop]))
    out = run_all(e)["stopped"]
    assert [c.token_ids for c in out.outputs] == [free[0], [stop]]
    assert [c.finish_reason for c in out.outputs] == ["length", "stop"]
    # Only output 0 decodes after the prefill: its 11 tokens after the first (the stopped fork,
    # taken back into the decode batch, would double that, writing to blocks it had freed).
    assert e.decode_tokens == len(free[0]) - 1
    assert not e.requests
    assert_blocks_back(e)


def _run_with_zos(requests, **engine_args) -> dict:
    """Zero-overhead scheduling on: ``requests`` (id, prompt ids, params) added together, run."""
    os.environ["PDINFER_ZERO_OVERHEAD_SCHEDULING"] = "1"  # the autouse fixture restores it
    e = engine(**engine_args)
    assert e.zero_overhead
    for request_id, ids, params in requests:
        e.add_request(request_id, {"prompt_token_ids": ids}, params)
    outputs = run_all(e)
    assert not e.requests
    assert_blocks_back(e)
    return {request_id: [c.token_ids for c in out.outputs] for request_id, out in outputs.items()}


def test_forks_of_a_parent_preempted_with_its_first_tokens_in_flight(reference):
    """Zero-overhead scheduling, 4 KV blocks: the decode step after B's prefill preempts B
    (n = 2) while its two first tokens are in flight; when they land, the fork of a parent
    with nothing computed recomputes like its parent (it once raised ValueError)."""
    a, b = list(range(100, 132)), list(range(200, 232))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = _run_with_zos([("A", a, params), ("B", b, params.clone(n=2))], num_kv_blocks=4)
    assert got == {"A": [reference(a, 8)], "B": [reference(b, 8)] * 2}


def test_a_forks_first_write_never_lands_in_a_published_block():
    """Zero-overhead scheduling fills B's output 0's last prompt block with its first token and
    publishes it to the prefix cache; the fork, held back by max_num_seqs, joins after output 0
    was preempted (the block's only reference left) and must copy the block before writing its
    own first token into that slot. B's outputs then equal B's alone (seeded), output 0's
    recompute included, which hits that block."""
    a, b = [7, *range(500, 515)], list(range(1000, 1031))
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=30, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = _run_with_zos([("A", a, greedy), ("B", b, params)], num_kv_blocks=6, max_num_seqs=2)
    alone = _run_with_zos([("B", b, params)], num_kv_blocks=64)
    assert got["B"] == alone["B"]


def test_a_preempted_sequence_queues_behind_a_chunked_prompt_under_way(reference):
    """8 blocks of 16, chunks of 32: A (80 tokens) decodes while B (60) is mid-prefill holding 3
    blocks; A's decode finds no block and is preempted. Put back ahead of B it needed 6 blocks
    with 5 free, and B could not go on behind it: nothing ran again. Behind B, B completes and
    ends, then A recomputes and ends (transformers' tokens for both)."""
    os.environ["PDINFER_ZERO_OVERHEAD_SCHEDULING"] = "1"  # NORMAL's default; the fixture restores it
    e = engine(num_kv_blocks=8, chunked_prefill=True, max_num_batched_tokens=32)
    a, b = list(range(100, 180)), list(range(300, 360))
    e.add_request("A", {"prompt_token_ids": a}, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    e.add_request("B", {"prompt_token_ids": b}, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    outputs = {}
    for _ in range(500):  # about 50 steps; a stalled queue never ends
        if not e.has_unfinished_requests():
            break
        for out in e.step():
            outputs[out.request_id] = out
    assert not e.has_unfinished_requests(), f"stalled: waiting {list(e.scheduler.waiting)}"
    assert e.scheduler.num_preemptions >= 1  # the case under test happened
    assert outputs["A"].outputs[0].token_ids == reference(a, 40)
    assert outputs["B"].outputs[0].token_ids == reference(b, 1)
    assert_blocks_back(e)


def test_requests_ended_by_preemption_leave_nothing_behind():
    """stop_preempted_request (a CE's rule): under block pressure the latest arrivals end with
    the preemption error; like every ended sequence they must leave no per-sequence state in
    the engine (blocks, the step builder's last samples), and the others finish normally."""
    e = engine(num_kv_blocks=6, stop_preempted_request=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        e.add_request(f"r{i}", {"prompt_token_ids": list(range(100 * (i + 1), 100 * (i + 1) + 20))}, params)
    outputs = run_all(e)
    assert e.scheduler.num_preemptions >= 1
    ended = [out for out in outputs.values() if out.error]
    assert ended and all("preempted" in out.error for out in ended)
    assert any(out.error is None and len(out.outputs[0].token_ids) == 40 for out in outputs.values())
    assert not e.step_builder.last_sample
    assert_blocks_back(e)


def test_aborting_an_n_request_before_its_forks_ends_it():
    """Aborted before its prompt ran, an n = 2 request ends at once (no forks will come): its
    state goes, its id is free again."""
    e = engine()
    e.add_request("a", "Hello", SamplingParams(n=2, max_tokens=4))
    e.abort_request("a")
    out = run_all(e)["a"]
    assert out.finished and out.error == "aborted"
    assert not e.requests
    e.add_request("a", "Hello", SamplingParams(n=2, max_tokens=4))  # the id is free again
    assert len(run_all(e)["a"].outputs) == 2
    assert_blocks_back(e)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=12, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_sequence_handed_to_a_completion_engine_decodes_without_prefill(prompt_ids, params):
    """The hand-off's shape by hand, with no connector: another engine's prefilled sequence,
    its K/V copied into this CE's blocks, decodes here (``fork_request``) without a prefill."""
    ids = prompt_ids[6]
    normal = engine()
    normal.add_request("r", {"prompt_token_ids": ids}, params)
    expected = run_all(normal)["r"].outputs[0].token_ids

    prefiller = engine()  # one prefill step, as a PE's
    seq, _ = _prefill_one(prefiller, ids, params, rid="r")
    ce = engine(EngineType.COMPLETION, cls=Traced)
    blocks = ce.block_manager.allocate_blocks(len(seq.block_table))
    ce.model_runner.cache.write_blocks(blocks, prefiller.model_runner.cache.read_blocks(seq.block_table))
    ce.fork_request(seq, blocks=blocks)
    out = run_all(ce)["r"]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].token_ids[0] == seq.output_token_ids[0]  # the first token is the prefill's
    assert "pe_prepare_save_kvcache" not in ce.trace  # no prefill step ran on the CE
    assert ce.trace.count("launch") == len(expected) - 1
    assert_blocks_back(ce)
    ce.shutdown()
    prefiller.abort_request("r")
    run_all(prefiller)
    assert_blocks_back(prefiller)


def test_plain_llm_engines_of_each_role_hand_off_like_normal(prompt_ids):
    """``LLMEngine(EngineArgs(engine_type=...))`` is a whole PE and a whole CE: the role is a
    component built from the args (no subclass), and a hand-off through them gives NORMAL's
    greedy tokens, every block back on both sides."""
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids[:4]]
    normal = engine()
    assert type(normal.role) is NormalRole
    expected = [out.outputs[0].token_ids for out in _generate(normal, prompts)]

    kv = {"connector": "local"}
    pe = LLMEngine(EngineArgs(engine_type=EngineType.PROMPT, kv_transfer=kv, **SMALL))
    ce = LLMEngine(EngineArgs(engine_type=EngineType.COMPLETION, kv_transfer=kv, **SMALL))
    assert type(pe) is type(ce) is LLMEngine
    assert isinstance(pe.role, PrefillRole) and isinstance(ce.role, CompletionRole)
    outputs = PDPair(pe, ce).generate(prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert all(out.error is None for out in outputs)
    assert pe.role.handoff_stats["count"] == len(prompts)
    assert not pe.role.handoffs and not ce.role.reservations
    assert_blocks_back(pe)
    assert_blocks_back(ce)
    pe.shutdown()
    ce.shutdown()


def _generate(e, prompts):
    for i, prompt in enumerate(prompts):
        e.add_request(str(i), prompt, GREEDY)
    outputs = run_all(e)
    return [outputs[str(i)] for i in range(len(prompts))]
