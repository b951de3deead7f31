"""What every error answer of `pdinfer serve` and `pdinfer router` must look like, and the
malformed requests both must refuse with a 400 (issue 24, item 8)."""

from __future__ import annotations

import json

import httpx

ERROR_FIELDS = {"message", "type", "param", "code"}


def assert_openai_error(resp: httpx.Response, status: int | None = None) -> dict:
    """``resp`` is an error in OpenAI's shape: ``{"error": {message, type, param, code}}``, JSON;
    a 503 also says when to retry. Returns the inner ``error``."""
    assert status is None or resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers.get("content-type", "").startswith("application/json"), (resp.status_code, resp.text)
    body = resp.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body
    if resp.status_code == 503:
        assert resp.headers.get("retry-after", "").isdigit(), resp.headers
    return error


def post_json(url: str, body, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    """POST ``body`` as Python's json writes it: NaN and Infinity as such, a lone surrogate as
    its ``\\ud800`` escape (httpx's own encoder refuses both)."""
    content = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(url, content=content, headers=headers, timeout=timeout)


CHAT = [{"role": "user", "content": "hi"}]
# (path under /v1, body without "model", the param the 400 must name)
MALFORMED = [
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("completions", {"prompt": ["fine", "lone \udfff here"]}, "prompt"),
    ("completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop"),
    ("completions", {"prompt": "hi", "user": "\udc00"}, "user"),
    ("completions", {"prompt": "hi", "unknown_field": {"\ud800": 1}}, "unknown_field"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "\ud800", "content": "hi"}]}, "messages"),
    ("completions", {"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": float("inf")}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": float("nan")}, "top_p"),
    ("completions", {"prompt": "hi", "frequency_penalty": float("nan")}, "frequency_penalty"),
    ("chat/completions", {"messages": CHAT, "presence_penalty": float("-inf")}, "presence_penalty"),
    ("chat/completions", {"messages": CHAT, "repetition_penalty": float("inf")}, "repetition_penalty"),
    ("completions", {"prompt": "hi", "seed": 2**63}, "seed"),
    ("completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    ("chat/completions", {"messages": CHAT, "seed": 2**64}, "seed"),
    ("completions", {"prompt": "hi", "max_tokens": 10**20}, "max_tokens"),
    # A field the server does not know is refused, as OpenAI refuses it: its sender meant
    # something by it (vLLM's truncate_prompt_tokens, echo on chat).
    ("completions", {"prompt": "hi", "foo_bar": 1}, "foo_bar"),
    ("chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("chat/completions", {"messages": CHAT, "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "hi", "tools": []}, "tools"),
    # A value of the wrong JSON type is refused, not converted.
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"prompt": "hi", "n": "2"}, "n"),
    ("completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [*CHAT, {"role": "tool", "content": "42"}]}, "messages"),
    ("completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("completions", {"prompt": "hi", "min_tokens": 2, "structured_outputs": {"choice": ["a"]}}, "min_tokens"),
    # What the engine itself refuses names the field as the request spelled it.
    ("completions", {"prompt": "hi", "logit_bias": {"60000": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "(abc"}}, "structured_outputs"),
    ("chat/completions", {"messages": CHAT, "guided_regex": "(abc"}, "guided_regex"),
    (
        "chat/completions",
        {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
        "response_format",
    ),
    ("completions", {"prompt": "hi", "guided_choice": ["a"], "guided_regex": "b"}, "guided_regex"),
]


def context_overflows(max_model_len: int) -> list[tuple[str, dict, str]]:
    """Requests whose prompt plus ``max_tokens`` exceed a context of ``max_model_len`` tokens."""
    return [
        ("completions", {"prompt": "hi", "max_tokens": max_model_len}, "max_tokens"),
        ("completions", {"prompt": [1] * (max_model_len // 2), "max_tokens": max_model_len // 2 + 1}, "max_tokens"),
        ("chat/completions", {"messages": CHAT, "max_tokens": max_model_len}, "max_tokens"),
        ("chat/completions", {"messages": CHAT, "max_completion_tokens": 10 * max_model_len}, "max_tokens"),
    ]


# Bodies that are not JSON a server can read: (raw bytes, what the 400's message must say)
UNREADABLE = [
    (b'{"prompt": "\xff\xfe"}', "JSON"),  # not UTF-8
    (b"[" * 100_000 + b"]" * 100_000, "JSON"),  # nests deeper than the parser goes
    (b'{"prompt": "hi",', "JSON"),
    (b"", "no body"),
]


def check_malformed_inputs(url: str, model: str, max_model_len: int | None, headers: dict | None = None) -> None:
    """Every malformed case above answers a 400 in OpenAI's shape (and 404, 405 too);
    ``max_model_len`` None leaves out the context overflows."""
    json_headers = {"Content-Type": "application/json", **(headers or {})}
    for content, says in UNREADABLE:
        resp = httpx.post(f"{url}/v1/completions", content=content, headers=json_headers, timeout=60)
        assert says in assert_openai_error(resp, 400)["message"], content[:40]
    assert_openai_error(httpx.get(f"{url}/v1/no-such-endpoint", headers=headers, timeout=60), 404)
    resp = httpx.get(f"{url}/v1/completions", headers=headers, timeout=60)
    assert assert_openai_error(resp, 405)["code"] == "method_not_allowed" and resp.headers["allow"] == "POST"
    assert_openai_error(httpx.delete(f"{url}/health", timeout=60), 405)
    assert httpx.head(f"{url}/health", timeout=60).status_code == 200  # load balancers' probe
    overflows = context_overflows(max_model_len) if max_model_len else []
    for path, body, param in MALFORMED + overflows:
        resp = post_json(f"{url}/v1/{path}", {"model": model, **body}, headers)
        error = assert_openai_error(resp, 400)
        assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
    # A prompt of no accepted shape gets one sentence naming the shapes, not one per union member.
    resp = post_json(f"{url}/v1/completions", {"model": model, "prompt": [[1, "a"]]}, headers)
    message = assert_openai_error(resp, 400)["message"]
    assert "a list of token ids" in message and "Input should be" not in message, message
