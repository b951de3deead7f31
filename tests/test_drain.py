"""Draining an engine, with real processes: ``POST /admin/drain`` and serve's SIGTERM.

A drained CE sends its live requests away; the router resumes each on the other CE from what
its client has, and the client's stream goes on with no error: its text equals the same
request's unmigrated run. A drained engine refuses new requests with a 503 and says so on
/health, so a router's health checks take it out of rotation. SIGTERM drains first
(``--drain-timeout-s``): a request in flight ends whole, then serve exits 0.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from conftest import PROMPTS
from openai_errors import CHAT, assert_openai_error, post_json
from servers import Server, wait_for

from pdinfer import EngineArgs, LLMEngine, SamplingParams
from pdinfer.engine.inproc_client import InProcessEngineClient
from pdinfer.engine.pd_common import NoRoomError

MODEL = "SmolLM2-135M-Instruct"
ENGINE = ["--max-model-len", "512", "--num-kv-blocks", "160"]  # 16 answers of ~110 tokens fit one CE
NUM_STREAMS = 16
MAX_TOKENS = 96
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain")
    pe = Server(["serve", "--role", "prompt", *ENGINE], tmp / "pe.log")
    ces = [Server(["serve", "--role", "completion", *ENGINE], tmp / f"ce{i}.log") for i in range(2)]
    router = Server(
        ["router", "--prefill", pe.url, "--decode", ces[0].url, ces[1].url, "--health-interval-s", "0.5"],
        tmp / "router.log",
    )
    try:
        for server in (pe, *ces):
            server.start(wait=False)
        for server in (pe, *ces):
            server.wait_healthy()
        router.start()
        wait_for(lambda: all(e["healthy"] for e in _engines_seen(router)), "every engine in rotation")
        yield {"router": router, "pe": pe, "ces": ces}
    finally:
        for server in (router, pe, *ces):
            server.stop()


def _engines_seen(router: Server) -> list[dict]:
    return httpx.get(f"{router.url}/debug/engines", timeout=10).json()


def _metric(server: Server, pattern: str) -> float:
    """The sum of the samples of the metric lines that match ``pattern`` (a regex, from the start)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if re.match(pattern, line))


