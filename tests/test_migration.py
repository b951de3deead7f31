"""Request migration, engine side: an output continued from its tokens so far (``Resume``).

A request that leaves an engine (its CE ran out of blocks, was drained or died) is added again
with the prompt and what its client has of the output; the new engine (a NORMAL one, or a PE
prefilling prompt + tokens so far for a CE) must go on exactly where the first would have:
greedy output equal to transformers' continuation, seeded output equal to the unmigrated run,
a structured output still valid, a stop string found across the move, no text shown twice.
The router's half, with real processes, is in test_migration_cluster.py.
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import PROMPTS, assert_blocks_back

from pdinfer import EngineArgs, LLMEngine, SamplingParams
from pdinfer.engine.completion_engine import CompletionEngine
from pdinfer.engine.detokenizer import Detokenizer
from pdinfer.engine.output_tracker import OutputTracker
from pdinfer.engine.pd_pair import PDPair
from pdinfer.engine.prefill_engine import PrefillEngine
from pdinfer.outputs import RequestDelta, Resume, SeqDelta

MEM = 512 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=40, ignore_eos=True, logprobs=2)


def run(engine, deadline_s: float = 120.0) -> dict:
    outs, end = {}, time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < end, "the engine did not finish"
        for out in engine.step():
            outs[out.request_id] = out
    return outs


@pytest.fixture(scope="module")
def normal():
    engine = LLMEngine(EngineArgs(kv_cache_memory=MEM, max_model_len=512))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def pair():
    pe = PrefillEngine(EngineArgs(engine_type="prompt", kv_cache_memory=MEM, max_model_len=512))
    ce = CompletionEngine(EngineArgs(engine_type="completion", kv_cache_memory=MEM, max_model_len=512))
    yield PDPair(pe, ce)
    pe.shutdown()
    ce.shutdown()


def _generate(engine, request_id: str, prompt_ids: list[int], params: SamplingParams, resume=None):
    engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params, resume=resume)
    return run(engine)[request_id].outputs[0]


@pytest.mark.parametrize("cut", [1, 17])
def test_a_resumed_greedy_output_goes_on_as_transformers_does(normal, pair, prompt_ids, reference, cut):
    """Cut transformers' greedy continuation after ``cut`` tokens and resume from there, on a
    NORMAL engine and through a PE -> CE hand-off (the PE prefills prompt + tokens so far):
    the rest is transformers' rest, and only the rest is reported."""
    ids = prompt_ids[3]
    expected = reference(ids, GREEDY.max_tokens)
    resume = Resume(token_ids=expected[:cut])
    out = _generate(normal, f"n-{cut}", ids, GREEDY, resume)
    assert out.token_ids == expected and out.finish_reason == "length"
    pair.add_request(f"pd-{cut}", {"prompt_token_ids": ids}, GREEDY, resume=resume)
    outs = run(pair)
    assert outs[f"pd-{cut}"].outputs[0].token_ids == expected, outs[f"pd-{cut}"].error
    assert_blocks_back(normal)
    assert_blocks_back(pair.pe)
    assert_blocks_back(pair.ce)


def test_a_resumed_seeded_output_equals_the_unmigrated_run(normal, pair, prompt_ids):
    """The random stream is keyed by (seed, position): resumed mid-way, on this engine or a
    P/D pair, a seeded output draws what it would have drawn, log-probs included."""
    ids = prompt_ids[0]
    whole = _generate(normal, "s-whole", ids, SEEDED)
    for cut in (1, 23):
        resume = Resume(token_ids=whole.token_ids[:cut])
        resumed = _generate(normal, f"s-{cut}", ids, SEEDED, resume)
        assert resumed.token_ids == whole.token_ids
        for got, want in zip(resumed.logprobs[cut:], whole.logprobs[cut:], strict=True):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
        pair.add_request(f"s-pd-{cut}", {"prompt_token_ids": ids}, SEEDED, resume=resume)
        assert run(pair)[f"s-pd-{cut}"].outputs[0].token_ids == whole.token_ids


