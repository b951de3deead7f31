"""The P/D router: its load balancers (pure Python, hand-computed expectations), then a real
1P2D cluster (three `pdinfer serve` processes and `pdinfer router`, the real `openai` client):
bad requests, a CE killed under load, and the same CE restarted on its port."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest
import surface_checks
import tool_checks
from conftest import PROMPTS
from fake_engines import FakeCE, ScriptedEngine
from openai_errors import assert_openai_error, check_malformed_inputs, post_json
from servers import Server, free_port, pdinfer_command, wait_for

from pdinfer.core.block_manager import ROOT_HASH, chain_hash
from pdinfer.serving.load_balancer import (
    Assignment,
    DecodeBalancer,
    Engine,
    PrefillBalancer,
    PrefixIndex,
    block_hashes,
    bucket_of,
)

ENGINE = ["--kv-cache-memory", "512MiB", "--max-model-len", "1024"]
MODEL = "SmolLM2-135M-Instruct"


# --- load balancers ---------------------------------------------------------------------------------
def _engines(role: str, n: int) -> list[Engine]:
    return [Engine(f"http://pe{i}" if role == "prefill" else f"http://ce{i}", role, healthy=True) for i in range(n)]


def test_buckets_and_chained_block_hashes():
    assert [bucket_of(n) for n in (1, 511, 512, 2047, 2048, 8191, 8192, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 3]
    ids = list(range(40))  # two full blocks of 16, 8 tokens left over
    first = chain_hash(ROOT_HASH, ids[:16])
    assert block_hashes(ids) == [first, chain_hash(first, ids[16:32])]
    assert block_hashes(ids[:15]) == []
    index = PrefixIndex(capacity_blocks=3)
    index.add(block_hashes(ids))
    assert index.cached_tokens(block_hashes(ids + [7] * 20)) == 32
    assert index.cached_tokens(block_hashes([99] + ids)) == 0  # same blocks, other prefix
    index.add(block_hashes([5] * 32))  # 2 more hashes: the oldest one is evicted (LRU)
    assert len(index) == 3 and index.cached_tokens(block_hashes(ids)) == 0
    index.resize(1)  # as many hashes as the PE has KV blocks: the most recent one stays
    assert len(index) == 1 and index.cached_tokens(block_hashes([5] * 32)) == 0
    assert index.cached_tokens(block_hashes(ids)) == 0


def test_decode_balancer_orders_by_requests_then_kv_tokens():
    ces = _engines("decode", 3)
    lb = DecodeBalancer(ces)
    a = lb.assign(ces[0], 100)
    b = lb.assign(ces[1], 10)
    # ce2 is empty; then ce1 (1 request, 10 tokens) before ce0 (1 request, 100 tokens)
    assert [e.url for e in lb.candidates()] == ["http://ce2", "http://ce1", "http://ce0"]
    lb.assign(ces[2], 5).add_tokens(200)
    assert [e.url for e in lb.candidates()] == ["http://ce1", "http://ce0", "http://ce2"]
    b.add_tokens(95)  # ce1 now holds 105 tokens: more than ce0
    assert [e.url for e in lb.candidates()][:2] == ["http://ce0", "http://ce1"]
    a.release()
    a.release()  # idempotent
    assert (ces[0].in_flight, ces[0].kv_tokens) == (0, 0)
    ces[0].healthy = False
    assert [e.url for e in lb.candidates(exclude={"http://ce1"})] == ["http://ce2"]


def test_prefill_balancer_balances_within_the_bucket_and_prefers_cached_prefixes():
    pes = _engines("prefill", 2)
    lb = PrefillBalancer(pes, prefix_tolerance_tokens=100)
    long_prompt = list(range(1000))  # bucket 1
    first = lb.pick(long_prompt)
    assert first.engine is pes[0] and pes[0].queued_tokens[1] == 1000
    # a short prompt (bucket 0) sees no load in its bucket on either PE: least total wins (pe1)
    short = lb.pick([7] * 100)
    assert short.engine is pes[1] and pes[1].queued_tokens[0] == 100
    # the same long prompt again: pe0 holds its 62 full blocks (992 tokens), but its bucket-1
    # load (1000) is more than pe1's (0) + tolerance (100): the least loaded PE wins
    again = lb.pick(long_prompt)
    assert again.engine is pes[1] and again.tokens == 1000
    first.release()
    # now pe0 has 0 queued bucket-1 tokens, pe1 1000; both hold the prefix: pe0 is also least
    third = lb.pick(long_prompt + [1, 2, 3])
    assert third.engine is pes[0] and third.tokens == 1003 - 992
    third.release()
    again.release()
    # within tolerance: pe1 holds the prefix and has 50 queued bucket-1 tokens, pe0 none
    other = list(range(5000, 5600))
    lb.pick(other, exclude={"http://pe0"}).release()  # pe1 learns this prefix
    pes[1].queued_tokens[1] = 50
    chosen = lb.pick(other + [9])
    assert chosen.engine is pes[1] and chosen.tokens == 601 - 592


def test_prefill_balancer_skips_unhealthy_and_returns_none_without_engines():
    pes = _engines("prefill", 2)
    lb = PrefillBalancer(pes)
    pes[0].healthy = False
    assert lb.pick([1] * 20).engine is pes[1]
    pes[1].healthy = False
    assert lb.pick([1] * 20) is None
    assert isinstance(Assignment(pes[0], 3, bucket=0), Assignment) and pes[0].queued_tokens[0] == 3


# --- a real 1P2D cluster behind the router ----------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    ces = [Server(["serve", "--role", "completion", *ENGINE], tmp / f"ce{i}.log") for i in range(2)]
    # A short waiting queue on the PE: a burst of prompts meets its back-pressure.
    pe = Server(["serve", "--role", "prompt", *ENGINE, "--kv-lease-s", "5", "--max-waiting", "8"], tmp / "pe.log")
    engines = [pe, *ces]
    router = Server(
        ["router", "--prefill", pe.url, "--decode", ces[0].url, ces[1].url, "--health-interval-s", "0.5"],
        tmp / "router.log",
    )
    try:
        for server in engines:
            server.start(wait=False)
        for server in engines:
            server.wait_healthy()
        router.start()
        wait_for(lambda: all(e["healthy"] for e in engines_seen(router.url)), "all in rotation")
        yield {"router": router, "pe": pe, "ces": ces, "tmp": tmp}
    finally:
        for server in (router, pe, *ces):  # ces[1] may have been replaced by a restart
            server.stop()


def engines_seen(router_url: str) -> list[dict]:
    return httpx.get(f"{router_url}/debug/engines", timeout=10).json()


def metric(router_url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples whose line starts with ``name``."""
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("completions", {"model": MODEL, "max_tokens": 4}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": 123}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [1] * 1025}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "word " * 1100}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": CHAT, "n": 0}, 400, "n"),
]


