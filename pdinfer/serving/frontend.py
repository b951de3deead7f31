"""What every OpenAI-compatible front end shares: one engine's server (``api_server``) and the
P/D router (``router``). A client sees the same shapes from both.

- ``check_api_key`` / ``install_error_handlers``: auth and OpenAI's error shape for every error;
- ``PromptBuilder``: text -> token ids, the chat template, the context-length check;
- ``ResponseFormat``: the completion / chat bodies and stream chunks of one request;
- ``sse_response``: chunks -> ``data: ...`` events, usage, an error event, ``[DONE]``;
- ``run_unless_disconnected``: a non-streamed answer whose client goes away is cancelled;
- ``http_server``: the uvicorn server both run (uvicorn's access log only at DEBUG).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdinfer.engine.output_tracker import ChoiceDelta
from pdinfer.serving import protocol, tools
from pdinfer.serving.logprobs import chat_logprobs, completion_logprobs
from pdinfer.serving.prompt_echo import PromptEcho
from pdinfer.serving.protocol import APIError, ChatCompletionRequest, bad_request

_json_encode = msgspec.json.Encoder().encode
_DISCONNECT_POLL_S = 0.5


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")


RETRY_AFTER_S = 1  # what a 503 (overloaded, no engine) asks a client to wait before it retries


def install_error_handlers(app: FastAPI, errors_counter) -> None:
    """Every error answers in OpenAI's shape, counted by kind: ``APIError``, pydantic's validation
    errors, the framework's own (404, 405, a body that is not UTF-8 or nests too deep) and, as a
    500, anything unexpected. A 503 carries ``Retry-After``."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        errors_counter.labels(kind=exc.code or exc.type).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status_code == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await on_api_error(request, protocol.validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = await on_api_error(request, _framework_error(request, exc))
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this answer.
        error = APIError(500, "internal server error", type="server_error", code="internal_error")
        return await on_api_error(request, error)


def _framework_error(request: Request, exc: StarletteHTTPException) -> APIError:
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
        return APIError(404, message, code="not_found")
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        return APIError(405, message, code="method_not_allowed")
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
        return bad_request(f"the body could not be read as JSON: {type(exc.__cause__).__name__}: {exc.__cause__}")
    return APIError(exc.status_code, str(exc.detail))


DEFAULT_MAX_BODY_BYTES = 8 << 20


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 in OpenAI's shape
    before any handler (or JSON parser) sees it, whether it declares its length or not."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            more = message.get("more_body", False)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, send) -> None:
        error = APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )
        payload = _json_encode(error.body())
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()

    return replayed


class PromptBuilder:
    """Engine prompts (``{"prompt"?, "prompt_token_ids"}``) from what a client sent.

    ``prompt_limit`` None skips the length check; ``vocab_size`` None leaves the token-id range
    check to the engine; ``max_model_len`` None skips ``check_room``.
    """

    def __init__(
        self,
        tokenizer,
        prompt_limit: int | None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.prompt_limit = prompt_limit
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # Long prompts are tokenized on a worker thread, with a copy of their own: a Rust
        # tokenizer must not be used from two threads at once.
        self._worker_tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None

    async def completion_async(self, prompt: str | list[int], param: str = "prompt") -> dict:
        """``completion``; a long text is tokenized off the event loop."""
        if isinstance(prompt, str) and len(prompt) > _INLINE_CHARS:
            return await _off_loop(self.completion, prompt, param, self._worker_tokenizer)
        return self.completion(prompt, param)

    async def chat_async(self, body: ChatCompletionRequest) -> dict:
        """``chat``; the template and the tokenizer run off the event loop for long chats."""
        if sum(len(str(m.content or "")) for m in body.messages) > _INLINE_CHARS:
            return await _off_loop(self.chat, body, self._worker_tokenizer)
        return self.chat(body)

    def completion(self, prompt: str | list[int], param: str = "prompt", tokenizer=None) -> dict:
        tokenizer = tokenizer or self.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", param=param)
            if tokenizer is None:
                raise bad_request("this model has no tokenizer: send token ids", param=param)
            token_ids = tokenizer(prompt).input_ids
            return self.checked({"prompt": prompt, "prompt_token_ids": token_ids}, param)
        return self.checked({"prompt_token_ids": list(prompt)}, param)

    def chat(self, body: ChatCompletionRequest, tokenizer=None) -> dict:
        tokenizer = tokenizer or self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions")
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        messages = [m.as_template_input(tools.template_knows_tool_calls(template)) for m in body.messages]
        extra = {}
        request_tools = body.tool_request()
        if request_tools is not None:
            if tools.template_knows_tools(template):
                extra["tools"] = request_tools.tools
            else:  # the template would drop them: pdinfer shows them (serving/tools.py)
                _add_system(messages, tools.hermes_system_prompt(request_tools.tools))
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt, **extra
            )
        except Exception as exc:  # a template raising on odd input is the input's fault
            raise bad_request(f"the chat template failed on these messages: {exc}", param="messages") from None
        token_ids = tokenizer(text, add_special_tokens=False).input_ids
        return self.checked({"prompt": text, "prompt_token_ids": token_ids}, "messages")

    def tool_format(self) -> str:
        """The tool-call format this model's chat template teaches (``serving.tools``)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return tools.template_format(template if isinstance(template, str) else None)

    def check_room(self, prompts: list[dict], max_tokens: int | None) -> None:
        """A 400 when a prompt and ``max_tokens`` together exceed the context, as OpenAI and vLLM
        answer (the engine would cut the output short). ``max_tokens`` None: up to the context."""
        context = self.max_model_len
        if context is None or max_tokens is None:
            return
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        if longest + max_tokens > context:
            room = context - longest
            hint = f"lower max_tokens to {room} or less" if room > 0 else "shorten the prompt"
            raise bad_request(
                f"the prompt has {longest} tokens and max_tokens is {max_tokens}: more than this "
                f"model's context of {context} tokens; {hint}",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def checked(self, prompt: dict, param: str) -> dict:
        token_ids = prompt["prompt_token_ids"]
        check_prompt_length(len(token_ids), self.prompt_limit, param)
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in token_ids):
            raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size})", param=param)
        return prompt


def check_prompt_length(num_tokens: int, limit: int | None, param: str) -> None:
    """A 400 for a prompt longer than the engine takes (``limit`` None: no limit)."""
    if limit is not None and num_tokens > limit:
        raise bad_request(
            f"the prompt has {num_tokens} tokens, more than this engine's limit of {limit}",
            param=param,
            code="context_length_exceeded",
        )


def _add_system(messages: list[dict], text: str) -> None:
    """``text`` at the end of the system message, or as a new first one."""
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
    else:
        messages.insert(0, {"role": "system", "content": text})


_INLINE_CHARS = 8192  # shorter prompts are tokenized in place: a thread hop would cost more
_pool: ThreadPoolExecutor | None = None


async def _off_loop(fn, *args):
    """Run ``fn`` on the one tokenizing thread (one: each tokenizer copy serves one thread)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="pdinfer-tokenize")
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args))