async def _complete(url: str, prompt: str, on_chunk=None) -> tuple[str, list[int], str | None, int]:
    """(text, token ids, finish reason, completion tokens) of one streamed greedy completion."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    text, ids, finishes, usage = "", [], [], 0
    async with client:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.text
                ids += getattr(choice, "token_ids", None) or []
                finishes += [choice.finish_reason] if choice.finish_reason else []
            if on_chunk is not None:
                on_chunk(len(ids))
    assert len(finishes) == 1, finishes  # one finish, at the end
    return text, ids, finishes[0], usage


def _prompts() -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(NUM_STREAMS)]


def test_a_drained_ce_hands_its_streams_to_the_other_ce(cluster):
    """16 streams through the router; once each has tokens, the CE holding the most requests is
    drained: its streams go on through the PE and the other CE, each ends with "length", no
    error, and the same text as its unmigrated run. The drained CE said how many requests it
    sent away and that none is left, answers /health and /pd/decode with 503, and every
    engine's KV blocks are free afterwards."""
    router, pe, ces = cluster["router"], cluster["pe"], cluster["ces"]
    prompts = _prompts()

    async def unmigrated():
        return await asyncio.gather(*[_complete(router.url, p) for p in prompts])

    expected = asyncio.run(asyncio.wait_for(unmigrated(), TIMEOUT_S))
    assert [finish for _, _, finish, _ in expected] == ["length"] * NUM_STREAMS
    migrations_before = _metric(router, r'pdinfer_router_migrations_total\{reason="drain"')
    counts = [0] * NUM_STREAMS

    async def drained_midway():
        tasks = [
            asyncio.ensure_future(_complete(router.url, p, lambda n, i=i: counts.__setitem__(i, n)))
            for i, p in enumerate(prompts)
        ]
        deadline = time.monotonic() + TIMEOUT_S
        while min(counts) < 1 and not any(t.done() for t in tasks):  # every stream has tokens
            assert time.monotonic() < deadline, counts
            await asyncio.sleep(0.05)
        used = [ce.kv()["total_blocks"] - ce.kv()["free_blocks"] for ce in ces]
        victim = ces[0] if used[0] >= used[1] else ces[1]
        answer = await asyncio.to_thread(httpx.post, f"{victim.url}/admin/drain", json={"timeout_s": 120}, timeout=180)
        return victim, answer, await asyncio.gather(*tasks)

    victim, answer, results = asyncio.run(asyncio.wait_for(drained_midway(), TIMEOUT_S))
    assert answer.status_code == 200, answer.text
    drained = answer.json()
    assert drained["draining"] is True and drained["remaining"] == 0, drained
    assert drained["migrated"] > 0, "the drained CE sent no request away (had every stream ended before the drain?)"
    assert [finish for _, _, finish, _ in results] == ["length"] * NUM_STREAMS
    assert [usage for *_, usage in results] == [MAX_TOKENS] * NUM_STREAMS
    assert [(text, ids) for text, ids, _, _ in results] == [(text, ids) for text, ids, _, _ in expected]
    assert _metric(router, r'pdinfer_router_migrations_total\{reason="drain"') - migrations_before >= 1

    health = httpx.get(f"{victim.url}/health", timeout=10)
    assert (health.status_code, health.json()["status"]) == (503, "draining")
    refused = httpx.post(
        f"{victim.url}/pd/decode", json={"request_id": "after-drain", "prompt_token_ids": [1, 2, 3]}, timeout=30
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_room", refused.text
    assert _metric(victim, r"pdinfer_engine_draining ") == 1
    assert _metric(victim, r"pdinfer_num_requests_migrated ") == drained["migrated"]
    wait_for(lambda: not next(e for e in _engines_seen(router) if e["url"] == victim.url)["healthy"], "ejected")
    for server in (pe, *ces):
        kv = server.wait_blocks_back()
        assert kv["free_blocks"] == kv["total_blocks"], (server.args, kv)


def _stream_in_background(url: str, prompt: str, max_tokens: int, api_key: str) -> tuple[threading.Thread, dict]:
    """A streamed greedy completion on a thread; ``result`` gets its chunks' text as it comes,
    and its finish reason and usage, or the error."""
    result: dict = {"text": ""}

    def run() -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=TIMEOUT_S, max_retries=0)
        try:
            stream = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                for choice in chunk.choices:
                    result["text"] += choice.text
                    result["finish"] = choice.finish_reason or result.get("finish")
                if chunk.usage is not None:
                    result["usage"] = chunk.usage.completion_tokens
        except openai.APIError as exc:
            result["error"] = repr(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_a_drained_engine_finishes_what_it_holds_and_refuses_the_rest(tmp_path):
    """A NORMAL engine behind two API servers: /admin/drain needs the API key, finishes the
    request in flight (a NORMAL engine's client cannot resume it elsewhere) before it answers,
    and then /health and both OpenAI endpoints answer 503 in OpenAI's shape."""
    key = "drain-key"
    args = ["serve", *ENGINE, "--api-key", key, "--api-server-count", "2"]
    server = Server(args, tmp_path / "serve.log").start()
    try:
        thread, result = _stream_in_background(server.url, PROMPTS[0], 160, key)
        wait_for(lambda: result["text"] or not thread.is_alive(), "the first tokens")
        assert httpx.post(f"{server.url}/admin/drain", timeout=30).status_code == 401
        answer = httpx.post(
            f"{server.url}/admin/drain?timeout_s=300", headers={"Authorization": f"Bearer {key}"}, timeout=330
        )
        assert answer.json() == {"draining": True, "migrated": 0, "remaining": 0}, answer.text
        thread.join(60)
        assert not thread.is_alive()
        assert (result.get("finish"), result.get("usage"), result.get("error")) == ("length", 160, None), result
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        auth = {"Authorization": f"Bearer {key}"}
        for _ in range(4):  # new connections: either API server may answer
            for path, body in [("completions", {"prompt": "Hello"}), ("chat/completions", {"messages": CHAT})]:
                refused = post_json(f"{server.url}/v1/{path}", {"model": MODEL, **body}, auth)
                assert assert_openai_error(refused, 503)["code"] == "draining"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=60, max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused_by_client:
            client.chat.completions.create(model=MODEL, messages=CHAT)
        assert (refused_by_client.value.status_code, refused_by_client.value.code) == (503, "draining")
        kv = server.kv()
        assert kv["free_blocks"] == kv["total_blocks"]
    finally:
        server.stop()


def test_sigterm_drains_first_then_serve_exits_cleanly(tmp_path):
    """SIGTERM to serve's whole process group (two API servers, the engine core) while a
    request streams: the request ends whole, one drain runs, and serve exits 0."""
    args = ["serve", *ENGINE, "--api-server-count", "2", "--drain-timeout-s", "120"]
    server = Server(args, tmp_path / "serve.log", env={"PDINFER_LOG_LEVEL": "INFO"}).start()
    try:
        thread, result = _stream_in_background(server.url, PROMPTS[1], 160, "unused")
        wait_for(lambda: result["text"] or not thread.is_alive(), "the first tokens")
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(180) == 0, server.log()
        thread.join(60)
        assert not thread.is_alive()
        assert (result.get("finish"), result.get("usage"), result.get("error")) == ("length", 160, None), result
        log = server.log()
        assert log.count("SIGTERM: draining the engine") == 1, log
        assert "SIGTERM: drained" in log and " ERROR " not in log, log
    finally:
        server.stop()


def test_an_in_process_engine_drains_and_refuses_new_requests():
    """The in-process client (tests, embedding) drains the engine on its loop thread."""
    client = InProcessEngineClient(LLMEngine(EngineArgs(max_model_len=512, num_kv_blocks=64)))
    client.start()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run() -> None:
        stream = await client.add_request("before", "Hello", params)
        assert await asyncio.wait_for(client.drain(), 60) == 0  # a NORMAL engine finishes it
        assert client.draining
        async for _ in stream:
            pass
        assert stream.output().outputs[0].finish_reason == "length"
        with pytest.raises(NoRoomError):
            await asyncio.wait_for(client.add_request("after", "Hello", params), 60)

    try:
        asyncio.run(asyncio.wait_for(run(), 120))
        assert client.stats.draining and client.num_unfinished() == 0
    finally:
        client.shutdown()