def test_bad_requests_get_4xx_and_the_router_keeps_serving(cluster):
    url = cluster["router"].url
    for path, body, status, param in BAD_REQUESTS:
        resp = httpx.post(f"{url}/v1/{path}", json=body, timeout=60)
        assert resp.status_code == status, (body, resp.text)
        error = resp.json()["error"]
        assert error["message"] and error["param"] == param, (body, error)
    resp = httpx.post(
        f"{url}/v1/completions", content=b"{not json", timeout=60, headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 4
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_malformed_input_gets_400_in_openai_shape_from_the_router(cluster):
    """Issue 24: lone surrogates (a 500 before: the router's tokenizer and JSON encoder refuse
    them), NaN, seeds past int64, unreadable bodies; 404 and 405 in OpenAI's shape too."""
    url = cluster["router"].url
    check_malformed_inputs(url, MODEL, None)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_router_refuses_max_tokens_past_the_context(cluster):
    body = {"model": MODEL, "prompt": [1] * 1000, "max_tokens": 100, "ignore_eos": True}
    assert_openai_error(post_json(f"{cluster['router'].url}/v1/completions", body), 400)


def test_router_without_engines_answers_503_with_retry_after(tmp_path):
    nothing = f"http://127.0.0.1:{free_port()}"
    router = Server(["router", "--normal", nothing], tmp_path / "router.log").start(wait=False)
    try:
        wait_for(lambda: _health_is_503(router.url), "the router listening")
        resp = post_json(f"{router.url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert assert_openai_error(resp, 503)["code"] == "no_engine" and resp.headers["retry-after"] == "1"
    finally:
        router.stop()


def _health_is_503(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 503
    except httpx.TransportError:
        return False


def test_structured_outputs_and_logit_bias_through_pe_and_ce(cluster):
    """The PE samples the first token under the grammar, the CE continues it: the JSON validates;
    n = 2 sampled choices both do. A bad schema is a 400 from the router."""
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Name a city and its rank."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, max_tokens=60, n=2, temperature=0.8, seed=3
    )
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        client.chat.completions.create(model=MODEL, messages=messages, response_format=bad, max_tokens=4)


def test_tool_calls_through_pe_and_ce(cluster):
    """Tool calling behind the router: the PE's first token obeys the tool grammar, the CE
    continues it, the router reads the calls (tool_checks.py), LangChain included."""
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="unused", max_retries=0, timeout=300)
    tool_checks.check_forced_choices(client)
    tool_checks.check_auto_reads_the_calls_the_model_writes(client)
    tool_checks.check_bad_tool_requests(client)
    tool_checks.check_langchain_round_trip(f"{cluster['router'].url}/v1", "unused")
    tool_checks.check_langchain_structured_output(f"{cluster['router'].url}/v1", "unused")
    for server in (cluster["pe"], *cluster["ces"]):
        assert server.wait_blocks_back()["free_blocks"] == server.kv()["total_blocks"]


@pytest.fixture(scope="module")
def normal_llm(cluster):
    """The reference: a NORMAL engine in this process (built once the cluster is up)."""
    from conftest import make_llm

    return make_llm(kv_cache_memory=512 << 20, max_model_len=1024)


def test_pd_through_the_router_returns_llm_token_ids(cluster, normal_llm):
    """A token-id prompt through PE -> CE behind the router: with ``return_token_ids`` the answer
    lists NORMAL's greedy tokens (how the GPU run compares outputs without a tokenizer)."""
    from pdinfer import SamplingParams

    prompt = [7, 300, 1200, 45, 9000, 12, 77, 4096]
    expected = (
        normal_llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert out.choices[0].model_extra["token_ids"] == expected
    assert out.choices[0].model_extra["prompt_token_ids"] == prompt


def test_prompt_token_ids_and_continuous_usage_through_pe_and_ce(cluster, tokenizer):
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="unused", max_retries=0, timeout=300)
    surface_checks.check_prompt_token_ids(client, tokenizer)
    surface_checks.check_continuous_usage(client)


def test_min_tokens_guided_names_and_partial_character_logprobs_through_pe_and_ce(cluster):
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="unused", max_retries=0, timeout=300)
    surface_checks.check_min_tokens(client)
    surface_checks.check_guided_names(client)
    surface_checks.check_partial_character_logprobs(client)
    surface_checks.check_one_finish_per_choice(client)


