"""Draining an engine, with real processes: ``POST /admin/drain`` and serve's SIGTERM.

A drained engine refuses new requests with a 503 and says so on /health, so a router's health
checks take it out of rotation; one that cannot migrate (NORMAL, PE) finishes what it holds.
SIGTERM drains first (``--drain-timeout-s``): a request in flight ends whole, then serve exits
0. A drained CE under load, whose streams the router continues on another CE, is in
test_migration_cluster.py (it shares that module's cluster).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

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
ENGINE = ["--max-model-len", "512", "--num-kv-blocks", "160"]
TIMEOUT_S = 600


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
