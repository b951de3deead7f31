"""`pdinfer launch --prefill 1 --decode 1`: a whole local P/D cluster from one command, driven
with the real `openai` client. The reference for text is `LLM` in this process (itself checked
against transformers in test_correctness); the last test stops the cluster with SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import PROMPTS, make_llm
from servers import free_port, pdinfer_command

from pdinfer import SamplingParams, env
from pdinfer.env import child_environ

ENGINE = ["--kv-cache-memory", "512MiB", "--max-model-len", "1024"]
MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-launch-test"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 77}
STARTUP_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def references():
    """LLM texts (built and dropped before the cluster starts, to spare the 2 cores)."""
    llm = make_llm(max_model_len=1024)
    refs = {}
    for name, extra in (("greedy", {"temperature": 0.0}), ("seeded", SEEDED)):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, **extra), use_tqdm=False)
        refs[name] = [o.outputs[0].text for o in outs]
    refs["greedy8"] = [
        o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    ]
    refs["chat"] = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    del llm
    return refs


def start_launch(args: list[str], log_dir: Path, api_key: str = "") -> subprocess.Popen:
    """``api_key``: the user's key, given as ``serve`` takes it too, in PDINFER_API_KEY."""
    err = open(log_dir / "launch.err", "w")
    return subprocess.Popen(
        pdinfer_command() + ["launch", *args, "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        start_new_session=True,
        env=child_environ({"PDINFER_LOG_LEVEL": "WARNING", "PDINFER_API_KEY": api_key}),
    )


def wait_ready(proc: subprocess.Popen, port: int, log_dir: Path) -> dict[str, dict]:
    """Read launch's report: its URL, then "name  url  pid N  log PATH" per child."""
    lines = []
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (lines and lines[-1].startswith("Ctrl-C")):
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, (log_dir / "launch.err").read_text()
        lines.append(line.strip())
    assert lines[0] == f"pdinfer launch: http://127.0.0.1:{port}/v1 is ready"
    children = {}
    for line in lines[1:-1]:
        name, url, _, pid, *_ = line.split()
        children[name] = {"url": url, "pid": int(pid)}
    return children


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


@pytest.fixture(scope="module")
def cluster(references, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("launch")
    port = free_port()
    args = ["--prefill", "1", "--decode", "1", "--port", str(port), *ENGINE]
    proc = start_launch(args, log_dir, api_key=API_KEY)
    try:
        children = wait_ready(proc, port, log_dir)
        yield {"proc": proc, "url": f"http://127.0.0.1:{port}", "children": children, "log_dir": log_dir}
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster['url']}/v1", api_key=API_KEY, max_retries=0, timeout=600)


def test_the_engines_answer_only_the_router(cluster, prompt_ids):
    """Every engine requires launch's own key on /v1 and /pd (only the router has it); the
    router requires the user's key (here from PDINFER_API_KEY); /health stays open."""
    body = {"request_id": "stranger", "prompt_token_ids": prompt_ids[0], "sampling": {"max_tokens": 4}}
    for name in ("prompt-0", "completion-0"):
        url = cluster["children"][name]["url"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        for path, payload in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/pd/decode", body)):
            for key in (None, API_KEY):  # no key, or the router's client key: both refused
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                answer = httpx.post(url + path, json=payload, headers=headers, timeout=30)
                assert answer.status_code == 401, (name, path, answer.text)
                assert answer.json()["error"]["code"] == "invalid_api_key"
    refused = httpx.post(f"{cluster['url']}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert refused.status_code == 401
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert API_KEY not in ps  # keys travel in the environment, not on command lines


def test_completions_equal_llm_greedy_and_seeded(client, references):
    for i in range(len(PROMPTS)):
        greedy = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0)
        assert greedy.choices[0].text == references["greedy"][i]
    batch = client.completions.create(model=MODEL, prompt=PROMPTS[:5], max_tokens=12, **SEEDED)
    assert [c.index for c in batch.choices] == list(range(5))
    assert [c.text for c in batch.choices] == references["seeded"][:5]
    assert 0 < batch.usage.completion_tokens <= 5 * 12
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens


def test_chat_streams_in_several_chunks_and_n_gives_n_choices(client, references):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert full.choices[0].message.content == references["chat"]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(with_text) >= 3
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in with_text) == references["chat"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    two = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=8, n=2, seed=11)
    assert sorted(c.index for c in two.choices) == [0, 1] and all(c.text for c in two.choices)
    assert two.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def engine_kv(cluster) -> list[dict]:
    return [
        httpx.get(f"{cluster['children'][name]['url']}/debug/kv", timeout=10).json()
        for name in ("prompt-0", "completion-0")
    ]


def wait_all_blocks_back(cluster, timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        kvs = engine_kv(cluster)
        if all(kv["free_blocks"] == kv["total_blocks"] for kv in kvs):
            return kvs
        assert time.monotonic() < deadline, kvs
        time.sleep(0.2)


def test_64_concurrent_streams_complete_and_disconnects_free_blocks(cluster, references):
    aclient = openai.AsyncOpenAI(base_url=f"{cluster['url']}/v1", api_key=API_KEY, max_retries=0, timeout=600)

    async def one(i: int) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all() -> list[str]:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    texts = asyncio.run(run_all())
    assert texts == [references["greedy8"][i % len(PROMPTS)] for i in range(64)]
    # clients that go away midway, streamed and not: every block comes back on both engines
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 600, "ignore_eos": True}
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        for _ in range(3):
            with http.stream("POST", f"{cluster['url']}/v1/completions", json={**body, "stream": True}) as resp:
                assert resp.status_code == 200
                events = 0
                for line in resp.iter_lines():
                    events += line.startswith("data: ")
                    if events == 2:
                        break
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{cluster['url']}/v1/completions", json=body, timeout=3)
    for kv in wait_all_blocks_back(cluster):
        assert kv["free_blocks"] == kv["total_blocks"]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_every_child(cluster):
    """Runs last in this module: it stops the cluster."""
    proc = cluster["proc"]
    pids = descendants(proc.pid)
    assert {c["pid"] for c in cluster["children"].values()} <= pids
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)]


