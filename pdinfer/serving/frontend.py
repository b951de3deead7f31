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

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdinfer.engine.output_tracker import ChoiceDelta
from pdinfer.serving import protocol
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
        messages = [m.as_template_input() for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
            )
        except Exception as exc:  # a template raising on odd input is the input's fault
            raise bad_request(f"the chat template failed on these messages: {exc}", param="messages") from None
        token_ids = tokenizer(text, add_special_tokens=False).input_ids
        return self.checked({"prompt": text, "prompt_token_ids": token_ids}, "messages")

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
        limit = self.prompt_limit
        if limit is not None and len(token_ids) > limit:
            raise bad_request(
                f"the prompt has {len(token_ids)} tokens, more than this engine's limit of {limit}",
                param=param,
                code="context_length_exceeded",
            )
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in token_ids):
            raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size})", param=param)
        return prompt


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
    """The OpenAI shapes of one request's answer (completion or chat, whole or streamed)."""

    def __init__(
        self,
        tokenizer,
        model_name: str,
        request_id: str,
        chat: bool,
        logprobs: int | None,
        return_token_ids: bool = False,
        prompt_echo: PromptEcho | None = None,
    ):
        self.tokenizer = tokenizer
        self.prompt_echo = prompt_echo  # echo and prompt_logprobs (prompt_echo.py); None: neither
        self.chat = chat
        self.num_logprobs = logprobs
        self.return_token_ids = return_token_ids  # each choice (or chunk) also lists its tokens
        self.head = {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        self.chunk_head = {**self.head, "object": "chat.completion.chunk"} if chat else self.head
        self._started: set[int] = set()  # chat choices whose first chunk (with the role) is out

    def logprobs(self, delta: Delta):
        if self.num_logprobs is None or delta.logprobs is None:
            return None
        if self.chat:
            return protocol.chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, self.num_logprobs)
        return protocol.completion_logprobs(
            self.tokenizer, delta.token_ids, delta.logprobs, self.num_logprobs, delta.text_offset
        )

    def chunk(self, d: Delta) -> dict:
        """One streamed chunk."""
        if not self.chat:
            return {**self.chunk_head, "choices": [self._completion_choice(d)]}
        delta: dict = {} if d.index in self._started else {"role": "assistant"}
        self._started.add(d.index)
        if d.text or not d.finish_reason:
            delta["content"] = d.text
        return {
            **self.chunk_head,
            "choices": [
                {
                    "index": d.index,
                    "delta": delta,
                    "logprobs": self.logprobs(d),
                    "finish_reason": d.finish_reason,
                    **self._ids(d),
                }
            ],
        }

    def body(self, finals: list[Delta], usage: dict) -> dict:
        """The whole answer, from each choice's complete text (``finals``)."""
        finals = sorted(finals, key=lambda d: d.index)
        if self.chat:
            choices = [
                {
                    "index": d.index,
                    "message": {"role": "assistant", "content": d.text},
                    "logprobs": self.logprobs(d),
                    "finish_reason": d.finish_reason,
                    **self._ids(d),
                }
                for d in finals
            ]
        else:
            choices = [self._completion_choice(d) for d in finals]
        if self.prompt_echo is None:
            return {**self.head, "choices": choices, "usage": usage}
        body = {**self.head, "choices": choices, "usage": self.prompt_echo.usage(usage)}
        if self.chat:
            self.prompt_echo.chat_body(body)
        return body

    def usage_chunk(self, usage: dict) -> dict:
        if self.prompt_echo is not None:
            usage = self.prompt_echo.usage(usage)
        return {**self.chunk_head, "choices": [], "usage": usage}

    def _completion_choice(self, d: Delta) -> dict:
        choice = {
            "index": d.index,
            "text": d.text,
            "logprobs": self.logprobs(d),
            "finish_reason": d.finish_reason,
            **self._ids(d),
        }
        if self.prompt_echo is not None:
            self.prompt_echo.completion_choice(choice)
        return choice

    def _ids(self, d: Delta) -> dict:
        return {"token_ids": list(d.token_ids)} if self.return_token_ids else {}


def sse_event(payload: dict) -> bytes:
    return b"data: " + _json_encode(payload) + b"\n\n"


def sse_response(
    chunks: AsyncIterator[dict],
    fmt: ResponseFormat,
    usage: Callable[[], dict],
    include_usage: bool,
    on_error: Callable[[APIError], None],
    cleanup: Callable[[], None],
) -> StreamingResponse:
    """Stream ``chunks``; an ``APIError`` raised mid-stream travels as an error event (the
    headers are gone). ``cleanup`` runs however the stream ends (client gone included)."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
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


def http_server(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    """The uvicorn server of a front end; its own logging only when pdinfer's is at DEBUG."""
    debug = logging.getLogger("pdinfer").getEffectiveLevel() <= logging.DEBUG
    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=5, log_level="info" if debug else "warning"
    )
    return uvicorn.Server(config)