def test_a_batch_larger_than_the_pes_queue_is_served_whole(cluster, normal_llm):
    """40 prompts in one request, against a PE that queues 8 (``--max-waiting``): a full PE is
    back-pressure, so every prompt is answered (a 503 "no prefill engine" before), with
    NORMAL's greedy text, and every engine gets its blocks back."""
    from pdinfer import SamplingParams

    prompts = [f"Count from {i} to {i + 3}:" for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    want = [o.outputs[0].text for o in normal_llm.generate(prompts, params, use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == want
    for server in (cluster["pe"], *cluster["ces"]):
        assert server.wait_blocks_back()["free_blocks"] == server.kv()["total_blocks"]


def test_prompt_logprobs_and_echo_through_pe_and_ce(cluster, normal_llm):
    """The PE computes the prompt log-probs in its prefill and answers them to the router, which
    puts them in the answer (before any token): NORMAL's (LLM's) values, per choice; echo with
    log-probs streams the prompt first; chat's are on the response; every block comes back."""
    from pdinfer import SamplingParams

    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    ref = normal_llm.generate([prompt], params, use_tqdm=False)[0]
    chat_ref = normal_llm.chat(CHAT, params.clone(prompt_logprobs=0), use_tqdm=False)[0]
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        n=2,
        temperature=0,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True},
    )
    assert [c.text for c in out.choices] == [ref.outputs[0].text] * 2
    for choice in out.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ref.prompt_logprobs)
        for entry, want in zip(got[1:], ref.prompt_logprobs[1:]):
            assert list(entry) == [str(t) for t in want]
            assert [item["logprob"] for item in entry.values()] == pytest.approx(list(want.values()), abs=1e-4)
    chunks = [
        c.choices[0]
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=0, stream=True
        )
        if c.choices
    ]
    assert chunks[0].text.startswith(prompt) and "".join(c.text for c in chunks) == prompt + ref.outputs[0].text
    ids = ref.prompt_token_ids
    head = chunks[0].logprobs.token_logprobs[: len(ids)]
    assert head[0] is None
    assert head[1:] == pytest.approx([ref.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))], abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    chat_got = chat.model_extra["prompt_logprobs"]
    assert len(chat_got) == len(chat_ref.prompt_logprobs) == chat.usage.prompt_tokens
    assert [next(iter(e.values()))["logprob"] for e in chat_got[1:]] == pytest.approx(
        [next(iter(e.values())) for e in chat_ref.prompt_logprobs[1:]], abs=1e-4
    )
    for server in (cluster["pe"], *cluster["ces"]):
        kv = server.wait_blocks_back()
        assert kv["free_blocks"] == kv["total_blocks"], server.url


