"""Data parallelism with real processes, on one DP-2 front (`DPFront`) over a tiny random-weight
Llama (fast steps; the real tokenizer, so text prompts work): the NORMAL vote across rank
processes (gloo on CPU), load balancing and serving through `build_app`, and a rank killed
mid-run. The parts without a front are in test_dp_building_blocks.py; `LLM(data_parallel_size=2)`
and `pdinfer serve --data-parallel-size 2` in test_dp_llm_and_serve.py.

Step logs (PDINFER_STEP_LOG, one file per rank) are compared per test from the line each rank
had reached when the test began.
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
from dp_helpers import WAIT_S, Client, alive, ids, long_params, quiesce, step_logs

from pdinfer import EngineArgs
from pdinfer.distributed.dp_front import DPFront, DPOptions

ALL_INTERVAL, ANY_INTERVAL = 50, 5
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def front(tiny_model, tmp_path_factory):
    step_log = tmp_path_factory.mktemp("steps") / "steps.log"
    saved = dict(os.environ)
    os.environ.update(
        PDINFER_STEP_LOG=str(step_log),
        PDINFER_PREFILL_ATTEMPT_INTERVAL=str(ALL_INTERVAL),
        PDINFER_PREFILL_ANY_ATTEMPT_INTERVAL=str(ANY_INTERVAL),
    )
    model, tokenizer = tiny_model
    args = EngineArgs(
        model=model,
        tokenizer=tokenizer,
        load_format="dummy",
        data_parallel_size=2,
        max_model_len=512,
        num_kv_blocks=64,
        max_num_seqs=MAX_NUM_SEQS,
    )
    front = DPFront(args, DPOptions(timeout_s=20.0))
    front.step_log = step_log
    front.start()
    try:
        front.wait_ready(WAIT_S)
        yield front
    finally:
        pids = front.rank_pids()
        front.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        assert not [p for p in pids if alive(p)], "rank processes outlived the front"


# --- the vote across rank processes ----------------------------------------------------------------
def test_uneven_arrivals_identical_step_types_and_running_full_progresses(front):
    quiesce(front)
    start = [len(log) for log in step_logs(front)]
    client = Client(front)
    # Rank 0 gets five requests (more than its max_num_seqs=2: "running full, waiting
    # non-empty"), arriving while earlier ones decode; rank 1 gets one.
    client.submit("u0", ids(12, 100), long_params(30), rank=0)
    client.wait(lambda: client.tokens("u0") >= 3, "u0 to decode")
    client.submit("u1", ids(20, 200), long_params(20), rank=0)
    client.submit("u2", ids(7, 300), long_params(12), rank=0)
    client.submit("v0", ids(9, 400), long_params(25), rank=1)
    client.wait(lambda: client.tokens("u1") >= 2, "u1 to decode")
    client.submit("u3", ids(30, 500), long_params(10), rank=0)
    client.submit("u4", ids(5, 600), long_params(10), rank=0)
    client.wait(lambda: len(client.final) == 6, "every request to finish")
    for request_id, out in client.final.items():
        assert out.error is None and out.outputs[0].finish_reason == "length", request_id
    quiesce(front)
    logs = [log[s:] for log, s in zip(step_logs(front), start)]
    assert [t for t, _ in logs[0]] == [t for t, _ in logs[1]]  # same step type, every step
    steps = list(zip(logs[0], logs[1]))
    # rank 1 ran empty prefill steps alongside rank 0's prefills ...
    assert any(t0 == "prefill" and n0 > 0 and n1 == 0 for (t0, n0), (_, n1) in steps)
    # ... and no step was an empty prefill on both ranks (no loop while running is full)
    assert all(n0 + n1 > 0 for (t0, n0), (_, n1) in steps if t0 == "prefill")


def test_a_lone_request_on_one_rank_is_prefilled_by_the_any_point(front):
    quiesce(front)
    start = [len(log) for log in step_logs(front)]
    client = Client(front)
    # Rank 0 decodes two long requests (max_num_seqs) and has nothing waiting: it never
    # wants to prefill, so ALL points fail. Rank 1 decodes one and then gets a lone request.
    client.submit("a0", ids(10, 1000), long_params(300), rank=0)
    client.submit("a1", ids(10, 2000), long_params(300), rank=0)
    client.submit("b0", ids(10, 3000), long_params(300), rank=1)
    client.wait(lambda: min(client.tokens(r) for r in ("a0", "a1", "b0")) >= 10, "decoding")
    client.pump()
    a_at_arrival = client.tokens("a0")
    client.submit("lonely", ids(10, 4000), long_params(4), rank=1)
    client.wait(lambda: client.tokens("lonely") >= 1, "the lone request's first token")
    waited = client.tokens("a0") - a_at_arrival
    # Decode steps between its arrival and its first token: at most the ANY interval, plus a
    # few steps of message latency; without the ANY point it would wait ~300 steps.
    assert waited <= ANY_INTERVAL + 5, waited
    client.wait(lambda: len(client.final) == 4, "every request to finish")
    quiesce(front)
    logs = [log[s:] for log, s in zip(step_logs(front), start)]
    assert [t for t, _ in logs[0]] == [t for t, _ in logs[1]]


def test_the_front_balances_requests_and_serves_through_build_app(front):
    from pdinfer.serving import build_app

    quiesce(front)
    transport = httpx.ASGITransport(app=build_app(front, "tiny"))

    async def run():
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            health = (await http.get("/health")).json()
            body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
            plain = (await http.post("/v1/completions", json=body)).json()
            chunks = []
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:])["choices"][0]["text"])
            return health, plain, chunks

    import asyncio

    health, plain, chunks = asyncio.run(run())
    assert health["status"] == "ok"
    assert plain["usage"]["completion_tokens"] == 6 and "".join(chunks) == plain["choices"][0]["text"]
    assert front.stats.num_total_blocks == 2 * 64  # aggregated over the ranks
    # Without hints a burst is spread evenly: equal requests alternate between the ranks.
    client = Client(front)
    for i in range(4):
        client.submit(f"lb{i}", ids(16, 5000 + 100 * i), long_params(8))
    client.wait(lambda: len(client.final) == 4, "every request to finish")
    assert sorted(out.extra["dp_rank"] for out in client.final.values()) == [0, 0, 1, 1]


# --- a rank killed mid-run -------------------------------------------------------------------------
def test_killing_a_rank_ends_every_request_and_the_group_recovers(front):
    quiesce(front)
    client = Client(front)
    retryable = {f"f{i}": ids(8 + i, 7000 + 50 * i) for i in range(4)}
    params = long_params(200)
    for request_id, prompt in retryable.items():  # the healthy group's answers, for reference
        client.submit(f"{request_id}-ref", prompt, params, final_only=True)
    client.wait(lambda: len(client.final) == 4, "the reference run")
    reference = {r: client.final[f"{r}-ref"].outputs[0].token_ids for r in retryable}
    old_pids, generation = front.rank_pids(), front.generation
    assert len(old_pids) == 2
    # Streamed requests on both ranks, then final-only ones (what LLM sends) behind them.
    client.submit("s0", ids(10, 8000), long_params(400), rank=0)
    client.submit("s1", ids(10, 8100), long_params(400), rank=1)
    client.wait(lambda: client.tokens("s0") >= 3 and client.tokens("s1") >= 3, "streaming")
    for request_id, prompt in retryable.items():
        client.submit(request_id, prompt, params, final_only=True)
    client.wait(lambda: all(front.requests[r].rank is not None for r in retryable), "dispatch")
    os.kill(old_pids[1], signal.SIGKILL)
    client.wait(lambda: len(client.final) == 4 + 2 + 4, "every request to end")
    for request_id in ("s0", "s1"):  # they streamed: a clear error, with what they had
        out = client.final[request_id]
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert "rank 1 was killed by SIGKILL" in out.error and "not retried" in out.error
        assert len(out.outputs[0].token_ids) >= 3
    for request_id in retryable:  # nothing reached the consumer: retried, same tokens
        assert client.final[request_id].error is None
        assert client.final[request_id].outputs[0].token_ids == reference[request_id]
    front.wait_ready(WAIT_S)
    assert front.generation == generation + 1
    assert not [p for p in old_pids if alive(p)]  # killed and reaped, no orphans
    new_pids = front.rank_pids()
    assert len(new_pids) == 2 and not set(new_pids) & set(old_pids)
    client.submit("after", "Once upon a time", long_params(5))
    client.wait(lambda: "after" in client.final, "a request after the restart")
    assert client.final["after"].error is None
