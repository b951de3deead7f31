"""A property-based fuzz of the HTTP API (issue 24): hypothesis draws request bodies from the
servers' own OpenAPI schema (hypothesis-jsonschema), breaks some of them (a field set to any
JSON value: NaN, infinities, huge integers, lone surrogates; a field dropped; bytes that are not
JSON), and sends them, with requests to other paths and methods, to a real `pdinfer serve` and to
a `pdinfer router` in front of it. Whatever comes: no 5xx, every error in OpenAI's shape (a
stream's error events too); after: both healthy and every KV block of the engine free."""

from __future__ import annotations

import json
import string
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from openai_errors import assert_openai_error
from servers import Server

MODEL = "SmolLM2-135M-Instruct"
# Short outputs in a cache that holds every sequence of a large request (16 choices and more):
# a valid request ends quickly on a CPU, without preemptions.
MAX_MODEL_LEN = 64
EXAMPLES = 50  # per server
READ_S = 2.0  # a request still running then is abandoned: the client goes away (an abort)
POST_PATHS = ("/v1/completions", "/v1/chat/completions")

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    serve = Server(["serve", "--kv-cache-memory", "512MiB", "--max-model-len", str(MAX_MODEL_LEN)], tmp / "serve.log")
    router = Server(["router", "--normal", serve.url, "--health-interval-s", "0.5"], tmp / "router.log")
    try:
        serve.start()
        router.start()
        yield {"serve": serve, "router": router}
    finally:
        router.stop()
        serve.stop()


# --- what hypothesis sends ------------------------------------------------------------------------
def json_values() -> st.SearchStrategy:
    """Any JSON value Python's json writes, and some it should not: NaN, infinities, lone
    surrogates."""
    leaves = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.integers(min_value=-(2**80), max_value=2**80)
        | st.floats()
        | st.text(max_size=16)
        | st.text(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE00F), min_size=1, max_size=4)
    )
    return st.recursive(
        leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    )


# What a field's checks may miss.
EDGE_VALUES = st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), 1e308, 2**63, -(2**63) - 1, 10**30, -1, 0, "", "\ud800", [], {}]
)


def body_strategy(openapi: dict, path: str) -> st.SearchStrategy[bytes]:
    """Bodies for ``path``: valid by its schema, then (often) broken."""
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = sorted(openapi["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]["properties"])
    schema_bodies = from_schema({**ref, "components": openapi["components"]})
    valid = (
        schema_bodies
        | st.builds(lambda body: {**body, "model": MODEL}, schema_bodies)  # past the model check
        | st.builds(minimal, schema_bodies, st.integers(1, 8))  # valid more often: the breaks go deep
    )
    field = st.sampled_from(fields)
    bodies = (
        valid
        | st.builds(with_field, valid, field | st.text(max_size=8), json_values())
        | st.builds(with_field, valid, field, EDGE_VALUES)
        | st.builds(with_lone_surrogate, valid, st.randoms(use_true_random=False))
        | st.builds(lambda body, name: {k: v for k, v in body.items() if k != name}, valid, field)
        | json_values()
    )
    return bodies.map(lambda body: json.dumps(body).encode()) | st.binary(max_size=64)


def with_field(body: dict, name: str, value) -> dict:
    return {**body, name: value}


def with_lone_surrogate(body: dict, rnd) -> dict:
    """``body`` with a lone surrogate added to one of its strings (to "user" if it has none)."""
    body = json.loads(json.dumps(body))  # a deep copy
    holders = []  # (container, key) of every string value
    stack = [body]
    while stack:
        node = stack.pop()
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(value, str):
                holders.append((node, key))
            elif isinstance(value, dict | list):
                stack.append(value)
    if not holders:
        return {**body, "user": "\udc00"}
    node, key = rnd.choice(holders)
    node[key] += rnd.choice(["\ud800", "\udbff", "\udc00", "\udfff"])
    return body


def minimal(body: dict, max_tokens: int) -> dict:
    """``body``'s prompt (or messages) alone, for this model, with a short output."""
    kept = {k: v for k, v in body.items() if k in ("prompt", "messages", "stream")}
    return {**kept, "model": MODEL, "max_tokens": max_tokens}


def request_strategy(openapi: dict) -> st.SearchStrategy[tuple[str, str, bytes | None]]:
    """(method, path, body): mostly generation requests, some to any path with any method."""
    posts = st.one_of(*(st.tuples(st.just("POST"), st.just(p), body_strategy(openapi, p)) for p in POST_PATHS))
    # Not /admin/*: a drain changes the server for good (every later request is a 503, by design).
    paths = sorted(p for p in openapi["paths"] if not p.startswith("/admin/"))
    any_path = st.sampled_from(paths) | st.text(string.ascii_letters + string.digits + "/-_.", max_size=24).map(
        lambda p: "/" + p
    )
    others = st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]), any_path, st.none())
    return st.one_of(posts, posts, posts, others)


# --- what must hold -------------------------------------------------------------------------------
def send(url: str, method: str, path: str, body: bytes | None) -> None:
    """One request; a 200 stream is read for up to READ_S, then dropped."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    timeout = httpx.Timeout(READ_S, connect=10)
    try:
        with httpx.stream(method, url + path, content=body, headers=headers, timeout=timeout) as resp:
            assert resp.status_code < 500, (method, path, body, resp.status_code, resp.read())
            if resp.status_code >= 400:
                resp.read()
                assert_openai_error(resp)
            elif resp.headers.get("content-type", "").startswith("text/event-stream"):
                check_events(resp)
    except httpx.ReadTimeout:
        pass  # a valid request still generating: abandoned (the client goes away)


def check_events(resp: httpx.Response) -> None:
    """Every ``data:`` event read within READ_S is JSON; an error event is a client's fault."""
    deadline = time.monotonic() + READ_S
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            if "error" in event:
                assert event["error"]["type"] != "server_error", event
        if time.monotonic() > deadline:
            return


@pytest.mark.parametrize("target", ["serve", "router"])
def test_fuzzed_requests_get_no_5xx_and_leave_every_block_free(servers, target):
    url = servers[target].url
    openapi = httpx.get(f"{url}/openapi.json", timeout=10).json()

    @FUZZ
    @given(request_strategy(openapi))
    def one(request: tuple[str, str, bytes | None]) -> None:
        send(url, *request)

    one()
    for server in servers.values():
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200, server.log()
    kv = servers["serve"].wait_blocks_back(timeout_s=120)
    assert kv["free_blocks"] == kv["total_blocks"], kv