def _stream_all(url: str, prompts: list[str], max_tokens: int, results: dict) -> None:
    """One thread per request: results[i] = ("completed", tokens) or ("error", message)."""

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            stream = client.completions.create(
                model=MODEL,
                prompt=prompts[i],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            usage = [chunk.usage for chunk in stream if chunk.usage]
            results[i] = ("completed", usage[0].completion_tokens)
        except openai.APIError as exc:
            results[i] = ("error", str(exc))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    results["threads"] = threads


def test_killed_ce_under_load_every_request_ends_and_new_ones_succeed(cluster):
    url, (survivor, victim) = cluster["router"].url, cluster["ces"]
    retries_before = metric(url, "pdinfer_router_retries_total")
    results: dict = {}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    _stream_all(url, prompts, 48, results)

    def victim_state() -> dict:
        return next(e for e in engines_seen(url) if e["url"] == victim.url)

    # kill it once it decodes: its routed tokens grow past the prompts it holds
    wait_for(lambda: victim_state()["in_flight"] > 0, "requests on the victim")
    prompt_tokens = victim_state()["kv_tokens"]
    wait_for(lambda: victim_state()["kv_tokens"] > prompt_tokens + 4, "the victim decoding")
    victim.kill()
    for t in results["threads"]:
        t.join(180)  # bounded: a hung request fails the test here
    assert not any(t.is_alive() for t in results["threads"])
    outcomes = [results[i] for i in range(len(prompts))]
    for kind, value in outcomes:
        assert kind == "completed" and value == 48 or kind == "error" and "engine" in value, value
    # the victim's requests were retried elsewhere or ended with a clear error
    errors = sum(kind == "error" for kind, _ in outcomes)
    assert errors + metric(url, "pdinfer_router_retries_total") - retries_before > 0
    assert metric(url, 'pdinfer_router_ejections_total{engine="' + victim.url) >= 1
    assert not victim_state()["healthy"]
    # new requests succeed on the surviving CE
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    for prompt in PROMPTS[:3]:
        assert (
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).usage.completion_tokens
            == 6
        )
    for server in (survivor, cluster["pe"]):
        kv = server.wait_blocks_back()
        assert kv["free_blocks"] == kv["total_blocks"]


def test_restarted_ce_on_the_same_port_comes_back_into_rotation(cluster):
    url, victim = cluster["router"].url, cluster["ces"][1]
    if victim.proc is not None and victim.proc.poll() is None:
        victim.kill()  # this test also stands alone
    restarted = Server(["serve", "--role", "completion", *ENGINE], cluster["tmp"] / "ce1b.log", port=victim.port)
    cluster["ces"][1] = restarted
    restarted.start()
    wait_for(
        lambda: next(e for e in engines_seen(url) if e["url"] == victim.url)["healthy"],
        "the restarted CE back in rotation",
    )
    routed = f'pdinfer_router_requests_routed_total{{engine="{victim.url}",role="decode"}}'
    before = metric(url, routed)

    async def burst() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            outs = await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=8, temperature=0)
                    for i in range(6)
                )
            )
            return [o.usage.completion_tokens for o in outs]
        finally:
            await client.close()

    assert asyncio.run(burst()) == [8] * 6
    assert metric(url, routed) > before  # the PE re-handshook with the new instance
    kv = restarted.wait_blocks_back()
    assert kv["free_blocks"] == kv["total_blocks"]


