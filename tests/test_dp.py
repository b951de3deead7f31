"""Data parallelism with real processes: the NORMAL vote across rank processes (gloo on CPU),
the DP front (load balancing, outputs, streaming), `LLM(data_parallel_size=2)` against one
engine, and a rank killed mid-run.

Most tests share one DP-2 front over a tiny random-weight Llama (fast steps; the real tokenizer,
so text prompts work). Step logs (PDINFER_STEP_LOG, one file per rank) are compared per test
from the line each rank had reached when the test began.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from conftest import PROMPTS
from dp_helpers import (
    TINY_CONFIG,
    WAIT_S,
    Client,
    alive,
    children,
    ids,
    long_params,
    quiesce,
    step_logs,
    two_free_ports,
    wait_gone,
)
from servers import Server

from pdinfer import EngineArgs, SamplingParams
from pdinfer.distributed.dp_front import DPFront, DPOptions
from pdinfer.distributed.messages import OutputDecoder, OutputEncoder
from pdinfer.distributed.replica_lb import ReplicaLoadBalancer
from pdinfer.outputs import CompletionOutput, RequestOutput

ALL_INTERVAL, ANY_INTERVAL = 50, 5
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from pdinfer import env
    from pdinfer.models.loader import resolve_model

    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    tokenizer, _ = resolve_model(None, env.get("PDINFER_CACHE_DIR"))
    return str(folder), tokenizer


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


# --- pure pieces ---------------------------------------------------------------------------------
def test_load_balancer_scores_by_hand():
    lb = ReplicaLoadBalancer(2, kv_token_weight=0.25, request_weight_tokens=16)
    assert [lb.choose(10) for _ in range(2)] == [0, 1]  # idle: round robin
    lb.assign("a", 0, 100)  # rank 0: 100 queued prompt tokens
    assert lb.choose(10) == 1
    lb.assign("b", 1, 40)
    lb.progress("b", 1)  # b decodes: 0.25 * 41 + 16 = 26.25 < 100
    assert lb.score(1) == pytest.approx(26.25)
    assert lb.choose(10) == 1
    lb.progress("a", 1)  # a decodes too: 0.25 * 101 + 16 = 41.25 > 26.25
    assert lb.choose(10) == 1
    lb.set_capacity(1, 50)  # rank 1 holds 41 KV tokens of 50: a 10-token prompt does not fit
    assert lb.choose(10) == 0
    lb.release("a")
    lb.release("b")
    assert lb.score(0) == lb.score(1) == 0


def test_output_deltas_round_trip_with_a_trimmed_stop_string():
    enc, dec = OutputEncoder(), OutputDecoder()
    texts = [("Hello wor", [1, 2]), ("Hello world STO", [1, 2, 3, 4]), ("Hello world", [1, 2, 3, 4])]
    for i, (text, tokens) in enumerate(texts):
        last = i == len(texts) - 1
        out = RequestOutput(
            "r", None, [5], [CompletionOutput(0, text, tokens, finish_reason="stop" if last else None)], finished=last
        )
        dec.apply(enc.encode(out))
        assert [(c.text, c.token_ids) for c in dec.snapshot()] == [(text, tokens)]


_GROUP_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pdinfer.distributed.dp_group import TorchDPGroup, DPGroupError
    rank, port, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    group = TorchDPGroup(rank, 2, "127.0.0.1", port, timeout_s=3.0)
    group.join(120)
    print("min", group.all_reduce_min([rank, 5 - rank]), flush=True)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL if how == "die" else signal.SIGSTOP)
    try:
        for _ in range(1000):
            group.all_reduce_min([0])
            time.sleep(0.01)
    except DPGroupError as exc:
        print("failed:", exc, flush=True)
        # As dp_rank.py does: skip interpreter teardown, where gloo, destroying a pair whose
        # receive timed out, sometimes aborts (SIGABRT) after the error was raised and reported.
        os._exit(3)
""")


