"""P/D across real processes: a PE and a CE, each a ``pdinfer serve`` process, K/V over TCP.

The test plays the router's part with plain HTTP: reserve on the CE (the first event of its
decode stream), prefill on the PE with that reservation, read the CE's stream to the end.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import make_llm
from servers import Server

from pdinfer import SamplingParams
from pdinfer.serving.pd_protocol import sampling_to_dict

ENGINE = ["--kv-cache-memory", "512MiB", "--max-model-len", "1024"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    ce = Server(
        ["serve", "--role", "completion", *ENGINE, "--kv-reservation-timeout-s", "20"],
        tmp / "ce.log",
        env={"PDINFER_STEP_LOG": str(tmp / "ce.steps")},
    )
    pe = Server(["serve", "--role", "prompt", *ENGINE, "--kv-lease-s", "3"], tmp / "pe.log")
    ce.start(wait=False)
    pe.start(wait=False)
    try:
        ce.wait_healthy()
        pe.wait_healthy()
        yield {"pe": pe, "ce": ce, "steps": tmp / "ce.steps", "tmp": tmp}
    finally:
        pe.stop()
        ce.stop()


def pd_generate(
    pe_url: str, ce_url: str, request_id: str, ids: list[int], params: SamplingParams, on_reserved=None
) -> dict:
    body = {"request_id": request_id, "prompt_token_ids": ids, "sampling": sampling_to_dict(params)}
    tokens: list[int] = []
    result: dict = {}
    with httpx.stream("POST", f"{ce_url}/pd/decode", json=body, timeout=120) as stream:
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                reservation = json.loads(line[6:])["reservation"]
                break
        if on_reserved is not None:
            on_reserved()
        prefill = httpx.post(f"{pe_url}/pd/prefill", json={**body, "reservation": reservation}, timeout=120)
        result["prefill_status"] = prefill.status_code
        result["prefill"] = prefill.json()
        if prefill.status_code != 200:
            return result
        for line in lines:
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            for delta in event["outputs"]:
                tokens += delta["token_ids"]
            if event["finished"]:
                result["error"] = event["error"]
                break
    result["tokens"] = tokens
    return result


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_16_prompts_through_pe_and_ce_equal_normal(cluster, prompt_ids, params):
    prompts = [ids[: 10 + 9 * i] for i, ids in enumerate(prompt_ids * 2)][:16]
    expected = [
        o.outputs[0].token_ids
        for o in make_llm(kv_cache_memory=512 << 20).generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
    ]
    results = [None] * len(prompts)

    def one(i):
        results[i] = pd_generate(cluster["pe"].url, cluster["ce"].url, f"r{params.seed}-{i}", prompts[i], params)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for result, want in zip(results, expected):
        assert result["prefill_status"] == 200, result
        assert result["tokens"] == want
        assert result["prefill"]["first_tokens"] == want[:1]  # the first token is the PE's
    steps = cluster["steps"].read_text().split()
    assert "decode" in steps and "prefill" not in steps  # the CE never ran a prefill step
    assert cluster["pe"].wait_blocks_back()["free_blocks"] == cluster["pe"].kv()["total_blocks"]
    kv = cluster["ce"].wait_blocks_back()
    assert kv["free_blocks"] == kv["total_blocks"]


def test_client_abort_during_decode_frees_the_ce(cluster, prompt_ids):
    body = {
        "request_id": "gone",
        "prompt_token_ids": prompt_ids[5],
        "sampling": sampling_to_dict(SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)),
    }
    with httpx.stream("POST", f"{cluster['ce'].url}/pd/decode", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        reservation = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["reservation"]
        assert (
            httpx.post(
                f"{cluster['pe'].url}/pd/prefill", json={**body, "reservation": reservation}, timeout=60
            ).status_code
            == 200
        )
        next(line for line in lines if line.startswith("data: "))  # decoding has begun
    # the stream is closed: the CE aborts the request
    for server in (cluster["ce"], cluster["pe"]):
        kv = server.wait_blocks_back()
        assert kv["free_blocks"] == kv["total_blocks"]


def test_what_a_stranger_sends_the_engines_is_a_400_and_they_keep_serving(cluster, prompt_ids):
    """The router never sends these, a stranger may: each once killed an engine loop (or the
    PE's KV socket thread). Now each is a 400 for that request alone."""
    pe, ce = cluster["pe"], cluster["ce"]
    ids = prompt_ids[0]
    reservation = {
        "transfer_id": "t" * 32,
        "request_id": "stranger",
        "address": "not-an-endpoint",
        "instance_id": "i" * 32,
        "block_ids": list(range(8)),
        "num_prompt_tokens": len(ids),
    }
    cases = [
        (ce, "/pd/decode", {"sampling": {"logprobs": 100_000}}),
        (ce, "/pd/decode", {"sampling": {"temperature": float("nan")}}),
        (pe, "/pd/prefill", {"sampling": {"logprobs": 100_000}, "reservation": reservation}),
        (pe, "/pd/prefill", {"reservation": reservation}),
        (pe, "/pd/prefill", {"reservation": {**reservation, "address": "tcp://127.0.0.1:1", "block_ids": [2**70]}}),
        # a field of the wrong type (the engine core could not decode the add: the request hung)
        (pe, "/pd/prefill", {"reservation": {**reservation, "transfer_id": 5}}),
        (pe, "/pd/prefill", {"reservation": {**reservation, "num_prompt_tokens": str(len(ids))}}),
        # converted before, not refused: true as a token id, a field nobody reads
        (ce, "/pd/decode", {"prompt_token_ids": [True, False]}),
        (ce, "/pd/decode", {"prompt_token_ids": ["5", "6"]}),
        (ce, "/pd/decode", {"unknown": 1}),
        # past the context: the CE reserved blocks for it, the PE answered a 502 server error
        (ce, "/pd/decode", {"prompt_token_ids": [1] * 3000}),
        (pe, "/pd/prefill", {"prompt_token_ids": [1] * 3000, "reservation": reservation}),
    ]
    for server, path, extra in cases:
        body = {"request_id": "stranger", "prompt_token_ids": ids, **extra}
        answer = httpx.post(  # by hand: httpx's json= refuses NaN, a stranger's client may not
            f"{server.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60
        )
        assert answer.status_code == 400, (path, extra, answer.text)
        assert answer.json()["error"]["type"] == "invalid_request_error"
    result = pd_generate(pe.url, ce.url, "after-strangers", ids, GREEDY)
    assert result["prefill_status"] == 200 and len(result["tokens"]) == 16
    for server in (pe, ce):
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert server.wait_blocks_back()["free_blocks"] == server.kv()["total_blocks"]


def test_killed_ce_during_transfer_pe_recovers_within_lease(tmp_path, prompt_ids):
    ce = Server(["serve", "--role", "completion", *ENGINE], tmp_path / "ce.log")
    pe = Server(["serve", "--role", "prompt", *ENGINE, "--kv-lease-s", "3"], tmp_path / "pe.log")
    ce.start(wait=False)  # both load at once
    pe.start(wait=False)
    try:
        ce.wait_healthy()
        pe.wait_healthy()
        warm = pd_generate(pe.url, ce.url, "warm", prompt_ids[6], GREEDY)  # PE and CE shook hands
        assert warm["prefill_status"] == 200
        start = time.monotonic()
        # the CE dies after reserving: the PE pushes into the void and its lease (3 s) runs out
        result = pd_generate(pe.url, ce.url, "doomed", prompt_ids[6], GREEDY, on_reserved=ce.kill)
        assert result["prefill_status"] == 504
        assert "lease expired" in result["prefill"]["error"]["message"]
        assert time.monotonic() - start < 60
        kv = pe.wait_blocks_back()
        assert kv["free_blocks"] == kv["total_blocks"]
        # the PE keeps serving: a new CE, a new request
        ce2 = Server(["serve", "--role", "completion", *ENGINE], tmp_path / "ce2.log").start()
        try:
            again = pd_generate(pe.url, ce2.url, "again", prompt_ids[6], GREEDY)
            assert again["prefill_status"] == 200 and len(again["tokens"]) == 16
        finally:
            ce2.stop()
    finally:
        pe.stop()
        ce.stop()


@pytest.mark.slow
@pytest.mark.parametrize("connector", ["cuda_ipc", "nccl"])
def test_device_connectors_across_processes(tmp_path, prompt_ids, connector):
    """The device transports between two processes: on CPU the cuda_ipc staging pool is shared
    memory and the nccl pair is a gloo group. The CE gets the K/V out of the PE's pool, checks
    it, and decodes NORMAL's tokens. Slow (about 45 s each on 2 cores, the default suite's
    slowest after this file's lease test): the default suite keeps both connectors' hand-offs
    in one process (``test_device_transport.py``) and the TCP hand-off between processes."""
    kv = ["--kv-connector", connector]
    ce = Server(["serve", "--role", "completion", *ENGINE, *kv], tmp_path / "ce.log")
    pe = Server(["serve", "--role", "prompt", *ENGINE, *kv], tmp_path / "pe.log")
    ce.start(wait=False)
    pe.start(wait=False)
    try:
        ce.wait_healthy()
        pe.wait_healthy()
        prompts = [ids[: 12 + 20 * i] for i, ids in enumerate(prompt_ids[:4])]
        expected = [
            o.outputs[0].token_ids
            for o in make_llm(kv_cache_memory=512 << 20).generate(
                [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
            )
        ]
        for i, (prompt, want) in enumerate(zip(prompts, expected)):
            result = pd_generate(pe.url, ce.url, f"{connector}-{i}", prompt, GREEDY)
            assert result["prefill_status"] == 200, result
            assert result["tokens"] == want
        for server in (pe, ce):
            kv_state = server.wait_blocks_back()
            assert kv_state["free_blocks"] == kv_state["total_blocks"]
    finally:
        pe.stop()
        ce.stop()
