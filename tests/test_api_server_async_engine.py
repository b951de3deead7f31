"""`AsyncEngine` in process, on the engine of the reference `LLM` (the one the server tests
compare with), for what a `pdinfer serve` subprocess cannot show: a stream cut short, overload
(503) and a loop that dies."""

from __future__ import annotations

import asyncio
import gc
import time

import httpx
import pytest
from conftest import MODEL, PROMPTS

from pdinfer import SamplingParams
from pdinfer.serving import AsyncEngine, EngineDeadError, build_app


# --- AsyncEngine in process (on the reference LLM's engine, once the references exist) ------------
@pytest.fixture(scope="module")
def async_engine(reference_llm, greedy_texts):
    engine = AsyncEngine(reference_llm.engine, max_waiting=2)
    engine.start()
    yield engine
    engine.shutdown()


def test_async_generate_streams_and_abort_frees_blocks(async_engine, greedy_texts):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)

    async def run() -> tuple[str, int]:
        async for out in async_engine.generate("a-1", PROMPTS[1], greedy):
            text = out.outputs[0].text
        seen = 0
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        async for _ in async_engine.generate("a-2", PROMPTS[2], long):
            seen += 1
            if seen == 2:
                break  # the generator closes: the request is aborted
        with pytest.raises(ValueError, match="prompt token ids"):
            await async_engine.add_request("a-3", [10**9], greedy)
        return text, seen

    text, seen = asyncio.run(run())
    assert text == greedy_texts[8][1] and seen == 2
    deadline = time.monotonic() + 60
    while async_engine.stats.num_free_blocks != async_engine.stats.num_total_blocks:
        assert time.monotonic() < deadline, async_engine.stats
        time.sleep(0.05)
    assert async_engine.stats.num_requests == 0


def test_a_refused_add_cannot_abort_a_later_request_of_its_id(async_engine, greedy_texts):
    """The router retries a refused reservation under the same request id. A refused add's
    stream sat in a reference cycle (the engine's answer held the exception, whose traceback
    held the stream); when the garbage collector ran its ``__del__``, it aborted the live request
    of that id and unregistered its stream, which then never ended (seen through ``launch``:
    requests hung until the router's 600 s engine timeout while the engines idled)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)

    async def run() -> str:
        for _ in range(3):
            with pytest.raises(ValueError, match="prompt token ids"):
                await async_engine.add_request("same-id", [10**9], greedy)
        stream = await async_engine.add_request("same-id", PROMPTS[1], greedy)
        gc.collect()  # the refused adds' streams go now, while the live one runs

        async def drain() -> None:
            async for _ in stream:
                pass

        await asyncio.wait_for(drain(), timeout=120)  # it hung: no delta ever came
        return stream.output().outputs[0].text

    gc.disable()  # the refused streams wait for the collect above, as they did between retries
    try:
        assert asyncio.run(run()) == greedy_texts[8][1]
    finally:
        gc.enable()


async def until(condition, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_overload_answers_503(async_engine):
    app = build_app(async_engine, MODEL)
    long = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 60, "ignore_eos": True}

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json=long, timeout=600))
            await until(lambda: async_engine.stats.num_running == 1)
            steps = async_engine.stats.num_steps
            await until(lambda: async_engine.stats.num_steps > steps)  # it is decoding now
            # Two more queue behind it (a NORMAL engine prefills them only at its next prefill
            # point, 70 decode steps on); with max_waiting=2 a fourth is refused.
            short = {**long, "max_tokens": 2}
            queued = [asyncio.ensure_future(http.post("/v1/completions", json=short, timeout=600)) for _ in range(2)]
            await until(lambda: async_engine.num_waiting() == 2)
            refused = await http.post("/v1/completions", json=long, timeout=600)
            assert refused.json()["error"]["code"] == "overloaded" and refused.headers["retry-after"] == "1"
            done = await asyncio.gather(first, *queued)
            return [refused.status_code] + [r.status_code for r in done]

    assert asyncio.run(run()) == [503, 200, 200, 200]


def test_a_dead_loop_fails_requests_and_health(async_engine):
    """Must run last in this module: it kills the loop thread on purpose."""

    def broken_step():
        raise RuntimeError("injected step failure")

    async_engine.engine.step_deltas = broken_step  # fault injection into the engine, not the code tested
    app = build_app(async_engine, MODEL)

    async def run():
        with pytest.raises(EngineDeadError, match="injected"):
            async for _ in async_engine.generate("dead-1", PROMPTS[0], SamplingParams(max_tokens=4)):
                pass
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            health = await http.get("/health")
            refused = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        return health, refused

    health, refused = asyncio.run(run())
    assert not async_engine.is_healthy
    assert health.status_code == 503 and "injected" in health.json()["error"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    assert refused.headers["retry-after"] == "1"