def test_a_late_health_answer_ejects_only_an_engine_whose_streams_are_silent(monkeypatch):
    """Three health checks in a row that time out eject a silent engine; an engine whose streams
    sent the router bytes within the last check window stays in (the late answer is the busy
    router's). The engine is a real socket that accepts and never answers."""
    from pdinfer.serving import router_pool
    from pdinfer.serving.load_balancer import Engine
    from pdinfer.serving.router_pool import EnginePool, RouterMetrics

    monkeypatch.setattr(router_pool, "_HEALTH_TIMEOUT_S", 0.05)

    async def run() -> tuple[bool, bool]:
        servers = [await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0) for _ in range(2)]
        urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
        silent, streaming = Engine(urls[0], "normal", healthy=True), Engine(urls[1], "decode", healthy=True)
        async with httpx.AsyncClient() as client:
            pool = EnginePool([silent, streaming], client, RouterMetrics("m"), interval_s=0.05)
            for _ in range(router_pool._MAX_SLOW_CHECKS):
                streaming.last_heard_s = time.monotonic()  # a token came through its stream
                await pool.check_all()
        for server in servers:
            server.close()
        return silent.healthy, streaming.healthy

    assert asyncio.run(run()) == (False, True)


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    with open(path) as f:
        return [int(c) for c in f.read().split()]


def test_router_workers_share_the_port_and_die_with_their_parent(cluster, tmp_path):
    """``--workers 2``: two router processes accept on one port; concurrent streams through it
    give the one-process router's greedy texts; killing the parent takes the worker with it."""
    urls = ["--prefill", cluster["pe"].url, "--decode", *[ce.url for ce in cluster["ces"]]]
    router = Server(["router", *urls, "--workers", "2", "--health-interval-s", "0.5"], tmp_path / "r2.log").start()
    try:
        [worker] = _children(router.proc.pid)
        wait_for(lambda: all(e["healthy"] for e in engines_seen(router.url)), "the workers' engines in rotation")
        prompts = [f"Count from {i} to {i + 5}:" for i in range(8)]
        one = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="unused", max_retries=0, timeout=300)
        expected = [
            one.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts
        ]
        two = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=300)
        got = [
            two.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts
        ]
        assert got == expected
        results: dict = {}
        _stream_all(router.url, prompts, 8, results)
        for t in results.pop("threads"):
            t.join(timeout=300)
            assert not t.is_alive(), "a stream never ended"
        assert results == {i: ("completed", 8) for i in range(len(prompts))}
        router.proc.kill()
        router.proc.wait(30)
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{worker}") and _state(worker) != "Z":
            assert time.monotonic() < deadline, "the worker outlived its parent"
            time.sleep(0.1)
    finally:
        router.stop()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_a_connection_dropped_before_the_answer_is_retried_and_a_refusal_is_relayed(tmp_path):
    """A NORMAL engine that drops one connection without answering keeps its place in rotation
    and the request succeeds on a new connection; an engine that answers 503 with Retry-After
    has that answer relayed as it is when no other engine can take the request."""
    engine = ScriptedEngine(["drop", "ok", "busy"])
    router = Server(["router", "--normal", engine.url, "--health-interval-s", "0.5"], tmp_path / "router.log")
    try:
        router.start()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert out.choices[0].text == "scripted" and engine.posts == 2
        assert [e["healthy"] for e in engines_seen(router.url)] == [True]
        resp = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "7"
        assert resp.json()["error"]["code"] == "overloaded"
    finally:
        router.stop()
        engine.stop()


# --- a real PE, a scripted CE: what the engines hear when a client leaves ---------------------------
@pytest.fixture(scope="module")
def fake_ce_router(cluster):
    """The cluster's PE and a ``FakeCE`` behind a router of their own (one attempt)."""
    ce = FakeCE()
    pe = cluster["pe"]
    router = Server(
        ["router", "--prefill", pe.url, "--decode", ce.url, "--max-attempts", "1", "--health-interval-s", "0.5"],
        cluster["tmp"] / "fake_ce_router.log",
    )
    try:
        router.start()
        wait_for(lambda: all(e["healthy"] for e in engines_seen(router.url)), "the fake CE in rotation")
        yield router, ce, pe
    finally:
        router.stop()
        ce.stop()