def test_a_child_dying_at_startup_stops_the_rest(tmp_path):
    missing = str(tmp_path / "missing.gguf")  # every child's command line names it
    proc = start_launch(
        ["--prefill", "1", "--decode", "2", "--port", str(free_port()), "--model", missing, *ENGINE], tmp_path
    )
    assert proc.wait(STARTUP_TIMEOUT_S) == 1
    err = (tmp_path / "launch.err").read_text()
    assert "exited with" in err and "does not exist" in err
    left = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if missing in cmdline and alive(int(entry)):
            left.append(entry)
    assert not left


@pytest.mark.slow
def test_short_prompts_go_to_the_normal_engine(references, tmp_path):
    """1P1D + 1 NORMAL: prompts of at most 8 tokens are proxied to the NORMAL engine."""
    port = free_port()
    proc = start_launch(
        [
            "--prefill",
            "1",
            "--decode",
            "1",
            "--normal",
            "1",
            "--port",
            str(port),
            "--router-arg=--normal-max-prompt-tokens=8",
            *ENGINE,
        ],
        tmp_path,
    )
    try:
        children = wait_ready(proc, port, tmp_path)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        for i in (0, 3):  # 5 prompt tokens: NORMAL; 55: P/D
            out = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0)
            assert out.choices[0].text == references["greedy"][i]
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == references["greedy"][0]
        extra = {"prompt_logprobs": 1}  # relayed as sent, like echo
        out = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, echo=True, extra_body=extra
        )
        assert out.choices[0].text == PROMPTS[0] + references["greedy"][0]
        assert len(out.choices[0].model_extra["prompt_logprobs"]) == out.usage.prompt_tokens
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        normal = children["normal-0"]["url"]
        assert f'pdinfer_router_requests_routed_total{{engine="{normal}",role="normal"}} 3.0' in metrics
        decode = children["completion-0"]["url"]
        assert f'pdinfer_router_requests_routed_total{{engine="{decode}",role="decode"}} 1.0' in metrics
    finally:
        stop(proc)


def test_engines_get_one_gpu_each_in_turn():
    from pdinfer.serving.launch import engine_devices

    assert engine_devices("auto", 3, num_gpus=2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert engine_devices("cuda", 2, num_gpus=4) == ["cuda:0", "cuda:1"]
    assert engine_devices("auto", 2, num_gpus=1) == [None, None]  # one GPU: all share it
    assert engine_devices("cuda:1", 2, num_gpus=2) == [None, None]  # an explicit device wins
    assert engine_devices("cpu", 2, num_gpus=2) == [None, None]


def _launch_args(*flags: str):
    import argparse

    from pdinfer.serving.launch import add_launch_parser

    parser = argparse.ArgumentParser()
    add_launch_parser(parser.add_subparsers())
    return parser.parse_args(["launch", *flags])


def test_launch_hands_its_engines_a_random_kv_secret_in_their_environment(tmp_path):
    from pdinfer.serving.launch import _children

    children = _children(_launch_args("--prefill", "2", "--decode", "1"), tmp_path)
    engines = [c for c in children if c.name != "router"]
    secrets = {c.env["PDINFER_KV_SECRET"] for c in engines}
    assert len(secrets) == 1  # one per cluster: every PE can talk to every CE
    (secret,) = secrets
    assert len(secret) >= 32
    assert all(secret not in " ".join(c.cmd) for c in children)  # not visible in ps
    again = _children(_launch_args("--prefill", "1", "--decode", "1"), tmp_path)
    assert again[0].env["PDINFER_KV_SECRET"] != secret  # random per cluster
    # An operator's own secret travels the same way, never on a command line.
    mine = _children(_launch_args("--prefill", "1", "--decode", "1", "--kv-secret", "s3cret-of-mine"), tmp_path)
    assert {c.env["PDINFER_KV_SECRET"] for c in mine if c.name != "router"} == {"s3cret-of-mine"}
    assert all("s3cret-of-mine" not in " ".join(c.cmd) for c in mine)


def test_the_routers_key_is_the_flag_else_the_environment(tmp_path, monkeypatch):
    from pdinfer.serving.launch import _children

    def router_key(*flags: str) -> str:
        (router,) = [
            c
            for c in _children(_launch_args("--prefill", "1", "--decode", "1", *flags), tmp_path)
            if c.name == "router"
        ]
        return router.env["PDINFER_API_KEY"]

    monkeypatch.setenv("PDINFER_API_KEY", "from-the-environment")
    env.rearm("PDINFER_API_KEY")
    try:
        assert router_key() == "from-the-environment"
        assert router_key("--api-key", "from-the-flag") == "from-the-flag"
    finally:
        monkeypatch.delenv("PDINFER_API_KEY")
        env.rearm("PDINFER_API_KEY")
    assert router_key() == ""  # no key anywhere: an open router, as with serve