def test_each_output_of_n_resumes_on_its_own_random_stream(normal, prompt_ids):
    """n > 1: output i draws from its own stream (the request's seed forked by i); resumed
    alone (n = 1, ``index`` i), it goes on as it would have."""
    ids = prompt_ids[1]
    params = SamplingParams(n=3, temperature=1.0, seed=77, max_tokens=20, ignore_eos=True)
    normal.add_request("n3", {"prompt_token_ids": ids}, params)
    outputs = run(normal)["n3"].outputs
    one = params.clone(n=1)
    for out in outputs:
        for cut in (0, 5):  # 0: an output that had no token yet when its request left
            resumed = _generate(normal, f"n3-{out.index}-{cut}", ids, one, Resume(out.token_ids[:cut], out.index))
            assert resumed.index == out.index and resumed.token_ids == out.token_ids


def test_a_structured_output_resumed_mid_json_is_still_valid(normal, pair, tokenizer):
    """The grammar's matcher replays the tokens so far: cut mid-JSON, the output still
    completes the same valid JSON; tokens the grammar refuses are a clear error."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "ages": {"type": "array", "items": {"type": "integer"}}},
        "required": ["name", "ages"],
    }
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": schema})
    ids = tokenizer("Give the name and ages of three children as JSON:").input_ids
    whole = _generate(normal, "j-whole", ids, params)
    assert whole.finish_reason == "stop", whole.text  # the grammar completed
    value = json.loads(whole.text)
    assert set(value) == {"name", "ages"}
    cut = len(whole.token_ids) // 2
    resumed = _generate(normal, "j-half", ids, params, Resume(whole.token_ids[:cut]))
    assert resumed.text == whole.text
    pair.add_request("j-pd", {"prompt_token_ids": ids}, params, resume=Resume(whole.token_ids[:cut]))
    out = run(pair)["j-pd"].outputs[0]
    assert json.loads(out.text) == value
    not_json = normal.tokenizer("Hello there").input_ids
    with pytest.raises(ValueError, match="structured output"):
        normal.add_request("j-bad", {"prompt_token_ids": ids}, params, resume=Resume(not_json))
    assert_blocks_back(normal)


@pytest.mark.parametrize(
    "params, resume, message",
    [
        (SamplingParams(n=2, max_tokens=8), Resume([5]), "n must be 1"),
        (SamplingParams(max_tokens=8, prompt_logprobs=1), Resume([5]), "prompt_logprobs"),
        (SamplingParams(max_tokens=3), Resume([5, 6, 7]), "nothing is left"),
        (SamplingParams(max_tokens=8), Resume([5], index=-1), "resume.index"),
        (SamplingParams(max_tokens=8), Resume([10**9]), "token ids"),
    ],
    ids=["n", "prompt_logprobs", "no_room", "index", "token"],
)
def test_a_resume_that_cannot_be_one_is_refused(normal, params, resume, message):
    with pytest.raises(ValueError, match=message):
        normal.add_request("bad", {"prompt_token_ids": [1, 2, 3]}, params, resume=resume)
    assert "bad" not in normal.requests
    assert_blocks_back(normal)


def test_the_client_side_goes_on_from_what_its_client_saw(tokenizer):
    """The tracker of a resumed output rebuilds its text from the tokens so far: a stop string
    that spans the move is found, and the text the first engine held back (a stop string's
    possible start, never shown) is shown now, the rest not again."""
    detok = Detokenizer(tokenizer)
    prompt_ids = tokenizer(PROMPTS[1]).input_ids
    text = " Paris. It is the capital and the largest city of France."
    tokens = tokenizer(text, add_special_tokens=False).input_ids
    params = SamplingParams(stop=["largest city"], max_tokens=64)
    # Unmigrated: where the stop string cuts, and what a stream shows before that.
    plain = OutputTracker("a", None, prompt_ids, params, detok, show_token_ids=True)
    plain.apply(RequestDelta("a", [SeqDelta(0, tokens)]))
    expected = plain.output().outputs[0].text
    assert expected == " Paris. It is the capital and the "
    cut = len(tokenizer(" Paris. It is the capital and the larg", add_special_tokens=False).input_ids) - 1
    before = OutputTracker("b", None, prompt_ids, params, detok, show_token_ids=True)
    before.apply(RequestDelta("b", [SeqDelta(0, tokens[:cut])]))
    seen = "".join(d.text for d in before.take_shown())
    assert seen and len(seen) < len(before.choices[0].text)  # a stop string's length is held back
    after = OutputTracker("c", None, prompt_ids, params, detok, show_token_ids=True)
    after.resume(Resume(tokens[:cut], num_shown_chars=len(seen)))
    stopped = after.apply(RequestDelta("c", [SeqDelta(0, tokens[cut:])]))
    shown = after.take_shown()
    assert stopped == [0]
    assert seen + "".join(d.text for d in shown) == expected
    assert [t for d in shown for t in d.token_ids] == tokens[cut : len(shown[0].token_ids) + cut]
    assert after.output().outputs[0].text == expected


def test_a_request_that_leaves_a_ce_waits_in_the_kv_store(pair, prompt_ids, reference, tmp_path):
    """A CE with a KV store saves the full blocks of a request it gives up (here a stopped
    preemption: a 12-block CE, two requests that outgrow it), and a PE that recomputes the
    request loads them instead of computing them: its output is still transformers'."""
    store = str(tmp_path / "store")
    small_ce = CompletionEngine(
        EngineArgs(engine_type="completion", num_kv_blocks=12, max_model_len=512, kv_store=store)
    )
    store_pe = PrefillEngine(EngineArgs(engine_type="prompt", kv_cache_memory=MEM, max_model_len=512, kv_store=store))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        ids = [prompt_ids[3], prompt_ids[6]]  # 12 blocks hold one of them to its end, not both
        first = PDPair(pair.pe, small_ce)
        for i, p in enumerate(ids):
            first.add_request(f"leave-{i}", {"prompt_token_ids": p}, params)
        outs = run(first)
        given_up = [i for i in range(2) if outs[f"leave-{i}"].outputs[0].finish_reason == "error"]
        assert len(given_up) == 1, [o.outputs[0].finish_reason for o in outs.values()]
        victim = given_up[0]
        so_far = outs[f"leave-{victim}"].outputs[0].token_ids
        assert small_ce.kv_store.flush(timeout=30)
        assert_blocks_back(small_ce)
        second = PDPair(store_pe, pair.ce)
        second.add_request("back", {"prompt_token_ids": ids[victim]}, params, resume=Resume(so_far))
        out = run(second)["back"].outputs[0]
        assert out.token_ids == reference(ids[victim], params.max_tokens)
        computed = len(ids[victim]) + len(so_far) - 1  # whose K/V was computed before it left
        assert store_pe.kv_store.stats()["loaded_blocks"] >= computed // 16 - 1
        assert_blocks_back(store_pe)
    finally:
        small_ce.shutdown()
        store_pe.shutdown()


