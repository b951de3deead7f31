"""``pdinfer serve`` runs its step loop in an engine-core process of its own (issue 23): what a
user sees of that boundary, through a real ``serve`` process and the real ``openai`` client.

- a killed engine core is noticed: the in-flight stream ends with an error event, ``/health``
  fails, new requests get a 503 in OpenAI's shape, nothing hangs;
- request bodies are bounded (413 in OpenAI's shape) and the server keeps serving;
- a huge prompt is tokenized off the event loop: ``/health`` answers while it is tokenized;
- SIGTERM (how ``launch`` and most supervisors stop a server) stops the core and removes its
  socket folder.

Greedy outputs through ``serve`` (two API-server processes in front of one core) equal ``LLM``'s
in test_api_server.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest
from conftest import MODEL, PROMPTS
from servers import Server

ENGINE = ["--kv-cache-memory", "256MiB", "--max-model-len", "512"]
KEY = "sk-core-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def children(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [(int(line.split(None, 1)[0]), line.split(None, 1)[1]) for line in out.strip().splitlines()]


def test_a_killed_engine_core_is_noticed_at_once(tmp_path):
    server = Server(["serve", *ENGINE], tmp_path / "serve.log").start()
    try:
        cores = [pid for pid, args in children(server.proc.pid) if "pdinfer.engine.core" in args]
        assert len(cores) == 1, children(server.proc.pid)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        stream = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        received = 0
        with pytest.raises(openai.APIError, match="engine"):
            for _chunk in stream:
                received += 1
                if received == 2:  # tokens flow: now the core dies
                    subprocess.run(["kill", "-9", str(cores[0])], check=True)
        assert 2 <= received < 400  # the stream ended early, with the error event
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert health.status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.body["message"]  # OpenAI's error shape (the SDK unwraps "error")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_bodies(tmp_path_factory):
    """A serve whose body limit (1 MiB) is far below the default, with an API key (from the
    environment) required on /metrics and /debug too. One API server: the health test needs
    its /health and its big prompt in the same process."""
    args = ["serve", *ENGINE, "--max-body-bytes", "1MiB", "--protect-metrics"]
    server = Server(args, tmp_path_factory.mktemp("serve") / "serve.log", env={"PDINFER_API_KEY": KEY})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_body_over_the_limit_is_a_413_in_openai_shape(small_bodies):
    url = f"{small_bodies.url}/v1/completions"
    big = {"model": MODEL, "prompt": "a" * (2 << 20), "max_tokens": 1}
    resp = httpx.post(url, json=big, headers=AUTH, timeout=60)
    assert resp.status_code == 413
    error = resp.json()["error"]
    assert error["code"] == "request_too_large" and "1048576" in error["message"]

    def chunked():  # no Content-Length: the limit holds while the body is read
        for _ in range(40):
            yield b"x" * (64 << 10)

    resp = httpx.post(url, content=chunked(), headers={"content-type": "application/json", **AUTH}, timeout=60)
    assert resp.status_code == 413
    ok = httpx.post(url, json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}, headers=AUTH, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_protect_metrics_requires_the_key_on_metrics_and_debug(small_bodies):
    for path in ("/metrics", "/debug/kv"):
        refused = httpx.get(small_bodies.url + path, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(small_bodies.url + path, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(f"{small_bodies.url}/health", timeout=30).status_code == 200
    assert httpx.post(f"{small_bodies.url}/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 401


def test_health_answers_while_a_huge_prompt_is_tokenized(small_bodies):
    """A prompt of ~1M characters (under the body limit) keeps the tokenizer busy; the event
    loop that serves /health must not wait for it. Ordering, not timing: once the big body is
    sent, /health answers three times in a row before the big request's answer arrives (a
    blocked loop answers at most the one health check it may take before it starts
    tokenizing; the next waits, and the big answer goes out first)."""
    body = json.dumps({"model": MODEL, "prompt": "hello world " * 80_000, "max_tokens": 1}).encode()
    events: list[str] = []
    sent, done = threading.Event(), threading.Event()

    def upload():
        yield body
        sent.set()

    def post_big():
        resp = httpx.post(
            f"{small_bodies.url}/v1/completions",
            content=upload(),
            headers={"content-type": "application/json", "content-length": str(len(body)), **AUTH},
            timeout=300,
        )
        events.append(f"big {resp.status_code}")
        done.set()

    thread = threading.Thread(target=post_big)
    with httpx.Client(timeout=120) as health:
        health.get(f"{small_bodies.url}/health")  # the connection, before the clock of the test
        thread.start()
        sent.wait(60)
        deadline = time.monotonic() + 120
        while not done.is_set():
            assert time.monotonic() < deadline, "the big request never finished"
            if health.get(f"{small_bodies.url}/health").status_code == 200 and not done.is_set():
                events.append("health")
    thread.join(timeout=120)
    assert not thread.is_alive(), "the big request never finished"
    assert events[-1] == "big 400", events  # longer than the context: a 400, not a 500
    assert events[:3] == ["health"] * 3, events


@pytest.mark.parametrize("to", ["server", "group"])
def test_sigterm_stops_the_core_and_removes_its_socket_folder(tmp_path, to):
    """uvicorn raises the SIGTERM it caught again once it has stopped; its default action ended
    the process before ``serve`` stopped its core, and every stop left a /tmp/pdinfer-core-*
    folder behind. Now the process exits 0 having stopped the core and removed the folder.

    A SIGTERM to the whole process group (``launch``, a shell's job control; systemd sends one to
    every process of the unit) reached the core too, which died before the API servers had
    stopped: they logged "the engine core exited" as an ERROR on every clean stop."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = Server(["serve", *ENGINE], tmp_path / "serve.log", env={"TMPDIR": str(tmp)})
    server.start()
    try:
        (core_dir,) = [p for p in tmp.iterdir() if p.name.startswith("pdinfer-core-")]
        cores = [pid for pid, args in children(server.proc.pid) if "pdinfer.engine.core" in args]
        assert len(cores) == 1
        if to == "server":
            os.kill(server.proc.pid, signal.SIGTERM)
        else:
            os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()
        assert " ERROR " not in server.log()
        assert not core_dir.exists()
        assert not os.path.exists(f"/proc/{cores[0]}")  # stopped and reaped by serve
    finally:
        server.stop()
