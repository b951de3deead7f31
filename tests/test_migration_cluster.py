"""Request migration with real processes: a P/D cluster behind ``pdinfer router`` that drops no
request. A CE short of KV blocks gives requests up and the router resumes them on a CE
(through a PE that prefills prompt + tokens so far); a CE killed mid-stream loses its streams'
engine, not the streams. Each answer equals a NORMAL engine's, token for token (greedy), and
every engine's KV blocks are free afterwards. A drained CE hands its streams on, then restarts.
(The engine side is in test_migration.py; serve's drain and SIGTERM alone in test_drain.py.)"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from conftest import make_llm
from servers import Server, wait_for

from pdinfer import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 128
ENGINE = ["--max-model-len", "512", "--kv-lease-s", "5"]
# 96 blocks of 16 tokens: room for about 8 of the 32 requests once they are long.
SMALL_CE = [*ENGINE, "--num-kv-blocks", "96"]
TIMEOUT_S = 600


def _prompts(tokenizer) -> list[list[int]]:
    topics = ["a robot who paints", "the sea at night", "a city of glass", "an old clock", "winter bread"]
    texts = [f"Tell a long story about {topics[i % 5]}, chapter {i}, with many details." for i in range(32)]
    return [tokenizer(t).input_ids for t in texts]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return _prompts(tokenizer)


@pytest.fixture(scope="module")
def expected(prompts):
    """A NORMAL engine's greedy answers: what every migrated answer must equal."""
    llm = make_llm(kv_cache_memory=2 << 30, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migration")
    pe = Server(["serve", "--role", "prompt", *ENGINE, "--kv-cache-memory", "256MiB"], tmp / "pe.log")
    ces = [
        Server(["serve", "--role", "completion", *SMALL_CE], tmp / f"ce{i}.log", env={"PDINFER_LOG_LEVEL": "INFO"})
        for i in range(2)
    ]
    routers = [
        Server(["router", "--prefill", "{pe}", "--decode", *decodes, "--health-interval-s", "0.5"], tmp / f"r{i}.log")
        for i, decodes in enumerate([["{ce0}"], ["{ce0}", "{ce1}"]])
    ]
    try:
        for server in (pe, *ces):
            server.start(wait=False)
        for server in (pe, *ces):
            server.wait_healthy()
        urls = {"pe": pe.url, "ce0": ces[0].url, "ce1": ces[1].url}
        for router in routers:
            router.args = [a.format(**urls) for a in router.args]
            router.start()
        yield {"pe": pe, "ces": ces, "one_ce": routers[0], "two_ces": routers[1]}
    finally:
        for server in (*routers, pe, *ces):
            server.stop()


async def _complete(url: str, prompt: list[int], stream: bool, on_tokens=None) -> tuple[list[int], str | None]:
    """(token ids, finish reason) of one greedy completion through the openai client."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    args = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra)
    async with client:
        if not stream:
            answer = await client.completions.create(**args)
            return answer.choices[0].token_ids, answer.choices[0].finish_reason
        ids: list[int] = []
        finishes = []
        async for chunk in await client.completions.create(**args, stream=True):
            choice = chunk.choices[0]
            ids += choice.token_ids or []
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            if on_tokens is not None:
                on_tokens(len(ids))
        assert len(finishes) == 1, finishes  # one finish, at the end
        return ids, finishes[0]


def _migrations(router: Server, reason: str = r"[^\"]*") -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    pattern = rf'^pdinfer_router_migrations_total\{{reason="{reason}"\}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _assert_all_blocks_free(*servers: Server) -> None:
    for server in servers:
        kv = server.wait_blocks_back()
        assert kv["free_blocks"] == kv["total_blocks"], (server.args, kv)


def test_a_short_ce_cache_loses_no_request(cluster, prompts, expected):
    """32 concurrent requests of 128 greedy tokens, half streamed and half whole, on one CE
    with 96 KV blocks: before migration, most streams ended in an error event ("preempted").
    Now the CE gives its victims up, the router resumes each from its tokens so far, and every
    answer is a NORMAL engine's; the CE says once per request why it gave it up."""
    router = cluster["one_ce"]
    before = _migrations(router)

    async def run_all():
        return await asyncio.gather(*[_complete(router.url, p, i % 2 == 0) for i, p in enumerate(prompts)])

    results = asyncio.run(asyncio.wait_for(run_all(), TIMEOUT_S))
    assert [finish for _, finish in results] == ["length"] * len(prompts)
    assert [ids for ids, _ in results] == expected
    migrated = _migrations(router) - before
    assert migrated > 0, "the CE's cache was never short: this test saw no migration"
    ce_log = cluster["ces"][0].log()
    assert ce_log.count("leaves this engine (preempted)") >= migrated, ce_log[-2000:]
    _assert_all_blocks_free(cluster["pe"], *cluster["ces"])


def test_a_drained_ce_hands_its_streams_to_the_other_ce(cluster, prompts, expected):
    """16 streams through the router with two CEs; once each has tokens, the CE holding the
    most blocks is drained (``POST /admin/drain``): its streams go on through the PE and the
    other CE with no error, each ends with "length" and a NORMAL engine's tokens. The drained
    CE said how many requests it sent away and that none is left, answers /health and
    /pd/decode with 503, and the router takes it out of rotation. (Then it is restarted: the
    router takes it back, and the PE shakes hands with its new instance.)"""
    router, pe, ces = cluster["two_ces"], cluster["pe"], cluster["ces"]
    chosen = prompts[:16]
    before = _migrations(router, "drain")
    counts = [0] * len(chosen)

    async def drained_midway():
        tasks = [
            asyncio.ensure_future(_complete(router.url, p, True, lambda n, i=i: counts.__setitem__(i, n)))
            for i, p in enumerate(chosen)
        ]
        deadline = time.monotonic() + TIMEOUT_S
        while min(counts) < 1 and not any(t.done() for t in tasks):  # every stream has tokens
            assert time.monotonic() < deadline, counts
            await asyncio.sleep(0.05)
        used = [ce.kv()["free_blocks"] for ce in ces]
        victim = ces[0] if used[0] <= used[1] else ces[1]
        answer = await asyncio.to_thread(httpx.post, f"{victim.url}/admin/drain", json={"timeout_s": 120}, timeout=180)
        return victim, answer, await asyncio.gather(*tasks)

    victim, answer, results = asyncio.run(asyncio.wait_for(drained_midway(), TIMEOUT_S))
    assert answer.status_code == 200, answer.text
    drained = answer.json()
    assert drained["draining"] is True and drained["remaining"] == 0, drained
    assert drained["migrated"] > 0, "the drained CE sent no request away (had every stream ended before the drain?)"
    assert [finish for _, finish in results] == ["length"] * len(chosen)
    assert [ids for ids, _ in results] == expected[:16]
    assert _migrations(router, "drain") - before >= 1
    health = httpx.get(f"{victim.url}/health", timeout=10)
    assert (health.status_code, health.json()["status"]) == (503, "draining")
    refused = httpx.post(
        f"{victim.url}/pd/decode", json={"request_id": "after-drain", "prompt_token_ids": [1, 2, 3]}, timeout=30
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_room", refused.text
    wait_for(lambda: not _in_rotation(router, victim), "the drained CE out of rotation")
    _assert_all_blocks_free(pe, *ces)
    victim.stop()  # a rolling restart: the same CE, a new instance
    victim.start()
    wait_for(lambda: _in_rotation(router, victim), "the restarted CE back in rotation")


def _in_rotation(router: Server, engine: Server) -> bool:
    seen = httpx.get(f"{router.url}/debug/engines", timeout=10).json()
    return next(e for e in seen if e["url"] == engine.url)["healthy"]


def test_streams_outlive_a_ce_killed_mid_stream(cluster, prompts, expected):
    """Two CEs; once every stream has tokens, the CE holding the most requests is killed
    (SIGKILL): each of its streams goes on from what its client has, through the PE and the
    other CE, with no error and no repeated or missing token."""
    router, (ce0, ce1), pe = cluster["two_ces"], cluster["ces"], cluster["pe"]
    chosen = prompts[:8]
    counts = [0] * len(chosen)
    before = _migrations(router, "decode_engine_failed")

    def seen(i):
        return lambda n: counts.__setitem__(i, n)

    async def run_all():
        tasks = [asyncio.ensure_future(_complete(router.url, p, True, seen(i))) for i, p in enumerate(chosen)]
        deadline = time.monotonic() + TIMEOUT_S
        while min(counts) < 4 and not any(t.done() for t in tasks):
            assert time.monotonic() < deadline, counts
            await asyncio.sleep(0.05)
        used = [ce.kv() for ce in (ce0, ce1)]
        victim = ce0 if used[0]["free_blocks"] <= used[1]["free_blocks"] else ce1
        await asyncio.to_thread(victim.kill)
        return victim, await asyncio.gather(*tasks)

    victim, results = asyncio.run(asyncio.wait_for(run_all(), TIMEOUT_S))
    assert [finish for _, finish in results] == ["length"] * len(chosen)
    assert [ids for ids, _ in results] == expected[:8]
    assert _migrations(router, "decode_engine_failed") > before, "no stream lost its CE: the kill came too late"
    _assert_all_blocks_free(pe, *[ce for ce in (ce0, ce1) if ce is not victim])
