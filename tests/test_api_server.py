"""The OpenAI-compatible server, end to end: a real `pdinfer serve` process and the real `openai`
client. The reference for text is `LLM` greedy output in this process (itself checked against
transformers in test_correctness): completions, chat, sampling options, bad requests, many
concurrent streams, client disconnects and metrics, through two API-server processes. `AsyncEngine` in process is in
test_api_server_async_engine.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import jsonschema
import openai
import pytest
import surface_checks
import tool_checks
from conftest import CHAT, MAX_MODEL_LEN, MODEL, PROMPTS
from openai_errors import check_malformed_inputs
from servers import Server

from pdinfer import SamplingParams

API_KEY = "sk-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Two API-server processes in front of the one engine core: every test below goes through
    # whichever of them accepts the connection.
    args = ["serve", "--api-key", API_KEY, "--kv-cache-memory", "512MiB", "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--api-server-count", "2"]
    process = Server(args, tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        process.start()
        yield process.url
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=600)


def kv(server) -> dict:
    return httpx.get(f"{server}/debug/kv", timeout=10).json()


def wait_blocks_back(server, timeout_s: float = 120, num_aborted: int | None = None) -> dict:
    """Poll /debug/kv until every KV block is free again (an abort lands between steps), and
    with ``num_aborted`` until the engine has counted that many aborts. With two API servers
    /debug/kv answers from either, each with the core's counters as of its last message from
    the core (at most one heartbeat, 0.1 s, old): poll, never read once."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = kv(server)
        done = state["free_blocks"] == state["total_blocks"]
        if num_aborted is not None:
            done = done and state["num_aborted"] >= num_aborted
        if done or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def wait_running(server, timeout_s: float = 60) -> None:
    """Poll until the engine holds KV blocks for a request."""
    deadline = time.monotonic() + timeout_s
    while kv(server)["free_blocks"] == kv(server)["total_blocks"]:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = client.models.retrieve(MODEL)  # GET /v1/models/{id}
    assert card.id == MODEL and card.model_dump()["root"] == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")
    from pdinfer import __version__

    assert httpx.get(f"{client.base_url}".replace("/v1/", "/version"), timeout=10).json() == {"version": __version__}


def test_completions_greedy_equal_llm(client, greedy_texts):
    for i in (0, 1, 4):
        out = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0)
        assert out.choices[0].text == greedy_texts[12][i]
        assert out.choices[0].finish_reason in ("length", "stop")
        assert out.usage.completion_tokens <= 12
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    batch = client.completions.create(model=MODEL, prompt=[PROMPTS[2], PROMPTS[5]], max_tokens=12, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [greedy_texts[12][2], greedy_texts[12][5]]


def test_return_token_ids_gives_llm_tokens_whole_and_streamed(client, reference_llm):
    """vLLM's ``return_token_ids`` extra: each choice also lists its token ids (what a client
    without the tokenizer compares), in the whole answer and across stream chunks."""
    ids = [PROMPTS[3], [5, 17, 400, 9000, 33]]  # a text prompt and a token-id prompt
    expected = [
        o.outputs[0].token_ids
        for o in reference_llm.generate(
            [ids[0], {"prompt_token_ids": ids[1]}],
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    extra = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=10, temperature=0, extra_body=extra)
    assert whole.choices[0].model_extra["token_ids"] == expected[0]
    streamed = []
    for chunk in client.completions.create(
        model=MODEL, prompt=ids[1], max_tokens=10, temperature=0, stream=True, extra_body=extra
    ):
        streamed += chunk.choices[0].model_extra["token_ids"]
    assert streamed == expected[1]
    plain = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=2, temperature=0)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_prompt_token_ids_and_continuous_usage(client, tokenizer):
    surface_checks.check_prompt_token_ids(client, tokenizer)
    surface_checks.check_continuous_usage(client)


def test_min_tokens_guided_names_and_partial_character_logprobs(client):
    surface_checks.check_min_tokens(client)
    surface_checks.check_guided_names(client)
    surface_checks.check_partial_character_logprobs(client)
    surface_checks.check_one_finish_per_choice(client)


def test_chat_stream_joins_to_the_non_stream_text(client, greedy_texts):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == greedy_texts["chat"]
    assert full.usage.completion_tokens > 0
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
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) >= 3
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == greedy_texts["chat"]
    assert with_choices[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_validates_whole_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Invent a person."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=80, seed=5)
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, max_tokens=80, seed=6, temperature=0.9, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    choice = client.completions.create(
        model=MODEL, prompt="Color:", max_tokens=8, extra_body={"structured_outputs": {"choice": ["red", "blue"]}}
    )
    assert choice.choices[0].text in ("red", "blue")


def test_tool_calls_named_required_auto_and_bad(client, server):
    tool_checks.check_forced_choices(client)
    tool_checks.check_auto_reads_the_calls_the_model_writes(client)
    tool_checks.check_bad_tool_requests(client)
    assert wait_blocks_back(server)["free_blocks"] == kv(server)["total_blocks"]


def test_langchain_bind_tools_round_trip(server):
    tool_checks.check_langchain_round_trip(f"{server}/v1", API_KEY)
    tool_checks.check_langchain_structured_output(f"{server}/v1", API_KEY)


def test_logit_bias_equals_llm_with_the_same_bias(client, reference_llm):
    first = reference_llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    banned = first[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={banned: -100})
    want = reference_llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logit_bias={str(banned): -100}
    )
    assert got.choices[0].text == want


