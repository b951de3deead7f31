"""What every OpenAI-compatible front end shares: one engine's server (``api_server``) and the
P/D router (``router``). A client sees the same shapes from both.

- ``check_api_key`` / ``install_error_handlers``: auth and OpenAI's error shape for 4xx;
- ``PromptBuilder``: text -> token ids, the chat template, the context-length check;
- ``DeltaTracker``: cumulative choice state -> what is new since the last chunk;
- ``ResponseFormat``: the completion / chat bodies and stream chunks of one request;
- ``sse_response``: chunks -> ``data: ...`` events, usage, an error event, ``[DONE]``;
- ``run_unless_disconnected``: a non-streamed answer whose client goes away is cancelled;
- ``http_server``: the uvicorn server both run (uvicorn's access log only at DEBUG).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from pdinfer.serving import protocol
from pdinfer.serving.protocol import APIError, ChatCompletionRequest, bad_request

_JSON_SEP = (",", ":")
_DISCONNECT_POLL_S = 0.5


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")


def install_error_handlers(app: FastAPI, errors_counter) -> None:
    """``APIError`` and pydantic's validation errors answer in OpenAI's shape, counted by kind."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        errors_counter.labels(kind=exc.code or exc.type).inc()
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await on_api_error(request, protocol.validation_error(exc.errors()))


class PromptBuilder:
    """Engine prompts (``{"prompt"?, "prompt_token_ids"}``) from what a client sent.

    ``prompt_limit`` None skips the length check; ``vocab_size`` None leaves the token-id range
    check to the engine.
    """

    def __init__(self, tokenizer, prompt_limit: int | None, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.prompt_limit = prompt_limit
        self.vocab_size = vocab_size

    def completion(self, prompt: str | list[int], param: str = "prompt") -> dict:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", param=param)
            if self.tokenizer is None:
                raise bad_request("this model has no tokenizer: send token ids", param=param)
            token_ids = self.tokenizer(prompt).input_ids
            return self.checked({"prompt": prompt, "prompt_token_ids": token_ids}, param)
        return self.checked({"prompt_token_ids": list(prompt)}, param)

    def chat(self, body: ChatCompletionRequest) -> dict:
        tokenizer = self.tokenizer
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


@dataclass
class Delta:
    """What one choice gained since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    text_offset: int


class DeltaTracker:
    """Turns each choice's cumulative state into deltas; None when there is nothing to show yet
    (e.g. half of a multi-byte character). With ``token_ids`` (the client asked for
    ``return_token_ids``) every new token is something to show, text or not."""

    def __init__(self, token_ids: bool = False) -> None:
        self._seen: dict[int, tuple[int, int, bool]] = {}  # choice -> (chars, tokens, finished)
        self._token_ids = token_ids

    def update(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
        finish_reason: str | None,
    ) -> Delta | None:
        num_chars, num_tokens, done = self._seen.get(index, (0, 0, False))
        if done:
            return None
        new_text = text[num_chars:] if len(text) >= num_chars else ""
        new_ids = token_ids[num_tokens:]
        new_logprobs = logprobs[num_tokens:] if logprobs is not None else None
        if not (new_text or finish_reason or (new_ids and (new_logprobs or self._token_ids))):
            return None
        self._seen[index] = (max(num_chars, len(text)), len(token_ids), finish_reason is not None)
        return Delta(index, new_text, new_ids, new_logprobs, finish_reason, num_chars)


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
    ):
        self.tokenizer = tokenizer
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
        return {**self.head, "choices": choices, "usage": usage}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.chunk_head, "choices": [], "usage": usage}

    def _completion_choice(self, d: Delta) -> dict:
        return {
            "index": d.index,
            "text": d.text,
            "logprobs": self.logprobs(d),
            "finish_reason": d.finish_reason,
            **self._ids(d),
        }

    def _ids(self, d: Delta) -> dict:
        return {"token_ids": list(d.token_ids)} if self.return_token_ids else {}


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=_JSON_SEP)}\n\n"


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

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse_event(chunk)
            if include_usage:
                yield f"data: {json.dumps(fmt.usage_chunk(usage()))}\n\n"
        except APIError as exc:
            on_error(exc)
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            cleanup()
            with contextlib.suppress(Exception):
                await chunks.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

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