Delta = ChoiceDelta  # what one output gained since the last chunk


class ResponseFormat:
    """The OpenAI shapes of one request's answer (completion or chat, whole or streamed).

    ``tool_request`` (chat): each choice's text is read for tool calls in ``tool_format``
    (``serving.tools``); ``chunk`` then answers None for a piece it holds back."""

    def __init__(
        self,
        tokenizer,
        model_name: str,
        request_id: str,
        chat: bool,
        logprobs: int | None,
        prompt_token_ids: list[list[int]] | None = None,
        tool_request: tools.ToolRequest | None = None,
        tool_format: str = tools.HERMES,
        n: int = 1,
        prompt_echo: PromptEcho | None = None,
    ):
        self.tokenizer = tokenizer
        self.prompt_echo = prompt_echo  # echo and prompt_logprobs (prompt_echo.py); None: neither
        self.chat = chat
        self.num_logprobs = logprobs
        # ``return_token_ids`` (vLLM's shape): each choice (or chunk) lists its tokens, and the
        # prompt's: per choice on completions, once per response on chat (in the first chunk).
        self.prompt_token_ids = prompt_token_ids
        self.return_token_ids = prompt_token_ids is not None
        self.n = n
        self.tool_request = tool_request
        self.tool_format = tool_format
        self.head = {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        self.chunk_head = {**self.head, "object": "chat.completion.chunk"} if chat else self.head
        self._started: set[int] = set()  # choices whose first chunk (chat: with the role) is out
        self._parsers: dict[int, tools.ToolParser | None] = {}

    def logprobs(self, delta: Delta):
        if self.num_logprobs is None or delta.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, self.num_logprobs)
        return completion_logprobs(
            self.tokenizer, delta.token_ids, delta.logprobs, self.num_logprobs, delta.text_offset
        )

    def chunk(self, d: Delta) -> dict | None:
        """One streamed chunk; None when a tool parser holds everything back."""
        if not self.chat:
            first = d.index not in self._started
            self._started.add(d.index)
            return {**self.chunk_head, "choices": [self._completion_choice(d, first)]}
        delta: dict = {} if d.index in self._started else {"role": "assistant"}
        logprobs = self.logprobs(d)
        parser = self._parser(d.index)
        finish_reason = d.finish_reason
        if parser is None:
            if d.text or not d.finish_reason:
                delta["content"] = d.text
        else:
            step = parser.feed(d.text)
            if d.finish_reason:
                last = parser.finish()
                step.content += last.content
                step.calls += last.calls
                finish_reason = self._finish_reason(d.finish_reason, parser)
            if step.content:
                delta["content"] = step.content
            if step.calls:
                delta["tool_calls"] = step.calls
            if not delta and not finish_reason and logprobs is None and not self.return_token_ids:
                return None
        head: dict[str, Any] = self.chunk_head
        if self.prompt_token_ids is not None and not self._started:  # the response's first chunk
            head = {**head, "prompt_token_ids": self.prompt_token_ids[0]}
        self._started.add(d.index)
        return {
            **head,
            "choices": [
                {
                    "index": d.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    **self._ids(d),
                }
            ],
        }

    def body(self, finals: list[Delta], usage: dict) -> dict:
        """The whole answer, from each choice's complete text (``finals``)."""
        finals = sorted(finals, key=lambda d: d.index)
        if self.chat:
            choices = [self._chat_choice(d) for d in finals]
        else:
            choices = [self._completion_choice(d, True) for d in finals]
        if self.prompt_echo is not None:
            usage = self.prompt_echo.usage(usage)
        body: dict[str, Any] = {**self.head, "choices": choices, "usage": usage}
        if self.chat and self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids[0]
        if self.chat and self.prompt_echo is not None:
            self.prompt_echo.chat_body(body)
        return body

    def usage_chunk(self, usage: dict) -> dict:
        if self.prompt_echo is not None:
            usage = self.prompt_echo.usage(usage)
        return {**self.chunk_head, "choices": [], "usage": usage}

    def _chat_choice(self, d: Delta) -> dict:
        message: dict = {"role": "assistant", "content": d.text}
        finish_reason = d.finish_reason
        parser = self._parser(d.index)
        if parser is not None:
            message["content"], calls = tools.parse_whole(parser, d.text)
            if calls:
                message["tool_calls"] = calls
            finish_reason = self._finish_reason(d.finish_reason, parser)
        return {
            "index": d.index,
            "message": message,
            "logprobs": self.logprobs(d),
            "finish_reason": finish_reason,
            **self._ids(d),
        }

    def _parser(self, index: int) -> tools.ToolParser | None:
        if self.tool_request is None:
            return None
        if index not in self._parsers:
            self._parsers[index] = self.tool_request.parser(self.tool_format)
        return self._parsers[index]

    def _finish_reason(self, reason: str | None, parser: tools.ToolParser) -> str | None:
        request = self.tool_request
        if reason == "stop" and parser.calls and request is not None and request.choice in ("auto", "required"):
            return "tool_calls"
        return reason

    def _completion_choice(self, d: Delta, first: bool) -> dict:
        choice = {
            "index": d.index,
            "text": d.text,
            "logprobs": self.logprobs(d),
            "finish_reason": d.finish_reason,
            **self._ids(d),
        }
        if first and self.prompt_token_ids is not None:
            choice["prompt_token_ids"] = self.prompt_token_ids[d.index // self.n]
        if self.prompt_echo is not None:
            self.prompt_echo.completion_choice(choice)
        return choice

    def _ids(self, d: Delta) -> dict:
        return {"token_ids": list(d.token_ids)} if self.return_token_ids else {}


def sse_event(payload: dict) -> bytes:
    return b"data: " + _json_encode(payload) + b"\n\n"


def sse_response(
    chunks: AsyncIterator[dict | None],
    fmt: ResponseFormat,
    usage: Callable[[], dict],
    include_usage: bool,
    on_error: Callable[[APIError], None],
    cleanup: Callable[[], None],
    continuous_usage: bool = False,
) -> StreamingResponse:
    """Stream ``chunks``; an ``APIError`` raised mid-stream travels as an error event (the
    headers are gone). ``cleanup`` runs however the stream ends (client gone included).
    ``continuous_usage``: every chunk also carries the usage so far (vLLM's
    ``continuous_usage_stats``)."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                if chunk is not None:  # None: a tool parser holds the piece back
                    if continuous_usage:
                        chunk["usage"] = usage()
                    yield sse_event(chunk)
            if include_usage:
                yield sse_event(fmt.usage_chunk(usage()))
        except APIError as exc:
            on_error(exc)
            yield sse_event(exc.body())
        finally:
            cleanup()
            with contextlib.suppress(Exception):
                await chunks.aclose()  # type: ignore[attr-defined]
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def run_unless_disconnected(request: Request, awaitable):
    """Await ``awaitable``; if the client disconnects meanwhile, cancel it and raise a 499."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client disconnected", code="client_disconnected")
        return task.result()
    finally:
        task.cancel()


# An idle keep-alive connection stays open this long (uvicorn's default is 5 s). A router's
# client pool forgets its idle connections sooner (``CLIENT_KEEP_ALIVE_S``), so it never sends a
# request on a connection the engine is closing at that moment (which fails the request).
KEEP_ALIVE_S = 30
CLIENT_KEEP_ALIVE_S = 10


def http_server(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    """The uvicorn server of a front end; its own logging only when pdinfer's is at DEBUG."""
    debug = logging.getLogger("pdinfer").getEffectiveLevel() <= logging.DEBUG
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level="info" if debug else "warning",
    )
    return uvicorn.Server(config)