def _leave_after(url: str, stream: bool, seconds: float) -> None:
    """A client that sends a completion request and goes away ``seconds`` later."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as resp:
            assert resp.status_code == 200
            time.sleep(seconds)
        return
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=seconds)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_leaves_during_the_prefill_makes_the_pe_abort_it(fake_ce_router, stream):
    """The PE holds the request (its handshake with the CE takes 10 s) when the client leaves:
    the router closes the CE's stream and the PE's connection, and the PE aborts the request at
    once. Without that it would end it with an error when the handshake timed out, as nobody's
    prefill; an abort is counted only for the former."""
    router, ce, pe = fake_ce_router
    ce.mode = "reserve"
    aborted, closed = pe.kv()["num_aborted"], ce.closed
    _leave_after(router.url, stream, 1.5)
    wait_for(lambda: ce.closed > closed, "the router to close the CE's stream", timeout_s=10)
    wait_for(lambda: pe.kv()["num_aborted"] > aborted, "the PE to abort the prefill", timeout_s=8)
    kv = pe.wait_blocks_back()
    assert kv["free_blocks"] == kv["total_blocks"]


def test_a_client_that_leaves_before_the_reservation_closes_the_ce_stream(fake_ce_router):
    """The CE answered /pd/decode but its reservation has not come when the client leaves: the
    router closes that stream (else the CE would hold the reservation until its timeout)."""
    router, ce, _ = fake_ce_router
    ce.mode = "silent"
    closed = ce.closed
    _leave_after(router.url, False, 1.5)
    wait_for(lambda: ce.closed > closed, "the router to close the CE's stream", timeout_s=10)


def test_a_request_the_ce_finished_before_the_pe_answered_is_not_aborted_on_the_pe(fake_ce_router):
    """The CE's output can be complete before its ack reaches the PE: the router then keeps the
    PE's connection open until the PE answers, and the PE, which aborts a prefill whose router
    left, carries on. (Here the CE finishes the request once the PE holds it, in its 10 s
    handshake with the CE.)"""
    router, ce, pe = fake_ce_router
    ce.mode = "finish"
    aborted = pe.kv()["num_aborted"]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1, "return_token_ids": True}
    resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == [87], resp.text
    # The PE lets the request go either way: aborted (the defect) or, 10 s on, at the end of its
    # handshake with the CE. Wait for its blocks to come back, then see which way it went.
    kv = pe.wait_blocks_back(timeout_s=60)
    assert kv["free_blocks"] == kv["total_blocks"]
    assert kv["num_aborted"] == aborted


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_the_ce_gave_up_goes_on_from_its_tokens(fake_ce_router, stream):
    """A CE out of blocks gives a request up after its first token (86): the router does not
    end the answer with an error (before request migration, a stream did) nor start it over;
    it asks the next CE to go on from that token (``resume``), and the client gets 86 then 87,
    each once, with one finish. Not counted as an attempt (this router allows one)."""
    router, ce, _ = fake_ce_router
    ce.mode = "preempt"  # token 86, then given up; the next /pd/decode: token 87
    num_bodies = len(ce.bodies)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "return_token_ids": True, "stream": stream}
    if not stream:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == [86, 87] and choice["text"] == " y x" and choice["finish_reason"] == "length"
    else:
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert not any("error" in e for e in events), events
        choices = [c for e in events for c in e["choices"]]
        assert [t for c in choices for t in c.get("token_ids") or []] == [86, 87]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
    first, second = ce.bodies[num_bodies:]
    assert "resume" not in first
    assert second["resume"] == {"token_ids": [86], "index": 0, "num_shown_chars": 2}
    assert second["prompt_token_ids"] == first["prompt_token_ids"]
    assert second["sampling"]["seed"] == first["sampling"]["seed"]  # the same random stream
    assert ce.mode == "finish"


def test_a_worker_whose_router_died_while_it_started_exits(tmp_path):
    """A worker sets its parent-death signal once it runs: a router that died before that never
    signals it, and it served on alone (one was found orphaned). It now checks that its parent
    is the router that started it, and ends at once otherwise."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        args = ["router", "--normal", "http://127.0.0.1:1", "--workers", "1", "--listen-fd", str(sock.fileno())]
        worker = subprocess.Popen(
            [*pdinfer_command(), *args, "--parent-pid", "1"],  # not its parent: as if the router had died
            pass_fds=(sock.fileno(),),
            stderr=open(tmp_path / "worker.log", "w"),
        )
        assert worker.wait(120) == 0, (tmp_path / "worker.log").read_text()