@pytest.mark.parametrize(
    "extra, problem",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "nonsense",
        ),
        ({"structured_outputs": {"regex": "(abc"}}, "parenthesis"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "cannot enforce 'not'",
        ),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 300}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool"),
        ({"use_beam_search": True}, "beam"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_what_would_change_the_output_and_cannot_is_a_400(client, extra, problem):
    with pytest.raises(openai.BadRequestError, match=problem):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, extra_body=extra)


def test_n_gives_n_choices(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=8, n=2, temperature=1.0, seed=11)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.text for c in out.choices)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_seed_reproduces_sampled_text(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) >= 2  # 12 sampled tokens: seeds are not ignored


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)  # greedy picked the most likely
        assert top[token] == pytest.approx(logprob)
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_prompt_logprobs_in_vllm_shape_equal_llm(client, reference_llm, tokenizer):
    """vLLM's ``prompt_logprobs``: per choice, None for the first token, then {token id: {logprob,
    rank, decoded_token}}: the prompt token first, then the top k (ranked 1..k)."""
    prompts = [PROMPTS[4], PROMPTS[0]]
    refs = reference_llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    out = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    for choice, ref in zip(out.choices, refs):
        got = choice.model_extra["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ref.prompt_token_ids) == len(ref.prompt_logprobs)
        for entry, want, token in zip(got[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:]):
            assert list(entry) == [str(t) for t in want]
            for tid, item in entry.items():
                assert item["logprob"] == pytest.approx(want[int(tid)], abs=1e-4)
                assert item["decoded_token"] == tokenizer.decode([int(tid)])
            by_rank = sorted(entry.values(), key=lambda item: item["rank"])
            if len(entry) == 4:  # the prompt token is not among the top 3
                assert [item["rank"] for item in by_rank[:3]] == [1, 2, 3] and entry[str(token)]["rank"] > 3
            else:
                assert [item["rank"] for item in by_rank] == [1, 2, 3]
            assert [item["logprob"] for item in by_rank] == sorted((i["logprob"] for i in by_rank), reverse=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=1)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


def test_echo_leads_with_the_prompt_whole_streamed_and_scoring_only(server, client, greedy_texts, reference_llm):
    """OpenAI's legacy ``echo``: the prompt text first; with ``logprobs`` its tokens' log-probs
    first (the first one's null); streamed, in the first chunk; with max_tokens 0, the prompt
    scored and nothing generated."""
    prompt = PROMPTS[1]
    ref = reference_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    ids, num_prompt = ref.prompt_token_ids, len(ref.prompt_token_ids)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1, echo=True)
    choice, lp = echo.choices[0], echo.choices[0].logprobs
    assert choice.text == prompt + greedy_texts[12][1] and echo.usage.prompt_tokens == num_prompt
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_lps = [ref.prompt_logprobs[i][ids[i]] for i in range(1, num_prompt)]
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(prompt_lps, abs=1e-4)
    assert lp.tokens[num_prompt:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert lp.text_offset[num_prompt] == len(prompt) and lp.text_offset[0] == 0
    chunks = [
        c.choices[0]
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1, echo=True, stream=True
        )
        if c.choices
    ]
    assert chunks[0].text.startswith(prompt) and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == prompt + greedy_texts[12][1]
    streamed_lps = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert streamed_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    score = client.completions.create(model=MODEL, prompt=[prompt, PROMPTS[0]], max_tokens=0, echo=True, logprobs=0)
    assert [c.text for c in score.choices] == [prompt, PROMPTS[0]]
    assert score.usage.completion_tokens == 0 and score.choices[0].finish_reason == "length"
    assert score.choices[0].logprobs.token_logprobs[1:] == pytest.approx(prompt_lps, abs=1e-4)
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt  # token ids: decoded
    assert wait_blocks_back(server)["free_blocks"] == kv(server)["total_blocks"]