def test_the_router_resumes_what_each_output_has_and_nothing_that_ended():
    """The router's record of a job (``PDJob``): n = 3, output 1 finished, outputs 0 and 2 were
    given up by their CE after some tokens (they reach the record without a finish). The next
    attempts resume output 0, then output 2, each alone (n = 1) from its own tokens and text,
    with the job's fixed seed and no prompt log-probs."""
    import asyncio

    from pdinfer.serving.pd_job import PDJob
    from pdinfer.serving.pd_protocol import OutputDelta

    job = PDJob(0, "r", [1, 2, 3], {"n": 3, "max_tokens": 9, "prompt_logprobs": 2}, asyncio.Queue())
    seed = job.sampling["seed"]
    assert isinstance(seed, int)  # an unseeded request gets one, so a resumed output keeps its stream
    job.start_attempt()
    assert job.resume is None and job.body()["sampling"]["n"] == 3 and "resume" not in job.body()
    job.deliver([OutputDelta(0, "a", [10]), OutputDelta(1, "b", [20]), OutputDelta(2, "cc", [30])])
    job.deliver([OutputDelta(0, "d", [11], None), OutputDelta(1, "e", [21], "length")])
    job.deliver([OutputDelta(2, "f", [31])])
    assert not job.done
    job.start_attempt()
    body = job.body()
    assert body["resume"] == {"token_ids": [10, 11], "index": 0, "num_shown_chars": 2}
    assert body["sampling"] == {"n": 1, "max_tokens": 9, "prompt_logprobs": None, "seed": seed}
    assert body["request_id"] == "r-a2"
    job.deliver([OutputDelta(0, "g", [12], "length")])
    job.start_attempt()
    assert job.body()["resume"] == {"token_ids": [30, 31], "index": 2, "num_shown_chars": 3}
    job.deliver([OutputDelta(2, "h", [32], "stop")])
    assert job.done and job.next_resume() is None
    assert [job.progress[i].token_ids for i in range(3)] == [[10, 11, 12], [20, 21], [30, 31, 32]]