def test_the_rendezvous_store_listens_on_its_host_only():
    """TCPStore's own server listens on every interface; ours is bound to the host given
    (127.0.0.2 is loopback too, so a store on every interface would answer there)."""
    import socket

    from pdinfer.distributed.dp_group import host_store

    store = host_store("127.0.0.1")
    store.set("k", "v")
    assert store.get("k") == b"v"
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.2", store.port))
    with socket.socket() as s:
        s.connect(("127.0.0.1", store.port))


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_collective_with_a_dead_or_stuck_peer_fails_within_the_group_timeout(how):
    from pdinfer.distributed.dp_group import host_store

    store = host_store("127.0.0.1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GROUP_SCRIPT, str(r), str(store.port), how], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=WAIT_S)  # a hang here fails the test
        assert "min [0, 4]" in out
        assert procs[0].returncode == 3 and "failed: DP rank 0/2: all-reduce failed" in out
    finally:
        for p in procs:
            p.kill()
            p.wait()


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


# --- LLM(data_parallel_size=2) and `pdinfer serve --data-parallel-size 2` --------------------------
def _choices(outputs) -> list:
    return [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def _compare_dp2_with_one_engine(prompts, **engine_kwargs) -> None:
    from pdinfer import LLM

    single = LLM(**engine_kwargs)
    dp = LLM(data_parallel_size=2, **engine_kwargs)
    try:
        for params in (
            SamplingParams(temperature=0.0, max_tokens=16),
            SamplingParams(temperature=1.0, seed=7, max_tokens=16, n=2),
        ):
            want = single.generate(prompts, params, use_tqdm=False)
            got = dp.generate(prompts, params, use_tqdm=False)
            assert _choices(got) == _choices(want)
            assert {o.extra["dp_rank"] for o in got} == {0, 1}  # both ranks took part
    finally:
        dp.engine.shutdown()


def test_dp2_llm_output_equals_one_engine(tiny_model):
    model, tokenizer = tiny_model
    _compare_dp2_with_one_engine(
        PROMPTS, model=model, tokenizer=tokenizer, load_format="dummy", max_model_len=512, num_kv_blocks=64
    )


@pytest.mark.slow
def test_dp2_llm_output_equals_one_engine_on_the_default_model():
    _compare_dp2_with_one_engine(PROMPTS[:6], max_model_len=512, kv_cache_memory=256 << 20)


def test_pdinfer_serve_data_parallel_streams_and_recovers_from_a_killed_rank(tiny_model, tmp_path):
    model, tokenizer = tiny_model
    server = Server(
        [
            "serve",
            "--data-parallel-size",
            "2",
            "--model",
            model,
            "--tokenizer",
            tokenizer,
            "--load-format",
            "dummy",
            "--max-model-len",
            "256",
            "--num-kv-blocks",
            "32",
        ],
        tmp_path / "serve.log",
    ).start()
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    pids: list[int] = []
    try:
        plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [
                json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines() if line.startswith("data: {")
            ]
        assert "".join(chunks) == plain["choices"][0]["text"] and len(chunks) >= 2
        metrics = httpx.get(f"{server.url}/metrics").text.splitlines()
        total = [line for line in metrics if line.startswith("pdinfer_kv_cache_total_blocks")]
        assert total and float(total[0].split()[-1]) == 2 * 32  # summed over the ranks
        pids = children(server.proc.pid)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        server.wait_healthy(WAIT_S)  # /health is 503 until the new generation is up
        deadline = time.monotonic() + WAIT_S
        while (new := children(server.proc.pid)) == pids or len(new) != 2:
            assert time.monotonic() < deadline, "the group was not restarted"
            time.sleep(0.5)
        server.wait_healthy(WAIT_S)
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert again["choices"][0]["text"] == plain["choices"][0]["text"]
        pids += new
    finally:
        server.stop()
    assert not wait_gone(pids), "rank processes outlived `pdinfer serve`"


@pytest.mark.slow
def test_ranks_of_another_host_join_through_an_agent_and_restart_with_the_group(tiny_model, tmp_path):
    from servers import pdinfer_command

    model, tokenizer = tiny_model
    port = two_free_ports()
    with open(tmp_path / "agent.log", "w") as log:  # "host 1": rank 1, started by its agent
        agent = subprocess.Popen(
            pdinfer_command()
            + [
                "serve",
                "--headless",
                "--data-parallel-size",
                "2",
                "--data-parallel-size-local",
                "1",
                "--dp-rank-offset",
                "1",
                "--dp-master-port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    args = EngineArgs(
        model=model, tokenizer=tokenizer, load_format="dummy", data_parallel_size=2, max_model_len=256, num_kv_blocks=32
    )
    front = DPFront(args, DPOptions(master_port=port, num_local_ranks=1))
    front.start()
    remote: list[int] = []
    try:
        front.wait_ready(WAIT_S)
        client = Client(front)
        client.submit("remote", "Hello", long_params(4), rank=1)
        client.wait(lambda: "remote" in client.final, "a request on the agent's rank")
        first = client.final["remote"]
        assert first.error is None and first.extra["dp_rank"] == 1
        remote = children(agent.pid)
        assert len(remote) == 1
        os.kill(remote[0], signal.SIGKILL)  # the remote rank dies: the whole group restarts
        deadline = time.monotonic() + WAIT_S
        while front.generation < 1 or not front.is_healthy:
            assert time.monotonic() < deadline, "the group did not restart"
            time.sleep(0.2)
        client.submit("again", "Hello", long_params(4), rank=1)
        client.wait(lambda: "again" in client.final, "a request after the restart")
        assert client.final["again"].outputs[0].token_ids == first.outputs[0].token_ids
        remote += children(agent.pid)
    finally:
        front.shutdown()
        code = agent.wait(60)
    assert code == 0  # the front told it to stop
    assert not wait_gone(remote)