def test_chat_prompt_logprobs_are_on_the_response(client, reference_llm):
    ref = reference_llm.chat(CHAT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    got = out.model_extra["prompt_logprobs"]  # vLLM's place for chat: the response, not a choice
    assert len(got) == len(ref.prompt_token_ids) == out.usage.prompt_tokens and got[0] is None
    for entry, want in zip(got[1:], ref.prompt_logprobs[1:]):
        ((tid, item),) = entry.items()  # k = 0: the prompt token alone
        assert item["logprob"] == pytest.approx(want[int(tid)], abs=1e-4)
    assert "prompt_logprobs" not in (out.choices[0].model_extra or {})


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt": "hi", "prompt_logprobs": -1, "echo": True, "logprobs": 1}, "prompt_logprobs"),
        ("completions", {"prompt": "hi", "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ("chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "hi", "echo": True, "suffix": "!"}, "suffix"),
    ],
)
def test_prompt_logprobs_and_echo_refusals(server, path, body, param):
    resp = httpx.post(
        f"{server}/v1/{path}", json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


BAD_REQUESTS = [
    ("completions", {"model": MODEL, "max_tokens": 4}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": 123}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [1] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "word " * (MAX_MODEL_LEN + 10)}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("chat/completions", {"model": MODEL, "messages": CHAT, "n": 0}, 400, "n"),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body, status, param in BAD_REQUESTS:
        resp = httpx.post(f"{server}/v1/{path}", json=body, headers=headers, timeout=60)
        assert resp.status_code == status, (body, resp.text)
        error = resp.json()["error"]
        assert error["message"] and error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error"
    too_long = httpx.post(
        f"{server}/v1/completions",
        headers=headers,
        timeout=60,
        json={"model": MODEL, "prompt": [1] * (MAX_MODEL_LEN + 1)},
    )
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    resp = httpx.post(
        f"{server}/v1/completions",
        content=b"{not json",
        timeout=60,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=60)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert out.choices[0].text
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_malformed_input_gets_400_in_openai_shape(server, client):
    """Lone surrogates, NaN and infinities, seeds past int64, max_tokens past the context, bodies
    that are not readable JSON: each a 400 naming the field (issue 24); 404 and 405 in the same
    shape. The server keeps serving."""
    check_malformed_inputs(server, MODEL, MAX_MODEL_LEN, headers={"Authorization": f"Bearer {API_KEY}"})
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert out.choices[0].text
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    assert wait_blocks_back(server)["free_blocks"] == kv(server)["total_blocks"]


def test_64_concurrent_streams_complete_and_free_every_block(server, greedy_texts):
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=600)

    async def one(i: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all() -> list[str]:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    texts = asyncio.run(run_all())
    assert all(texts)
    assert texts == [greedy_texts[8][i % len(PROMPTS)] for i in range(64)]
    state = wait_blocks_back(server)
    assert state["free_blocks"] == state["total_blocks"]


def test_client_disconnect_mid_stream_frees_blocks(server):
    time.sleep(0.3)  # longer than a heartbeat: both API servers have the core's latest counters
    num_aborted = wait_blocks_back(server)["num_aborted"]
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    # Checked while the stream is open: leaving iter_lines() closes the connection.
                    wait_running(server)
                    break
    state = wait_blocks_back(server, num_aborted=num_aborted + 1)
    assert state["free_blocks"] == state["total_blocks"]
    # Left alone, the request would run to max_tokens and free its blocks too: the engine must
    # have aborted it.
    assert state["num_aborted"] == num_aborted + 1


def test_client_disconnect_without_stream_frees_blocks(server):
    time.sleep(0.3)  # longer than a heartbeat: both API servers have the core's latest counters
    num_aborted = wait_blocks_back(server)["num_aborted"]
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True}

    async def post_and_leave() -> None:
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            post = asyncio.ensure_future(
                http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
            )
            while True:  # until the engine runs it
                state = (await http.get("/debug/kv")).json()
                if state["free_blocks"] < state["total_blocks"]:
                    break
                assert not post.done(), post.result().text
                await asyncio.sleep(0.05)
            assert not post.done()  # ~400 tokens to go: it cannot have finished
            post.cancel()  # the client goes away: its connection closes mid-request
            with contextlib.suppress(asyncio.CancelledError):
                await post

    asyncio.run(post_and_leave())
    state = wait_blocks_back(server, num_aborted=num_aborted + 1)
    assert state["free_blocks"] == state["total_blocks"]
    assert state["num_aborted"] == num_aborted + 1  # aborted, not run to max_tokens


def test_metrics_expose_the_names(server):
    # Each API server counts its own HTTP requests (docs/usage.md): the errors named below are
    # made on the connection that then scrapes, so one process both counts and answers.
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server, headers=headers, timeout=60) as http:
        assert http.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"}).status_code == 404
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 0}).status_code == 400
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
        text = http.get("/metrics").text
    for name in (
        "pdinfer_time_to_first_token_seconds_bucket",
        "pdinfer_time_per_output_token_seconds_bucket",
        "pdinfer_e2e_request_latency_seconds_bucket",
        "pdinfer_num_requests_waiting",
        "pdinfer_num_requests_running",
        "pdinfer_kv_cache_usage_ratio",
        "pdinfer_kv_cache_free_blocks",
        "pdinfer_prefix_cache_hit_rate",
        'pdinfer_requests_finished_total{finish_reason="length"}',
        'pdinfer_request_errors_total{kind="invalid_request_error"}',
        'pdinfer_request_errors_total{kind="model_not_found"}',
    ):
        assert name in text, name
    assert "pdinfer_engine_healthy 1.0" in text
